"""Each newer generator family trains jointly with two tiny HF refiners (one with LoRA), and a run
stopped after its step-2 checkpoint and resumed inline ends with the same metrics as the uninterrupted
run: the family's model, conditioning and LoRA adapter checkpoint and restore exactly. One family
trains through Ray with two rollout workers (its adapter travels through the weight sync, which
moves every family's tensors alike); inline equals Ray is tested on its own in test_joint.py."""
import json
import shutil

import pytest

import driver.cli as cli
from tests.conftest import assert_same_training, make_config, run_training

STEPS = 3


def family_run_config(family: str, mode: str):
    return make_config(
        f"trainer.steps={STEPS}", "trainer.checkpoint_every=2", "trainer.prompts_per_step=1", "experts.n_refiners=2",
        f"cluster.mode={mode}", f"cluster.rollout_workers={2 if mode == 'ray' else 1}",
        "experts.refiner_0.model={kind: hf_causal_lm, path: 'tiny:qwen2', answer_tag: null}",
        "experts.refiner_1.model={kind: hf_causal_lm, path: 'tiny:qwen2', lora: {r: 4, alpha: 8}}",
        "experts.refiner_0.max_new_tokens=8", "experts.refiner_1.max_new_tokens=8",
        f"experts.generator.model={{kind: diffusers_flow, path: 'tiny:{family}', guidance_scale: 2.0, "
        f"max_sequence_length: 16, lora: {{r: 4, alpha: 8}}}}", "experts.generator.clip_eps=0.2",
        "experts.generator.kl_form=flow_grpo", preset="shapes-tiny")


@pytest.mark.parametrize("family, mode", [("flux1", "ray"), ("flux2_klein", "inline"), ("qwen_image", "inline")])
def test_a_family_trains_and_resumes_inline_to_the_same_metrics(family, mode, ray_session, tmp_path):
    run_dir = tmp_path / mode
    rows, info, _ = run_training(family_run_config(family, mode), run_dir)
    assert [r["version/generator"] for r in rows] == [1, 2, 3]
    assert all(w == {**info["registry"], "text_encoder": 0} for w in info["workers"])
    stopped = tmp_path / "stopped"
    shutil.copytree(run_dir, stopped)
    shutil.rmtree(stopped / "checkpoints" / f"step_{STEPS:06d}")
    assert cli.main(["train", "--resume", str(stopped), "--set", "cluster.mode=inline",
                     "--set", "cluster.rollout_workers=1"]) == 0
    resumed = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert_same_training(resumed, rows, tol=1e-5)
