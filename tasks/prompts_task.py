"""`prompts` as a task: training and evaluation prompts from files or datasets (tasks/prompt_data.py).

Its reward is whatever `reward.terms` names (it has no default); its evaluation sets are
`task.eval`, each a source of its own, which must share no prompt with the training set.
"""
from __future__ import annotations

from tasks.prompt_data import DataPrompt, load_prompts, overlap


class PromptsTask:
    name = "prompts"

    def __init__(self, config):
        self.config = config

    def train_prompts(self) -> list[DataPrompt]:
        t = self.config.task
        return load_prompts(t.train, t.text_field, t.split)

    def eval_sets(self) -> dict[str, list[DataPrompt]]:
        t = self.config.task
        return {name: load_prompts(source, t.text_field, t.eval_split or t.split)
                for name, source in t.eval_sources().items()}

    def check(self) -> None:
        """Raise ValueError naming the evaluation prompts that are also training prompts."""
        train = self.train_prompts()
        for name, prompts in self.eval_sets().items():
            shared = overlap(train, prompts)
            if shared:
                shown = "; ".join(repr(p) for p in shared[:3]) + (" …" if len(shared) > 3 else "")
                raise ValueError(f"the set '{name}' shares {len(shared)} prompt(s) with task.train: {shown}")
