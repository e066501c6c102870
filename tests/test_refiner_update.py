"""The refiner update in micro-batches with the LM head only where tokens were generated: the same
loss, stats and gradient as one forward over every sequence with full-vocabulary logits at every
position (written out here as the reference), for the tiny LM and a tiny Qwen2-style HF LM (left
padding, an early end), whatever the micro-batch and on a rank's share of the batch."""
import pytest
import torch
import torch.nn.functional as F

from algorithm.losses import refiner_loss
from experts.kinds import build_model, expert_kind
from experts.parallel import Gang
from tasks.shapes import EOS, PAD, prompt_set
from tests.conftest import make_config

N, CLIP, BETA = 7, 0.2, 0.05

pytestmark = pytest.mark.usefixtures("one_thread")


class FullLogits:
    """`model`'s log-probs of generated tokens as one forward over prompt + tokens with the head
    and the fp32 log-softmax at every position, sliced afterwards (the update before micro-batching)."""

    def __init__(self, model):
        self.model = model

    def token_logprobs(self, prompts, tokens, mask):
        m = self.model
        if hasattr(m, "lm"):  # experts/hf_refiner.py
            ids, attention = m.left_pad(prompts)
            attention = torch.cat([attention, mask.long()], 1)
            logits = m.lm(input_ids=torch.cat([ids, tokens], 1), attention_mask=attention,
                          position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
            lp = F.log_softmax(logits[:, ids.shape[1] - 1:-1].float() / m.temperature, dim=-1)
            return torch.where(mask, lp.gather(2, tokens[:, :, None]).squeeze(2), 0.0)
        ctx = m.context(prompts)
        seq = torch.cat([ctx, tokens], 1)
        lp = m.logprobs(seq, seq.shape[1])[:, ctx.shape[1] - 1:-1]
        return torch.where(tokens == PAD, 0.0, lp.gather(2, tokens[:, :, None]).squeeze(2))


def lm_config(kind: str):
    model = "experts.refiner_0.model={kind: hf_causal_lm, path: 'tiny:qwen2', answer_tag: null}"
    return make_config(*([model] if kind == "hf" else []), "experts.refiner_0.max_new_tokens=6",
                       f"experts.refiner_0.kl_beta={BETA}", f"experts.refiner_0.clip_eps={CLIP}", preset="shapes-tiny")


def head_of(model) -> torch.nn.Module:
    return model.lm.get_output_embeddings() if hasattr(model, "lm") else model.head


@pytest.fixture(scope="module", params=["tiny", "hf"])
def setup(request):
    """(config, policy moved off its reference, reference, a batch of N sequences of prompts of
    different lengths with one ended early, advantages)."""
    torch.manual_seed(0)
    config = lm_config(request.param)
    policy, reference = build_model(config, "refiner_0"), build_model(config, "refiner_0").requires_grad_(False)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    prompts = [policy.prompt_ids(p) for p in prompt_set(N, seed=3)]
    assert len({len(p) for p in prompts}) > 1  # left padding
    tokens, logps, mask = policy.sample(prompts, torch.rand(N, 6, generator=torch.Generator().manual_seed(0)))
    end, pad = (policy.eos, policy.pad) if hasattr(policy, "lm") else (EOS, PAD)
    tokens[0, 2], tokens[0, 3:], mask[0, 3:] = end, pad, False  # the first sequence ends after 3 tokens
    with torch.no_grad():  # log-probs of an older version: ratios off 1, some clipped
        logps = FullLogits(policy).token_logprobs(prompts, tokens, mask)
        logps = torch.where(mask, logps + 0.3 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1)), 0.0)
    batch = {"prompts": prompts, "tokens": tokens, "logps": logps, "mask": mask}
    return config, policy, reference, batch, torch.linspace(-1, 1, N)


def gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


def test_micro_batches_and_rank_shares_give_the_whole_batchs_loss_and_gradient(setup):
    config, policy, reference, batch, adv = setup
    policy.zero_grad(set_to_none=True)
    loss, stats = refiner_loss(FullLogits(policy), FullLogits(reference), batch, adv, clip_eps=CLIP, kl_beta=BETA)
    loss.backward()
    whole = gradient(policy)
    assert whole.abs().sum() > 0 and stats["kl"] > 0 and abs(stats["ratio_mean"] - 1) > 1e-3
    kind = expert_kind(config, "refiner_0")
    for micro, ranks in ((None, 1), (3, 1), (3, 2)):  # 3 divides neither 7 nor a rank's 4 or 3
        kind.spec.micro_batch = micro
        policy.zero_grad(set_to_none=True)
        total, kl, ratio, passes = 0.0, 0.0, 0.0, []
        for rank in range(ranks):
            rows = Gang(rank, ranks, "ddp", 1).rows(N) if ranks > 1 else None
            done = []
            hook = head_of(policy).weight.register_hook(lambda g: done.append(1))
            part, part_stats = kind.backward(policy, reference, batch, adv, rows=rows,
                                             before_last=lambda: passes.append(len(done)))
            hook.remove()
            total, kl, ratio = total + part, kl + part_stats["kl"], ratio + part_stats["ratio_mean"]
            share = N if rows is None else len(rows)
            assert passes[-1] == len(done) - 1 == -(-share // (micro or share)) - 1  # before the last pass only
        assert abs(total - float(loss.detach())) < 1e-5 and abs(kl - stats["kl"]) < 1e-5, micro
        assert abs(ratio - stats["ratio_mean"]) < 1e-5, micro
        torch.testing.assert_close(gradient(policy), whole, rtol=1e-5, atol=1e-5)


def test_the_head_runs_only_where_tokens_are_scored(setup):
    """Scoring M generated tokens after a P-token context computes logits at M positions, not P + M;
    sampling's first forward at the last position only."""
    _, policy, _, batch, _ = setup
    shapes = []
    hook = head_of(policy).register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    try:
        policy.token_logprobs(batch["prompts"], batch["tokens"], batch["mask"])
        m = batch["tokens"].shape[1]
        assert shapes == [(N, m, shapes[0][-1])]
        shapes.clear()
        with torch.no_grad():
            policy.sample(batch["prompts"], torch.rand(N, m, generator=torch.Generator().manual_seed(5)))
        assert shapes and all(s[:2] == (N, 1) for s in shapes)
    finally:
        hook.remove()
