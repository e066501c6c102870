"""`RolloutPipeline`: refine -> compose -> encode -> generate -> decode -> reward -> counterfactual,
for a batch of samples, with inference copies of every expert and the generator's frozen front end
(text encoding, latent space, decoding: experts/frontend.py). Where Wan2.2-A14B's two transformers
are two experts (`experts.generator_low`), the generator's copy and generator_low's are joined into
one velocity, each denoising its side of the boundary with the version delivered to it.

`run` returns a rollout's outputs as three parts: small metadata for the driver, the generator's
trajectories (experts/trajectories.py) and each refiner's token batch; the last two go to the
experts that learn from them. A worker's share goes through in chunks of `rollout.batch_size`
samples, each chunk's outputs on the host before the next starts, so that the device holds one
chunk's activations, latents and images whatever the share. Every draw is seeded by (trainer.seed,
step, sample), so a rollout is a pure function of the step, its samples and the weights: the same
sample comes out the same in any batch or chunk, on any worker.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from algorithm.batch import Sample
from algorithm.losses import kept_states, trained_steps
from algorithm.sde import sample, sde_steps
from algorithm.similarity import SimilaritySums, group_sums, signatures
from common.seeding import generator
from experts.frontend import build_frontend
from experts.generator import LOW_NOISE
from experts.kinds import build_model
from experts.trajectories import split_shared, trajectories
from experts.weights import load
from tasks import build_task
from tasks.base import Refinement, to_uint8
from tasks.reward_guard import RewardFaults, RewardSet
from tasks.rewards.term import build_scorer, sample_scorer


@dataclass
class RolloutMeta:
    """What the driver reads of a rollout: per sample its reward terms, whether they are valid (the
    reward neither failed nor gave NaN), the version vector it was made with, its counterfactual
    reward terms per refiner (NaN where not drawn) and refinements; for the batch its reward faults,
    per prompt group the sums its samples' similarity is merged from (algorithm/similarity.py: the
    images stay where they were made), the text cache's hits and misses, the seconds it took, and,
    when they are logged, the images (uint8) of the step's first `logging.images_per_log` samples
    only (clips are large: 81 frames of 480 x 832 are 97 MB)."""
    samples: list[int]
    terms: dict[str, np.ndarray]
    valid: np.ndarray
    versions: list[dict]
    counterfactual: dict[str, dict[str, np.ndarray]]
    refinements: list[dict[str, str]]
    faults: RewardFaults
    similarity: SimilaritySums
    cache_hits: int
    cache_misses: int
    busy_s: float
    images: np.ndarray | None = None

    @staticmethod
    def join(metas: list["RolloutMeta"]) -> "RolloutMeta":
        """Several shards' metadata as one, in shard order (busy_s: the slowest shard's)."""
        def joined(field: str) -> list:
            return [x for m in metas for x in getattr(m, field)]

        def arrays(field: str) -> dict[str, np.ndarray]:
            return {k: np.concatenate([getattr(m, field)[k] for m in metas]) for k in getattr(metas[0], field)}

        def nested(field: str) -> dict[str, dict[str, np.ndarray]]:
            return {e: {t: np.concatenate([getattr(m, field)[e][t] for m in metas]) for t in terms}
                    for e, terms in getattr(metas[0], field).items()}
        faults = RewardFaults()
        for m in metas:
            faults.add(m.faults)
        return RolloutMeta(joined("samples"), arrays("terms"), np.concatenate([m.valid for m in metas]),
                           joined("versions"), nested("counterfactual"), joined("refinements"), faults,
                           SimilaritySums.join([m.similarity for m in metas]),
                           sum(m.cache_hits for m in metas), sum(m.cache_misses for m in metas),
                           max(m.busy_s for m in metas),
                           None if metas[0].images is None else np.concatenate([m.images for m in metas]))


class RolloutOutputs(NamedTuple):
    """A rollout's outputs: its metadata, the generator's trajectories (a Trajectories) and
    {refiner id: its token batch}. The driver holds them as ObjectRefs."""
    meta: Any
    trajectories: Any
    tokens: dict[str, Any]


class Chunk(NamedTuple):
    """One chunk of a rollout, on the host: its metadata (the whole rollout's cache counts and time
    are filled in once joined), the generator's kept states (B, S, *latent), log-probs,
    conditioning per sample and the one row every sample shares, and each refiner's token batch."""
    meta: RolloutMeta
    states: torch.Tensor
    logps: torch.Tensor
    cond: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]
    tokens: dict[str, dict]


def as_text(refinements: list[dict[str, Refinement]]) -> list[dict[str, str]]:
    return [{e: r.text for e, r in refs.items()} for refs in refinements]


def joined_tokens(parts: list[dict]) -> dict:
    """One refiner's token batches of several chunks as one (a chunk without a refined sample
    holds no tokens)."""
    drawn = [p for p in parts if len(p["prompts"])]
    if not drawn:
        return {"prompts": []}
    return {"prompts": [x for p in drawn for x in p["prompts"]],
            **{k: np.concatenate([p[k] for p in drawn]) for k in ("tokens", "logps", "mask")}}


def joined_results(parts: list[dict]) -> dict:
    """Several chunks' results ({key: array, list, or {name: array}}) as one, in chunk order."""
    def join(values: list):
        if isinstance(values[0], dict):
            return {k: join([v[k] for v in values]) for k in values[0]}
        return [x for v in values for x in v] if isinstance(values[0], list) else np.concatenate(values)
    return {k: join([p[k] for p in parts]) for k in parts[0]}


def refine_samples(model, expert_id: str, seed: int, step, *, samples: list,
                   device: torch.device) -> tuple[list, dict]:
    """One refiner's refinement of every sample in `samples`, from its own seeded draws: (per sample
    its Refinement, its token batch for the update). Rollout workers call it for each refiner; under
    `cluster.layout=colocated` each refiner rank calls it on its share with the weights it trains."""
    if not samples:
        return [], {"prompts": []}
    prompts = [model.prompt_ids(s.prompt) for s in samples]
    draws = [generator(seed, "tokens", step, s.sample, expert_id) for s in samples]
    if getattr(model, "engine", None) is not None:  # an inference engine samples with its own seeded sampler
        sampled = model.sample(prompts, [int(torch.randint(1 << 32, (), generator=g)) for g in draws])
    else:
        sampled = model.sample(prompts, torch.stack([torch.rand(model.max_new_tokens, generator=g)
                                                     for g in draws]).to(device))
    drawn, logps, mask = (t.cpu() for t in sampled)
    refinements = [model.refinement(drawn[row].tolist(), mask[row].tolist()) for row in range(len(samples))]
    return refinements, {"prompts": prompts, "tokens": drawn.numpy(), "logps": logps.numpy(), "mask": mask.numpy()}


class RolloutPipeline:
    def __init__(self, config, scorers: dict | None = None, device: torch.device = torch.device("cpu"),
                 served: dict[str, torch.nn.Module] | None = None):
        """`scorers`: term name -> the callable that scores it, for terms scored elsewhere (a pool
        of reward actors); every other term's scorer is built here, on `device`. A term's
        `per_frame` chooses its frames here, before a pool is called. `served`: the models it
        samples with, where they are another's (a colocated generator rank's own, which refines
        nothing: its refinements are given to `run`); None: inference copies of every expert, built
        here and loaded with the versions delivered (`load`)."""
        self.config, self.device = config, device
        self.task = build_task(config)
        self.models = served if served is not None else {
            eid: build_model(config, eid, device=device, serving=True).eval().to(device)
            for eid in config.experts.ids()}
        self.refiner_ids = list(config.experts.active_refiners())
        self.versions: dict[str, int | None] = {eid: None for eid in config.experts.ids()}
        self.frontend = build_frontend(config, device)
        steps = config.experts.generator.sample_steps
        self.sigmas, self.sde = self.frontend.sigmas(steps), sde_steps(steps, config.experts.generator.sde_window)
        self.state_steps = kept_states(trained_steps(self.sde, config.experts.generator.train_final_step))
        self.owners = config.owners()
        scorers = scorers or {}
        self.rewards = RewardSet({name: sample_scorer(term, scorers.get(name) or build_scorer(term, device, name))
                                  for name, term in config.reward.terms.items()}, self.owners, config.reward.timeout_s,
                                 config.reward.timeout_per_image_s)

    @property
    def velocity(self):
        """The generator's velocity as sampling calls it: with Wan2.2-A14B's low-noise transformer an
        expert of its own, the two joined. Looked up per call: a colocated rank lends its model for
        one rollout only."""
        low = self.models.get(LOW_NOISE)
        return self.models["generator"].joined(low) if low is not None else self.models["generator"]

    def load(self, expert_id: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Serve `tensors` (a whole version, as the model holds them) as `version` of `expert_id`;
        the model reads them in place."""
        load(self.models[expert_id], tensors, assign=True)
        self.versions[expert_id] = version

    def version_vector(self) -> dict:
        return {**self.versions, "text_encoder": self.frontend.version}

    def chunks(self, items: list) -> list[tuple[int, list]]:
        """(position of its first item, its items) of each chunk of `rollout.batch_size` items
        (None: one chunk of them all)."""
        size = self.config.rollout.batch_size or max(len(items), 1)
        return [(first, items[first:first + size]) for first in range(0, len(items), size)]

    def run(self, step: int, samples: list, refinements: list[dict[str, Refinement]] | None = None) -> RolloutOutputs:
        """`samples` (algorithm.batch.Sample, in the step's order) rolled out with the weights served
        now, chunk by chunk, and joined. `refinements` (per sample {refiner: Refinement}): made by the
        refiners elsewhere (`refine_samples`), so none is made here and no token batch returned."""
        start = time.perf_counter()
        parts = [self.run_chunk(step, chunk, None if refinements is None else refinements[at:at + len(chunk)])
                 for at, chunk in self.chunks(samples)]
        hits, misses = self.frontend.take_stats()
        meta = replace(RolloutMeta.join([p.meta for p in parts]), cache_hits=hits, cache_misses=misses,
                       busy_s=time.perf_counter() - start)
        cond = self.models["generator"].merge_conditions([p.cond for p in parts])
        shard = trajectories(torch.cat([p.states for p in parts]), self.state_steps,
                             torch.cat([p.logps for p in parts]), cond, shared_cond=parts[0].shared,
                             sigmas=self.sigmas, sde=self.sde)
        tokens = {eid: joined_tokens([p.tokens[eid] for p in parts]) for eid in parts[0].tokens}
        return RolloutOutputs(meta, shard, tokens)

    def run_chunk(self, step: int, samples: list, refinements: list[dict] | None = None) -> Chunk:
        """One chunk of a rollout, from refinement (unless its `refinements` are given) to reward,
        its outputs moved to the host."""
        refinements, tokens = self.refine(step, samples) if refinements is None else (refinements, {})
        noise = self.noise(step, samples)
        cond = self.frontend.condition([s.prompt for s in samples], refinements)
        states, logps = self.generate(cond, noise, sde=True)
        decoded = self.frontend.decode(states[:, -1])
        similarity = group_sums(signatures(decoded), [s.group for s in samples])  # reduced on the device
        images = decoded.cpu().numpy()
        # on the host before the rewards and the regenerations: the device holds one chunk's latents at a time
        kept, logps = states[:, self.state_steps.to(states.device)].cpu(), logps.cpu()
        per_sample, shared = split_shared({k: v.cpu() for k, v in cond.items()})
        del states, cond, decoded
        faults = RewardFaults()
        terms, valid = self.reward(images, samples, refinements, faults)
        counterfactual = self.counterfactual(step, samples, refinements, noise, faults=faults)
        shown = to_uint8(images[[s.sample < self.config.logging.images_per_log for s in samples]]) \
            if self.shows_images(step) else None
        meta = RolloutMeta([s.sample for s in samples], terms, valid, [self.version_vector()] * len(samples),
                           counterfactual, as_text(refinements), faults, similarity, 0, 0, 0.0, shown)
        return Chunk(meta, kept, logps, per_sample, shared, tokens)

    def shows_images(self, step: int) -> bool:
        """Whether `step`'s images go to the trackers (`logging.images_every`, and the last step)."""
        every = self.config.logging.images_every
        return bool(every) and (step % every == 0 or step == self.config.trainer.steps - 1)

    def draw(self, prompts: list, refine: bool, tag: str = "eval", first: int = 0) -> dict:
        """One ODE sample per prompt (refined by every refiner if `refine`), its draws seeded by
        `tag` and the prompt's position (counted from `first`, so a long list drawn in parts draws
        the same images), in chunks of `rollout.batch_size`: {"images", "refinements"}."""
        drawn = joined_results([self.drawn(part, refine, tag, first + at) for at, part in self.chunks(prompts)])
        return {"images": drawn["images"], "refinements": as_text(drawn["refinements"])}

    def drawn(self, prompts: list, refine: bool, tag: str, first: int = 0) -> dict:
        """`draw` of one chunk, its images on the host."""
        samples = [Sample(first + i, first + i, p, refine) for i, p in enumerate(prompts)]
        refinements, _ = self.refine(tag, samples)
        cond = self.frontend.condition(prompts, refinements)
        states, _ = self.generate(cond, self.noise(tag, samples), sde=False)
        return {"images": self.frontend.decode(states[:, -1]).cpu().numpy(), "refinements": refinements}

    def evaluate(self, prompts: list, refine: bool, first: int = 0) -> dict:
        """Every reward term of one ODE sample per prompt (as `draw`), and the strict correctness of
        the terms that have one, in chunks of `rollout.batch_size`: {"images", "refinements",
        "terms", "valid", "strict"}."""
        return joined_results([self.evaluated(part, refine, first + at) for at, part in self.chunks(prompts)])

    def evaluated(self, prompts: list, refine: bool, first: int) -> dict:
        """`evaluate` of one chunk."""
        drawn = self.drawn(prompts, refine, "eval", first)
        images, refinements = drawn["images"], drawn["refinements"]
        terms, valid, _ = self.rewards(images, prompts, refinements)
        return {"images": images, "refinements": as_text(refinements), "terms": terms, "valid": valid,
                "strict": self.rewards.strict(images, prompts, refinements)}

    def generate(self, cond: dict, noise: torch.Tensor, sde: bool):
        """The generator's trajectories from `noise` under `cond`: SDE on `generator.sde_window`'s
        steps (all of them by default) if `sde`, else an ODE all the way (evaluation, sampling)."""
        velocity = self.velocity
        window = self.sde if sde else torch.zeros_like(self.sde)
        return sample(lambda x, sigma: velocity(x, sigma, **cond), noise.to(self.device), self.sigmas,
                      self.config.experts.generator.noise_level, sde=window)

    def refine(self, step, samples: list):
        """Every refiner's refinement of the samples marked `refine`, each from its own seeded
        draws: (per sample {refiner: Refinement}, {refiner: its token batch for the update})."""
        refined = [i for i, s in enumerate(samples) if s.refine]
        refinements: list[dict[str, Refinement]] = [{} for _ in samples]
        tokens = {}
        for eid in [e for e in self.refiner_ids if e in self.models]:
            made, tokens[eid] = refine_samples(self.models[eid], eid, self.config.trainer.seed, step,
                                               samples=[samples[i] for i in refined], device=self.device)
            for i, refinement in zip(refined, made):
                refinements[i][eid] = refinement
        return refinements, tokens

    def noise(self, step, samples: list) -> torch.Tensor:
        """Every Gaussian draw of each sample's trajectory (B, T+1, *latent), seeded per sample; the
        initial noise seeded per prompt group instead under `generator.same_initial_noise`."""
        spec, seed = self.config.experts.generator, self.config.trainer.seed
        draws = torch.stack([torch.randn((spec.sample_steps + 1, *self.frontend.latent_shape), generator=generator(
            seed, "noise", step, s.sample)) for s in samples])
        if spec.same_initial_noise:
            draws[:, 0] = torch.stack([torch.randn(self.frontend.latent_shape, generator=generator(
                seed, "initial noise", step, s.group)) for s in samples])
        return draws

    def reward(self, images: np.ndarray, samples: list, refinements: list[dict], faults: RewardFaults):
        """(named terms, valid per sample) of decoded images in [-1, 1], scored against the original
        prompts; faults are added to `faults`."""
        terms, valid, found = self.rewards(images, [s.prompt for s in samples], refinements)
        faults.add(found)
        return terms, valid

    def counterfactual(self, step, samples, refinements, noise,
                       *, faults: RewardFaults) -> dict[str, dict[str, np.ndarray]]:
        """Per refiner k, the reward terms of R(without y_k): the same sample regenerated from the
        same noise with y_k dropped (NaN where not drawn; `counterfactual_fraction` bounds the cost),
        reward faults counted into `faults`. Only under counterfactual credit (algorithm/credit.py)."""
        algo = self.config.algorithm
        if algo.credit != "counterfactual":
            return {}
        out = {}
        for eid in self.refiner_ids:
            rows = [i for i, s in enumerate(samples) if s.refine and torch.rand(1, generator=generator(
                self.config.trainer.seed, "counterfactual", step, s.sample, eid)).item()
                < algo.counterfactual_fraction]
            values = {t: np.full(len(samples), np.nan) for t in self.config.reward.terms}
            if rows:
                sub = [samples[i] for i in rows]
                cond = self.frontend.condition([s.prompt for s in sub], [refinements[i] for i in rows], drop=eid)
                states, _ = self.generate(cond, noise[rows], sde=True)
                without = [{e: r for e, r in refinements[i].items() if e != eid} for i in rows]
                terms, valid = self.reward(self.frontend.decode(states[:, -1]).cpu().numpy(), sub, without, faults)
                for t, v in terms.items():
                    values[t][rows] = np.where(valid, v, np.nan)
            out[eid] = values
        return out
