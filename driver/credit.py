"""Credit assignment: which advantage each expert learns from (SPEC §2, step 5).

shared:      every expert uses the total reward's advantage over the whole group (skip samples are
             the in-group baseline, as PromptRL's retention).
per_expert:  refiner k uses the advantage of the terms it owns, normalised over the group's samples
             that it refined; the generator uses the total, or the terms it owns if the config
             says (`experts.generator.owns`, e.g. [image]: text terms are not its doing).
counterfactual: refiner k uses the difference reward D_k = R - R(without y_k), where R(without y_k)
             is the same sample regenerated from the same noise with y_k dropped; normalised over
             the group's samples that have one. No hand-made decomposition of the reward is needed;
             the generator is credited as in per_expert.
"""
from __future__ import annotations

import numpy as np

from tasks.reward import total_reward


def group_normalise(values: np.ndarray, groups: np.ndarray, include: np.ndarray, clip: float) -> np.ndarray:
    """A = clip((R - mean) / (std + 1e-4), +-clip) within each group over `include`; 0 elsewhere."""
    adv = np.zeros_like(values, dtype=np.float64)
    for g in np.unique(groups):
        sel = (groups == g) & include
        if sel.any():
            r = values[sel]
            adv[sel] = np.clip((r - r.mean()) / (r.std() + 1e-4), -clip, clip)
    return adv


def advantages(mode: str, terms: dict[str, np.ndarray], weights: dict[str, float], groups: np.ndarray,
               refined: np.ndarray, owns: dict[str, list[str]], clip: float,
               counterfactual: dict[str, np.ndarray] | None = None,
               valid: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per expert, an advantage for every sample (refiners: nonzero only where they refined).
    `owns` maps each refiner, and optionally the generator, to the terms it is credited with;
    samples not `valid` (their reward failed) get 0 and are left out of every group's statistics."""
    everyone = np.ones_like(refined, dtype=bool) if valid is None else np.asarray(valid, bool)
    refined = refined & everyone
    total = total_reward(terms, weights)
    shared = group_normalise(total, groups, everyone, clip)
    owns = dict(owns)
    generator_terms = owns.pop("generator", None)
    out = {"generator": shared}
    if generator_terms and mode != "shared":
        own = total_reward(terms, {t: weights[t] for t in generator_terms})
        out["generator"] = group_normalise(own, groups, everyone, clip)
    for eid, owned in owns.items():
        if mode == "shared":
            out[eid] = np.where(refined, shared, 0.0)
        elif mode == "per_expert":
            own = total_reward(terms, {t: weights[t] for t in owned})
            out[eid] = group_normalise(own, groups, refined, clip)
        elif mode == "counterfactual":
            without = counterfactual[eid]
            drawn = refined & ~np.isnan(without)
            out[eid] = group_normalise(np.where(drawn, total - np.nan_to_num(without), 0.0), groups, drawn, clip)
        else:
            raise ValueError(f"credit mode {mode!r} is not implemented")
    return out
