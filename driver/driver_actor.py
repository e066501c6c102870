"""`DriverActor`: the training loop. `train_step` is the algorithm and nothing else:

prompts -> rollouts (refine, generate, reward: on every worker, or on the experts' own ranks under
`cluster.layout=colocated`) -> advantages -> the N+1 expert updates, concurrently -> publish ->
metrics row. The driver moves metadata and ObjectRefs only: token batches and trajectories travel
from those who roll out to the experts through the object store.
Fault recovery and asynchronous bookkeeping live next to the engines, in the expert group and the
rollout pool (cluster/), which share one fault counter.
"""
from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import ray

from algorithm.batch import step_samples
from algorithm.credit import advantages, total_reward
from algorithm.staleness import lags, within
from cluster.expert_actor import ExpertActor
from cluster.expert_group import ExpertGroup
from cluster.layouts import LAYOUTS
from cluster.placement import Placement
from cluster.recovery import FaultCounts, here
from cluster.runtime import Runtime, get
from cluster.startup import reports_start
from driver import checkpoint, metrics
from driver.checkpoint import checkpoint_exists, checkpoint_path
from driver.metrics import MetricsLog, marked_timer
from driver.trackers import Trackers
from tasks import build_task
from tasks.reward_guard import FailingRewards


def run_here(mode: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` in a Ray task on this process's node (`mode` ray: its ObjectRef
    arguments, at any depth, are fetched there and not here), or in-process (inline); its error is
    raised as `fn` raised it."""
    if mode == "inline":
        return fn(*args, **kwargs)
    task = ray.remote(fn).options(num_cpus=0, max_retries=0, scheduling_strategy=here())
    try:
        return ray.get(task.remote(*args, **kwargs))
    except ray.exceptions.RayTaskError as error:
        raise (error.cause or error) from None


class DriverActor:
    @reports_start
    def __init__(self, config, run_dir: str, resume: str | None = None, placement: Placement | None = None,
                 expert_cls=ExpertActor):  # positional: Ray passes Runtime.spawn's *args on
        """`resume`: a checkpoint folder; the run continues from its step with every expert's
        weights, optimizer state and version restored, exactly as if it had never stopped.
        `placement`: the bundles reserved for this run's actors (ray mode). `expert_cls`: the
        experts' actor class (bench/perf.py's scaling simulation swaps in one whose update sleeps)."""
        self.config, self.run_dir = config, Path(run_dir)
        self.prompts = build_task(config).train_prompts()
        self.trained = [e for e in config.experts.ids() if config.expert(e).train]
        self.owns = {e: r.owns for e, r in config.experts.active_refiners().items()}
        self.start_step, states = checkpoint.load(Path(resume), config.experts.ids()) if resume else (0, {})
        runtime = Runtime(config.cluster.mode, config.trainer.run_name, config.cluster.max_restarts, placement)
        self.placement, self.faults = placement, FaultCounts()
        self.rollouts = LAYOUTS[config.cluster.layout](config, runtime, self.faults, self.samples)
        self.experts = ExpertGroup(config, runtime, self.faults, self.rollouts.workers, states=states,
                                   expert_cls=expert_cls)
        if resume:
            self.rollouts.resubmit(checkpoint.load_in_flight(Path(resume)), self.start_step, self.experts)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", keep_before=self.start_step)
        self.stopping = False
        self.failing = FailingRewards(config.reward.max_failed_steps)
        self.trackers = Trackers(config, self.run_dir, self.start_step)

    def samples(self, step: int) -> list:
        """`step`'s samples: G per prompt, the last S of each group with the original prompt."""
        t, a = self.config.trainer, self.config.algorithm
        return step_samples(self.prompts, step=step, seed=t.seed, prompts_per_step=t.prompts_per_step,
                            group_size=a.group_size, num_skip_refinement=a.num_skip_refinement,
                            refine=not self.config.experts.generator_only)

    def train_step(self, step: int) -> dict:
        """prompts -> rollouts -> advantages -> expert updates -> publish -> the step's metrics row."""
        cfg, timings = self.config, {}
        with marked_timer("step_s", timings):
            rollout = self.rollouts.collect(step, self.experts)  # `samples(step)`, rolled out (maybe ahead)
            meta = rollout.meta
            self.failing.observe(meta.valid, meta.faults)
            lag = lags(meta.versions, self.experts.versions)
            valid = meta.valid & within(lag, cfg.cluster.max_staleness)
            adv = advantages(mode=cfg.algorithm.credit, terms=meta.terms, weights=cfg.reward.weights,
                             groups=rollout.groups, refined=rollout.refined, owns=self.owns,
                             clip=cfg.algorithm.adv_clip, counterfactual=meta.counterfactual, valid=valid,
                             generator_terms=cfg.experts.generator.owns, per_term=cfg.reward.normalize == "per_term",
                             batch_std=cfg.algorithm.adv_std == "batch")
            due = [e for e in self.trained if step % cfg.expert(e).update_every == 0 and valid.any()]
            with marked_timer("update_s", timings):
                stats = self.experts.update(step, due, adv, rollout,
                                            remake=partial(self.rollouts.remake, step, rollout, self.experts))
            sync = self.experts.publish(self.experts.ids if self.rollouts.take_reloaded() else due)
            total = total_reward(meta.terms, cfg.reward.weights)
            if meta.images is not None:
                self.log_samples(step, rollout, total, valid)
        return metrics.step_row(step=step, config=cfg, meta=meta, total=total, valid=valid, refined=rollout.refined,
                                groups=rollout.groups, owns=self.owns, lag=lag, versions=self.experts.versions,
                                stats=stats, actor_faults=self.faults.as_dict(), sync=sync, timings=timings)

    def log_samples(self, step: int, rollout, total: np.ndarray, valid: np.ndarray) -> None:
        """The step's first `logging.images_per_log` samples, with their prompts and rewards."""
        n = self.config.logging.images_per_log
        self.trackers.samples(step, rollout.meta.images[:n], [s.prompt.text for s in rollout.samples[:n]],
                              rollout.meta.refinements[:n],
                              rewards=[float(t) if v else None for t, v in zip(total[:n], valid[:n])])

    def save_checkpoint(self, step: int) -> Path:
        """Every expert's snapshot, plus the older weights the rollouts in flight were made with,
        written by a task on this node from the references the driver holds (the ranks of a
        sharded expert on this node write their optimizer shards into the folder themselves)."""
        staging = checkpoint.staging(self.run_dir, step)
        try:
            snapshots = self.experts.saved_snapshots(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return run_here(self.config.cluster.mode, checkpoint.save_fetched, self.run_dir, step, snapshots,
                        keep=self.config.trainer.keep_checkpoints,
                        in_flight=self.rollouts.older_weights(self.experts.versions), staged=True)

    def run(self, on_row=None) -> dict:
        """Train until `trainer.steps`, or until `stop()` was asked, or until the reward failed on
        every sample of `reward.max_failed_steps` steps in a row (`rewards_failed` in the summary
        says how): then the step under way is finished and the last completed one checkpointed.
        Checkpoints also come every `trainer.checkpoint_every` steps and `trainer.checkpoint_every_s`
        seconds."""
        t = self.config.trainer
        step, saved_at, checkpoint = self.start_step, time.monotonic(), None
        try:
            while step < t.steps and not self.stopping and not self.failing.stop:
                row = self.train_step(step)
                if self.evaluation_due(step):
                    with marked_timer("time/eval_s", row):
                        row.update(metrics.eval_metrics(self.rollouts.evaluate()))
                self.metrics.append(row)
                self.trackers.log(row)
                if on_row:
                    on_row(row)
                step += 1
                if self.checkpoint_due(step, saved_at):
                    checkpoint, saved_at = self.save_checkpoint(step), time.monotonic()
            if checkpoint is None and not checkpoint_exists(self.run_dir, step):  # stopped before a step ended
                checkpoint = self.save_checkpoint(step)
        finally:
            self.trackers.close()
        return {"run_dir": str(self.run_dir), "steps": step, "stopped": step < t.steps,
                "rewards_failed": str(self.failing) if self.failing.stop else None,
                "checkpoint": str(checkpoint or checkpoint_path(self.run_dir, step)),
                "last": self.metrics.rows[-1] if self.metrics.rows else None}

    def checkpoint_due(self, step: int, saved_at: float) -> bool:
        """Whether to checkpoint once `step` steps are done: every `trainer.checkpoint_every` steps and
        `trainer.checkpoint_every_s` seconds (since `saved_at`), after the last, and when the run stops."""
        t = self.config.trainer
        return bool(t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or self.stopping \
            or self.failing.stop or bool(t.checkpoint_every_s and time.monotonic() - saved_at >= t.checkpoint_every_s)

    def evaluation_due(self, step: int) -> bool:
        """`evaluation.every` steps, and after the last step."""
        every = self.config.evaluation.every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == self.config.trainer.steps)

    def stop(self) -> None:
        """Ask `run` to stop after the step under way (an interrupt: Ctrl-C, SIGTERM)."""
        self.stopping = True

    def poll(self, since: int) -> list[dict]:
        """Metric rows from index `since` on: callers stream progress with this while `run` runs."""
        return self.metrics.rows[since:]

    def inspect(self) -> dict:
        """Where every version stands: experts, workers, the sync registry, and who is trained."""
        return {**self.experts.inspect(), "workers": get([w.version_vector.remote() for w in self.rollouts.workers]),
                "update_targets": list(self.trained), "in_flight": sorted(self.rollouts.in_flight)}

    def shutdown(self) -> None:
        """Stop this run's actors and give back its placement groups (they would outlive the driver)."""
        if self.config.cluster.mode == "inline":
            return
        for handle in [*self.experts.actors(), *self.rollouts.actors()]:
            ray.kill(handle, no_restart=True)
        if self.placement:
            self.placement.release()

    def expert_weights(self, expert_id: str):
        """The weights of `expert_id`'s latest snapshot (what was last published), as a reference
        for the caller to fetch (`get` of this call's result, then of what it holds)."""
        return self.experts.latest_weights(expert_id)
