"""`jointrl export`: a run's models as diffusers, transformers and PEFT load them, holding the
numbers the run sampled with; every generator family's LoRA file is what its diffusers pipeline's
`load_lora_weights` reads; bad input exits 2 and writes nothing."""
import json

import pytest
import torch

from common.hub import local_model
from driver import cli
from driver.preflight import run_config
from driver.commands.export import export_diffusers_generator, trained_model
from experts import state_file
from experts.kinds import build_model
from tests.conftest import trained_inline
from tests.family_check import PROMPTS, assert_equals_pipeline, family_config, pipeline_sampled, sampled_with

CLIP = ["task.num_frames=5", "task.image_width=64", "reward.terms.image.per_frame={frames: 5, reduce: mean}"]
FAMILIES = {"sd3": [], "flux1": [], "flux2_klein": [], "qwen_image": [], "wan2.1": CLIP, "wan2.2_a14b": CLIP}
STEPS = 4
# what the tiny SD3 lacks, as tests/test_family_sd3.py loads its pipeline
ABSENT = {"sd3": dict(text_encoder_3=None, tokenizer_3=None, image_encoder=None, feature_extractor=None)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A prompts-tiny run of two steps: a full and a LoRA tiny Qwen2 refiner, a LoRA tiny SD3."""
    return trained_inline(tmp_path_factory.mktemp("exported") / "run", "prompts-tiny", steps=2)


def the_runs_model(run_dir, expert_id):
    config = run_config(run_dir, "RUN_DIR")
    weights = state_file.read_weights(run_dir / "checkpoints" / "step_000002" / f"{expert_id}.safetensors")
    return config, trained_model(config, expert_id, weights)


def fused(transformer) -> dict:
    """The transformer's weights with its LoRA adapter folded in: one function, whatever holds it."""
    transformer.fuse_lora(lora_scale=1.0)
    return {k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items() if "lora_" not in k}


def test_the_exported_refiners_are_the_runs_in_transformers_and_peft(run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "out"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.count("jointrl: wrote ") == 5 and "PEFT LoRA adapter" in said
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    for eid in ("refiner_0", "refiner_1"):
        config, refiner = the_runs_model(run, eid)
        if eid == "refiner_1":  # LoRA: the base named in the adapter (tiny: its local folder) and the adapter
            assert json.loads((out / eid / "adapter_config.json").read_text())["r"] == 4
            loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(local_model("tiny:qwen2")),
                                               out / eid)
        else:
            loaded = AutoModelForCausalLM.from_pretrained(out / eid)
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, refiner.lm(input_ids=ids).logits), eid
        tokenizer = AutoTokenizer.from_pretrained(out / eid)
        system = json.loads((out / eid / "refiner.json").read_text())["system_prompt"]
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "a cat"}]
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert list(templated["input_ids"] if hasattr(templated, "keys") else templated) == refiner.chat_ids("a cat")
        generation = json.loads((out / eid / "generation_config.json").read_text())
        spec = config.expert(eid)
        assert generation["temperature"] == spec.temperature and generation["max_new_tokens"] == spec.max_new_tokens
        assert generation["do_sample"] and generation["top_k"] == 0
    card = (out / "README.md").read_text()
    assert "2 step(s), 16 rollouts" in card and "pipe.load_lora_weights(\"generator\")" in card
    assert "| refiner_1 | hf_causal_lm |" in card and "LoRA r=4 alpha=8" in card


def test_the_exported_generator_lora_is_the_runs_in_diffusers_and_merged_it_is_too(run, tmp_path):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    out = tmp_path / "lora"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    _, velocity = the_runs_model(run, "generator")
    pipe = StableDiffusion3Pipeline.from_pretrained(local_model("tiny:sd3"), **ABSENT["sd3"])
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(out / "generator")
    ours, theirs = fused(velocity.transformer), fused(pipe.transformer)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(not torch.equal(ours[k], base[k]) for k in base)  # the run moved the generator
    merged = tmp_path / "merged"
    assert cli.main(["export", str(run), "--out", str(merged), "--merge-lora"]) == 0
    loaded = SD3Transformer2DModel.from_pretrained(merged / "generator" / "transformer").state_dict()
    assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours)
    assert "AutoModel.from_pretrained(\"generator/transformer\")" in (merged / "README.md").read_text()
    from transformers import AutoModelForCausalLM
    _, refiner = the_runs_model(run, "refiner_1")  # the LoRA refiner merged: a whole LM of the same function
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(merged / "refiner_1")(input_ids=ids).logits,
                                   refiner.lm(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert not (merged / "refiner_1" / "adapter_config.json").exists()


def test_diffusers_samples_with_the_exported_lora_as_the_run_samples(run, tmp_path):
    """The run's trained generator (its velocity and front end, deterministic sampling) and diffusers'
    StableDiffusion3Pipeline with the exported LoRA loaded: the same prompts and initial latents
    give the same timesteps, latents and images (tests/family_check.py's bar in float32, 1e-5)."""
    from diffusers import StableDiffusion3Pipeline

    from experts.frontend import build_frontend
    out = tmp_path / "out"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    config, velocity = the_runs_model(run, "generator")
    ours = sampled_with(velocity, build_frontend(config), STEPS)
    pipe = StableDiffusion3Pipeline.from_pretrained(local_model("tiny:sd3"), **ABSENT["sd3"])
    pipe.load_lora_weights(out / "generator")
    g, size = config.experts.generator.model, config.task.image_size
    final, pixels, timesteps = pipeline_sampled(pipe, ours.latents, prompt=PROMPTS, num_inference_steps=STEPS,
                                                guidance_scale=g.guidance_scale,
                                                max_sequence_length=g.max_sequence_length, height=size, width=size)
    assert_equals_pipeline(ours, ours.final, final, pixels, timesteps, "float32", STEPS)
    pipe.unload_lora_weights()  # the base alone samples otherwise: the adapter is in what was compared
    base, _, _ = pipeline_sampled(pipe, ours.latents, prompt=PROMPTS, num_inference_steps=STEPS,
                                  guidance_scale=g.guidance_scale, max_sequence_length=g.max_sequence_length,
                                  height=size, width=size)
    assert (base - final).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_lora_file_is_what_its_diffusers_pipeline_loads(family, tmp_path):
    """A random adapter on each family's tiny build, exported and loaded by the family's pipeline
    (Wan2.2-A14B's second transformer with load_into_transformer_2): the same weights, adapter folded in."""
    import diffusers
    path = local_model(f"tiny:{family}")
    config = family_config(path, "experts.generator.model.lora={r: 4, alpha: 8}", *FAMILIES[family])
    velocity = build_model(config, "generator")
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in velocity.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=draw) * 0.1)
    export_diffusers_generator(velocity, tmp_path, merge_lora=False)
    pipe = getattr(diffusers, velocity.index["_class_name"]).from_pretrained(path, **ABSENT.get(family, {}))
    pipe.load_lora_weights(tmp_path)
    held = ["transformer"]
    if "transformer_2" in velocity._modules:
        pipe.load_lora_weights(tmp_path / "transformer_2", load_into_transformer_2=True)
        held.append("transformer_2")
    for name in held:
        ours, theirs = fused(getattr(velocity, name)), fused(getattr(pipe, name))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), (family, name)


def test_the_shapes_worlds_own_models_are_written_as_safetensors_with_a_note(tmp_path, capsys):
    run_dir = trained_inline(tmp_path / "shapes", "shapes-tiny", steps=1)
    out = tmp_path / "out"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    assert "a model of jointrl's own" in capsys.readouterr().out
    from safetensors.torch import load_file
    saved = load_file(out / "generator" / "model.safetensors")
    theirs = state_file.read_weights(run_dir / "checkpoints" / "step_000001" / "generator.safetensors")
    assert all(torch.equal(saved[k], theirs[k].to(saved[k].dtype)) for k in theirs)
    assert "`jointrl sample` draws with it" in (out / "README.md").read_text()


def test_export_without_a_checkpoint_of_a_missing_step_or_into_a_folder_with_files_exits_2(run, tmp_path, capsys):
    empty_run = tmp_path / "empty"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text((run / "config.yaml").read_text())
    cases = [([str(empty_run), "--out", str(tmp_path / "a")], "has no checkpoints"),
             ([str(run), "--out", str(tmp_path / "b"), "--step", "7"], "--step 7: "),
             ([str(tmp_path / "nowhere"), "--out", str(tmp_path / "c")], "is not a run directory")]
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases.append(([str(run), "--out", str(full)], "already holds files"))
    for argv, says in cases:
        assert cli.main(["export", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    assert cli.main(["export", str(run), "--out", str(tmp_path / "d"), "--step", "1"]) == 2  # pruned
    assert "(steps kept: 2)" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "abcd") and sorted(p.name for p in full.iterdir()) == ["keep.txt"]
