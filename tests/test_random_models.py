"""`random:<name>` (common/random_models.py) on small architectures: the config files of the tiny SD3
pipeline and the tiny Qwen2 LM (no weights, no tokenizer) are built into random models that load
through the same code as a real checkpoint, train a step, and are planned as the architecture they
stand for; the presets' real names are planned identically with and without `random:`."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from common.hub import local_model
from driver.plan import config_target, plan_for
from tests.conftest import make_config, run_training


def config_files(kind: str, root: Path) -> Path:
    """`tiny:<kind>`'s config files alone, in `root/<kind>` (what configs/architectures ships for a
    real model: no weights, no tokenizer files)."""
    built = Path(local_model(f"tiny:{kind}"))
    for f in built.rglob("*.json"):
        rel = f.relative_to(built)
        if rel.parts[0].startswith("tokenizer") or rel.name.startswith(("tokenizer", "special_tokens", "added_tokens",
                                                                          "vocab")):
            continue
        (root / kind / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, root / kind / rel)
    assert not list((root / kind).rglob("*.safetensors")) and not list((root / kind).rglob("tokenizer*"))
    return root / kind


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("architectures")
    return {kind: config_files(kind, root) for kind in ("sd3", "qwen2")}


def joint_config(sd3: str, lm: str, *extra: str):
    return make_config(
        "trainer.steps=1", "cluster.mode=inline", "experts.n_refiners=2", "experts.refiner_1.train=false",
        f"experts.refiner_defaults.model={{kind: hf_causal_lm, path: '{lm}', answer_tag: null, lora: {{r: 4, alpha: 8}}}}",
        "experts.refiner_defaults.max_new_tokens=6",
        f"experts.generator.model={{kind: diffusers_flow, path: '{sd3}', guidance_scale: 2.0, max_sequence_length: 8, "
        f"dtype: bfloat16, lora: {{r: 4, alpha: 8}}}}",
        "experts.generator.sde_window=[0, 2]", "experts.generator.clip_eps=0.2", *extra, preset="shapes-tiny")


def test_random_models_load_through_the_real_loading_path_and_train(sources, tmp_path):
    sd3, lm = f"random:{sources['sd3']}", f"random:{sources['qwen2']}"
    folder = Path(local_model(sd3))
    assert local_model(sd3) == str(folder)  # built once, then found
    index = json.loads((folder / "model_index.json").read_text())
    assert {k for k, v in index.items() if isinstance(v, list) and v[0]} == \
        {"scheduler", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer"}
    from safetensors.torch import load_file
    weights = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    tiny = load_file(Path(local_model("tiny:sd3")) / "transformer" / "diffusion_pytorch_model.safetensors")
    assert weights.keys() == tiny.keys() and all(weights[k].shape == tiny[k].shape for k in tiny)
    matrix = next(k for k in weights if weights[k].dim() == 2)
    assert weights[matrix].dtype == torch.bfloat16 and not torch.equal(weights[matrix].float(), tiny[matrix])
    assert 0 < weights[matrix].float().abs().max() <= weights[matrix].shape[1] ** -0.5

    rows, _, _ = run_training(joint_config(sd3, lm), tmp_path / "run")  # the experts' own loading code, one step
    assert len(rows) == 1 and rows[0]["version/generator"] == 1 and rows[0]["version/refiner_0"] == 1
    assert abs(rows[0]["ppo/ratio_mean/generator"] - 1) < 1e-3 and abs(rows[0]["ppo/ratio_mean/refiner_0"] - 1) < 1e-3
    assert all(torch.isfinite(torch.tensor(v)) for k, v in rows[0].items() if k.startswith("loss/"))


def test_the_stand_in_tokenizers_keep_their_encoders_special_tokens(sources):
    from transformers import CLIPTextConfig, T5Config

    from common.loading import component, load_index, load_tokenizer
    from common.random_models import stand_in_tokenizer
    folder = Path(local_model(f"random:{sources['sd3']}"))
    clip = component(str(folder), load_index(str(folder)), "tokenizer")  # as the pipeline's front end loads it
    config = json.loads((sources["sd3"] / "text_encoder" / "config.json").read_text())
    ids = clip("a red circle, above a square", padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77 and len(clip) == config["vocab_size"] and clip.model_max_length == 77
    # its start token, 6 words and a comma (each unknown), its end token, then padding (CLIP-L's: the end token)
    assert ids[:9] == [config["bos_token_id"], *[clip.unk_token_id] * 7, config["eos_token_id"]]
    assert set(ids[9:]) == {config["eos_token_id"]}
    t5 = stand_in_tokenizer(T5Config(vocab_size=100, d_model=8, num_layers=1, num_heads=1))
    assert t5("two green triangles").input_ids == [t5.unk_token_id] * 3 + [1] and t5.pad_token_id == 0
    lm = load_tokenizer(local_model(f"random:{sources['qwen2']}"))  # as the refiner loads it
    chat = lm.apply_chat_template([{"role": "user", "content": "a cat"}], add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    assert lm.convert_ids_to_tokens(chat)[:2] == ["<|im_start|>", "<unk>"] and lm.eos_token == "<|im_end|>"
    assert max(lm.get_vocab().values()) + 1 == json.loads((sources["qwen2"] / "config.json").read_text())["vocab_size"]
    odd = CLIPTextConfig(vocab_size=10, bos_token_id=3, eos_token_id=3)  # one id asked for twice: the second moves
    specials = {t: stand_in_tokenizer(odd).convert_tokens_to_ids(t) for t in ("<|startoftext|>", "<|endoftext|>")}
    assert specials["<|startoftext|>"] == 3 and specials["<|endoftext|>"] == 9


@pytest.mark.parametrize("kind", ["flux1", "flux2_klein", "qwen_image"])
def test_every_familys_random_pipeline_encodes_guides_and_decodes(kind, tmp_path):
    """Their stand-in tokenizers: CLIP's and T5's for FLUX.1, ChatML for FLUX.2 klein's Qwen3 (under
    its chat template) and Qwen-Image's Qwen2.5-VL (under its prompt template)."""
    from tasks.base import TextPrompt
    from tests.family_check import PROMPTS, family_config, parts
    velocity, frontend = parts(family_config(f"random:{config_files(kind, tmp_path)}", "experts.generator.model.guidance_scale=2.0"))
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    assert all(len(v) == len(PROMPTS) and torch.isfinite(v.float()).all() for k, v in cond.items() if "negative" not in k)
    x = torch.randn(len(PROMPTS), *frontend.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = velocity(x, torch.full((len(PROMPTS),), 0.5), **cond)
        images = frontend.decode(x)
    assert v.shape == x.shape and torch.isfinite(v).all() and v.abs().max() > 0
    assert images.shape[:2] == (len(PROMPTS), 3) and torch.isfinite(images).all()
    if kind == "qwen_image":  # the tokens the pipeline drops are its template's system turn, as with Qwen's tokenizer
        pipe = frontend.pipeline
        ids = pipe.tokenizer(pipe.prompt_template_encode.format("a cat")).input_ids
        assert pipe.tokenizer.convert_ids_to_tokens(ids[pipe.prompt_template_encode_start_idx:]) == \
            ["<unk>", "<unk>", "<|im_end|>", "<unk>", "<|im_start|>", "<unk>", "<unk>"]  # a cat, then "\nassistant\n"


def test_a_random_model_is_planned_as_the_architecture_it_stands_for(sources):
    def plan(sd3: str, lm: str) -> dict:
        config = joint_config(sd3, lm, "cluster.mode=ray", "experts.generator.resources.num_gpus=1")
        return plan_for(config, config_target(config)).to_json()
    named = plan(str(sources["sd3"]), str(sources["qwen2"]))
    assert plan(f"random:{sources['sd3']}", f"random:{sources['qwen2']}") == named
    # the built folders, read as local models (their configs as the libraries wrote them), give the same plan
    assert plan(local_model(f"random:{sources['sd3']}"), local_model(f"random:{sources['qwen2']}")) == named


def test_the_gpu_presets_real_models_are_planned_alike_with_random_weights():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_smoke
    from driver.config import resolve_config
    stand_in = gpu_smoke.smoke_config("gpu", False, 1, 80.0, 2, None, False, random=True)  # its preflight passes here
    # the real models, which are not here (the preflight would refuse them): the same config unchecked
    source, overrides = gpu_smoke.smoke_overrides("gpu", False, 1, 80.0, 2, False)
    real = resolve_config(source, [*overrides, f"trainer.prompts_per_step={stand_in.trainer.prompts_per_step}"])
    assert [stand_in.expert(e).model.path for e in stand_in.experts.ids()] == \
        [f"random:{real.expert(e).model.path}" for e in real.experts.ids()]
    assert plan_for(stand_in, config_target(stand_in)).to_json() == plan_for(real, config_target(real)).to_json()
    from common.config import SettingError
    with pytest.raises(SettingError, match="reward terms pickscore"):  # its reward model has no random stand-in
        gpu_smoke.smoke_config("pickscore", False, 1, 80.0, 2, None, False, random=True)
