"""Placement: every actor's resources reserved up front as placement groups.

Reserving the whole demand at once lets an autoscaler see it and add nodes, and lets a run that
cannot fit say which bundles are missing after `cluster.placement_timeout_s` instead of hanging.
An actor that asks for nothing (the default: `num_cpus=0`) gets no bundle and is scheduled freely.
`cluster.colocate=true` puts experts and rollout workers in one group (`cluster.placement` packs or
spreads them together); false reserves two groups, the trainers' and the rollout workers', each
placed on its own terms (disaggregated, as when training and generation want different nodes).

On a cluster with GPUs the placement follows the memory plan (driver/plan.py, given here as its
GPU groups): one bundle per planned GPU, {"GPU": 1} plus its actors' CPUs, each actor scheduled
into its GPU's bundle with its share of it (1, or 1/k for k actors the plan lets share a GPU), so
the GPU Ray gives each actor is the plan's and no two actors share a device the plan kept apart
(a fraction limits no memory). The actors without a GPU keep their bundles as above.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.expert_gang import rank_name


class PlacementError(RuntimeError):
    """The cluster could not hold the run's actors in time; names what is missing."""


def bundle(resources) -> dict[str, float]:
    """A config `Resources` as a placement bundle (only the non-zero amounts)."""
    amounts = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.custom}
    return {k: float(v) for k, v in amounts.items() if v > 0}


def demand(config) -> dict[str, dict[str, dict[str, float]]]:
    """Group name -> actor name -> its bundle, for the actors that reserve anything."""
    experts = {rank_name(e, r): bundle(config.expert(e).resources)
               for e in config.experts.ids() for r in range(config.expert(e).parallel.ranks)}
    workers = {f"rollout/{j}": bundle(config.cluster.rollout_resources)
               for j in range(config.cluster.workers)}
    rewards = {f"reward/{term}/{k}": bundle(resources)
               for term, (n, resources) in config.reward.pools().items() for k in range(n)}
    groups = {"actors": {**experts, **workers, **rewards}} if config.cluster.colocate else {
        "experts": experts, "rollout": {**workers, **rewards}}
    return {g: {name: b for name, b in actors.items() if b} for g, actors in groups.items()}


def shortfall(bundles: list[dict[str, float]], total: dict[str, float]) -> dict[str, float]:
    """Per resource, how much more the bundles ask for than the cluster has in all."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    return {k: round(v - total.get(k, 0.0), 4) for k, v in sorted(need.items()) if v > total.get(k, 0.0)}


class Placement:
    """The run's placement groups and, per actor, the options that schedule it into its bundle."""

    def __init__(self, config, run_name: str, gpu_groups: list[list[tuple[str, float]]] | None = None):
        """`gpu_groups`: the plan's GPUs that hold actors, each [(actor name, its share)]."""
        self.options: dict[str, dict] = {}
        self.groups = []
        strategy = config.cluster.placement.upper()
        groups = demand(config)
        if gpu_groups:
            planned = {name for gpu in gpu_groups for name, _ in gpu}
            asked = {name: b for actors in groups.values() for name, b in actors.items()}
            groups = {g: {n: b for n, b in actors.items() if n not in planned} for g, actors in groups.items()}
            self.reserve_gpus(config, run_name, gpu_groups, asked, strategy=strategy)
        for group, actors in groups.items():
            if not actors:
                continue
            pg = placement_group(list(actors.values()), strategy=strategy, name=f"{run_name}/{group}")
            self.groups.append(pg)
            ready, _ = ray.wait([pg.ready()], timeout=config.cluster.placement_timeout_s)
            if not ready:
                self.release()
                raise PlacementError(self.describe(group, actors, strategy, config.cluster.placement_timeout_s))
            for index, name in enumerate(actors):
                self.options[name] = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}

    def reserve_gpus(self, config, run_name: str, gpu_groups: list, asked: dict, *, strategy: str) -> None:
        """One bundle per planned GPU ({"GPU": 1} and its actors' other resources), each actor in its own."""
        bundles = []
        for gpu in gpu_groups:
            b = {"GPU": 1.0}
            for name, _ in gpu:
                for k, v in asked.get(name, {}).items():
                    if k != "GPU":
                        b[k] = b.get(k, 0.0) + v
            bundles.append(b)
        pg = placement_group(bundles, strategy=strategy, name=f"{run_name}/gpus")
        self.groups.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=config.cluster.placement_timeout_s)
        if not ready:
            self.release()
            actors = {"+".join(n for n, _ in gpu): b for gpu, b in zip(gpu_groups, bundles)}
            raise PlacementError(self.describe("gpus", actors, strategy, config.cluster.placement_timeout_s))
        for index, gpu in enumerate(gpu_groups):
            for name, share in gpu:
                self.options[name] = {"num_gpus": share, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}

    @staticmethod
    def describe(group: str, actors: dict, strategy: str, timeout_s: float) -> str:
        total = ray.cluster_resources()
        wanted = ", ".join(f"{name} {b}" for name, b in actors.items())
        short = shortfall(list(actors.values()), total)
        have = {k: v for k, v in total.items() if not k.startswith(("node:", "memory", "object_store"))}
        return (f"cluster.placement: the '{group}' placement group ({strategy}) was not reserved within "
                f"cluster.placement_timeout_s={timeout_s:g} s. Bundles asked for: {wanted}. The cluster has "
                f"{have} in all" + (f", short of {short}" if short else
                                     " (enough in all, but not on the nodes as the strategy needs them)")
                + ". Add nodes (an autoscaler adds them if it can) or lower experts.<id>.resources / "
                  "cluster.rollout_resources. Nothing was trained.")

    def release(self) -> None:
        for pg in self.groups:
            remove_placement_group(pg)
        self.groups = []
