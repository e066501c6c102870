"""`DriverActor`: the training loop of SPEC §2, visible at a glance in `train_step`.

prompts -> rollout (refine, generate, reward; on every worker) -> advantages -> the N+1 expert
updates, concurrently -> weight sync -> metrics. The driver holds metadata and ObjectRefs only:
token batches and trajectories travel from rollout workers to the experts through the object store.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from cluster.rollout import RolloutWorker
from cluster.runtime import Runtime, get
from cluster.weight_sync import WeightSyncActor
from driver import checkpoint
from driver.credit import advantages
from driver.metrics import MetricsLog
from experts.actor import ExpertActor
from experts.seeding import derive_seed
from tasks.reward import total_reward
from tasks.shapes import prompt_set


def gather(metas: list[dict], key: str) -> dict[str, np.ndarray]:
    """Per-sample arrays under `key` from every rollout shard, joined in sample order."""
    return {k: np.concatenate([m[key][k] for m in metas]) for k in metas[0][key]}


class DriverActor:
    def __init__(self, config, run_dir: str):
        self.config, self.run_dir = config, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.prompts = prompt_set(config.trainer.n_train_prompts, derive_seed(config.trainer.seed, "prompts"))
        self.runtime = Runtime(config.cluster.mode, config.trainer.run_name)
        self.expert_ids = config.experts.ids()
        self.trained = [e for e in self.expert_ids if config.expert(e).train]
        self.owns = {e: r.owns for e, r in config.experts.active_refiners().items()}
        self.credited = {**self.owns, **({"generator": config.experts.generator.owns}
                                         if config.experts.generator.owns else {})}
        self.experts = {e: self.runtime.spawn(ExpertActor, config, e, name=f"expert/{e}")
                        for e in self.expert_ids}
        self.workers = [self.runtime.spawn(RolloutWorker, config, j, name=f"rollout/{j}")
                        for j in range(config.cluster.rollout_workers)]
        self.sync = self.runtime.spawn(WeightSyncActor, self.workers, name="weight_sync")
        self.versions = {e: 0 for e in self.expert_ids}
        self.publish(self.expert_ids)

    def publish(self, expert_ids: list[str]) -> float:
        """Deliver the current weights of `expert_ids` to every rollout worker; returns seconds."""
        releases = [(e, self.versions[e], [self.experts[e].weights.remote()]) for e in expert_ids]
        return get(self.sync.publish.remote(releases))["sync_s"] if releases else 0.0

    def make_items(self, step: int) -> list[dict]:
        """This step's samples: G per prompt, the last S of each group with the original prompt."""
        t, a = self.config.trainer, self.config.algorithm
        rng = np.random.default_rng(derive_seed(t.seed, "batch", step))
        chosen = rng.choice(len(self.prompts), size=t.prompts_per_step, replace=False)
        return [{"sample": g * a.group_size + k, "group": g, "prompt": self.prompts[p],
                 "refine": k < a.group_size - a.num_skip_refinement and not self.config.experts.generator_only}
                for g, p in enumerate(chosen) for k in range(a.group_size)]

    def train_step(self, step: int) -> dict:
        start = time.perf_counter()
        items = self.make_items(step)
        shards = [list(s) for s in np.array_split(np.array(items, dtype=object), len(self.workers))]
        outs = [w.rollout.options(num_returns=3).remote(step, s) for w, s in zip(self.workers, shards)]
        metas = get([o[0] for o in outs])        # small: rewards, version vectors, refinements
        self.check_versions(step, [v for m in metas for v in m["versions"]])
        terms, counterfactual = gather(metas, "terms"), gather(metas, "counterfactual")
        groups = np.array([it["group"] for it in items])
        refined = np.array([it["refine"] for it in items])
        adv = advantages(self.config.algorithm.credit, terms, self.config.reward.weights, groups, refined,
                         self.credited, self.config.algorithm.adv_clip, counterfactual)
        t_update = time.perf_counter()
        due = [e for e in self.trained if step % self.config.expert(e).update_every == 0]
        calls = {e: self.experts[e].update.remote(step, adv[e], *[o[2] for o in outs]) if e == "generator"
                 else self.experts[e].update.remote(step, adv[e][refined], *[o[1] for o in outs]) for e in due}
        stats = get(calls)  # the updates above run concurrently, one per expert actor
        self.versions.update({e: s["version"] for e, s in stats.items()})
        t_sync = time.perf_counter()
        sync_s = self.publish(due)
        row = self.metrics_row(step, terms, counterfactual, refined, metas, stats)
        row.update({"time/rollout_s": t_update - start, "time/update_s": t_sync - t_update,
                    "time/sync_s": sync_s, "time/step_s": time.perf_counter() - start})
        return row

    def check_versions(self, step: int, vectors: list[dict]) -> None:
        """Synchronous training: every sample must come from the versions published so far."""
        for v in vectors:
            stale = {e: v[e] for e in self.expert_ids if v[e] != self.versions[e]}
            if stale:
                raise RuntimeError(f"step {step}: samples made with stale weights {stale}, "
                                   f"expected {self.versions}")

    def metrics_row(self, step, terms, counterfactual, refined, metas, stats) -> dict:
        cfg = self.config
        total = total_reward(terms, cfg.reward.weights)
        row = {"step": step, "n_experts": len(self.expert_ids), "credit": cfg.algorithm.credit,
               "rollouts": (step + 1) * cfg.trainer.prompts_per_step * cfg.algorithm.group_size,
               "reward/total": float(total.mean())}
        row.update({f"reward/{t}": float(v.mean()) for t, v in terms.items()})
        for e, owned in self.owns.items():
            row[f"reward/{e}"] = float(np.mean([terms[t][refined].mean() for t in owned]))
        row.update({f"version/{e}": v for e, v in self.versions.items()})
        row["version/text_encoder"] = metas[0]["versions"][0]["text_encoder"]
        for e, s in stats.items():
            row[f"loss/{e}"], row[f"kl/{e}"] = s["loss"], s["kl"]
        if "generator" in stats:
            row["ppo/ratio_mean"] = stats["generator"]["ratio_mean"]
        hits = sum(m["cache_hits"] for m in metas)
        row["text_encoder/cache_hit_rate"] = hits / max(1, hits + sum(m["cache_misses"] for m in metas))
        for e, without in counterfactual.items():
            drawn = ~np.isnan(without)
            row[f"counterfactual/{e}"] = float(np.mean(total[drawn] - without[drawn])) if drawn.any() else 0.0
        if counterfactual:
            row["counterfactual/generations"] = int(sum((~np.isnan(v)).sum() for v in counterfactual.values()))
        row["sample/refinements"] = metas[0]["refinements"][0]
        return row

    def save_checkpoint(self, step: int) -> Path:
        states = get({e: self.experts[e].state.remote() for e in self.expert_ids})
        return checkpoint.save(self.run_dir, step, states)

    def run(self, on_row=None) -> dict:
        every = self.config.trainer.checkpoint_every
        steps = self.config.trainer.steps
        for step in range(steps):
            row = self.train_step(step)
            self.metrics.append(row)
            if on_row:
                on_row(row)
            if (every and (step + 1) % every == 0) or step + 1 == steps:
                self.save_checkpoint(step + 1)
        return {"run_dir": str(self.run_dir), "steps": steps, "last": self.metrics.rows[-1]}

    def poll(self, since: int) -> list[dict]:
        """Metric rows from index `since` on: the CLI streams progress with this while `run` runs."""
        return self.metrics.rows[since:]

    def inspect(self) -> dict:
        """Where every version stands: experts, workers, the sync registry, and who is trained."""
        return {"experts": get({e: h.info.remote() for e, h in self.experts.items()}),
                "workers": get([w.version_vector.remote() for w in self.workers]),
                "registry": get(self.sync.registrations.remote()), "update_targets": list(self.trained)}

    def expert_weights(self, expert_id: str) -> dict:
        return get(self.experts[expert_id].weights.remote())
