"""Tasks: where prompts, rewards and evaluation sets come from (`task.name`)."""
from __future__ import annotations

SHAPES_TERMS = {"image": {"fn": "shapes_image", "weight": 1.0}, "fidelity": {"fn": "shapes_fidelity", "weight": 0.5},
                "style": {"fn": "shapes_style", "weight": 0.5}, "format": {"fn": "shapes_format", "weight": 0.5}}


def build_task(config):
    """The task the config names."""
    if config.task.name == "prompts":
        from tasks.prompts_task import PromptsTask
        return PromptsTask(config)
    from tasks.shapes_task import ShapesTask
    return ShapesTask(config)


def default_terms(task_name: str) -> dict[str, dict]:
    """The reward terms a task is scored with when `reward.terms` is not set."""
    if task_name == "shapes":
        return {name: dict(term) for name, term in SHAPES_TERMS.items()}
    raise ValueError(f"task.name={task_name} has no default reward: set reward.terms, e.g. "
                     f"reward.terms={{geneval: {{fn: geneval, weight: 1.0}}}}")
