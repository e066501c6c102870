"""Reward terms that misbehave, for the fault tests (`reward.terms.image.fn=tests.faulty_rewards:<name>`):
each is the shapes image term, except where it fails."""
import time
from pathlib import Path

import numpy as np

from experts.spec import Strict
from tasks.base import to_uint8
from tasks.shapes import image_checks


def shapes_image(images, prompts):
    return np.array([float(np.mean(image_checks(to_uint8(im), p))) for im, p in zip(images, prompts)])


def nan_on_counting(images, prompts, refinements):
    return np.where([p.metadata["tag"] == "counting" for p in prompts], np.nan, shapes_image(images, prompts))


def nan_unrefined(images, prompts, refinements):
    """NaN for every sample drawn from the original prompt (algorithm.num_skip_refinement of each group)."""
    return np.where([not refs for refs in refinements], np.nan, shapes_image(images, prompts))


def raises_on_position(images, prompts, refinements):
    if any(p.metadata["tag"] == "position" for p in prompts):
        raise RuntimeError("reward server said no")
    return shapes_image(images, prompts)


def hangs_on_two_objects(images, prompts, refinements):
    if any(p.metadata["tag"] == "two_objects" for p in prompts):
        time.sleep(1.0)
    return shapes_image(images, prompts)


def always_inf(images, prompts, refinements):
    return np.full(len(prompts), np.inf)


def always_raises(images, prompts, refinements):
    raise RuntimeError("reward server said no")


class FailsAfter:
    """The shapes image term for its first `calls` calls (one a step per rollout worker), then a
    RuntimeError on every call: a reward that breaks mid-run."""

    class Options(Strict):
        calls: int

    def __init__(self, options, device):
        self.options, self.made = options, 0

    def __call__(self, images, prompts, refinements):
        self.made += 1
        if self.made > self.options.calls:
            raise RuntimeError(f"reward server gone after {self.options.calls} calls")
        return shapes_image(images, prompts)


NOT_CALLABLE = 3


class Slow:
    """The shapes image term, taking `seconds` per call; it touches the file `started` as a call
    begins, so a test knows a rollout is in its reward phase."""

    class Options(Strict):
        started: str
        seconds: float = 2.0

    def __init__(self, options, device):
        self.options = options

    def __call__(self, images, prompts, refinements):
        Path(self.options.started).touch()
        time.sleep(self.options.seconds)
        return shapes_image(images, prompts)


def from_environment(images, prompts, refinements):
    """JOINTRL_TERM_SCORE (a term's runtime_env sets it) for every sample, and HF_HUB_OFFLINE (every
    actor is given the client's) beside it: 10 x score + 1 where it is "1"."""
    import os
    value = float(os.environ["JOINTRL_TERM_SCORE"]) * 10 + (os.environ.get("HF_HUB_OFFLINE") == "1")
    return np.full(len(prompts), value)
