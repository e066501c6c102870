"""The generator update's time and peak memory, against a plain per-timestep loop from the paper.

Side by side on one tiny SD3 (4 layers, width 128, 64x64 latents, B=4, 6 SDE steps, guidance 4.5,
LoRA r=32, one thread), from the same trajectories: jointrl's update (`generator_backward`, one
sampling step of every sample per backward pass) at 1 and at 6 trained steps, and Flow-GRPO's
training loop written here from its equations (arXiv 2505.05470 eq. 8-12; its KL as its code
writes it), which backpropagates each timestep on its own and skips the reference when beta = 0.
Each measurement runs in a fresh process: the loss and its gradient only (no optimizer step), the
median of --repeats after a warm-up; peak memory is the process's high-water mark above what it
held before the update (Linux: /proc/self/clear_refs; glibc's mmap threshold is fixed so that the
allocator's cache does not hide or inflate it), or CUDA's max_memory_allocated on a GPU.

Bars: peak memory at 6 trained steps <= 1.3x that at 1; time <= 1.0x the per-timestep loop's.
    python bench/update.py [--repeats 3] [--out bench/results/update.md]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

STEPS, BATCH, GUIDANCE, NOISE_LEVEL, CLIP = 6, 4, 4.5, 0.7, 1e-4
PROMPTS = ["a red circle above a blue square", "two green triangles"]


def model_dir(root: Path) -> Path:
    from experts.tiny_hf import tiny_sd3
    out = root / "sd3-4x128"
    if not out.is_dir():
        tiny_sd3(out, sample_size=64, text="bytes", num_layers=4, num_heads=4, head_dim=32)
    return out


def setup(path: Path, beta: float, device: torch.device):
    """(policy with a LoRA adapter, its reference, trajectories of B samples, their conditioning)."""
    from algorithm.sde import sample
    from driver.preflight import load_config
    from experts.frontend import build_frontend
    from experts.kinds import build_model
    from experts.trajectories import split_shared
    from experts.weights import reference_of
    from tasks.base import TextPrompt
    config = load_config("shapes-tiny", [
        f"experts.generator.model={{kind: diffusers_flow, path: {path}, guidance_scale: {GUIDANCE}, "
        f"max_sequence_length: 16, lora: {{r: 32, alpha: 32}}}}", "task.image_size=128",
        f"experts.generator.sample_steps={STEPS}", f"experts.generator.kl_beta={beta}"])
    policy = build_model(config, "generator", device=device)
    frontend = build_frontend(config, device)
    cond = frontend.condition([TextPrompt(PROMPTS[i % 2]) for i in range(BATCH)], [{}] * BATCH)
    cond = {k: v.to(device) for k, v in cond.items()}
    noise = torch.randn((BATCH, STEPS + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(0))
    sigmas = frontend.sigmas(STEPS).to(device)
    with torch.no_grad():
        for p in policy.parameters():  # a LoRA adapter that has moved: ratio and KL away from 1 and 0
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(device))
        states, logps = sample(lambda x, s: policy(x, s, **cond), noise.to(device), sigmas, NOISE_LEVEL,
                               sde=torch.ones(STEPS, dtype=torch.bool))
    per_sample, shared = split_shared(cond)
    batch = {"states": states, "state_steps": torch.arange(STEPS + 1, device=device), "logps": logps,
             "sigmas": sigmas, "cond": per_sample, "shared_cond": shared}
    return policy, reference_of(policy), batch, config


def flow_grpo_loop(policy, reference, batch, adv, trained: int, beta: float) -> None:
    """Flow-GRPO's training loop from its equations: per timestep, re-evaluate the SDE step's mean
    and log-prob (eq. 9-12), PPO-clip the ratio (eq. 8), add beta * ||mu - mu_ref||^2 / (2 std_t^2),
    and backpropagate that timestep's loss divided by the number of timesteps."""
    states, sigmas, cond = batch["states"], batch["sigmas"], {**batch["cond"], **batch["shared_cond"]}
    for j in range(trained):
        x, x_next = states[:, j], states[:, j + 1]
        sigma, sigma_next = sigmas[j], sigmas[j + 1]
        dt = sigma_next - sigma
        std_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma))) * NOISE_LEVEL

        def mean_of(model):
            v = model(x, sigma.expand(BATCH), **cond)
            return x * (1 + std_t ** 2 / (2 * sigma) * dt) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt

        mean = mean_of(policy)
        std = std_t * torch.sqrt(-dt)
        logp = (-((x_next - mean) ** 2) / (2 * std ** 2) - torch.log(std)
                - 0.5 * torch.log(torch.tensor(2 * torch.pi))).mean(dim=(1, 2, 3))
        ratio = torch.exp(logp - batch["logps"][:, j])
        loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)).mean()
        if beta > 0:
            with torch.no_grad():
                ref_mean = mean_of(reference)
            loss = loss + beta * (((mean - ref_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * std_t ** 2)).mean()
        (loss / trained).backward()


def jointrl_update(policy, reference, batch, adv, trained: int, beta: float) -> None:
    from algorithm.losses import GeneratorObjective, generator_backward
    sde = torch.arange(STEPS) < trained
    generator_backward(policy, reference, {**batch, "sde": sde.to(batch["states"].device)}, adv,
                       obj=GeneratorObjective(NOISE_LEVEL, CLIP, beta, "flow_grpo"))


class PeakMemory:
    """The update's peak memory above what the process held when it began."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
            self.base = self.resident("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = self.resident("VmHWM") - self.base

    @staticmethod
    def resident(field: str) -> int:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
        return int(line.split()[1]) * 1024


def measure_one(path: Path, method: str, trained: int, beta: float, repeats: int) -> dict:
    """In this process: the update's median time and its peak memory (the first, warm-up, run's)."""
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy, reference, batch, _ = setup(path, beta, device)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device=device)
    update = {"jointrl": jointrl_update, "loop": flow_grpo_loop}[method]
    times, peak = [], None
    for _ in range(repeats + 1):
        policy.zero_grad(set_to_none=True)
        with PeakMemory(device) as memory:
            start = time.perf_counter()
            update(policy, reference, batch, adv, trained, beta)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = max(peak or 0, memory.peak)
    grad = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
    return {"time_s": statistics.median(times[1:]), "peak_bytes": peak, "grad_norm": float(grad.norm())}


def run_child(path: Path, method: str, trained: int, beta: float, repeats: int) -> dict:
    # a fixed mmap threshold: glibc hands every freed large tensor back to the kernel, so the
    # resident high-water mark follows the live tensors, not what the allocator kept cached
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps([str(path), method, trained, beta, repeats])],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "update.md"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        path, method, trained, beta, repeats = json.loads(args.child)
        print(json.dumps(measure_one(Path(path), method, trained, beta, repeats)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp))
        rows = {}
        for beta in (0.04, 0.0):
            for trained in (1, STEPS):
                for method in ("jointrl", "loop"):
                    r = rows[method, trained, beta] = run_child(path, method, trained, beta, args.repeats)
                    print(f"{method:8s} beta={beta:<5} trained steps={trained}: {r['time_s']:.3f} s, "
                          f"peak {r['peak_bytes'] / 2 ** 20:.0f} MiB, |grad| {r['grad_norm']:.4g}", flush=True)
    lines = ["# Generator update: jointrl against Flow-GRPO's per-timestep loop", "",
             f"Tiny SD3 (4 layers, width 128, 64x64 latents), B={BATCH}, {STEPS} SDE steps, guidance {GUIDANCE}, "
             f"LoRA r=32, one thread, {'CUDA' if torch.cuda.is_available() else 'CPU'}; loss and gradient only, "
             f"median of {args.repeats} after a warm-up; peak = resident high-water mark above the update's "
             "start (glibc's mmap threshold fixed at 128 KiB, so freed tensors leave RSS).", "",
             "| beta | trained steps | jointrl time (s) | loop time (s) | time ratio | jointrl peak (MiB) | "
             "loop peak (MiB) | same gradient |", "|---|---|---|---|---|---|---|---|"]
    for beta in (0.04, 0.0):
        for trained in (1, STEPS):
            ours, loop = rows["jointrl", trained, beta], rows["loop", trained, beta]
            same = abs(ours["grad_norm"] - loop["grad_norm"]) <= 1e-4 * loop["grad_norm"]
            lines.append(f"| {beta} | {trained} | {ours['time_s']:.3f} | {loop['time_s']:.3f} | "
                         f"{ours['time_s'] / loop['time_s']:.3f} | {ours['peak_bytes'] / 2 ** 20:.0f} | "
                         f"{loop['peak_bytes'] / 2 ** 20:.0f} | {'yes' if same else 'NO'} |")
    memory_ratio = {b: rows["jointrl", STEPS, b]["peak_bytes"] / rows["jointrl", 1, b]["peak_bytes"] for b in (0.04, 0.0)}
    time_ratio = {b: rows["jointrl", STEPS, b]["time_s"] / rows["loop", STEPS, b]["time_s"] for b in (0.04, 0.0)}
    lines += ["", *[f"- beta={b}: peak memory at {STEPS} trained steps / at 1: {memory_ratio[b]:.2f} (bar <= 1.3); "
                    f"time at {STEPS} steps / the loop's: {time_ratio[b]:.3f} (bar <= 1.0)" for b in (0.04, 0.0)]]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2:]), f"\nwritten to {args.out}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
