"""The moving-shapes world (`shapes_video`): its detector and motion scorer on rendered clips, its
prompt sets, the tiny video DiT, its config errors, and the `shapes-video` preset from its shipped
base (configs/bases/shapes-video/, as `jointrl pretrain --config shapes-video --set
pretrain.out_dir=configs/bases/shapes-video` writes it)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import SettingError
from driver.config import resolve_config
from driver.preflight import load_config
from experts.dit import TinyDiT
from tasks.base import to_uint8
from tasks.rewards.base import Options
from tasks.rewards.shapes import ShapesVideo
from tasks.shapes import ObjectClause, VOCAB
from tests.shipped_bases import check_shipped_base
from tasks.shapes_video import (VIDEO_CATEGORIES, VIDEO_VOCAB, VideoPrompt, clip_checks, clip_correct,
                                make_video_prompt, render_clip, video_clause_key, video_eval_set, video_prompt_set)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "bases" / "shapes-video"
O = ObjectClause


def as_sample(clip: np.ndarray) -> np.ndarray:
    """A uint8 clip (F, H, W, 3) as the generator decodes one: (F, 3, H, W) in [-1, 1]."""
    return np.moveaxis(clip, -1, 1).astype(np.float32) / 127.5 - 1.0


@pytest.mark.parametrize("frames", [4, 8])
def test_rendered_clips_of_every_category_score_right(frames):
    """The scorer on the renderer's own clips: every category, both wordings, nearly all strictly
    right (a 32 px circle may read as a square in a frame or two), the mean reward near 1."""
    rng = np.random.default_rng(frames)
    for cat in VIDEO_CATEGORIES:
        prompts = [make_video_prompt(cat, rng, terse=bool(i % 2)) for i in range(16)]
        clips = [render_clip(p, rng, frames) for p in prompts]
        assert np.mean([clip_correct(c, p) for c, p in zip(clips, prompts)]) >= 0.9, cat
        assert np.mean([np.mean(clip_checks(c, p)) for c, p in zip(clips, prompts)]) >= 0.98, cat


@pytest.mark.parametrize("asked, drawn", [
    (VideoPrompt.make("a red circle moving left", "direction", [O("circle", "red")], "left"),
     VideoPrompt.make("a red circle moving right", "direction", [O("circle", "red")], "right")),
    (VideoPrompt.make("a red circle moving up", "direction", [O("circle", "red")], "up"),
     VideoPrompt.make("a red circle moving left", "direction", [O("circle", "red")], "left")),
    (VideoPrompt.make("a blue triangle growing", "size", [O("triangle", "blue")], "growing"),
     VideoPrompt.make("a blue triangle shrinking", "size", [O("triangle", "blue")], "shrinking")),
    (VideoPrompt.make("two green squares moving apart", "pair", [O("square", "green", 2)], "apart"),
     VideoPrompt.make("two green squares moving together", "pair", [O("square", "green", 2)], "together")),
    (VideoPrompt.make("a red circle and a blue square moving together", "colors",
                      [O("circle", "red"), O("square", "blue")], "together"),
     VideoPrompt.make("a red circle and a blue square moving apart", "colors",
                      [O("circle", "red"), O("square", "blue")], "apart")),
], ids=["opposite", "across", "shrinking_not_growing", "together_not_apart", "apart_not_together"])
def test_wrong_motion_scores_low(asked, drawn):
    """The right objects moving the wrong way: no motion credit, never strictly right; its reward is
    the objects' share alone, below the right clip's by the motion's checks."""
    rng = np.random.default_rng(0)
    scorer = ShapesVideo(Options(), None)
    wrong = np.stack([as_sample(render_clip(drawn, rng, 4)) for _ in range(6)])
    right = np.stack([as_sample(render_clip(asked, rng, 4)) for _ in range(6)])
    got_wrong, got_right = scorer(wrong, [asked] * 6, [{}] * 6), scorer(right, [asked] * 6, [{}] * 6)
    assert scorer.strict(wrong, [asked] * 6, [{}] * 6).sum() == 0
    assert got_wrong.max() <= 1 - 2 / len(clip_checks(render_clip(asked, rng, 4), asked)) + 0.01  # centroid jitter
    assert got_right.min() >= 0.95 and got_right.mean() - got_wrong.mean() >= 0.25


def test_still_clips_wrong_objects_and_blank_clips_score_low():
    rng = np.random.default_rng(1)
    asked = VideoPrompt.make("a red circle moving left", "direction", [O("circle", "red")], "left")
    first = render_clip(asked, rng, 4)[:1]
    still = np.repeat(first, 4, axis=0)  # the right object, not moving
    assert not clip_correct(still, asked) and clip_checks(still, asked)[-2:] == [0.0, 0.0]
    blue = VideoPrompt.make("a blue circle moving left", "direction", [O("circle", "blue")], "left")
    assert np.mean(clip_checks(render_clip(blue, rng, 4), asked)) == 0.0  # nothing red at all
    three = VideoPrompt.make("three red circles moving left", "counting", [O("circle", "red", 3)], "left")
    checks = clip_checks(render_clip(asked, rng, 4), three)
    assert checks[2] == 0.0 and not clip_correct(render_clip(asked, rng, 4), three)  # one circle, not three
    blank = -np.ones((2, 4, 3, 32, 32), np.float32)
    assert ShapesVideo(Options(), None)(blank, [asked, three], [{}, {}]).max() == 0.0
    with pytest.raises(ValueError, match="set task.num_frames"):
        ShapesVideo(Options(), None)(blank[:, 0], [asked, three], [{}, {}])


def test_prompt_sets_share_no_prompt_and_read_in_the_video_vocabulary():
    train = video_prompt_set(40, 3)
    held = video_eval_set(10, 1234, exclude=train)
    assert {p.category for p in train} == set(VIDEO_CATEGORIES)
    assert [p.metadata["tag"] for p in held] == [c for c in VIDEO_CATEGORIES for _ in range(10)]
    assert not {video_clause_key(p) for p in held} & {video_clause_key(p) for p in train}
    assert not {p.text for p in held} & {p.text for p in train}
    assert VIDEO_VOCAB[:len(VOCAB)] == VOCAB  # the image words keep their ids
    assert max(i for p in train + held for i in p.ids) >= len(VOCAB)  # motion words are read
    with pytest.raises(ValueError, match="outside the shapes_video vocabulary"):
        VideoPrompt.make("a red circle dancing", "direction", [O("circle", "red")], "left")


def test_the_video_dit_patches_clips_in_time_and_space_and_keeps_the_image_model():
    torch.manual_seed(0)
    video = TinyDiT(32, 3, 4, 32, n_layers=1, n_heads=2, d_text=16, frames=4, frame_patch=2)
    x = torch.randn(2, 3, 4, 32, 32)
    tokens = video.patchify(x)
    assert tokens.shape == (2, 2 * 8 * 8, 3 * 2 * 4 * 4)
    assert torch.equal(tokens[1, 64 + 8 + 3], x[1, :, 2:4, 4:8, 12:16].reshape(-1))  # second frame pair, row 1, col 3
    assert torch.equal(video.unpatchify(tokens), x)
    out = video(x, torch.rand(2), torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool))
    assert out.shape == x.shape
    image = TinyDiT(32, 3, 4, 32, n_layers=1, n_heads=2, d_text=16)
    picture = torch.randn(2, 3, 32, 32)
    by_hand = picture.reshape(2, 3, 8, 4, 8, 4).permute(0, 2, 4, 1, 3, 5).reshape(2, 64, 48)  # the 2D patches
    assert torch.equal(image.patchify(picture), by_hand) and torch.equal(image.unpatchify(by_hand), picture)


@pytest.mark.parametrize("overrides, match", [
    (["task.num_frames=3"], r"task\.num_frames=3: task\.name=shapes_video draws clips of 4 to 8 frames"),
    (["task.num_frames=5"], r"task\.num_frames \(5\) must be a multiple of it"),
    (["experts.generator.model.kind=tiny_dit"], r"experts\.generator\.model\.kind=tiny_dit makes images"),
    (["task.num_frames=null"], r"task\.num_frames=None: task\.name=shapes_video draws clips of 4 to 8 frames"),
    (["task.name=shapes", "task.num_frames=null", "experts.generator.owns=null"], r"tiny_video_dit makes clips"),
])
def test_a_video_config_that_cannot_work_is_refused_naming_the_key(overrides, match):
    with pytest.raises(SettingError, match=match):
        resolve_config("shapes-video", ["experts.base=null", *overrides])


def test_the_shipped_video_base_is_its_manifests_files_made_for_the_preset_and_the_preset_loads_it():
    base, _ = check_shipped_base("shapes-video", SHIPPED, max_mib=5)
    report = json.loads((base / "eval.json").read_text())["sets"]["held_out"]["unrefined"]
    assert set(report["video/strict"]) == {"overall", *VIDEO_CATEGORIES}


def test_the_preset_trains_from_its_base_inline(tmp_path, one_thread):
    """Two small steps of `shapes-video` inline: clips go through the rollout, the reward logs
    reward/video and each refiner's own term, and every expert updates."""
    from tests.conftest import run_training
    config = load_config("shapes-video", ["trainer.steps=2", "trainer.prompts_per_step=2", "algorithm.group_size=4",
                                          "algorithm.num_skip_refinement=1", "experts.generator.sample_steps=4",
                                          "cluster.mode=inline", "logging.report=false"])
    rows, info, _ = run_training(config, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0 < r["reward/video"] <= 1 and all(f"reward/refiner_{i}" in r for i in range(3)) for r in rows)
    assert all(info["experts"][e]["version"] == 2 for e in info["experts"])


def test_the_shipped_video_base_draws_the_asked_colours():
    """One ODE clip per held-out prompt of one moving object, unrefined: the base draws the colour
    the prompt asks (the detector's colour check, over every frame), far more than another prompt's
    (the base is rough: its motions are RL's to learn, see bench/results/learning-video.md)."""
    from driver.commands.evaluate import base_config
    from experts.pipeline import RolloutPipeline
    from tasks.evaluation import eval_prompts
    config = base_config(load_config("shapes-video", ["experts.base=null", "evaluation.per_category=8"]),
                         next(SHIPPED.glob("base-*")))
    pipeline = RolloutPipeline(config)
    moving = [p for p in eval_prompts(config, pipeline)["held_out"] if p.metadata["tag"] == "direction"]
    clips = pipeline.draw(moving, refine=False)["images"]
    assert clips.shape == (8, 4, 3, 32, 32)
    asked = [clip_checks(to_uint8(c), p)[0] for c, p in zip(clips, moving)]
    other = [clip_checks(to_uint8(c), p)[0] for c, p in zip(clips, moving[1:] + moving[:1])]
    assert np.mean(asked) >= 0.6 and np.mean(asked) - np.mean(other) >= 0.3, (asked, other)
