"""Flow-GRPO's SDE sampler for a rectified-flow model, with per-step Gaussian log-probs.

Flow-GRPO (arXiv 2505.05470, sec. 4.2, eq. 9-12) turns the flow's deterministic ODE into an SDE
with the same marginals, so that each sampling step is a Gaussian policy whose log-probability the
PPO ratio can use. Convention (SD3): x_sigma = (1 - sigma) x_data + sigma noise, sampled from
sigma = 1 down to 0. With Delta = sigma_next - sigma < 0 and noise level a (eq. 12's sigma_t):
    std_t = a * sqrt(sigma / (1 - sigma))
    mean  = x (1 + std_t^2 Delta / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) Delta
    x_next = mean + std_t sqrt(-Delta) eps
At sigma = 1 the denominator uses the next sigma instead (as Flow-GRPO's code does), keeping std
finite. The log-prob is averaged over every dimension but the batch, as Flow-GRPO's
`sde_step_with_logprob` does (not summed). Steps outside an SDE window are plain Euler ODE steps
(Flow-GRPO-Fast trains on a window of steps only).
"""
from __future__ import annotations

import math

import torch


def sigma_schedule(steps: int) -> torch.Tensor:
    """Evenly spaced sigmas from 1 to 0 (the tiny DiT's; a diffusers model takes its scheduler's)."""
    return torch.linspace(1.0, 0.0, steps + 1)


def sde_steps(steps: int, window: list[int] | None) -> torch.Tensor:
    """Which of the `steps` transitions are SDE (noise injected, log-prob recorded, trained on):
    those in [window[0], window[1]) (Flow-GRPO-Fast's window; ODE elsewhere), or all of them."""
    mask = torch.zeros(steps, dtype=torch.bool)
    start, end = window if window is not None else (0, steps)
    mask[start:min(end, steps)] = True
    return mask


def sde_mean_std(x, v, sigma, sigma_next, *, noise_level: float, sigma_max: float):
    """Mean and standard deviation of the Gaussian transition x -> x_next (Flow-GRPO eq. 12, sigma
    broadcastable); the std is std_t * sqrt(|Delta|), the Euler-Maruyama step of eq. 11."""
    delta = sigma_next - sigma
    denom = torch.where(sigma >= 1.0, torch.full_like(sigma, sigma_max), sigma)
    std_t = noise_level * torch.sqrt(sigma / (1 - denom))
    mean = x * (1 + std_t ** 2 * delta / (2 * sigma)) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * delta
    return mean, std_t * torch.sqrt(-delta)


def gaussian_logp(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of x_next under N(mean, std^2), averaged over all but the batch dimension (the
    log pi_theta(x_{t-1} | x_t) of Flow-GRPO's ratio, eq. 8, as its code averages it)."""
    lp = -((x_next - mean) ** 2) / (2 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def _bcast(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar sigma shaped to broadcast over a batch like `like`."""
    return s.reshape([1] * like.dim()).expand(like.shape[0], *[1] * (like.dim() - 1))


@torch.no_grad()
def sample(velocity, noise: torch.Tensor, sigmas: torch.Tensor, noise_level: float, *, sde: torch.Tensor):
    """Flow-GRPO's rollout: integrate from noise[:, 0] along `sigmas` (T+1, from 1 down to 0);
    `noise` (B, T+1, ...) holds every Gaussian draw, `velocity(x, sigma)` is the conditioned model,
    and the transitions marked in `sde` (T,) are SDE steps, the others ODE steps.

    Returns the states (B, T+1, ...) and per-step log-probs (B, T) (0 at ODE steps).
    """
    b, steps = noise.shape[0], noise.shape[1] - 1
    x, sigmas = noise[:, 0], sigmas.to(noise.device)
    states, logps = [x], []
    for t in range(steps):
        s, s_next = _bcast(sigmas[t], x), _bcast(sigmas[t + 1], x)
        v = velocity(x, sigmas[t].expand(b))
        if sde[t]:
            mean, std = sde_mean_std(x, v, s, s_next, noise_level=noise_level, sigma_max=float(sigmas[1]))
            x = mean + std * noise[:, t + 1]
            logps.append(gaussian_logp(x, mean, std))
        else:
            x = x + v * (s_next - s)
            logps.append(torch.zeros(b, device=x.device))
        states.append(x)
    return torch.stack(states, 1), torch.stack(logps, 1)
