"""The memory plan measured: every GPU preset on its target, the real architectures' parameter
counts against their published sizes, and the planner's estimate of a generator update against
the update's measured peak memory.

(a) `jointrl plan` of every GPU preset on its `plan.target`: per GPU its actors, bytes and what is
    left; the GPUs idle while rolling out and while updating.
(b) Parameter counts of the presets' models built on the meta device from the shipped config files
    (configs/architectures), against the sizes their model cards publish.
(c) On CPU, a generator update (loss and gradient, one step of every sample per backward pass:
    4 samples, 8 passes through the transformer under guidance, reference forward for the KL)
    on a tiny SD3 and a tiny FLUX.2 klein, with and without activation checkpointing, measured
    as bench/update.py measures it (a fresh process; the resident high-water mark above what it
    held before the update, glibc's mmap threshold fixed so freed tensors leave RSS), against the
    plan's activations of one micro-batch + adapter gradients for the same config. Bar: within 25 %.

    python bench/plans.py [--out bench/results/plans.md]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPU_PRESETS = ["gpu", "sd3", "flux1", "flux2-klein", "qwen-image", "geneval", "pickscore", "ocr"]
# (what, how the planner counts it, published size, where it is published)
PUBLISHED = [
    ("FLUX.1-dev transformer", ("flux1", "transformer"), 12e9, "model card: 12 B (issue 30: about 11.9 B)"),
    ("Qwen-Image transformer", ("qwen-image", "transformer"), 20e9, "model card: 20 B MMDiT (issue 30: about 20.4 B)"),
    ("SD3.5-medium transformer", ("sd3", "transformer"), 2.5e9, "model card: 2.5 B (MMDiT-X)"),
    ("FLUX.2-klein-base-9B transformer", ("flux2-klein", "transformer"), 9e9, "model card: 9 B"),
    ("FLUX.2-klein-4B transformer", ("klein-4b", "transformer"), 4e9, "model card: 4 B"),
    ("Qwen3-8B (klein 9B's text encoder)", ("flux2-klein", "text_encoder"), 8.2e9, "Qwen3 model card: 8.2 B"),
    ("Qwen3-4B (klein 4B's text encoder)", ("klein-4b", "text_encoder"), 4.0e9, "Qwen3 model card: 4.0 B"),
    ("Qwen2.5-VL-7B (Qwen-Image's text encoder)", ("qwen-image", "text_encoder"), 8.29e9,
     "model page: 8.29 B"),
    ("T5 v1.1 XXL encoder (SD3, FLUX.1)", ("sd3", "text_encoder_3"), None, "no published figure for the encoder "
                                                                          "alone found"),
    ("Qwen2.5-0.5B-Instruct (refiners)", ("lm", "Qwen/Qwen2.5-0.5B-Instruct"), 0.49e9, "model card: 0.49 B"),
    ("PickScore_v1 (CLIP ViT-H/14)", ("reward", "yuvalkirstain/PickScore_v1"), 0.986e9,
     "OpenCLIP ViT-H-14: 986 M"),
    ("CLIP ViT-L/14 (GenEval colours)", ("reward", "openai/clip-vit-large-patch14"), 428e6, "model page: 428 M"),
    ("OWLv2 base patch16 (GenEval detector)", ("reward", "google/owlv2-base-patch16-ensemble"), None,
     "no published figure found"),
    ("TrOCR base printed", ("reward", "microsoft/trocr-base-printed"), 334e6, "TrOCR paper, Table: 334 M"),
]


def plans_table() -> list[str]:
    from driver.config import resolve_config
    from driver.plan import config_target, plan_for
    lines = ["## (a) The plan of every GPU preset on its target", ""]
    for preset in GPU_PRESETS:
        config = resolve_config(preset)
        plan = plan_for(config, config_target(config))
        t = plan.target
        lines += [f"### {preset}: {t.nodes} node x {t.gpus_per_node} GPUs x {t.gpu_memory_gb:g} GB "
                  f"({t.headroom_gb:g} GB headroom each)", "",
                  "| GPU | actors | planned (GB) | left of the GPU (GB) |", "|---|---|---|---|"]
        lines += [f"| {g.id} | {', '.join(g.actors) or 'idle'} | {g.bytes / 1e9:.1f} | {g.free / 1e9:.1f} |"
                  for g in plan.gpus]
        lines += ["", f"Idle while rolling out: {plan.idle['rollout'] or 'none'}; idle while updating: "
                      f"{plan.idle['update'] or 'none'}.", ""]
    return lines


def counted(how: tuple[str, str]) -> int:
    from driver.config import resolve_config
    from common.architectures import ARCHITECTURES, config_folder, weighted_components
    from experts.memory import count, meta_causal_lm, meta_component, reward_architecture
    kind, what = how
    if kind == "lm":
        return count(meta_causal_lm(config_folder(what)))
    if kind == "reward":
        return reward_architecture(what, "float32").params
    if kind == "klein-4b":
        folder = ARCHITECTURES / "black-forest-labs" / "FLUX.2-klein-4B"
        return count(meta_component(folder / what, *weighted_components(folder)[what]))
    from experts.memory import generator_architecture
    config = resolve_config(kind)
    arch = generator_architecture(config.experts.generator.model, config.task.image_size)
    return arch.transformer if what == "transformer" else arch.frontend[what]


def counts_table() -> list[str]:
    lines = ["## (b) Parameter counts of the real architectures (meta device) against the published sizes", "",
             "Counts are parameters and persistent buffers (what a checkpoint holds).", "",
             "| model | planner (B) | published (B) | difference | source |", "|---|---|---|---|---|"]
    for name, how, size, source in PUBLISHED:
        n = counted(how)
        published, off = (f"{size / 1e9:.3g}", f"{100 * (n - size) / size:+.1f} %") if size else ("-", "-")
        lines.append(f"| {name} | {n / 1e9:.3f} | {published} | {off} | {source} |")
    return lines + [""]


# --- (c) the planner against measurement ---------------------------------------------------------------

BATCH, STEPS, GUIDANCE, BETA = 4, 6, 4.5, 0.04


def tiny_klein(root: Path) -> Path:
    """tiny:flux2_klein with a wider, deeper transformer (2 double and 2 single blocks, 4 heads of 32),
    so the update's activations stand well above the process's noise."""
    import shutil

    from diffusers import Flux2Transformer2DModel

    from common.hub import local_model
    from experts.tiny.flux2 import TEXT_WIDTH
    out = root / "klein-2x2x128"
    if not out.is_dir():
        shutil.copytree(local_model("tiny:flux2_klein"), out)
        shutil.rmtree(out / "transformer")
        Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
                                num_attention_heads=4, joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32,
                                axes_dims_rope=(8, 8, 8, 8), guidance_embeds=False).save_pretrained(out / "transformer")
    return out


MODELS = {  # name -> (how its folder is made, image size, max_sequence_length)
    "tiny SD3 (4 layers, width 128, 64x64 latents)": ("sd3", 128, 16),
    "tiny FLUX.2 klein (2+2 blocks, width 128, 64x64 tokens)": ("klein", 256, 16),
}


def config_of(path: Path, image_size: int, text: int, checkpointing: bool):
    from driver.preflight import load_config
    return load_config("shapes-tiny", [f"experts.generator.parallel.activation_checkpointing={checkpointing}",
        f"experts.generator.model={{kind: diffusers_flow, path: {path}, guidance_scale: {GUIDANCE}, "
        f"max_sequence_length: {text}, lora: {{r: 32, alpha: 32}}}}", f"task.image_size={image_size}",
        f"experts.generator.sample_steps={STEPS}", f"experts.generator.kl_beta={BETA}", "trainer.prompts_per_step=1",
        f"algorithm.group_size={BATCH}", "algorithm.num_skip_refinement=1"])


def measure_child(path: str, image_size: int, text: int, checkpointing: bool) -> dict:
    """In this (fresh) process: the update's peak, and the plan's parts for the same config (the
    policy's blocks recomputed in the backward pass if `checkpointing`, as the expert does)."""
    import torch

    from algorithm.sde import sample
    from driver.plan import generator_expert
    from experts.frontend import build_frontend
    from experts.kinds import build_model
    from experts.trajectories import split_shared
    from experts.weights import reference_of
    from tasks.base import TextPrompt
    update = load_bench_update()
    torch.set_num_threads(1)
    from experts.parallel import checkpoint_activations
    config = config_of(Path(path), image_size, text, checkpointing)
    planned = generator_expert(config, "generator", 0).bytes
    policy = build_model(config, "generator")
    if checkpointing:
        checkpoint_activations(policy)
    frontend = build_frontend(config, torch.device("cpu"))
    cond = frontend.condition([TextPrompt(p) for p in ["a red circle above a blue square", "two green triangles"] * 2],
                              [{}] * BATCH)
    noise = torch.randn((BATCH, STEPS + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(0))
    sigmas = frontend.sigmas(STEPS)
    with torch.no_grad():
        states, logps = sample(lambda x, s: policy(x, s, **cond), noise, sigmas, 0.7,
                               sde=torch.ones(STEPS, dtype=torch.bool))
    per_sample, shared = split_shared(cond)
    batch = {"states": states, "state_steps": torch.arange(STEPS + 1), "logps": logps, "sigmas": sigmas,
             "cond": per_sample, "shared_cond": shared}
    reference = reference_of(policy)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    peaks = []
    for _ in range(2):  # the first allocates the adapter's gradients; both are counted as the update's
        policy.zero_grad(set_to_none=True)
        with update.PeakMemory(torch.device("cpu")) as memory:
            update.jointrl_update(policy, reference, batch, adv, 1, BETA)
        peaks.append(memory.peak)
    return {"peak_bytes": max(peaks), "planned": planned, "latent": list(frontend.latent_shape)}


def load_bench_update():
    spec = importlib.util.spec_from_file_location("bench_update", ROOT / "bench" / "update.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measured_table() -> list[str]:
    lines = ["## (c) The planner against measurement (CPU, fp32, one thread)", "",
             f"One backward pass of the update: {BATCH} samples x 1 trained step, {2 * BATCH} passes through the "
             f"transformer (guidance {GUIDANCE}), the reference's forward (beta {BETA}), LoRA r=32. Measured: resident "
             "high-water mark above the update's start (bench/update.py's PeakMemory, a fresh process, glibc's mmap "
             "threshold at 128 KiB). Planned: the plan's `activations (one micro-batch)` (the most the forward and "
             "backward pass hold at once, the reference's pass included) + `grads (fp32)` of expert/generator for the "
             "same config.", "",
             "| model | activation checkpointing | measured (MiB) | planned (MiB) | planned / measured | activations | "
             "grads |", "|---|---|---|---|---|---|---|"]
    update = load_bench_update()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for (name, (kind, size, text)), checkpointing in [(m, c) for m in MODELS.items() for c in (False, True)]:
            path = update.model_dir(Path(tmp)) if kind == "sd3" else tiny_klein(Path(tmp))
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps([str(path), size, text,
                                                                                    checkpointing])],
                                 check=True, capture_output=True, text=True, env=env).stdout
            r = json.loads(out.strip().splitlines()[-1])
            p = r["planned"]
            parts = [p["activations (one micro-batch)"], p["grads (fp32)"]]
            plan = sum(parts)
            ratios.append(plan / r["peak_bytes"])
            lines.append(f"| {name} | {'on' if checkpointing else 'off'} | {r['peak_bytes'] / 2**20:.0f} | "
                         f"{plan / 2**20:.0f} | {plan / r['peak_bytes']:.2f} | "
                         + " | ".join(f"{x / 2**20:.0f}" for x in parts) + " |")
            print(lines[-1], flush=True)
    lines += ["", "Bar: within 25 % (planned / measured in 0.75 .. 1.25): "
              + ", ".join(f"{r:.2f} {'met' if 0.75 <= r <= 1.25 else 'MISSED'}" for r in ratios), ""]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "plans.md"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure_child(*json.loads(args.child))))
        return 0
    lines = ["# Memory plans (`jointrl plan`) and what they rest on", "", "Written by `python bench/plans.py`.", ""]
    lines += plans_table()
    lines += counts_table()
    lines += measured_table()
    Path(args.out).write_text("\n".join(lines))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
