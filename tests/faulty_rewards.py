"""Reward plug-ins that misbehave, for the fault tests (`reward.fn=tests.faulty_rewards:<name>`)."""
import time

import numpy as np

from tasks.reward import shapes_reward


def nan_on_counting(images, prompts, refinements, owners):
    terms = shapes_reward(images, prompts, refinements, owners)
    terms["image"] = np.where([p.metadata["tag"] == "counting" for p in prompts], np.nan, terms["image"])
    return terms


def raises_on_position(images, prompts, refinements, owners):
    if any(p.metadata["tag"] == "position" for p in prompts):
        raise RuntimeError("reward server said no")
    return shapes_reward(images, prompts, refinements, owners)


def hangs_on_two_objects(images, prompts, refinements, owners):
    if any(p.metadata["tag"] == "two_objects" for p in prompts):
        time.sleep(1.0)
    return shapes_reward(images, prompts, refinements, owners)


def always_inf(images, prompts, refinements, owners):
    terms = shapes_reward(images, prompts, refinements, owners)
    terms["image"] = np.full(len(prompts), np.inf)
    return terms


NOT_CALLABLE = 3
