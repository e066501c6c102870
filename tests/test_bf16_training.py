"""bf16 training that trains (experts/precision.py): a bf16 model's trained parameters are kept in
fp32, with fp32 gradients and AdamW moments, and computed in bf16 exactly as a rollout worker's
bf16 copy computes; frozen parts stay bf16. At lr 2e-7, where bf16 weights with bf16 moments
barely move, 10 AdamW steps move a tiny HF refiner, a tiny SD3 transformer and its LoRA adapter as
fp32 AdamW does; a one-rank FSDP2 expert computes the same; a snapshot restores the update exactly."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from algorithm.losses import kept_states, trained_steps
from algorithm.sde import sample, sde_steps
from cluster.collective import layout
from experts.expert import Expert
from experts.frontend import build_frontend
from experts.kinds import build_model
from experts.parallel import GangSpec
from experts.trajectories import split_shared, trajectories
from experts.weights import model_tensors, synced_state, travel_form, travelled
from tasks.base import TextPrompt
from tasks.shapes import prompt_set
from tests.conftest import gradients_applied, make_config

LR, STEPS, N = 2e-7, 10, 4

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {  # expert id, its model section
    "refiner": ("refiner_0", "{kind: hf_causal_lm, path: 'tiny:qwen2', dtype: DTYPE, answer_tag: null}"),
    "generator": ("generator", "{kind: diffusers_flow, path: 'tiny:sd3', dtype: DTYPE, max_sequence_length: 8}"),
    "lora": ("generator", "{kind: diffusers_flow, path: 'tiny:sd3', dtype: DTYPE, max_sequence_length: 8, "
                          "lora: {r: 4, alpha: 8}}"),
}


def config(case: str, dtype: str, *extra: str):
    eid, model = CASES[case]
    return make_config(f"experts.{eid}.model={model.replace('DTYPE', dtype)}", f"experts.{eid}.lr={LR}",
                       "experts.refiner_0.max_new_tokens=6", "experts.generator.sample_steps=2",
                       "experts.generator.clip_eps=0.2", *extra, preset="shapes-tiny")


def started(case: str, expert: Expert) -> Expert:
    """The expert at its start: a LoRA adapter as it is once trained a while (lora_B away from its
    zeros, which bf16 resolves at any scale), in values bf16 holds exactly, the same in every run."""
    if case == "lora":
        with torch.no_grad():
            for i, p in enumerate(expert.trainable):
                p.copy_((0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i))).bfloat16())
    return expert


def rollout(case: str, expert: Expert) -> dict:
    """A rollout's batch for `expert`, made by a worker's inference copy (built in the model's
    dtype) that was given the expert's version 0 as it travels."""
    worker = build_model(expert.config, expert.expert_id).eval()
    worker.load_state_dict(model_tensors(worker, expert.weights()), strict=False)
    torch.manual_seed(0)
    with torch.no_grad():
        if case == "refiner":
            prompts = [worker.prompt_ids(p) for p in prompt_set(N, seed=3)]
            tokens, logps, mask = worker.sample(prompts, torch.rand(N, 6, generator=torch.Generator().manual_seed(0)))
            return {"prompts": prompts, "tokens": tokens.numpy(), "logps": logps.numpy(), "mask": mask.numpy()}
        frontend = build_frontend(expert.config)
        cond = frontend.condition([TextPrompt(p.text) for p in prompt_set(N, seed=3)], [{} for _ in range(N)])
        sigmas, sde = frontend.sigmas(2), sde_steps(2, None)
        noise = torch.randn((N, 3, *frontend.latent_shape), generator=torch.Generator().manual_seed(1))
        states, logps = sample(lambda x, s: worker(x, s, **cond), noise, sigmas, 0.7, sde=sde)
    kept = kept_states(trained_steps(sde, True))
    per_sample, shared = split_shared(cond)
    return trajectories(states[:, kept], kept, logps, per_sample, shared_cond=shared, sigmas=sigmas, sde=sde)


def as_bf16_start(expert: Expert) -> Expert:
    """An fp32 expert started from the bf16 model's weights (its own rounded to bf16), reference too."""
    with torch.no_grad():
        for module in (expert.model, expert.reference):
            for p in module.parameters() if isinstance(module, torch.nn.Module) else ():
                p.copy_(p.to(torch.bfloat16).float())
    return expert


def as_before(expert: Expert) -> Expert:
    """The bf16 training before fp32 was kept: bf16 trained parameters, gradients and AdamW moments."""
    for p in expert.trainable:
        p.data = p.data.bfloat16()
    expert.computed = {}
    expert.optimizer = torch.optim.AdamW(expert.trainable, lr=LR)
    return expert


def train(expert: Expert, batch: dict) -> tuple[torch.Tensor, torch.Tensor, list[dict], list[torch.Tensor]]:
    """(the update of the trained weights after STEPS AdamW steps on `batch`, that of fp32 AdamW
    given the same gradients each step, each step's stats, the last step's gradients)."""
    start = [p.detach().float().clone() for p in expert.trainable]
    shadow = [p.clone().requires_grad_() for p in start]
    fp32_adamw = torch.optim.AdamW(shadow, lr=LR)
    stats = []
    with gradients_applied(expert) as applied:
        for step in range(STEPS):
            stats.append(expert.update(step, step, np.linspace(-1, 1, N), batch))
            for s, g in zip(shadow, applied[-1]):
                s.grad = g.float()
            fp32_adamw.step()
    moved = torch.cat([(p.detach().float() - s).flatten() for p, s in zip(expert.trainable, start)])
    return moved, torch.cat([(p.detach() - s).flatten() for p, s in zip(shadow, start)]), stats, applied[-1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", list(CASES))
def test_ten_adamw_steps_at_lr_2e_7_move_bf16_weights_as_fp32_does(case):
    eid = CASES[case][0]
    expert = started(case, Expert(config(case, "bfloat16"), eid))
    assert {p.dtype for p in expert.trainable} == {torch.float32}
    frozen = [p for p in expert.model.parameters() if not p.requires_grad] if case == "lora" else \
        list(expert.reference.parameters())
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}  # the base under LoRA, the reference copy
    batch = rollout(case, expert)
    moved, fp32_adamw, stats, grads = train(expert, batch)
    assert {g.dtype for g in grads} == {torch.float32}
    assert {v.dtype for s in expert.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    assert stats[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # the trainer computes as the bf16 worker did
    fp32_run, *_ = train(started(case, as_bf16_start(Expert(config(case, "float32"), eid))), batch)
    old, old_fp32_adamw, *_ = train(as_before(started(case, Expert(config(case, "bfloat16"), eid))), batch)
    # from the gradients it computes, the update is fp32 AdamW's; bf16 weights and moments lose it
    assert rel(moved, fp32_adamw) <= 1e-2 < rel(old, old_fp32_adamw)
    # against the fp32 model's run: the bf16 program rounds its gradients (about 1-2 %), which AdamW's
    # per-element normalisation turns into whole steps of either sign where a gradient is near 0
    assert rel(moved, fp32_run) <= 0.3 < 0.9 < rel(old, fp32_run), (rel(moved, fp32_run), rel(old, fp32_run))
    print(f"{case}: {moved.numel()} trained elements; update relative difference to fp32 AdamW on the same "
          f"gradients {rel(moved, fp32_adamw):.2g} (before: {rel(old, old_fp32_adamw):.3g}); to the fp32 run "
          f"{rel(moved, fp32_run):.3g} (before: {rel(old, fp32_run):.3g}); elements moved "
          f"{float((moved != 0).float().mean()):.4f}, fp32 run {float((fp32_run != 0).float().mean()):.4f}, "
          f"before {float((old != 0).float().mean()):.4f}")


def test_lora_adapters_are_fp32_on_a_bf16_base_in_every_copy():
    """diffusers' add_adapter casts the generator's adapter to the transformer's dtype (cast back);
    peft's get_peft_model keeps the refiner's in fp32 (checked): trainer and worker build the same."""
    cfg = config("lora", "bfloat16", "experts.refiner_0.model={kind: hf_causal_lm, path: 'tiny:qwen2', "
                                     "dtype: bfloat16, lora: {r: 4, alpha: 8}}")
    for eid in ("generator", "refiner_0"):
        model = build_model(cfg, eid)
        adapter = {p.dtype for n, p in model.named_parameters() if "lora_" in n and p.requires_grad}
        base = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and not p.requires_grad}
        assert (adapter, base) == ({torch.float32}, {torch.bfloat16}), eid


@pytest.mark.parametrize("case", ["refiner", "lora"])
def test_a_version_travels_as_the_trainer_keeps_it_and_a_worker_casts_it(case):
    """fp32 where the trainer keeps it (a version restores exactly), cast to the worker copy's dtype
    on load; a broadcast is received in the trainer's layout."""
    expert = Expert(config(case, "bfloat16"), CASES[case][0])
    worker = build_model(expert.config, expert.expert_id)
    arrays = expert.weights()
    assert {a.dtype for a in arrays.values()} == {np.dtype(np.float32)}
    loaded = model_tensors(worker, arrays)
    own = synced_state(worker)
    assert all(loaded[k].dtype == own[k].dtype for k in own)
    assert {v.dtype for v in own.values()} == ({torch.float32} if case == "lora" else {torch.bfloat16})
    assert layout(travelled(worker)) == layout(travel_form(synced_state(expert.model)))


def test_a_snapshot_of_a_bf16_expert_continues_bit_for_bit():
    cfg = config("generator", "bfloat16")
    expert = Expert(cfg, "generator")
    batch = rollout("generator", expert)
    adv = np.linspace(-1, 1, N)
    expert.update(0, 0, adv, batch)
    snapshot = expert.snapshot()
    expert.update(1, 1, adv, batch)
    restored = Expert(cfg, "generator")
    restored.restore(*snapshot)
    restored.update(1, 1, adv, batch)
    assert all(torch.equal(a, b) for a, b in zip(expert.model.parameters(), restored.model.parameters()))


def test_a_sharded_bf16_expert_computes_and_keeps_as_one_process_does():
    """FSDP2 with mixed precision (one rank on gloo): gathered in bf16 for the same forward as the
    one-process expert's, gradients reduced into fp32 shards (their bf16 sums taken in another
    order: equal to bf16 rounding), fp32 moments, its whole weights gathered in fp32."""
    cfg = config("generator", "bfloat16", "experts.generator.parallel.ranks=2",
                 "experts.generator.parallel.strategy=fsdp")
    one, sharded = Expert(cfg, "generator"), Expert(cfg, "generator")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        sharded.join_gang(GangSpec("127.0.0.1", store.port, 1, 1, "gloo", 60.0), 0)
        batch = rollout("generator", one)
        stats, grads = [], []
        for expert in (one, sharded):
            with gradients_applied(expert) as applied:
                stats.append(expert.update(0, 0, np.linspace(-1, 1, N), batch))
            grads.append(torch.cat([g.full_tensor().flatten() if isinstance(g, DTensor) else g.flatten()
                                    for g in applied[0]]))
        assert all(p.grad is None for p in [*one.trainable, *sharded.trainable])  # freed once applied
        mine, theirs = sharded.weights(), one.weights()
        kept = {name: p.detach().to_local() for name, p in sharded.model.named_parameters()}
    finally:
        dist.destroy_process_group()
    norms = [s.pop("grad_norm") for s in stats]  # of gradients reduced in another order: as close as they
    assert stats[0] == stats[1]  # the same loss, KL and ratio: the same forward passes
    assert norms[1] == pytest.approx(norms[0], rel=1e-2)
    assert {g.dtype for g in grads} == {torch.float32} and rel(grads[1], grads[0]) <= 1e-2
    assert {v.dtype for s in sharded.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    assert {k: a.dtype for k, a in mine.items()} == {k: a.dtype for k, a in theirs.items()}
    assert all(kept[k].dtype == torch.float32 and np.array_equal(mine[k], kept[k].numpy()) for k in kept)
    assert max(float(np.abs(mine[k] - theirs[k]).max()) for k in mine) <= 2.5 * LR  # within one AdamW step
