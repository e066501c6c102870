"""Where a run's metrics and samples go besides RUN_DIR/metrics.jsonl: TensorBoard and Weights &
Biases when the config asks (`logging.*`), and sheets of sample images with their prompts every
`logging.images_every` steps (RUN_DIR/samples/step_N.png and .json, which `jointrl report` reads).

A video task's samples are clips: its sheets are animated (step_N.gif, and .mp4 where imageio[ffmpeg]
is installed), TensorBoard receives the clips' grid as an animated GIF image (what `add_video`
writes, encoded here with Pillow: torch's `add_video` needs moviepy's 1.x `moviepy.editor`) and W&B
each clip as a `wandb.Video` of that GIF (from an array W&B would need moviepy too)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from driver.images import gif_bytes, tiled
from driver.plots import caption, sample_sheet


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers (not the step, flags, texts or missing values)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trackers:
    def __init__(self, config, run_dir: Path, start_step: int = 0):
        self.run_dir, self.logging, self.fps = Path(run_dir), config.logging, config.logging.fps
        self.tensorboard = self.wandb = None
        if self.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # a resumed run drops the events the stopped run wrote after its checkpoint
            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step or None)
        if self.logging.wandb:
            import wandb
            self.wandb = wandb.init(project=self.logging.wandb_project, name=config.trainer.run_name,
                                    id=config.trainer.run_name, resume="allow", dir=str(self.run_dir),
                                    mode=self.logging.wandb_mode, config=config.model_dump())

    def log(self, row: dict) -> None:
        values = scalars(row)
        if self.tensorboard:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, row["step"])
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(values, step=row["step"])

    def samples(self, step: int, images: np.ndarray, prompts: list[str], refinements: list[dict[str, str]],
                *, rewards: list[float | None]) -> Path:
        """Images (B, H, W, 3) or clips (B, F, H, W, 3) uint8 with what made them: a sheet (PNG, or
        animated) and its JSON, and the trackers; returns the sheet."""
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        clips = np.asarray(images).ndim == 5
        captions = [caption(p, r, w) for p, r, w in zip(prompts, refinements, rewards)]
        sheet = sample_sheet(images, captions, f"step {step}", folder / f"step_{step:06d}.png", fps=self.fps)
        np.save(folder / f"step_{step:06d}.npy", images)
        (folder / f"step_{step:06d}.json").write_text(json.dumps(
            {"step": step, "prompts": prompts, "refinements": refinements, "rewards": rewards, "fps": self.fps},
            indent=1))
        if self.tensorboard:
            if clips:
                self.animated_image("samples", images, step)
            else:
                self.tensorboard.add_images("samples", images, step, dataformats="NHWC")
            self.tensorboard.add_text("samples/prompts", "\n\n".join(c.replace("\n", "  \n") for c in captions), step)
        if self.wandb:
            import wandb
            self.wandb.log({"samples": [wandb.Video(io.BytesIO(gif_bytes(clip, self.fps)), caption=c, format="gif")
                                        if clips else wandb.Image(clip, caption=c)
                                        for clip, c in zip(images, captions)]}, step=step)
        return sheet

    def animated_image(self, tag: str, clips: np.ndarray, step: int) -> None:
        """Clips (B, F, H, W, 3) uint8 as one TensorBoard image, their grid as an animated GIF (as
        `add_video` logs a video; TensorBoard's image tab plays it)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        frames = tiled(clips, cols=min(len(clips), 8), scale=1)
        image = Summary.Image(height=frames.shape[1], width=frames.shape[2], colorspace=3,
                              encoded_image_string=gif_bytes(frames, self.fps))
        # the writer every add_* call goes through (SummaryWriter has no public call for an encoded image)
        self.tensorboard._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
