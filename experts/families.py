"""Generator families: which diffusers pipeline a model folder holds, and the module that serves it.

A `diffusers_flow` generator is chosen by the `_class_name` of its `model_index.json` (one line of
`FAMILIES` per family). Each family's module is the only place that knows the family, and defines
two classes:

- `Velocity(spec, seed)`: the trained transformer as an `nn.Module`, `forward(x, sigma, **cond)` the
  velocity v(x, sigma | text) on the flow's state (B, *latent_shape) — with the family's guidance —
  plus `merge_conditions(conds)`, `synced_state()`, `adapter_disabled()` (the LoRA reference),
  `lora` and `conditioning(...)` (the shapes of what `cond` holds, for the memory plan);
- `FrontEnd(config, device)`: what stays frozen in a rollout worker: the text encoders behind a
  cache (`condition(prompts, refinements, drop)` -> the `cond` the velocity reads, `take_stats()`,
  `version`), the flow's space (`latent_shape`, `sigmas(steps)` from 1 down to 0, shifted as the
  family's pipeline shifts them) and the way back to pixels (`decode(latents)` -> (B, 3, H, W) in
  [-1, 1], or (B, F, 3, H, W) for a video family's clips).

The flow runs on the unpacked latent grid (C, H, W) for every family, (C, F', H', W') for video: a family that packs latents
into tokens (FLUX) packs and unpacks inside its velocity, a bijective reshape, so the SDE, its
log-probs and the trajectories are the same objects for every family.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple


class Family(NamedTuple):
    """A generator family: the module that serves it, and whether its samples are clips
    (task.num_frames set) rather than images."""
    module: str
    video: bool = False


FAMILIES = {  # a pipeline's class name -> its family
    "StableDiffusion3Pipeline": Family("experts.sd3"),
    "FluxPipeline": Family("experts.flux1"),
    "Flux2KleinPipeline": Family("experts.flux2"),
    "QwenImagePipeline": Family("experts.qwen_image"),
    "WanPipeline": Family("experts.wan", video=True),
}


def pipeline_class(path: str) -> str:
    """The `_class_name` of the model folder's (or hub id's) `model_index.json`."""
    from diffusers import DiffusionPipeline
    return DiffusionPipeline.load_config(path).get("_class_name", "?")


def family_module(path: str):
    """The module serving the model at `path` (a local folder or hub id, as `local_model` gives it);
    ValueError naming the family found and those supported."""
    found = pipeline_class(path)
    if found not in FAMILIES:
        raise ValueError(f"'{path}' holds a {found}; the generator families supported are "
                         f"{', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[found].module)
