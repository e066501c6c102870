"""The per-expert update rules, each a loss a reader can check against its paper.

refiner_loss:   GRPO's token-level objective (arXiv 2402.03300, eq. 3) as PromptRL trains its
                prompt rewriter (arXiv 2602.01382, sec. 3.2): PPO-clipped ratio times the
                sequence's advantage plus beta * k3 KL to the frozen reference (GRPO eq. 4), the
                ratio taken against the rollout's log-probs so that stale samples are corrected.
                Convention: averaged over all valid tokens of the batch (TRL's `dapo`/`bnpo` loss
                types, verl's `token-mean`), not the mean of per-sequence means of GRPO's eq. 3.
                Its gradient is accumulated `micro_batch` sequences at a time, each part's
                token sum divided by the whole batch's token count (`refiner_backward`), so the
                update's memory is one part's.
generator_loss: Flow-GRPO's objective (arXiv 2505.05470, eq. 8): PPO-clipped ratio of each SDE
                step's Gaussian log-prob, averaged over trained steps and samples, plus beta * KL.
                Its gradient is accumulated one micro-batch of transitions at a time (by default one
                step of every sample, as Flow-GRPO's training loop backpropagates per timestep), so
                the update's memory does not grow with the number of trained steps.
                KL conventions (`kl_form`): "exact" is the exact KL between the policy's and the
                reference's step Gaussians, ||mu_theta - mu_ref||^2 / (2 std^2) with std^2 =
                std_t^2 |Delta sigma| the transition variance, averaged over dimensions; "flow_grpo"
                is Flow-GRPO's code's, ||mu_theta - mu_ref||^2 / (2 std_t^2), which divides by std_t^2
                alone: exact * |Delta sigma| (15-25x smaller on SD3.5 with 10 steps), the form in
                which Flow-GRPO's beta values were published.
                With beta = 0 the reference is not evaluated (its KL is reported as 0).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from algorithm.sde import gaussian_logp, sde_mean_std


def kl3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) (GRPO eq. 4): e^d - d - 1 with d = log ref - log pi; >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def refiner_loss(policy, reference, batch: dict, adv: torch.Tensor, *, clip_eps: float, kl_beta: float,
                 tokens: float | None = None):
    """Per token PPO-clip(r, A) + beta KL3 with r = exp(logp - logp_rollout), averaged over all valid
    tokens (`tokens`: the count to divide by, if not this batch's own, as for one rank's share of a
    step's batch). On-policy (`cluster.max_staleness=0`) r = 1 to float rounding, so the gradient is that
    of rho = exp(logp - sg(logp)), GRPO's single-update case; samples made by an older version are
    corrected by r. Its stats: the KL, the mean ratio, and the mean and largest |logp -
    logp_rollout| per token (on-policy, the error of the rollout's sampler: an inference engine's
    log-probs against the trainer's)."""
    logp = policy.token_logprobs(batch["prompts"], batch["tokens"], batch["mask"])
    mask = batch["mask"].float()
    ratio = torch.exp(logp - batch["logps"])
    per_token, kl = clipped_surrogate(ratio, adv[:, None], clip_eps), torch.zeros_like(logp)
    if kl_beta:
        with torch.no_grad():
            ref_logp = reference.token_logprobs(batch["prompts"], batch["tokens"], batch["mask"])
        kl = kl3(logp, ref_logp)
        per_token = per_token + kl_beta * kl
    n = mask.sum().clamp(min=1.0) if tokens is None else max(tokens, 1.0)
    loss = (per_token * mask).sum() / n
    gap = (logp.detach() - batch["logps"]).abs() * mask  # |trainer - rollout| per token: the sampler's error on-policy
    return loss, {"kl": float((kl.detach() * mask).sum() / n), "ratio_mean": float((ratio.detach() * mask).sum() / n),
                  "logprob_gap": float(gap.sum() / n), "logprob_gap_max": float(gap.max()) if gap.numel() else 0.0}


def sequences(batch: dict, rows: torch.Tensor) -> dict:
    """The refiner token batch's sequences `rows` (prompts, tokens, rollout log-probs, mask)."""
    return {"prompts": [batch["prompts"][i] for i in rows.tolist()],
            **{k: batch[k][rows.to(batch[k].device)] for k in ("tokens", "logps", "mask")}}


def refiner_backward(policy, reference, batch: dict, adv: torch.Tensor, *, clip_eps: float, kl_beta: float,
                     micro_batch: int | None = None, rows: torch.Tensor | None = None,
                     before_last: Callable[[], None] | None = None, pad_to: int | None = None):
    """Backpropagate `refiner_loss` of the batch `micro_batch` sequences at a time (None: all at
    once), each part divided by the whole batch's valid tokens, so that the parts add up to the
    whole batch's loss and gradient (to float rounding); returns (loss, stats). `rows`: only these
    sequences' part, still divided by the whole batch's count (one rank's share). `before_last`
    runs before the last backward pass (a sharded model that held back its gradient reduction
    until then turns it on). `pad_to`: the largest rank's share, whose number of passes this one
    makes too (`padded`)."""
    rows = torch.arange(len(batch["prompts"])) if rows is None else rows
    parts = list(rows.split(micro_batch or max(len(rows), 1)))
    passes = -(-pad_to // micro_batch) if pad_to and micro_batch else len(parts)
    tokens = float(batch["mask"].sum())
    loss, stats = 0.0, {"kl": 0.0, "ratio_mean": 0.0, "logprob_gap": 0.0, "logprob_gap_max": 0.0}
    for i, (part, counted) in enumerate(padded(parts, passes)):
        part_loss, part_stats = refiner_loss(policy, reference, sequences(batch, part), adv[part.to(adv.device)],
                                             clip_eps=clip_eps, kl_beta=kl_beta, tokens=tokens)
        if before_last is not None and i == passes - 1:
            before_last()
        (part_loss if counted else part_loss * 0.0).backward()
        if counted:
            loss += float(part_loss.detach())
            stats = {k: max(v, part_stats[k]) if k.endswith("_max") else v + part_stats[k] for k, v in stats.items()}
    return loss, stats


def padded(parts: list, passes: int) -> list[tuple[object, bool]]:
    """`parts`, then its last part again up to `passes` in all, each with whether it counts. Under
    FSDP every pass gathers each block's shards and reduces its gradient across the ranks, so a rank
    whose share is smaller makes the extra passes with zero weight rather than stop early and leave
    the others waiting in a collective it never joins."""
    return [(part, True) for part in parts] + [(parts[-1], False)] * (passes - len(parts))


def clipped_surrogate(ratio, adv, clip_eps: float):
    """Elementwise max(-A r, -A clip(r, 1 - eps, 1 + eps)): PPO's pessimistic bound (arXiv 1707.06347, eq. 7)."""
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))


@dataclass(frozen=True)
class GeneratorObjective:
    """The knobs of Flow-GRPO's generator loss (experts.generator's config)."""
    noise_level: float
    clip_eps: float
    kl_beta: float
    kl_form: str = "exact"          # "exact" | "flow_grpo" (module docstring)
    train_final_step: bool = True   # False: the last (sigma -> 0) step is sampled but not trained
    micro_batch: int | None = None  # transitions per backward pass; None: one step of every sample


def trained_steps(sde: torch.Tensor, train_final_step: bool) -> torch.Tensor:
    """The steps the loss trains on: the SDE steps (only they have a log-prob to match), without
    the last step unless `train_final_step` (Flow-GRPO trains on all but the last by default: its
    timestep_fraction 0.99; that step's std is tiny and its ratio unstable)."""
    steps = sde.nonzero().flatten()
    return steps if train_final_step else steps[steps != len(sde) - 1]


def kept_states(steps: torch.Tensor) -> torch.Tensor:
    """The states the loss reads when it trains `steps`: x_t and x_{t+1} of each, as sorted step
    indices (a rollout keeps only these)."""
    return torch.unique(torch.cat([steps, steps + 1]))


def state_at(batch: dict, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x_t of samples `rows` at steps `steps`, among the states kept at `batch["state_steps"]`."""
    return batch["states"][rows, torch.searchsorted(batch["state_steps"], steps)]


def transition_chunks(samples: torch.Tensor, steps: torch.Tensor, micro_batch: int | None) -> list[tuple]:
    """Every (sample, step) transition of `samples` to train, ordered by step then sample, in chunks
    of `micro_batch` (None: one step of every sample per chunk): [(sample indices, step indices)]."""
    rows, cols = samples.repeat(len(steps)), steps.repeat_interleave(len(samples))
    size = micro_batch or len(samples)
    return [(rows[i:i + size], cols[i:i + size]) for i in range(0, len(rows), size)]


def step_kl(mean, ref_mean, std, delta, *, kl_form: str) -> torch.Tensor:
    """Per transition, KL(policy step || reference step) in `kl_form` (module docstring), averaged
    over dimensions; `delta` = |sigma_next - sigma| broadcast like `mean`."""
    exact = (((mean - ref_mean) ** 2) / (2 * std ** 2)).flatten(1).mean(1)
    return exact * delta.flatten() if kl_form == "flow_grpo" else exact


def transition_losses(policy, reference, batch: dict, adv: torch.Tensor, *, rows, cols, obj: GeneratorObjective):
    """PPO-clip + beta KL of each transition (rows[i], cols[i]), re-evaluated with the policy;
    (losses, KLs, ratios), one per transition. `batch` holds the states x_t (B, S, ...) at the steps
    `state_steps` (S,) (those of the trained transitions, `kept_states`), log-probs (B, T), the
    sigmas (T+1,), the per-sample conditioning `cond` and the conditioning every sample shares,
    `shared_cond` (the empty prompt's under guidance, one row the model broadcasts)."""
    sigmas = batch["sigmas"]
    x, x_next = state_at(batch, rows, cols), state_at(batch, rows, cols + 1)
    shape = (-1, *[1] * (x.dim() - 1))
    s, s_next = sigmas[cols].view(shape), sigmas[cols + 1].view(shape)
    cond = {**{name: v[rows] for name, v in batch["cond"].items()}, **batch["shared_cond"]}
    sigma_max = float(sigmas[1])
    mean, std = sde_mean_std(x, policy(x, s.flatten(), **cond), s, s_next, noise_level=obj.noise_level,
                             sigma_max=sigma_max)
    ratio = torch.exp(gaussian_logp(x_next, mean, std) - batch["logps"][rows, cols])
    losses = clipped_surrogate(ratio, adv[rows], obj.clip_eps)
    kl = torch.zeros_like(losses)
    if obj.kl_beta:
        with torch.no_grad():
            ref_mean, _ = sde_mean_std(x, reference(x, s.flatten(), **cond), s, s_next, noise_level=obj.noise_level,
                                       sigma_max=sigma_max)
        kl = step_kl(mean, ref_mean, std, s - s_next, kl_form=obj.kl_form)
        losses = losses + obj.kl_beta * kl
    return losses, kl.detach(), ratio.detach()


def generator_backward(policy, reference, batch: dict, adv: torch.Tensor, *, obj: GeneratorObjective,
                       samples: torch.Tensor | None = None, before_last: Callable[[], None] | None = None,
                       pad_to: int | None = None):
    """Backpropagate the mean over trained transitions of `transition_losses`, one chunk at a time
    (the gradient is the full batch's, to float rounding); returns (loss, stats). `samples`: only
    these samples' transitions, still divided by the whole batch's count (one rank's share).
    `before_last` runs before the last backward pass (a sharded model that held back its gradient
    reduction until then turns it on). `pad_to`: the largest rank's share, whose number of passes
    this one makes too (`padded`)."""
    steps = trained_steps(batch["sde"], obj.train_final_step)
    n_samples = batch["states"].shape[0]
    chunks = transition_chunks(torch.arange(n_samples) if samples is None else samples, steps, obj.micro_batch)
    passes = len(transition_chunks(torch.arange(pad_to), steps, obj.micro_batch)) if pad_to else len(chunks)
    n = len(steps) * n_samples
    loss, kl, ratio = 0.0, 0.0, 0.0
    for i, ((rows, cols), counted) in enumerate(padded(chunks, passes)):
        losses, kls, ratios = transition_losses(policy, reference, batch, adv, rows=rows, cols=cols, obj=obj)
        part = losses.sum() / n
        if before_last is not None and i == passes - 1:
            before_last()
        (part if counted else part * 0.0).backward()
        if counted:
            loss, kl, ratio = loss + float(part.detach()), kl + float(kls.sum()) / n, ratio + float(ratios.sum()) / n
    return loss, {"kl": kl, "ratio_mean": ratio}
