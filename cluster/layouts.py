"""The layouts by name (`cluster.layout`): the class that makes a run's rollouts under each."""
from __future__ import annotations

from cluster.colocated import ColocatedRollouts
from cluster.rollout_pool import RolloutPool
from cluster.rollouts import Rollouts

LAYOUTS: dict[str, type[Rollouts]] = {"separate": RolloutPool, "colocated": ColocatedRollouts}
