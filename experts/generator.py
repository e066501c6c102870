"""The image generator: the config of the flow-matching generator expert, its model kinds, and its kind.

The generator turns the (refined) prompt into an image with a flow-matching model sampled as an SDE,
and learns from every reward term (Flow-GRPO). Its kinds are a tiny DiT (`tiny_dit`) and a diffusers
SD3-family model (`diffusers_flow`). Pure: no driver, cluster or Ray imports; files, models and
packages named here are checked by driver/preflight.py.
"""
from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from algorithm.losses import generator_loss
from experts.build import ExpertKind
from experts.devices import to_device
from experts.seeding import derive_seed
from experts.spec import LoraConfig, Resources, Strict, default_kind


class TinyDiTConfig(Strict):
    """A tiny DiT-style velocity model on patchified images (experts/dit.py)."""
    kind: Literal["tiny_dit"] = Field("tiny_dit", description="a tiny DiT-style flow-matching model")
    d_model: PositiveInt = Field(64, description="width of the transformer")
    n_layers: PositiveInt = Field(2, description="transformer blocks")
    n_heads: PositiveInt = Field(4, description="attention heads per block")
    patch: PositiveInt = Field(4, description="side of an image patch in pixels (task.image_size must be a multiple)")


class DiffusersFlowConfig(Strict):
    """A diffusers flow-matching model, SD3 family (transformer, CLIP/T5 text encoders, VAE, a
    FlowMatchEulerDiscreteScheduler with shift); images are task.image_size on a side."""
    kind: Literal["diffusers_flow"] = Field(description="a diffusers SD3-family flow-matching "
                                                        "pipeline (needs diffusers, transformers and peft)")
    path: str = Field(description="a local pipeline directory (with model_index.json) or a hub id 'org/name', "
                                  "fetched when loaded")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the weights and compute")
    guidance_scale: float = Field(1.0, ge=1.0, description="> 1: classifier-free guidance against the empty "
                                                           "prompt; 1: none")
    max_sequence_length: PositiveInt = Field(256, description="T5 tokens of the prompt (a model without T5 pads "
                                                              "with zeros)")
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
    clip_eps: PositiveFloat = Field(1e-4, description="PPO clip of the probability ratio to the rollout's "
                                                      "log-probs (per denoising step)")
    noise_level: PositiveFloat = Field(0.7, description="SDE noise scale of the sampler (Flow-GRPO's a); "
                                                        "larger explores more")
    sample_steps: PositiveInt = Field(8, description="denoising steps per image")
    sde_window: list[NonNegativeInt] | None = Field(None, description="[start, end): SDE sampling (and "
                                                    "training) on these steps only, ODE elsewhere "
                                                    "(Flow-GRPO-Fast); None: all steps")
    init: str | None = Field(None, description="a safetensors checkpoint to start from (a base from `jointrl "
                                               "pretrain`); None: the model's own initial weights")
    resources: Resources = Field(Resources(), description="what this expert's actor reserves from Ray")
    model: Annotated[TinyDiTConfig | DiffusersFlowConfig, Field(discriminator="kind")] = Field(
        TinyDiTConfig(), description="the generator's model, by `kind`; a section without kind is tiny_dit")

    _kind = model_validator(mode="before")(default_kind("tiny_dit"))

    @model_validator(mode="after")
    def _window(self):
        w = self.sde_window
        if w is not None and (len(w) != 2 or not w[0] < w[1] <= self.sample_steps):
            raise ValueError(f"sde_window {w} must be [start, end) with start < end <= sample_steps ({self.sample_steps})")
        return self


class GeneratorKind(ExpertKind):
    """The generator learns from every sample's trajectory, with Flow-GRPO's loss (algorithm/losses.py)."""

    def fresh_model(self) -> torch.nn.Module:
        m = self.spec.model
        if m.kind == "diffusers_flow":
            from experts.sd3 import SD3Velocity
            return SD3Velocity(self.spec, derive_seed(self.config.trainer.seed, "init", self.expert_id))
        from experts.dit import TinyDiT
        return TinyDiT(self.config.task.image_size, 3, m.patch, m.d_model, m.n_layers, m.n_heads,
                       self.config.experts.text_encoder.d_model)

    def update_inputs(self, advantages, refined, outputs: list) -> tuple:
        """(its advantage of every sample, then the trajectories of every rollout shard)."""
        return (advantages.generator, *[o.trajectories for o in outputs])

    def merge(self, model, shards: list[dict], device: torch.device) -> dict:
        """All trajectories of every shard as one batch, their conditioning joined as the model needs
        it (the tiny DiT re-pads its text features to a common length)."""
        return to_device({"states": torch.cat([torch.tensor(s["states"]) for s in shards]),
                          "logps": torch.cat([torch.tensor(s["logps"]) for s in shards]),
                          "cond": model.merge_conditions([{k: torch.tensor(v) for k, v in s["cond"].items()}
                                                          for s in shards]),
                          "sigmas": torch.tensor(shards[0]["sigmas"]), "sde": torch.tensor(shards[0]["sde"])}, device)

    def loss(self, model, reference, batch: dict, adv: torch.Tensor):
        s = self.spec
        return generator_loss(model, reference, batch, adv, s.noise_level, s.clip_eps, s.kl_beta)
