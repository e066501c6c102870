"""The typed run config: every default lives here, presets override a few, `--set` overrides any.

`load_config` turns a preset name or YAML path plus `dotted.key=value` overrides into a validated
`Config`, or raises `ConfigError` with one paragraph that names the offending key.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Annotated, Literal, Optional

import yaml
from safetensors import safe_open
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat,
                      PositiveInt, ValidationError, model_validator)

from tasks.reward import TERMS, TEXT_TERMS
from tasks.reward_guard import resolve
from tasks.shapes import MAX_PROMPT_WORDS




def _weights_file(path: str | None) -> str | None:
    """An expert's weights: an existing safetensors file (weights are never unpickled)."""
    if path is None:
        return path
    if not Path(path).is_file():
        raise ValueError(f"no checkpoint file at '{path}'")
    try:
        with safe_open(path, "pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types for every kind of bad header
        raise ValueError(f"'{path}' is not a safetensors weights file ({type(e).__name__}: {e}); "
                         f"weights are never loaded through pickle") from None
    return path


InitPath = Annotated[Optional[str], AfterValidator(_weights_file)]


class ConfigError(ValueError):
    """A bad config or value; the CLI prints it and exits with status 2 before starting anything."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Resources(Strict):
    """What one actor reserves from Ray; `custom` names resources a node advertises (e.g. a pool)."""
    num_cpus: NonNegativeFloat = 0.0
    num_gpus: NonNegativeFloat = 0.0
    custom: dict[str, NonNegativeFloat] = {}

    def options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.custom)}


class TinyLMConfig(Strict):
    kind: Literal["tiny_lm"] = "tiny_lm"
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4


class LoraConfig(Strict):
    """A LoRA adapter (peft): only it trains, syncs and is checkpointed; the reference is the base."""
    r: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | None = None   # None: the attention projections of the model's kind


def _model_path(path: str) -> str:
    """A local model directory (with its config.json) or a hub id (`org/name`, fetched when loaded)."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file() and not (local / "model_index.json").is_file():
            raise ValueError(f"'{path}' is a directory without config.json or model_index.json: not a saved model")
        return str(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"no model directory at '{path}' (and it is not a hub id like 'org/name')")
    return path


def _installed(*modules: str):
    def check(value):
        import importlib.util
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"needs {missing}: pip install 'jointrl[hf]'")
        return value
    return check


class HFCausalLMConfig(Strict):
    """A Hugging Face causal LM refiner (a Qwen-class instruct model), prompted with its chat template."""
    kind: Annotated[Literal["hf_causal_lm"], AfterValidator(_installed("transformers", "peft"))]
    path: Annotated[str, AfterValidator(_model_path)]
    dtype: Literal["float32", "bfloat16"] = "float32"
    system_prompt: str = ("Rewrite the user's image prompt into a more detailed one. Think briefly, then give "
                          "the new prompt inside <answer></answer>.")
    answer_tag: str | None = "answer"         # the refinement is the text inside <tag>…</tag>; None: all of it
    lora: LoraConfig | None = None


def _default_kind(kind: str):
    """A `model` section without `kind` (e.g. `--set experts.generator.model.d_model=128`) is the tiny one."""
    def fill(data):
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and "kind" not in data["model"]:
            data = {**data, "model": {"kind": kind, **data["model"]}}
        return data
    return fill


class RefinerConfig(Strict):
    owns: list[str] | None = None            # reward terms credited to this refiner; None: the default
    train: bool = True
    lr: PositiveFloat = 3e-3
    update_every: PositiveInt = 1
    kl_beta: NonNegativeFloat = 0.01
    clip_eps: PositiveFloat = 0.2             # PPO clip of the ratio to the rollout's log-probs
    max_new_tokens: PositiveInt = Field(6, ge=2)
    temperature: PositiveFloat = 1.0
    init: InitPath = None                     # a checkpoint to start from (`jointrl pretrain` writes one)
    resources: Resources = Resources()
    model: Annotated[TinyLMConfig | HFCausalLMConfig, Field(discriminator="kind")] = TinyLMConfig()

    _kind = model_validator(mode="before")(_default_kind("tiny_lm"))


class TinyDiTConfig(Strict):
    kind: Literal["tiny_dit"] = "tiny_dit"
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4
    patch: PositiveInt = 4


class DiffusersFlowConfig(Strict):
    """A diffusers flow-matching model, SD3 family (transformer, CLIP/T5 text encoders, VAE, a
    FlowMatchEulerDiscreteScheduler with shift); images are task.image_size on a side."""
    kind: Annotated[Literal["diffusers_flow"], AfterValidator(_installed("diffusers", "transformers", "peft"))]
    path: Annotated[str, AfterValidator(_model_path)]
    dtype: Literal["float32", "bfloat16"] = "float32"
    guidance_scale: float = Field(1.0, ge=1.0)  # > 1: classifier-free guidance against the empty prompt
    max_sequence_length: PositiveInt = 256    # T5 tokens (a model without T5 pads with zeros)
    lora: LoraConfig | None = None


class GeneratorConfig(Strict):
    train: bool = True                        # false: prompt-only mode, the generator stays at version 0
    owns: list[str] | None = None             # terms it learns from under per_expert/counterfactual; None: all
    lr: PositiveFloat = 3e-4
    update_every: PositiveInt = 1
    kl_beta: NonNegativeFloat = 0.01
    clip_eps: PositiveFloat = 1e-4
    noise_level: PositiveFloat = 0.7
    sample_steps: PositiveInt = 8
    sde_window: list[NonNegativeInt] | None = None  # [start, end): SDE (and training) on these sampling
                                              # steps only, ODE elsewhere (Flow-GRPO-Fast); None: all
    init: InitPath = None                     # a checkpoint to start from (pretrained base)
    resources: Resources = Resources()
    model: Annotated[TinyDiTConfig | DiffusersFlowConfig, Field(discriminator="kind")] = TinyDiTConfig()

    _kind = model_validator(mode="before")(_default_kind("tiny_dit"))

    @model_validator(mode="after")
    def _window(self):
        w = self.sde_window
        if w is not None and (len(w) != 2 or not w[0] < w[1] <= self.sample_steps):
            raise ValueError(f"sde_window {w} must be [start, end) with start < end <= sample_steps ({self.sample_steps})")
        return self


class TextEncoderConfig(Strict):
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4
    init: InitPath = None                     # a checkpoint to start from (pretrained with the generator)


class ExpertsConfig(Strict):
    n_refiners: int = Field(3, ge=1)
    refiners: list[RefinerConfig] = []
    generator_only: bool = False              # true: Flow-GRPO alone; no refiner is spawned, no prompt refined
    generator: GeneratorConfig = GeneratorConfig()
    text_encoder: TextEncoderConfig = TextEncoderConfig()

    @model_validator(mode="before")
    @classmethod
    def _refiner_keys(cls, data):
        """`experts.refiner_<i>.<key>` is shorthand for `experts.refiners.<i>.<key>`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        named = {int(m.group(1)): data.pop(k) for k in list(data) if (m := re.fullmatch(r"refiner_(\d+)", k))}
        if named:
            refiners = [dict(r) if isinstance(r, dict) else r for r in data.get("refiners", [])]
            for i, overrides in sorted(named.items()):
                refiners += [{} for _ in range(i + 1 - len(refiners))]
                refiners[i] = {**refiners[i], **overrides}
            data["refiners"] = refiners
        return data

    @model_validator(mode="after")
    def _fill_refiners(self):
        if len(self.refiners) > self.n_refiners:
            raise ValueError(f"refiner_{len(self.refiners) - 1} is configured but n_refiners={self.n_refiners}")
        refiners = self.refiners + [RefinerConfig() for _ in range(self.n_refiners - len(self.refiners))]
        for i, r in enumerate(refiners):
            if r.owns is None:
                r.owns = [TEXT_TERMS[i % len(TEXT_TERMS)]]
        self.__dict__["refiners"] = refiners
        return self

    @model_validator(mode="after")
    def _something_trains(self):
        if self.generator_only and not self.generator.train:
            raise ValueError("generator_only=true with generator.train=false trains nothing")
        return self

    def active_refiners(self) -> dict[str, RefinerConfig]:
        """The refiners this run spawns, by expert id (none in generator-only mode)."""
        return {} if self.generator_only else {f"refiner_{i}": r for i, r in enumerate(self.refiners)}

    def ids(self) -> list[str]:
        return [*self.active_refiners(), "generator"]


class AlgorithmConfig(Strict):
    credit: Literal["shared", "per_expert", "counterfactual"] = "per_expert"
    group_size: int = Field(8, ge=2)
    num_skip_refinement: NonNegativeInt = 2
    counterfactual_fraction: float = Field(1.0, gt=0.0, le=1.0)  # share of refined samples regenerated per refiner
    adv_clip: PositiveFloat = 5.0
    grad_clip: PositiveFloat = 1.0

    @model_validator(mode="after")
    def _check(self):
        if self.num_skip_refinement >= self.group_size:
            raise ValueError(f"num_skip_refinement ({self.num_skip_refinement}) must be smaller than "
                             f"group_size ({self.group_size}): a group needs refined samples")
        return self


class TrainerConfig(Strict):
    steps: PositiveInt = 40
    seed: int = 0
    prompts_per_step: PositiveInt = 4
    n_train_prompts: PositiveInt = 48
    checkpoint_every: NonNegativeInt = 0      # 0: only at the end
    keep_checkpoints: PositiveInt = 3         # the newest are kept, older ones removed
    run_name: str | None = None


class ClusterConfig(Strict):
    mode: Literal["ray", "inline"] = "ray"
    address: str | None = None                # None: RAY_ADDRESS if set, else a new local Ray
    rollout_workers: PositiveInt = 1
    rollout_resources: Resources = Resources()  # per rollout worker
    share_weights: bool = True                # CPU workers read weights from the object store, no private copy
    sync: Literal["object_store", "collective"] = "object_store"  # collective: experts broadcast new
                                              # versions into the workers (for GPU weights); ray mode only
    collective_backend: Literal["gloo", "nccl"] = "gloo"  # nccl: weights on GPUs
    collective_timeout_s: PositiveFloat = 60.0  # a broadcast stuck this long falls back to the object store
    max_staleness: NonNegativeInt = 0         # k > 0: rollouts for steps t+1..t+k run while step t updates
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"  # of the reserved bundles
    colocate: bool = True                     # false: experts and rollout workers in separate placement groups
    placement_timeout_s: PositiveFloat = 120.0  # then the run stops, naming the bundles it could not place
    max_restarts: NonNegativeInt = 3          # per actor: Ray restarts it, the driver restores its state


class RewardConfig(Strict):
    weights: dict[str, NonNegativeFloat] = {"image": 1.0, "fidelity": 0.5, "style": 0.5, "format": 0.5}
    fn: str | None = None                     # package.module:function returning named terms; None: shapes
    timeout_s: PositiveFloat = 60.0           # a reward call slower than this drops its samples
    actors: NonNegativeInt = 0                # K > 0: a pool of K reward actors scores every batch (a reward
                                              # model loaded once per actor); 0: each rollout worker scores
    resources: Resources = Resources()        # per reward actor

    @model_validator(mode="after")
    def _known_terms(self):
        if self.fn is not None:
            resolve(self.fn)  # importable and callable, or a config error now
            return self
        unknown = sorted(set(self.weights) - set(TERMS))
        if unknown:
            raise ValueError(f"unknown reward terms {unknown}; the shapes reward has {list(TERMS)}")
        return self


class EvaluationConfig(Strict):
    per_category: PositiveInt = 20           # held-out prompts per GenEval category
    seed: int = 1234                         # the held-out set is fixed by this seed, not the run's
    refine: bool = True                      # refine eval prompts with the trained refiners


class PretrainConfig(Strict):
    """`jointrl pretrain`: flow matching of the base generator and text encoder on rendered pairs."""
    steps: PositiveInt = 9000
    batch_size: PositiveInt = 32
    lr: PositiveFloat = 2e-3                  # cosine-decayed to 0 over `steps`
    ema: float = Field(0.998, ge=0.0, lt=1.0)  # the saved weights are this EMA of the trained ones
    refiner_steps: PositiveInt = 400          # supervised start of the refiners on the captions' details
    refiner_lr: PositiveFloat = 3e-3
    degraded_share: float = Field(0.2, ge=0.0, lt=1.0)  # low-quality images in the data, never captioned
                                                         # with quality words (shapes.QUALITY_WORDS)
    threads: PositiveInt = 2
    seed: int = 0
    out_dir: str = "runs/pretrained"          # bases are cached here by a hash of what shapes them


class LoggingConfig(Strict):
    """Where metrics and samples go besides RUN_DIR/metrics.jsonl (always written)."""
    tensorboard: bool = False                 # RUN_DIR/tensorboard/ event files
    wandb: bool = False                       # Weights & Biases, in RUN_DIR/wandb/
    wandb_project: str = "jointrl"
    wandb_mode: Literal["offline", "online"] = "offline"  # offline works without a network; `wandb sync` later
    images_every: NonNegativeInt = 0          # sample images with their prompts every N steps (and the last); 0: never
    images_per_log: PositiveInt = 8

    @model_validator(mode="after")
    def _installed(self):
        import importlib.util
        for flag, module, extra in (("tensorboard", "tensorboard", "log"), ("wandb", "wandb", "log")):
            if getattr(self, flag) and importlib.util.find_spec(module) is None:
                raise ValueError(f"{flag}=true needs the '{module}' package: pip install 'jointrl[{extra}]'")
        return self


class TaskConfig(Strict):
    name: Literal["shapes"] = "shapes"
    image_size: PositiveInt = 32


class Config(Strict):
    experts: ExpertsConfig = ExpertsConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    cluster: ClusterConfig = ClusterConfig()
    reward: RewardConfig = RewardConfig()
    task: TaskConfig = TaskConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    pretrain: PretrainConfig = PretrainConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _owned_terms(self):
        for i, r in enumerate(self.experts.refiners):
            bad = [t for t in r.owns if t not in self.reward.weights]
            if bad:
                raise ValueError(f"experts.refiner_{i}.owns names {bad}, not a reward term "
                                 f"({sorted(self.reward.weights)})")
            if self.algorithm.credit == "per_expert" and not r.owns:
                raise ValueError(f"experts.refiner_{i}.owns is empty, but credit=per_expert needs a term")
        bad = [t for t in self.experts.generator.owns or [] if t not in self.reward.weights]
        if bad:
            raise ValueError(f"experts.generator.owns names {bad}, not a reward term ({sorted(self.reward.weights)})")
        if self.experts.generator.model.kind == "tiny_dit" and self.task.image_size % self.experts.generator.model.patch:
            raise ValueError("task.image_size must be a multiple of experts.generator.model.patch")
        return self

    def owners(self) -> dict[str, list[str]]:
        """Reward term -> the refiners that own it."""
        out: dict[str, list[str]] = {}
        for eid, r in self.experts.active_refiners().items():
            for t in r.owns:
                out.setdefault(t, []).append(eid)
        return out

    def expert(self, expert_id: str) -> RefinerConfig | GeneratorConfig:
        return self.experts.generator if expert_id == "generator" else \
            self.experts.refiners[int(expert_id.split("_")[1])]

    def text_len(self) -> int:
        """Longest composed text: <bos> prompt, then <sep> and each refiner's tokens (the same width
        in generator-only mode, so one pretrained text encoder serves every method)."""
        return 1 + MAX_PROMPT_WORDS + sum(1 + r.max_new_tokens for r in self.experts.refiners)


PRESETS: dict[str, dict] = {
    "shapes": {},  # the defaults above: 3 refiners, each owning a text term, per_expert credit
    "shapes-tiny": {  # for tests and smoke runs: small groups, short sampling
        "algorithm": {"group_size": 4, "num_skip_refinement": 1},
        "trainer": {"steps": 3, "prompts_per_step": 2},
        "experts": {"generator": {"sample_steps": 4}},
    },
    "gpu": {  # one GPU (bench/gpu_smoke.sh): Qwen2.5-0.5B-Instruct refiners and SD3.5-medium, LoRA, bf16,
              # with Flow-GRPO's SD3.5 settings (10 steps, guidance 4.5, clip 1e-4, LoRA r=32 at lr 3e-4)
        "experts": {
            "n_refiners": 2,
            "refiners": [{"model": {"kind": "hf_causal_lm", "path": "Qwen/Qwen2.5-0.5B-Instruct", "dtype": "bfloat16",
                                    "lora": {"r": 16, "alpha": 32}},
                          "max_new_tokens": 48, "lr": 1e-5, "resources": {"num_gpus": 0.1}} for _ in range(2)],
            "generator": {"model": {"kind": "diffusers_flow", "path": "stabilityai/stable-diffusion-3.5-medium",
                                    "dtype": "bfloat16", "guidance_scale": 4.5, "lora": {"r": 32, "alpha": 64}},
                          "sample_steps": 10, "sde_window": [0, 4], "lr": 3e-4, "clip_eps": 1e-4, "kl_beta": 0.04,
                          "resources": {"num_gpus": 0.3}},
        },
        "cluster": {"rollout_workers": 1, "rollout_resources": {"num_gpus": 0.5}},
        "task": {"image_size": 512},
        "trainer": {"prompts_per_step": 2},
        "algorithm": {"group_size": 4, "num_skip_refinement": 1},
    },
    "shapes-cluster": {  # deploy/: every expert and rollout worker reserves a CPU, spread over the nodes
        "experts": {**{f"refiner_{i}": {"resources": {"num_cpus": 1}} for i in range(3)},
                    "generator": {"resources": {"num_cpus": 1}}},
        "cluster": {"rollout_workers": 2, "rollout_resources": {"num_cpus": 1}, "placement": "spread"},
    },
}


def _set(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for i, k in enumerate(keys[:-1]):
        if isinstance(node, list) and k.isdigit():
            k = int(k)
            node += [{} for _ in range(k + 1 - len(node))]
        elif not isinstance(node, dict):
            raise ConfigError(f"invalid config key '{dotted}': '{'.'.join(keys[:i])}' is not a section")
        nxt = node[k] if (isinstance(node, list) or k in node) else None
        if nxt is None:
            nxt = node[k] = {}
        node = nxt
    if isinstance(node, list):
        raise ConfigError(f"invalid config key '{dotted}': give a field, e.g. '{dotted}.lr'")
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, object]:
    if "=" not in item:
        raise ConfigError(f"invalid --set '{item}': expected dotted.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(source: str = "shapes", overrides: list[str] = ()) -> Config:
    """Resolve a preset name or YAML path plus `dotted.key=value` overrides into a Config."""
    if source in PRESETS:
        tree = copy.deepcopy(PRESETS[source])
    elif Path(source).is_file():
        try:
            tree = yaml.safe_load(Path(source).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{source}' is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file '{source}' must hold a mapping of sections, not {type(tree).__name__}")
    else:
        raise ConfigError(f"unknown config '{source}': neither a preset ({', '.join(PRESETS)}) "
                          f"nor an existing YAML file")
    for item in overrides:
        _set(tree, *parse_override(item))
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(describe(e)) from None


def run_config(run_dir: Path, flag: str, overrides: list[str] = ()) -> Config:
    """The saved config of the run in `run_dir` plus `overrides` (`flag` names it in errors)."""
    if not (Path(run_dir) / "config.yaml").is_file():
        raise ConfigError(f"{flag} '{run_dir}' is not a run directory (no config.yaml there)")
    return load_config(str(Path(run_dir) / "config.yaml"), overrides)


def describe(error: ValidationError) -> str:
    parts = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"]) or "config"
        got = f" (got {err['input']!r})" if not isinstance(err.get("input"), dict) else ""
        parts.append(f"{key}: {err['msg']}{got}")
    return "invalid config: " + "; ".join(parts) + ". Nothing was started."


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(), sort_keys=False)
