"""The algorithm's maths in isolation: SDE log-probs, behaviour log-probs, clipping, advantages, KL."""
import numpy as np
import torch

from driver.preflight import load_config
from algorithm.credit import advantages, group_normalise
from experts.frontend import build_text_encoder
from experts.kinds import build_model
from algorithm.sde import gaussian_logp, sample, sde_mean_std, sde_steps, sigma_schedule
from experts.text_encoder import CachedEncoder
from algorithm.losses import (GeneratorObjective, clipped_surrogate, generator_backward, kl3, refiner_loss,
                              trained_steps)
from tasks.shapes import BOS, prompt_set

CFG = load_config("shapes-tiny")
OBJECTIVE = GeneratorObjective(noise_level=0.7, clip_eps=1e-4, kl_beta=0.01)


def test_sde_logprob_equals_torch_normal():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 3, 8, 8, generator=g), torch.randn(3, 3, 8, 8, generator=g)
    sigma, sigma_next = torch.tensor(0.6).view(1, 1, 1, 1), torch.tensor(0.45).view(1, 1, 1, 1)
    mean, std = sde_mean_std(x, v, sigma, sigma_next, noise_level=0.7, sigma_max=0.9)
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
    encoder = CachedEncoder(build_text_encoder(CFG), max_bytes=0)
    text, pad = encoder([(BOS, *p.ids) for p in prompts])
    dit = build_model(CFG, "generator")
    noise = torch.randn(n, steps + 1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    sigmas, sde = sigma_schedule(steps), sde_steps(steps, window)
    states, logps = sample(lambda x, s: dit(x, s, text, pad), noise, sigmas, 0.7, sde=sde)
    return dit, {"states": states, "state_steps": torch.arange(steps + 1), "logps": logps, "sigmas": sigmas, "sde": sde,
                 "cond": {"text": text, "text_pad": pad}, "shared_cond": {}}


def test_an_sde_window_records_and_trains_only_its_steps():
    """Flow-GRPO-Fast: noise only on the window's steps, ODE elsewhere; log-probs (and the loss)
    exist only there, and an ODE step is deterministic given its state."""
    dit, batch = _trajectories(steps=6, window=[1, 3])
    assert batch["sde"].tolist() == [False, True, True, False, False, False]
    assert (batch["logps"][:, [0, 3, 4, 5]] == 0).all() and (batch["logps"][:, [1, 2]] != 0).all()
    loss, stats = generator_backward(dit, build_model(CFG, "generator"), batch, torch.tensor([1.0, -1.0, 0.5, 0.0]),
                                     obj=OBJECTIVE)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-5
    x, sigmas = batch["states"][:, 0], batch["sigmas"]
    with torch.no_grad():  # step 0 is an Euler (ODE) step
        euler = x + dit(x, sigmas[0].expand(4), **batch["cond"]) * (sigmas[1] - sigmas[0])
    torch.testing.assert_close(batch["states"][:, 1], euler)


def test_generator_recomputed_logprob_equals_recorded_so_first_ratio_is_one():
    dit, batch = _trajectories()
    ref = build_model(CFG, "generator")
    loss, stats = generator_backward(dit, ref, batch, torch.tensor([1.0, -1.0, 0.5, 0.0]), obj=OBJECTIVE)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-5
    assert stats["kl"] < 1e-10  # same weights as the reference
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in dit.parameters())


def test_refiner_recomputed_logprob_equals_recorded():
    lm = build_model(CFG, "refiner_0")
    prompts = [list(p.ids) for p in prompt_set(5, seed=2)]
    tokens, logps, mask = lm.sample(prompts, torch.rand(5, lm.max_new_tokens, generator=torch.Generator().manual_seed(0)))
    again = lm.token_logprobs(prompts, tokens)
    torch.testing.assert_close(again * mask, logps * mask, rtol=1e-5, atol=1e-5)
    batch = {"prompts": prompts, "tokens": tokens, "logps": logps, "mask": mask}
    loss, stats = refiner_loss(lm, build_model(CFG, "refiner_0"), batch, torch.ones(5), clip_eps=0.2, kl_beta=0.01)
    assert abs(stats["ratio_mean"] - 1.0) < 1e-5 and stats["kl"] < 1e-10


def test_refiner_ratio_is_taken_against_the_rollout_logprobs_and_clipped():
    """A sample from an older refiner (async rollouts): the ratio to its recorded log-probs corrects
    the gradient, and PPO's clip stops it where the policy already moved past 1 + eps."""
    lm = build_model(CFG, "refiner_0")
    prompts = [list(p.ids) for p in prompt_set(5, seed=2)]
    tokens, logps, mask = lm.sample(prompts, torch.rand(5, lm.max_new_tokens, generator=torch.Generator().manual_seed(0)))
    stale = {"prompts": prompts, "tokens": tokens, "logps": logps - 0.5 * mask, "mask": mask}
    ref = build_model(CFG, "refiner_0")
    loss, stats = refiner_loss(lm, ref, stale, torch.ones(5), clip_eps=0.2, kl_beta=0.0)
    assert abs(stats["ratio_mean"] - float(np.exp(0.5))) < 1e-4
    loss.backward()  # A > 0 and r = 1.65 > 1.2: clipped, no gradient
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in lm.parameters())
    lm.zero_grad()
    # A < 0: the pessimistic term is r
    refiner_loss(lm, ref, stale, -torch.ones(5), clip_eps=0.2, kl_beta=0.0)[0].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())


def test_ppo_clipping():
    logp = torch.log(torch.tensor([0.5, 0.9, 1.1, 2.0]))
    adv = torch.ones(4)
    # positive advantage: gains capped at 1 + eps, losses not
    torch.testing.assert_close(clipped_surrogate(logp.exp(), adv, 0.2), -torch.tensor([0.5, 0.9, 1.1, 1.2]))
    torch.testing.assert_close(clipped_surrogate(logp.exp(), -adv, 0.2), torch.tensor([0.8, 0.9, 1.1, 2.0]))
    # a clipped sample passes no gradient
    logp = logp.clone().requires_grad_(True)
    clipped_surrogate(logp.exp(), adv, 0.2).mean().backward()
    assert logp.grad[3] == 0 and logp.grad[0] != 0


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _moved(dit):
    """`dit` with its weights nudged, so that ratio and KL are away from their starting values."""
    with torch.no_grad():
        for p in dit.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return dit


def test_micro_batches_accumulate_the_whole_batch_gradient():
    """The update's memory is one micro-batch's: its gradient, accumulated part by part, is that of
    all transitions in one graph, to float rounding, whatever the micro-batch."""
    dit, batch = _trajectories(steps=5)
    _moved(dit)
    ref, adv = build_model(CFG, "generator"), torch.tensor([1.0, -1.0, 0.5, -0.3])
    results = {}
    for micro in (20, None, 3, 1):
        dit.zero_grad()
        loss, stats = generator_backward(dit, ref, batch, adv,
                                         obj=GeneratorObjective(0.7, 0.2, 0.05, micro_batch=micro))
        results[micro] = (loss, stats, _grads(dit))
    whole_loss, whole_stats, whole = results[20]  # 4 samples x 5 steps: all in one graph
    assert whole.abs().sum() > 0 and whole_stats["kl"] > 0
    for micro, (loss, stats, grads) in results.items():
        assert abs(loss - whole_loss) < 1e-6 and abs(stats["kl"] - whole_stats["kl"]) < 1e-7, micro
        torch.testing.assert_close(grads, whole, rtol=1e-5, atol=1e-7)


def test_the_final_step_can_be_left_untrained():
    """train_final_step=false: Flow-GRPO's all-but-last; the last step's transitions no longer count."""
    sde = torch.ones(5, dtype=torch.bool)
    assert trained_steps(sde, True).tolist() == [0, 1, 2, 3, 4]
    assert trained_steps(sde, False).tolist() == [0, 1, 2, 3]
    assert trained_steps(torch.tensor([False, True, True, False]), False).tolist() == [1, 2]
    dit, batch = _trajectories(steps=3)
    _moved(dit)
    ref, adv = build_model(CFG, "generator"), torch.tensor([1.0, -1.0, 0.5, -0.3])
    short = {**batch, "sde": torch.tensor([True, True, False])}  # as if only the first two were SDE steps
    without_last = generator_backward(dit, ref, batch, adv,
                                      obj=GeneratorObjective(0.7, 0.2, 0.05, train_final_step=False))
    first_two = generator_backward(dit, ref, short, adv, obj=GeneratorObjective(0.7, 0.2, 0.05))
    assert without_last == first_two


def test_flow_grpo_kl_is_the_exact_kl_times_the_step():
    dit, batch = _trajectories(steps=4)
    _moved(dit)
    ref, adv = build_model(CFG, "generator"), torch.zeros(4)
    per_step = {}
    for form in ("exact", "flow_grpo"):
        for t in range(4):
            one = {**batch, "sde": torch.arange(4) == t}
            objective = GeneratorObjective(0.7, 0.2, 1.0, form)
            per_step[form, t] = generator_backward(dit, ref, one, adv, obj=objective)[1]["kl"]
    for t in range(4):
        delta = float(batch["sigmas"][t] - batch["sigmas"][t + 1])
        assert abs(per_step["flow_grpo", t] - per_step["exact", t] * delta) <= 1e-6 * per_step["exact", t]


def test_a_zero_kl_weight_never_runs_the_reference():
    """beta = 0: the frozen reference's forward pass is skipped, for the generator and a refiner."""
    class NoReference:
        def __call__(self, *args, **kwargs):
            raise AssertionError("the reference ran with kl_beta = 0")
        token_logprobs = __call__

    dit, batch = _trajectories(steps=3)
    loss, stats = generator_backward(dit, NoReference(), batch, torch.ones(4), obj=GeneratorObjective(0.7, 1e-4, 0.0))
    assert stats["kl"] == 0.0
    lm = build_model(CFG, "refiner_0")
    prompts = [list(p.ids) for p in prompt_set(3, seed=2)]
    tokens, logps, mask = lm.sample(prompts, torch.rand(3, lm.max_new_tokens, generator=torch.Generator().manual_seed(0)))
    loss, stats = refiner_loss(lm, NoReference(), {"prompts": prompts, "tokens": tokens, "logps": logps, "mask": mask},
                               torch.ones(3), clip_eps=0.2, kl_beta=0.0)
    assert stats["kl"] == 0.0 and torch.isfinite(loss)


def test_group_advantage_normalisation():
    r = np.array([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
    g = np.array([0, 0, 0, 1, 1, 1])
    adv = group_normalise(r, g, np.ones(6, bool), clip=5.0)
    np.testing.assert_allclose(adv[:3], (r[:3] - 2) / (np.std(r[:3]) + 1e-4))
    np.testing.assert_allclose(adv[3:], 0.0)  # equal rewards: no signal
    big = group_normalise(np.array([0.0] * 99 + [1.0]), np.zeros(100, int), np.ones(100, bool), clip=5.0)
    assert big.max() == 5.0  # clipped


def test_batch_std_divides_every_group_by_the_whole_steps_spread():
    """adv_std=batch (Flow-GRPO's global_std): centred per group, divided by the std of every
    included reward of the step; a group that barely varies keeps small advantages."""
    r = np.array([1.0, 2.0, 3.0, 10.0, 10.0, 10.01, 7.0])
    g = np.array([0, 0, 0, 1, 1, 1, 1])
    include = np.array([True] * 6 + [False])
    adv = group_normalise(r, g, include, clip=5.0, batch_std=True)
    std = r[:6].std()
    np.testing.assert_allclose(adv[:3], (r[:3] - 2.0) / (std + 1e-4))
    np.testing.assert_allclose(adv[3:6], (r[3:6] - r[3:6].mean()) / (std + 1e-4))
    assert adv[6] == 0.0 and np.abs(adv[3:6]).max() < 0.01
    terms = {"image": r}
    adv = advantages(mode="shared", terms=terms, weights={"image": 1.0}, groups=g, refined=np.ones(7, bool), owns={},
                     clip=5.0, valid=include, batch_std=True)
    np.testing.assert_allclose(adv.generator, group_normalise(r, g, include, 5.0, batch_std=True))


def test_credit_modes_route_the_right_terms():
    terms = {"image": np.array([0.0, 1.0, 0.0, 1.0]), "style": np.array([1.0, 0.0, 0.0, 0.0])}
    groups, refined = np.zeros(4, int), np.array([True, True, True, False])
    w = {"image": 1.0, "style": 1.0}
    common = {"terms": terms, "weights": w, "groups": groups, "refined": refined, "clip": 5.0}
    per = advantages(mode="per_expert", owns={"refiner_0": ["style"]}, **common)
    assert per.refiners["refiner_0"][0] > 0 and per.refiners["refiner_0"][1] < 0 and per.refiners["refiner_0"][3] == 0
    shared = advantages(mode="shared", owns={"refiner_0": ["style"]}, **common)
    np.testing.assert_allclose(shared.refiners["refiner_0"][:3], shared.generator[:3])
    np.testing.assert_allclose(per.generator, shared.generator)
    owned = {"refiner_0": ["style"]}
    image_only = group_normalise(terms["image"], groups, np.ones(4, bool), 5.0)
    for mode in ("per_expert", "counterfactual"):
        without = {"refiner_0": {t: np.full(4, 0.5) for t in terms}}
        np.testing.assert_allclose(advantages(mode=mode, owns=owned, counterfactual=without, generator_terms=["image"],
                                              **common).generator,
                                   image_only)   # the style term is not the generator's doing
    np.testing.assert_allclose(advantages(mode="shared", owns=owned, generator_terms=["image"], **common).generator,
                               shared.generator)  # shared credit is shared, whatever is owned


def test_kl3_nonnegative_and_zero_at_equality():
    a, b = torch.randn(1000), torch.randn(1000)
    assert (kl3(a, b) >= 0).all()
    assert torch.equal(kl3(a, a), torch.zeros(1000))


def test_counterfactual_advantage_is_the_normalised_difference_reward():
    terms = {"image": np.array([0.9, 0.5, 0.2, 0.4])}
    without = {"refiner_0": {"image": np.array([0.1, 0.5, 0.2, np.nan])}}  # y_0 helped sample 0 only
    groups, refined = np.zeros(4, int), np.array([True, True, True, False])
    adv = advantages(mode="counterfactual", terms=terms, weights={"image": 1.0}, groups=groups, refined=refined,
                     owns={"refiner_0": []}, clip=5.0, counterfactual=without)
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
    common = {"terms": terms, "weights": w, "groups": groups, "refined": refined, "clip": 50.0}
    adv = advantages(mode="shared", owns={}, per_term=True, **common)
    z = {t: np.concatenate([(v[g * 4:g * 4 + 4] - v[g * 4:g * 4 + 4].mean()) / (v[g * 4:g * 4 + 4].std() + 1e-4)
                            for g in (0, 1)]) for t, v in terms.items()}
    total = z["big"] + z["small"]
    expected = np.concatenate([(total[g * 4:g * 4 + 4] - total[g * 4:g * 4 + 4].mean())
                               / (total[g * 4:g * 4 + 4].std() + 1e-4) for g in (0, 1)])
    np.testing.assert_allclose(adv.generator, expected)
    plain = advantages(mode="shared", owns={}, **common)
    assert np.argmax(plain.generator[:4]) == 3 and np.argmax(adv.generator[:4]) != np.argmax(plain.generator[:4]) \
        or not np.allclose(adv.generator, plain.generator)
    np.testing.assert_allclose(adv.generator[4:], z["small"][4:] / (z["small"][4:].std() + 1e-4), atol=1e-6)
    # counterfactual under per_term: D = sum_t w_t (r_t - r_t(without)) / (std_g(r_t) + 1e-4)
    without = {"refiner_0": {"big": terms["big"] - 10.0, "small": terms["small"]}}
    cf = advantages(mode="counterfactual", owns={"refiner_0": ["small"]}, counterfactual=without, per_term=True,
                    **common)
    d = 10.0 / (np.array([terms["big"][:4].std()] * 4 + [0.0] * 4) + 1e-4)
    expected_cf = np.concatenate([(d[g * 4:g * 4 + 4] - d[g * 4:g * 4 + 4].mean())
                                  / (d[g * 4:g * 4 + 4].std() + 1e-4) for g in (0, 1)])
    np.testing.assert_allclose(cf.refiners["refiner_0"], expected_cf, atol=1e-6)
