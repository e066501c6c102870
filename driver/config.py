"""The typed run config: the schema's defaults, presets (configs/*.yaml) override a few, `--set` any.

`resolve_config` turns a preset name or YAML path plus `dotted.key=value` overrides into a validated
`Config`, or raises `SettingError` with one paragraph that names the offending key. The schema here
only judges values; the files, models, packages and reward function a config names are checked by
driver/preflight.py, whose `load_config` resolves a config, then checks it. Every key carries its description:
`jointrl config keys` lists them, `jointrl config show` prints a resolved config with them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import BaseModel, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, \
    ValidationError, model_validator

from common.config import Resources, SettingError, Strict
from experts.generator import LOW_NOISE, GeneratorConfig
from experts.refiner import RefinerConfig
from experts.spec import TextEncoderConfig
from tasks.rewards.term import TermConfig
from tasks.shapes import MAX_PROMPT_WORDS


def models_of(annotation) -> list[type[BaseModel]]:
    """The config sections a field holds: one model, the kinds of a union, or the item of a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in models_of(a)]


def laid_over(defaults: dict, own: dict, model: type[BaseModel]) -> dict:
    """The section `own` with every key it does not set taken from `defaults` (both raw sections of
    `model`). A key `own` sets keeps its value, except a section that both set, which is laid over
    the same way key by key (a model section of another `kind` replaces the defaults' whole); a
    value that is not a section (a list, a mapping such as `resources.custom`, null) replaces."""
    out = dict(defaults)
    for key, value in own.items():
        field, base = model.model_fields.get(key), out.get(key)
        sections = models_of(field.annotation) if field is not None else []
        if not (sections and isinstance(value, dict) and isinstance(base, dict)):
            out[key] = value
            continue
        if len(sections) > 1:  # model kinds: the defaults' kind, explicit or the field's default's
            kind = base.get("kind", getattr(field.default, "kind", None))
            if value.get("kind", kind) != kind:
                out[key] = value
                continue
            sections = [s for s in sections if get_args(s.model_fields["kind"].annotation) == (kind,)]
        out[key] = laid_over(base, value, sections[0])
    return out


def raw_section(section) -> dict:
    """A section as the keys it sets: a dict as given, a model's fields as set."""
    return section.model_dump(exclude_unset=True) if isinstance(section, BaseModel) else dict(section)


# the keys of experts.generator_low that are the generator's: its sampler, and the credit of the trajectories
LOW_NOISE_SHARED = ("owns", "noise_level", "sample_steps", "sde_window", "train_final_step", "same_initial_noise",
                    "train_cfg")


class ExpertsConfig(Strict):
    """The experts: N refiners (`refiner_<i>`) and one generator (two experts where Wan2.2-A14B's
    low-noise transformer is one of its own, `generator_low`). The one place that maps an expert id
    to its config section (`sections`) and spells a refiner's id (`refiner_id`)."""
    n_refiners: int = Field(3, ge=1, description="how many refiners; a refiner without a section of its own "
                                                 "takes `refiner_defaults`. `--set experts.n_refiners=K` keeps the "
                                                 "first K sections a preset or file configures (a section set "
                                                 "beyond K by `--set` is an error)")
    refiner_defaults: RefinerConfig = Field(RefinerConfig(), description="keys every refiner takes unless its "
                                            "own section (`experts.refiner_<i>`) sets them, e.g. "
                                            "`experts.refiner_defaults.kl_beta=0.1` for all. A section sets a key "
                                            "where it names it, at any depth: `experts.refiner_1.model.lora.r=8` "
                                            "sets r only, and refiner_1 keeps the defaults' model path, kind and "
                                            "lora.alpha; a list, a mapping (resources.custom) or null replaces "
                                            "the default's whole, and a model of another kind replaces its model")
    refiners: list[RefinerConfig] = Field([], description="one refiner: its model, reward terms and learning; "
                                                          "`experts.refiner_<i>` is `experts.refiners.<i>`")
    generator_only: bool = Field(False, description="true: Flow-GRPO alone; no refiner is spawned, no prompt "
                                                    "refined")
    generator: GeneratorConfig = Field(GeneratorConfig(), description="the flow-matching image generator")
    generator_low: GeneratorConfig | None = Field(
        None, description="Wan2.2-A14B's low-noise transformer (transformer_2) as an expert of its own, trained "
                          "only on the steps it denoises (sigma x num_train_timesteps below boundary_ratio x "
                          "num_train_timesteps), with its own version, optimizer, snapshot, checkpoint and weight "
                          "sync, from the generator's advantages; experts.generator is then the high-noise "
                          "transformer alone. Every key it does not set is experts.generator's (but `init`); the "
                          "sampler's keys and the model's but `lora` and `dtype` must be the generator's. None: "
                          "experts.generator trains both transformers")
    text_encoder: TextEncoderConfig = Field(TextEncoderConfig(), description="the tiny generator's text encoder")
    base: str | None = Field(None, description="a `jointrl pretrain` output folder (`pretrain.out_dir`): every "
                                               "expert whose `init` is not set starts from the file made there for "
                                               "its settings (relative paths are read from the config file's "
                                               "folder if there); None: each expert's own `init`")

    @staticmethod
    def refiner_id(i: int | str) -> str:
        """Refiner i's expert id, also its config key (`experts.refiner_<i>.lr`)."""
        return f"refiner_{i}"

    @model_validator(mode="before")
    @classmethod
    def _refiner_sections(cls, data):
        """`experts.refiner_<i>.<key>` is shorthand for `experts.refiners.<i>.<key>`; each of the
        n_refiners refiners is its own section laid over `refiner_defaults`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        id_pattern = cls.refiner_id(r"(\d+)")
        named = {int(m.group(1)): data.pop(k) for k in list(data) if (m := re.fullmatch(id_pattern, k))}
        for i, section in named.items():
            if not isinstance(section, dict):
                raise ValueError(f"{cls.refiner_id(i)} is a section of keys (e.g. {cls.refiner_id(i)}.lr=0.001), "
                                 f"got {section!r}")
        if not isinstance(data.get("refiners", []), list):
            return data  # the schema names it
        refiners = [raw_section(r) if isinstance(r, (dict, BaseModel)) else r for r in data.get("refiners", [])]
        for i, overrides in sorted(named.items()):
            refiners += [{} for _ in range(i + 1 - len(refiners))]
            refiners[i] = {**refiners[i], **overrides} if isinstance(refiners[i], dict) else refiners[i]
        n = data.get("n_refiners", cls.model_fields["n_refiners"].default)
        if type(n) is int:  # else the schema names what is wrong with it
            refiners += [{} for _ in range(n - len(refiners))]
        defaults = data.get("refiner_defaults", {})
        if isinstance(defaults, (dict, BaseModel)):
            refiners = [laid_over(raw_section(defaults), r, RefinerConfig) if isinstance(r, dict) else r
                        for r in refiners]
        data["refiners"] = refiners
        return data

    @model_validator(mode="before")
    @classmethod
    def _low_noise_section(cls, data):
        """`experts.generator_low` takes every key of `experts.generator` it does not set, but `init`."""
        if not isinstance(data, dict) or not isinstance(data.get("generator_low"), (dict, BaseModel)):
            return data
        generator = data.get("generator", {})
        if not isinstance(generator, (dict, BaseModel)):
            return data  # the schema names what is wrong with it
        defaults = {k: v for k, v in raw_section(generator).items() if k != "init"}
        return {**data, "generator_low": laid_over(defaults, raw_section(data["generator_low"]), GeneratorConfig)}

    @model_validator(mode="after")
    def _low_noise_twin(self):
        """generator_low samples with the generator: one sampler, one model, one credit."""
        low, generator = self.generator_low, self.generator
        if low is None:
            return self
        for key in LOW_NOISE_SHARED:
            if getattr(low, key) != getattr(generator, key):
                raise ValueError(f"experts.generator_low.{key}={getattr(low, key)!r} differs from "
                                 f"experts.generator.{key}={getattr(generator, key)!r}: the two transformers share "
                                 f"the sampler, its trajectories and their advantages; set experts.generator.{key}")
        if low.model.kind != generator.model.kind:
            raise ValueError(f"experts.generator_low.model.kind={low.model.kind}: it is the low-noise transformer "
                             f"of experts.generator.model ({generator.model.kind})")
        own = low.model.model_dump(exclude={"lora", "dtype"})
        for key, value in generator.model.model_dump(exclude={"lora", "dtype"}).items():
            if own[key] != value:
                raise ValueError(f"experts.generator_low.model.{key}={own[key]!r} differs from experts.generator."
                                 f"model.{key}={value!r}: generator_low is the low-noise transformer of the "
                                 f"generator's model; only its lora and dtype may differ")
        return self

    @model_validator(mode="after")
    def _no_section_beyond_n(self):
        if len(self.refiners) > self.n_refiners:
            last = self.refiner_id(len(self.refiners) - 1)
            raise ValueError(f"{last} is configured but n_refiners={self.n_refiners}")
        return self

    @model_validator(mode="after")
    def _something_trains(self):
        if self.generator_only and not self.generator.train:
            raise ValueError("generator_only=true with generator.train=false trains nothing")
        return self

    def sections(self) -> dict[str, RefinerConfig | GeneratorConfig]:
        """Every configured expert's section by expert id: the refiners, then the generator (and its
        low-noise transformer's, where it is an expert of its own)."""
        low = {LOW_NOISE: self.generator_low} if self.generator_low is not None else {}
        return {**{self.refiner_id(i): r for i, r in enumerate(self.refiners)}, "generator": self.generator, **low}

    def active_refiners(self) -> dict[str, RefinerConfig]:
        """The refiners this run spawns, by expert id (none in generator-only mode)."""
        return {} if self.generator_only else \
            {e: s for e, s in self.sections().items() if isinstance(s, RefinerConfig)}

    def ids(self) -> list[str]:
        return [*self.active_refiners(), "generator", *([LOW_NOISE] if self.generator_low is not None else [])]


class AlgorithmConfig(Strict):
    """How rewards become advantages: GRPO groups and the credit of each expert."""
    credit: Literal["shared", "per_expert", "counterfactual"] = Field(
        "per_expert", description="shared: every expert learns from the total reward; per_expert: a refiner "
                                  "from the terms it owns; counterfactual: from the reward its refinement adds")
    group_size: int = Field(8, ge=2, description="samples per prompt; advantages are relative to the group")
    num_skip_refinement: NonNegativeInt = Field(2, description="samples of each group drawn from the unrefined "
                                                               "prompt (a baseline for the refiners)")
    counterfactual_fraction: float = Field(1.0, gt=0.0, le=1.0, description="share of refined samples "
                                           "regenerated without each refiner (credit=counterfactual)")
    adv_clip: PositiveFloat = Field(5.0, description="advantages are clipped to [-adv_clip, adv_clip]")
    adv_std: Literal["group", "batch"] = Field("group", description="the std advantages are divided by: each "
                                               "prompt group's (GRPO), or the whole step's over the samples "
                                               "credited (Flow-GRPO's global_std); centred on the group's mean "
                                               "either way")
    grad_clip: PositiveFloat = Field(1.0, description="gradient norm clip of every update")

    @model_validator(mode="after")
    def _check(self):
        if self.num_skip_refinement >= self.group_size:
            raise ValueError(f"num_skip_refinement ({self.num_skip_refinement}) must be smaller than "
                             f"group_size ({self.group_size}): a group needs refined samples")
        return self


class TrainerConfig(Strict):
    """How long a run trains, on what prompts, and its checkpoints."""
    steps: PositiveInt = Field(40, description="training steps (one rollout and update of every expert each)")
    seed: int = Field(0, description="seeds the training prompts, the models' initialisation and the sampling")
    prompts_per_step: PositiveInt = Field(4, description="prompts per step, each sampled group_size times")
    n_train_prompts: PositiveInt = Field(48, description="size of the fixed training prompt set")
    checkpoint_every: NonNegativeInt = Field(0, description="save a checkpoint every N steps; 0: only at the end "
                                                             "(and as checkpoint_every_s says)")
    checkpoint_every_s: NonNegativeFloat = Field(300.0, description="also save one once this many seconds passed "
                                                                    "since the last, so a crash loses no more; 0: "
                                                                    "never by time")
    keep_checkpoints: PositiveInt = Field(3, description="checkpoints kept: the newest, older ones are removed")
    run_name: str | None = Field(None, description="the run's name in logs; None: its run directory's name")


class ClusterConfig(Strict):
    """Where the actors run on Ray and how weights reach the rollout workers."""
    mode: Literal["ray", "inline"] = Field("ray", description="ray: experts and workers are Ray actors; "
                                                              "inline: all in this process (for debugging)")
    address: str | None = Field(None, description="the Ray cluster to join; None: RAY_ADDRESS if set, else a "
                                                  "new local Ray")
    rollout_workers: PositiveInt = Field(1, description="rollout workers sampling in parallel (cluster.layout="
                                                        "separate; colocated has none)")
    rollout_resources: Resources = Field(Resources(), description="what each rollout worker reserves from Ray")
    share_weights: bool = Field(True, description="CPU workers read weights from the object store, no private "
                                                  "copy")
    sync: Literal["object_store", "collective"] = Field(
        "object_store", description="how new weight versions reach the workers; collective: experts broadcast "
                                    "them into the workers (for GPU weights; ray mode only)")
    collective_backend: Literal["gloo", "nccl"] = Field("gloo", description="backend of sync=collective; nccl: "
                                                                            "weights on GPUs")
    collective_timeout_s: PositiveFloat = Field(60.0, description="seconds before a stuck broadcast falls back "
                                                                  "to the object store; also how long a rank of an "
                                                                  "expert of several ranks waits for its peers")
    max_staleness: NonNegativeInt = Field(0, description="k > 0: rollouts for steps t+1..t+k run while step t "
                                                         "updates (off-policy by up to k versions); 0: in lockstep")
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack", description="Ray placement strategy of the reserved bundles")
    colocate: bool = Field(True, description="placement only: false puts experts and rollout workers in "
                                             "separate placement groups (cluster.layout says who rolls out)")
    layout: Literal["separate", "colocated"] = Field(
        "separate", description="who rolls out: separate: rollout workers hold inference copies and every new "
                                "version is synced to them; colocated: no rollout workers, each expert's own ranks "
                                "roll out their share with their current weights, then update (no weight sync; "
                                "synchronous only)")
    offload: list[Literal["optimizer", "reference"]] = Field(
        [], description="under layout=colocated: what each expert rank moves to host memory while it rolls out "
                        "and back to its device for the update (the optimizer state, the frozen reference)")
    placement_timeout_s: PositiveFloat = Field(120.0, description="seconds to wait for the bundles; then the run "
                                                                  "stops, naming those it could not place")
    max_restarts: NonNegativeInt = Field(3, description="per actor: Ray restarts it this often, the driver "
                                                        "restores its state")
    optimizer_snapshot_every: PositiveInt = Field(
        1, description="an expert's optimizer state joins the snapshot the driver keeps after at most this many of "
                       "its updates, and whenever a checkpoint is written; the weights join it after every update "
                       "(they are published anyway). A killed expert is restored from the last snapshot with its "
                       "optimizer state and the updates since are made again from their kept inputs (the same "
                       "state, inputs and code: the same result, checked against the latest weights' "
                       "fingerprint). A full fine-tune's AdamW moments are twice its fp32 weights: N > 1 puts them "
                       "through the object store N times less often, for up to N - 1 updates replayed on a restart "
                       "and N - 1 steps' update inputs kept on the driver's node")
    restart_wait_s: PositiveFloat = Field(600.0, description="seconds the driver waits for Ray to restart a dead "
                                                             "actor (a restarted expert loads its model again, "
                                                             "minutes for a large one); then the run stops")
    temp_dir: str | None = Field(None, description="a local Ray's session folder (its logs, sockets and, unless "
                                                   "spill_dir says otherwise, the objects it spills) and every "
                                                   "expert rank's scratch for the optimizer shards it hands to a "
                                                   "checkpoint's writer on another node; None: the system's (/tmp). "
                                                   "A cluster joined at an address keeps its `ray start --temp-dir`")
    spill_dir: str | None = Field(None, description="where a local Ray spills the objects its object store cannot "
                                                    "hold (a checkpoint of a large full fine-tune passes through "
                                                    "it); None: in its session folder. A cluster joined at an "
                                                    "address keeps its `ray start --system-config`")

    @model_validator(mode="after")
    def _sockets_fit_temp_dir(self):
        """Ray keeps its sockets in the session folder under temp_dir, as
        `<temp_dir>/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store`, and a Unix
        socket's path has at most 107 bytes: the folder's absolute path has at most 107 - 64."""
        if self.temp_dir is not None and len(str(Path(self.temp_dir).expanduser().resolve()).encode()) > 43:
            where = Path(self.temp_dir).expanduser().resolve()
            raise ValueError(f"cluster.temp_dir={self.temp_dir!r} ({where}, {len(str(where).encode())} bytes) is too "
                             f"long: Ray's sockets live under it and a socket's path has at most 107 bytes, which "
                             f"leaves 43 for the folder (e.g. /scratch/ray)")
        return self

    @property
    def workers(self) -> int:
        """The rollout workers the layout spawns: none where the experts roll out themselves."""
        return 0 if self.layout == "colocated" else self.rollout_workers


class RolloutConfig(Strict):
    """How a rollout worker pushes its share of a step through its models."""
    batch_size: PositiveInt | None = Field(None, description="samples a rollout worker refines, encodes, samples "
                                           "(twice that many through the transformer under classifier-free "
                                           "guidance), decodes and scores at once: its share of a step goes "
                                           "through in chunks of this many, drawing the same images and "
                                           "log-probs as at once; None: the whole share at once")
    text_cache_mb: NonNegativeFloat = Field(256.0, description="bound on a rollout worker's cache of text "
                                            "features (kept in the text encoder's dtype), in MiB; the least "
                                            "recently used are evicted first; 0: no cache")


class PlanTarget(Strict):
    """The cluster a config is planned for when neither `jointrl plan`'s flags nor a connected Ray
    cluster say otherwise."""
    nodes: PositiveInt = Field(1, description="nodes of the cluster")
    gpus_per_node: NonNegativeInt = Field(8, description="GPUs on each node")
    gpu_memory_gb: PositiveFloat = Field(80.0, description="memory of each GPU, in GB (10^9 bytes)")
    gpu_tflops: PositiveFloat = Field(989.0, description="peak dense bf16 TFLOP/s of each GPU (H100 SXM: 989), "
                                      "for the plan's estimate of each layout's step time")


class PlanConfig(Strict):
    """`jointrl plan`: the memory plan of a config from its models' real architectures."""
    target: PlanTarget = Field(PlanTarget(), description="the cluster the config is planned for by default")
    headroom_gb: NonNegativeFloat = Field(4.0, description="GB of each GPU the plan leaves free for what it "
                                          "does not count (the CUDA context, allocator fragmentation, "
                                          "communication buffers)")


class RewardConfig(Strict):
    """The reward: named terms, each scored by a built-in or a plug-in, summed with their weights."""
    terms: dict[str, TermConfig] | None = Field(None, description="the named reward terms, "
                                                "`reward.terms.<name>: {fn, weight, …}`; None: the task's own "
                                                "(shapes: image, fidelity, style, format)")
    normalize: Literal["none", "per_term"] = Field("none", description="per_term: each term is normalised within "
                                                   "its prompt group before the weighted sum the advantages use, "
                                                   "so no term dominates by its scale")
    timeout_s: PositiveFloat = Field(60.0, description="seconds a reward call may take beside its images' "
                                     "`timeout_per_image_s`; a slower call's term is scored again sample by "
                                     "sample, and the samples it fails on are dropped")
    timeout_per_image_s: NonNegativeFloat = Field(1.0, description="seconds a reward call may take per image it "
                                                  "scores, beside `timeout_s`: the deadline of a call of n images "
                                                  "is timeout_s + n x this (a video task: n clips, each "
                                                  "counted once whatever its frames)")
    max_failed_steps: NonNegativeInt = Field(3, description="steps in a row in which the reward failed on every "
                                             "sample (each term raised, timed out or gave no finite number), so "
                                             "that no update could be made, before the run checkpoints its last "
                                             "step and stops (exit status 3), naming the term, its failed samples "
                                             "and its last error; 0: never stop")
    actors: NonNegativeInt = Field(0, description="default for every term that scores images: K > 0: a pool of K "
                                                  "reward actors per term (its model loaded once per actor); 0: "
                                                  "each rollout worker scores (text terms always, unless their "
                                                  "own `actors` says)")
    resources: Resources = Field(Resources(), description="default for every term: what each reward actor "
                                                          "reserves from Ray")

    @property
    def weights(self) -> dict[str, float]:
        """Every term's weight in the total."""
        return {name: term.weight for name, term in (self.terms or {}).items()}

    @model_validator(mode="after")
    def _calls_go_to_actors(self):
        """`images_per_call` says how a batch is split among a term's reward actors: a term without
        actors has none to split it among."""
        pools = self.pools()
        for name, term in (self.terms or {}).items():
            if term.images_per_call is not None and name not in pools:
                raise ValueError(f"reward.terms.{name}.images_per_call={term.images_per_call}: the term is scored "
                                 f"by each rollout worker, not by reward actors (reward.terms.{name}.actors, "
                                 f"reward.actors); its scorer's own `batch_size` sets its forward passes")
            if term.runtime_env is not None and name not in pools:
                raise ValueError(f"reward.terms.{name}.runtime_env: the term is scored by each rollout worker, in "
                                 f"the worker's environment; set reward.terms.{name}.actors=1 (or more) for reward "
                                 f"actors of its own environment")
        return self

    def pools(self) -> dict[str, tuple[int, Resources]]:
        """The terms scored by reward actors: name -> (how many actors, what each reserves)."""
        out = {}
        for name, term in (self.terms or {}).items():
            k = term.actors if term.actors is not None else self.actors if term.needs_images() else 0
            if k:
                out[name] = (k, term.resources or self.resources)
        return out


class EvaluationConfig(Strict):
    """`jointrl eval`, and evaluation during training: every reward term on the task's held-out sets."""
    per_category: PositiveInt = Field(20, description="shapes: held-out prompts per GenEval category")
    seed: int = Field(1234, description="shapes: fixes the held-out set (not the run's seed)")
    refine: bool = Field(True, description="also score eval prompts refined by the trained refiners (besides "
                                           "unrefined)")
    every: NonNegativeInt = Field(0, description="evaluate every N training steps (and after the last), logged "
                                                 "to metrics as eval/<set>/<term>; 0: never during training")
    max_prompts: PositiveInt | None = Field(None, description="score at most the first N prompts of each set; "
                                                              "None: all")
    batch_size: PositiveInt = Field(16, description="prompts drawn and scored at once (the images of a larger "
                                                    "set are drawn in parts, the same images as at once)")


class PretrainConfig(Strict):
    """`jointrl pretrain`: flow matching of the base generator and text encoder on rendered pairs."""
    steps: PositiveInt = Field(9000, description="flow-matching steps of the base generator and text encoder")
    batch_size: PositiveInt = Field(32, description="image-caption pairs per step")
    lr: PositiveFloat = Field(2e-3, description="learning rate, cosine-decayed to 0 over `steps`")
    ema: float = Field(0.998, ge=0.0, lt=1.0, description="the saved weights are this EMA of the trained ones")
    refiner_steps: PositiveInt = Field(400, description="supervised steps of the refiners on the captions' "
                                                        "details")
    refiner_lr: PositiveFloat = Field(3e-3, description="learning rate of the refiners' supervised start")
    restate_share: float = Field(0.25, ge=0.0, le=1.0, description="share of the refiners' supervised examples "
                                 "that first restate one of the prompt's colours or shapes, as a rewriting LM "
                                 "restates the request before adding detail")
    rewrite_share: float = Field(0.0, ge=0.0, le=1.0, description="share of the refiners' supervised examples "
                                 "that restate the whole request in its usual words (a rare-worded prompt in the "
                                 "words the base reads best), as an instruct LM asked to rewrite a prompt does; the "
                                 "rest are detail segments. For task.compose=replace, with max_new_tokens above the "
                                 "longest prompt's words (a rewrite longer than that is cut)")
    rewrite_shares: dict[str, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(
        default_factory=dict, description="a refiner's own rewrite_share, by id (e.g. {refiner_0: 1.0}: one "
        "rewriter beside detail refiners); a refiner not named has rewrite_share")
    rare_caption_share: float = Field(0.01, ge=0.0, le=1.0, description="under task.rare_wording, the share "
                                      "of the base's captions said in rare synonyms (a long tail); the refiners' "
                                      "supervised start sees both wordings equally")
    degraded_share: float = Field(0.2, ge=0.0, lt=1.0, description="share of low-quality images in the data, "
                                  "never captioned with quality words (shapes.QUALITY_WORDS)")
    threads: PositiveInt = Field(2, description="torch CPU threads")
    seed: int = Field(0, description="seeds the pretraining data and noise")
    out_dir: str = Field("runs/pretrained", description="bases are cached here by a hash of what shapes them")

    def rewrite_share_of(self, refiner_id: str) -> float:
        """The share of `refiner_id`'s supervised examples that restate the whole request."""
        return self.rewrite_shares.get(refiner_id, self.rewrite_share)


class LoggingConfig(Strict):
    """Where metrics and samples go besides RUN_DIR/metrics.jsonl (always written)."""
    tensorboard: bool = Field(False, description="write RUN_DIR/tensorboard/ event files (needs tensorboard)")
    wandb: bool = Field(False, description="log to Weights & Biases, in RUN_DIR/wandb/ (needs wandb)")
    wandb_project: str = Field("jointrl", description="the Weights & Biases project")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="offline works without a network; "
                                                                            "`wandb sync` later")
    images_every: NonNegativeInt = Field(0, description="log sample images with their prompts every N steps "
                                                        "(and the last); 0: never")
    images_per_log: PositiveInt = Field(8, description="images per logged sample grid")
    fps: PositiveFloat = Field(8.0, description="a video task: frames per second of the clips written (sample "
                                                "sheets, `jointrl eval` and `jointrl sample`, TensorBoard, W&B)")
    report: bool = Field(False, description="when training ends, write RUN_DIR/report/ (`jointrl report`: the "
                                            "curves and a captioned sample sheet) and print the two to open first")
    ray_verbose: bool = Field(False, description="Ray's own lines (its start, notices) and the actors' output on "
                                                 "the terminal; false: Ray's lines go to RUN_DIR/ray.log and the "
                                                 "actors' output stays in Ray's session logs (named there)")


class TaskConfig(Strict):
    """The task: where training and evaluation prompts come from, and its default reward."""
    name: Literal["shapes", "shapes_video", "prompts"] = Field(
        "shapes", description="shapes: the embedded toy world; shapes_video: its moving shapes, in clips of "
                              "task.num_frames (4 to 8) frames; prompts: prompt datasets (task.train, task.eval)")
    image_size: PositiveInt = Field(32, description="side of the generated images in pixels (their height where "
                                                    "task.image_width is set)")
    image_width: PositiveInt | None = Field(None, description="width of each image or frame in pixels where it "
                                                              "differs from its height (task.image_size); a video "
                                                              "generator's only (Wan: 416 x 240); None: square")
    num_frames: PositiveInt | None = Field(None, description="frames of each generated clip (a video task: "
                                                             "every sample is a clip of this many frames); "
                                                             "None: every sample is an image")
    train: str | None = Field(None, description="prompts: the training prompts, a file (.txt one per line, "
                                                ".jsonl/.json, .csv, .parquet), a save_to_disk folder or a dataset "
                                                "id; relative paths are read from the config file's folder if "
                                                "there")
    eval: str | dict[str, str] = Field({}, description="prompts: the evaluation set(s), one source or "
                                                       "{name: source}; none may share a prompt with task.train")
    text_field: str = Field("prompt", description="prompts: the field of a record that holds its text (the "
                                                  "other fields travel with it as metadata)")
    split: str = Field("train", description="prompts: the split of a dataset id or a DatasetDict folder for "
                                            "task.train")
    eval_split: str | None = Field(None, description="prompts: the split for task.eval; None: task.split")
    compose: Literal["append", "replace"] = Field(
        "append", description="what the generator's text encoder reads of a refined sample: append: the prompt, "
                              "then each refinement; replace: the refinements alone, in place of the prompt, as "
                              "PromptRL's code feeds its generator the rewrite (a sample no refiner wrote for, "
                              "e.g. one of algorithm.num_skip_refinement, reads the prompt). The reward is always "
                              "scored against the original prompt")
    rare_wording: float = Field(0.0, ge=0.0, le=1.0, description="shapes: the share of training prompts that say "
                                "their colours, shapes, counts and relations in rare synonyms (crimson for red, "
                                "disc for circle, twin for two, west for left), words the base's captions use "
                                "rarely (pretrain.rare_caption_share) and the refiners' supervised start has seen "
                                "as often as the usual ones; its held-out set is also evaluated so worded "
                                "(rare_wording). 0: off, the usual words only")

    def eval_sources(self) -> dict[str, str]:
        """Every evaluation set by name (a single source is named `eval`)."""
        return {"eval": self.eval} if isinstance(self.eval, str) else dict(self.eval)

    @model_validator(mode="after")
    def _sources(self):
        if self.name == "prompts" and not self.train:
            raise ValueError("task.name=prompts needs task.train (a prompt file or dataset id)")
        if self.rare_wording and self.name != "shapes":
            raise ValueError(f"task.rare_wording={self.rare_wording} is a setting of task.name=shapes only "
                             f"(task.name={self.name} has no rare wording): set task.rare_wording=0")
        return self

    @model_validator(mode="after")
    def _clips(self):
        from tasks.shapes_video import FRAMES
        if self.name == "shapes_video" and (self.num_frames is None or not FRAMES[0] <= self.num_frames <= FRAMES[1]):
            raise ValueError(f"task.num_frames={self.num_frames}: task.name=shapes_video draws clips of "
                             f"{FRAMES[0]} to {FRAMES[1]} frames")
        return self


class Config(Strict):
    """A whole run: one section per concern."""
    experts: ExpertsConfig = Field(ExpertsConfig(), description="the refiners and the generator")
    algorithm: AlgorithmConfig = Field(AlgorithmConfig(), description="groups, credit and clipping")
    trainer: TrainerConfig = Field(TrainerConfig(), description="steps, prompts, seed and checkpoints")
    cluster: ClusterConfig = Field(ClusterConfig(), description="Ray: actors, placement and weight sync")
    reward: RewardConfig = Field(RewardConfig(), description="the reward function and its terms' weights")
    task: TaskConfig = Field(TaskConfig(), description="the task and its image size")
    rollout: RolloutConfig = Field(RolloutConfig(), description="how rollout workers batch their share of a step")
    evaluation: EvaluationConfig = Field(EvaluationConfig(), description="`jointrl eval`'s held-out set")
    plan: PlanConfig = Field(PlanConfig(), description="`jointrl plan`: the cluster a config is planned for")
    pretrain: PretrainConfig = Field(PretrainConfig(), description="`jointrl pretrain` of the base models")
    logging: LoggingConfig = Field(LoggingConfig(), description="metrics and images besides metrics.jsonl")

    @model_validator(mode="after")
    def _runtime_envs_need_ray(self):
        """A term's `runtime_env` is its reward actors' Ray environment: inline, nothing applies it."""
        if self.cluster.mode == "inline":
            for name, term in (self.reward.terms or {}).items():
                if term.runtime_env is not None:
                    raise ValueError(f"reward.terms.{name}.runtime_env: cluster.mode=inline scores every term in "
                                     f"this process, where no runtime_env applies; set cluster.mode=ray")
        return self

    @model_validator(mode="after")
    def _default_terms(self):
        """The task's own terms where none are set, and each refiner's `owns` where it sets none."""
        from tasks import default_terms
        if self.reward.terms is None:
            self.reward.terms = {name: TermConfig(**t) for name, t in default_terms(self.task.name).items()}
        if self.algorithm.credit == "shared":  # its credit reads no owns: names of no term are let go
            for spec in self.experts.sections().values():
                if spec.owns:
                    spec.owns = [t for t in spec.owns if t in self.reward.terms] or None
        text = [t for t, term in self.reward.terms.items() if not term.needs_images()]
        n = len(self.experts.refiners)
        for i, r in enumerate(self.experts.refiners):
            if r.owns is None:
                r.owns = default_owns(i, n, text) or list(self.reward.terms)
        return self

    @model_validator(mode="after")
    def _rewrite_shares_name_refiners(self):
        refiners = [f"refiner_{i}" for i in range(len(self.experts.refiners))]
        unknown = sorted(set(self.pretrain.rewrite_shares) - set(refiners))
        if unknown:
            raise ValueError(f"pretrain.rewrite_shares names {unknown}, not a refiner of this run: valid keys "
                             f"here: {refiners or 'none (the run has no refiner)'}")
        return self

    @model_validator(mode="after")
    def _replace_needs_refiners(self):
        if self.task.compose == "replace" and not self.experts.active_refiners():
            raise ValueError("task.compose=replace feeds the generator the refiners' text in place of the prompt, but "
                             "this run has no refiner (experts.generator_only=true or experts.n_refiners=0): "
                             "valid values here: task.compose=append")
        return self

    @model_validator(mode="after")
    def _models_read_the_prompts(self):
        """The tiny kinds read only the shapes words: a prompt file needs models with tokenizers."""
        if self.task.name != "prompts":
            return self
        tiny = [f"experts.{e}.model.kind={s.model.kind}" for e, s in self.experts.sections().items()
                if s.model.kind in ("tiny_lm", "tiny_dit", "tiny_video_dit")
                and (e == "generator" or e in self.experts.active_refiners())]
        if tiny:
            raise ValueError(f"task.name=prompts needs models with tokenizers (hf_causal_lm refiners, a "
                             f"diffusers_flow generator; `tiny:qwen2` and `tiny:sd3` for tiny random ones), got "
                             f"{', '.join(tiny)}: the tiny kinds read only the shapes words")
        return self

    @model_validator(mode="after")
    def _owned_terms(self):
        terms = self.reward.weights
        for eid, spec in self.experts.sections().items():
            bad = [t for t in spec.owns or [] if t not in terms]
            if bad:
                raise ValueError(f"experts.{eid}.owns names {bad}, not a reward term ({sorted(terms)})")
            if isinstance(spec, RefinerConfig) and self.algorithm.credit == "per_expert" and not spec.owns:
                raise ValueError(f"experts.{eid}.owns is empty, but credit=per_expert needs a term")
        m = self.experts.generator.model
        if m.kind in ("tiny_dit", "tiny_video_dit") and self.task.image_size % m.patch:
            raise ValueError("task.image_size must be a multiple of experts.generator.model.patch")
        square = self.task.image_width in (None, self.task.image_size)
        if self.experts.generator.model.kind == "tiny_dit" and not square:
            raise ValueError(f"task.image_width={self.task.image_width}: the tiny DiT's images are square "
                             f"(task.image_size={self.task.image_size}); unset task.image_width")
        return self

    @model_validator(mode="after")
    def _tiny_frames(self):
        """A tiny DiT makes images, its video kind clips of task.num_frames, patched whole in time."""
        m, frames = self.experts.generator.model, self.task.num_frames
        if m.kind == "tiny_dit" and frames is not None:
            raise ValueError(f"task.num_frames={frames} asks for clips, but experts.generator.model.kind=tiny_dit "
                             f"makes images: use kind tiny_video_dit (or task.num_frames=null)")
        if m.kind == "tiny_video_dit" and (frames is None or frames % m.frame_patch):
            raise ValueError(f"experts.generator.model.kind=tiny_video_dit makes clips of task.num_frames frames in "
                             f"patches of experts.generator.model.frame_patch={m.frame_patch}: task.num_frames "
                             f"({frames}) must be a multiple of it")
        return self

    @model_validator(mode="after")
    def _from_base(self):
        """`experts.base`: every expert whose `init` is not set (not even to null) takes its file there."""
        if self.experts.base is None:
            return self
        from driver.bases import init_files
        specs = {**self.experts.sections(), "text_encoder": self.experts.text_encoder}
        try:
            files = init_files(self, self.experts.base, {n for n, spec in specs.items() if "init" not in spec.model_fields_set})
        except ValueError as e:
            raise ValueError(f"experts.base: {e}") from None
        for name, path in files.items():
            specs[name].init = str(path)
        return self

    @model_validator(mode="after")
    def _gangs(self):
        """An expert of several ranks needs a sample per rank each step, and its own process group."""
        for eid, spec in self.experts.sections().items():
            ranks = spec.parallel.ranks
            if spec.parallel.strategy == "ddp" and (spec.parallel.defer_gradient_sync
                                                    or not spec.parallel.reshard_after_forward):
                key = "defer_gradient_sync=true" if spec.parallel.defer_gradient_sync else "reshard_after_forward=false"
                raise ValueError(f"experts.{eid}.parallel.{key} is an fsdp setting; experts.{eid}.parallel.strategy "
                                 f"is ddp")
            if ranks == 1:
                continue
            skipped = self.algorithm.num_skip_refinement if isinstance(spec, RefinerConfig) else 0
            samples = self.trainer.prompts_per_step * (self.algorithm.group_size - skipped)
            if ranks > samples:
                raise ValueError(f"experts.{eid}.parallel.ranks={ranks} is more than the {samples} samples {eid} "
                                 f"learns from each step (trainer.prompts_per_step x (algorithm.group_size"
                                 f"{' - algorithm.num_skip_refinement' if skipped else ''})): every rank needs a share")
            if self.cluster.sync == "collective":
                raise ValueError(f"experts.{eid}.parallel.ranks={ranks} with cluster.sync=collective: an expert of "
                                 f"several ranks publishes through the object store (cluster.sync=object_store)")
        return self

    @model_validator(mode="after")
    def _layout(self):
        """Colocated experts roll out with the weights they hold now: nothing runs ahead of them."""
        c = self.cluster
        if c.layout == "colocated" and c.max_staleness:
            raise ValueError(f"cluster.max_staleness={c.max_staleness} with cluster.layout=colocated: the experts "
                             f"roll out with their current weights, so a step cannot run ahead of the updates; "
                             f"set cluster.max_staleness=0 or cluster.layout=separate")
        if c.layout == "colocated" and self.evaluation.every:
            raise ValueError(f"evaluation.every={self.evaluation.every} with cluster.layout=colocated: evaluation "
                             f"during training draws on a rollout worker, which this layout has none of; set "
                             f"evaluation.every=0 and run `jointrl eval RUN_DIR` on its checkpoints")
        if c.layout == "colocated" and self.experts.generator_low is not None:
            raise ValueError("experts.generator_low with cluster.layout=colocated: a colocated generator rank "
                             "samples with the one transformer it trains, and the low-noise one is another "
                             "expert's (not done here); set cluster.layout=separate or experts.generator_low=null")
        engines = [e for e, spec in self.experts.active_refiners().items() if spec.engine == "vllm"]
        for e in engines:
            if (kind := self.experts.active_refiners()[e].model.kind) != "hf_causal_lm":
                raise ValueError(f"experts.{e}.engine=vllm serves a Hugging Face causal LM (model.kind="
                                 f"hf_causal_lm), not model.kind={kind}: set experts.{e}.engine=hf")
        if c.layout == "colocated" and engines:
            raise ValueError(f"experts.{engines[0]}.engine=vllm with cluster.layout=colocated: a colocated refiner "
                             f"rank refines with the model it trains, and there is no rollout worker to hold an "
                             f"engine; set engine=hf or cluster.layout=separate")
        if c.offload and c.layout != "colocated":
            raise ValueError(f"cluster.offload={c.offload} with cluster.layout={c.layout}: only a rank that rolls "
                             f"out and then updates (cluster.layout=colocated) has a phase to offload for")
        sharded = [e for e, spec in self.experts.sections().items()
                   if spec.parallel.ranks > 1 and spec.parallel.strategy == "fsdp"
                   and (e == "generator" or e in self.experts.active_refiners())]
        if c.offload and sharded:
            raise ValueError(f"cluster.offload={c.offload} with experts.{sharded[0]}.parallel.strategy=fsdp: an "
                             f"fsdp rank's shards of the optimizer state and reference stay on its device (moving "
                             f"them is not done here); set cluster.offload=[] or strategy=ddp")
        return self

    def owners(self) -> dict[str, list[str]]:
        """Reward term -> the refiners that own it."""
        out: dict[str, list[str]] = {}
        for eid, r in self.experts.active_refiners().items():
            for t in r.owns:
                out.setdefault(t, []).append(eid)
        return out

    def expert(self, expert_id: str) -> RefinerConfig | GeneratorConfig:
        return self.experts.sections()[expert_id]

    def ranks(self, expert_id: str) -> int:
        """The processes expert `expert_id` runs on: its `parallel.ranks` under Ray, one inline."""
        return self.expert(expert_id).parallel.ranks if self.cluster.mode == "ray" else 1

    def text_len(self) -> int:
        """Longest text the tiny text encoder reads: <bos> prompt, then <sep> and each refiner's
        tokens, cut at its max_sequence_length (tasks.base.Vocabulary.compose)."""
        composed = 1 + MAX_PROMPT_WORDS + sum(1 + r.max_new_tokens for r in self.experts.active_refiners().values())
        return min(composed, self.experts.text_encoder.max_sequence_length)


def default_owns(i: int, n: int, text: list[str]) -> list[str]:
    """The text terms refiner i of n owns when its `owns` is unset: the j-th text term goes to
    refiner j mod n, so every text term has an owner and, with fewer terms than refiners, refiner i
    owns the (i mod terms)-th (a third refiner of a preset with `format` and `faithful` owns
    `format`, one refiner owns both); none where there is no text term."""
    return [t for j, t in enumerate(text) if j % n == i] or ([text[i % len(text)]] if text else [])


def resolve_config(source: str = "shapes", overrides: list[str] = ()) -> Config:
    """The validated config of a preset name or YAML path plus `dotted.key=value` overrides, without
    the preflight checks (what `jointrl config show` prints)."""
    from driver import overrides as sets, presets
    tree = sets.first_refiners(with_default_terms(presets.load_tree(source), overrides), list(overrides))
    return validated(sets.apply(tree, list(overrides)))


def with_default_terms(tree: dict, overrides) -> dict:
    """`tree` with its task's default reward terms written out when an override changes one of
    them by its dotted key (`reward.terms.style.weight=0`) and the tree names no terms: so the key
    changes that term and keeps the others, as it would in a preset that lists them."""
    from tasks import default_terms
    if not any(item.startswith("reward.terms.") for item in overrides) or (tree.get("reward") or {}).get("terms"):
        return tree
    try:
        terms = default_terms((tree.get("task") or {}).get("name", "shapes"))
    except ValueError:
        return tree
    return {**tree, "reward": {**(tree.get("reward") or {}), "terms": terms}}


def validated(tree: dict) -> Config:
    """The Config of a tree, or a SettingError naming every bad key."""
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise SettingError(describe(e)) from None


def invalid(problems: list[str]) -> str:
    """The one paragraph of a config error: `key: problem` parts."""
    return "invalid config: " + "; ".join(problems) + ". Nothing was started."


def describe(error: ValidationError) -> str:
    parts = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"]) or "config"
        got = f" (got {err['input']!r})" if not isinstance(err.get("input"), dict) else ""
        parts.append(f"{key}: {err['msg']}{got}")
    return invalid(parts)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(), sort_keys=False)
