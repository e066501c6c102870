"""The per-expert update rules, each a loss a reader can check against its paper.

refiner_loss:   GRPO's token-level objective (arXiv 2402.03300, eq. 3) as PromptRL trains its
                prompt rewriter (arXiv 2602.01382, sec. 3.2): PPO-clipped ratio times the
                sequence's advantage plus beta * k3 KL to the frozen reference (GRPO eq. 4), the
                ratio taken against the rollout's log-probs so that stale samples are corrected.
                Convention: averaged over all valid tokens of the batch (TRL's `dapo`/`bnpo` loss
                types, verl's `token-mean`), not the mean of per-sequence means of GRPO's eq. 3.
generator_loss: Flow-GRPO's objective (arXiv 2505.05470, eq. 8): PPO-clipped ratio of each SDE
                step's Gaussian log-prob, averaged over steps and samples, plus beta * KL.
                Convention: the KL is the exact KL between the policy's and the reference's step
                Gaussians, ||mu_theta - mu_ref||^2 / (2 std^2) with std^2 = std_t^2 |Delta sigma|
                the transition variance, averaged over dimensions. Flow-GRPO's code divides by
                std_t^2 alone, so this KL is Flow-GRPO's divided by |Delta sigma| (15-25x larger on
                SD3.5 with 10 steps and an SDE window [0, 4)): Flow-GRPO's beta values do not carry
                over unchanged.
"""
from __future__ import annotations

import torch

from algorithm.sde import gaussian_logp, sde_mean_std


def kl3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) (GRPO eq. 4): e^d - d - 1 with d = log ref - log pi; >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def refiner_loss(policy, reference, batch: dict, adv: torch.Tensor, clip_eps: float, kl_beta: float):
    """Per token PPO-clip(r, A) + beta KL3 with r = exp(logp - logp_rollout), averaged over all valid
    tokens. On-policy (`cluster.max_staleness=0`) r = 1 to float rounding, so the gradient is that
    of rho = exp(logp - sg(logp)), GRPO's single-update case; samples made by an older version are
    corrected by r."""
    logp = policy.token_logprobs(batch["prompts"], batch["tokens"], batch["mask"])
    with torch.no_grad():
        ref_logp = reference.token_logprobs(batch["prompts"], batch["tokens"], batch["mask"])
    mask = batch["mask"].float()
    ratio = torch.exp(logp - batch["logps"])
    kl = kl3(logp, ref_logp)
    per_token = clipped_surrogate(ratio, adv[:, None], clip_eps) + kl_beta * kl
    n = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n
    return loss, {"kl": float((kl.detach() * mask).sum() / n), "ratio_mean": float((ratio.detach() * mask).sum() / n)}


def clipped_surrogate(ratio, adv, clip_eps: float):
    """Elementwise max(-A r, -A clip(r, 1 - eps, 1 + eps)): PPO's pessimistic bound (arXiv 1707.06347, eq. 7)."""
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))


def ppo_clip_objective(logp, old_logp, adv, clip_eps: float):
    """mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) with r = exp(logp - old_logp)."""
    ratio = torch.exp(logp - old_logp)
    return clipped_surrogate(ratio, adv, clip_eps).mean(), ratio


def generator_loss(policy, reference, batch: dict, adv: torch.Tensor, noise_level: float,
                   clip_eps: float, kl_beta: float):
    """PPO over every SDE step of every trajectory, re-evaluating each recorded transition; `batch`
    holds the states (B, T+1, ...), log-probs (B, T), the sigmas (T+1,), which steps were SDE (T,)
    and the conditioning the model reads (`cond`, per sample). The KL is the exact Gaussian KL
    (see the module docstring for how it relates to Flow-GRPO's)."""
    states, old_logp, sigmas = batch["states"], batch["logps"], batch["sigmas"]
    steps = batch["sde"].nonzero().flatten()          # only SDE transitions have a log-prob to match
    b, k = states.shape[0], len(steps)
    x, x_next = states[:, steps].flatten(0, 1), states[:, steps + 1].flatten(0, 1)
    shape = (-1, *[1] * (x.dim() - 1))
    s, s_next = sigmas[steps].repeat(b).view(shape), sigmas[steps + 1].repeat(b).view(shape)
    cond = {name: v.repeat_interleave(k, 0) for name, v in batch["cond"].items()}
    sigma_max = float(sigmas[1])
    mean, std = sde_mean_std(x, policy(x, s.flatten(), **cond), s, s_next, noise_level, sigma_max)
    with torch.no_grad():
        ref_mean, _ = sde_mean_std(x, reference(x, s.flatten(), **cond), s, s_next, noise_level, sigma_max)
    logp = gaussian_logp(x_next, mean, std)
    pg, ratio = ppo_clip_objective(logp, old_logp[:, steps].flatten(), adv.repeat_interleave(k), clip_eps)
    kl = (((mean - ref_mean) ** 2) / (2 * std ** 2)).flatten(1).mean(1).mean()
    return pg + kl_beta * kl, {"kl": float(kl.detach()), "ratio_mean": float(ratio.detach().mean())}
