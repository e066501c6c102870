"""Reward terms on clips (B, F, 3, H, W): an image term scored per frame (`per_frame`), the
temporal-consistency term, a user's clip plug-in, and the configs that cannot work refused before
anything starts (exit 2, naming the key and its valid values)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoProcessor, CLIPModel

import driver.cli as cli
from common.hub import local_model
from tasks.base import Refinement, TextPrompt
from tasks.reward_guard import RewardSet
from tasks.rewards.frames import PerFrame, frame_indices
from tasks.rewards.term import TermConfig, build_scorer, sample_scorer

CPU = torch.device("cpu")


def clips(b=3, f=6, size=24, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (b, f, 3, size, size)).astype(np.float32)


def prompts(n):
    return [TextPrompt(f"prompt {i}") for i in range(n)]


@pytest.mark.parametrize("f, k, expected", [(8, 4, [0, 2, 5, 7]), (9, 3, [0, 4, 8]), (5, 1, [2]), (4, 4, [0, 1, 2, 3]),
                                            (81, 2, [0, 80])])
def test_frames_are_spread_evenly_first_and_last_among_them(f, k, expected):
    assert frame_indices(f, k).tolist() == expected
    for f in range(2, 30):
        for k in range(2, f + 1):
            chosen = frame_indices(f, k)
            assert chosen[0] == 0 and chosen[-1] == f - 1 and (np.diff(chosen) > 0).all()


class Recorder:
    """An image term that records its calls and scores each image by its mean pixel, and is
    strict where that is positive."""

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, refinements):
        self.calls.append((np.asarray(images).shape, [p.text for p in prompts], list(refinements)))
        return np.asarray(images).mean((1, 2, 3))

    def strict(self, images, prompts, refinements):
        return (np.asarray(images).mean((1, 2, 3)) > 0).astype(float)


@pytest.mark.parametrize("reduce", ["mean", "min"])
def test_per_frame_scores_the_chosen_frames_in_one_call_and_reduces_per_clip(reduce):
    batch, inner = clips(b=3, f=7), Recorder()
    refinements = [{"refiner_0": Refinement(f"r{i}", True)} for i in range(3)]
    scored = PerFrame(inner, frames=3, reduce=reduce)(batch, prompts(3), refinements)
    (shape, texts, refs), = inner.calls
    assert shape == (9, 3, 24, 24)
    assert texts == [t for t in ["prompt 0", "prompt 1", "prompt 2"] for _ in range(3)]
    assert refs == [r for r in refinements for _ in range(3)]
    frames = batch[:, [0, 3, 6]].mean((2, 3, 4))
    np.testing.assert_allclose(scored, frames.mean(1) if reduce == "mean" else frames.min(1), rtol=1e-6)
    strict = PerFrame(inner, frames=3, reduce=reduce).strict(batch, prompts(3), refinements)
    np.testing.assert_array_equal(strict, (frames > 0).all(1).astype(float))


def test_per_frame_refuses_images():
    with pytest.raises(ValueError, match=r"per_frame scores clips \(B, F, 3, H, W\)"):
        PerFrame(Recorder(), 2, "mean")(clips()[:, 0], prompts(3), [{}] * 3)


def test_a_builtin_per_frame_is_its_image_score_averaged_over_the_frames():
    batch = clips(b=2, f=5)
    term = TermConfig(fn="clip_score", model="tiny:clip", per_frame={"frames": 2})
    image = build_scorer(term, CPU)  # the image term itself, as a reward actor builds it
    per_frame = sample_scorer(term, image)
    expected = np.mean([image(batch[:, f], prompts(2), [{}] * 2) for f in (0, 4)], axis=0)
    np.testing.assert_allclose(per_frame(batch, prompts(2), [{}] * 2), expected, rtol=1e-5, atol=1e-6)
    assert isinstance(per_frame, PerFrame) and per_frame.strict(batch, prompts(2), [{}] * 2) is None
    assert sample_scorer(TermConfig(fn="clip_score"), image) is image


def test_a_pool_of_reward_actors_is_sent_the_chosen_frames_only():
    from cluster.reward_pool import PooledTerm
    from driver.config import ClusterConfig
    from cluster.runtime import InlineHandle

    class Actor:
        def __init__(self):
            self.inner = Recorder()

        def score(self, *args):
            return self.inner(*args)

        def ready(self):
            return 0
    actor = Actor()
    term = TermConfig(fn="clip_score", per_frame={"frames": 2, "reduce": "min"})
    pooled = sample_scorer(term, PooledTerm([InlineHandle(actor)], first=0, restarts=ClusterConfig(max_restarts=0),
                                            images_per_call=4))
    batch = clips(b=3, f=6)
    scored = pooled(batch, prompts(3), [{}] * 3)
    assert [shape for shape, _, _ in actor.inner.calls] == [(4, 3, 24, 24), (2, 3, 24, 24)]  # 6 frames, by 4
    np.testing.assert_allclose(scored, batch[:, [0, 5]].mean((2, 3, 4)).min(1), rtol=1e-6)


def test_temporal_consistency_is_the_mean_cosine_of_consecutive_clip_embeddings():
    scorer = build_scorer(TermConfig(fn="temporal_consistency", model="tiny:clip", batch_size=4), CPU)
    noise = clips(b=2, f=5, seed=1)
    still = np.repeat(noise[:, :1], 5, axis=1)
    batch = np.concatenate([still, noise])
    scores = scorer(batch, prompts(4), [{}] * 4)
    folder = local_model("tiny:clip")
    model, processor = CLIPModel.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)
    with torch.no_grad():
        from tasks.rewards.base import pil_images
        from tasks.rewards.clip import features
        pixels = processor(images=pil_images(batch.reshape(-1, 3, 24, 24)), return_tensors="pt")["pixel_values"]
        embeds = features(model.get_image_features(pixel_values=pixels)).reshape(4, 5, -1)
    expected = torch.nn.functional.cosine_similarity(embeds[:, 1:], embeds[:, :-1], dim=-1).mean(1).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores[:2], 1.0, atol=1e-5)  # a still clip: every frame the same
    assert (scores[2:] < scores[:2].min() - 1e-4).all(), scores  # independent noise frames
    with pytest.raises(ValueError, match="at least 2 frames"):
        scorer(batch[:, :1], prompts(4), [{}] * 4)


def test_a_users_clip_class_receives_clips_through_the_reward_set():
    term = TermConfig(fn="tasks.scorers:Motion", scale=2.0)
    assert term.takes() == "clips" and term.sample_problems("reward.terms.motion", 4) == []
    seen = []

    def plain(images, prompts, refinements):  # a function that does not say what it takes: what the task makes
        seen.append(np.asarray(images).shape)
        return np.zeros(len(prompts))
    batch = clips(b=3, f=4)
    batch[0] = batch[0, :1]  # a still clip
    terms, valid, _ = RewardSet({"motion": build_scorer(term, CPU), "plain": plain}, {}, 60.0)(batch, prompts(3),
                                                                                                [{}] * 3)
    assert seen == [(3, 4, 3, 24, 24)] and valid.all()
    np.testing.assert_allclose(terms["motion"], 2 * np.abs(np.diff(batch, axis=1)).mean((1, 2, 3, 4)), rtol=1e-6)
    assert terms["motion"][0] == 0 and (terms["motion"][1:] > 0.5).all()


@pytest.mark.parametrize("term, frames, named", [
    ({"fn": "clip_score"}, 4, ["reward.terms.t:", "per_frame: {frames: k, reduce: mean|min} with k in 1..4"]),
    ({"fn": "tasks.scorers:sharpness"}, 4, ["reward.terms.t:", "k in 1..4"]),
    ({"fn": "clip_score", "per_frame": {"frames": 5}}, 4, ["reward.terms.t.per_frame.frames=5", "valid values are 1..4"]),
    ({"fn": "clip_score", "per_frame": {"frames": 2}}, None, ["reward.terms.t.per_frame", "task.num_frames is not set"]),
    ({"fn": "temporal_consistency"}, None, ["reward.terms.t:", "scores clips"]),
    ({"fn": "temporal_consistency"}, 1, ["reward.terms.t:", "at least 2 frames"]),
    ({"fn": "temporal_consistency", "per_frame": {"frames": 2}}, 4, ["reward.terms.t.per_frame", "whole clips"]),
    ({"fn": "format", "per_frame": {"frames": 1}}, 4, ["reward.terms.t.per_frame", "scores text"]),
])
def test_terms_that_cannot_score_the_tasks_samples_are_named(term, frames, named):
    problems = TermConfig(**term).sample_problems("reward.terms.t", frames)
    assert len(problems) == 1 and all(n in problems[0] for n in named), problems


@pytest.mark.parametrize("term, frames", [({"fn": "clip_score", "per_frame": {"frames": 4, "reduce": "min"}}, 4),
                                          ({"fn": "tasks.scorers:Motion"}, 2), ({"fn": "temporal_consistency"}, 2),
                                          ({"fn": "format"}, 4), ({"fn": "clip_score"}, None),
                                          ({"fn": "tests.faulty_rewards:shapes_image"}, 4)])
def test_terms_that_fit_the_tasks_samples_pass(term, frames):
    assert TermConfig(**term).sample_problems("reward.terms.t", frames) == []


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(cli, "train", lambda *_: pytest.fail("training started for a bad config"))


@pytest.mark.parametrize("args, named", [
    (["--config", "shapes-video", "--set", "reward.terms.image={fn: shapes_image}"],
     "reward.terms.image: shapes_image scores images"),
    (["--config", "shapes-video", "--set", "reward.terms.image={fn: shapes_image, per_frame: {frames: 6}}"],
     "reward.terms.image.per_frame.frames=6: a clip has 4 frames (task.num_frames); valid values are 1..4"),
    (["--set", "reward.terms.image.per_frame={frames: 2, reduce: mean}"], "reward.terms.image.per_frame: the task"),
    (["--set", "reward.terms.image.per_frame={frames: 2, reduce: max}"], "reward.terms.image.per_frame.reduce"),
])
def test_a_video_reward_that_cannot_work_exits_2_before_anything_starts(args, named, no_training, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *args, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err
    assert not run_dir.exists()
