"""Two joint steps on a GPU, for when one is lent: every expert, the rollout worker and the reward
actors on the GPU (fractional GPUs of one device), a preset's models (`gpu`: Qwen2.5-0.5B-Instruct
refiners, SD3.5-medium, LoRA, bf16; `geneval`, `pickscore`, `ocr`: the same experts on a real task
with its reward model in a pool; they must be in the Hugging Face cache or reachable, and the
real-task presets need Flow-GRPO's prompt files) or, with --tiny, tiny random models built here (no
download), on the GPU all the same: for a real-task preset, `prompts-tiny`'s task, data and every
reward term, placed as the preset places them. With --family, a generator family's preset (`sd3`,
`flux1`, `flux2-klein`, `qwen-image`): its real model and Flow-GRPO's prompt files, or with --tiny
that family's tiny random pipeline (`tiny:<family>`) under the preset's sampler and loss settings, in
`prompts-tiny`'s task. Prints where each actor's models live, each step's
metrics (and an evaluation), and writes the run's report.
Usage: python bench/gpu_smoke.py [--preset gpu|geneval|pickscore|ocr | --family sd3|flux1|flux2-klein|qwen-image]
                                 [--tiny] [--collective] [--run-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402

from cluster.runtime import get  # noqa: E402
from driver.config import load_config  # noqa: E402
from driver.launch import start_driver, stop_driver  # noqa: E402
from driver.report import report  # noqa: E402


def tiny_overrides(models: Path) -> list[str]:
    from experts.tiny_hf import tiny_causal_lm, tiny_sd3
    lm, sd3 = tiny_causal_lm(models / "qwen2"), tiny_sd3(models / "sd3")
    return [*[f"experts.refiner_{i}.model={{kind: hf_causal_lm, path: {lm}, dtype: bfloat16, lora: {{r: 4, alpha: 8}}}}"
              for i in range(2)],
            f"experts.generator.model={{kind: diffusers_flow, path: {sd3}, dtype: bfloat16, guidance_scale: 4.5, "
            f"max_sequence_length: 8, lora: {{r: 4, alpha: 8}}}}", "task.image_size=32", "experts.refiner_0.max_new_tokens=8",
            "experts.refiner_1.max_new_tokens=8"]


def tiny_task_overrides(preset: str) -> list[str]:
    """`prompts-tiny`'s models, data and reward terms, with the GPU shares of `preset`."""
    from driver.config import resolve_config
    real = resolve_config(preset)
    shares = [f"experts.refiner_{i}.resources.num_gpus={r.resources.num_gpus}" for i, r in enumerate(real.experts.refiners)]
    shares += [f"experts.generator.resources.num_gpus={real.experts.generator.resources.num_gpus}",
               f"cluster.rollout_resources.num_gpus={real.cluster.rollout_resources.num_gpus}",
               "reward.terms.geneval.resources={num_gpus: 0.05}", "reward.terms.pickscore.resources={num_gpus: 0.05}",
               "experts.generator.model.dtype=bfloat16", "evaluation.every=2"]
    return shares


TINY_FAMILY = {"sd3": "tiny:sd3", "flux1": "tiny:flux1", "flux2-klein": "tiny:flux2_klein", "qwen-image": "tiny:qwen_image"}
PRESET_GENERATOR_KEYS = ("sample_steps", "sde_window", "noise_level", "clip_eps", "kl_beta", "kl_form",
                         "train_final_step", "same_initial_noise", "train_cfg", "micro_batch")


def tiny_family_overrides(family: str) -> list[str]:
    """`prompts-tiny` with the family's tiny pipeline as generator, carrying the family preset's
    guidance, sampler and loss settings (the GPU shares as `prompts-tiny` on a real-task preset)."""
    from driver.config import resolve_config
    g = resolve_config(family).experts.generator
    m = g.model
    model = (f"{{kind: diffusers_flow, path: '{TINY_FAMILY[family]}', dtype: bfloat16, guidance_scale: {m.guidance_scale}, "
             f"embedded_guidance: {m.embedded_guidance}, max_sequence_length: 16, lora: {{r: 4, alpha: 8}}}}")
    values = [f"experts.generator.{k}={json.dumps(getattr(g, k))}" for k in PRESET_GENERATOR_KEYS]
    return [f"experts.generator.model={model}", *values, f"algorithm.adv_std={resolve_config(family).algorithm.adv_std}",
            *tiny_task_overrides("geneval")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpu", choices=("gpu", "geneval", "pickscore", "ocr"))
    p.add_argument("--family", choices=tuple(TINY_FAMILY), help="a generator family's preset (replaces --preset)")
    p.add_argument("--tiny", action="store_true", help="tiny random HF models instead of the preset's")
    p.add_argument("--collective", action="store_true", help="weight sync by NCCL broadcast")
    p.add_argument("--run-dir", default=f"runs/gpu-smoke-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    assert torch.cuda.is_available(), "no CUDA device: this smoke test needs a GPU"
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = ["trainer.steps=2", "logging.images_every=1", "logging.tensorboard=true"]
    preset = args.family or args.preset
    real_task = preset != "gpu"
    if args.tiny and args.family:
        overrides += tiny_family_overrides(args.family)
    elif args.tiny:
        overrides += tiny_task_overrides(preset) if real_task else tiny_overrides(run_dir / "models")
    overrides += ["cluster.sync=collective", "cluster.collective_backend=nccl"] if args.collective else []
    cfg = load_config("prompts-tiny" if args.tiny and real_task else preset, overrides)
    print(f"generator: {cfg.experts.generator.model.path}", flush=True)
    cfg.trainer.run_name = run_dir.resolve().name
    ray.init(address="local", include_dashboard=False, namespace="jointrl")
    start = time.perf_counter()
    driver = start_driver(cfg, run_dir)
    try:
        get(driver.run.remote())
        actors = {f"expert/{e}": ray.get_actor(f"{cfg.trainer.run_name}/expert/{e}", namespace="jointrl")
                  for e in cfg.experts.ids()}
        actors["rollout/0"] = ray.get_actor(f"{cfg.trainer.run_name}/rollout/0", namespace="jointrl")
        for term, (n, _) in cfg.reward.pools().items():
            actors[f"reward/{term}/0"] = ray.get_actor(f"{cfg.trainer.run_name}/reward/{term}/0", namespace="jointrl")
        for name, handle in actors.items():
            print(f"{name}: models on {get(handle.__ray_call__.remote(lambda self: str(self.device)))}")
    finally:
        stop_driver(driver)
        ray.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        print({k: v for k, v in r.items() if k.startswith(("step", "reward/", "loss/", "version/", "time/step_s",
                                                            "sync/via", "sample/", "eval/"))})
    print(f"{len(rows)} steps in {time.perf_counter() - start:.1f} s; report: "
          + ", ".join(p.name for p in report(run_dir, lambda: cfg)[0]))
    ok = len(rows) == 2 and all(r[f"version/{e}"] == 2 for r in rows[-1:] for e in cfg.experts.ids())
    print("GPU SMOKE", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
