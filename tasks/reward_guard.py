"""The reward of a batch: every term scored at once, and a term that raises, hangs or returns NaN
costs its samples, never the run or the weights.

`RewardSet` starts every term's batch call together (each on its own thread: a term scored by a
pool of reward actors waits on the network, one scored here computes), all under one deadline
that grows with the batch: `reward.timeout_s` + n x `reward.timeout_per_image_s` for n images (a
reward model's time is mostly per image; the fixed part covers a call's overhead and a slow first
call). A term whose batch call raises or times out is scored again sample by sample, each under
the deadline of one image, to find the culprits. Samples that any term failed on, or scored
non-finite, are marked invalid (their terms set to 0) and counted by kind; the driver leaves
invalid samples out of every advantage and metric.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import numpy as np

FAULTS = ("reward_error", "reward_timeout", "reward_nan")
LOG = logging.getLogger("jointrl.reward")


def narrowed(refinements: list[dict], owners: list[str] | None) -> list[dict]:
    """Each sample's refinements by the refiners that own a term (all of them where none does)."""
    if not owners:
        return refinements
    return [{e: r for e, r in refs.items() if e in owners} for refs in refinements]


class GuardedTerm:
    """One term's scorer behind a deadline (`seconds(n)` for n images); a call that hangs is
    abandoned (its thread runs on)."""

    def __init__(self, name: str, scorer: Callable, seconds: Callable[[int], float]):
        self.name, self.scorer, self.seconds = name, scorer, seconds
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{name}")

    def submit(self, images, prompts, refinements) -> Future:
        return self.pool.submit(self.scorer, images, prompts, refinements)

    def result(self, future: Future, n: int, deadline: float) -> np.ndarray:
        try:
            out = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{self.name}")
            raise
        if isinstance(out, dict):
            raise TypeError(f"the reward term '{self.name}' returned a dict; a term's function returns one "
                            f"value per sample")
        values = np.array(out, dtype=np.float64).reshape(-1)  # a copy: a pool's answer is read-only
        if len(values) != n:
            raise ValueError(f"the reward term '{self.name}' returned {len(values)} values for {n} samples")
        return values

    def one_by_one(self, images, prompts, refinements, faults: dict) -> tuple[np.ndarray, np.ndarray]:
        """(values, which samples scored) when the batch call failed: each sample on its own."""
        n = len(prompts)
        values, ok = np.zeros(n), np.ones(n, bool)
        first = None
        for i in range(n):
            try:
                future = self.submit(images[i:i + 1], prompts[i:i + 1], refinements[i:i + 1])
                values[i] = self.result(future, 1, time.monotonic() + self.seconds(1))[0]
            except FutureTimeout:
                ok[i], first = False, first or f"no answer within {self.seconds(1):g} s (reward.timeout_s + " \
                                               f"reward.timeout_per_image_s)"
                faults["reward_timeout"] += 1
            except Exception as e:
                ok[i], first = False, first or f"{type(e).__name__}: {e}"
                faults["reward_error"] += 1
        if first:  # the user sees why samples are dropped, not only that they are
            LOG.warning("reward term '%s' failed on %d of %d samples, e.g. %s", self.name, int((~ok).sum()), n, first)
        return values, ok


class RewardSet:
    def __init__(self, scorers: dict[str, Callable], owners: dict[str, list[str]], timeout_s: float,
                 timeout_per_image_s: float = 0.0):
        """`scorers`: term name -> its scorer (local, or a pool's caller); `owners`: term -> the
        refiners whose refinements it reads; a call of n images may take `timeout_s` +
        n x `timeout_per_image_s` seconds."""
        self.terms = {t: GuardedTerm(t, fn, self.seconds) for t, fn in scorers.items()}
        self.owners, self.timeout_s, self.timeout_per_image_s = owners, timeout_s, timeout_per_image_s

    def seconds(self, n: int) -> float:
        """The deadline of a reward call of `n` images."""
        return self.timeout_s + n * self.timeout_per_image_s

    def __call__(self, images, prompts, refinements) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
        """(terms, valid per sample, fault counts) for a batch."""
        n = len(prompts)
        faults = dict.fromkeys(FAULTS, 0)
        inputs = {t: (images, prompts, narrowed(refinements, self.owners.get(t))) for t in self.terms}
        deadline = time.monotonic() + self.seconds(n)
        futures = {t: g.submit(*inputs[t]) for t, g in self.terms.items()}
        terms, valid = {}, np.ones(n, bool)
        for t, guard in self.terms.items():
            try:
                terms[t] = guard.result(futures[t], n, deadline)
            except Exception:  # find the culprits sample by sample
                terms[t], ok = guard.one_by_one(*inputs[t], faults)
                valid &= ok
        bad = valid & ~np.all([np.isfinite(v) for v in terms.values()], axis=0) if terms else np.zeros(n, bool)
        faults["reward_nan"] += int(bad.sum())
        valid &= ~bad
        for v in terms.values():
            v[~valid] = 0.0
        return terms, valid, faults

    def strict(self, images, prompts, refinements) -> dict[str, np.ndarray]:
        """Per-sample 0/1 correctness of the terms whose scorer has one (GenEval's accuracy); a
        scorer's `strict` may also return None (a pool's caller, whose actors' scorer has none)."""
        out = {}
        for t, guard in self.terms.items():
            strict = getattr(guard.scorer, "strict", None)
            found = strict(images, prompts, narrowed(refinements, self.owners.get(t))) if strict else None
            if found is not None:
                out[t] = np.asarray(found, dtype=np.float64)
        return out
