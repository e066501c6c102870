"""Training a model built in a low-precision dtype (`model.dtype=bfloat16`) without losing its update.

bf16 keeps 8 bits of mantissa: AdamW's step of about lr = 2e-7 on a weight of 0.02 is 1e-5 of it,
far below bf16's spacing of 2^-8, so bf16 weights with bf16 moments barely move. The trainer
therefore keeps every trained parameter in fp32, and with it its gradient and AdamW moments, and
computes in the model's dtype: the forward and backward passes read the trained parameters cast to
that dtype (`computed_in`), the very cast a rollout worker's inference copy gets when it loads the
version (experts/weights.py `model_tensors`), so the trainer runs the program its samples came
from and the on-policy probability ratio stays 1 (to the device's reduction order). Autocast over
fp32 weights would not: its norms, softmax and residual stream run in fp32 where the workers' run
in bf16, a systematic gap the PPO clip sees as off-policy (Flow-GRPO's clip is 1e-4). This is
FSDP2's mixed precision (`fsdp_policy`: fp32 shards, gathered in the model's dtype, gradients
reduced in fp32), which a sharded expert uses instead. Frozen parts (the reference copy, the base
under LoRA) stay in the model's dtype; a LoRA adapter is built in fp32 and trains as it is.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch
from torch import nn

LOW = (torch.bfloat16, torch.float16)


def kept_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a trainer keeps `param` in: fp32 for a trained parameter of a low-precision dtype."""
    return torch.float32 if param.requires_grad and param.dtype in LOW else param.dtype


def keep_trained_in_fp32(model: nn.Module) -> dict[nn.Parameter, torch.dtype]:
    """Cast `model`'s trained parameters of a low-precision dtype to fp32, in place; returns
    {parameter: the dtype it is computed in} for `computed_in`."""
    computed = {}
    for param in model.parameters():
        if kept_dtype(param) != param.dtype:
            computed[param] = param.dtype
            param.data = param.data.float()
    return computed


def accumulate_into(master: nn.Parameter, copy: nn.Parameter) -> None:
    """After a backward pass: the copy's gradient added to the fp32 parameter's, in fp32."""
    master.grad = copy.grad.float() if master.grad is None else master.grad.add_(copy.grad)
    copy.grad = None


@contextmanager
def computed_in(model: nn.Module, computed: dict[nn.Parameter, torch.dtype]) -> Iterator[None]:
    """Within it, `model` computes with its fp32 parameters in `computed` cast to their dtype
    there (leaf copies, made once); each backward pass's gradient of a copy is added to its
    parameter's `.grad` in fp32 as soon as it is accumulated, so micro-batches add up in fp32."""
    copies, hooks = {}, []
    for master, dtype in computed.items():
        copy = nn.Parameter(master.detach().to(dtype))
        hooks.append(copy.register_post_accumulate_grad_hook(partial(accumulate_into, master)))
        copies[id(master)] = copy
    slots = [(module, key, p) for module in model.modules() for key, p in module._parameters.items()
             if p is not None and id(p) in copies]  # every place a (tied) parameter is held
    for module, key, p in slots:
        setattr(module, key, copies[id(p)])
    try:
        yield
    finally:
        for module, key, p in slots:
            setattr(module, key, p)
        for hook in hooks:
            hook.remove()


def fsdp_policy(computed: dict[nn.Parameter, torch.dtype]):
    """FSDP2's mixed precision for a model whose trained parameters `keep_trained_in_fp32` cast:
    gathered in the dtype they are computed in, gradients reduced in fp32, the forward's inputs
    left as the model's own code casts them (as on a rollout worker)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    dtypes = set(computed.values())
    if len(dtypes) > 1:
        raise ValueError(f"trained parameters computed in several dtypes {sorted(map(str, dtypes))}; FSDP "
                         f"gathers a model in one")
    return MixedPrecisionPolicy(param_dtype=next(iter(dtypes), None), reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
