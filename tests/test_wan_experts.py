"""Wan2.2-A14B's two transformers as two experts (`experts.generator_low`) on tiny:wan2.2_a14b (its
boundary at 0.875 x 1000): each expert trains exactly the transitions its transformer denoised, and
together their gradients are one expert's training both (each averaged over its own transitions);
they start from the very adapters one expert of both starts from; a run with both trained gives
the same numbers inline and on Ray with either expert killed mid-run, and resumes exactly; the plan
counts each transformer alone; a model without a low-noise transformer, a sampler key, model key or
`owns` set apart, or trained steps that leave one side none, exit 2 naming the key."""
import json
import shutil

import numpy as np
import pytest
import torch

from algorithm.sde import sample
from cluster.runtime import get
from driver.launch import start_driver, stop_driver
from experts.frontend import build_frontend
from experts.kinds import build_model, expert_kind
from experts.trajectories import split_shared, trajectories
from experts.weights import reference_of
from tasks.base import TextPrompt
from tests.conftest import assert_same_training, make_config, run_killing, run_training
from tests.family_check import PROMPTS, initial_latents
from tests.test_wan import CLIP

MODEL = ("experts.generator.model={kind: diffusers_flow, path: 'tiny:wan2.2_a14b', max_sequence_length: 16, "
         "guidance_scale: 3.0, guidance_scale_2: 2.0, lora: {r: 4, alpha: 8}}")
RUN = [MODEL, *CLIP, "experts.generator_only=true", "experts.generator.sample_steps=4",
       "experts.generator.kl_beta=0.05", "experts.generator.lr=0.01", "trainer.prompts_per_step=1", "trainer.steps=3",
       "trainer.checkpoint_every=1", "cluster.rollout_workers=1",
       "reward.terms={clip: {fn: 'tests.test_wan:clip_brightness'}}"]
SPLIT = "experts.generator_low={lr: 0.02, kl_beta: 0.1}"  # its own learning keys; the sampler's are the generator's
BOUNDARY = 875.0


def config(*extra: str):
    return make_config(*RUN, *extra, preset="shapes-tiny")


def test_each_expert_trains_its_side_and_the_two_gradients_are_one_experts(one_thread):
    """From one batch of SDE trajectories over both noise levels (sampled by one model of both
    transformers), generator's update covers exactly the steps at or above the boundary and
    generator_low's the others; each one's loss and gradient, scaled by its share of the
    transitions, are those of one expert training both, to 1e-6."""
    both_cfg, split_cfg = config(), config("experts.generator_low={}")
    both = build_model(both_cfg, "generator").train()
    parts = {e: build_model(split_cfg, e).train() for e in ("generator", "generator_low")}
    start = both.synced_state()
    held = {**parts["generator"].synced_state(), **parts["generator_low"].synced_state()}
    assert held.keys() == start.keys() and all(torch.equal(held[k], v) for k, v in start.items())
    assert all(k.startswith("transformer.") for k in parts["generator"].synced_state())
    assert all(k.startswith("transformer_2.") for k in parts["generator_low"].synced_state())
    with torch.no_grad():  # adapters that move the velocity, the same in both setups
        gen = torch.Generator().manual_seed(3)
        for name, param in both.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        for model in parts.values():
            model.load_state_dict({k: v for k, v in both.state_dict().items() if k in model.state_dict()},
                                  strict=False)
    frontend = build_frontend(both_cfg)
    traj = sampled_trajectories(both, frontend)
    steps_high = torch.as_tensor(traj.sigmas[:-1]) * 1000 >= BOUNDARY
    assert 0 < int(steps_high.sum()) < len(steps_high)  # both levels among the trained steps
    adv = torch.tensor([1.0, -0.5, 0.25])

    def backward(cfg, eid, model):
        kind = expert_kind(cfg, eid)
        batch = kind.merge(model, [traj], torch.device("cpu"))
        model.zero_grad(set_to_none=True)
        loss, _ = kind.backward(model, reference_of(model), batch, adv)
        return batch["sde"], loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    all_sde, all_loss, all_grads = backward(both_cfg, "generator", both)
    assert all_sde.all()
    n = {e: 0 for e in parts}
    for eid, model in parts.items():
        sde, loss, grads = backward(split_cfg, eid, model)
        np.testing.assert_array_equal(sde.numpy(), (steps_high if eid == "generator" else ~steps_high).numpy())
        n[eid] = int(sde.sum())
        share = n[eid] / len(sde)
        assert grads.keys() == {k for k in all_grads if k.startswith("transformer_2." if eid == "generator_low"
                                                                       else "transformer.")}
        scale = max(float(g.abs().max()) for g in grads.values())
        assert scale > 1e-5  # gradients that say something
        for name, grad in grads.items():  # to 1e-6 of the largest gradient
            torch.testing.assert_close(grad * share, all_grads[name], rtol=0, atol=1e-6 * scale, msg=name)
        all_loss -= loss * share
    assert abs(all_loss) <= 1e-6, all_loss


def sampled_trajectories(velocity, frontend):
    """Three samples' SDE trajectories over every step, with guidance (travelling form)."""
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    sigmas, sde = frontend.sigmas(4), torch.ones(4, dtype=torch.bool)
    noise = torch.stack([initial_latents(frontend, 5, seed=k) for k in range(len(PROMPTS))])
    states, logps = sample(lambda x, s: velocity(x, s, **cond), noise, sigmas, 0.7, sde=sde)
    per_sample, shared = split_shared(cond)
    return trajectories(states, torch.arange(5), logps, per_sample, shared_cond=shared, sigmas=sigmas, sde=sde)


@pytest.fixture(scope="module")
def inline_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two-experts") / "inline"
    rows, info, _ = run_training(config(SPLIT, "cluster.mode=inline"), run_dir)
    return run_dir, rows, info


def test_both_trained_learn_with_their_own_versions_and_checkpoints(inline_run):
    run_dir, rows, info = inline_run
    for eid in ("generator", "generator_low"):
        assert [r[f"version/{eid}"] for r in rows] == [1, 2, 3]
        assert all(r[f"ppo/ratio_mean/{eid}"] == pytest.approx(1.0, abs=1e-5) for r in rows)  # on-policy
        assert rows[-1][f"kl/{eid}"] > 0  # its updates moved it off its reference
        assert info["snapshots"][eid]["version"] == 3
    from experts import state_file
    step = run_dir / "checkpoints" / "step_000003"
    assert all(k.startswith("transformer.") for k in state_file.read(step, "generator").weights)
    assert all(k.startswith("transformer_2.") for k in state_file.read(step, "generator_low").weights)


def test_ray_with_either_expert_killed_equals_inline(inline_run, ray_session, tmp_path):
    _, reference, _ = inline_run
    rows, info = run_killing(config(SPLIT), tmp_path / "ray",  # both at once: their restarts overlap
                             [(1, "expert/generator_low"), (1, "expert/generator")])
    assert_same_training(rows, reference, tol=1e-5)
    assert rows[-1]["faults/expert_restarts"] == 2  # each kill noticed once, at that expert's next update
    assert info["snapshots"]["generator_low"]["version"] == info["snapshots"]["generator"]["version"] == 3


def test_a_run_resumed_after_step_1_equals_the_uninterrupted_one(inline_run, tmp_path):
    run_dir, reference, _ = inline_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    cfg = config(SPLIT, "cluster.mode=inline")
    cfg.trainer.run_name = "resumed"
    driver = start_driver(cfg, resumed, resumed / "checkpoints" / "step_000001")
    get(driver.run.remote())
    stop_driver(driver)
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert_same_training(rows, reference, tol=1e-6)


def test_the_plan_counts_each_transformer_alone():
    from driver.plan import host_plan
    from experts.memory import generator_architecture
    cfg = config(SPLIT)
    arch = generator_architecture(cfg.experts.generator.model, 32, 64, 5)
    actors = host_plan(cfg).actors
    assert actors["expert/generator"].params == dict(zip(("transformer", "lora"), arch.per_transformer["transformer"]))
    assert actors["expert/generator_low"].params == dict(zip(("transformer", "lora"),
                                                             arch.per_transformer["transformer_2"]))
    assert actors["rollout/0"].params["generator"] == arch.transformer == sum(
        n for n, _ in arch.per_transformer.values())


@pytest.mark.parametrize("sets, named", [
    (["experts.generator.model={kind: diffusers_flow, path: 'tiny:wan2.1'}", "task.num_frames=5",
      "experts.generator_low={}"], ["experts.generator_low is set", "experts.generator.model.path=tiny:wan2.1",
                                    "no low-noise transformer"]),
    (["experts.generator_low={}"], ["experts.generator_low is set", "experts.generator.model.kind=tiny_dit"]),
    ([MODEL, *CLIP, "experts.generator_low={noise_level: 0.5}"],
     ["experts.generator_low.noise_level=0.5", "experts.generator.noise_level=0.7"]),
    ([MODEL, *CLIP, "experts.generator_low={owns: [image]}"],  # one advantage for both: the generator's
     ["experts.generator_low.owns=['image']", "experts.generator.owns=None", "their advantages"]),
    ([MODEL, *CLIP, "experts.generator_low={}", "experts.generator.sde_window=[2, 4]"],  # sigmas 1, .858, .602, .009
     ["experts.generator trains no step", "[2, 3]", "high-noise", "widen experts.generator.sde_window"]),
    ([MODEL, *CLIP, "experts.generator_low.model.max_sequence_length=32"],
     ["experts.generator_low.model.max_sequence_length=32", "only its lora and dtype"]),
    ([MODEL, *CLIP, "experts.generator_low={}", "cluster.layout=colocated"],
     ["experts.generator_low with cluster.layout=colocated", "cluster.layout=separate"]),
])
def test_a_split_the_model_cannot_take_exits_2_naming_the_key(sets, named, monkeypatch, tmp_path, capsys):
    import driver.cli as cli
    monkeypatch.setattr(cli, "train", lambda *_: pytest.fail("training started for a bad config"))
    args = [a for s in sets for a in ("--set", s)]
    assert cli.main(["train", "--config", "shapes-tiny", *args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in named), err
