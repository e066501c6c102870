"""What a model costs in memory, read from its architecture alone: nothing is downloaded, no weight
is allocated.

Every model is built on the meta device from its config files (a diffusers pipeline's
model_index.json and each component's config.json, a transformers config.json), found as
common/architectures.py finds them: a local folder, the local Hugging Face cache, or the copies
shipped in configs/architectures/ (so the presets' real models are known without the hub);
`tiny:<kind>` is built locally as everywhere else, and `random:<name>` is planned as `<name>`. Counts are of parameters and persistent buffers: what a checkpoint
holds (SD3's positional embedding is a buffer of 226 M values).

Activations are measured, not fitted: one forward pass of the real module on the meta device, at
the real token counts of one sample, traced operation by operation (`Trace`). Every tensor
autograd keeps for the backward pass is recorded (`torch.autograd.graph.saved_tensors_hooks`, each
storage once, weights excluded) under the same `requires_grad` as training (all parameters for a
full fine-tune, only the adapter under LoRA, so a frozen linear keeps no input), and at each
operation what is live: what has been kept so far plus the operation's own inputs and outputs.
Attention is taken as the fused kernel a GPU runs (flash or memory-efficient attention keep q, k,
v, the output and its log-sum-exp, never the score matrix; the meta device would otherwise trace
the unfused math). Each kept tensor is attributed to the repeated block it was saved in
(experts/parallel.py `blocks`, the unit activation checkpointing recomputes), so the same pass
gives the update's peak both without checkpointing (the pass's largest live total) and with it
(every block's inputs, plus the largest live total within one block as it is recomputed). The
backward pass is taken to peak where the forward does: it visits the same operations in reverse,
each with its gradients in place of its outputs while everything saved before it is still kept.
A pass without gradients (sampling, the reference, a VAE decode, a reward model) is measured as
its working set: the largest operation's inputs and outputs, plus the largest block input held
beside them (the residual stream). The same trace counts a pass's FLOPs by torch's own formulas
(torch.utils.flop_counter: matrix products and convolutions), attention apart (its two products,
q·kᵀ and the scores times v, grow with the square of the tokens), for the plan's time model.
bench/plans.py measures the estimate against the update's
peak memory on CPU. Each measurement is kept once made (experts/measurements.py), so a model is
traced once, not at every plan.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from common.architectures import UnknownModel, config_folder, index_class, weighted_components
from experts.measurements import remembered

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
META = torch.device("meta")
TRACING = ["experts.memory", "experts.parallel"]  # the code every measurement depends on (experts/measurements.py)


def architecture_inputs(model_json: str) -> dict:
    """A model section's settings a measurement depends on: all but where the model is read from
    (its config files are keyed themselves, so a local copy or `random:` shares the hub id's)."""
    return {k: v for k, v in json.loads(model_json).items() if k not in ("path", "revision")}


# --- models on the meta device ---------------------------------------------------------------------


def in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` cast to `dtype` (on the meta device nothing is copied; diffusers' notice that a cast
    after loading may differ from loading in the dtype does not apply to a count and is silenced)."""
    from diffusers.utils import logging as diffusers_logging
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        return module.to(dtype)
    finally:
        diffusers_logging.set_verbosity(level)


def meta_component(folder: Path, library: str, cls: str) -> nn.Module:
    """A diffusers or transformers class from the config in `folder`, on the meta device."""
    found = getattr(importlib.import_module(library), cls)
    with META:
        if library == "diffusers":
            return found.from_config(found.load_config(folder))
        return found._from_config(transformers_config(folder))


def transformers_config(folder: Path):
    """The transformers config in `folder`; UnknownModel where transformers cannot read it (a model
    type it does not know): the plan cannot size it, and loading it says why, naming its key."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as e:
        raise UnknownModel(f"transformers cannot read the config in '{folder}' ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


def meta_causal_lm(folder: Path) -> nn.Module:
    """The causal LM of the config in `folder` (as AutoModelForCausalLM loads it), on the meta device."""
    from transformers import AutoModelForCausalLM
    config = transformers_config(folder)
    with META:
        return AutoModelForCausalLM.from_config(config)


def meta_pretrained(folder: Path) -> nn.Module:
    """A transformers model of the class its config.json names, on the meta device."""
    config = transformers_config(folder)
    name = (config.architectures or ["AutoModel"])[0]
    cls = getattr(importlib.import_module("transformers"), name, None)
    if cls is None:
        raise UnknownModel(f"'{folder}' names the architecture {name}, which transformers does not have")
    with META:
        return cls._from_config(config)


def count(module: nn.Module) -> int:
    """Parameters and persistent buffers: what the module's checkpoint holds."""
    persistent = sum(b.numel() for name, b in module.named_buffers()
                     if name.rsplit(".", 1)[-1] not in getattr(_owner(module, name), "_non_persistent_buffers_set", ()))
    return sum(p.numel() for p in module.parameters()) + persistent


def _owner(module: nn.Module, name: str) -> nn.Module:
    return module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module


def is_diffusers_model(module: nn.Module) -> bool:
    from diffusers import ModelMixin
    return isinstance(module, ModelMixin)


def add_lora(module: nn.Module, lora, targets) -> int:
    """Attach `lora` (a LoraConfig section) with peft, as the expert does; the adapter's count."""
    from peft import LoraConfig
    before = sum(p.numel() for p in module.parameters())
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules or targets)
    with META:  # the adapter on the meta device too (no initialisation runs)
        if is_diffusers_model(module):
            module.add_adapter(config)  # diffusers' own, as the generator attaches it
        else:
            from peft import inject_adapter_in_model
            inject_adapter_in_model(config, module)
    for name, p in module.named_parameters():
        p.requires_grad_("lora_" in name)
    return sum(p.numel() for p in module.parameters()) - before


# --- activations ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Activations:
    """Bytes of one sample's forward pass with gradients, from a trace of what is live at each
    operation: what autograd has kept so far (for the backward pass) plus the operation's own
    inputs and outputs not already kept. `outside` and `blocks` are what the pass keeps outside
    the repeated blocks and in them; `block_inputs` the blocks' inputs (what activation
    checkpointing keeps instead); `peak` the largest live total over the pass; `block_peak` the
    largest over one block's operations of what that block kept so far plus the operation's (one
    block recomputed under checkpointing). The backward pass goes through the same operations in
    reverse, each with its gradients in place of its outputs while everything saved before it is
    still kept, so its peak is taken as the forward's."""
    outside: int
    block_inputs: int
    blocks: int
    peak: int
    block_peak: int

    def kept(self, batch: int, checkpointing: bool) -> int:
        """What a forward pass of `batch` samples keeps until its backward pass."""
        return batch * (self.outside + (self.block_inputs if checkpointing else self.blocks))

    def update_peak(self, batch: int, checkpointing: bool, no_grad_pass: int = 0) -> int:
        """The most a forward and backward pass of `batch` samples holds at once; `no_grad_pass`:
        the working set of a pass without gradients run while the forward's tensors are kept (the
        reference's, for the KL), per sample."""
        kept = self.kept(1, checkpointing)
        inner = kept + self.block_peak if checkpointing else self.peak
        return batch * max(inner, kept + no_grad_pass)


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention as a fused kernel: it keeps q, k, v, out and the log-sum-exp."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes an additive mask
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    return FUSED_ATTENTION(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


FUSED_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@contextlib.contextmanager
def fused_kernels():
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fused_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Flops:
    """One forward pass's FLOPs: its matrix products and convolutions outside attention (`linear`,
    about 2 x parameters x tokens), and attention's two products (`attention`)."""
    linear: int
    attention: int


@dataclass(frozen=True)
class Pass:
    """One forward pass of one sample: with gradients, its activations; without, its working set
    (the largest operation's inputs and outputs plus the largest block input held beside them);
    its FLOPs either way."""
    kept: Activations
    working_set: int
    flops: Flops


class Trace(TorchDispatchMode):
    """Follows a forward pass on the meta device: every tensor autograd saves (each storage once,
    weights aside) attributed to the repeated block it was saved in, and at each operation what is
    live (see `Activations`)."""

    def __init__(self, weights: set, n_blocks: int):
        super().__init__()
        self.weights, self.saved = weights, set()
        self.outside, self.per_block, self.inputs = 0, [0] * n_blocks, 0
        self.block, self.peak, self.block_peak, self.largest_op, self.held = None, 0, 0, 0, 0
        self.linear_flops, self.attention_flops = 0, 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.weights and key not in self.saved:
            self.saved.add(key)
            if self.block is None:
                self.outside += nbytes(t)
            else:
                self.per_block[self.block] += nbytes(t)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is FUSED_ATTENTION:
            self.attention_flops += sdpa_flop_count(*(a.shape for a in args[:3]))
        elif func.overloadpacket in flop_registry:
            self.linear_flops += flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
        tensors = {storage_key(t): t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)}
        tensors = {k: t for k, t in tensors.items() if k not in self.weights}
        self.largest_op = max(self.largest_op, sum(map(nbytes, tensors.values())))
        transient = sum(nbytes(t) for k, t in tensors.items() if k not in self.saved)
        self.peak = max(self.peak, self.outside + sum(self.per_block) + transient)
        if self.block is not None:
            self.block_peak = max(self.block_peak, self.per_block[self.block] + transient)
        return out

    def enter(self, i: int):
        def hook(module, args, kwargs):
            self.block = i
            size = sum(nbytes(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                       and a.is_floating_point() and storage_key(a) not in self.weights)
            self.inputs += size
            self.held = max(self.held, size)
        return hook

    def leave(self, module, args, output):
        self.block = None


def measure(model: nn.Module, run, grad: bool = True) -> Pass:
    """`run()`, one forward pass of `model` on meta tensors of one sample, traced (with gradients
    if `grad`, else without)."""
    from experts.parallel import blocks  # torch.distributed's import (a second) only when tracing
    units = blocks(model)
    weights = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    trace = Trace(weights, len(units))
    handles = [h for i, u in enumerate(units) for h in (u.register_forward_pre_hook(trace.enter(i), with_kwargs=True),
                                                          u.register_forward_hook(trace.leave))]
    saving = torch.autograd.graph.saved_tensors_hooks(trace.pack, lambda t: t) if grad else torch.no_grad()
    try:
        with fused_kernels(), saving, trace:
            run()
    finally:
        for h in handles:
            h.remove()
    kept = Activations(trace.outside, trace.inputs, sum(trace.per_block), trace.peak, trace.block_peak)
    return Pass(kept, trace.largest_op + trace.held, Flops(trace.linear_flops, trace.attention_flops))


# --- the generator ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeneratorArchitecture:
    """The generator of a config, per sample: its transformer(s) (Wan2.2-A14B's two together, and each
    one's count), its frozen front end (text encoders and VAE) and adapter by parameter count, its
    latent grid and token counts, and what one sample costs through the transformer (trained and
    sampled), the VAE and the text cache."""
    family: str
    transformer: int
    largest_block: int
    lora: int
    per_transformer: dict[str, tuple[int, int]]  # each trained transformer's (parameters, adapter), by its name
    frontend: dict[str, int]
    frontend_width: dict[str, int]  # bytes per parameter of each front-end part (the model's dtype, or float32)
    latent_shape: tuple[int, ...]
    image_tokens: int
    text_tokens: int
    train: Activations
    sample_working_set: int
    decode_working_set: int
    text_features: int
    flops: Flops  # one sample's pass through one transformer (Wan2.2-A14B's two are alike)

    @property
    def latent_numel(self) -> int:
        return math.prod(self.latent_shape)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@functools.lru_cache(maxsize=32)
def _generator(path: str, revision: str | None, model_json: str, image_size: int, *, image_width: int | None,
               num_frames: int | None) -> GeneratorArchitecture:
    from experts.families import FAMILIES
    folder = config_folder(path, revision)
    family = index_class(folder)
    if family not in FAMILIES:
        raise UnknownModel(f"'{path}' holds a {family}; the generator families supported are {', '.join(FAMILIES)}")
    size = f"{image_size}x{image_width or image_size}" + (f"x{num_frames}" if num_frames else "")
    return remembered("generator", GeneratorArchitecture, folder=folder,
                      inputs={"model": architecture_inputs(model_json), "image_size": image_size,
                              "image_width": image_width, "num_frames": num_frames},
                      modules=[*TRACING, "experts.flow_family", FAMILIES[family].module], what=f"generator {path} at {size}",
                      trace=lambda: _trace_generator(folder, family, model_json=model_json, image_size=image_size,
                                                     image_width=image_width, num_frames=num_frames))


def _trace_generator(folder: Path, family: str, *, model_json: str, image_size: int, image_width: int | None,
                     num_frames: int | None) -> GeneratorArchitecture:
    from experts.families import FAMILIES
    from experts.generator import DiffusersFlowConfig
    m = DiffusersFlowConfig.model_validate_json(model_json)
    module = importlib.import_module(FAMILIES[family].module)
    parts = weighted_components(folder)
    built = {name: meta_component(folder / name, *spec) for name, spec in parts.items()}
    transformer = built.pop("transformer")
    trained = {"transformer": transformer,  # Wan2.2-A14B: both
               **({"transformer_2": built.pop("transformer_2")} if "transformer_2" in built else {})}
    dtype = dtype_of(m.dtype)
    for t in trained.values():
        in_dtype(t, dtype)
    counts = {name: count(t) for name, t in trained.items()}
    from experts.parallel import blocks
    largest = max((count(b) for b in blocks(transformer)), default=count(transformer))
    loras = {name: add_lora(t, m.lora, module.Velocity.LORA_TARGETS) if m.lora else 0 for name, t in trained.items()}
    per_transformer = {name: (counts[name], loras[name]) for name in trained}
    size, lora = sum(counts.values()), sum(loras.values())
    if not m.lora:
        transformer.requires_grad_(True)
    velocity = module.Velocity.__new__(module.Velocity)  # the family's own forward, on the meta transformer
    nn.Module.__init__(velocity)
    velocity.transformer, velocity.spec = transformer, m
    frontend = module.FrontEnd.__new__(module.FrontEnd)  # the family's own latent grid, from its meta VAE
    frontend.config = SimpleNamespace(task=SimpleNamespace(image_size=image_size, image_width=image_width,
                                                           num_frames=num_frames))
    frontend.spec, frontend.vae = m, built["vae"]
    latent_shape = tuple(frontend.latent_grid(image_size))
    shapes, text_tokens = module.Velocity.conditioning(dict(transformer.config), m)

    def inputs(batch: int):
        x = torch.empty((batch, *latent_shape), device=META)
        cond = {k: torch.empty((batch, *shape), device=META, dtype=dt or dtype) for k, (shape, dt) in shapes.items()}
        return x, torch.empty(batch, device=META), cond
    one = measure(transformer, lambda: velocity.velocity(*inputs(1)))
    widths = {name: torch.float32 if name in module.FrontEnd.FLOAT32 else dtype for name in built}
    vae = in_dtype(built["vae"], widths["vae"])
    decode = measure(vae, lambda: frontend.decode(torch.empty((1, *latent_shape), device=META, dtype=dtype)),
                     grad=False).working_set
    features = sum(math.prod(shape) * (torch.tensor([], dtype=dt or dtype).element_size())
                   for shape, dt in shapes.values())
    image_tokens = transformer_image_tokens(family, latent_shape)
    return GeneratorArchitecture(family, size, largest, lora, per_transformer,
                                 {name: count(part) for name, part in built.items()},
                                 {name: d.itemsize for name, d in widths.items()},
                                 latent_shape,
                                 image_tokens, text_tokens, one.kept, one.working_set, decode, features, one.flops)


def transformer_image_tokens(family: str, latent_shape: tuple[int, ...]) -> int:
    """Image tokens the transformer reads: the latent grid's cells, after its 2x2 packing or patching
    (of each latent frame, for video)."""
    *_, h, w = latent_shape
    frames = latent_shape[1] if len(latent_shape) == 4 else 1
    if family == "Flux2KleinPipeline":
        return h * w  # each cell of the patchified grid is a token
    return frames * (h // 2) * (w // 2)  # SD3's 2x2 patches, FLUX.1's and Qwen-Image's 2x2 packing, Wan's (1, 2, 2)


def generator_architecture(model, image_size: int, image_width: int | None = None,
                           num_frames: int | None = None) -> GeneratorArchitecture:
    """`model` (a DiffusersFlowConfig section) measured at images `image_size` on a side (`image_size`
    high and `image_width` wide where set), or at clips of `num_frames` such frames."""
    return _generator(model.path, model.revision, model.model_dump_json(), image_size, image_width=image_width,
                      num_frames=num_frames)


# --- causal LMs (refiners) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LMArchitecture:
    """A refiner's LM: its count, adapter, and per token what training keeps and sampling caches."""
    params: int
    lora: int
    vocab: int
    train_per_token: Activations
    kv_per_token: int
    working_set_per_token: int


@functools.lru_cache(maxsize=16)
def _lm(path: str, revision: str | None, model_json: str) -> LMArchitecture:
    folder = config_folder(path, revision)
    return remembered("lm", LMArchitecture, folder=folder, inputs={"model": architecture_inputs(model_json)},
                      modules=[*TRACING, "experts.hf_refiner"], what=f"refiner {path}",
                      trace=lambda: _trace_lm(folder, model_json))


def _trace_lm(folder: Path, model_json: str) -> LMArchitecture:
    from experts.hf_refiner import LORA_TARGETS
    from experts.refiner import HFCausalLMConfig
    m = HFCausalLMConfig.model_validate_json(model_json)
    lm = meta_causal_lm(folder).to(dtype_of(m.dtype))
    size = count(lm)
    lora = add_lora(lm, m.lora, LORA_TARGETS) if m.lora else 0
    if not m.lora:
        lm.requires_grad_(True)
    c = lm.config
    tokens = 64
    ids = torch.zeros((1, tokens), dtype=torch.long, device=META)
    body = lm.get_decoder() if hasattr(lm, "get_decoder") else lm
    one = measure(body, lambda: body(input_ids=ids))
    train = one.kept
    per_token = Activations(*(v // tokens for v in (train.outside, train.block_inputs, train.blocks, train.peak,
                                                     train.block_peak)))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim
    sample = one.working_set // tokens
    return LMArchitecture(size, lora, c.vocab_size, per_token, kv * DTYPE_BYTES[m.dtype], sample)


def lm_architecture(model) -> LMArchitecture:
    """`model` (an HFCausalLMConfig section) measured per token."""
    return _lm(model.path, model.revision, model.model_dump_json())


# --- reward models ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardArchitecture:
    """A reward model: its count and one image's working set through its vision side."""
    params: int
    per_image: int


@functools.lru_cache(maxsize=16)
def reward_architecture(path: str, dtype: str, revision: str | None = None) -> RewardArchitecture:
    """A reward model (a transformers checkpoint) in `dtype`: its count and one image's working set."""
    folder = config_folder(path, revision)
    return remembered("reward", RewardArchitecture, folder=folder, inputs={"dtype": dtype}, modules=TRACING,
                      what=f"reward model {path} in {dtype}", trace=lambda: _trace_reward(folder, dtype))


def _trace_reward(folder: Path, dtype: str) -> RewardArchitecture:
    model = meta_pretrained(folder).to(dtype_of(dtype))
    vision = getattr(model, "vision_model", None) or getattr(model, "encoder", None) \
        or getattr(getattr(model, "owlv2", None), "vision_model", None) or getattr(model, "visual", None)
    config = getattr(vision, "config", None)
    side = getattr(config, "image_size", None)
    if vision is None or side is None:
        return RewardArchitecture(count(model), 0)
    pixels = torch.empty((1, 3, side, side), device=META, dtype=dtype_of(dtype))
    return RewardArchitecture(count(model), measure(vision, lambda: vision(pixel_values=pixels), grad=False).working_set)
