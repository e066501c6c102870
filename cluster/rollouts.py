"""What the driver asks of a layout's rollouts (`cluster.layout`), whoever makes them: `Rollouts`,
and `Rollout`, one step's.

A layout is a `Rollouts` subclass, registered by name in cluster/layouts.py `LAYOUTS`: the separate
layout's rollout workers (cluster/rollout_pool.py) or the experts' own ranks (cluster/colocated.py).
Every layout starts the run's reward pools the same way, here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from cluster.recovery import FaultCounts, Retry
from cluster.reward_pool import spawn_pools
from cluster.runtime import Runtime, get
from experts.pipeline import RolloutMeta, RolloutOutputs
from experts.records import Release


def shares(items: list, ranks: int) -> list[list]:
    """`items` in `ranks` contiguous shares, in order (sizes differ by at most one)."""
    return [list(s) for s in np.array_split(np.array(items, dtype=object), ranks)]


@dataclass
class Rollout:
    """One step's rollout: its samples, each worker's share, each share's outputs (ObjectRefs), the
    weights every worker was given for it, and, once collected, the metadata of all shares."""
    samples: list
    shares: list[list]
    outputs: list[RolloutOutputs]
    weights: dict[str, Release]
    meta: RolloutMeta | None = None
    tokens: dict[str, list] = field(default_factory=dict)  # colocated: {refiner: its ranks' token batches}
    refinements: list[dict] | None = None  # colocated: per sample {refiner: Refinement}, made before generating
    refined: np.ndarray = field(init=False)
    groups: np.ndarray = field(init=False)

    def __post_init__(self):
        self.refined = np.array([s.refine for s in self.samples])
        self.groups = np.array([s.group for s in self.samples])

    def outputs_for(self, expert_id: str) -> list[RolloutOutputs]:
        """The shares `expert_id`'s update reads: the workers' outputs, or under `cluster.layout=
        colocated` a refiner's token batches from its own ranks."""
        if expert_id in self.tokens:
            return [RolloutOutputs(None, None, {expert_id: t}) for t in self.tokens[expert_id]]
        return self.outputs

    @property
    def versions(self) -> dict[str, int]:
        """The version of every expert this rollout is made with (its workers are told so)."""
        return {e: w.version for e, w in self.weights.items()}


class Rollouts(ABC):
    """A layout's rollouts, as the driver's loop and the expert group use them. `workers`: the
    rollout workers the weight-sync actor delivers versions to (none where the experts roll out);
    `in_flight`: {step: Rollout} submitted ahead and not yet collected. What the plan reads of a
    layout (driver/plan.py, driver/commands/layout_plan.py) is its class's: `experts_roll_out`,
    `rollout_seconds` and `who_rolls_out`."""

    experts_roll_out = False  # whether each expert rank rolls out its share too (and holds what that needs)

    @staticmethod
    @abstractmethod
    def rollout_seconds(*, refine: dict[str, float], generate: float, samples: int, refined: int,
                        ranks: dict[str, int], workers: int) -> float:
        """A synchronous step's rollout phase, as long as its busiest device: `refine` (per
        refiner) and `generate` are one device's seconds per sample; `samples` a step's, `refined`
        those refined; `ranks` each expert's; `workers` the rollout workers."""

    @staticmethod
    @abstractmethod
    def who_rolls_out(*, generator_ranks: int, workers: int) -> str:
        """Who holds a generator under this layout, in words (`jointrl plan`)."""

    def __init__(self, config, runtime: Runtime, faults: FaultCounts, plan):
        """`plan(step)`: the samples of `step` (algorithm/batch.py); `faults`: the counts its
        retries bump."""
        self.config, self.runtime, self.plan = config, runtime, plan
        self.retry = Retry(config.cluster, faults)
        self.refiner_ids = list(config.experts.active_refiners())
        self.reward_pools = spawn_pools(config, runtime)
        self.workers: list = self.spawn_workers()
        # a reward actor that cannot start (its model cannot be loaded) stops the run's start, as a worker does
        get([actor.ready.remote() for actors in self.reward_pools.values() for actor in actors])
        self.in_flight: dict[int, Rollout] = {}

    def spawn_workers(self) -> list:
        """The layout's rollout workers, started while the reward actors start."""
        return []

    @abstractmethod
    def collect(self, step: int, experts) -> Rollout:
        """`step`'s rollout with its metadata, made with the versions `experts` published."""

    @abstractmethod
    def remake(self, step: int, rollout: Rollout, experts) -> Rollout:
        """`rollout` made again with the weights it was made with, after its outputs were lost."""

    @abstractmethod
    def resubmit(self, saved: dict, start_step: int, experts) -> None:
        """A resumed run's rollouts in flight, from a checkpoint's older weights (`older_weights`)."""

    @abstractmethod
    def take_reloaded(self) -> bool:
        """Whether someone was given older weights since the last call (then every expert is
        published again)."""

    @abstractmethod
    def older_weights(self, versions: dict[str, int]) -> dict:
        """{step: {expert: (version, weights)}} older than `versions` that rollouts in flight use."""

    @abstractmethod
    def evaluate(self) -> dict:
        """The task's evaluation report with the weights served now."""

    def actors(self) -> list:
        return [*self.workers, *(a for actors in self.reward_pools.values() for a in actors)]
