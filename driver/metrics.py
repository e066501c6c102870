"""Per-step metrics: the rows of RUN_DIR/metrics.jsonl, computed by pure functions of what a step
produced; the timer that measures a step's phases; and the one-line progress a user watches.

Rewards are means over the step's valid samples (None in a step without any); a refiner's own
reward is the mean of the terms it owns over the samples it refined.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from algorithm.credit import total_reward
from algorithm.similarity import SimilaritySums, group_similarity
from tasks.reward_guard import FAULTS, RewardFaults

ZERO_SPREAD = 1e-8  # a group's reward std at most this is no spread (float noise on equal totals)


@contextmanager
def marked_timer(name: str, timings: dict[str, float]):
    """Add the seconds the block takes to `timings[name]` (verl's `marked_timer`)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def step_row(*, step: int, config, meta, total: np.ndarray, valid: np.ndarray, refined: np.ndarray,
             groups: np.ndarray, owns: dict[str, list[str]], lag: dict[str, np.ndarray], versions: dict[str, int],
             stats: dict[str, dict], actor_faults: dict[str, int], sync, timings: dict[str, float]) -> dict:
    """The metrics row of a step: `meta` is its rollout's (experts/pipeline.py), `valid` the samples
    learnt from, `groups` each sample's prompt group, `owns` each refiner's terms, `lag` each
    sample's versions behind each expert, `stats` the updates', `sync` the publish's result and
    `timings` the driver's phases (marked_timer)."""
    return {"step": step, "n_experts": len(versions), "credit": config.algorithm.credit,
            "rollouts": (step + 1) * config.trainer.prompts_per_step * config.algorithm.group_size,
            **reward_metrics(meta.terms, total, valid, refined & valid, owns=owns),
            **group_metrics(total, meta.terms, valid, groups, similarity=meta.similarity),
            **fault_metrics(meta.faults, actor_faults, meta.valid, valid),
            **{f"version/{e}": v for e, v in versions.items()}, "version/text_encoder": meta.versions[0]["text_encoder"],
            **update_metrics(stats),
            "text_encoder/cache_hit_rate": meta.cache_hits / max(1, meta.cache_hits + meta.cache_misses),
            **counterfactual_metrics({e: total_reward(terms, config.reward.weights)
                                      for e, terms in meta.counterfactual.items()}, total, valid),
            "sample/refinements": meta.refinements[0],
            **staleness_metrics(lag, meta.valid, valid),
            "sync/via": sync.via,  # collective, object_store (also a collective run's fallback), none (colocated), None
            "time/rollout_s": meta.busy_s, "time/update_s": timings["update_s"], "time/sync_s": sync.sync_s,
            "time/idle_s": max(0.0, timings["step_s"] - meta.busy_s), "time/step_s": timings["step_s"]}


def mean_where(values: np.ndarray, where: np.ndarray) -> float | None:
    return float(values[where].mean()) if where.any() else None


def reward_metrics(terms: dict[str, np.ndarray], total: np.ndarray, valid: np.ndarray, refined: np.ndarray,
                   *, owns: dict[str, list[str]]) -> dict:
    """reward/total, reward/<term> and reward/<refiner id> (the terms it owns, where it refined)."""
    row = {"reward/total": mean_where(total, valid)}
    row.update({f"reward/{t}": mean_where(v, valid) for t, v in terms.items()})
    for e, owned in owns.items():
        row[f"reward/{e}"] = float(np.mean([terms[t][refined].mean() for t in owned])) if refined.any() else None
    return row


def group_metrics(total: np.ndarray, terms: dict[str, np.ndarray], valid: np.ndarray, groups: np.ndarray,
                  *, similarity: SimilaritySums) -> dict:
    """Over the prompt groups with a valid sample: groups/zero_std, the share whose total reward has
    no spread over their valid samples (population std, algorithm/credit.py's, at most ZERO_SPREAD:
    every advantage 0, nothing for the generator to learn from that group) and groups/reward_std,
    the mean of those stds; groups/zero_std/<term>, the same share for each term alone (a joint run's
    text terms keep the total spread where its images are all alike: the image term's says so);
    groups/similarity, the mean over groups of their samples' mean pairwise similarity
    (algorithm/similarity.py; every sample generated, valid or not). None without any."""
    members = [(groups == g) & valid for g in np.unique(groups[valid])]
    stds = np.array([total[m].std() for m in members])
    alike = list(group_similarity(similarity).values())
    return {"groups/zero_std": float(np.mean(stds <= ZERO_SPREAD)) if members else None,
            "groups/reward_std": float(stds.mean()) if members else None,
            **{f"groups/zero_std/{t}": float(np.mean([v[m].std() <= ZERO_SPREAD for m in members])) if members else None
               for t, v in terms.items()},
            "groups/similarity": float(np.mean(alike)) if alike else None}


def update_metrics(stats: dict[str, dict]) -> dict:
    """loss/<id>, kl/<id> and ppo/ratio_mean/<id> of every expert updated this step (the mean ratio
    of its new to its rollout log-probs: 1 on-policy, the first check of a new setup), its
    grad_norm/<id> (the gradient's global norm before clipping, experts/expert.py), a refiner's
    refiner/<id>/logprob_gap and _max (mean and largest |trainer - rollout| log-prob per token: 0 to
    rounding with engine=hf, the engine's error with vllm), and ppo/ratio_mean, the generator's."""
    row = {}
    for e, s in stats.items():
        row[f"loss/{e}"], row[f"kl/{e}"], row[f"ppo/ratio_mean/{e}"] = s["loss"], s["kl"], s["ratio_mean"]
        row[f"grad_norm/{e}"] = s["grad_norm"]
        if "logprob_gap" in s:  # a refiner's
            row[f"refiner/{e}/logprob_gap"], row[f"refiner/{e}/logprob_gap_max"] = s["logprob_gap"], \
                s["logprob_gap_max"]
    if "generator" in stats:
        row["ppo/ratio_mean"] = stats["generator"]["ratio_mean"]
    return row


def counterfactual_metrics(without: dict[str, np.ndarray], total: np.ndarray, valid: np.ndarray) -> dict:
    """counterfactual/<refiner id>: mean D_k = R - R(without y_k) over the valid samples drawn,
    from each refiner's counterfactual totals `without` (NaN where not drawn)."""
    row = {}
    for e, totals in without.items():
        drawn = ~np.isnan(totals) & valid
        row[f"counterfactual/{e}"] = float(np.mean(total[drawn] - totals[drawn])) if drawn.any() else 0.0
    if without:
        row["counterfactual/generations"] = int(sum((~np.isnan(v)).sum() for v in without.values()))
    return row


def fault_metrics(reward_faults: RewardFaults, actor_faults: dict[str, int], rewarded: np.ndarray,
                  valid: np.ndarray) -> dict:
    """Reward faults of this step, actor faults survived so far, and the samples each dropped."""
    return {**{f"faults/{k}": reward_faults.counts.get(k, 0) for k in FAULTS},
            "faults/skipped_update": int(not valid.any()),
            **{f"faults/{k}": n for k, n in actor_faults.items()}, "faults/dropped_samples": int((~rewarded).sum())}


def staleness_metrics(lag: dict[str, np.ndarray], rewarded: np.ndarray, valid: np.ndarray) -> dict:
    """staleness/<id>: the largest lag of the step's samples behind each expert; and those dropped for it."""
    return {**{f"staleness/{e}": int(v.max()) for e, v in lag.items()},
            "staleness/dropped_samples": int((rewarded & ~valid).sum())}


class MetricsLog:
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, flushed as it is written.

    On resume (`keep_before` > 0) the rows of steps before it are kept and the rest, written after
    the checkpoint by the run that stopped, are dropped: those steps are trained again."""

    def __init__(self, path: Path, keep_before: int = 0):
        self.path = path
        self.rows: list[dict] = []
        if keep_before:
            rows = [parse(line) for line in (path.read_text().splitlines() if path.is_file() else [])]
            self.rows = [r for r in rows if r is not None and r["step"] < keep_before]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            tmp.replace(path)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def eval_metrics(report: dict) -> dict:
    """eval/<set>/<mode>/<measure>: each measure's overall, for the metrics log and trackers."""
    return {f"eval/{name}/{mode}/{measure}": s["overall"]
            for name, by_mode in report.items() for mode, found in by_mode.items() for measure, s in found.items()}


def parse(line: str) -> dict | None:
    """One metrics row; None for a line cut short by a killed process (always a later step)."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def progress_line(row: dict) -> str:
    versions = " ".join(f"{k.split('/', 1)[1].replace('refiner_', 'r')}={int(v)}"
                        for k, v in row.items() if k.startswith("version/") and k != "version/text_encoder")
    reward = "n/a" if row["reward/total"] is None else f"{row['reward/total']:.3f}"
    dropped = f" dropped={row['faults/dropped_samples']}" if row.get("faults/dropped_samples") else ""
    return f"reward={reward} v[{versions}]{dropped} {row['time/step_s']:.2f}s/step"
