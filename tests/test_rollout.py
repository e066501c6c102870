"""Rollout worker behaviour in-process: version vectors, cache survival across syncs, determinism."""
import numpy as np
import pytest

from algorithm.batch import Sample
from cluster.expert_actor import ExpertActor
from cluster.rollout_worker import RolloutWorker
from experts.expert import StaleExpert
from tests.conftest import assert_same_rollout, make_config
from tasks.shapes import prompt_set

CFG = make_config("experts.n_refiners=2", preset="shapes-tiny")


def _items(n_groups=2, refine_per_group=3, skip=1):
    prompts = prompt_set(n_groups, seed=0)
    return [Sample(g * 4 + k, g, prompts[g], k < refine_per_group)
            for g in range(n_groups) for k in range(refine_per_group + skip)]


def _synced_worker():
    worker = RolloutWorker(CFG, 0)
    experts = {e: ExpertActor(CFG, e) for e in CFG.experts.ids()}
    for e, actor in experts.items():
        worker.load_weights(e, 0, actor.weights())
    return worker, experts


def test_refiner_sync_keeps_the_text_encoder_cache_and_bumps_only_that_version():
    worker, experts = _synced_worker()
    items = _items()
    worker.run(0, items)
    cached = list(worker.frontend.encoder.cache.entries)
    assert cached
    tokens = worker.run(0, items).tokens["refiner_0"]
    adv = np.ones(len(tokens["prompts"]))
    stats = experts["refiner_0"].update(0, 0, adv, tokens)
    worker.load_weights("refiner_0", stats["version"], experts["refiner_0"].weights())
    assert worker.version_vector() == {"refiner_0": 1, "refiner_1": 0, "generator": 0, "text_encoder": 0}
    assert all(k in worker.frontend.encoder.cache for k in cached)   # a refiner sync invalidates nothing
    worker.frontend.encoder.take_stats()
    meta = worker.run(1, items).meta
    assert meta.cache_hits >= 2                             # the unrefined prompts hit
    assert all(v == worker.version_vector() for v in meta.versions)


def test_rollout_is_a_function_of_seed_step_and_sample_not_of_batching():
    worker, _ = _synced_worker()
    items = _items()
    whole, traj, _ = worker.run(3, items)
    halves = [worker.run(3, items[:4]).meta, worker.run(3, items[4:]).meta]
    for t in whole.terms:
        np.testing.assert_allclose(whole.terms[t], np.concatenate([h.terms[t] for h in halves]), atol=1e-6)
    assert whole.refinements == halves[0].refinements + halves[1].refinements
    again = worker.run(3, items).trajectories
    np.testing.assert_array_equal(traj.states, again.states)


def test_expert_update_is_idempotent_by_step():
    worker, experts = _synced_worker()
    traj = worker.run(0, _items()).trajectories
    gen = experts["generator"]
    adv = np.linspace(-1, 1, len(traj.logps))
    first = gen.update(0, 0, adv, traj)
    weights = gen.weights()
    again = gen.update(0, 0, adv, traj)
    assert again == first and gen.version == 1
    assert all(np.array_equal(weights[k], v) for k, v in gen.weights().items())
    with pytest.raises(StaleExpert, match="at version 1, asked to update from 0"):
        gen.update(1, 0, adv, traj)  # what a restarted instance would be asked: it must refuse
    assert gen.version == 1


def test_generator_starts_from_an_init_checkpoint(tmp_path):
    from driver import checkpoint
    from common.config import SettingError
    trained = ExpertActor(CFG, "generator")
    worker, _ = _synced_worker()
    traj = worker.run(0, _items()).trajectories
    trained.update(0, 0, np.linspace(-1, 1, len(traj.logps)), traj)
    path = checkpoint.save(tmp_path, 1, {"generator": trained.snapshot()}) / "generator.safetensors"
    cfg = make_config("experts.n_refiners=2", f"experts.generator.init={path}", preset="shapes-tiny")
    started = ExpertActor(cfg, "generator")
    assert all(np.array_equal(v, trained.weights()[k]) for k, v in started.weights().items())
    assert started.version == 0  # a new run's version counts from 0
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SettingError, match="experts.generator.init"):
        make_config("experts.n_refiners=2", f"experts.generator.init={corrupt}", preset="shapes-tiny")


def _counterfactual_worker(*overrides):
    cfg = make_config("experts.n_refiners=2", "algorithm.credit=counterfactual", *overrides, preset="shapes-tiny")
    worker = RolloutWorker(cfg, 0)
    for e in cfg.experts.ids():
        worker.load_weights(e, 0, ExpertActor(cfg, e).weights())
    return cfg, worker


def test_counterfactual_of_an_empty_refinement_is_the_sample_itself():
    import torch

    from tasks.shapes import EOS
    cfg, worker = _counterfactual_worker()
    head = worker.models["refiner_1"].head
    with torch.no_grad():  # refiner_1 always stops at once: y_1 is empty
        head.bias.fill_(-1e4)
        head.bias[EOS] = 1e4
    meta = worker.run(0, _items()).meta
    refined = np.array([it.refine for it in _items()])
    total = sum(w * meta.terms[t] for t, w in cfg.reward.weights.items())
    without = {e: sum(w * terms[t] for t, w in cfg.reward.weights.items()) for e, terms in meta.counterfactual.items()}
    assert all(r["refiner_1"] == "" for r, f in zip(meta.refinements, refined) if f)
    np.testing.assert_array_equal(without["refiner_1"][refined], total[refined])
    assert np.isnan(without["refiner_1"][~refined]).all()
    assert not np.allclose(without["refiner_0"][refined], total[refined])


def test_refiner_that_cannot_change_the_image_gets_zero_counterfactual_advantage():
    import torch

    from algorithm.credit import advantages
    cfg, worker = _counterfactual_worker("reward.terms={image: {fn: shapes_image}}", "experts.refiner_0.owns=[image]",
                                         "experts.refiner_1.owns=[image]")
    with torch.no_grad():  # a generator whose velocity is 0 whatever the text: images ignore refinements
        worker.models["generator"].out.weight.zero_()
        worker.models["generator"].out.bias.zero_()
    items = _items()
    meta = worker.run(0, items).meta
    groups, refined = np.array([it.group for it in items]), np.array([it.refine for it in items])
    adv = advantages(mode="counterfactual", terms=meta.terms, weights=cfg.reward.weights, groups=groups,
                     refined=refined, owns={"refiner_0": ["image"], "refiner_1": ["image"]}, clip=5.0,
                     counterfactual=meta.counterfactual)
    assert np.array_equal(adv.refiners["refiner_0"], np.zeros(len(items)))
    assert np.array_equal(adv.refiners["refiner_1"], np.zeros(len(items)))


def test_counterfactual_fraction_bounds_the_extra_generations():
    _, worker = _counterfactual_worker("algorithm.counterfactual_fraction=0.5")
    items = _items(n_groups=6)
    meta = worker.run(0, items).meta
    drawn = sum((~np.isnan(terms["image"])).sum() for terms in meta.counterfactual.values())
    n_refined = sum(it.refine for it in items)
    assert 0 < drawn < 2 * n_refined


def test_a_rollout_is_made_with_the_versions_it_names_even_after_a_newer_one_arrived():
    """Deliveries come from the weight-sync actor, rollouts from the driver: a publish may reach a
    worker before a rollout submitted earlier. The rollout still uses the versions it names."""
    from cluster.recovery import NotSynced
    worker, experts = _synced_worker()
    items = _items()
    before = worker.rollout(0, items)[1].states
    stats = experts["generator"].update(0, 0, np.ones(len(items)), worker.rollout(0, items)[1])
    worker.load_weights("generator", stats["version"], experts["generator"].weights())  # overtakes the rollout
    named = {"refiner_0": 0, "refiner_1": 0, "generator": 0}
    np.testing.assert_array_equal(worker.rollout(0, items, named)[1].states, before)
    newer = worker.rollout(0, items, {**named, "generator": 1})[1].states
    assert not np.array_equal(newer, before)
    with pytest.raises(NotSynced, match="generator"):  # v0 is forgotten once a rollout named v1
        worker.rollout(0, items, named)


def test_a_share_rolled_out_in_chunks_equals_it_rolled_out_at_once():
    """rollout.batch_size: a share of 8 in chunks of 3 (the last one short) or of 1 (some without a
    refined sample) gives the same refinements, rewards, counterfactual regenerations, logged images,
    states, log-probs and text features as at once; `draw` and `evaluate` too."""
    outputs, drawn, evaluated = {}, {}, {}
    prompts = prompt_set(5, seed=4)
    for size in ("null", 3, 1):
        _, worker = _counterfactual_worker(f"rollout.batch_size={size}", "logging.images_every=1")
        outputs[size] = worker.run(2, _items())
        drawn[size] = worker.draw(prompts, refine=True)
        evaluated[size] = worker.evaluate(prompts, refine=True)
    assert outputs["null"].meta.images is not None
    for size in (3, 1):
        assert_same_rollout(outputs[size], outputs["null"])
        assert drawn[size]["refinements"] == drawn["null"]["refinements"]
        np.testing.assert_allclose(drawn[size]["images"], drawn["null"]["images"], rtol=0, atol=1e-6)
        for key in ("terms", "strict"):
            for t, v in evaluated["null"][key].items():
                np.testing.assert_allclose(evaluated[size][key][t], v, rtol=0, atol=1e-6)


def test_the_text_cache_stays_within_its_bound_and_serves_the_encoders_features():
    """rollout.text_cache_mb: over 300 unique refined prompts (each batch repeating two of the last),
    the cache never holds more bytes than its bound (counted as the storages it keeps alive), drops
    the least recently used first, and serves what the encoder computes without a cache."""
    import torch

    from experts.frontend import ShapesFrontEnd, build_text_encoder
    from experts.text_encoder import CachedEncoder, held_bytes
    from tasks.shapes import BOS, SEP, VOCAB

    cfg = make_config("rollout.text_cache_mb=0.0625", preset="shapes-tiny")
    cached = ShapesFrontEnd(cfg, torch.device("cpu")).encoder
    bound = cached.cache.max_bytes
    assert bound == 2 ** 16
    uncached = CachedEncoder(build_text_encoder(cfg), max_bytes=0)
    rng = np.random.default_rng(0)
    refined = list(dict.fromkeys((BOS, *p.ids, SEP, *rng.integers(SEP + 1, len(VOCAB), 6).tolist())
                                 for p in prompt_set(400, seed=5)))[:300]
    assert len(refined) == 300
    for first in range(0, 300, 10):
        seqs = refined[first:first + 10] + refined[max(0, first - 2):first]
        feats, pad = cached(seqs)
        want, want_pad = uncached(seqs)
        assert torch.equal(pad, want_pad)
        torch.testing.assert_close(feats, want, rtol=0, atol=1e-6)
        assert cached.cache.bytes == sum(held_bytes(f) for f in cached.cache.entries.values()) <= bound
    assert cached.take_stats() == (29 * 2, 300)
    assert len(uncached.cache) == 0 and uncached.take_stats() == (0, 300 + 29 * 2)
    kept = [k[1] for k in cached.cache.entries]
    assert 10 < len(kept) < 300 and kept == refined[-len(kept):]  # the least recently used went first


def test_same_initial_noise_shares_a_groups_start_and_nothing_else():
    """generator.same_initial_noise (Flow-GRPO's same_latent): a prompt's samples start from one
    noise; their SDE draws still differ, and other groups start elsewhere."""
    cfg = make_config("experts.generator.same_initial_noise=true", preset="shapes-tiny")
    worker = RolloutWorker(cfg, 0)
    noise = worker.noise(2, _items())
    plain = RolloutWorker(CFG, 0).noise(2, _items())
    assert (noise[1:4, 0] == noise[0, 0]).all() and (noise[5:8, 0] == noise[4, 0]).all()
    assert not (noise[4, 0] == noise[0, 0]).all() and not (noise[1, 1] == noise[0, 1]).all()
    assert (noise[:, 1:] == plain[:, 1:]).all()  # the SDE draws are the per-sample ones
