"""The reward of a batch: every term scored at once, and a term that raises, hangs or returns NaN
costs its samples, never the run or the weights.

`RewardSet` starts every term's batch call together (each on its own thread: a term scored by a
pool of reward actors waits on the network, one scored here computes), all under one deadline
that grows with the batch: `reward.timeout_s` + n x `reward.timeout_per_image_s` for n images (a
reward model's time is mostly per image; the fixed part covers a call's overhead and a slow first
call). A term whose batch call raises or times out is scored again sample by sample, each under
the deadline of one image, to find the culprits. Samples that any term failed on, or scored
non-finite, are marked invalid (their terms set to 0) and counted by kind and by term, with the
last error each term gave; the driver leaves invalid samples out of every advantage and metric.

One bad sample costs only itself, but a term that fails on every sample leaves nothing to learn
from: `FailingRewards` counts such steps in a row, and the driver stops the run after
`reward.max_failed_steps` of them, saying which term failed, on how many samples and why.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from common.loading import one_line

FAULTS = ("reward_error", "reward_timeout", "reward_nan")
LOG = logging.getLogger("jointrl.reward")


@dataclass
class TermFaults:
    """One term's samples scored and failed (raised, timed out or non-finite), and its last error."""
    scored: int = 0
    failed: int = 0
    error: str | None = None


@dataclass
class RewardFaults:
    """The reward faults of a batch (or of several, `add`ed): samples per kind (FAULTS) and, per
    term, the samples it scored and failed on, with its last error."""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    terms: dict[str, TermFaults] = field(default_factory=dict)

    def scored(self, term: str, n: int) -> None:
        self.terms.setdefault(term, TermFaults()).scored += n

    def failed(self, term: str, error: str, n: int = 1, kind: str | None = None) -> None:
        """`n` samples of `term` failed, `error` says why; counted as `kind` (a FAULTS name) if given."""
        if kind:
            self.counts[kind] += n
        faults = self.terms.setdefault(term, TermFaults())
        faults.failed, faults.error = faults.failed + n, error

    def add(self, other: "RewardFaults") -> None:
        for kind, n in other.counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + n
        for term, f in other.terms.items():
            mine = self.terms.setdefault(term, TermFaults())
            mine.scored, mine.failed = mine.scored + f.scored, mine.failed + f.failed
            mine.error = f.error or mine.error

    def failing(self) -> str:
        """Every term that failed, on how many samples, and its last error."""
        return "; ".join(f"reward.terms.{t} failed on {f.failed} of {f.scored} samples (last error: {f.error})"
                         for t, f in self.terms.items() if f.failed)


class FailingRewards:
    """Steps in a row in which the reward failed on every sample, so that no update could be made,
    and the faults of those steps; `limit` of them in a row (`reward.max_failed_steps`, 0: never)
    stop the run. A step with any valid sample starts the count again."""

    def __init__(self, limit: int):
        self.limit, self.steps, self.faults = limit, 0, RewardFaults()

    def observe(self, valid: np.ndarray, faults: RewardFaults) -> None:
        """A step's reward validity per sample (before any other drop) and its reward faults."""
        if valid.any():
            self.steps, self.faults = 0, RewardFaults()
        else:
            self.steps += 1
            self.faults.add(faults)

    @property
    def stop(self) -> bool:
        return bool(self.limit) and self.steps >= self.limit

    def __str__(self) -> str:
        return (f"the reward failed on every sample of {self.steps} steps in a row (reward.max_failed_steps="
                f"{self.limit}), so nothing could be learnt: {self.faults.failing() or 'no term said why'}")


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

    def one_by_one(self, images, prompts, refinements, faults: RewardFaults) -> tuple[np.ndarray, np.ndarray]:
        """(values, which samples scored) when the batch call failed: each sample on its own."""
        n = len(prompts)
        values, ok = np.zeros(n), np.ones(n, bool)
        first = None
        for i in range(n):
            try:
                future = self.submit(images[i:i + 1], prompts[i:i + 1], refinements[i:i + 1])
                values[i] = self.result(future, 1, time.monotonic() + self.seconds(1))[0]
            except FutureTimeout:
                ok[i], why = False, f"no answer within {self.seconds(1):g} s (reward.timeout_s + " \
                                    f"reward.timeout_per_image_s)"
                faults.failed(self.name, why, kind="reward_timeout")
                first = first or why
            except Exception as e:
                ok[i], why = False, one_line(e)
                faults.failed(self.name, why, kind="reward_error")
                first = first or why
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

    def __call__(self, images, prompts, refinements) -> tuple[dict[str, np.ndarray], np.ndarray, RewardFaults]:
        """(terms, valid per sample, faults) for a batch."""
        n = len(prompts)
        faults = RewardFaults()
        inputs = {t: (images, prompts, narrowed(refinements, self.owners.get(t))) for t in self.terms}
        deadline = time.monotonic() + self.seconds(n)
        futures = {t: g.submit(*inputs[t]) for t, g in self.terms.items()}
        terms, valid = {}, np.ones(n, bool)
        for t, guard in self.terms.items():
            faults.scored(t, n)
            try:
                terms[t] = guard.result(futures[t], n, deadline)
            except Exception:  # find the culprits sample by sample
                terms[t], ok = guard.one_by_one(*inputs[t], faults)
                valid &= ok
        bad = np.zeros(n, bool)  # valid until a term scored it non-finite: counted once, blamed on each such term
        for t, v in terms.items():
            if (nan := valid & ~np.isfinite(v)).any():
                faults.failed(t, f"scored {v[nan][0]} (not a finite number)", int(nan.sum()))
                bad |= nan
        faults.counts["reward_nan"] += int(bad.sum())
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
