"""A reward that raises, hangs or returns NaN costs its samples, never the run or the weights.

`GuardedReward` calls the reward function on a batch under a timeout. If the batch call raises or
times out, each sample is scored on its own to find the culprits. Samples whose call failed, or
whose terms are not finite, are marked invalid (their terms set to 0) and counted by kind; the
driver leaves invalid samples out of every advantage and metric.
"""
from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

FAULTS = ("reward_error", "reward_timeout", "reward_nan")


def resolve(spec: str):
    """The callable `package.module:function` names."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"'{spec}' is not of the form package.module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import the reward '{spec}': {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"the reward '{spec}' is not callable")
    return fn


def reward_fn(config, task):
    """The run's reward: the plug-in `reward.fn` names, else the task's own."""
    return resolve(config.reward.fn) if config.reward.fn else task.reward


class GuardedReward:
    def __init__(self, fn, terms: list[str], timeout_s: float):
        self.fn, self.terms, self.timeout_s = fn, list(terms), timeout_s
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def _call(self, *args) -> dict:
        """One call under the timeout; a call that hangs is abandoned (its thread runs on)."""
        future = self.pool.submit(self.fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
            raise

    def __call__(self, images, prompts, refinements, owners) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
        """(terms, valid per sample, fault counts) for a batch."""
        n = len(prompts)
        faults = dict.fromkeys(FAULTS, 0)
        terms = {t: np.zeros(n) for t in self.terms}
        valid = np.ones(n, bool)
        try:
            self._take(terms, range(n), self._call(images, prompts, refinements, owners))
        except Exception:  # find the culprits sample by sample
            for i in range(n):
                try:
                    self._take(terms, [i], self._call(images[i:i + 1], prompts[i:i + 1], refinements[i:i + 1], owners))
                except FutureTimeout:
                    valid[i] = False
                    faults["reward_timeout"] += 1
                except Exception:
                    valid[i] = False
                    faults["reward_error"] += 1
        bad = valid & ~np.all([np.isfinite(v) for v in terms.values()], axis=0)
        faults["reward_nan"] += int(bad.sum())
        valid &= ~bad
        for v in terms.values():
            v[~valid] = 0.0
        return terms, valid, faults

    def _take(self, terms: dict, rows, scored: dict) -> None:
        missing = [t for t in self.terms if t not in scored]
        if missing:
            raise KeyError(f"the reward returned no term(s) {missing}")
        rows = list(rows)
        for t in self.terms:
            values = np.asarray(scored[t], dtype=np.float64).reshape(-1)
            if len(values) != len(rows):
                raise ValueError(f"the reward returned {len(values)} values of '{t}' for {len(rows)} samples")
            terms[t][rows] = values
