"""Where a run's metrics and samples go besides RUN_DIR/metrics.jsonl: TensorBoard and Weights &
Biases when the config asks (`logging.*`), and sheets of sample images with their prompts every
`logging.images_every` steps (RUN_DIR/samples/step_N.png and .json, which `jointrl report` reads)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from driver.plots import caption, sample_sheet


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers (not the step, flags, texts or missing values)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trackers:
    def __init__(self, config, run_dir: Path, start_step: int = 0):
        self.run_dir, self.logging = Path(run_dir), config.logging
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
                rewards: list[float | None]) -> Path:
        """Images (B, H, W, 3) uint8 with what made them: a PNG sheet and its JSON, and the trackers."""
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        captions = [caption(p, r, w) for p, r, w in zip(prompts, refinements, rewards)]
        png = sample_sheet(images, captions, f"step {step}", folder / f"step_{step:06d}.png")
        np.save(folder / f"step_{step:06d}.npy", images)
        (folder / f"step_{step:06d}.json").write_text(json.dumps(
            {"step": step, "prompts": prompts, "refinements": refinements, "rewards": rewards}, indent=1))
        if self.tensorboard:
            self.tensorboard.add_images("samples", images, step, dataformats="NHWC")
            self.tensorboard.add_text("samples/prompts", "\n\n".join(c.replace("\n", "  \n") for c in captions), step)
        if self.wandb:
            import wandb
            self.wandb.log({"samples": [wandb.Image(im, caption=c) for im, c in zip(images, captions)]}, step=step)
        return png

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
