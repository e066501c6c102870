"""The per-expert update rules of SPEC §2, each a loss a reader can check against the papers.

refiner_loss:   token-level policy gradient with a k3 KL to the frozen reference (PromptRL), its
                ratio taken against the rollout's log-probs so that stale samples are corrected.
generator_loss: Flow-GRPO's PPO-clipped objective over SDE steps + closed-form Gaussian KL.
"""
from __future__ import annotations

import torch

from experts.flow_sde import gaussian_logp, sde_mean_std, sigma_schedule


def kl3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): e^d - d - 1 with d = log ref - log pi; >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def refiner_loss(policy, reference, batch: dict, adv: torch.Tensor, clip_eps: float, kl_beta: float):
    """Per token PPO-clip(r, A) + beta KL3 with r = exp(logp - logp_rollout), averaged over all valid
    tokens. On-policy (`cluster.max_staleness=0`) r = 1 to float rounding, so the gradient is
    SPEC's rho = exp(logp - sg(logp)); samples made by an older version are corrected by r."""
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
    """Elementwise max(-A r, -A clip(r, 1 - eps, 1 + eps)): PPO's pessimistic bound."""
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))


def ppo_clip_objective(logp, old_logp, adv, clip_eps: float):
    """mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) with r = exp(logp - old_logp)."""
    ratio = torch.exp(logp - old_logp)
    return clipped_surrogate(ratio, adv, clip_eps).mean(), ratio


def generator_loss(policy, reference, batch: dict, adv: torch.Tensor, noise_level: float,
                   clip_eps: float, kl_beta: float):
    """PPO over every SDE step of every trajectory, re-evaluating each recorded transition."""
    states, old_logp = batch["states"], batch["logps"]             # (B, T+1, C, H, W), (B, T)
    b, steps = old_logp.shape
    sigmas = sigma_schedule(steps)
    x, x_next = states[:, :-1].flatten(0, 1), states[:, 1:].flatten(0, 1)
    s = sigmas[:-1].repeat(b).view(-1, 1, 1, 1)
    s_next = sigmas[1:].repeat(b).view(-1, 1, 1, 1)
    text = batch["text"].repeat_interleave(steps, 0)
    pad = batch["text_pad"].repeat_interleave(steps, 0)
    mean, std = sde_mean_std(x, policy(x, s.flatten(), text, pad), s, s_next, noise_level, float(sigmas[1]))
    with torch.no_grad():
        ref_mean, _ = sde_mean_std(x, reference(x, s.flatten(), text, pad), s, s_next, noise_level,
                                   float(sigmas[1]))
    logp = gaussian_logp(x_next, mean, std)
    pg, ratio = ppo_clip_objective(logp, old_logp.flatten(), adv.repeat_interleave(steps), clip_eps)
    kl = (((mean - ref_mean) ** 2) / (2 * std ** 2)).flatten(1).mean(1).mean()
    return pg + kl_beta * kl, {"kl": float(kl.detach()), "ratio_mean": float(ratio.detach().mean())}
