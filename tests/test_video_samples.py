"""Seeing videos: a video task's samples (clips) written as animations wherever images are written as
pictures: grids, captioned sheets (logging, `jointrl report`, `jointrl eval`), `jointrl sample`,
TensorBoard and W&B. Synthetic clips whose every frame is one known colour per tile, so that each
frame of what is written can be checked."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from driver import images as pictures
from driver.config import resolve_config
from driver.images import grid, write_clip
from tasks.base import TextPrompt, to_uint8

F, SIZE = 5, 16


def colours(b: int) -> np.ndarray:
    """(b, F, 3) distinct colours in [-1, 1]: tile i's frame f is one of them."""
    values = np.random.default_rng(3).permutation(np.arange(b * F) * 8 + 16)[:b * F].reshape(b, F)
    return np.stack([values, 255 - values, (values * 3) % 256], -1) / 127.5 - 1


def solid_clips(b: int = 3) -> np.ndarray:
    """(b, F, 3, SIZE, SIZE) in [-1, 1], every frame one colour."""
    return np.broadcast_to(colours(b)[..., None, None], (b, F, 3, SIZE, SIZE)).astype(np.float32).copy()


def gif_frames(path: Path) -> np.ndarray:
    gif = Image.open(path)
    frames = []
    for k in range(gif.n_frames):
        gif.seek(k)
        frames.append(np.asarray(gif.convert("RGB")))
    return np.stack(frames)


def assert_plays(frames: np.ndarray, clip_uint8: np.ndarray, y: int, x: int) -> None:
    """The pixel (y, x) of the written frames shows `clip_uint8`'s colours (F, 3), frame by frame (GIF's
    palette costs a few levels)."""
    assert len(frames) == len(clip_uint8)
    assert np.abs(frames[:, y, x].astype(int) - clip_uint8.astype(int)).max() <= 8, (frames[:, y, x], clip_uint8)


def test_a_grid_of_clips_is_a_clip_of_grids():
    clips = solid_clips(3)
    played = grid(clips, cols=2)
    assert played.shape == (F, *grid(clips[:, 0], cols=2).shape)
    for f in range(F):
        np.testing.assert_array_equal(played[f], grid(clips[:, f], cols=2))


@pytest.mark.parametrize("mp4", [False, True])
def test_a_clip_is_a_gif_of_its_frames_and_an_mp4_when_imageio_is_there(mp4, tmp_path, monkeypatch):
    if mp4 and not pictures.can_write_mp4():
        pytest.skip("imageio[ffmpeg] is not installed (`pip install 'jointrl[video]'`)")
    monkeypatch.setattr(pictures, "can_write_mp4", lambda: mp4)
    clip = to_uint8(solid_clips(1)[0])  # (F, SIZE, SIZE, 3)
    written = write_clip(tmp_path / "clip.png", clip, fps=4)
    assert [p.name for p in written] == ["clip.gif", *(["clip.mp4"] if mp4 else [])]
    frames = gif_frames(written[0])
    assert frames.shape == (F, SIZE, SIZE, 3) and Image.open(written[0]).info["duration"] == 250
    assert_plays(frames, clip[:, 0, 0], 8, 8)
    if mp4:
        import imageio.v3 as iio
        video = iio.imread(written[1])
        assert video.shape == (F, 16, 16, 3)
        assert np.abs(video[:, 8, 8].astype(int) - clip[:, 0, 0]).max() <= 12


def test_a_sample_sheet_of_clips_is_animated_with_its_captions(tmp_path):
    from driver.plots import sample_sheet
    clips = to_uint8(solid_clips(3))
    still = sample_sheet(clips[:, 0], ["prompt: a"] * 3, "t", tmp_path / "still.png", cols=2)
    sheet = sample_sheet(clips, ["prompt: a", "prompt: b\nrefiner_0: moving left", "prompt: c"], "t",
                         tmp_path / "sheet.png", cols=2, fps=8)
    assert sheet == tmp_path / "sheet.gif"
    frames = gif_frames(sheet)
    assert frames.shape[1:3] == np.asarray(Image.open(still)).shape[:2]
    first = np.asarray(Image.open(still).convert("RGB"))
    # where the still sheet shows tile 0's first frame in its colour, the animated one plays tile 0's clip
    ys, xs = np.nonzero((np.abs(first.astype(int) - clips[0, 0, 0, 0]).sum(-1) <= 3))
    assert len(ys) > 100
    assert_plays(frames, clips[0, :, 0, 0], ys[len(ys) // 2], xs[len(xs) // 2])


def logging_config(tmp_path, *extra):
    """What the writers read of a config (the clips alone make them write animations)."""
    return resolve_config("shapes", ["logging.tensorboard=true", "logging.fps=4", "trainer.run_name=video", *extra])


def test_logged_clips_reach_the_sheet_tensorboard_wandb_and_the_report(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from driver.commands.report import report
    from driver.trackers import Trackers
    clips = to_uint8(solid_clips(3))
    trackers = Trackers(logging_config(tmp_path, "logging.wandb=true"), tmp_path)
    sheet = trackers.samples(4, clips, ["a red circle", "a blue square", "two circles"],
                             [{"refiner_0": "moving left"}, {}, {"refiner_0": ""}], rewards=[0.5, None, 1.0])
    trackers.close()
    assert sheet == tmp_path / "samples" / "step_000004.gif" and len(gif_frames(sheet)) == F
    assert json.loads((tmp_path / "samples" / "step_000004.json").read_text())["fps"] == 4
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0}).Reload()
    (logged,) = events.Images("samples")
    played = gif_frames(__import__("io").BytesIO(logged.encoded_image_string))
    assert logged.step == 4 and played.shape == (F, logged.height, logged.width, 3)
    np.testing.assert_array_equal(played.shape[1:], grid(solid_clips(3), cols=3, scale=1).shape[1:])
    assert_plays(played, clips[1, :, 0, 0], 2 + SIZE // 2, 2 + SIZE + 2 + SIZE // 2)  # tile 1, as tiled
    videos = list((tmp_path / "wandb").glob("offline-run-*/files/media/videos/**/*.gif"))
    assert len(videos) == 3 and all(len(gif_frames(v)) == F for v in videos), videos
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "reward/total": 0.75}) + "\n")
    written, missing = report(tmp_path, lambda: pytest.fail("the logged samples are drawn again"))
    assert missing is None and tmp_path / "report" / "samples.gif" in written
    assert len(gif_frames(tmp_path / "report" / "samples.gif")) == F


def test_eval_writes_animated_grids_and_sheets_of_clips(tmp_path):
    from driver.commands.evaluate import write_samples
    prompts = [TextPrompt(f"p{i}", {"tag": tag}) for i, tag in enumerate(["a", "a", "b"])]
    result = {"images": solid_clips(3), "refinements": [{}, {"refiner_0": "x"}, {}],
              "terms": {"image": np.array([0.1, 0.2, 0.3])}, "valid": np.array([True, False, True])}
    write_samples(tmp_path, logging_config(tmp_path), prompts, result, weights={"image": 1.0})
    samples = gif_frames(tmp_path / "eval_samples.gif")
    np.testing.assert_array_equal(samples.shape[1:], grid(solid_clips(4), cols=2)[0].shape)  # a row per tag
    assert_plays(samples, to_uint8(solid_clips(3))[2, :, 0, 0], samples.shape[1] - 10, 10)  # row b, tile 0
    assert len(gif_frames(tmp_path / "eval_sheet.gif")) == F
    assert not list(tmp_path.glob("*.png"))


def test_sample_writes_an_animated_grid_of_clips(tmp_path, monkeypatch):
    from driver import checkpoint
    from driver.commands.sample import sample_run

    class Drawn:
        def draw(self, prompts, refine, tag, first=0):
            return {"images": solid_clips(len(prompts)), "refinements": [{"refiner_0": "big"}] * len(prompts)}
    monkeypatch.setattr(checkpoint, "pipeline_at", lambda run_dir, config: (tmp_path / "step_000001", Drawn()))
    drawn = sample_run(tmp_path, logging_config(tmp_path), "a red circle", n=2, out=tmp_path / "out.png")
    assert drawn["files"][0] == tmp_path / "out.gif" and drawn["files"][1:] == (
        [tmp_path / "out.mp4"] if pictures.can_write_mp4() else [])
    frames = gif_frames(tmp_path / "out.gif")
    np.testing.assert_array_equal(frames.shape, grid(solid_clips(2), cols=2).shape)
    assert_plays(frames, to_uint8(solid_clips(2))[1, :, 0, 0], 10, frames.shape[2] - 10)


def test_a_rollout_and_an_evaluation_of_clips_score_per_frame_and_write_animations(tmp_path):
    """The rollout pipeline with the tiny models, its decoder made to return clips (each image
    sliding one pixel a frame): the per-frame reward, the logged clips and the eval sheets."""
    import torch

    from algorithm.batch import Sample
    from driver.commands.evaluate import write_samples
    from driver.trackers import Trackers
    from experts.pipeline import RolloutPipeline
    from tasks.rewards.term import build_scorer
    from tasks.shapes import prompt_set
    config = resolve_config("shapes-tiny", ["reward.terms.image.per_frame={frames: 2, reduce: min}",
                                            "logging.images_every=1", "logging.images_per_log=3"])
    pipeline = RolloutPipeline(config)
    decode, decoded = pipeline.frontend.decode, []

    def clips_of(latents):
        images = decode(latents)
        decoded.append(torch.stack([images.roll(f, dims=-1) for f in range(F)], 1))
        return decoded[-1]
    pipeline.frontend.decode = clips_of
    prompts = prompt_set(2, seed=0)
    samples = [Sample(g * 2 + k, g, prompts[g], k == 0) for g in range(2) for k in range(2)]
    meta = pipeline.run(0, samples).meta
    clips = decoded[-1].numpy()
    side = config.task.image_size
    assert clips.shape == (4, F, 3, side, side) and meta.images.shape == (3, F, side, side, 3)
    np.testing.assert_array_equal(meta.images, to_uint8(clips[:3]))
    image = build_scorer(config.reward.terms["image"], torch.device("cpu"))
    by_frame = [image(clips[:, f], prompts=[s.prompt for s in samples], refinements=[{}] * 4) for f in (0, F - 1)]
    np.testing.assert_allclose(meta.terms["image"], np.minimum(*by_frame))
    sheet = Trackers(config, tmp_path).samples(0, meta.images, [s.prompt.text for s in samples[:3]],
                                               meta.refinements[:3], rewards=[0.1, 0.2, None])
    assert len(gif_frames(sheet)) == F
    held = prompt_set(3, seed=1)
    result = pipeline.evaluate(held, refine=True)
    assert result["images"].shape == (3, F, 3, side, side)
    write_samples(tmp_path, config, held, result, weights=config.reward.weights)
    assert len(gif_frames(tmp_path / "eval_sheet.gif")) == F and len(gif_frames(tmp_path / "eval_samples.gif")) == F
