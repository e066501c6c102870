"""How much a prompt group's samples differ, before any update (issue 40's low-diversity regime).

Rolls out the first STEPS steps of the `shapes` preset with the benchmark's settings plus KEY=VALUE
overrides, from the base's weights (or a run's checkpoint, --ckpt), as RolloutPipeline.run_chunk
does but with no update, and measures per prompt group: image similarity (algorithm/similarity.py,
as groups/similarity logs it), the spread of the total and of the image reward, and the same within
the refined positions (a group's first 6: their noise is the same in a joint and a generator-only
run, so the two compare pair by pair). bench/results/low-diversity.md was measured with it.

usage: python bench/group_spread.py NAME STEPS [--ckpt RUN_DIR] [--out DIR] -- KEY=VALUE ...
Appends one JSON line per call to DIR/group_spread.jsonl and writes DIR/groups-NAME.jsonl (default
DIR: runs/group-spread).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

from algorithm.batch import step_samples  # noqa: E402
from algorithm.similarity import signatures  # noqa: E402
from driver.preflight import load_config  # noqa: E402
from experts.pipeline import RolloutPipeline  # noqa: E402
from tasks import build_task  # noqa: E402
from tasks.reward_guard import RewardFaults  # noqa: E402

ZERO = 1e-8
BENCH = ["trainer.prompts_per_step=8", "experts.refiner_defaults.kl_beta=0.1"]


def pair_sim(u: np.ndarray) -> float | None:
    u = u[np.linalg.norm(u, axis=1) > 0]
    n = len(u)
    if n < 2:
        return None
    s = u.sum(0)
    return float((s @ s - n) / (n * (n - 1)))


def mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def main():
    args = sys.argv[1:]
    name, steps = args[0], int(args[1])
    ckpt = args[args.index("--ckpt") + 1] if "--ckpt" in args else None
    out_dir = Path(args[args.index("--out") + 1] if "--out" in args else ROOT / "runs" / "group-spread")
    out_dir.mkdir(parents=True, exist_ok=True)
    sets = args[args.index("--") + 1:] if "--" in args else []
    config = load_config("shapes", [*BENCH, *sets, "cluster.mode=inline"])
    pipe = RolloutPipeline(config)
    if ckpt:
        from driver.checkpoint import latest_weights
        from experts.weights import model_tensors
        _, weights = latest_weights(Path(ckpt), config.experts.ids())
        for eid, state in weights.items():
            pipe.load(eid, 1, model_tensors(pipe.models[eid], state))
    prompts = build_task(config).train_prompts()
    t, a = config.trainer, config.algorithm
    weights = config.reward.weights
    rows = []
    start = time.perf_counter()
    for step in range(steps):
        samples = step_samples(prompts, step=step, seed=t.seed, prompts_per_step=t.prompts_per_step,
                               group_size=a.group_size, num_skip_refinement=a.num_skip_refinement,
                               refine=not config.experts.generator_only)
        with torch.no_grad():
            refinements, _ = pipe.refine(step, samples)
            noise = pipe.noise(step, samples)
            cond = pipe.frontend.condition([s.prompt for s in samples], refinements)
            states, _ = pipe.generate(cond, noise, sde=True)
            decoded = pipe.frontend.decode(states[:, -1])
        sig = signatures(decoded)
        full = decoded.flatten(1).double().cpu().numpy()
        full = full - full.mean(1, keepdims=True)
        full = full / np.maximum(np.linalg.norm(full, axis=1, keepdims=True), 1e-6)
        images = decoded.cpu().numpy()
        terms, valid = pipe.reward(images, samples, refinements, RewardFaults())
        strict = pipe.rewards.strict(images, [s.prompt for s in samples], refinements)["image"]
        if step == 0 and "--dump" in args:
            np.savez_compressed(out_dir / f"images-{name}.npz", images=images,
                                prompts=np.array([s.prompt.text for s in samples]),
                                refine=np.array([s.refine for s in samples]), image=terms["image"],
                                refinements=np.array([" | ".join(r[e].text for e in sorted(r)) for r in refinements]))
        total = sum(w * terms[k] for k, w in weights.items())
        groups = np.array([s.group for s in samples])
        refined = np.array([s.refine for s in samples])
        pos = np.array([s.sample % a.group_size for s in samples])
        first6 = pos < a.group_size - a.num_skip_refinement  # the refined positions (paired noise)
        for g in np.unique(groups):
            m = (groups == g) & valid
            img, tot = terms["image"][m], total[m]
            gm = groups == g
            words = [" | ".join(r[e].text
                                for e in sorted(r)) for r, keep in zip(refinements, gm & refined) if keep]
            rows.append({
                "step": step, "group": int(g), "category": samples[int(np.flatnonzero(gm)[0])].prompt.category,
                "sim_all": pair_sim(sig[gm]), "sim_full": pair_sim(full[gm]),
                "sim_first6": pair_sim(sig[gm & first6]), "sim_last2": pair_sim(sig[gm & ~first6]),
                "sim_refined": pair_sim(sig[gm & refined]) if (gm & refined).any() else None,
                "total_std": float(tot.std()), "image_std": float(img.std()),
                "image_std_first6": float(terms["image"][gm & first6].std()),
                "promptrl_std": float((img + 0.1 * terms["format"][m]).std()),
                "image_mean": float(img.mean()), "image_all1": bool((img >= 1.0).all()),
                "strict_mean": float(strict[gm].mean()),
                "distinct_refinements": len(set(words)) if words else None,
            })
    secs = time.perf_counter() - start
    out = {
        "name": name, "sets": sets, "ckpt": ckpt, "steps": steps, "groups": len(rows), "seconds": round(secs, 1),
        "similarity": mean([r["sim_all"] for r in rows]),
        "sim_full": mean([r["sim_full"] for r in rows]),
        "sim_first6": mean([r["sim_first6"] for r in rows]),
        "sim_last2": mean([r["sim_last2"] for r in rows]),
        "sim_refined": mean([r["sim_refined"] for r in rows]),
        "zero_std": mean([float(r["total_std"] <= ZERO) for r in rows]),
        "reward_std": mean([r["total_std"] for r in rows]),
        "image_zero_std": mean([float(r["image_std"] <= ZERO) for r in rows]),
        "image_std": mean([r["image_std"] for r in rows]),
        "image_std_first6": mean([r["image_std_first6"] for r in rows]),
        "image_zero_std_first6": mean([float(r["image_std_first6"] <= ZERO) for r in rows]),
        "promptrl_zero_std": mean([float(r["promptrl_std"] <= ZERO) for r in rows]),
        "promptrl_std": mean([r["promptrl_std"] for r in rows]),
        "image_all1": mean([float(r["image_all1"]) for r in rows]),
        "image_mean": mean([r["image_mean"] for r in rows]),
        "strict": mean([r["strict_mean"] for r in rows]),
        "distinct_refinements": mean([r["distinct_refinements"] for r in rows]),
    }
    # per-step means of the logged-style metrics, to compare with a CLI run's metrics.jsonl
    out["per_step"] = [{"step": s, **{k: mean([r[k] for r in rows if r["step"] == s]) for k in ("sim_all", "total_std")},
                        "zero_std": mean([float(r["total_std"] <= ZERO) for r in rows if r["step"] == s])}
                       for s in range(steps)]
    with open(out_dir / "group_spread.jsonl", "a") as f:
        f.write(json.dumps(out) + "\n")
    with open(out_dir / f"groups-{name}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items() if k != "per_step"}))


if __name__ == "__main__":
    main()
