"""The Wan family's two measures on a tiny random Wan2.1 (`tiny:wan2.1`), a clip of 33 frames of 128x224
(latent 16 x 9 x 16 x 28), guidance 5, one thread, CPU:

1. sampling the clip with log-probs (jointrl: the front end's conditioning, then Flow-GRPO's SDE sampler
   with a log-prob per step, algorithm/sde.py) against diffusers' WanPipeline sampling the same clip
   (its own loop, given the Euler scheduler of the checkpoint's shift, output_type="latent"): the
   median (and the fastest) of --repeats after a warm-up, interleaved, both from the same initial
   latents and both encoding the prompts. Bar: ratio <= 1.05.
2. the video update's peak memory (Flow-GRPO's loss and its gradient, `generator_backward`, LoRA r=32,
   B=4, 6 SDE steps) at 6 trained steps against 1, each in a fresh process, measured as bench/update.py
   measures the image families (`PeakMemory`). Bar: <= 1.3.

    python bench/wan.py [--repeats 5] [--out bench/results/wan.md]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

FRAMES, HEIGHT, WIDTH, STEPS, BATCH, GUIDANCE = 33, 128, 224, 6, 4, 5.0
PROMPTS = ["a red circle moving left", "two squares moving apart"]


def config(*extra: str):
    from driver.preflight import load_config
    return load_config("shapes-tiny", [
        f"experts.generator.model={{kind: diffusers_flow, path: 'tiny:wan2.1', guidance_scale: {GUIDANCE}, "
        f"max_sequence_length: 16}}", f"task.num_frames={FRAMES}", f"task.image_size={HEIGHT}",
        f"task.image_width={WIDTH}", f"reward.terms.image.per_frame={{frames: {FRAMES}, reduce: mean}}",
        f"experts.generator.sample_steps={STEPS}", *extra])


def sampling(repeats: int) -> dict:
    """Median seconds of jointrl's sampling with log-probs and of the pipeline's, of the same clip."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from algorithm.sde import sample
    from common.hub import local_model
    from experts.frontend import build_frontend
    from experts.kinds import build_model
    from experts.text_encoder import FeatureCache
    from tasks.base import TextPrompt
    torch.set_num_threads(1)
    cfg = config()
    velocity, frontend = build_model(cfg, "generator").eval(), build_frontend(cfg)
    prompts = [PROMPTS[i % 2] for i in range(BATCH)]
    noise = torch.randn((BATCH, STEPS + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(0))
    pipe = WanPipeline.from_pretrained(local_model("tiny:wan2.1"))
    c = pipe.scheduler.config
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=c.num_train_timesteps, shift=c.flow_shift)
    pipe.set_progress_bar_config(disable=True)

    def ours():
        frontend.cache = FeatureCache(frontend.cache.max_bytes)  # text encoded every time, as the pipeline does
        cond = frontend.condition([TextPrompt(p) for p in prompts], [{} for _ in prompts])
        return sample(lambda x, s: velocity(x, s, **cond), noise, frontend.sigmas(STEPS), 0.7,
                      sde=torch.ones(STEPS, dtype=torch.bool))

    def theirs():
        return pipe(prompt=prompts, latents=noise[:, 0].clone(), num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                    num_frames=FRAMES, height=HEIGHT, width=WIDTH, max_sequence_length=16, output_type="latent").frames

    times = {"jointrl": [], "pipeline": []}
    with torch.no_grad():
        for i in range(repeats + 1):
            for name, run in (("jointrl", ours), ("pipeline", theirs)):  # interleaved: the same machine load
                start = time.perf_counter()
                run()
                if i:
                    times[name].append(time.perf_counter() - start)
    return {**{k: statistics.median(v) for k, v in times.items()}, **{f"{k}_min": min(v) for k, v in times.items()}}


def update_peak(trained: int) -> dict:
    """In this process: the update's peak memory (bench/update.py's PeakMemory) at `trained` SDE steps."""
    from algorithm.losses import GeneratorObjective, generator_backward
    from algorithm.sde import sample
    from bench.update import PeakMemory
    from experts.frontend import build_frontend
    from experts.kinds import build_model
    from experts.trajectories import split_shared
    from experts.weights import reference_of
    from tasks.base import TextPrompt
    torch.set_num_threads(1)
    cfg = config("experts.generator.model.lora={r: 32, alpha: 32}")
    policy, frontend = build_model(cfg, "generator"), build_frontend(cfg)
    cond = frontend.condition([TextPrompt(PROMPTS[i % 2]) for i in range(BATCH)], [{}] * BATCH)
    noise = torch.randn((BATCH, STEPS + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(0))
    sigmas, sde = frontend.sigmas(STEPS), torch.arange(STEPS) < trained
    with torch.no_grad():
        states, logps = sample(lambda x, s: policy(x, s, **cond), noise, sigmas, 0.7, sde=sde)
    per_sample, shared = split_shared(cond)
    batch = {"states": states, "state_steps": torch.arange(STEPS + 1), "logps": logps, "sigmas": sigmas, "sde": sde,
             "cond": per_sample, "shared_cond": shared}
    reference, adv = reference_of(policy), torch.tensor([1.0, -1.0, 0.5, -0.5])
    peak = 0
    for _ in range(2):  # a warm-up, then the measured one; the larger of the two
        policy.zero_grad(set_to_none=True)
        with PeakMemory(torch.device("cpu")) as memory:
            generator_backward(policy, reference, batch, adv, obj=GeneratorObjective(0.7, 1e-4, 0.004, "flow_grpo"))
        peak = max(peak, memory.peak)
    return {"peak_bytes": peak}


def child(args: list) -> dict:
    """`args` measured in a fresh process; a memory measurement with glibc's mmap threshold fixed (as
    bench/update.py: freed tensors leave RSS), a timing without (the fixed threshold maps and unmaps
    every large tensor, which would time the allocator instead of the sampler)."""
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if args[0] == "update" else {})}
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], check=True, capture_output=True,
                         text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "wan.md"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        what, n = json.loads(args.child)
        print(json.dumps(sampling(n) if what == "sampling" else update_peak(n)))
        return 0
    timed = child(["sampling", args.repeats])
    ratio = timed["jointrl"] / timed["pipeline"]
    peaks = {n: child(["update", n])["peak_bytes"] for n in (1, STEPS)}
    growth = peaks[STEPS] / peaks[1]
    lines = ["# Wan: sampling against diffusers' WanPipeline, and the video update's peak memory", "",
             f"Tiny random Wan2.1 (`tiny:wan2.1`), {BATCH} clips of {FRAMES} frames of {HEIGHT}x{WIDTH} (latent "
             f"16 x {(FRAMES - 1) // 4 + 1} x {HEIGHT // 8} x {WIDTH // 8}), {STEPS} steps, guidance {GUIDANCE}, one "
             "thread, CPU (2 cores; other work on the machine makes timings noisy: read the median and the fastest side by side). `python bench/wan.py`. The timing "
             "runs without bench/update.py's fixed mmap threshold, which the memory measurement needs: with it every "
             "large tensor is mapped and unmapped, and the same sampling measured 1.13 (median), the allocator's "
             "cost rather than the sampler's.", "",
             "| measure | jointrl | reference | ratio | bar |", "|---|---|---|---|---|",
             f"| sampling with log-probs vs WanPipeline's own sampling (median of {args.repeats}) | "
             f"{timed['jointrl']:.3f} s | {timed['pipeline']:.3f} s | {ratio:.3f} | <= 1.05 "
             f"{'met' if ratio <= 1.05 else 'missed'} |",
             f"| the same, fastest of {args.repeats} (least disturbed by the machine's other load) | "
             f"{timed['jointrl_min']:.3f} s | {timed['pipeline_min']:.3f} s | "
             f"{timed['jointrl_min'] / timed['pipeline_min']:.3f} | |",
             f"| update peak memory, 6 trained steps vs 1 (LoRA r=32, B={BATCH}) | {peaks[STEPS] / 2 ** 20:.0f} MiB | "
             f"{peaks[1] / 2 ** 20:.0f} MiB | {growth:.3f} | <= 1.3 {'met' if growth <= 1.3 else 'missed'} |"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
