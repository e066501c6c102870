"""What a weight transfer guarantees: a fingerprint that any corruption changes, a worker that
refuses weights not matching it, and CPU workers that map the published weights instead of
copying them (`cluster.share_weights`)."""
import time

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


def tensors_in(tree) -> list:
    """Every torch tensor in a nest of dicts, lists, tuples (records too) and dataclasses."""
    import dataclasses

    import torch
    if isinstance(tree, torch.Tensor):
        return [tree]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = vars(tree)
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_in(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_in(v)]
    return []


def test_what_leaves_an_expert_or_a_worker_holds_no_tensor_and_restores_exactly(tmp_path):
    """Every method an actor answers with hands out numpy arrays (the optimizer's moments too),
    never a tensor: a receiver without the sender's device (a CPU-only head) deserializes no CUDA
    tensor, and the object store hands them out zero-copy. The travelled optimizer state restores a
    new expert, and checkpoints, bit for bit."""
    import torch

    from algorithm.batch import step_samples
    from experts import state_file
    from tasks import build_task
    cfg = make_config("experts.n_refiners=1", preset="shapes-tiny")
    worker = RolloutWorker(cfg, 0)
    expert = ExpertActor(cfg, "generator")
    for e in cfg.experts.ids():
        weights = expert.weights() if e == "generator" else ExpertActor(cfg, e).weights()
        worker.load_weights(e, 0, weights, fingerprint(weights))
    samples = step_samples(build_task(cfg).train_prompts(), step=0, seed=cfg.trainer.seed,
                           prompts_per_step=cfg.trainer.prompts_per_step, group_size=cfg.algorithm.group_size,
                           num_skip_refinement=cfg.algorithm.num_skip_refinement)
    meta, trajectories, *tokens = worker.rollout(0, samples, {e: 0 for e in cfg.experts.ids()})
    stats = expert.update(0, 0, np.linspace(-1, 1, len(samples)), trajectories)
    snapshot = expert.snapshot()
    answers = [meta, trajectories, tokens, stats, snapshot, worker.version_vector(), expert.info()]
    assert not [t.shape for t in tensors_in(answers)]
    moments = [v for entries in snapshot.optimizer["state"].values() for v in entries.values()]
    assert moments and all(isinstance(v, np.ndarray) for v in moments)
    fresh = ExpertActor(cfg, "generator")
    fresh.restore(*snapshot)
    live, restored = expert.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(live[p][k], restored[p][k]) for p in live for k in live[p])
    state_file.write(tmp_path, "generator", snapshot.weights, snapshot.optimizer, info=snapshot.info)
    saved = state_file.read(tmp_path, "generator").optimizer["state"]
    assert all(torch.equal(live[p][k], saved[p][k]) for p in live for k in live[p])


def test_bfloat16_moments_travel_as_their_words_and_come_back_bit_for_bit(tmp_path):
    import torch

    from experts import state_file
    from experts.records import ExpertInfo
    from experts.weights import optimizer_arrays, optimizer_tensors
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[1](model[0](torch.randn(5, 4)).to(torch.bfloat16)).float().sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    travelled = optimizer_arrays(state, private=True)
    assert sorted(travelled["bfloat16"]) == ["2.exp_avg", "2.exp_avg_sq", "3.exp_avg", "3.exp_avg_sq"]
    assert travelled["state"][2]["exp_avg"].dtype == np.int16 and travelled["state"][0]["step"].shape == ()
    state_file.write(tmp_path, "e", {}, travelled, info=ExpertInfo(1, 0))  # a checkpoint holds them as bfloat16
    for back in (optimizer_tensors(travelled), state_file.read(tmp_path, "e").optimizer):
        for p, entries in state["state"].items():
            for k, v in entries.items():
                assert back["state"][p][k].dtype == v.dtype and torch.equal(back["state"][p][k], v), (p, k)
    again = torch.optim.AdamW(model.parameters(), lr=0.1)
    again.load_state_dict(optimizer_tensors(travelled))
    assert torch.equal(again.state_dict()["state"][2]["exp_avg"], state["state"][2]["exp_avg"])


def test_a_snapshot_kept_from_another_node_is_copied_by_a_task_here_or_said_lost(ray_session):
    """The driver keeps its snapshots on its own node: one made elsewhere is copied by a task on the
    driver's node (the driver deserializes none of it); one whose owner died is SnapshotLost."""
    import ray

    from cluster.recovery import SnapshotLost, keep_here

    @ray.remote(num_cpus=0)
    class Maker:
        def make(self):
            return {"w": np.arange(50_000, dtype=np.float32)}, {"version": 3}

        def owned(self):
            return [ray.put(np.ones(10))]
    maker = Maker.remote()
    weights, info = maker.make.options(num_returns=2).remote()
    kept = keep_here((weights, info), "another-node")
    assert [k.hex() for k in kept] != [weights.hex(), info.hex()]
    assert np.array_equal(ray.get(kept[0])["w"], ray.get(weights)["w"]) and ray.get(kept[1]) == {"version": 3}
    assert keep_here((weights, info), ray.get_runtime_context().get_node_id()) == (weights, info)  # made here
    [orphan] = ray.get(maker.owned.remote())
    ray.kill(maker)
    with pytest.raises(SnapshotLost):
        for _ in range(50):  # until Ray has noticed the owner is gone
            keep_here((orphan,), "another-node")
            time.sleep(0.2)
