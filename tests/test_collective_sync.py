"""Weight sync by collective broadcast (`cluster.sync=collective`, gloo here, NCCL on GPUs): the
same versions, fingerprints and acknowledgements as the object-store path, the same training
numbers, and a group that re-forms itself after a member is killed."""
import numpy as np
import pytest
import torch

from cluster.collective import flatten, layout, unflatten
from experts.weights import fingerprint
from tests.conftest import assert_same_training, make_config, run_killing, run_training

STEPS = 5


def config(*extra):
    """Two workers and two experts (one refiner: a further one is one more process, and one more
    version in the same broadcast)."""
    return make_config(f"trainer.steps={STEPS}", "cluster.rollout_workers=2", "experts.n_refiners=1", *extra,
                       preset="shapes-tiny")


def test_one_byte_buffer_round_trips_every_dtype_as_aligned_views():
    """A version travels as one uint8 buffer (NCCL has no int16, the words bfloat16 travels as)."""
    tensors = {"w": torch.randn(3, 4), "steps": torch.arange(5), "b": torch.randn(2), "flag": torch.tensor(True),
               "words": torch.randn(7).to(torch.bfloat16).view(torch.int16), "one": torch.tensor(2.5, dtype=torch.float64)}
    plan = layout(tensors)
    assert all(offset % 16 == 0 for *_, offset in plan)
    buffer = flatten(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    out = unflatten(buffer, plan)
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k
        assert out[k].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views, no copies


def test_the_fingerprint_of_tensors_is_that_of_their_arrays():
    arrays = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 3), np.float32), "c": np.arange(7, dtype=np.uint8)}
    assert fingerprint({k: torch.from_numpy(v) for k, v in arrays.items()}) == fingerprint(arrays)
    assert fingerprint({"h": torch.ones(5, dtype=torch.bfloat16)}) != fingerprint({"h": torch.ones(5, dtype=torch.float16)})


@pytest.fixture(scope="module")
def object_store_rows(tmp_path_factory):
    """The same config synced in-process: what a collective run must reproduce."""
    rows, _, _ = run_training(config("cluster.mode=inline", "cluster.rollout_workers=1"),
                              tmp_path_factory.mktemp("object_store"))
    return rows


def test_a_collective_run_broadcasts_every_version_and_trains_the_same(ray_session, object_store_rows, tmp_path):
    rows, info, _ = run_training(config("cluster.sync=collective"), tmp_path)
    assert_same_training(rows, object_store_rows)
    assert [r["sync/via"] for r in rows] == ["collective"] * STEPS
    assert rows[-1]["faults/sync_fallbacks"] == 0
    assert all(w == {**info["registry"], "text_encoder": 0} for w in info["workers"])


def test_a_killed_worker_is_synced_through_the_object_store_and_the_group_reformed(ray_session, object_store_rows,
                                                                                  tmp_path):
    rows, _ = run_killing(config("cluster.sync=collective", "cluster.collective_timeout_s=20"), tmp_path,
                          [(2, "rollout/1")])
    assert_same_training(rows, object_store_rows)
    # the kill is noticed exactly once, where it lands: in a rollout (worker restart), in the
    # object-store delivery (sync restart), or in the broadcast, which falls back to the object store
    last = rows[-1]
    assert last["faults/worker_restarts"] + last["faults/sync_restarts"] + last["faults/sync_fallbacks"] == 1
    assert rows[-1]["sync/via"] == "collective"  # the group was formed again with the new worker


class FakeMember:
    """An expert or rollout worker as the weight-sync actor sees it, in-process: its GPU (node, Ray's
    ids), a group it fails to join if `joins` is False, and what it is delivered."""

    def __init__(self, device=None, joins=True):
        self.device, self.joins, self.delivered = device, joins, []

    def broadcast_generation(self):
        return None

    def broadcast_device(self):
        return self.device

    def join_broadcast(self, spec, rank):
        if not self.joins:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        return spec.generation

    def load_weights(self, expert_id, version, weights, checksum=None):
        self.delivered.append((expert_id, version))
        return version


def sync_actor(backend, expert, worker):
    from cluster.runtime import InlineHandle, Members
    from cluster.weight_sync import WeightSyncActor
    members = Members("fake", {"expert/generator": InlineHandle(expert), "rollout/0": InlineHandle(worker)})
    return WeightSyncActor(members, ["rollout/0"], ["generator"], {"backend": backend, "timeout_s": 5.0})


def test_an_nccl_group_on_one_gpu_is_refused_once_naming_the_key_not_fallen_back_from():
    """NCCL refuses two members on one GPU: the group is refused before it is formed (or when NCCL
    says invalid usage), with one error naming cluster.sync, instead of a fallback every step."""
    from cluster.collective import CollectiveRefused, refuse_shared_gpus
    from experts.records import Release
    shared = {"expert/generator": ("node-a", ("0",)), "rollout/0": ("node-a", ("0",)), "rollout/1": ("node-a", ("1",))}
    with pytest.raises(CollectiveRefused, match=r"cluster.sync=collective.*expert/generator and rollout/0 share GPU 0"):
        refuse_shared_gpus("nccl", shared)
    refuse_shared_gpus("gloo", shared)                                              # host buffers: no GPU is shared
    refuse_shared_gpus("nccl", {**shared, "rollout/0": ("node-b", ("0",))})         # GPU 0 of another node
    refuse_shared_gpus("nccl", {"expert/generator": None, "rollout/0": None})       # no GPUs at all
    worker = FakeMember(("node-a", ("0",)))
    sync = sync_actor("nccl", FakeMember(("node-a", ("0",))), worker)
    with pytest.raises(CollectiveRefused, match="cluster.sync=object_store"):
        sync.publish({"generator": Release(1, {}, 0)}, broadcast=True)
    assert worker.delivered == [] and sync.fallbacks == 0


def test_a_broadcast_that_nccl_calls_invalid_usage_is_refused_too(monkeypatch):
    import torch.distributed as dist
    from cluster.collective import CollectiveRefused
    from cluster.weight_sync import WeightSyncActor
    from experts.records import Release
    sync = sync_actor("nccl", FakeMember(), FakeMember())
    misuse = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage (run with NCCL_DEBUG=WARN "
                                   "for details), NCCL version 2.26.2\nncclInvalidUsage: This usually reflects invalid "
                                   "usage of NCCL library.")

    def broadcast(self, releases):  # the first broadcast of a group on shared GPUs
        raise misuse
    monkeypatch.setattr(WeightSyncActor, "broadcast", broadcast)
    with pytest.raises(CollectiveRefused, match=r"ncclInvalidUsage.*cluster.sync=object_store"):
        sync.publish({"generator": Release(1, {}, 0)}, broadcast=True)


def test_a_fallback_is_said_once_in_the_log_and_counted_each_time(caplog):
    import logging
    from experts.records import Release
    worker = FakeMember(joins=False)
    sync = sync_actor("gloo", FakeMember(), worker)
    with caplog.at_level(logging.WARNING, logger="jointrl.sync"):
        for version in (1, 2, 3):
            result = sync.publish({"generator": Release(version, {}, 0)}, broadcast=True)
            assert result.via == "object_store" and "Connection closed by peer" in result.fallback
    assert worker.delivered == [("generator", 1), ("generator", 2), ("generator", 3)]
    said = [r for r in caplog.records if r.name == "jointrl.sync"]
    assert len(said) == 1 and "Connection closed by peer" in said[0].getMessage() and sync.fallbacks == 3
