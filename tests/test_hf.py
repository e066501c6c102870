"""Real model kinds on CPU without a hub: tiny random Qwen2-style refiners (one with LoRA) and a
tiny SD3-style generator (LoRA, guidance, an SDE window), built in-process, behind the same expert
interface as the tiny models, through Ray; then `report`, `sample` and TensorBoard on that run."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import driver.cli as cli
from algorithm.batch import Sample
from cluster.expert_actor import ExpertActor
from cluster.rollout_worker import RolloutWorker
from experts.hf_refiner import answer_of
from experts.kinds import build_model
from experts.weights import fingerprint, model_tensors, synced_state, to_arrays
from tasks.shapes import prompt_set
from tests.conftest import assert_same_rollout, assert_same_training, looks_like_a_picture, make_config, run_training

STEPS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from experts.tiny_hf import tiny_causal_lm, tiny_sd3
    root = tmp_path_factory.mktemp("tiny-hf")
    return {"lm": tiny_causal_lm(root / "qwen2"), "sd3": tiny_sd3(root / "sd3")}


def hf_config(models, *extra, mode="ray"):
    return make_config(
        f"trainer.steps={STEPS}", "experts.n_refiners=2", f"cluster.mode={mode}",
        "cluster.rollout_workers=2" if mode == "ray" else "cluster.rollout_workers=1",
        f"experts.refiner_0.model={{kind: hf_causal_lm, path: {models['lm']}, answer_tag: null}}",
        f"experts.refiner_1.model={{kind: hf_causal_lm, path: {models['lm']}, lora: {{r: 4, alpha: 8}}}}",
        "experts.refiner_0.max_new_tokens=8", "experts.refiner_1.max_new_tokens=8",
        f"experts.generator.model={{kind: diffusers_flow, path: {models['sd3']}, guidance_scale: 2.0, "
        f"max_sequence_length: 8, lora: {{r: 4, alpha: 8}}}}",
        "experts.generator.sde_window=[0, 2]", "experts.generator.clip_eps=0.2", *extra, preset="shapes-tiny")


def test_the_answer_is_what_the_refiner_wrote_inside_its_tags():
    assert answer_of("think <answer> a red circle </answer> more", "answer") == ("a red circle", True)
    assert answer_of("no tags at all", "answer") == ("", False)
    assert answer_of(" plain text ", None) == ("plain text", None)


def test_hf_refiner_log_probs_recomputed_equal_those_recorded(models):
    cfg = hf_config(models)
    lm = build_model(cfg, "refiner_0")
    prompts = [lm.prompt_ids(p) for p in prompt_set(4, seed=3)]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    tokens, logps, mask = lm.sample(prompts, torch.rand(4, 8, generator=torch.Generator().manual_seed(0)))
    again = lm.token_logprobs(prompts, tokens, mask)
    torch.testing.assert_close(again, logps, rtol=1e-5, atol=1e-5)
    assert (logps[~mask] == 0).all() and mask[:, 0].all()


def worker_batch(cfg):
    worker = RolloutWorker(cfg, 0)
    experts = {e: ExpertActor(cfg, e) for e in cfg.experts.ids()}
    for e, expert in experts.items():
        worker.load_weights(e, 0, expert.weights())
    items = [Sample(i, i // 4, p, i % 4 < 3) for i, p in enumerate(prompt_set(2, seed=0) * 4)]
    return worker, experts, items


def test_lora_experts_sync_only_their_adapter_and_keep_the_base_as_reference(models):
    cfg = hf_config(models)
    worker, experts, items = worker_batch(cfg)
    _, trajectories, tokens = worker.run(0, items)
    for eid, batch in (("refiner_1", tokens["refiner_1"]), ("generator", trajectories)):
        expert = experts[eid]
        adapter = {k: v.clone() for k, v in synced_state(expert.model).items()}
        assert adapter and all("lora_" in k for k in adapter)
        assert len(adapter) < len(expert.model.state_dict()) / 2
        n = len(tokens["refiner_1"]["prompts"]) if eid == "refiner_1" else len(items)
        before = {k: v.clone() for k, v in expert.model.state_dict().items() if "lora_" not in k}
        stats = expert.update(0, 0, np.linspace(-1, 1, n), batch)
        assert stats["version"] == 1 and np.isfinite(stats["loss"])
        after = expert.model.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items())  # the base never moves
        assert any(not torch.equal(a, adapter[k]) for k, a in synced_state(expert.model).items())  # it learned
    # the LoRA refiner's reference is its base: with the adapter off, it scores as a fresh base does
    ref = experts["refiner_1"].reference
    fresh = build_model(hf_config(models, "experts.refiner_1.model.lora=null"), "refiner_1")
    b = tokens["refiner_1"]
    args = (b["prompts"], torch.tensor(b["tokens"]), torch.tensor(b["mask"]))
    torch.testing.assert_close(ref.token_logprobs(*args), fresh.token_logprobs(*args).detach())


def test_sd3_generator_log_probs_match_and_the_text_cache_hits(models):
    cfg = hf_config(models)
    worker, experts, items = worker_batch(cfg)
    meta, trajectories, _ = worker.run(0, items)
    assert trajectories.sde.tolist() == [True, True, False, False]
    assert (trajectories.logps[:, 2:] == 0).all() and (trajectories.logps[:, :2] != 0).all()
    assert trajectories.state_steps.tolist() == [0, 1, 2]  # x_t and x_{t+1} of the trained steps 0 and 1
    assert set(trajectories.cond) == {"prompt_embeds", "pooled"}
    assert {k: len(v) for k, v in trajectories.shared_cond.items()} == {"negative_prompt_embeds": 1,
                                                                        "negative_pooled": 1}
    assert meta.cache_misses > 0
    again = worker.run(0, items).meta
    assert again.cache_misses == 0 and again.cache_hits > 0  # the same composed texts
    gen = experts["generator"]
    stats = gen.update(0, 0, np.zeros(len(items)), trajectories)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-4  # the recorded log-probs are the policy's


def test_an_sd3_share_rolled_out_in_chunks_equals_it_rolled_out_at_once(models):
    """rollout.batch_size=3 over a share of 8 with HF refiners and a guided SD3 generator, under
    counterfactual credit: the same refinements, images, rewards, states, log-probs and text
    features (the empty prompt's once) as at once."""
    items = worker_batch(hf_config(models))[2]
    outputs = {size: RolloutWorker(hf_config(models, f"rollout.batch_size={size}", "algorithm.credit=counterfactual",
                                             "logging.images_every=1"), 0).run(1, items)
               for size in ("null", 3)}
    assert_same_rollout(outputs[3], outputs["null"])


def test_compact_trajectories_train_as_the_full_ones(models):
    """A trajectory holds x_t and x_{t+1} of the trained steps only, the empty prompt's features once
    and the text features in the encoders' dtype (bfloat16, travelling as raw words): the update
    reads from it the loss, stats and gradient it reads from the full form of the same rollout
    (every state, the empty prompt's features per sample, float32 features)."""
    from experts.expert import Expert
    cfg = hf_config(models, "experts.generator.model.dtype=bfloat16", "experts.generator.sample_steps=5",
                    "experts.generator.sde_window=[1, 5]", "experts.generator.train_final_step=false",
                    "experts.generator.kl_beta=0.1")
    worker, items = RolloutWorker(cfg, 0), worker_batch(cfg)[2]
    compact = worker.run(0, items).trajectories
    assert compact.state_steps.tolist() == [1, 2, 3, 4]  # trained: 1, 2, 3 (the window's last is the final one)
    assert compact.cond["prompt_embeds"].dtype == np.int16 and compact.dtypes["prompt_embeds"] == "bfloat16"
    assert sorted(compact.shared_cond) == ["negative_pooled", "negative_prompt_embeds"]
    assert all(len(v) == 1 for v in compact.shared_cond.values())
    refinements, _ = worker.refine(0, items)
    cond = worker.frontend.condition([s.prompt for s in items], refinements)
    states, logps = worker.generate(cond, worker.noise(0, items), sde=True)
    np.testing.assert_array_equal(compact.states, states[:, 1:5].numpy())
    np.testing.assert_array_equal(compact.logps, logps.numpy())
    full = {"states": states, "state_steps": torch.arange(6), "logps": logps, "sigmas": worker.sigmas, "sde": worker.sde,
            "cond": {k: v.float().expand(len(items), *v.shape[1:]) for k, v in cond.items()}, "shared_cond": {}}
    expert = Expert(cfg, "generator")
    with torch.no_grad():  # an adapter that has moved: ratio and KL away from 1 and 0
        for p in expert.trainable:
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype))
    adv = torch.linspace(-1, 1, len(items))
    results = []
    for batch in (expert.kind.merge(expert.model, [compact], torch.device("cpu")), full):
        expert.optimizer.zero_grad(set_to_none=True)
        loss, stats = expert.kind.backward(expert.model, expert.reference, batch, adv)
        results.append((loss, stats, torch.cat([p.grad.flatten().float() for p in expert.trainable])))
    (loss, stats, grads), (full_loss, full_stats, full_grads) = results
    assert stats["kl"] > 0 and abs(stats["ratio_mean"] - 1) > 1e-4 and grads.abs().sum() > 0
    assert loss == full_loss and stats == full_stats and torch.equal(grads, full_grads)


def test_bfloat16_weights_travel_as_raw_words_and_arrive_bit_exact(models):
    cfg = hf_config(models, "experts.refiner_0.model.dtype=bfloat16")
    sender, receiver = build_model(cfg, "refiner_0"), build_model(cfg, "refiner_0")
    with torch.no_grad():
        for p in sender.parameters():
            p.add_(0.01)
    arrays = to_arrays(sender)
    assert {a.dtype for a in arrays.values()} == {np.dtype(np.int16)}
    arrived = model_tensors(receiver, arrays)
    assert fingerprint(arrays) == fingerprint(to_arrays(sender))
    assert all(arrived[k].dtype == torch.bfloat16 and torch.equal(arrived[k], v)
               for k, v in synced_state(sender).items())


@pytest.fixture(scope="module")
def hf_run(ray_session, models, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hf-run")
    rows, info, _ = run_training(hf_config(models, "logging.tensorboard=true", "logging.images_every=1",
                                           "logging.images_per_log=4"), run_dir)
    return run_dir, rows, info


def test_a_joint_run_of_hf_refiners_and_a_diffusers_generator_trains_through_ray(models, hf_run, tmp_path):
    run_dir, rows, info = hf_run
    assert [r["step"] for r in rows] == list(range(STEPS))
    for e in ("refiner_0", "refiner_1", "generator"):
        assert [r[f"version/{e}"] for r in rows] == [1, 2, 3]
        assert all(np.isfinite(r[f"loss/{e}"]) for r in rows)
    assert all(w == {**info["registry"], "text_encoder": 0} for w in info["workers"])
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    for eid, adapter_only in (("refiner_0", False), ("refiner_1", True), ("generator", True)):
        with safe_open(str(ckpt / f"{eid}.safetensors"), "pt") as f:
            weights = [k for k in f.keys() if k.startswith("weights.")]
        assert weights and all("lora_" in k for k in weights) == adapter_only, eid
    inline, _, _ = run_training(hf_config(models, mode="inline"), tmp_path / "inline")
    assert_same_training(rows, inline, tol=1e-5)


def test_report_sample_and_tensorboard_of_the_hf_run(hf_run, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir, rows, _ = hf_run
    assert cli.main(["report", str(run_dir)]) == 0
    for png in ("rewards", "experts", "versions", "timing", "losses", "samples"):
        looks_like_a_picture(run_dir / "report" / f"{png}.png")
    out = run_dir / "sampled.png"
    assert cli.main(["sample", str(run_dir), "--prompt", "A vivid red circle, photo", "-n", "2",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "refiner_0:" in printed and out.is_file()
    with Image.open(out) as im:
        assert im.size[0] > 0 and im.size[1] > 0
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    assert [e.step for e in events.Scalars("loss/generator")] == [r["step"] for r in rows]
    assert [e.step for e in events.Images("samples")] == list(range(STEPS))
    assert json.loads((run_dir / "samples" / "step_000000.json").read_text())["prompts"]
