"""`jointrl plan`: the memory plan of a config on a target cluster, from its models' real architectures.

Each actor of the run (every rank of every expert, every rollout worker, every reward actor, the
driver and the weight-sync actor) is given its bytes by part, from the models measured on the meta
device (experts/memory.py), and the actors that ask for a GPU are placed on the target's GPUs:
each on a GPU of its own while there are GPUs enough, several on one GPU only where their parts
together fit it (never two ranks of one expert: NCCL refuses two ranks on one device). A config
that cannot fit raises `PlanError` naming the actor, its largest part, the shortfall and what
would make it fit. `plan_for(config, target)` is the API (`Plan`: per actor `gpus`, `params`,
`bytes`; per GPU its actors and bytes).

Conventions counted (those the experts implement, stated once here):
- Training (experts/precision.py): trained parameters kept in fp32 with fp32 gradients and AdamW's
  two fp32 moments; a full fine-tune of a bf16 model computes through bf16 copies of them made once
  per update; a LoRA adapter is fp32 and computes as it is; frozen parts (the reference copy of a
  full fine-tune, the base under LoRA) stay in the model's dtype. Under fsdp parameters,
  gradients, moments and the reference are sharded over the ranks and gathered a block at a time
  in the model's dtype (two blocks: one computing, one prefetched), or the whole model with
  `defer_gradient_sync`.
- The generator's update: `experts.generator.micro_batch` transitions per backward pass (None:
  one step of every sample of the rank's share), doubled through the transformer by classifier-
  free guidance when `train_cfg` and guidance_scale > 1; its activations are the most its forward
  and backward pass hold at once (experts/memory.py `Activations.update_peak`), with the
  reference's no-grad pass (kl_beta > 0) run while the forward's tensors are kept. Each rank
  receives the step's trajectories (experts/trajectories.py): the states x_t and x_{t+1} of every
  trained step (the SDE window's, less the last without `train_final_step`) in fp32, the
  log-probs, and the conditioning in the model's dtype with the empty prompt's once.
- The refiner's update: `experts.refiner_<i>.micro_batch` sequences per backward pass (None: the
  rank's share), logits (fp32) only at the generated tokens; sequences are PROMPT_TOKENS of chat
  context plus `max_new_tokens`.
- Under `cluster.layout=colocated` there is no rollout worker: each expert rank rolls out its share
  with the weights it trains and holds the rest of what a worker would for its own model
  (`colocated_rank`).
- A rollout worker: inference copies of every expert in the model's dtype, the generator's frozen
  front end (text encoders and VAE), the text-feature cache bound (`rollout.text_cache_mb`), and
  one chunk of `rollout.batch_size` samples (None: its whole share) at a time: its refiners'
  sampling (KV cache and logits), its transformer passes (doubled by guidance), its VAE decodes
  and the reward models scored in the worker; the states of the chunk's trajectories. Phases run
  one after another, so the chunk's working set is the largest of them. A refiner served by vLLM
  (`engine: vllm`) holds its weights in the engine's dtype and the KV cache the engine reserves:
  `vllm.kv_cache_gib` when set; else the engine takes `vllm.gpu_memory_utilization` of its device as
  it starts (of the host's memory on CPU, this machine's where the plan is made), each engine of a
  worker its own share, or what the chunk's prompts need at `vllm.max_model_len` if that is more
  (`reserve_engines`).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from cluster.layouts import LAYOUTS
from common.config import SettingError
from driver.config import Config
from experts.generator import GeneratorConfig, transformer_part
from experts.memory import DTYPE_BYTES, UnknownModel, generator_architecture, lm_architecture, reward_architecture

GB = 1e9
MIB = 2 ** 20
PROMPT_TOKENS = 128  # chat template, system prompt and user prompt of a refiner's context (a bound)
TINY_ACTIVATION = 4 * 12  # the tiny kinds: fp32 bytes kept per token, width and layer (a transformer block's ~12 tensors)


class PlanError(SettingError):
    """The config cannot fit its target (or the target has no GPU for it); exit status 2."""


class UnknownArchitecture(PlanError):
    """A model of the config whose config files are not at hand (common/architectures.py `config_folder`)."""


@dataclass(frozen=True)
class Target:
    """The cluster planned for: `source` says where it came from (flags, a Ray cluster, plan.target)."""
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    headroom_gb: float
    source: str

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable(self) -> int:
        """Bytes of a GPU the plan may fill (its memory less the headroom)."""
        return int((self.gpu_memory_gb - self.headroom_gb) * GB)


@dataclass
class ActorPlan:
    """One actor: where it runs (`gpus`, with its `share` of each), its models' parameter counts
    and its bytes by part; `phase` is when it computes (rollout, update, or always)."""
    name: str
    phase: str
    wants_gpu: bool
    params: dict[str, int]
    bytes: dict[str, int]
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    share: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass(frozen=True)
class GPUPlan:
    """One GPU of the target: its node, the actors on it and their bytes."""
    id: int
    node: int
    actors: list[str]
    bytes: int
    free: int


@dataclass
class Plan:
    target: Target
    actors: dict[str, ActorPlan]
    gpus: list[GPUPlan]
    idle: dict[str, list[int]]
    host_bytes: int

    def gpu_groups(self) -> list[list[tuple[str, float]]]:
        """Per planned GPU that holds actors: (actor name, its share of the GPU); the placement's bundles."""
        return [[(a, self.actors[a].share) for a in g.actors] for g in self.gpus if g.actors]

    def to_json(self) -> dict:
        return {"target": asdict(self.target),
                "actors": {n: {"gpus": a.gpus, "share": a.share, "phase": a.phase, "params": a.params,
                               "bytes": a.bytes, "total": a.total, "notes": a.notes} for n, a in self.actors.items()},
                "gpus": [asdict(g) for g in self.gpus], "idle": self.idle, "host_bytes": self.host_bytes}


# --- the target ------------------------------------------------------------------------------------


def config_target(config: Config, source: str = "plan.target") -> Target:
    t = config.plan.target
    return Target(t.nodes, t.gpus_per_node, t.gpu_memory_gb, config.plan.headroom_gb, source)


def cluster_target(config: Config) -> Target:
    """The connected Ray cluster's GPUs: its nodes with GPUs and their count (Ray does not report a
    GPU's memory: plan.target.gpu_memory_gb is taken)."""
    import ray
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
    per_node = max((int(n["Resources"]["GPU"]) for n in nodes), default=0)
    return Target(max(len(nodes), 1), per_node, config.plan.target.gpu_memory_gb, config.plan.headroom_gb,
                  "the Ray cluster")


def with_flags(target: Target, gpus: int | None, gpu_memory_gb: float | None, nodes: int | None) -> Target:
    """`target` with what `jointrl plan`'s flags set (--gpus is per node)."""
    if gpus is None and gpu_memory_gb is None and nodes is None:
        return target
    return Target(nodes if nodes is not None else target.nodes, gpus if gpus is not None else target.gpus_per_node,
                  gpu_memory_gb if gpu_memory_gb is not None else target.gpu_memory_gb, target.headroom_gb, "flags")


# --- what each actor holds -------------------------------------------------------------------------


def wants_gpu(resources) -> bool:
    return resources.num_gpus > 0


def step_samples(config: Config) -> int:
    return config.trainer.prompts_per_step * config.algorithm.group_size


def refined_samples(config: Config) -> int:
    return config.trainer.prompts_per_step * (config.algorithm.group_size - config.algorithm.num_skip_refinement)


def trained_steps(spec: GeneratorConfig) -> list[int]:
    """The sampling steps the update trains on: the SDE window's, less the last without `train_final_step`."""
    start, end = spec.sde_window or (0, spec.sample_steps)
    return [t for t in range(start, end) if spec.train_final_step or t != spec.sample_steps - 1]


def trajectory_states(spec: GeneratorConfig) -> int:
    """States a trajectory keeps: x_t and x_{t+1} of every trained step (experts/trajectories.py)."""
    return len({s for t in trained_steps(spec) for s in (t, t + 1)})


def guided(spec: GeneratorConfig) -> int:
    """How many times a sample goes through the transformer when sampled: 2 under guidance."""
    return 2 if getattr(spec.model, "guidance_scale", 1.0) > 1.0 else 1


def training_state(trained: int, frozen: int, dtype: str, ranks: int, *, fsdp: bool, lora: bool) -> dict[str, int]:
    """Parameters, gradients, moments and frozen weights of one rank (see the module docstring):
    `frozen` is the reference copy of a full fine-tune, or the base under a LoRA adapter; a full
    fine-tune of a 16-bit model computes through 16-bit copies of its fp32 parameters (an adapter
    is built in fp32; under fsdp the copies are the gathered blocks)."""
    shard, width = (ranks if fsdp else 1), DTYPE_BYTES[dtype]
    copies = {f"{dtype} compute copies": width * trained} if width == 2 and not lora and not fsdp else {}
    return {"trained params (fp32)": 4 * trained // shard, "grads (fp32)": 4 * trained // shard,
            "optimizer (fp32 AdamW moments)": 8 * trained // shard,
            f"{'frozen base' if lora else 'reference copy'} ({dtype})": width * frozen // shard, **copies}


def task_generator(config: Config, model):
    """The architecture of generator `model` at the task's image or clip size."""
    t = config.task
    return generator_architecture(model, t.image_size, t.image_width, t.num_frames)


def generator_expert(config: Config, eid: str, rank: int) -> ActorPlan:
    """A generator-kind expert's rank: the generator, or one of Wan2.2-A14B's two transformers when
    each is an expert of its own (`experts.generator_low`), counted alone."""
    spec = config.expert(eid)
    name = f"expert/{eid}" + (f"/rank{rank}" if rank else "")
    par, m = spec.parallel, spec.model
    ranks, fsdp = par.ranks, par.strategy == "fsdp" and par.ranks > 1
    samples = step_samples(config)
    share = math.ceil(samples / ranks)
    if m.kind in ("tiny_dit", "tiny_video_dit"):
        return tiny_generator_expert(config, name, share)
    arch = task_generator(config, m)
    width = DTYPE_BYTES[m.dtype]
    part = transformer_part(config, eid)
    params, lora = arch.per_transformer["transformer_2" if part == "low" else "transformer"] if part \
        else (arch.transformer, arch.lora)
    trained, frozen = (lora, params) if m.lora else (params, params)
    parts = training_state(trained, frozen, m.dtype, ranks, fsdp=fsdp, lora=bool(m.lora)) if spec.train \
        else {f"frozen weights ({m.dtype})": width * params}
    if fsdp:
        gathered = params * width if par.defer_gradient_sync else 2 * arch.largest_block * width
        parts["fsdp gathered blocks"] = gathered + (params * 4 if par.defer_gradient_sync and not m.lora else 0)
    batch = (spec.micro_batch or share) * (2 if spec.train_cfg and guided(spec) == 2 else 1)
    ac = par.activation_checkpointing
    reference = arch.sample_working_set if spec.kl_beta > 0 else 0  # its no-grad pass beside the kept tensors
    parts["activations (one micro-batch)"] = arch.train.update_peak(batch, ac, reference) if spec.train else 0
    parts["trajectories (one step)"] = samples * (trajectory_states(spec) * arch.latent_numel * 4
                                                  + spec.sample_steps * 4 + arch.text_features) + arch.text_features
    advice = generator_advice(config, eid, arch, params, batch=batch, ac=ac)
    notes = [f"a pass through the transformer: {arch.image_tokens} image tokens (latent "
             f"{'x'.join(map(str, arch.latent_shape))}) + {arch.text_tokens} text tokens; {batch} passes per backward "
             f"pass ({spec.micro_batch or share} transition(s){', doubled by guidance' if batch > (spec.micro_batch or share) else ''}), "
             f"activation checkpointing {'on' if ac else 'off'}: {arch.train.kept(batch, ac) / GB:.1f} GB kept "
             f"({arch.train.kept(batch, not ac) / GB:.1f} GB {'without' if ac else 'with'} it)"]
    return ActorPlan(name, "update", wants_gpu(spec.resources), {"transformer": params, "lora": lora},
                     {k: int(v) for k, v in parts.items()}, advice, notes)


def generator_advice(config: Config, eid: str, arch, params: int, *, batch: int, ac: bool) -> list[str]:
    """What would make expert `eid` (of `params` trained or adapted parameters) fit."""
    spec, key = config.expert(eid), f"experts.{eid}"
    out = []
    if not spec.model.lora:
        out.append(f"a LoRA adapter ({key}.model.lora={{r: 32, alpha: 64}}): no fp32 copy, gradients or moments of "
                   f"the {params / 1e9:.1f} B parameters, no reference copy")
    out.append(f"more ranks under fsdp ({key}.parallel.ranks=N, {key}.parallel.strategy=fsdp): parameters, gradients, "
               f"moments and reference split N ways")
    if batch > 1:
        out.append(f"a smaller {key}.micro_batch (now {batch} passes of the transformer per backward pass)")
    if not ac:
        out.append(f"{key}.parallel.activation_checkpointing=true (keeps "
                   f"{arch.train.kept(batch, True) / GB:.1f} GB of activations instead of {arch.train.kept(batch, False) / GB:.1f})")
    return out


def tiny_generator_expert(config: Config, name: str, share: int) -> ActorPlan:
    """The tiny DiT: its parameters counted from the module, activations from its width, depth and tokens."""
    from experts.kinds import build_model
    spec, m = config.experts.generator, config.experts.generator.model
    params = sum(p.numel() for p in build_model(config, "generator", fresh=True).parameters())
    side, frames = config.task.image_size, config.task.num_frames or 1
    depth = frames // m.frame_patch if m.kind == "tiny_video_dit" else 1
    tokens = depth * (side // m.patch) ** 2 + config.text_len()
    batch = spec.micro_batch or share
    latent = 3 * frames * side * side
    parts = {**training_state(params, params, "float32", 1, fsdp=False, lora=False),
             "activations (one micro-batch)": batch * tokens * m.d_model * m.n_layers * TINY_ACTIVATION,
             "trajectories (one step)": step_samples(config) * (trajectory_states(spec) * latent * 4
                                                                + config.text_len() * config.experts.text_encoder.d_model * 4)}
    advice = [f"a smaller experts.generator.micro_batch (now {batch} transitions per backward pass)"] if batch > 1 else []
    return ActorPlan(name, "update", wants_gpu(spec.resources), {"transformer": params}, parts, advice)


def refiner_expert(config: Config, eid: str, rank: int) -> ActorPlan:
    spec = config.expert(eid)
    name = f"expert/{eid}" + (f"/rank{rank}" if rank else "")
    par, m = spec.parallel, spec.model
    ranks, fsdp = par.ranks, par.strategy == "fsdp" and par.ranks > 1
    share = math.ceil(refined_samples(config) / ranks)
    batch = spec.micro_batch or share
    seq = PROMPT_TOKENS + spec.max_new_tokens
    if m.kind == "tiny_lm":
        from experts.kinds import build_model
        params = sum(p.numel() for p in build_model(config, eid, fresh=True).parameters())
        parts = {**training_state(params, params, "float32", 1, fsdp=False, lora=False),
                 "activations (one micro-batch)": batch * seq * m.d_model * m.n_layers * TINY_ACTIVATION}
        return ActorPlan(name, "update", wants_gpu(spec.resources), {"lm": params}, parts)
    arch = lm_architecture(m)
    width = DTYPE_BYTES[m.dtype]
    trained, frozen = (arch.lora, arch.params) if m.lora else (arch.params, arch.params)
    parts = training_state(trained, frozen, m.dtype, ranks, fsdp=fsdp, lora=bool(m.lora)) if spec.train \
        else {f"frozen weights ({m.dtype})": width * arch.params}
    ac = par.activation_checkpointing
    # fp32 logits at the generated tokens: the policy's, their log-softmax and its gradient; the reference's
    logits = batch * spec.max_new_tokens * arch.vocab * 4 * (3 + (spec.kl_beta > 0))
    reference = arch.working_set_per_token if spec.kl_beta > 0 else 0
    parts["activations (one micro-batch)"] = arch.train_per_token.update_peak(batch * seq, ac, reference) + logits \
        if spec.train else 0
    parts["token batches (one step)"] = refined_samples(config) * (seq * 8 + spec.max_new_tokens * 5)
    key = f"experts.{eid}"
    advice = [f"a smaller {key}.micro_batch (now {batch} sequences per backward pass)"]
    if not m.lora:
        advice.insert(0, f"a LoRA adapter ({key}.model.lora={{r: 16, alpha: 32}})")
    return ActorPlan(name, "update", wants_gpu(spec.resources), {"lm": arch.params, "lora": arch.lora},
                     {k: int(v) for k, v in parts.items()}, advice)


def reward_models(term) -> list[tuple[str, str | None, str]]:
    """The models with weights a reward term loads: (model, revision, dtype) each."""
    from tasks.rewards import is_model, resolve
    found = resolve(term.fn)
    if not is_model(found) or not hasattr(found, "models"):
        return []
    options = term.options()
    return [(ref.name, ref.revision, options.dtype) for ref in found.models(options) if ref.weights]


def reward_parts(term) -> tuple[dict[str, int], dict[str, int]]:
    """(parameter counts, bytes) of a term's models at its batch size."""
    params, parts = {}, {}
    batch = getattr(term.options(), "batch_size", 1)
    for path, revision, dtype in reward_models(term):
        arch = reward_architecture(path, dtype, revision)
        params[path] = arch.params
        parts[f"weights: {path}"] = arch.params * DTYPE_BYTES[dtype]
        parts[f"activations: {path} x {batch}"] = arch.per_image * batch
    return params, parts


@dataclass
class RolloutParts:
    """What rolling out holds: parameter counts, bytes by part, the working set by phase, and the
    bytes of one synced version of each model rolled out (its adapter alone under LoRA)."""
    params: dict[str, int]
    parts: dict[str, int]
    working: dict[str, int]
    synced: dict[str, int]


def rollout_parts(config: Config, share: int, experts: set[str]) -> RolloutParts:
    """What rolling out `share` samples holds with the models of `experts` (refiner ids;
    "generator": with its front end, and the reward terms scored where it samples), one chunk of
    `rollout.batch_size` at a time."""
    spec = config.experts.generator
    chunk = min(config.rollout.batch_size or share, share)
    refiners = {e: r for e, r in config.experts.active_refiners().items() if e in experts}
    params, parts, working, synced = {}, {}, {}, {}
    for eid, r in refiners.items():
        if r.model.kind == "tiny_lm":
            from experts.kinds import build_model
            params[eid] = sum(p.numel() for p in build_model(config, eid, fresh=True).parameters())
            parts[f"weights: {eid}"] = synced[eid] = 4 * params[eid]
            continue
        arch = lm_architecture(r.model)
        params[eid] = arch.params
        seq = PROMPT_TOKENS + r.max_new_tokens
        if r.engine == "vllm":  # the engine's weights, and the KV cache it reserves (or at least needs)
            from experts.vllm_refiner import engine_dtype
            parts[f"weights: {eid} (vLLM engine)"] = arch.params * DTYPE_BYTES[engine_dtype(r)] + arch.lora * 4
            parts[f"KV cache: {eid} (vLLM engine)"] = int(r.vllm.kv_cache_gib * 2 ** 30) if r.vllm.kv_cache_gib \
                else chunk * (r.vllm.max_model_len or seq) * arch.kv_per_token
            working[f"refine: {eid}"] = chunk * (seq * arch.working_set_per_token + arch.vocab * 4 * 2)
            continue
        parts[f"weights: {eid}"] = arch.params * DTYPE_BYTES[r.model.dtype] + arch.lora * 4
        synced[eid] = arch.lora * 4 if r.model.lora else parts[f"weights: {eid}"]
        working[f"refine: {eid}"] = chunk * (seq * (arch.kv_per_token + arch.working_set_per_token) + arch.vocab * 4 * 2)
    if "generator" not in experts:
        return RolloutParts(params, parts, working, synced)
    m = spec.model
    if m.kind == "diffusers_flow":
        arch = task_generator(config, m)
        width = DTYPE_BYTES[m.dtype]
        params["generator"] = arch.transformer
        parts["weights: generator"] = arch.transformer * width + arch.lora * 4
        synced["generator"] = arch.lora * 4 if m.lora else parts["weights: generator"]
        for name, n in arch.frontend.items():
            params[name] = n
            parts[f"weights: {name}"] = n * arch.frontend_width[name]
        working["generate"] = arch.sample_working_set * chunk * guided(spec)
        working["decode"] = arch.decode_working_set * chunk
        parts["trajectories (one chunk)"] = chunk * (spec.sample_steps + 1) * arch.latent_numel * 4 * 2 \
            + chunk * arch.text_features * guided(spec)
    else:  # the tiny DiT and its text encoder
        from experts.frontend import build_text_encoder
        from experts.kinds import build_model
        params["generator"] = sum(p.numel() for p in build_model(config, "generator", fresh=True).parameters())
        params["text_encoder"] = sum(p.numel() for p in build_text_encoder(config, fresh=True).parameters())
        parts["weights: generator"] = synced["generator"] = 4 * params["generator"]
        parts["weights: text_encoder"] = 4 * params["text_encoder"]
        side = config.task.image_size
        parts["trajectories (one chunk)"] = chunk * (spec.sample_steps + 1) * 3 * (config.task.num_frames or 1) \
            * side * side * 4 * 2
    parts["text cache (rollout.text_cache_mb)"] = int(config.rollout.text_cache_mb * MIB)
    pooled = config.reward.pools()
    for name, term in config.reward.terms.items():
        if name in pooled:
            continue
        term_params, term_parts = reward_parts(term)
        params.update(term_params)
        parts.update({k: v for k, v in term_parts.items() if k.startswith("weights")})
        working[f"reward: {name}"] = sum(v for k, v in term_parts.items() if k.startswith("activations"))
    return RolloutParts(params, parts, working, synced)


def rollout_worker(config: Config, j: int) -> ActorPlan:
    workers = config.cluster.rollout_workers
    share = math.ceil(step_samples(config) / workers)
    chunk = min(config.rollout.batch_size or share, share)
    held = rollout_parts(config, share, {"generator", *config.experts.active_refiners()})
    params, parts, working = held.params, held.parts, held.working
    parts.update(delivered_ahead(config, held.synced))
    if working:
        phase = max(working, key=working.get)
        parts[f"working set of one chunk of {chunk} ({phase})"] = working[phase]
    advice = [f"a smaller rollout.batch_size (now {chunk} samples at a time)",
              "fewer rollout workers (cluster.rollout_workers) if GPUs are short"]
    return ActorPlan(f"rollout/{j}", "rollout", wants_gpu(config.cluster.rollout_resources), params,
                     {k: int(v) for k, v in parts.items()}, advice)


def delivered_ahead(config: Config, synced: dict[str, int]) -> dict[str, int]:
    """The versions a rollout worker holds beside the ones it serves: a version delivered stays
    until the next rollout serves it, and the one served before it until then too
    (cluster/rollout_worker.py `serve`, `use_versions`); under `cluster.max_staleness=k`, k older
    ones that rollouts in flight name. Each is a trained expert's synced weights (`synced`: its
    adapter under LoRA) as the worker holds them; an engine refiner's wait in host memory, not on
    the device."""
    ahead = 1 + config.cluster.max_staleness
    out = {f"versions delivered ahead: {eid} (x{ahead})": ahead * synced[eid]
           for eid, r in config.experts.active_refiners().items() if r.train and r.engine != "vllm"}
    trained = [e for e in ("generator", "generator_low") if e in config.experts.ids() and config.expert(e).train]
    if trained:
        out[f"versions delivered ahead: {', '.join(trained)} (x{ahead})"] = ahead * synced["generator"]
    return out


OFFLOADED = {"optimizer": "optimizer (", "reference": "reference copy ("}  # cluster.offload -> its parts' names


def colocated_rank(config: Config, a: ActorPlan) -> ActorPlan:
    """Expert rank `a` under `cluster.layout=colocated`: it also rolls out its share with the weights
    it trains (held once: no inference copy), holding its front end, the text cache and the terms
    scored there besides. Phases run one after another: the rollout's working set replaces the
    update's activations, and the parts `cluster.offload` names are in host memory meanwhile, so its
    peak is the larger phase's: the update's bytes, plus what the rollout needs beyond them."""
    e = expert_of(a.name)
    ranks = config.ranks(e)
    samples = step_samples(config) if e == "generator" else refined_samples(config)
    share = math.ceil(samples / ranks)
    rolling = rollout_parts(config, share, {e})
    params, parts, working = rolling.params, rolling.parts, rolling.working
    held = {k: v for k, v in parts.items() if k != f"weights: {e}"}
    away = sum(v for k, v in a.bytes.items() if k.startswith("activations")
               or any(k.startswith(OFFLOADED[o]) for o in config.cluster.offload))
    beyond = max(0, max(working.values(), default=0) - away)
    chunk = min(config.rollout.batch_size or share, share)
    out = {**a.bytes, **{f"rollout: {k}": v for k, v in held.items()},
           f"rollout: working set of one chunk of {chunk} beyond the update's": beyond}
    notes = [*a.notes, f"colocated: rolls out {share} sample(s) with the weights it trains; offloaded while "
                       f"rolling out: {config.cluster.offload or 'nothing'}"]
    return ActorPlan(a.name, "always", a.wants_gpu, {**params, **a.params}, {k: int(v) for k, v in out.items()},
                     [*a.advice, "cluster.offload=[optimizer, reference] (host memory while rolling out)"], notes)


def reward_actor(config: Config, term_name: str, k: int) -> ActorPlan:
    term = config.reward.terms[term_name]
    _, resources = config.reward.pools()[term_name]
    params, parts = reward_parts(term)
    return ActorPlan(f"reward/{term_name}/{k}", "rollout", wants_gpu(resources), params, parts,
                     [f"a smaller reward.terms.{term_name}.batch_size"])


def actors_of(config: Config) -> dict[str, ActorPlan]:
    """Every actor of the run with its bytes, experts' ranks first."""
    out = []
    for eid in config.experts.ids():
        spec = config.expert(eid)
        for r in range(config.ranks(eid)):
            rank = generator_expert(config, eid, r) if isinstance(spec, GeneratorConfig) \
                else refiner_expert(config, eid, r)
            out.append(colocated_rank(config, rank) if LAYOUTS[config.cluster.layout].experts_roll_out else rank)
    out += [rollout_worker(config, j) for j in range(config.cluster.workers)]
    out += [reward_actor(config, t, k) for t, (n, _) in config.reward.pools().items() for k in range(n)]
    out += [driver_actor(config, out), ActorPlan("weight_sync", "always", False, {}, {})]
    return {a.name: a for a in out}


def driver_actor(config: Config, actors: list[ActorPlan]) -> ActorPlan:
    """The driver keeps every trained expert's latest snapshot with optimizer state in the object
    store on its node (cluster/expert_group.py): its synced weights (the adapter under LoRA) and
    AdamW moments, in fp32, and where that snapshot is older than the latest version
    (cluster.optimizer_snapshot_every > 1) the latest weights too, if rollout workers are given them;
    a sharded expert's moments stay on its ranks' nodes (host memory all the same)."""
    parts = {}
    for a in actors:
        if a.name.startswith("expert/") and "/rank" not in a.name and "trained params (fp32)" in a.bytes:
            ranks = config.expert(a.name.split("/")[1]).parallel.ranks
            shard = ranks if config.expert(a.name.split("/")[1]).parallel.strategy == "fsdp" else 1
            parts[f"snapshot of {a.name} (object store)"] = (a.bytes["trained params (fp32)"]
                                                              + a.bytes["optimizer (fp32 AdamW moments)"]) * shard
            if config.cluster.optimizer_snapshot_every > 1 and not LAYOUTS[config.cluster.layout].experts_roll_out:
                parts[f"latest weights of {a.name} (object store)"] = a.bytes["trained params (fp32)"] * shard
    return ActorPlan("driver", "always", False, {}, parts)


# --- placement ------------------------------------------------------------------------------------


def expert_of(name: str) -> str | None:
    return name.split("/")[1] if name.startswith("expert/") else None


def place(actors: dict[str, ActorPlan], target: Target) -> list[list[str]]:
    """The GPU of each GPU actor: one each while there are GPUs enough, else, largest first, each on
    the emptiest GPU it fits (so as few share as the count needs; two ranks of one expert never
    share); raises PlanError."""
    gpu_actors = [a for a in actors.values() if a.wants_gpu]
    cap = target.usable
    for a in gpu_actors:
        if a.total > cap:
            raise PlanError(too_big(a, target))
    if len(gpu_actors) <= target.gpus:
        return [[a.name] for a in gpu_actors] + [[] for _ in range(target.gpus - len(gpu_actors))]
    bins: list[list[str]] = [[] for _ in range(target.gpus)]
    used = [0] * target.gpus
    for a in sorted(gpu_actors, key=lambda a: -a.total):
        fits = [i for i in range(target.gpus) if used[i] + a.total <= cap
                and not (expert_of(a.name) and any(expert_of(b) == expert_of(a.name) for b in bins[i]))]
        if not fits:
            need = sum(x.total for x in gpu_actors) / GB
            raise PlanError(
                f"the {len(gpu_actors)} actors that ask for a GPU ({need:.1f} GB together) do not fit the target's "
                f"{target.gpus} GPUs of {target.gpu_memory_gb:g} GB ({target.headroom_gb:g} GB headroom each; "
                f"{target.source}): {a.name} ({a.total / GB:.1f} GB) finds no GPU with room. What would make it fit: "
                f"fewer rollout workers (cluster.rollout_workers), fewer reward actors (reward.terms.<name>.actors), "
                f"or for the largest actors: " + "; ".join(a.advice) + f". Nothing was started.")
        i = min(fits, key=lambda i: used[i])  # the emptiest: share as little as the count allows
        bins[i].append(a.name)
        used[i] += a.total
    return bins


def too_big(a: ActorPlan, target: Target) -> str:
    part = max(a.bytes, key=a.bytes.get)
    short = a.total - target.usable
    return (f"{a.name} needs {a.total / GB:.1f} GB, one GPU of the target gives {target.usable / GB:.1f} GB "
            f"({target.gpu_memory_gb:g} GB less plan.headroom_gb={target.headroom_gb:g}; {target.source}): short by "
            f"{short / GB:.1f} GB; its largest part is {part} ({a.bytes[part] / GB:.1f} GB). What would make it fit: "
            + "; ".join(a.advice or ["a GPU with more memory (--gpu-memory)"]) + ". Nothing was started.")


def check_collective(config: Config, bins: list[list[str]]) -> None:
    """NCCL refuses two ranks of one group on one device: a collective weight sync between an
    expert and a rollout worker that share a GPU cannot run."""
    if config.cluster.sync != "collective" or config.cluster.collective_backend != "nccl":
        return
    for gpu, names in enumerate(bins):
        experts = [n for n in names if n.startswith("expert/")]
        workers = [n for n in names if n.startswith("rollout/")]
        if experts and workers or len(workers) > 1:
            raise PlanError(f"cluster.sync=collective with cluster.collective_backend=nccl: {', '.join(experts + workers)} "
                            f"share GPU {gpu}, and NCCL refuses two members of one broadcast group on one device. Use "
                            f"cluster.sync=object_store, or give the run GPUs enough for one each. Nothing was started.")


def reserve_engines(config: Config, actors: dict[str, ActorPlan], target: Target) -> None:
    """A vLLM engine without `vllm.kv_cache_gib` takes `vllm.gpu_memory_utilization` of its device
    when it starts, whatever its model needs (vLLM's `LLM(gpu_memory_utilization=...)`, a share of the
    device's whole memory per engine): each rollout worker's engine parts are made at least that, of
    the target's GPU for a worker on a GPU, of this machine's memory for one on CPU."""
    engines = {e: r for e, r in config.experts.active_refiners().items() if r.engine == "vllm" and not r.vllm.kv_cache_gib}
    for a in actors.values():
        if not a.name.startswith("rollout/") or not engines:
            continue
        device = target.gpu_memory_gb * GB if a.wants_gpu else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        for eid, r in engines.items():
            weights, kv = f"weights: {eid} (vLLM engine)", f"KV cache: {eid} (vLLM engine)"
            reserved = int(r.vllm.gpu_memory_utilization * device)
            a.bytes[kv] = max(a.bytes[kv], reserved - a.bytes[weights])
            a.advice.append(f"a lower experts.{eid}.vllm.gpu_memory_utilization, or vllm.kv_cache_gib")
            a.notes.append(f"{eid}'s engine reserves experts.{eid}.vllm.gpu_memory_utilization="
                           f"{r.vllm.gpu_memory_utilization:g} of {device / GB:.0f} GB "
                           f"({'its GPU' if a.wants_gpu else 'host memory'}); set vllm.kv_cache_gib to reserve less")


def plan_for(config: Config, target: Target) -> Plan:
    """The memory plan of `config` on `target`; raises PlanError (a SettingError, exit 2) when it
    cannot fit or names a model whose architecture is unknown."""
    try:
        actors = actors_of(config)
    except UnknownModel as e:
        raise UnknownArchitecture(f"{e}. Nothing was started.") from None
    if target.gpus == 0 and any(a.wants_gpu for a in actors.values()):
        asking = [a.name for a in actors.values() if a.wants_gpu]
        raise PlanError(f"the target has no GPU ({target.source}), but {', '.join(asking)} ask for one "
                        f"(experts.<id>.resources.num_gpus, cluster.rollout_resources.num_gpus, "
                        f"reward.terms.<name>.resources.num_gpus); set them to 0 for a CPU run or plan for GPUs "
                        f"(--gpus N). Nothing was started.")
    reserve_engines(config, actors, target)
    bins = place(actors, target) if target.gpus else []
    check_collective(config, bins)
    gpus = []
    for i, names in enumerate(bins):
        for n in names:
            actors[n].gpus, actors[n].share = [i], 1.0 / len(names)
        used = sum(actors[n].total for n in names)
        gpus.append(GPUPlan(i, i // max(target.gpus_per_node, 1), names, used,
                            int(target.gpu_memory_gb * GB) - used))
    idle = {phase: [g.id for g in gpus if not any(actors[n].phase in (phase, "always") for n in g.actors)]
            for phase in ("rollout", "update")}
    generator = actors["expert/generator"].bytes
    # the rollouts' outputs wait in the object store, and those of the updates since an expert's last
    # snapshot with optimizer state are kept there to replay (cluster.optimizer_snapshot_every)
    in_store = generator.get("trajectories (one step)", 0) * config.cluster.optimizer_snapshot_every
    host = sum(a.total for a in actors.values() if not a.wants_gpu) + in_store
    return Plan(target, actors, gpus, idle, host)


def host_plan(config: Config) -> Plan:
    """The plan of a run whose actors all run on CPUs: `host_bytes` is what they hold together."""
    return plan_for(config, Target(1, 0, 0.0, 0.0, "this machine"))


# --- the report -----------------------------------------------------------------------------------


def report(plan: Plan) -> str:
    """The plan as a person reads it: per GPU its actors and bytes, per actor its parts."""
    t = plan.target
    lines = [f"target: {t.nodes} node(s) x {t.gpus_per_node} GPUs x {t.gpu_memory_gb:g} GB, "
             f"{t.headroom_gb:g} GB headroom each ({t.source})", ""]
    for g in plan.gpus:
        head = f"GPU {g.id} (node {g.node}): " + (", ".join(g.actors) or "idle")
        lines.append(f"{head}  {g.bytes / GB:.1f} GB used, {g.free / GB:.1f} GB free")
    lines += [f"idle while rolling out: {plan.idle['rollout'] or 'none'}; idle while updating: "
              f"{plan.idle['update'] or 'none'}", ""]
    for a in plan.actors.values():
        where = f"GPU {a.gpus[0]}" + (f" (a {a.share:.2g} share)" if a.share < 1 else "") if a.gpus else "no GPU"
        lines.append(f"{a.name} [{where}, {a.phase}]: {a.total / GB:.2f} GB"
                     + ("; params " + ", ".join(f"{k} {v / 1e9:.3f} B" for k, v in a.params.items() if v) if a.params else ""))
        lines += [f"    {part}: {b / GB:.3f} GB" for part, b in a.bytes.items() if b]
        lines += [f"    ({note})" for note in a.notes]
    lines.append(f"\nhost memory: {plan.host_bytes / GB:.2f} GB (the actors without a GPU, and the steps' "
                 f"trajectories in the object store: one step's, and those kept to replay updates)")
    return "\n".join(lines)


def target_for(config: Config, gpus: int | None = None, gpu_memory_gb: float | None = None,
               nodes: int | None = None) -> Target:
    """Flags first, then a connected Ray cluster (cluster.address or RAY_ADDRESS), else plan.target."""
    if gpus is not None or gpu_memory_gb is not None or nodes is not None:
        return with_flags(config_target(config), gpus, gpu_memory_gb, nodes)
    if config.cluster.mode == "ray" and (config.cluster.address or os.environ.get("RAY_ADDRESS")):
        from cluster.connect import connect_to
        connect_to(config.cluster.address)
        return cluster_target(config)
    return config_target(config)
