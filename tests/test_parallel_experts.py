"""An expert across several processes (`experts.<id>.parallel`): two ranks give the one-rank run's
metrics step for step, by data parallelism (ddp) and by FSDP2 sharding (fsdp, with ranks killed),
for a refiner and for the generator at once, on gloo between two CPU processes."""
import json
import shutil

import numpy as np
import pytest

from driver import cli
from experts import state_file

from tests.conftest import assert_same_training, make_config, run_killing, run_training

GANG = ("experts.refiner_0.parallel.ranks=2", "experts.generator.parallel.ranks=2")


def gang_config(strategy: str | None, *extra: str):
    """Under fsdp the generator holds its gradient reduction to the last of its update's backward passes
    (`defer_gradient_sync`), and the refiner (one backward pass) reduces as FSDP does by default. One
    refiner: a further one, on one rank, is one more process to start and tests nothing here."""
    parallel = [*GANG, f"experts.refiner_0.parallel.strategy={strategy}",
                f"experts.generator.parallel.strategy={strategy}",
                *(["experts.generator.parallel.defer_gradient_sync=true"] if strategy == "fsdp" else [])] if strategy else []
    return make_config("experts.generator.kl_beta=0.05", "experts.n_refiners=1", *parallel, *extra,
                       preset="shapes-tiny")


TRAINED = ("refiner_0", "generator")


KILLS = [(1, "expert/generator/rank1"), (2, "expert/refiner_0")]  # a follower, then a leader


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """strategy (None: one rank, inline) -> its 3-step run, checkpointed every step, made once per module:
    (metric rows, the driver's inspect(), the final checkpoint's weights, run directory). The fsdp
    run has a rank of each gang killed mid-run (KILLS) and keeps its experts' optimizer shards every
    second update only (cluster.optimizer_snapshot_every=2), so the generator's gang is restored
    from a snapshot one update old and replays that update."""
    made = {}

    def run(strategy: str | None):
        if strategy not in made:
            run_dir = tmp_path_factory.mktemp(strategy or "one-rank")
            cfg = gang_config(strategy, "trainer.checkpoint_every=1", *([] if strategy else ["cluster.mode=inline"]),
                              *(["cluster.optimizer_snapshot_every=2"] if strategy == "fsdp" else []))
            rows, info = run_killing(cfg, run_dir, KILLS) if strategy == "fsdp" else run_training(cfg, run_dir)[:2]
            last = run_dir / "checkpoints" / "step_000003"
            weights = {e: {k: v.numpy() for k, v in state_file.read_weights(last / f"{e}.safetensors").items()}
                       for e in TRAINED}
            made[strategy] = rows, info, weights, run_dir
        return made[strategy]
    return run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_give_the_one_rank_metrics_and_weights(strategy, runs):
    (rows, info, weights, _), (one_rows, _, one_weights, _) = runs(strategy), runs(None)
    assert_same_training(rows, one_rows, tol=1e-5)
    for e in TRAINED:
        assert weights[e].keys() == one_weights[e].keys()
        # Adam divides each gradient by its own scale, so rounding in gradients near zero moves
        # single weights by up to a few percent of one step (lr 3e-3): 2e-4 is a fifteenth of one
        worst = max(float(np.abs(weights[e][k] - one_weights[e][k]).max()) for k in weights[e])
        assert worst < 2e-4, (e, worst)
    assert rows[-1]["version/refiner_0"] == rows[-1]["version/generator"] == 3
    assert info["snapshots"]["generator"]["version"] == 3


def test_three_fsdp_ranks_over_eight_samples_with_dropped_ones_make_the_one_rank_run(ray_session, tmp_path):
    """8 samples a step on 3 fsdp generator ranks, 2 transitions a pass: shares of 3, 3 and 2 samples,
    so 12, 12 and 8 passes unpadded, whose collectives would not line up (the run hung until the
    collective timeout); padded, every rank makes 12 and the run is the one-rank run. The reward
    fails on each group's unrefined sample: a dropped sample stays in its rank's share (at advantage
    0), so the shares are the same whatever fails."""
    sets = ["reward.terms.image.fn=tests.faulty_rewards:nan_unrefined", "experts.generator.micro_batch=2",
            "trainer.steps=2", "cluster.collective_timeout_s=20", "experts.n_refiners=1"]
    gang = ["experts.generator.parallel.ranks=3", "experts.generator.parallel.strategy=fsdp"]
    rows, _, _ = run_training(make_config(*sets, *gang, preset="shapes-tiny"), tmp_path / "three")
    one, _, _ = run_training(make_config(*sets, "cluster.mode=inline", preset="shapes-tiny"), tmp_path / "one")
    assert_same_training(rows, one, tol=1e-5)
    assert [r["version/generator"] for r in rows] == [1, 2]
    assert [r["faults/dropped_samples"] for r in rows] == [2, 2]  # 2 prompts a step, one unrefined sample each


def test_a_rank_killed_mid_run_costs_time_not_correctness(runs):
    """In the fsdp run a rank of each gang was killed (a follower, then a leader): each gang was
    formed again and restored, every update applied once, versions rising; the metrics and weights
    are the one-rank run's (test above)."""
    rows, info, _, _ = runs("fsdp")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["faults/expert_restarts"] == len(KILLS)
    assert rows[-1]["faults/replayed_updates"] > 0
    for e in TRAINED:
        assert [r[f"version/{e}"] for r in rows] == [1, 2, 3], e
        assert info["snapshots"][e] == {"version": 3, "last_step": 2}


def test_more_ranks_than_samples_or_a_collective_sync_is_refused_naming_the_key():
    from common.config import SettingError
    from driver.config import resolve_config
    with pytest.raises(SettingError, match=r"experts.refiner_0.parallel.ranks=7 is more than the 6 samples"):
        resolve_config("shapes-tiny", ["experts.refiner_0.parallel.ranks=7"])  # 2 prompts x (4 - 1)
    resolve_config("shapes-tiny", ["experts.generator.parallel.ranks=8"])      # 2 prompts x 4
    with pytest.raises(SettingError, match="cluster.sync=object_store"):
        resolve_config("shapes-tiny", ["experts.generator.parallel.ranks=2", "cluster.sync=collective"])
    with pytest.raises(SettingError, match="generator.parallel.defer_gradient_sync=true is an fsdp setting"):
        resolve_config("shapes-tiny", ["experts.generator.parallel.ranks=2", "experts.generator.parallel.defer_gradient_sync=true"])


def test_a_sharded_checkpoint_resumes_on_one_rank_and_on_two_to_the_same_metrics(runs, tmp_path):
    """Under fsdp every rank writes its optimizer shard into the checkpoint (torch.distributed.checkpoint,
    safetensors), hashed in the manifest; the run resumed from step 2 on one rank (inline) and on two
    ranks again ends with the uninterrupted run's metrics (from step 1: step 2's metrics show the
    update made with the restored optimizer state)."""
    rows, _, _, run_dir = runs("fsdp")
    step_1 = run_dir / "checkpoints" / "step_000001"
    shards = sorted(p.name for p in (step_1 / "generator.optimizer").iterdir())
    assert len(shards) == 2 and all(n.endswith(".safetensors") for n in shards)
    assert {f"generator.optimizer/{n}" for n in shards} <= set(json.loads((step_1 / "manifest.json").read_text())["files"])
    for resume in (["--set", "cluster.mode=inline", *[f"--set={k.replace('=2', '=1')}" for k in GANG]], []):
        stopped = tmp_path / f"stopped-{len(resume)}"
        shutil.copytree(run_dir, stopped)
        for later in ("step_000002", "step_000003"):
            shutil.rmtree(stopped / "checkpoints" / later)
        assert cli.main(["train", "--resume", str(stopped), *resume]) == 0
        resumed = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
        assert_same_training(resumed, rows, tol=1e-5)


def test_a_gang_reserves_a_bundle_per_rank_and_one_it_cannot_place_is_named(ray_session, tmp_path):
    from cluster.placement import PlacementError, demand
    from driver.launch import start_driver
    cfg = make_config("experts.generator.parallel.ranks=2", "experts.generator.resources.num_gpus=1",
                      "cluster.placement_timeout_s=1", "trainer.run_name=unplaceable-gang", preset="shapes-tiny")
    assert demand(cfg)["actors"] == {"expert/generator": {"GPU": 1.0}, "expert/generator/rank1": {"GPU": 1.0}}
    with pytest.raises(PlacementError, match=r"expert/generator/rank1 \{'GPU': 1.0\}.*short of \{'GPU': 2.0\}"):
        start_driver(cfg, tmp_path)


def refiner_batch(model, n: int = 6):
    """A refiner's own samples of `n` prompts, as an update reads them, with advantages."""
    import torch
    from tasks.shapes import prompt_set
    prompts = [list(p.ids) for p in prompt_set(n, seed=2)]
    tokens, logps, mask = model.sample(prompts, torch.rand(n, model.max_new_tokens, generator=torch.Generator().manual_seed(0)))
    return {"prompts": prompts, "tokens": tokens, "logps": logps, "mask": mask}, torch.linspace(-1, 1, n)


def gradient(expert) -> "torch.Tensor":
    import torch
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in expert.trainable])


def test_the_ranks_shares_of_loss_and_gradient_add_up_to_the_whole_batchs():
    """The convention every rank computes by: its samples' part, divided by the whole batch's count."""
    import torch
    from experts.expert import Expert
    from experts.parallel import Gang
    cfg = make_config("experts.refiner_0.kl_beta=0.05", preset="shapes-tiny")
    expert = Expert(cfg, "refiner_0")
    batch, adv = refiner_batch(expert.model)
    whole_loss, whole_stats = expert.kind.backward(expert.model, expert.reference, batch, adv)
    whole = gradient(expert)
    parts, part_loss, part_kl = [], 0.0, 0.0
    for rank in range(3):
        expert.optimizer.zero_grad(set_to_none=True)
        loss, stats = expert.kind.backward(expert.model, expert.reference, batch, adv, rows=Gang(rank, 3, "ddp",
                                                                                                 1).rows(6))
        parts.append(gradient(expert))
        part_loss, part_kl = part_loss + loss, part_kl + stats["kl"]
    assert abs(part_loss - whole_loss) < 1e-6 and abs(part_kl - whole_stats["kl"]) < 1e-7
    assert torch.allclose(sum(parts), whole, atol=1e-6)


def test_a_smaller_share_makes_as_many_passes_as_the_largest_and_they_add_nothing():
    """Under fsdp every backward pass is a collective, so each rank makes the largest share's number
    of passes: 6 samples on 4 ranks (shares 2, 2, 1, 1) one at a time is 2 passes on every rank, the
    small shares' second with zero weight: their loss, stats and gradient are the unpadded ones."""
    import torch
    from experts.expert import Expert
    from experts.parallel import Gang
    expert = Expert(make_config("experts.refiner_0.kl_beta=0.05", "experts.refiner_0.micro_batch=1",
                                preset="shapes-tiny"), "refiner_0")
    batch, adv = refiner_batch(expert.model)
    passes = []
    hook = expert.model.head.register_forward_hook(lambda *_: passes.append(1))  # the policy's, once a pass
    for rank in range(4):
        gang = Gang(rank, 4, "fsdp", 1)
        rows, pad_to = gang.rows(6), gang.largest_share(6)
        assert (len(rows), pad_to) == ((2, 2) if rank < 2 else (1, 2))
        runs = []
        for padding in (None, pad_to):
            expert.optimizer.zero_grad(set_to_none=True)
            passes.clear()
            loss, stats = expert.kind.backward(expert.model, expert.reference, batch, adv, rows=rows, pad_to=padding)
            runs.append((loss, stats, gradient(expert), len(passes)))
        (loss, stats, grad, n), (padded_loss, padded_stats, padded_grad, padded_n) = runs
        assert padded_n == 2 and n == len(rows)
        assert padded_loss == loss and padded_stats == stats and torch.equal(padded_grad, grad)
    hook.remove()


def test_activation_checkpointing_gives_the_same_gradient():
    import torch
    from experts.expert import Expert
    grads = []
    for checkpointing in (False, True):
        expert = Expert(make_config(f"experts.refiner_0.parallel.activation_checkpointing={checkpointing}",
                                    preset="shapes-tiny"), "refiner_0")
        wrapped = [m for m in expert.model.modules() if type(m).__name__ == "CheckpointWrapper"]
        assert len(wrapped) == (len(expert.model.blocks) if checkpointing else 0)
        batch, adv = refiner_batch(expert.model)
        expert.kind.backward(expert.model, expert.reference, batch, adv)
        grads.append(gradient(expert))
    assert torch.allclose(grads[0], grads[1], atol=1e-6), float((grads[0] - grads[1]).abs().max())


def test_the_backend_follows_the_device_and_the_stats_are_reduced_on_it(monkeypatch):
    """NCCL takes device tensors only: between GPUs the gang's group is `cpu:gloo,cuda:nccl` and the
    stats are all-reduced on the model's device, in float64 where its collectives carry it."""
    import torch
    import torch.distributed as dist
    from cluster.collective import GroupSpec
    from experts import parallel
    assert parallel.backend_for(torch.device("cuda")) == "cpu:gloo,cuda:nccl"
    assert parallel.backend_for(torch.device("cpu")) == "gloo"
    assert GroupSpec("h", 1, 1, 2, {}, "nccl", 1.0).device.type == "cuda"
    assert GroupSpec("h", 1, 1, 2, {}, "gloo", 1.0).device.type == "cpu"
    reduced = []

    def all_reduce(values):  # two ranks with the same share
        reduced.append((values.device.type, values.dtype))
        if values.device.type != "meta":
            values.mul_(2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    loss, stats = parallel.sum_stats(0.25, {"kl": 0.5, "ratio_mean": 1.0}, torch.device("cpu"))
    assert (loss, stats) == (0.5, {"kl": 1.0, "ratio_mean": 2.0}) and reduced[-1] == ("cpu", torch.float64)
    with pytest.raises(RuntimeError, match="meta"):  # a meta tensor has no value to read: where it went counts
        parallel.sum_stats(0.25, {"kl": 0.5}, torch.device("meta"))
    assert reduced[-1] == ("meta", torch.float32)
    assert parallel.stats_dtype(torch.device("cuda")) == torch.float64   # ProcessGroupNCCL maps kDouble to ncclDouble
    assert parallel.stats_dtype(torch.device("mps")) == torch.float32    # MPS has no float64


# Representative errors, as torch raises them: gloo's two as seen here (a peer killed mid all_reduce,
# a peer that never answers); NCCL's as pytorch writes them (torch/csrc/distributed/c10d/NCCLUtils.hpp
# C10D_NCCL_CHECK: "NCCL error in: <file>:<line>, <ncclGetErrorString>, NCCL version <v>\n" +
# NCCLUtils.cpp getNcclErrorDetailStr; NCCLComm::getNcclComm's abort; ProcessGroupNCCL.cpp's watchdog).
LOST = [
    RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                 "[127.0.0.1]:6281. This is typically caused by a remote worker crashing."),
    RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                 "waiting 5000ms for recv operation to complete"),
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, remote process exited or there was a "
    "network error, NCCL version 2.26.2\nncclRemoteError: A call failed possibly due to a network error or a remote "
    "process exiting prematurely.",
    "NCCL communicator was aborted on rank 1.  Original reason for failure was: [PG ID 0 PG GUID 0(default_pg) Rank 1] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, "
    "Timeout(ms)=60000) ran for 60012 milliseconds before timing out.",
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.26.2\nncclSystemError: System call (e.g. socket, malloc) or external "
    "library call failed or device error. ",
]
MISUSED = [
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, invalid usage (run with "
    "NCCL_DEBUG=WARN for details), NCCL version 2.26.2\nncclInvalidUsage: This usually reflects invalid usage of NCCL "
    "library.",
]
WRONG = [RuntimeError("No backend type associated with device type cpu"),
         TypeError("Input tensor data type is not supported for NCCL process group: Short")]


def test_a_lost_peer_is_told_from_a_wrong_call_on_gloo_and_nccl():
    """A lost peer re-forms the gang (GangBroken); an invalid call (NCCL's invalid usage, a tensor
    NCCL does not take) is raised as it is, not retried as if a peer had gone."""
    import torch.distributed as dist
    from experts.expert import Expert, GangBroken
    from experts.parallel import Gang, nccl_misused, peer_lost
    as_error = lambda e: e if isinstance(e, BaseException) else dist.DistBackendError(e)  # noqa: E731
    assert all(peer_lost(as_error(e)) for e in LOST)
    assert all(peer_lost(RuntimeError(e)) for e in LOST if isinstance(e, str))  # in words, as an older torch raised them
    assert peer_lost(dist.DistNetworkError("Connection reset by peer")) and peer_lost(dist.DistStoreError("timeout"))
    assert not any(peer_lost(as_error(e)) for e in MISUSED + WRONG)
    assert all(nccl_misused(as_error(e)) for e in MISUSED) and not any(nccl_misused(as_error(e)) for e in LOST)
    expert = Expert(make_config(preset="shapes-tiny"), "refiner_0")
    expert.gang = Gang(1, 2, "ddp", 1)
    for error in map(as_error, LOST + MISUSED + WRONG[:1]):
        with pytest.raises(GangBroken if peer_lost(error) else type(error)):
            with expert.among_peers("a test"):
                raise error


def gather_on_two_ranks(rank: int, port: int, by_unit: bool, out: str) -> None:
    """Rank `rank` of two (gloo, CPU): a small model sharded with FSDP2, gathered whole by the leader
    only; saves what it got and how many host copies it made."""
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from experts import parallel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ModuleList([nn.Linear(10, 10), nn.Linear(10, 10)]), nn.Linear(10, 3))
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    parallel.join_group("127.0.0.1", port, "gang-0", rank, world_size=2, backend="gloo", timeout_s=60)
    parallel.shard(model, torch.device("cpu"))

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.clone, torch.ops.aten.copy_)
            return func(*args, **(kwargs or {}))
    with Copies():
        got = parallel.gathered(model, model.state_dict(), by_unit=by_unit, keep=rank == 0)
    equal = got is not None and all(torch.equal(got[k], whole[k]) for k in whole)
    torch.save({"none": got is None, "equal": equal, "copies": Copies.count}, out)
    torch.distributed.destroy_process_group()


@pytest.mark.cluster  # its ranks are processes of their own
@pytest.mark.parametrize("by_unit", [True, False])
def test_only_the_leader_copies_the_gathered_model_to_the_host(tmp_path, by_unit):
    """Every rank takes part in gathering a sharded model (the collectives line up, nothing hangs);
    only the leader copies it to the host and gets it whole; the other rank gets None and makes no
    copy (a full fine-tune's 36 GB once per snapshot, not once per rank)."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    context = mp.get_context("spawn")
    procs = [context.Process(target=gather_on_two_ranks, args=(r, port, by_unit, outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    del store
    assert [p.exitcode for p in procs] == [0, 0]
    leader, other = (torch.load(o) for o in outs)
    assert leader["equal"] and not leader["none"] and (leader["copies"] > 0) == by_unit  # else fresh from the gather
    assert other["none"] and other["copies"] == 0
