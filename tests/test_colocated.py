"""`cluster.layout=colocated`: the experts' own ranks roll out, then update, with no weight sync.

The same seed gives the separate layout's metrics step for step (a rollout is a pure function of
the step and the weights): in one process for every credit mode, one and three refiners, LoRA and
full fine-tuning, tiny SD3 and FLUX.2 klein (bf16) builds, with `cluster.offload`; on Ray with a refiner
on two ddp ranks and the generator on two fsdp ranks, a rank killed mid-run. Checkpoints resume in
either layout. Each axis is covered once in a few combined runs (the suite's time budget).
"""
import json
import shutil

import pytest
import torch

from common.config import SettingError
from driver import cli
from driver.config import resolve_config
from cluster.offload import on_host

from tests.conftest import assert_same_training, make_config, run_killing, run_training

CHEAP_TERMS = ("reward.terms={aesthetic: {fn: aesthetic, weight: 1.0, model: 'tiny:aesthetic', actors: 1}, "
               "format: {fn: format, weight: 0.25}, faithful: {fn: faithful, weight: 0.25}}")
TINY_SD3 = ("experts.generator.model={kind: diffusers_flow, path: tiny:sd3, max_sequence_length: 16, "
            "lora: {r: 4, alpha: 8}}")
FLUX2 = ("experts.generator.model={kind: diffusers_flow, path: tiny:flux2_klein, max_sequence_length: 16, "
         "dtype: bfloat16}")  # trained in fp32, computed in bf16 (experts/precision.py) in both layouts

# name -> (preset, overrides of both layouts, overrides of the colocated run only)
CASES = {
    "counterfactual, 3 refiners, offload": ("shapes-tiny", ["algorithm.credit=counterfactual", "experts.n_refiners=3",
                                                            "experts.generator.kl_beta=0.05"],
                                            ["cluster.offload=[optimizer,reference]"]),
    # SD3 generator and refiner_1 with LoRA, refiner_0 full; a term scored by a reward actor
    "tiny:sd3 LoRA, counterfactual": ("prompts-tiny", [CHEAP_TERMS, "experts.refiner_1.owns=[faithful]",
                                                       "algorithm.credit=counterfactual"],
                                      ["cluster.offload=[optimizer,reference]"]),
    "tiny:flux2 full, bf16": ("shapes-tiny", [FLUX2, "experts.n_refiners=1", "algorithm.credit=per_expert",
                                        "experts.generator.kl_beta=0.05"], ["cluster.offload=[optimizer]"]),
}


def run(tmp_path, name: str, preset: str, *overrides: str):
    config = make_config("cluster.mode=inline", "trainer.steps=2", *overrides, preset=preset)
    rows, info, _ = run_training(config, tmp_path / name)
    return rows, info


@pytest.mark.parametrize("case", list(CASES))
def test_colocated_gives_the_separate_layouts_metrics_in_one_process(case, tmp_path, one_thread):
    preset, both, colocated_only = CASES[case]
    separate, separate_info = run(tmp_path, "separate", preset, *both)
    colocated, info = run(tmp_path, "colocated", preset, "cluster.layout=colocated", *both, *colocated_only)
    assert_same_training(colocated, separate, tol=1e-5)
    assert {r["sync/via"] for r in separate} == {"object_store"} and len(separate_info["workers"]) == 1
    assert {r["sync/via"] for r in colocated} == {"none"} and info["workers"] == []
    assert colocated[-1]["version/generator"] == 2


def test_staleness_and_offload_outside_colocated_or_under_fsdp_are_refused_naming_the_key():
    with pytest.raises(SettingError, match=r"cluster.max_staleness=1 with cluster.layout=colocated"):
        resolve_config("shapes-tiny", ["cluster.layout=colocated", "cluster.max_staleness=1"])
    with pytest.raises(SettingError, match=r"cluster.offload=\['optimizer'\] with cluster.layout=separate"):
        resolve_config("shapes-tiny", ["cluster.offload=[optimizer]"])
    with pytest.raises(SettingError, match=r"with experts.generator.parallel.strategy=fsdp"):
        resolve_config("shapes-tiny", ["cluster.layout=colocated", "cluster.offload=[reference]",
                                       "experts.generator.parallel.ranks=2", "experts.generator.parallel.strategy=fsdp"])
    assert cli.main(["train", "--config", "shapes-tiny", "--set", "cluster.layout=colocated",
                     "--set", "cluster.max_staleness=2"]) == 2


GANGS = ("experts.n_refiners=1", "experts.refiner_0.parallel.ranks=2", "experts.refiner_0.parallel.strategy=ddp",
         "experts.generator.parallel.ranks=2", "experts.generator.parallel.strategy=fsdp",
         "experts.generator.parallel.defer_gradient_sync=true")
KILLS = [(1, "expert/generator")]  # the leader, which holds the rollout pipeline and hosts the gang's rendezvous


def test_on_ray_ddp_and_fsdp_ranks_roll_out_with_the_separate_metrics_and_survive_a_killed_rank(
        ray_session, tmp_path, one_thread):
    """A refiner on two ddp ranks and the generator on two fsdp ranks (each gathered whole for
    its rollout), the generator's leader killed mid-run: its gang is restored from the last snapshot
    and the step's rollout and update are made once; the metrics are the one-process separate run's.
    The optimizer state is kept every second update only (cluster.optimizer_snapshot_every=2; the
    snapshots between hold no weights either, as no worker is served): the killed gang is restored
    from its first snapshot and replays the update since."""
    common = ("experts.generator.kl_beta=0.05", "algorithm.credit=counterfactual", "trainer.steps=2")
    separate = run_training(make_config("cluster.mode=inline", "experts.n_refiners=1", *common,
                                        preset="shapes-tiny"), tmp_path / "separate")[0]
    rows, info = run_killing(make_config("cluster.layout=colocated", "cluster.optimizer_snapshot_every=2", *GANGS,
                                         *common, preset="shapes-tiny"), tmp_path / "colocated", KILLS)
    assert_same_training(rows, separate, tol=1e-5)
    assert rows[-1]["faults/expert_restarts"] == len(KILLS) and rows[-1]["faults/replayed_updates"] > 0
    assert [r["version/generator"] for r in rows] == [1, 2] and {r["sync/via"] for r in rows} == {"none"}
    assert info["snapshots"]["generator"] == {"version": 2, "last_step": 1} and info["workers"] == []


def resumed(run_dir, tmp_path, name: str, *overrides: str) -> list[dict]:
    """`run_dir` cut back to its step-1 checkpoint and resumed with `overrides`: its metric rows."""
    stopped = tmp_path / name
    shutil.copytree(run_dir, stopped)
    for later in ("step_000002", "step_000003"):
        shutil.rmtree(stopped / "checkpoints" / later)
    assert cli.main(["train", "--resume", str(stopped), *[f"--set={o}" for o in overrides]]) == 0
    return [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]


def test_a_checkpoint_resumes_in_either_layout_to_the_uninterrupted_metrics(tmp_path, one_thread):
    """A colocated run resumed colocated, and each layout's checkpoint resumed in the other, end
    with the uninterrupted run's metrics (the optimizer state and versions restored); shared
    credit and one refiner (the combinations above cover the other credits and counts). The optimizer
    state is kept every second update only, so each checkpoint takes it (and, colocated, the weights)."""
    common = ("cluster.mode=inline", "trainer.checkpoint_every=1", "experts.generator.kl_beta=0.05",
              "algorithm.credit=shared", "experts.n_refiners=1", "cluster.optimizer_snapshot_every=2")
    runs = {}
    for layout in ("separate", "colocated"):
        rows, _, _ = run_training(make_config(*common, f"cluster.layout={layout}", preset="shapes-tiny"),
                                  tmp_path / layout)
        runs[layout] = rows
    assert_same_training(runs["colocated"], runs["separate"], tol=1e-5)
    for layout, into in (("colocated", "colocated"), ("colocated", "separate"), ("separate", "colocated")):
        rows = resumed(tmp_path / layout, tmp_path, f"{layout}-to-{into}", f"cluster.layout={into}")
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert_same_training(rows, runs[layout], tol=1e-5)
        assert rows[-1]["sync/via"] == ("none" if into == "colocated" else "object_store")


class OnFakeDevice(torch.Tensor):
    """A host tensor that says it lives on `where` (a GPU this machine does not have) until moved."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, where):
        tensor = torch.Tensor._make_subclass(cls, data)
        tensor.where = torch.device(where)
        return tensor

    @property
    def device(self):
        return self.where

    def to(self, device, *args, **kwargs):
        return OnFakeDevice(self.detach().clone(), device)


class FakeReference(torch.nn.Module):
    """A frozen reference on the fake device, moved by `to`."""

    def __init__(self):
        super().__init__()
        self.where = torch.device("cuda:0")

    def parameters(self, recurse: bool = True):
        yield OnFakeDevice(torch.zeros(2), self.where)

    def to(self, device):
        self.where = torch.device(device)
        return self


def test_offload_moves_the_optimizer_state_and_reference_to_the_host_and_back():
    """On a (fake) GPU: during the rollout the moments and the reference are in host memory with
    the same values, the step counter (already on the host) stays as it is; after it, every tensor
    is back on its device. A part not named is not moved."""
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param])
    step = torch.tensor(4.0)
    moments = torch.arange(3.0)
    optimizer.state[param] = {"step": step, "exp_avg": OnFakeDevice(moments.clone(), "cuda:0"),
                              "exp_avg_sq": OnFakeDevice(moments + 1, "cuda:0")}
    reference = FakeReference()
    state = optimizer.state[param]
    with on_host(optimizer, reference, ["optimizer", "reference"]):
        assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "cpu"
        assert torch.equal(state["exp_avg"], moments) and state["step"] is step
        assert reference.where.type == "cpu"
    assert state["exp_avg"].device == state["exp_avg_sq"].device == torch.device("cuda:0")
    assert torch.equal(state["exp_avg_sq"], moments + 1) and reference.where == torch.device("cuda:0")
    with on_host(optimizer, reference, ["reference"]):
        assert state["exp_avg"].device.type == "cuda" and reference.where.type == "cpu"


def test_the_plan_counts_a_colocated_rank_its_rollout_and_offload_and_no_worker():
    """A tiny SD3 generator (LoRA) on a GPU target: colocated, the generator rank holds the front end and its rollout's
    working set beyond the update's activations, its transformer once; no rollout worker is
    planned; offloading the optimizer takes its moments off the rollout phase, byte for byte."""
    from driver.plan import config_target, plan_for

    def generator(*overrides):
        config = resolve_config("shapes-tiny", [TINY_SD3, "experts.generator.micro_batch=1", *overrides])
        plan = plan_for(config, config_target(config))
        return plan, plan.actors["expert/generator"].bytes
    separate, alone = generator()
    plan, held = generator("cluster.layout=colocated")
    _, offloaded = generator("cluster.layout=colocated", "cluster.offload=[optimizer]")
    assert any(n.startswith("rollout/") for n in separate.actors) and not any(n.startswith("rollout/") for n in plan.actors)
    assert {k: v for k, v in held.items() if not k.startswith("rollout: ")} == alone
    assert held["rollout: weights: vae"] > 0 and not any(k == "rollout: weights: generator" for k in held)
    beyond = [k for k in held if k.startswith("rollout: working set")][0]
    assert held[beyond] > held["optimizer (fp32 AdamW moments)"]
    assert held[beyond] - offloaded[beyond] == held["optimizer (fp32 AdamW moments)"]


def test_the_plan_estimates_each_layouts_step_from_its_phases_and_names_the_faster(capsys):
    """With given per-sample costs the estimate is the module's arithmetic, both layouts on the same
    4 devices: 8 samples, 6 refined; separate: the generator on 2 ranks and one worker, colocated:
    the generator on 3 ranks. Then a tiny build's costs measured here, through the CLI."""
    from driver.commands.layout_plan import PhaseCosts, compare
    from driver.plan import Target
    here = Target(1, 0, 0.0, 0.0, "this machine")
    config = resolve_config("shapes-tiny", ["experts.n_refiners=1", "experts.generator.parallel.ranks=2"])
    costs = PhaseCosts({"refiner_0": 1.0}, 2.0, {"generator": 3.0, "refiner_0": 1.0}, "given")
    out = compare(config, here, costs)
    assert (out["separate"].devices, out["colocated"].devices) == (4, 4)
    assert (out["separate"].rollout_s, out["colocated"].rollout_s) == (1.0 * 6 + 2.0 * 8, 1.0 * 6 + 2.0 * 3)
    assert (out["separate"].update_s, out["colocated"].update_s) == (max(3.0 * 4, 1.0 * 6), max(3.0 * 3, 1.0 * 6))
    assert out["faster"] == "colocated"
    colocated = resolve_config("shapes-tiny", ["experts.n_refiners=1", "experts.generator.parallel.ranks=3",
                                               "cluster.layout=colocated"])
    assert compare(colocated, here, costs)["separate"].shape == "the generator on 2 rank(s) + 1 rollout worker(s)"
    # a refiner that refines slowly: two workers refine in parallel, its one rank alone
    slow_refiner = PhaseCosts({"refiner_0": 10.0}, 0.0, {"generator": 0.0, "refiner_0": 0.0}, "given")
    two_workers = resolve_config("shapes-tiny", ["experts.n_refiners=1", "cluster.rollout_workers=2"])
    out = compare(two_workers, here, slow_refiner)
    assert (out["separate"].rollout_s, out["colocated"].rollout_s) == (10.0 * 3, 10.0 * 6)
    assert out["faster"] == "separate"
    assert cli.main(["plan", "--config", "shapes-tiny", "--gpus", "0", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts["costs"]["source"].startswith("measured") and layouts["faster"] in ("separate", "colocated")
    assert all(v > 0 for v in [layouts["costs"]["generate"], *layouts["costs"]["update"].values()])
    assert layouts["colocated"]["devices"] == layouts["separate"]["devices"]


def test_a_layout_the_config_refuses_is_never_recommended_and_the_comparison_says_why():
    """Colocated would be faster (given costs) but the config refuses it (evaluation during training
    draws on a rollout worker, which colocated has none of): the plan recommends separate and
    gives the refusal, with the key to change."""
    from driver.commands.layout_plan import PhaseCosts, compare, compare_report
    from driver.plan import Target
    here = Target(1, 0, 0.0, 0.0, "this machine")
    costs = PhaseCosts({"refiner_0": 1.0}, 2.0, {"generator": 3.0, "refiner_0": 1.0}, "given")
    sets = ["experts.n_refiners=1", "experts.generator.parallel.ranks=2"]
    assert compare(resolve_config("shapes-tiny", sets), here, costs)["faster"] == "colocated"
    out = compare(resolve_config("shapes-tiny", [*sets, "evaluation.every=2"]), here, costs)
    assert out["faster"] == "separate"
    assert out["colocated"].startswith("the config refuses it: evaluation.every=2 with cluster.layout=colocated")
    assert "  colocated: the config refuses it: evaluation.every=2" in compare_report(out)
