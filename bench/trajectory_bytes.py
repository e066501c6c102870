"""Bytes of one step's trajectories: what the rollout workers send the generator expert each step.

A tiny SD3 (`tiny:sd3`) in bfloat16 with the sd3 preset's sampling (guidance 4.5, 128 T5 tokens, 10
steps) and an SDE window [0, 4) (Flow-GRPO-Fast's), one step of --samples samples rolled out by a
rollout pipeline; the trajectories are serialized as Ray's object store holds them (pickle protocol
5, numpy arrays whole), in all and per field. The tiny model's widths are not SD3.5's (text width
32, latents 4 x side/2 x side/2), so the split between text and states differs from a real model's.

    python bench/trajectory_bytes.py [--samples 32] [--image-size 64]
It measures whichever jointrl comes first on the path: `PYTHONPATH=<another checkout>` measures that one.
"""
from __future__ import annotations

import argparse
import pickle

import numpy as np


def fields(trajectories) -> dict:
    """{field: value} of a shard's trajectories (a dict, or a record of named fields)."""
    return dict(trajectories) if isinstance(trajectories, dict) else trajectories._asdict()


def nbytes(value) -> int:
    return len(pickle.dumps(value, protocol=5))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=32, help="samples in the step (prompts x 8)")
    p.add_argument("--image-size", type=int, default=64, help="pixels on a side")
    args = p.parse_args()
    import diffusers
    import torch
    import transformers
    from algorithm.batch import Sample
    from driver.preflight import load_config
    from experts.pipeline import RolloutPipeline
    from tasks.shapes import prompt_set
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # CLIP's notice of each prompt it truncates to 77 tokens
    diffusers.logging.set_verbosity_error()
    config = load_config("shapes-tiny", [
        "experts.generator.model={kind: diffusers_flow, path: 'tiny:sd3', dtype: bfloat16, guidance_scale: 4.5, "
        "max_sequence_length: 128, lora: {r: 32, alpha: 64}}", f"task.image_size={args.image_size}",
        "experts.generator.sample_steps=10", "experts.generator.sde_window=[0, 4]", "reward.terms={image: {fn: shapes_image}}"])
    pipeline = RolloutPipeline(config)
    prompts = prompt_set(args.samples // 8, seed=0)
    samples = [Sample(i, i // 8, prompts[i // 8], i % 8 < 6) for i in range(args.samples)]
    trajectories = pipeline.run(0, samples).trajectories
    parts = fields(trajectories)
    total = nbytes(trajectories)
    print(f"one step's trajectories, {args.samples} samples, image {args.image_size} px: {total:,} bytes "
          f"({total / args.samples:,.0f} per sample)")
    for name, value in parts.items():
        shapes = ({k: v if isinstance(v, str) else (tuple(np.shape(v)), str(v.dtype)) for k, v in value.items()}
                  if isinstance(value, dict) else (tuple(np.shape(value)), str(value.dtype)))
        print(f"  {name:12s} {nbytes(value):>12,}  {shapes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
