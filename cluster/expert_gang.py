"""`ExpertGang`: an expert's rank actors, which the expert group drives as one expert.

An expert of `parallel.ranks` = M > 1 is M actors (`expert/<id>` is rank 0, the leader;
`expert/<id>/rank<r>` the others), each in its own placement bundle, forming one torch.distributed
process group (gloo between CPU processes, NCCL between GPUs) whose rendezvous the leader hosts.
Every call that computes goes to every rank; the leader's answer is the expert's (its weights and
snapshots are whole), and the others' answers are awaited for their errors. A gang is formed again
(a new generation of its process group) whenever it is restored: at start, on resume, and after
any rank died or lost a peer mid-call, so a restored gang is always whole. In inline mode, or with
M = 1, the gang is one actor and no process group is formed.
"""
from __future__ import annotations

from cluster.runtime import Runtime, get
from experts.expert import GangBroken
from experts.parallel import GangSpec
from experts.records import Snapshot


def rank_name(expert_id: str, rank: int) -> str:
    """The actor name of rank `rank` of expert `expert_id` (rank 0 keeps the expert's own name)."""
    return f"expert/{expert_id}" if rank == 0 else f"expert/{expert_id}/rank{rank}"


class ExpertGang:
    def __init__(self, config, runtime: Runtime, expert_id: str, cls):
        spec = config.expert(expert_id)
        ranks = spec.parallel.ranks if config.cluster.mode == "ray" else 1
        self.expert_id, self.config = expert_id, config
        self.ranks = [runtime.spawn_member(cls, config, expert_id, name=rank_name(expert_id, r),
                                           resources=spec.resources) for r in range(ranks)]
        self.leader = self.ranks[0]
        self.generation = 0

    @property
    def several(self) -> bool:
        return len(self.ranks) > 1

    def form(self) -> None:
        """A new generation of the ranks' process group (every rank alive: Ray has restarted any
        that died; a restore follows, since a rank rebuilt for the new group starts over)."""
        self.generation += 1
        host, port = get(self.leader.open_gang.remote())
        backend = "nccl" if self.config.expert(self.expert_id).resources.num_gpus > 0 else "gloo"
        spec = GangSpec(host, port, self.generation, len(self.ranks), backend, self.config.cluster.collective_timeout_s)
        get([r.join_gang.remote(spec, i) for i, r in enumerate(self.ranks)])

    def check(self) -> None:
        """Raise GangBroken unless every rank is in the current generation (none restarted since)."""
        if self.several and get([r.gang_generation.remote() for r in self.ranks]) != [self.generation] * len(self.ranks):
            raise GangBroken(f"{self.expert_id}: a rank restarted since its gang was formed")

    def wait_alive(self) -> None:
        """Return once every rank answers (raises RayActorError while Ray restarts one)."""
        get([r.info.remote() for r in self.ranks])

    def start(self) -> None:
        """A gang as its config builds it, formed if it has several ranks."""
        if self.several:
            self.wait_alive()
            self.form()

    def restore(self, *state) -> None:
        """Every rank back to `state` (a snapshot or checkpoint), in a newly formed gang."""
        self.start()
        get([r.restore.remote(*state) for r in self.ranks])

    def update(self, step: int, version: int, *inputs) -> list:
        """Every rank's update call (the leader's first: the expert's stats)."""
        self.check()
        return [r.update.remote(step, version, *inputs) for r in self.ranks]

    def snapshot(self) -> tuple[Snapshot, list]:
        """(the leader's snapshot as ObjectRefs, the other ranks' calls to await)."""
        calls = [r.snapshot.options(num_returns=3).remote() for r in self.ranks]
        return Snapshot(*calls[0]), [ref for call in calls[1:] for ref in call]

    def actors(self) -> list:
        return list(self.ranks)
