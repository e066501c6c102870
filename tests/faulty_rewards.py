"""Reward terms that misbehave, for the fault tests (`reward.terms.image.fn=tests.faulty_rewards:<name>`):
each is the shapes image term, except where it fails."""
import time

import numpy as np

from tasks.base import to_uint8
from tasks.shapes import image_checks


def shapes_image(images, prompts):
    return np.array([float(np.mean(image_checks(to_uint8(im), p))) for im, p in zip(images, prompts)])


def nan_on_counting(images, prompts, refinements):
    return np.where([p.metadata["tag"] == "counting" for p in prompts], np.nan, shapes_image(images, prompts))


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


NOT_CALLABLE = 3
