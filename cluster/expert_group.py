"""`ExpertGroup`: the run's experts as the driver sees them — spawned, their snapshots in the
driver's custody, each update applied exactly once, each new version published to the workers.

After every update the group keeps each expert's snapshot (info, and the weights where rollout
workers are given them; weights and optimizer state after every `cluster.optimizer_snapshot_every`
updates and at checkpoints) as ObjectRefs it owns, on the driver's node, with the inputs of the
updates since its last snapshot with optimizer state. A killed expert is restarted by Ray, restored
from that snapshot, made to apply the kept updates again (the same state, inputs and code compute
the same update) and given the step's update again; an update names the version it starts from,
so a restarted instance refuses instead of silently starting over. An expert of several ranks is
driven as one through its gang (cluster/expert_gang.py): any of its ranks killed, the whole gang is formed
again and restored. A killed weight-sync actor or worker during a publish is survived by delivering
every published version again.
"""
from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import NamedTuple

import ray
from ray.exceptions import ObjectLostError

from algorithm.credit import Advantages
from cluster.expert_actor import ExpertActor
from cluster.expert_gang import ExpertGang
from cluster.recovery import FaultCounts, Retry, RolloutLost, SnapshotLost, keep_here, this_node
from cluster.runtime import Runtime, get
from cluster.weight_sync import SyncResult, WeightSyncActor
from experts.expert import GangBroken, StaleExpert
from experts.kinds import expert_kind
from experts.records import Release, ShardedOptimizer, ShardFiles, Snapshot
from experts.state_file import SHARDS

LOG = logging.getLogger("jointrl.recovery")


class Replay(NamedTuple):
    """An update an expert applied since its last snapshot with optimizer state: made again, in
    order, when the expert is restored."""
    step: int
    version: int
    inputs: tuple


class SubmittedUpdate(NamedTuple):
    """An expert's update and the snapshot after it, submitted: the update's refs, the snapshot (with
    the optimizer state if `base`), the other ranks' snapshot calls, and the update's inputs."""
    updates: list
    snapshot: Snapshot
    others: list
    inputs: tuple
    base: bool


class ExpertGroup:
    def __init__(self, config, runtime: Runtime, faults: FaultCounts, workers: list, *, states: dict | None = None,
                 expert_cls=ExpertActor):
        """`workers`: the rollout workers the experts publish to. `states`: each expert's
        (weights, optimizer, info) from a checkpoint, to start from. `expert_cls`: the experts'
        actor class (bench/perf.py's scaling simulation swaps in one whose update sleeps)."""
        self.config, self.faults, self.retry = config, faults, Retry(config.cluster, faults)
        self.ids = config.experts.ids()
        self.kinds = {e: expert_kind(config, e) for e in self.ids}
        self.gangs = {e: ExpertGang(config, runtime, e, expert_cls) for e in self.ids}
        self.handles = {e: gang.leader for e, gang in self.gangs.items()}
        collective = config.cluster.sync == "collective" and config.cluster.mode == "ray"
        self.sync = runtime.spawn_member(
            WeightSyncActor, runtime.members, [f"rollout/{j}" for j in range(len(workers))],
            list(self.handles) if collective else None,
            {"backend": config.cluster.collective_backend, "timeout_s": config.cluster.collective_timeout_s}
            if collective else None, name="weight_sync")
        self.workers = workers
        self.nodes: dict[str, str | None] = {}
        self.snapshots = {e: self.first_snapshot(e, (states or {}).get(e)) for e in self.ids}
        self.bases = dict(self.snapshots)  # each expert's last snapshot with its optimizer state
        self.replays: dict[str, list[Replay]] = {e: [] for e in self.ids}  # its updates since
        self.versions = {e: info.version for e, info in get({e: s.info for e, s in self.snapshots.items()}).items()}
        self.published: dict[str, Release] = {}  # what every worker holds
        self.publish(self.ids)

    def first_snapshot(self, e: str, state: tuple | None) -> Snapshot:
        """Expert `e`'s starting snapshot, once it holds `state` if given. An expert killed
        meanwhile restarts as its config builds it, and is restored again."""
        return self.retry(partial(self.started, e, state), recover=self.gangs[e].wait_alive,
                          retried=(SnapshotLost, GangBroken), name=f"{e}'s start", counter="expert_restarts")

    def started(self, e: str, state: tuple | None) -> Snapshot:
        """Expert `e`'s snapshot once its gang holds `state` (None: as its config builds it)."""
        if state:
            self.gangs[e].restore(*state)
        else:
            self.gangs[e].start()
        return self.take_snapshot(e)

    def take_snapshot(self, e: str, *, with_optimizer: bool = True) -> Snapshot:
        """Expert `e`'s snapshot now, kept on the driver's node."""
        self.nodes[e] = get(self.handles[e].node.remote())
        made, others = self.gangs[e].snapshot(with_optimizer=with_optimizer)
        get(others)
        snapshot = self.keep(made, e)
        get(snapshot.info)
        return snapshot

    def keep(self, snapshot: Snapshot, e: str) -> Snapshot:
        """Snapshot `snapshot` of expert `e`, its data on the driver's node (keep_here); a sharded
        expert's optimizer shards were made wherever its ranks run."""
        optimizer = snapshot.optimizer
        if isinstance(optimizer, ShardedOptimizer):
            weights, info = keep_here((snapshot.weights, snapshot.info), self.nodes[e])
            return Snapshot(weights, ShardedOptimizer([keep_here((shard,), node)[0] for shard, node
                                                       in zip(optimizer.shards, self.gangs[e].nodes)]), info)
        return Snapshot(*keep_here(snapshot, self.nodes[e]))

    def publish(self, expert_ids: list[str]) -> SyncResult:
        """Deliver the latest versions of `expert_ids` to every rollout worker."""
        infos = get({e: self.snapshots[e].info for e in expert_ids})
        return self.deliver({e: Release(self.versions[e], self.snapshots[e].weights, infos[e].checksum)
                             for e in expert_ids}, current=True)

    def deliver(self, releases: dict[str, Release], current: bool = False) -> SyncResult:
        """Give every worker these releases and wait for their acknowledgements. `current`: the
        experts hold these versions now, so a collective run may broadcast them. If the sync actor
        or a worker died, everything published is delivered again through the object store, which
        rebuilds the restarted sync actor's registry and a restarted worker's weights."""
        if not releases:
            return SyncResult(0.0, None if self.workers else "none", None)
        out = self.retry(partial(self.sync_publish, releases, broadcast=current),
                         again=partial(self.sync_publish, {**self.published, **releases}, broadcast=False),
                         recover=self.sync_alive, name="weight sync", counter="sync_restarts")
        self.faults.sync_fallbacks += out.fallback is not None
        self.published.update(releases)
        return out

    def sync_publish(self, releases: dict[str, Release], *, broadcast: bool) -> SyncResult:
        return get(self.sync.publish.remote(releases, broadcast=broadcast))

    def sync_alive(self) -> None:
        """Returns once the sync actor and every worker answer (Ray has restarted them)."""
        get([self.sync.registrations.remote(), *[w.version_vector.remote() for w in self.workers]])

    def update(self, step: int, due: list[str], advantages: Advantages, rollout, *, remake) -> dict[str, dict]:
        """The due experts' updates on `rollout`, concurrently, then each one's new snapshot; returns
        each expert's stats. If the rollout outputs an update reads were lost with their node,
        `remake()` makes the rollout again (a pure function of step and weights) and the experts
        not yet updated are given that one."""
        stats: dict[str, dict] = {}
        while True:
            try:
                self.apply_updates(step, [e for e in due if e not in stats], advantages, rollout, stats=stats)
                return stats
            except RolloutLost:
                self.faults.rollouts_lost += 1
                rollout = remake()

    def apply_updates(self, step: int, due: list[str], advantages: Advantages, rollout, *, stats: dict) -> None:
        """Each due expert's update, exactly once. An expert that died is restarted by Ray,
        restored from its previous snapshot and given the same update again; its new snapshot must
        show this step's version."""
        self.make_whole(due)
        calls = {e: self.submit_update(e, step, advantages, rollout) for e in due}
        for e in due:
            stats[e], self.snapshots[e] = self.retry(
                partial(self.updated, e, step, calls[e]),
                again=partial(self.update_again, e, step, advantages, rollout),
                recover=partial(self.restore, e), retried=(StaleExpert, SnapshotLost),
                name=f"{e}'s update at step {step}", counter="expert_restarts")
            self.versions[e] = stats[e]["version"]

    def submit_update(self, e: str, step: int, advantages: Advantages, rollout) -> SubmittedUpdate:
        """Expert `e`'s update on `rollout` and the snapshot after it (with the optimizer state when
        due), submitted."""
        inputs = self.kinds[e].update_inputs(advantages, rollout.refined, rollout.outputs_for(e))
        base = self.base_due(e)
        updates = self.gangs[e].update(step, self.versions[e], *inputs)
        snapshot, others = self.gangs[e].snapshot(with_optimizer=base, with_weights=base or bool(self.workers))
        return SubmittedUpdate(updates, snapshot, others, inputs, base)

    def base_due(self, e: str) -> bool:
        """Whether expert `e`'s next snapshot takes its optimizer state (cluster.optimizer_snapshot_every)."""
        return len(self.replays[e]) + 1 >= self.config.cluster.optimizer_snapshot_every

    def updated(self, e: str, step: int, call: SubmittedUpdate) -> tuple[dict, Snapshot]:
        """A submitted update's stats and its new snapshot, kept on the driver's node; the snapshot
        must show this step's version (an expert that restarted between shows an older one). The
        update's inputs are kept until the expert's next snapshot with optimizer state."""
        try:
            result, info = get(call.updates)[0], get(call.snapshot.info)
            get(call.others)
            replay = None if call.base else Replay(step, self.versions[e], self.kept_inputs(call.inputs))
        except ObjectLostError as lost:
            raise RolloutLost(f"step {step}: {e}'s update lost its inputs ({type(lost).__name__})") from lost
        if (info.version, info.last_step) != (self.versions[e] + 1, step):
            raise StaleExpert(f"{e}: its snapshot after step {step} shows {info}")
        kept = self.keep(call.snapshot, e)
        if replay is None:
            self.bases[e], self.replays[e] = kept, []
        else:
            self.replays[e].append(replay)
        return result, kept

    @staticmethod
    def kept_inputs(inputs: tuple) -> tuple:
        """An update's inputs kept for its replay: those in the object store with their data on the
        driver's node (keep_here), as the rollout workers' nodes may be lost before it."""
        at = [i for i, x in enumerate(inputs) if isinstance(x, ray.ObjectRef)]
        if not at:
            return inputs
        kept = dict(zip(at, keep_here(tuple(inputs[i] for i in at), None)))
        return tuple(kept.get(i, x) for i, x in enumerate(inputs))

    def update_again(self, e: str, step: int, advantages: Advantages, rollout) -> tuple[dict, Snapshot]:
        """Expert `e`'s update made again, on its gang restored from its previous snapshot."""
        return self.updated(e, step, self.submit_update(e, step, advantages, rollout))

    def restore(self, e: str) -> None:
        """Expert `e`'s gang back to its latest version: its last snapshot with optimizer state,
        then the updates since made again (raises RayActorError while Ray restarts a rank)."""
        get(self.handles[e].info.remote())
        self.gangs[e].restore(*self.bases[e])
        self.replay(e)
        self.nodes[e] = get(self.handles[e].node.remote())

    def replay(self, e: str) -> None:
        """The updates expert `e` applied since its last snapshot with optimizer state, made again in
        order from their kept inputs, then checked against its latest snapshot's fingerprint (by
        version alone where that snapshot holds no weights). Where they differ (kernels that do not
        repeat bit for bit, as some GPU ones), the latest weights are loaded over them, the replayed
        optimizer moments kept, and a warning says so."""
        if not self.replays[e]:
            return
        self.faults.replayed_updates += len(self.replays[e])
        for update in self.replays[e]:
            get(self.gangs[e].update(update.step, update.version, *update.inputs))
        latest = get(self.snapshots[e].info)
        made, others = self.gangs[e].snapshot(with_optimizer=False, with_weights=latest.checksum is not None)
        get(others)
        replayed = get(made.info)
        if replayed != latest:
            LOG.warning("%s: %d updates made again from its last optimizer snapshot end at %s, not %s (the "
                        "kernels do not repeat exactly): the latest weights are loaded, the optimizer state "
                        "kept as replayed", e, len(self.replays[e]), replayed, latest)
            self.gangs[e].load_weights(self.snapshots[e].weights, self.snapshots[e].info)

    def wait_alive(self, e: str) -> None:
        """Return once every rank of `e` answers (raises RayActorError while Ray restarts one)."""
        self.gangs[e].wait_alive()

    def make_whole(self, expert_ids: list[str]) -> None:
        """Every gang of `expert_ids` with a restarted rank restored before anything is asked of it."""
        for e in expert_ids:
            self.retry(self.gangs[e].check, recover=partial(self.restore, e), retried=(GangBroken,),
                       name=f"{e}'s gang", counter="expert_restarts")

    def saved_snapshots(self, staging: Path) -> dict[str, Snapshot]:
        """Every expert's latest snapshot as ObjectRefs, for a checkpoint's writer (on this node) to
        fetch; a sharded expert's optimizer as its ranks write it (they hold that snapshot's state:
        checkpoints come between steps), a list of each rank's ShardFiles, its files written
        straight into the checkpoint's temporary folder `staging` by the ranks on this node. An
        expert whose latest snapshot lacks its optimizer state (or weights) takes them first."""
        for e in self.ids:
            if self.replays[e] and (not self.gangs[e].sharded or not self.workers):
                self.current_snapshot(e)
        return {e: Snapshot(s.weights, self.optimizer_files(e, staging / f"{e}{SHARDS}")
                            if self.gangs[e].sharded else s.optimizer, s.info)
                for e, s in self.snapshots.items()}

    def current_snapshot(self, e: str) -> Snapshot:
        """Expert `e`'s snapshot of its version now, with its weights and, unless its ranks write
        their optimizer shards themselves (sharded), its optimizer state: the new base of later
        restores."""
        sharded = self.gangs[e].sharded
        self.snapshots[e] = self.retry(partial(self.take_snapshot, e, with_optimizer=not sharded),
                                       recover=partial(self.restore, e), retried=(SnapshotLost, GangBroken),
                                       name=f"{e}'s snapshot", counter="expert_restarts")
        if not sharded:
            self.bases[e], self.replays[e] = self.snapshots[e], []
        return self.snapshots[e]

    def latest_weights(self, e: str):
        """The weights of expert `e`'s version now, as an ObjectRef (taken now where its latest
        snapshot holds none)."""
        held = self.workers or not self.replays[e]  # a snapshot holds weights if it is a base or is published
        return self.snapshots[e].weights if held else self.current_snapshot(e).weights

    def optimizer_files(self, e: str, into: Path) -> list[ShardFiles]:
        """Sharded expert `e`'s optimizer state as its ranks write it (`ExpertGang.optimizer_files`);
        a rank lost meanwhile, the gang is restored from its latest snapshot (the state being saved)
        and writes it again."""
        return self.retry(partial(self.gangs[e].optimizer_files, str(into), this_node()),
                          recover=partial(self.restore, e), retried=(GangBroken,),
                          name=f"{e}'s optimizer files", counter="expert_restarts")

    def inspect(self) -> dict:
        """Where every version stands: the experts, their snapshots and the sync registry."""
        return {"experts": {e: info._asdict() for e, info in get({e: h.info.remote()
                                                                  for e, h in self.handles.items()}).items()},
                "snapshots": {e: {"version": info.version, "last_step": info.last_step}
                              for e, info in get({e: s.info for e, s in self.snapshots.items()}).items()},
                "registry": get(self.sync.registrations.remote())}

    def actors(self) -> list:
        return [*[a for gang in self.gangs.values() for a in gang.actors()], self.sync]
