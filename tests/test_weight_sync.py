"""What a weight transfer guarantees: a fingerprint that any corruption changes, a worker that
refuses weights not matching it, and CPU workers that map the published weights instead of
copying them (`cluster.share_weights`)."""
import numpy as np
import pytest

from cluster.expert_actor import ExpertActor
from cluster.rollout_worker import CorruptWeights, RolloutWorker
from experts.weights import fingerprint
from tests.conftest import make_config


def test_the_fingerprint_changes_with_any_byte_name_or_shape():
    weights = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 3), np.float32)}
    same = {k: v.copy() for k, v in weights.items()}
    assert fingerprint(weights) == fingerprint(same)
    flipped = {**same, "a": same["a"].copy()}
    flipped["a"].view(np.uint8)[5] ^= 1
    assert fingerprint(flipped) != fingerprint(weights)
    assert fingerprint({**weights, "a": weights["a"][:9]}) != fingerprint(weights)          # truncated
    assert fingerprint({"c": weights["a"], "b": weights["b"]}) != fingerprint(weights)        # renamed
    assert fingerprint({**weights, "b": weights["b"].reshape(9)}) != fingerprint(weights)     # reshaped
    assert fingerprint({k: weights[k] for k in ("a",)}) != fingerprint(weights)               # missing


def test_a_worker_refuses_weights_that_do_not_match_their_fingerprint():
    cfg = make_config(preset="shapes-tiny")
    worker = RolloutWorker(cfg, 0)
    weights = ExpertActor(cfg, "generator").weights()
    good = fingerprint(weights)
    bad = {k: v.copy() for k, v in weights.items()}
    next(iter(bad.values())).reshape(-1)[0] += 1.0
    with pytest.raises(CorruptWeights, match="generator v3"):
        worker.load_weights("generator", 3, bad, good)
    assert worker.versions["generator"] is None                                  # nothing was served
    assert worker.load_weights("generator", 3, weights, good) == 3


@pytest.mark.parametrize("share", [True, False])
def test_shared_workers_map_the_weights_and_private_ones_copy_them(share):
    cfg = make_config(f"cluster.share_weights={str(share).lower()}", preset="shapes-tiny")
    worker = RolloutWorker(cfg, 0)
    weights = ExpertActor(cfg, "generator").weights()
    for array in weights.values():
        array.flags.writeable = False  # as Ray hands them out of the object store
    worker.load_weights("generator", 1, weights, fingerprint(weights))
    params = worker.models["generator"].state_dict()
    assert all(np.shares_memory(params[k].numpy(), v) == share for k, v in weights.items())
    assert all(np.array_equal(params[k].numpy(), v) for k, v in weights.items())
