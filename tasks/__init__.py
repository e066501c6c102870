"""Tasks: where prompts, rewards and evaluation measures come from (`task.name`)."""
from __future__ import annotations


def build_task(config):
    """The task the config names."""
    from tasks.shapes_task import ShapesTask
    return {"shapes": ShapesTask}[config.task.name](config)
