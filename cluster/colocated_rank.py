"""`ColocatedRank`: what an expert's rank does besides training under `cluster.layout=colocated`.

There are no rollout workers: a refiner's ranks refine their share of a step's samples, and the
generator's ranks roll out theirs, with the weights they train (cluster/colocated.py asks them).
While a rank rolls out, its model computes as a rollout worker's copy would, and the parts
`cluster.offload` names wait in host memory (cluster/offload.py).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from cluster.offload import on_host
from cluster.reward_pool import pooled_scorers
from cluster.runtime import Members
from experts import parallel, precision
from experts.expert import StaleExpert
from experts.pipeline import RolloutOutputs, RolloutPipeline, refine_samples


class ColocatedRank:
    """Mixed into the expert's actor (cluster/expert_actor.py), over `experts.expert.Expert`."""
    pipeline: RolloutPipeline | None = None  # the generator's rollouts, built at the first

    def refine(self, step: int, version: int, samples: list) -> tuple[list, dict]:
        """A refiner's refinement of its share of a step's refined samples, with the weights it
        trains: (per sample its Refinement, its token batch, which its update reads). From
        `version` only, as `update`."""
        self.holds(version)
        with self.rolling_out():
            return refine_samples(self.model, self.expert_id, self.config.trainer.seed, step, samples=samples,
                                  device=self.device)

    def roll_out(self, step: int, version: int, samples: list, refinements: list[dict], *, versions: dict[str, int],
                 members: Members | None = None) -> RolloutOutputs:
        """The generator's share of a step's rollout with the weights it trains: the rollout
        pipeline (experts/pipeline.py) around this expert's own model, the samples' `refinements`
        made by the refiners' ranks, each sample marked with `versions`. Its terms that reward
        actors score are asked of them (found among the run's `members`), each rank starting at
        its own actor of a pool. From `version` only."""
        self.holds(version)
        if self.pipeline is None:
            scorers = pooled_scorers(self.config, members, self.gang.rank if self.gang else 0, f"expert/{self.expert_id}")
            self.pipeline = RolloutPipeline(self.config, scorers, self.device, served={})
        self.pipeline.models[self.expert_id] = self.model  # lent for this rollout (fsdp builds it anew per gang)
        self.pipeline.versions.update(versions)
        try:
            with self.rolling_out():
                return self.pipeline.run(step, samples, refinements)
        finally:
            del self.pipeline.models[self.expert_id]

    def holds(self, version: int) -> None:
        if version != self.version:
            raise StaleExpert(f"{self.expert_id} is at version {self.version}, asked to roll out with {version}")

    @contextmanager
    def rolling_out(self):
        """The model as a rollout worker's inference copy computes: in eval mode, without a graph,
        in its compute dtype, whole under fsdp (`parallel.gathered_for_rollout`: its ranks enter
        together); the parts `cluster.offload` names in host memory meanwhile."""
        whole = parallel.gathered_for_rollout(self.model, self.spec.parallel.reshard_after_forward) \
            if self.sharded else nullcontext()
        with torch.no_grad(), on_host(self.optimizer, self.reference, self.config.cluster.offload), \
                self.among_peers("a rollout"), whole, \
                precision.computed_in(self.model, {} if self.sharded else self.computed):
            self.model.eval()
            yield
