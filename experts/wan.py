"""The Wan family (`WanPipeline`: Wan2.1-T2V 1.3B and 14B, Wan2.2-T2V-A14B, Wan2.2-TI2V-5B text to
video): a 3D-patch DiT on the Wan VAE's latent video (C, F', H', W'), F' = (F - 1) / 4 + 1 latent
frames of H / s x W / s cells (s = 8, 16 for Wan2.2's VAE), read by a UMT5 text encoder.

As diffusers' pipeline: prompts cleaned (ftfy where installed, HTML unescaped, whitespace squeezed),
UMT5's last hidden states cut at each prompt's length and zero-padded to max_sequence_length;
timestep = sigma * num_train_timesteps in float32, one per sample, or one per latent token
(F' x H'/2 x W'/2, every one the same) where the pipeline's `expand_timesteps` is set (TI2V-5B);
guidance against the empty prompt; latents decoded as z * latents_std + latents_mean per channel.
Wan2.2-A14B holds two transformers: `transformer` (high noise) denoises the steps whose timestep is
at least boundary_ratio x num_train_timesteps, `transformer_2` (low noise) the others, each with its
own guidance scale (`guidance_scale`, `guidance_scale_2`); both are trained, by one expert
(`experts.generator`) or each by its own (`experts.generator` the high-noise one and
`experts.generator_low` the low-noise one, each on the steps it denoises).

Sigmas: the Wan checkpoints ship a UniPC multistep scheduler; jointrl's sampler is the Euler step of
the flow (Flow-GRPO's SDE, whose ODE limit is Euler's), so the sigmas are those of diffusers'
FlowMatchEulerDiscreteScheduler with the checkpoint's shift (UniPC's `flow_shift`, 3.0 for the T2V
models at 480p) and its num_train_timesteps: what WanPipeline samples when given that scheduler.

A clip decodes to (B, F, 3, H, W) in [-1, 1], frames first, the video contract of a sample.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from common.loading import component
from experts.flow_family import NEGATIVE, FamilyFrontEnd, FamilyVelocity, split_negative

HIGH, LOW = "transformer", "transformer_2"


def frame_counts(temporal: int, up_to: int = 81) -> list[int]:
    """The frame counts a Wan VAE of temporal compression `temporal` takes: k * temporal + 1."""
    return list(range(1, up_to + 1, temporal))


def check_clip(task, temporal: int, spatial: int, path: str) -> tuple[int, int, int]:
    """(F', H', W') of the task's clips (task.num_frames frames of task.image_size x task.image_width)
    for a Wan VAE of `temporal` and `spatial` compression; ValueError naming the key a Wan model at
    `path` cannot take. Every Wan transformer reads 2x2 patches of latent cells (patch_size
    (1, 2, 2)), so each side is a multiple of twice the spatial compression."""
    n = task.num_frames
    if n is None:
        raise ValueError(f"task.num_frames is not set, but experts.generator.model.path={path} is a video model "
                         f"(WanPipeline): set task.num_frames to {temporal}k+1 frames (e.g. 33 or 81)")
    if (n - 1) % temporal:
        below = n - (n - 1) % temporal
        raise ValueError(f"task.num_frames={n}: the Wan VAE of experts.generator.model.path={path} takes "
                         f"{temporal}k+1 frames ({', '.join(map(str, frame_counts(temporal)[1:6]))}, ..., 81); "
                         f"nearest {below} or {below + temporal}")
    multiple = 2 * spatial
    height, width = task.image_size, task.image_width or task.image_size
    for key, side in (("task.image_size", height), ("task.image_width", width)):
        if side % multiple:
            raise ValueError(f"{key}={side} is not a multiple of {multiple}, the pixels per latent patch of "
                             f"experts.generator.model.path={path}")
    return (n - 1) // temporal + 1, height // spatial, width // spatial


def euler_scheduler(config):
    """diffusers' FlowMatchEulerDiscreteScheduler of a Wan scheduler config (a mapping): its
    num_train_timesteps and its shift (UniPC's `flow_shift`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config["num_train_timesteps"],
                                           shift=config.get("flow_shift", config.get("shift", 1.0)))


def high_noise(sigma: torch.Tensor, num_train_timesteps: int, boundary: float) -> torch.Tensor:
    """Whether Wan2.2-A14B's high-noise transformer denoises at `sigma`: the pipeline's
    t >= boundary_timestep, t = sigma x num_train_timesteps in float32 (`boundary`: boundary_ratio x
    num_train_timesteps)."""
    return sigma.float() * num_train_timesteps >= boundary


def split_steps(sigmas: torch.Tensor, steps: list[int], num_train_timesteps: int,
                boundary_ratio: float) -> dict[str, list[int]]:
    """{"high", "low": the steps among `steps` each transformer of Wan2.2-A14B denoises}."""
    high = high_noise(sigmas, num_train_timesteps, boundary_ratio * num_train_timesteps)
    return {"high": [t for t in steps if high[t]], "low": [t for t in steps if not high[t]]}


def transformer_steps(folder, sample_steps: int, steps: list[int], boundary_ratio: float):
    """({"high", "low": the steps among `steps` each transformer denoises}, the sampling sigmas) under
    the Euler scheduler of the pipeline whose config files are in `folder`, at `sample_steps` steps."""
    scheduler = euler_scheduler(json.loads((Path(folder) / "scheduler" / "scheduler_config.json").read_text()))
    scheduler.set_timesteps(sample_steps)
    return split_steps(scheduler.sigmas, steps, scheduler.config.num_train_timesteps, boundary_ratio), \
        scheduler.sigmas


class Velocity(FamilyVelocity):
    """Wan's velocity. Under Wan2.2-A14B it holds the transformers of its `part`: "both" (one expert
    trains both), "high" (`transformer` alone: `experts.generator` when `experts.generator_low` is
    set) or "low" (`transformer_2` alone: `experts.generator_low`); a rollout worker joins a high and
    a low part into the pipeline's velocity (`joined`)."""
    # Flow-GRPO's Wan LoRA targets: the self- and cross-attention projections of every block
    LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
    # what a velocity built without __init__ (the memory plan's, on the meta device) reads
    expand_timesteps, num_train_timesteps, boundary, part = False, 1000, None, "both"

    @staticmethod
    def conditioning(transformer: dict, model) -> tuple[dict, int]:
        """UMT5's last hidden states, zero-padded to max_sequence_length."""
        return {"prompt_embeds": ((model.max_sequence_length, transformer["text_dim"]), None)}, \
            model.max_sequence_length

    def __init__(self, spec, seed: int, device: torch.device = torch.device("cpu"), part: str = "both"):
        """`seed`: the LoRA adapters' (transformer_2's is seed + 1), the same for every part, so that
        two experts start from the very adapters one expert training both starts from."""
        self.part = part
        super().__init__(spec, seed, device)
        if self.boundary is None and spec.model.guidance_scale_2 is not None:
            raise ValueError(f"experts.generator.model.guidance_scale_2 is the low-noise transformer's guidance; "
                             f"{spec.model.path} has none (no transformer_2 and boundary_ratio)")

    def load_trained(self, seed: int, device: torch.device) -> None:
        """The transformers of this velocity's part, with the scheduler's timestep scale and the boundary."""
        index = self.index
        self.expand_timesteps = bool(index.get("expand_timesteps"))
        self.num_train_timesteps = component(self.path, index, "scheduler").config.num_train_timesteps
        boundary = index.get("boundary_ratio")
        has_low = (index.get(LOW) or [None, None])[1] is not None
        self.boundary = boundary * self.num_train_timesteps if boundary is not None and has_low else None
        if self.boundary is None and self.part != "both":
            raise ValueError(f"experts.generator_low: {self.spec.path} has no low-noise transformer (transformer_2 "
                             f"with a boundary_ratio, as Wan2.2-T2V-A14B) to train as an expert of its own")
        if self.part in ("both", "high"):
            self.transformer = self.trained_component(HIGH, seed, device)
        if self.part in ("both", "low") and self.boundary is not None:
            self.transformer_2 = self.trained_component(LOW, seed + 1, device)

    def held(self) -> dict[str, torch.nn.Module]:
        """{"high", "low": the transformer this velocity holds of each noise level}."""
        sides = {"high": HIGH, "low": LOW} if self.boundary is not None else {"high": HIGH}
        return {side: getattr(self, name) for side, name in sides.items() if name in self._modules}

    def transformers(self) -> list:
        return list(self.held().values())

    def at_high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """Whether the high-noise transformer denoises at `sigma`: the pipeline's t >= boundary_timestep
        (True everywhere for a model of one transformer)."""
        if self.boundary is None:
            return torch.ones_like(sigma, dtype=torch.bool)
        return high_noise(sigma, self.num_train_timesteps, self.boundary)

    def denoises(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Per step (its sigma), whether a transformer this velocity holds denoises it: the steps it trains on."""
        high = self.at_high_noise(sigmas)
        return {"both": torch.ones_like(high), "high": high, "low": ~high}[self.part]

    def timestep(self, x: torch.Tensor, sigma: torch.Tensor, transformer=None) -> torch.Tensor:
        """The pipeline's timestep: sigma * num_train_timesteps in float32, per sample or per latent token."""
        t = sigma.float() * self.num_train_timesteps
        if not self.expand_timesteps:
            return t
        _, _, frames, height, width = x.shape
        p = (transformer or self.transformer).config.patch_size
        return t[:, None].expand(-1, (frames // p[0]) * (height // p[1]) * (width // p[2]))

    def velocity(self, x, sigma, cond, transformer=None) -> torch.Tensor:
        transformer = transformer or self.transformer
        dtype = transformer.dtype
        return transformer(hidden_states=x.to(dtype), timestep=self.timestep(x, sigma, transformer),
                           encoder_hidden_states=cond["prompt_embeds"].to(dtype)).sample.float()

    def forward(self, x, sigma, **cond) -> torch.Tensor:
        """v(x, sigma | text), guided against the empty prompt when `cond` holds its conditioning; under
        Wan2.2-A14B each row by the transformer of its noise level, with that transformer's guidance
        (rows of both levels may share a batch in the update)."""
        return self.routed(self.held(), x, sigma, cond)

    def joined(self, low: "Velocity"):
        """The velocity of this high-noise part and the low-noise part `low` together, as the pipeline
        samples with them (this part's guidance scales: the sampler's keys are experts.generator's)."""
        return lambda x, sigma, **cond: self.routed({**self.held(), **low.held()}, x, sigma, cond)

    def routed(self, transformers: dict, x, sigma, cond) -> torch.Tensor:
        """The velocity of every row by the transformer of its noise level among `transformers`
        ({"high", "low": transformer}), each with its guidance scale."""
        if self.boundary is None:
            return self.guided(transformers["high"], self.spec.guidance_scale, x, sigma, cond=cond)
        high = self.at_high_noise(sigma)
        out = torch.empty_like(x, dtype=torch.float32)
        low_scale = self.spec.guidance_scale_2 if self.spec.guidance_scale_2 is not None else self.spec.guidance_scale
        for rows, side, scale in ((high, "high", self.spec.guidance_scale), (~high, "low", low_scale)):
            if not rows.any():
                continue
            if side not in transformers:
                raise ValueError(f"a {side}-noise step (sigma {float(sigma[rows][0]):.4f}) for a velocity that "
                                 f"holds only the {', '.join(transformers)}-noise transformer")
            out[rows] = self.guided(transformers[side], scale, x[rows], sigma[rows],
                                    cond={k: v if k.startswith(NEGATIVE) else v[rows] for k, v in cond.items()})
        return out

    def guided(self, transformer, scale: float, x, sigma, *, cond) -> torch.Tensor:
        """One transformer's velocity, guided with `scale` against the empty prompt's conditioning (one
        row, shared by the batch) where `cond` holds it, both branches in one batch."""
        positive, negative = split_negative(cond)
        if not negative or scale == 1.0:
            return self.velocity(x, sigma, positive, transformer)
        shared = {k: v.expand(len(x), *v.shape[1:]) for k, v in negative.items()}
        both = self.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), self.merge_conditions([shared, positive]),
                             transformer)
        uncond, conditional = both.chunk(2)
        return uncond + scale * (conditional - uncond)

    @contextlib.contextmanager
    def adapter_disabled(self):
        """Both transformers as their frozen bases (LoRA): the reference, without a copy."""
        for transformer in self.transformers():
            transformer.disable_adapters()
        try:
            yield
        finally:
            for transformer in self.transformers():
                transformer.enable_adapters()


class FrontEnd(FamilyFrontEnd):
    COMPONENTS = ("scheduler", "vae", "text_encoder", "tokenizer")
    # diffusers' Wan examples load the VAE in float32 beside a bfloat16 transformer
    # (`AutoencoderKLWan.from_pretrained(model_id, subfolder="vae", torch_dtype=torch.float32)`)
    FLOAT32 = ("vae",)

    def __init__(self, config, device: torch.device):
        from diffusers import WanPipeline
        super().__init__(config, device)
        self.pipeline = WanPipeline(transformer=None, transformer_2=None, **self.parts)
        self.euler = euler_scheduler(self.scheduler.config)  # of the checkpoint's shift

    def latent_grid(self, image_size: int) -> tuple[int, ...]:
        """(C, F', H', W') of clips of task.num_frames frames, task.image_size high and task.image_width
        (else image_size) wide."""
        c = self.vae.config
        return (c.z_dim, *check_clip(self.config.task, c.scale_factor_temporal, c.scale_factor_spatial, self.spec.path))

    def encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipeline.encode_prompt(prompt=texts, do_classifier_free_guidance=False, device=self.device,
                                                max_sequence_length=self.spec.max_sequence_length)
        return {"prompt_embeds": embeds}

    def sigmas(self, steps: int) -> torch.Tensor:
        self.euler.set_timesteps(steps)
        return self.euler.sigmas.float().clone()

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents of latents on the flow's grid: the per-channel normalisation undone."""
        c = self.vae.config
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inverse_std + mean  # as the pipeline computes it (the same roundings in bf16)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clips (B, F, 3, H, W) in [-1, 1]."""
        video = self.vae.decode(self.vae_latents(latents.to(self.vae.dtype))).sample  # (B, 3, F, H, W)
        return video.float().clamp(-1, 1).permute(0, 2, 1, 3, 4)
