"""The per-expert update rules of SPEC §2, each a loss a reader can check against the papers.

refiner_loss:   token-level policy gradient with a k3 KL to the frozen reference (PromptRL).
generator_loss: Flow-GRPO's PPO-clipped objective over SDE steps + closed-form Gaussian KL.
"""
from __future__ import annotations

import torch

from experts.flow_sde import gaussian_logp, sde_mean_std, sigma_schedule


def kl3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): e^d - d - 1 with d = log ref - log pi; >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def refiner_loss(policy, reference, batch: dict, adv: torch.Tensor, kl_beta: float):
    """Per token -(rho A - beta KL3), rho = exp(logp - sg(logp)), averaged over all valid tokens."""
    logp = policy.token_logprobs(batch["prompts"], batch["tokens"])
    with torch.no_grad():
        ref_logp = reference.token_logprobs(batch["prompts"], batch["tokens"])
    mask = batch["mask"].float()
    rho = torch.exp(logp - logp.detach())
    kl = kl3(logp, ref_logp)
    per_token = -(rho * adv[:, None] - kl_beta * kl)
    n = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n
    behaviour_ratio = (torch.exp(logp.detach() - batch["logps"]) * mask).sum() / n
    return loss, {"kl": float((kl.detach() * mask).sum() / n), "ratio_mean": float(behaviour_ratio)}


def ppo_clip_objective(logp, old_logp, adv, clip_eps: float):
    """mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) with r = exp(logp - old_logp)."""
    ratio = torch.exp(logp - old_logp)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps)).mean()
    return loss, ratio


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
