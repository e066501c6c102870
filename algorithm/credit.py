"""Credit assignment: which advantage each expert learns from.

Every advantage is GRPO's group-relative one (arXiv 2402.03300, eq. 3, outcome supervision):
A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-4), clipped to +-`adv_clip`. Conventions: the
population std (no Bessel correction; TRL's is sqrt(G/(G-1)) larger), statistics per prompt group
(Flow-GRPO's per-prompt tracker, arXiv 2505.05470 sec. 4.1), over the samples an expert is
credited for only. `batch_std` divides by the std over every such sample of the step instead of
the group's (Flow-GRPO's `global_std`: a group whose samples barely differ is not blown up).

shared:      every expert uses the total reward's advantage over the whole group, as PromptRL
             trains its rewriter and its flow model from one reward (arXiv 2602.01382 sec. 3); the
             group's unrefined samples are the in-group baseline (PromptRL's prompt retention).
per_expert:  refiner k uses the advantage of the terms it owns, normalised over the group's samples
             that it refined; the generator uses the total, or the terms it owns if the config
             says (`experts.generator.owns`, e.g. [image]: text terms are not its doing).
             Where a generator's two transformers are two experts (Wan2.2-A14B's `generator_low`),
             both learn from this one generator advantage, in every mode: they made the sample
             together, each on its own steps.
counterfactual: refiner k uses the difference reward D_k = R - R(without y_k), where R(without y_k)
             is the same sample regenerated from the same noise with y_k dropped; normalised over
             the group's samples that have one. This is the difference reward of multi-agent credit
             assignment (Wolpert & Tumer 2001; COMA's counterfactual baseline, arXiv 1705.08926)
             with the default action "no refinement": it needs no hand-made decomposition of the
             reward, and the shared noise makes R and R(without y_k) differ only by y_k. The
             generator is credited as in per_expert.

normalize=per_term: each term is first standardised within its prompt group (over the valid
samples), z_t = (r_t - mean_g(r_t)) / (std_g(r_t) + 1e-4), and the weights apply to z_t: a term on
a large scale (PickScore's ~20) no longer drowns one on [0, 1], and a term with no spread in a
group adds nothing to it (GRPO's eq. 3 normalisation applied to each reward before they are summed).
Counterfactual
totals are standardised with the group's statistics of the real samples, so D_k = sum_t w_t
(r_t - r_t(without y_k)) / (std_g(r_t) + 1e-4).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np



class Scale(NamedTuple):
    """Per sample, the mean and std of a term over its prompt group (per_term normalisation)."""
    mean: np.ndarray
    std: np.ndarray


def total_reward(terms: dict[str, np.ndarray], weights: dict[str, float],
                 scales: dict[str, Scale] | None = None) -> np.ndarray:
    """The scalar reward: the weighted sum of the named terms, each standardised by `scales` if given."""
    if scales is None:
        return sum(w * terms[t] for t, w in weights.items())
    return sum(w * (terms[t] - scales[t].mean) / (scales[t].std + 1e-4) for t, w in weights.items())


def term_scales(terms: dict[str, np.ndarray], groups: np.ndarray, include: np.ndarray) -> dict[str, Scale]:
    """Each term's group mean and std over `include`, spread to the group's samples."""
    out = {}
    for t, values in terms.items():
        mean, std = np.zeros(len(values)), np.zeros(len(values))
        for g in np.unique(groups):
            sel = (groups == g) & include
            if sel.any():
                mean[groups == g], std[groups == g] = values[sel].mean(), values[sel].std()
        out[t] = Scale(mean, std)
    return out


def group_normalise(values: np.ndarray, groups: np.ndarray, include: np.ndarray, clip: float,
                    *, batch_std: bool = False) -> np.ndarray:
    """A = clip((R - mean) / (std + 1e-4), +-clip) within each group over `include` (GRPO eq. 3's
    normalised outcome reward), the std the whole batch's over `include` if `batch_std`; 0 elsewhere."""
    adv = np.zeros_like(values, dtype=np.float64)
    overall = values[include].std() if batch_std and include.any() else None
    for g in np.unique(groups):
        sel = (groups == g) & include
        if sel.any():
            r = values[sel]
            std = r.std() if overall is None else overall
            adv[sel] = np.clip((r - r.mean()) / (std + 1e-4), -clip, clip)
    return adv


class Advantages(NamedTuple):
    """Per sample, the generator's advantage and each refiner's (nonzero only where it refined)."""
    generator: np.ndarray
    refiners: dict[str, np.ndarray]


def advantages(*, mode: str, terms: dict[str, np.ndarray], weights: dict[str, float], groups: np.ndarray,
               refined: np.ndarray, owns: dict[str, list[str]], clip: float,
               counterfactual: dict[str, dict[str, np.ndarray]] | None = None, valid: np.ndarray | None = None,
               generator_terms: list[str] | None = None, per_term: bool = False,
               batch_std: bool = False) -> Advantages:
    """Every expert's advantage of every sample. `owns` maps each refiner to the terms it is
    credited with, `generator_terms` the generator's (None: the total); `counterfactual` holds,
    per refiner, the terms of its counterfactual samples (NaN where not drawn). Samples not `valid`
    (their reward failed) get 0 and are left out of every group's statistics; `per_term`
    standardises each term within its group before weighting; `batch_std` as in `group_normalise`."""
    normalise = functools.partial(group_normalise, clip=clip, batch_std=batch_std)
    everyone = np.ones_like(refined, dtype=bool) if valid is None else np.asarray(valid, bool)
    refined = refined & everyone
    scales = term_scales(terms, groups, everyone) if per_term else None
    total = total_reward(terms, weights, scales)
    shared = normalise(total, groups, everyone)
    generator = shared
    if generator_terms and mode != "shared":
        generator = normalise(total_reward(terms, {t: weights[t] for t in generator_terms}, scales), groups, everyone)
    refiners = {}
    for eid, owned in owns.items():
        if mode == "shared":
            refiners[eid] = np.where(refined, shared, 0.0)
        elif mode == "per_expert":
            own = total_reward(terms, {t: weights[t] for t in owned}, scales)
            refiners[eid] = normalise(own, groups, refined)
        elif mode == "counterfactual":
            without = total_reward(counterfactual[eid], weights, scales)
            drawn = refined & ~np.isnan(without)
            refiners[eid] = normalise(np.where(drawn, total - np.nan_to_num(without), 0.0), groups, drawn)
        else:
            raise ValueError(f"credit mode {mode!r} is not implemented")
    return Advantages(generator, refiners)
