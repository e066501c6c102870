"""The algorithm's maths in isolation: SDE log-probs, behaviour log-probs, clipping, advantages, KL."""
import numpy as np
import torch

from driver.config import load_config
from algorithm.credit import advantages, group_normalise
from experts.frontend import build_text_encoder
from experts.kinds import build_model
from algorithm.sde import gaussian_logp, sample, sde_mean_std, sde_steps, sigma_schedule
from experts.text_encoder import CachedEncoder
from algorithm.losses import generator_loss, kl3, ppo_clip_objective, refiner_loss
from tasks.shapes import BOS, prompt_set

CFG = load_config("shapes-tiny")


def test_sde_logprob_equals_torch_normal():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 3, 8, 8, generator=g), torch.randn(3, 3, 8, 8, generator=g)
    sigma, sigma_next = torch.tensor(0.6).view(1, 1, 1, 1), torch.tensor(0.45).view(1, 1, 1, 1)
    mean, std = sde_mean_std(x, v, sigma, sigma_next, 0.7, 0.9)
    x_next = mean + std * torch.randn(x.shape, generator=g)
    want = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x_next).flatten(1).mean(1)
    torch.testing.assert_close(gaussian_logp(x_next, mean, std), want, rtol=1e-6, atol=1e-6)
    # and the mean follows the SPEC formula
    std_t = 0.7 * (0.6 / 0.4) ** 0.5
    expected = x * (1 + std_t ** 2 * -0.15 / 1.2) + v * (1 + std_t ** 2 * 0.4 / 1.2) * -0.15
    torch.testing.assert_close(mean, expected)
    torch.testing.assert_close(std, torch.full_like(std, std_t * 0.15 ** 0.5))


def _trajectories(n=4, steps=4, window=None):
    prompts = prompt_set(n, seed=1)
    encoder = CachedEncoder(build_text_encoder(CFG))
    text, pad = encoder([(BOS, *p.ids) for p in prompts])
    dit = build_model(CFG, "generator")
    noise = torch.randn(n, steps + 1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    sigmas, sde = sigma_schedule(steps), sde_steps(steps, window)
    states, logps = sample(lambda x, s: dit(x, s, text, pad), noise, sigmas, 0.7, sde)
    return dit, {"states": states, "logps": logps, "sigmas": sigmas, "sde": sde, "cond": {"text": text, "text_pad": pad}}


def test_an_sde_window_records_and_trains_only_its_steps():
    """Flow-GRPO-Fast: noise only on the window's steps, ODE elsewhere; log-probs (and the loss)
    exist only there, and an ODE step is deterministic given its state."""
    dit, batch = _trajectories(steps=6, window=[1, 3])
    assert batch["sde"].tolist() == [False, True, True, False, False, False]
    assert (batch["logps"][:, [0, 3, 4, 5]] == 0).all() and (batch["logps"][:, [1, 2]] != 0).all()
    loss, stats = generator_loss(dit, build_model(CFG, "generator"), batch, torch.tensor([1.0, -1.0, 0.5, 0.0]),
                                 0.7, 1e-4, 0.01)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-5
    x, sigmas = batch["states"][:, 0], batch["sigmas"]
    with torch.no_grad():  # step 0 is an Euler (ODE) step
        euler = x + dit(x, sigmas[0].expand(4), **batch["cond"]) * (sigmas[1] - sigmas[0])
    torch.testing.assert_close(batch["states"][:, 1], euler)


def test_generator_recomputed_logprob_equals_recorded_so_first_ratio_is_one():
    dit, batch = _trajectories()
    ref = build_model(CFG, "generator")
    loss, stats = generator_loss(dit, ref, batch, torch.tensor([1.0, -1.0, 0.5, 0.0]), 0.7, 1e-4, 0.01)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-5
    assert stats["kl"] < 1e-10  # same weights as the reference
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in dit.parameters())


def test_refiner_recomputed_logprob_equals_recorded():
    lm = build_model(CFG, "refiner_0")
    prompts = [list(p.ids) for p in prompt_set(5, seed=2)]
    tokens, logps, mask = lm.sample(prompts, torch.rand(5, lm.max_new_tokens, generator=torch.Generator().manual_seed(0)))
    again = lm.token_logprobs(prompts, tokens)
    torch.testing.assert_close(again * mask, logps * mask, rtol=1e-5, atol=1e-5)
    batch = {"prompts": prompts, "tokens": tokens, "logps": logps, "mask": mask}
    loss, stats = refiner_loss(lm, build_model(CFG, "refiner_0"), batch, torch.ones(5), 0.2, 0.01)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-5 and stats["kl"] < 1e-10


def test_refiner_ratio_is_taken_against_the_rollout_logprobs_and_clipped():
    """A sample from an older refiner (async rollouts): the ratio to its recorded log-probs corrects
    the gradient, and PPO's clip stops it where the policy already moved past 1 + eps."""
    lm = build_model(CFG, "refiner_0")
    prompts = [list(p.ids) for p in prompt_set(5, seed=2)]
    tokens, logps, mask = lm.sample(prompts, torch.rand(5, lm.max_new_tokens, generator=torch.Generator().manual_seed(0)))
    stale = {"prompts": prompts, "tokens": tokens, "logps": logps - 0.5 * mask, "mask": mask}
    ref = build_model(CFG, "refiner_0")
    loss, stats = refiner_loss(lm, ref, stale, torch.ones(5), 0.2, 0.0)
    assert abs(stats["ratio_mean"] - float(np.exp(0.5))) < 1e-4
    loss.backward()  # A > 0 and r = 1.65 > 1.2: clipped, no gradient
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in lm.parameters())
    lm.zero_grad()
    refiner_loss(lm, ref, stale, -torch.ones(5), 0.2, 0.0)[0].backward()  # A < 0: the pessimistic term is r
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())


def test_ppo_clipping():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 0.9, 1.1, 2.0]))
    adv = torch.ones(4)
    loss, ratio = ppo_clip_objective(logp, old, adv, clip_eps=0.2)
    # positive advantage: gains capped at 1 + eps, losses not
    torch.testing.assert_close(loss, -torch.tensor([0.5, 0.9, 1.1, 1.2]).mean())
    loss_neg, _ = ppo_clip_objective(logp, old, -adv, clip_eps=0.2)
    torch.testing.assert_close(loss_neg, torch.tensor([0.8, 0.9, 1.1, 2.0]).mean())
    # a clipped sample passes no gradient
    logp = logp.clone().requires_grad_(True)
    ppo_clip_objective(logp, old, adv, 0.2)[0].backward()
    assert logp.grad[3] == 0 and logp.grad[0] != 0


def test_group_advantage_normalisation():
    r = np.array([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
    g = np.array([0, 0, 0, 1, 1, 1])
    adv = group_normalise(r, g, np.ones(6, bool), clip=5.0)
    np.testing.assert_allclose(adv[:3], (r[:3] - 2) / (np.std(r[:3]) + 1e-4))
    np.testing.assert_allclose(adv[3:], 0.0)  # equal rewards: no signal
    big = group_normalise(np.array([0.0] * 99 + [1.0]), np.zeros(100, int), np.ones(100, bool), clip=5.0)
    assert big.max() == 5.0  # clipped


def test_credit_modes_route_the_right_terms():
    terms = {"image": np.array([0.0, 1.0, 0.0, 1.0]), "style": np.array([1.0, 0.0, 0.0, 0.0])}
    groups, refined = np.zeros(4, int), np.array([True, True, True, False])
    w = {"image": 1.0, "style": 1.0}
    per = advantages("per_expert", terms, w, groups, refined, {"refiner_0": ["style"]}, 5.0)
    assert per.refiners["refiner_0"][0] > 0 and per.refiners["refiner_0"][1] < 0 and per.refiners["refiner_0"][3] == 0
    shared = advantages("shared", terms, w, groups, refined, {"refiner_0": ["style"]}, 5.0)
    np.testing.assert_allclose(shared.refiners["refiner_0"][:3], shared.generator[:3])
    np.testing.assert_allclose(per.generator, shared.generator)
    owned = {"refiner_0": ["style"]}
    image_only = group_normalise(terms["image"], groups, np.ones(4, bool), 5.0)
    for mode in ("per_expert", "counterfactual"):
        without = {"refiner_0": {t: np.full(4, 0.5) for t in terms}}
        np.testing.assert_allclose(advantages(mode, terms, w, groups, refined, owned, 5.0, without,
                                              generator_terms=["image"]).generator,
                                   image_only)   # the style term is not the generator's doing
    np.testing.assert_allclose(advantages("shared", terms, w, groups, refined, owned, 5.0,
                                          generator_terms=["image"]).generator,
                               shared.generator)  # shared credit is shared, whatever is owned


def test_kl3_nonnegative_and_zero_at_equality():
    a, b = torch.randn(1000), torch.randn(1000)
    assert (kl3(a, b) >= 0).all()
    assert torch.equal(kl3(a, a), torch.zeros(1000))


def test_counterfactual_advantage_is_the_normalised_difference_reward():
    terms = {"image": np.array([0.9, 0.5, 0.2, 0.4])}
    without = {"refiner_0": {"image": np.array([0.1, 0.5, 0.2, np.nan])}}  # y_0 helped sample 0 only
    groups, refined = np.zeros(4, int), np.array([True, True, True, False])
    adv = advantages("counterfactual", terms, {"image": 1.0}, groups, refined, {"refiner_0": []}, 5.0, without)
    d = np.array([0.8, 0.0, 0.0])
    np.testing.assert_allclose(adv.refiners["refiner_0"][:3], (d - d.mean()) / (d.std() + 1e-4))
    assert adv.refiners["refiner_0"][3] == 0.0


def test_per_term_normalisation_weights_each_term_by_its_group_spread():
    """reward.normalize=per_term: z_t = (r_t - mean_g) / (std_g + 1e-4) per group, then weighted;
    a term on a 100x scale no longer decides the advantage alone."""
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    terms = {"big": np.array([10.0, 30.0, 20.0, 40.0, 5.0, 5.0, 5.0, 5.0]),
             "small": np.array([0.4, 0.1, 0.3, 0.2, 0.1, 0.9, 0.5, 0.3])}
    w = {"big": 1.0, "small": 1.0}
    refined = np.ones(8, bool)
    adv = advantages("shared", terms, w, groups, refined, {}, 50.0, per_term=True)
    z = {t: np.concatenate([(v[g * 4:g * 4 + 4] - v[g * 4:g * 4 + 4].mean()) / (v[g * 4:g * 4 + 4].std() + 1e-4)
                            for g in (0, 1)]) for t, v in terms.items()}
    total = z["big"] + z["small"]
    expected = np.concatenate([(total[g * 4:g * 4 + 4] - total[g * 4:g * 4 + 4].mean())
                               / (total[g * 4:g * 4 + 4].std() + 1e-4) for g in (0, 1)])
    np.testing.assert_allclose(adv.generator, expected)
    plain = advantages("shared", terms, w, groups, refined, {}, 50.0)
    assert np.argmax(plain.generator[:4]) == 3 and np.argmax(adv.generator[:4]) != np.argmax(plain.generator[:4]) \
        or not np.allclose(adv.generator, plain.generator)
    np.testing.assert_allclose(adv.generator[4:], z["small"][4:] / (z["small"][4:].std() + 1e-4), atol=1e-6)
    # counterfactual under per_term: D = sum_t w_t (r_t - r_t(without)) / (std_g(r_t) + 1e-4)
    without = {"refiner_0": {"big": terms["big"] - 10.0, "small": terms["small"]}}
    cf = advantages("counterfactual", terms, w, groups, refined, {"refiner_0": ["small"]}, 50.0, without,
                    per_term=True)
    d = 10.0 / (np.array([terms["big"][:4].std()] * 4 + [0.0] * 4) + 1e-4)
    expected_cf = np.concatenate([(d[g * 4:g * 4 + 4] - d[g * 4:g * 4 + 4].mean())
                                  / (d[g * 4:g * 4 + 4].std() + 1e-4) for g in (0, 1)])
    np.testing.assert_allclose(cf.refiners["refiner_0"], expected_cf, atol=1e-6)
