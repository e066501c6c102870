"""A diffusers flow-matching generator, SD3 family (`experts.generator.model.kind=diffusers_flow`).

The generator expert trains the transformer (`SD3Velocity`: the velocity v(x, sigma | text), with
classifier-free guidance when `guidance_scale` > 1, and an optional LoRA adapter). A rollout worker
also holds what stays frozen (`SD3FrontEnd`): the text encoders (CLIP, and T5 where the model has
one) behind a cache keyed by the composed text, the VAE that decodes latents, and the scheduler's
shifted sigmas. Components load as the model's `model_index.json` names them, from a local folder
or a hub id.
"""
from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace

import torch
from torch import nn

from experts.hf_refiner import DTYPES
from experts.hub import local_model
from experts.text_encoder import CacheStats

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the joint attention's projections


def load_index(path: str) -> dict:
    from diffusers import DiffusionPipeline
    return DiffusionPipeline.load_config(path)


def component(path: str, index: dict, name: str, dtype: torch.dtype | None = None):
    """The pipeline component `name` (None where the model has none, e.g. SD3 without T5)."""
    library, cls = index.get(name) or (None, None)
    if cls is None:
        return None
    kwargs = {"subfolder": name}
    if dtype is not None and name.startswith(("text_encoder", "transformer", "vae")):
        kwargs["dtype" if library == "transformers" else "torch_dtype"] = dtype
    return getattr(importlib.import_module(library), cls).from_pretrained(path, **kwargs)


class SD3Velocity(nn.Module):
    def __init__(self, spec, seed: int):
        super().__init__()
        m = spec.model
        self.spec = m
        path = local_model(m.path)
        self.transformer = component(path, load_index(path), "transformer", DTYPES[m.dtype])
        if m.lora:
            from peft import LoraConfig
            torch.manual_seed(seed)  # the adapter's initialisation, identical wherever it is built
            self.transformer.add_adapter(LoraConfig(r=m.lora.r, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
                                                    target_modules=m.lora.target_modules or LORA_TARGETS,
                                                    init_lora_weights=True))

    @property
    def lora(self) -> bool:
        return self.spec.lora is not None

    def velocity(self, x, sigma, embeds, pooled) -> torch.Tensor:
        dtype = self.transformer.dtype
        out = self.transformer(hidden_states=x.to(dtype), timestep=(sigma * 1000.0).to(dtype),
                               encoder_hidden_states=embeds.to(dtype), pooled_projections=pooled.to(dtype)).sample
        return out.float()

    def forward(self, x, sigma, prompt_embeds, pooled, negative_embeds=None, negative_pooled=None) -> torch.Tensor:
        """v(x, sigma | text); with guidance, v_uncond + g (v_cond - v_uncond) against the empty prompt."""
        g = self.spec.guidance_scale
        if g == 1.0 or negative_embeds is None:
            return self.velocity(x, sigma, prompt_embeds, pooled)
        both = self.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([negative_embeds, prompt_embeds]),
                             torch.cat([negative_pooled, pooled]))
        uncond, cond = both.chunk(2)
        return uncond + g * (cond - uncond)

    @staticmethod
    def merge_conditions(conds: list[dict]) -> dict[str, torch.Tensor]:
        """Conditioning of several rollout shards as one batch (fixed-length embeddings: joined)."""
        return {k: torch.cat([torch.as_tensor(c[k]) for c in conds]) for k in conds[0]}

    def synced_state(self) -> dict[str, torch.Tensor]:
        state = self.state_dict()
        return {k: v for k, v in state.items() if "lora_" in k} if self.lora else state

    @contextlib.contextmanager
    def adapter_disabled(self):
        """A context in which the transformer is its frozen base (LoRA): the reference, without a copy."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()


class SD3FrontEnd:
    """Text encoders (cached), VAE and scheduler of an SD3-family model, frozen."""

    def __init__(self, config, device: torch.device):
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
        m = config.experts.generator.model
        self.config, self.spec = config, m
        path = local_model(m.path)
        index = load_index(path)
        dtype = DTYPES[m.dtype]
        parts = {name: component(path, index, name, dtype) for name in (
            "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3",
            "tokenizer_3")}
        self.pipeline = StableDiffusion3Pipeline(transformer=None, **parts)
        # the pipeline's prompt encoding reads the transformer's config (the width of the zeros that
        # stand in for T5 when a model has none); the worker's transformer is the synced expert's
        transformer_config = SD3Transformer2DModel.load_config(path, subfolder="transformer")
        self.pipeline.transformer = SimpleNamespace(config=SimpleNamespace(**transformer_config))
        for module in (parts["vae"], parts["text_encoder"], parts["text_encoder_2"], parts["text_encoder_3"]):
            if module is not None:
                module.requires_grad_(False).eval().to(device)
        self.vae, self.scheduler = parts["vae"], parts["scheduler"]
        factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        if config.task.image_size % factor:
            raise ValueError(f"task.image_size={config.task.image_size} is not a multiple of the VAE's "
                             f"downsampling ({factor}) of experts.generator.model.path={m.path}")
        side = config.task.image_size // factor
        self.latent_shape = (self.vae.config.latent_channels, side, side)
        self.cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stats = CacheStats()
        self.version = 0  # the text encoders never train
        self.device = device

    def compose(self, prompt, refs: dict, drop: str | None) -> str:
        """The prompt, then each refiner's refinement (except `drop`), as one text."""
        order = self.config.experts.active_refiners()
        return ", ".join([prompt.text, *[refs[e].text for e in order if e in refs and e != drop and refs[e].text]])

    @torch.no_grad()
    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = list(dict.fromkeys(t for t in texts if t not in self.cache))
        self.stats.count(texts, self.cache)
        if missing:
            embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompt=missing, prompt_2=None, prompt_3=None, device=self.device,
                do_classifier_free_guidance=False, max_sequence_length=self.spec.max_sequence_length)
            for t, e, p in zip(missing, embeds.float(), pooled.float()):
                self.cache[t] = (e, p)
        return torch.stack([self.cache[t][0] for t in texts]), torch.stack([self.cache[t][1] for t in texts])

    def condition(self, prompts: list, refinements: list[dict], drop: str | None = None) -> dict[str, torch.Tensor]:
        embeds, pooled = self.encode([self.compose(p, r, drop) for p, r in zip(prompts, refinements)])
        cond = {"prompt_embeds": embeds, "pooled": pooled}
        if self.spec.guidance_scale != 1.0:
            negative, negative_pooled = self.encode([""])
            cond.update(negative_embeds=negative.expand_as(embeds).contiguous(),
                        negative_pooled=negative_pooled.expand_as(pooled).contiguous())
        return cond

    def sigmas(self, steps: int) -> torch.Tensor:
        """The scheduler's sigmas (shifted as the model was trained), from 1 down to 0."""
        self.scheduler.set_timesteps(steps)
        return self.scheduler.sigmas.float().clone()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] from the VAE."""
        scaled = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        return self.vae.decode(scaled.to(self.vae.dtype)).sample.float().clamp(-1, 1)

    def take_stats(self) -> tuple[int, int]:
        return self.stats.take()
