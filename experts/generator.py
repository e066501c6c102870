"""The image generator: the config of the flow-matching generator expert, its model kinds, and its kind.

The generator turns the (refined) prompt into an image with a flow-matching model sampled as an SDE,
and learns from every reward term (Flow-GRPO). Its kinds are a tiny DiT (`tiny_dit`), its video form
(`tiny_video_dit`: clips of task.num_frames frames, patched in time and space) and a diffusers
flow-matching pipeline of a supported family (`diffusers_flow`: experts/families.py). Pure: no
driver, cluster or Ray imports; files, models and packages named here are checked by
driver/preflight.py.
"""
from __future__ import annotations

from typing import Annotated, Callable, Literal

import torch
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from algorithm.losses import GeneratorObjective, generator_backward, trained_steps
from common.config import Resources, Strict
from common.seeding import derive_seed
from experts.build import ExpertKind
from experts.devices import to_device
from experts.spec import LoraConfig, ParallelConfig, default_kind
from experts.trajectories import Trajectories, device_tensors
from experts.weights import as_tensor


class TinyDiTConfig(Strict):
    """A tiny DiT-style velocity model on patchified images (experts/dit.py)."""
    kind: Literal["tiny_dit"] = Field("tiny_dit", description="a tiny DiT-style flow-matching model")
    d_model: PositiveInt = Field(64, description="width of the transformer")
    n_layers: PositiveInt = Field(2, description="transformer blocks")
    n_heads: PositiveInt = Field(4, description="attention heads per block")
    patch: PositiveInt = Field(4, description="side of an image patch in pixels (task.image_size must be a multiple)")


class TinyVideoDiTConfig(Strict):
    """The tiny DiT on clips (experts/dit.py): 3D patches of `frame_patch` frames by `patch` pixels."""
    kind: Literal["tiny_video_dit"] = Field(description="a tiny DiT on clips of task.num_frames frames, "
                                                        "patched in time and space")
    d_model: PositiveInt = Field(64, description="width of the transformer")
    n_layers: PositiveInt = Field(2, description="transformer blocks")
    n_heads: PositiveInt = Field(4, description="attention heads per block")
    patch: PositiveInt = Field(4, description="side of a patch in pixels (task.image_size must be a multiple)")
    frame_patch: PositiveInt = Field(2, description="frames of a patch (task.num_frames must be a multiple)")


class DiffusersFlowConfig(Strict):
    """A diffusers flow-matching pipeline of a supported family (SD3, FLUX.1, FLUX.2 klein, Qwen-Image,
    Wan: experts/families.py), chosen by its model_index.json; images are task.image_size on a side,
    a video model's clips task.num_frames frames of task.image_size x task.image_width."""
    kind: Literal["diffusers_flow"] = Field(description="a diffusers flow-matching pipeline, its family read "
                                                        "from its model_index.json (needs diffusers, "
                                                        "transformers and peft)")
    path: str = Field(description="a local pipeline directory (with model_index.json) or a hub id 'org/name', "
                                  "fetched when loaded")
    revision: str | None = Field(None, description="the hub revision to load (a branch, tag or commit hash; pin "
                                                   "a commit for runs that repeat); None: the default branch")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the weights and compute; "
                                                  "what trains is kept in fp32 (with its gradients and AdamW "
                                                  "moments) and computed in this dtype")
    guidance_scale: float = Field(1.0, ge=1.0, description="> 1: true classifier-free guidance against the empty "
                                                           "prompt (SD3's and FLUX.2 klein's guidance_scale, "
                                                           "FLUX.1's and Qwen-Image's true_cfg_scale); 1: none")
    guidance_scale_2: float | None = Field(None, ge=1.0, description="Wan2.2-A14B: the guidance of its low-noise "
                                                                     "transformer (the pipeline's guidance_scale_2); "
                                                                     "None: guidance_scale")
    embedded_guidance: PositiveFloat = Field(3.5, description="the guidance a guidance-distilled transformer reads "
                                                              "through its guidance embedding (FLUX.1-dev's "
                                                              "guidance_scale); unused by models without one")
    max_sequence_length: PositiveInt = Field(256, description="text tokens of the prompt the transformer reads "
                                                              "(T5's for SD3 and FLUX.1, padded: a model without "
                                                              "T5 pads with zeros)")
    lora: LoraConfig | None = Field(None, description="a LoRA adapter on the transformer to train instead of "
                                                      "the full model; None: full fine-tuning")


class GeneratorConfig(Strict):
    """The generator expert (`experts.generator`): its model, its sampler and how it learns."""
    train: bool = Field(True, description="false: prompt-only mode, the generator stays at version 0")
    owns: list[str] | None = Field(None, description="reward terms it learns from under per_expert or "
                                                     "counterfactual credit; None: all of them")
    lr: PositiveFloat = Field(3e-4, description="learning rate (AdamW)")
    update_every: PositiveInt = Field(1, description="update once every this many steps")
    kl_beta: NonNegativeFloat = Field(0.01, description="weight of the KL penalty to the initial (reference) "
                                                        "model; 0: none")
    kl_form: Literal["exact", "flow_grpo"] = Field("exact", description="exact: the exact KL between the policy's "
                                                    "and the reference's step Gaussians; flow_grpo: Flow-GRPO's, "
                                                    "that KL times |delta sigma| (the form its beta values assume)")
    clip_eps: PositiveFloat = Field(1e-4, description="PPO clip of the probability ratio to the rollout's "
                                                      "log-probs (per denoising step)")
    noise_level: PositiveFloat = Field(0.7, description="SDE noise scale of the sampler (Flow-GRPO's a); "
                                                        "larger explores more")
    sample_steps: PositiveInt = Field(8, description="denoising steps per image")
    sde_window: list[NonNegativeInt] | None = Field(None, description="[start, end): SDE sampling (and "
                                                    "training) on these steps only, ODE elsewhere "
                                                    "(Flow-GRPO-Fast); None: all steps")
    train_final_step: bool = Field(True, description="false: the last (sigma -> 0) step is sampled but not trained "
                                                     "(Flow-GRPO's default: that step's std is tiny, its ratio "
                                                     "unstable)")
    same_initial_noise: bool = Field(False, description="one initial noise shared by a prompt's group (Flow-GRPO's "
                                                        "same_latent); false: each sample its own")
    train_cfg: bool = Field(True, description="false: the update evaluates the conditional velocity alone, "
                                              "without classifier-free guidance, even where sampling used it "
                                              "(the ratio then starts away from 1)")
    micro_batch: PositiveInt | None = Field(None, description="transitions (sample x step) per backward pass of "
                                                              "the update; None: one step of every sample. Memory "
                                                              "grows with it, not with the trained steps")
    init: str | None = Field(None, description="a safetensors checkpoint to start from (a base from `jointrl "
                                               "pretrain`); None: the model's own initial weights")
    resources: Resources = Field(Resources(), description="what this expert's actor (each rank's) reserves from Ray")
    parallel: ParallelConfig = Field(ParallelConfig(), description="the expert across several processes: ranks "
                                                                   "and strategy (ddp, fsdp)")
    model: Annotated[TinyDiTConfig | TinyVideoDiTConfig | DiffusersFlowConfig, Field(discriminator="kind")] = Field(
        TinyDiTConfig(), description="the generator's model, by `kind`; a section without kind is tiny_dit")

    _kind = model_validator(mode="before")(default_kind("tiny_dit"))

    @model_validator(mode="after")
    def _window(self):
        w = self.sde_window
        if w is not None and (len(w) != 2 or not w[0] < w[1] <= self.sample_steps):
            raise ValueError(f"sde_window {w} must be [start, end) with start < end <= sample_steps ({self.sample_steps})")
        if not self.train_final_step and (w or [0, self.sample_steps])[0] >= self.sample_steps - 1:
            raise ValueError(f"train_final_step=false leaves no step of sde_window {w} to train")
        return self


LOW_NOISE = "generator_low"  # the expert id of Wan2.2-A14B's low-noise transformer, when it is an expert of its own


def transformer_part(config, expert_id: str) -> str | None:
    """Which of a two-transformer model's transformers expert `expert_id` holds: "high" (the
    generator) or "low" (`experts.generator_low`) when the two are experts of their own; None when
    the generator holds all of its model."""
    if config.experts.generator_low is None:
        return None
    return "low" if expert_id == LOW_NOISE else "high"


class GeneratorKind(ExpertKind):
    """The generator learns from every sample's trajectory, with Flow-GRPO's loss (algorithm/losses.py).
    Under `experts.generator_low` the generator and generator_low are each one transformer of the
    same model (`part`), each learning from the transitions its transformer denoised, with the
    generator's advantages (algorithm/credit.py), from the same trajectories."""

    def __init__(self, config, expert_id: str, spec):
        super().__init__(config, expert_id, spec)
        self.part = transformer_part(config, expert_id)

    def fresh_model(self, device: torch.device) -> torch.nn.Module:
        m = self.spec.model
        if m.kind == "diffusers_flow":
            from common.hub import local_model
            from experts.families import family_module
            # the generator's seed for both parts too: their adapters start as one expert's of both would
            seed = derive_seed(self.config.trainer.seed, "init", "generator")
            return family_module(local_model(m.path, m.revision)).Velocity(
                self.spec, seed, device, **({"part": self.part} if self.part else {}))
        from experts.dit import TinyDiT
        video = {"frames": self.config.task.num_frames, "frame_patch": m.frame_patch} if m.kind == "tiny_video_dit" else {}
        return TinyDiT(self.config.task.image_size, 3, m.patch, m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                       d_text=self.config.experts.text_encoder.d_model, **video)

    def update_inputs(self, advantages, refined, outputs: list) -> tuple:
        """(its advantage of every sample, then the trajectories of every rollout shard)."""
        return (advantages.generator, *[o.trajectories for o in outputs])

    def merge(self, model, shards: list[Trajectories], device: torch.device) -> dict:
        """All trajectories of every shard as one batch, their conditioning joined as the model needs
        it (the tiny DiT and Qwen-Image re-pad their text features to a common length), without the
        empty prompt's, which every shard holds once, unless the update trains with guidance
        (`train_cfg`). An expert of one transformer of two (`part`) trains the SDE steps that
        transformer denoised only, and its loss averages over those."""
        first = shards[0]
        sde, sigmas = as_tensor(first.sde), as_tensor(first.sigmas)
        if self.part:
            sde = sde & model.denoises(sigmas[:-1]).to(sde.device)
            if not len(trained_steps(sde, self.spec.train_final_step)):
                raise ValueError(f"experts.{self.expert_id}: none of the trained steps is denoised by its "
                                 f"{self.part}-noise transformer (sigmas {sigmas.tolist()}); change "
                                 f"experts.generator.sample_steps or experts.generator.sde_window")
        return to_device({"states": torch.cat([as_tensor(s.states) for s in shards]),
                          "state_steps": as_tensor(first.state_steps),
                          "logps": torch.cat([as_tensor(s.logps) for s in shards]),
                          "cond": model.merge_conditions([device_tensors(s.cond, s.dtypes) for s in shards]),
                          "shared_cond": device_tensors(first.shared_cond, first.dtypes) if self.spec.train_cfg else {},
                          "sigmas": sigmas, "sde": sde}, device)

    def backward(self, model, reference, batch: dict, adv: torch.Tensor, *, rows: torch.Tensor | None = None,
                 before_last: Callable[[], None] | None = None, pad_to: int | None = None):
        s = self.spec
        return generator_backward(model, reference, batch, adv, obj=GeneratorObjective(
            s.noise_level, s.clip_eps, s.kl_beta, s.kl_form, s.train_final_step, s.micro_batch), samples=rows,
            before_last=before_last, pad_to=pad_to)
