"""`DriverActor`: the training loop of SPEC §2, visible at a glance in `train_step`.

prompts -> rollout (refine, generate, reward; on every worker) -> advantages -> the N+1 expert
updates, concurrently -> weight sync -> metrics. The driver holds metadata and ObjectRefs only:
token batches and trajectories travel from rollout workers to the experts through the object store.

With `cluster.max_staleness=k` the rollouts of steps t+1..t+k are already submitted while step t
updates. Each rollout names the versions published when it was submitted, and a worker holds every
version a rollout in flight may still name, so a publish that reaches a worker first (it comes
from the weight-sync actor, another caller) never changes the weights of a rollout submitted before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import ObjectLostError

from cluster.placement import Placement
from cluster.recovery import NotSynced, RolloutLost, SnapshotLost, keep_here, settle, survive
from cluster.reward_pool import RewardActor
from cluster.rollout import RolloutWorker
from cluster.runtime import Runtime, get
from cluster.weight_sync import WeightSyncActor, fingerprint
from driver import checkpoint
from driver.config import dump_config
from driver.credit import advantages
from driver.metrics import MetricsLog
from driver.staleness import lags, within
from driver.trackers import Trackers
from experts.actor import ExpertActor, StaleExpert
from experts.seeding import derive_seed
from tasks.reward import total_reward
from tasks.reward_guard import FAULTS
from tasks.shapes import prompt_set


def gather(metas: list[dict], key: str) -> dict[str, np.ndarray]:
    """Per-sample arrays under `key` from every rollout shard, joined in sample order."""
    return {k: np.concatenate([m[key][k] for m in metas]) for k in metas[0][key]}


@dataclass
class Rollout:
    """One step's rollout in flight: its samples, each worker's share and (meta, tokens,
    trajectories) refs, and the weights every worker held when it was submitted, {expert:
    (version, weights ref, fingerprint)}, which a restarted worker is given again to redo it."""
    items: list[dict]
    shards: list[list[dict]]
    outs: list[tuple]
    weights: dict[str, tuple]

    @property
    def versions(self) -> dict[str, int]:
        """The version of every expert this rollout is made with (its workers are told so)."""
        return {e: w[0] for e, w in self.weights.items()}


class DriverActor:
    def __init__(self, config, run_dir: str, resume: str | None = None, placement: Placement | None = None,
                 expert_cls=ExpertActor):
        """`resume`: a checkpoint folder; the run continues from its step with every expert's
        weights, optimizer state and version restored, exactly as if it had never stopped.
        `placement`: the bundles reserved for this run's actors (ray mode). `expert_cls`: the
        experts' actor class (bench/perf.py's scaling simulation swaps in one whose update sleeps)."""
        self.config, self.run_dir = config, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not (self.run_dir / "config.yaml").exists():  # the CLI writes it first; a run started from Python too
            (self.run_dir / "config.yaml").write_text(dump_config(config))
        self.prompts = prompt_set(config.trainer.n_train_prompts, derive_seed(config.trainer.seed, "prompts"))
        self.runtime = Runtime(config.cluster.mode, config.trainer.run_name)
        self.expert_ids = config.experts.ids()
        self.trained = [e for e in self.expert_ids if config.expert(e).train]
        self.owns = {e: r.owns for e, r in config.experts.active_refiners().items()}
        self.credited = {**self.owns, **({"generator": config.experts.generator.owns}
                                         if config.experts.generator.owns else {})}
        self.placement = placement
        self.experts = {e: self.runtime.spawn(expert_cls, config, e, name=f"expert/{e}",
                                              **self.options(f"expert/{e}", config.expert(e).resources))
                        for e in self.expert_ids}
        self.rewarders = [self.runtime.spawn(RewardActor, config, k, name=f"reward/{k}",
                                             **self.options(f"reward/{k}", config.reward.resources))
                          for k in range(config.reward.actors)]
        self.workers = [self.runtime.spawn(RolloutWorker, config, j, self.rewarders or None, name=f"rollout/{j}",
                                           **self.options(f"rollout/{j}", config.cluster.rollout_resources))
                        for j in range(config.cluster.rollout_workers)]
        collective = config.cluster.sync == "collective" and config.cluster.mode == "ray"
        self.sync = self.runtime.spawn(
            WeightSyncActor, self.workers, self.experts if collective else None,
            {"backend": config.cluster.collective_backend, "timeout_s": config.cluster.collective_timeout_s}
            if collective else None, name="weight_sync", **self.options("weight_sync"))
        self.start_step = 0
        self.in_flight: dict[int, Rollout] = {}  # submitted rollouts by step, at most max_staleness ahead
        self.reloaded = False  # a worker was given older weights to redo a rollout: publish all after the step
        self.faults = {"expert_restarts": 0, "worker_restarts": 0, "sync_restarts": 0, "sync_fallbacks": 0,
                       "rollouts_lost": 0}
        states = {}
        if resume:
            self.start_step, states = checkpoint.load(Path(resume), self.expert_ids)
        self.nodes: dict[str, str | None] = {}
        self.snapshots = {e: self.first_snapshot(e, states.get(e)) for e in self.expert_ids}
        self.versions = {e: info["version"] for e, info in get({e: s[2] for e, s in self.snapshots.items()}).items()}
        self.published: dict[str, tuple] = {}  # expert -> (version, weights ref, fingerprint) every worker holds
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", keep_before=self.start_step)
        self.trackers = Trackers(config, self.run_dir, self.start_step)
        self.publish(self.expert_ids)
        if resume:
            self.resubmit_in_flight(checkpoint.load_in_flight(Path(resume)))

    def options(self, name: str, resources=None) -> dict:
        """Ray options of the actor `name`: restarts, its resources and, if it reserved any, its bundle."""
        return {"max_restarts": self.config.cluster.max_restarts, "max_task_retries": 0,
                **(resources.options() if resources else {}),
                **(self.placement.options.get(name, {}) if self.placement else {})}

    def first_snapshot(self, e: str, state: tuple | None) -> tuple:
        """Expert `e`'s starting snapshot, once it holds `state` (a checkpoint's) if given. An expert
        killed meanwhile restarts as its config builds it, and is restored again."""
        expert = self.experts[e]

        def attempt(first):
            if state:
                get(expert.restore.remote(*state))
            self.nodes[e] = get(expert.node.remote())
            snapshot = keep_here(expert.snapshot.options(num_returns=3).remote(), self.nodes[e])
            get(snapshot[2])
            return snapshot
        snapshot, faults = survive(attempt, lambda: get(expert.info.remote()), self.config.cluster.max_restarts,
                                   lost=(SnapshotLost,))
        self.faults["expert_restarts"] += faults
        return snapshot

    def publish(self, expert_ids: list[str]) -> dict:
        """Deliver the latest snapshot weights of `expert_ids` to every rollout worker: {sync_s, via}."""
        infos = get({e: self.snapshots[e][2] for e in expert_ids})
        return self.deliver({e: (self.versions[e], self.snapshots[e][0], infos[e]["checksum"]) for e in expert_ids},
                            current=True)

    def deliver(self, releases: dict[str, tuple], current: bool = False) -> dict:
        """Give every worker these {expert: (version, weights ref, fingerprint)} and wait for their
        acknowledgements; returns {sync_s, via: how they went}. `current`: the experts hold these versions now, so a
        collective run may broadcast them. If the sync actor or a worker died, everything is
        delivered again through the object store, which rebuilds the restarted sync actor's
        registry and a restarted worker's weights."""
        def attempt(first):
            send = releases if first else {**self.published, **releases}
            return get(self.sync.publish.remote([(e, v, checksum, [ref]) for e, (v, ref, checksum) in send.items()],
                                                broadcast=current and first))

        def alive():  # the sync actor and every worker answer once Ray has restarted them
            get([self.sync.registrations.remote(), *[w.version_vector.remote() for w in self.workers]])
        if not releases:
            return {"sync_s": 0.0, "via": None}
        out, faults = survive(attempt, alive, self.config.cluster.max_restarts)
        self.faults["sync_restarts"] += faults
        self.faults["sync_fallbacks"] += out["fallback"] is not None
        self.published.update(releases)
        return {"sync_s": out["sync_s"], "via": out["via"]}

    def submit_rollout(self, step: int) -> None:
        """Every worker's share of `step`'s samples, made with the weights published so far."""
        items = self.make_items(step)
        shards = [list(s) for s in np.array_split(np.array(items, dtype=object), len(self.workers))]
        rollout = self.in_flight[step] = Rollout(items, shards, [], dict(self.published))
        rollout.outs = [w.rollout.options(num_returns=3).remote(step, s, rollout.versions)
                        for w, s in zip(self.workers, shards)]

    def submit_under(self, step: int, weights: dict[str, tuple]) -> None:
        """`step`'s rollout made again with the `weights` it was first made with: the workers get
        the ones that changed since, then what they held before."""
        held = dict(self.published)
        changed = {e: w for e, w in weights.items() if w[0] != held[e][0]}
        self.deliver(changed)
        self.submit_rollout(step)
        self.deliver({e: held[e] for e in changed})

    def look_ahead(self, step: int) -> None:
        """Rollouts in flight for `step` and up to `cluster.max_staleness` steps after it."""
        last = min(step + self.config.cluster.max_staleness, self.config.trainer.steps - 1)
        for s in range(step, last + 1):
            if s not in self.in_flight:
                self.submit_rollout(s)

    def resubmit_in_flight(self, saved: dict[int, dict[str, tuple]]) -> None:
        """The rollouts a checkpoint had in flight, each made again with the older weights it was
        made with ({step: {expert: (version, weights)}}), so that a resumed run equals the
        uninterrupted one. Those beyond this run's `max_staleness` are left to `look_ahead`."""
        for s in sorted(saved):
            if s - self.start_step < self.config.cluster.max_staleness:
                older = {e: (v, self.runtime.put(w), fingerprint(w)) for e, (v, w) in saved[s].items()}
                self.submit_under(s, {**self.published, **older})

    def collect(self, step: int) -> list[dict]:
        """The metas of `step`'s rollout from every worker. A worker that died is restarted by Ray,
        loaded with the weights the rollout was submitted under and given its share again: a
        rollout is a pure function of step and weights."""
        rollout, metas = self.in_flight[step], []
        for j, worker in enumerate(self.workers):
            def attempt(first, worker=worker, j=j):
                if not first:
                    settle(rollout.outs[j][1:])
                    rollout.outs[j] = worker.rollout.options(num_returns=3).remote(step, rollout.shards[j],
                                                                                   rollout.versions)
                return get(rollout.outs[j][0])

            def reload(worker=worker):
                self.reloaded = True
                get([worker.load_weights.remote(e, *rollout.weights[e]) for e in self.expert_ids])
            meta, faults = survive(attempt, reload, self.config.cluster.max_restarts, lost=(NotSynced,))
            self.faults["worker_restarts"] += faults
            metas.append(meta)
        return metas

    def update(self, step: int, due: list[str], args: dict[str, tuple], stats: dict[str, dict]) -> None:
        """The due experts' updates, concurrently, then each one's new snapshot; each expert's
        stats go into `stats` as it finishes. An expert that died is restarted by Ray, restored
        from its previous snapshot and given the same update again: applied exactly once. A
        restarted instance never passes for the old one: it refuses an update from a version it
        does not hold, and its snapshot must show this step's version. Raises RolloutLost if the
        rollout outputs an update reads were lost with their node."""
        def submit(e):
            return (self.experts[e].update.remote(step, self.versions[e], *args[e]),
                    self.experts[e].snapshot.options(num_returns=3).remote())
        calls = {e: submit(e) for e in due}
        for e in due:
            def attempt(first, e=e):
                if not first:
                    calls[e] = submit(e)
                try:
                    result, info = get(calls[e][0]), get(calls[e][1][2])
                except ObjectLostError as lost:
                    raise RolloutLost(f"step {step}: {e}'s update lost its inputs ({type(lost).__name__})") from lost
                if (info["version"], info["last_step"]) != (self.versions[e] + 1, step):
                    raise StaleExpert(f"{e}: its snapshot after step {step} shows {info}")
                return result, keep_here(calls[e][1], self.nodes[e])

            def restore(e=e, previous=self.snapshots[e]):
                get(self.experts[e].restore.remote(*previous))
                self.nodes[e] = get(self.experts[e].node.remote())
            (stats[e], self.snapshots[e]), faults = survive(attempt, restore, self.config.cluster.max_restarts,
                                                            lost=(StaleExpert, SnapshotLost))
            self.faults["expert_restarts"] += faults

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
        stats: dict[str, dict] = {}
        while True:  # a rollout is a pure function of step and weights: one lost with a node is made again
            self.look_ahead(step)
            rollout = self.in_flight[step]
            metas = self.collect(step)  # metas are small: rewards, version vectors, refinements
            groups = np.array([it["group"] for it in rollout.items])
            refined = np.array([it["refine"] for it in rollout.items])
            lag = lags([v for m in metas for v in m["versions"]], self.versions)
            rewarded = gather(metas, "valid")["valid"]
            valid = rewarded & within(lag, self.config.cluster.max_staleness)
            terms, counterfactual = gather(metas, "terms"), gather(metas, "counterfactual")
            adv = advantages(self.config.algorithm.credit, terms, self.config.reward.weights, groups, refined,
                             self.credited, self.config.algorithm.adv_clip, counterfactual, valid)
            t_update = time.perf_counter()
            due = [e for e in self.trained if step % self.config.expert(e).update_every == 0 and valid.any()]
            try:
                self.update(step, [e for e in due if e not in stats],
                            {e: (adv[e], *[o[2] for o in rollout.outs]) if e == "generator"
                             else (adv[e][refined], *[o[1] for o in rollout.outs]) for e in due}, stats)
                break
            except RolloutLost:
                self.faults["rollouts_lost"] += 1
                self.submit_under(step, self.in_flight.pop(step).weights)
        del self.in_flight[step]
        self.versions.update({e: s["version"] for e, s in stats.items()})
        t_sync = time.perf_counter()
        sync = self.publish(self.expert_ids if self.reloaded else due)
        self.reloaded = False
        total = total_reward(terms, self.config.reward.weights)
        row = self.metrics_row(step, terms, total, counterfactual, refined & valid, valid, metas, stats)
        row.update({f"faults/{k}": n for k, n in self.faults.items()})  # actor faults survived so far
        row["faults/dropped_samples"] = int((~rewarded).sum())
        row.update({f"staleness/{e}": int(v.max()) for e, v in lag.items()})
        row["staleness/dropped_samples"] = int((rewarded & ~valid).sum())
        row["sync/via"] = sync["via"]  # collective, object_store (also a collective run's fallback), None
        if "images" in metas[0]:
            self.log_samples(step, rollout.items, metas, total, valid)
        rollout_s = max(m["busy_s"] for m in metas)  # the slowest worker's share
        step_s = time.perf_counter() - start
        row.update({"time/rollout_s": rollout_s, "time/update_s": t_sync - t_update, "time/sync_s": sync["sync_s"],
                    "time/idle_s": max(0.0, step_s - rollout_s), "time/step_s": step_s})
        return row

    def log_samples(self, step: int, items: list[dict], metas: list[dict], total: np.ndarray, valid: np.ndarray):
        """The step's first `logging.images_per_log` samples, with their prompts and rewards."""
        n = self.config.logging.images_per_log
        refinements = [r for m in metas for r in m["refinements"]][:n]
        self.trackers.samples(step, np.concatenate([m["images"] for m in metas])[:n],
                              [it["prompt"].text for it in items[:n]], refinements,
                              [float(t) if v else None for t, v in zip(total[:n], valid[:n])])

    def metrics_row(self, step, terms, total, counterfactual, refined, valid, metas, stats) -> dict:
        """Rewards are means over the valid samples (None in a step without any)."""
        cfg = self.config
        def mean(values, where):
            return float(values[where].mean()) if where.any() else None
        row = {"step": step, "n_experts": len(self.expert_ids), "credit": cfg.algorithm.credit,
               "rollouts": (step + 1) * cfg.trainer.prompts_per_step * cfg.algorithm.group_size,
               "reward/total": mean(total, valid)}
        row.update({f"reward/{t}": mean(v, valid) for t, v in terms.items()})
        for e, owned in self.owns.items():
            row[f"reward/{e}"] = float(np.mean([terms[t][refined].mean() for t in owned])) if refined.any() else None
        faults = {k: sum(m["faults"].get(k, 0) for m in metas) for k in FAULTS}
        row.update({f"faults/{k}": n for k, n in faults.items()})
        row["faults/skipped_update"] = int(not valid.any())
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
            drawn &= valid
            row[f"counterfactual/{e}"] = float(np.mean(total[drawn] - without[drawn])) if drawn.any() else 0.0
        if counterfactual:
            row["counterfactual/generations"] = int(sum((~np.isnan(v)).sum() for v in counterfactual.values()))
        row["sample/refinements"] = metas[0]["refinements"][0]
        return row

    def save_checkpoint(self, step: int) -> Path:
        """Every expert's snapshot, plus the older weights the rollouts in flight were made with."""
        snapshots = {e: tuple(get(list(refs))) for e, refs in self.snapshots.items()}
        in_flight = {s: {e: (w[0], get(w[1])) for e, w in r.weights.items() if w[0] != self.versions[e]}
                     for s, r in self.in_flight.items()}
        return checkpoint.save(self.run_dir, step, snapshots, keep=self.config.trainer.keep_checkpoints,
                               in_flight=in_flight)

    def run(self, on_row=None) -> dict:
        every = self.config.trainer.checkpoint_every
        steps = self.config.trainer.steps
        try:
            for step in range(self.start_step, steps):
                row = self.train_step(step)
                self.metrics.append(row)
                self.trackers.log(row)
                if on_row:
                    on_row(row)
                if (every and (step + 1) % every == 0) or step + 1 == steps:
                    self.save_checkpoint(step + 1)
        finally:
            self.trackers.close()
        return {"run_dir": str(self.run_dir), "steps": steps, "last": self.metrics.rows[-1]}

    def poll(self, since: int) -> list[dict]:
        """Metric rows from index `since` on: the CLI streams progress with this while `run` runs."""
        return self.metrics.rows[since:]

    def inspect(self) -> dict:
        """Where every version stands: experts, workers, the sync registry, and who is trained."""
        return {"experts": get({e: h.info.remote() for e, h in self.experts.items()}),
                "snapshots": {e: {k: info[k] for k in ("version", "last_step")}
                              for e, info in get({e: s[2] for e, s in self.snapshots.items()}).items()},
                "workers": get([w.version_vector.remote() for w in self.workers]),
                "registry": get(self.sync.registrations.remote()), "update_targets": list(self.trained),
                "in_flight": sorted(self.in_flight)}

    def shutdown(self) -> None:
        """Stop this run's actors and give back its placement groups (they would outlive the driver)."""
        if self.config.cluster.mode == "inline":
            return
        for handle in [*self.experts.values(), *self.workers, *self.rewarders, self.sync]:
            ray.kill(handle, no_restart=True)
        if self.placement:
            self.placement.release()

    def expert_weights(self, expert_id: str) -> dict:
        """The weights of `expert_id`'s latest snapshot (what was last published)."""
        return get(self.snapshots[expert_id][0])
