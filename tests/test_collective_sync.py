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
    return make_config(f"trainer.steps={STEPS}", "cluster.rollout_workers=2", *extra, preset="shapes-tiny")


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
