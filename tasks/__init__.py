"""Tasks: where prompts, rewards and evaluation sets come from (`task.name`)."""
from __future__ import annotations

from tasks.base import Vocabulary

SHAPES_TERMS = {"image": {"fn": "shapes_image", "weight": 1.0}, "fidelity": {"fn": "shapes_fidelity", "weight": 0.5},
                "style": {"fn": "shapes_style", "weight": 0.5}, "format": {"fn": "shapes_format", "weight": 0.5}}
VIDEO_TERMS = {"video": {"fn": "shapes_video", "weight": 1.0},
               **{name: term for name, term in SHAPES_TERMS.items() if name != "image"}}


def build_task(config):
    """The task the config names."""
    if config.task.name == "prompts":
        from tasks.prompts_task import PromptsTask
        return PromptsTask(config)
    if config.task.name == "shapes_video":
        from tasks.shapes_task import ShapesVideoTask
        return ShapesVideoTask(config)
    from tasks.shapes_task import ShapesTask
    return ShapesTask(config)


def default_terms(task_name: str) -> dict[str, dict]:
    """The reward terms a task is scored with when `reward.terms` is not set."""
    if task_name in ("shapes", "shapes_video"):
        return {name: dict(term) for name, term in (SHAPES_TERMS if task_name == "shapes" else VIDEO_TERMS).items()}
    raise ValueError(f"task.name={task_name} has no default reward: set reward.terms, e.g. "
                     f"reward.terms={{geneval: {{fn: geneval, weight: 1.0}}}}")


def text_vocabulary(task) -> Vocabulary:
    """The words the tiny text encoder reads for the task config `task`: the shapes
    world's, then under `shapes_video` its motion words, and with `task.rare_wording` the rare
    synonyms (after them: the shapes words keep their ids)."""
    if task.name == "shapes_video":
        from tasks.shapes_video import VIDEO_VOCABULARY
        return VIDEO_VOCABULARY
    return refiner_vocabulary(task)


def refiner_vocabulary(task) -> Vocabulary:
    """The words the tiny refiner LM reads and writes for the task config `task`: the shapes world's
    (under `shapes_video` too: a refinement adds detail, not motion), with the rare synonyms under
    `task.rare_wording`."""
    from tasks.shapes import RARE_VOCABULARY, SHAPES_VOCABULARY
    return RARE_VOCABULARY if task.rare_wording else SHAPES_VOCABULARY
