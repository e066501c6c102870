"""A Hugging Face causal LM refiner served by a vLLM engine on a rollout worker (`engine: vllm`).

It stands where the worker's `HFRefiner` copy would (experts/hf_refiner.py) and reads and writes
the same text (`ChatRefiner`), but samples with vLLM's offline `LLM` (in the worker's process:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`), each sample's draws seeded by the request's own seed, so a
sample comes out the same in any batch and on any worker. It returns the engine's log-probs of the
sampled tokens at the sampling temperature (`logprobs_mode=processed_logprobs`: after temperature,
as the trainer's `log_softmax(logits / T)`); the trainer recomputes them with its own model, as
for the HF path, and the difference is logged (refiner/<id>/logprob_gap).

A version reaches the engine in place, without a restart: full weights through the worker's
`reload_weights` (vLLM's in-place reload, checkpoint names), a LoRA adapter as a new LoRA request
read from a folder written per version. The model it mirrors lives on the meta device: it names
the tensors of a version, their shapes and dtypes (what the weight sync checks and casts to), and
holds none of them.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from common.hub import local_model
from common.loading import DTYPES, load_tokenizer
from experts.hf_refiner import ChatRefiner, with_adapter

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the worker's process
              "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # on CPU: the worker's torch threads, not every core
              "VLLM_LOGGING_LEVEL": "WARNING",  # not a page of INFO lines per engine start
              "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout is the CLI's (`jointrl plan --json`)
LM_PREFIX = "lm."  # the trained model's state_dict names the causal LM under `lm`


class EngineLoadError(RuntimeError):
    """The engine could not take a version of the refiner's weights."""


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its LoRA buffers for


def lora_rank_slot(r: int) -> int:
    """The smallest rank vLLM allocates for that holds an adapter of rank `r`."""
    fits = [slot for slot in LORA_RANK_SLOTS if slot >= r]
    if not fits:
        raise ValueError(f"a LoRA adapter of rank {r}: vLLM serves ranks up to {LORA_RANK_SLOTS[-1]}")
    return fits[0]


def engine_environment() -> None:
    """vLLM's settings for an engine inside a jointrl process (each unless the user set it), read
    when vllm is first imported: call before."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def engine_dtype(spec) -> str:
    return spec.vllm.dtype or spec.model.dtype


class VllmRefiner(ChatRefiner):
    def __init__(self, spec, expert_id: str, seed: int):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM
        m, e = spec.model, spec.vllm
        self.spec, self.expert_id, self.max_new_tokens, self.temperature = m, expert_id, spec.max_new_tokens, \
            spec.temperature
        path = local_model(m.path, m.revision)
        self.tokenizer = load_tokenizer(path)
        dtype = engine_dtype(spec)
        with torch.device("meta"):  # names, shapes and dtypes of a version; no memory
            lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=DTYPES[dtype])
            self.lm = with_adapter(lm, m.lora, seed) if m.lora else lm
        self.special_ids(self.lm.config.eos_token_id)
        engine_environment()
        from vllm import LLM
        from vllm.platforms import current_platform
        lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": lora_rank_slot(m.lora.r)} if m.lora else {}
        cache = {"kv_cache_memory_bytes": int(e.kv_cache_gib * 2 ** 30)} if e.kv_cache_gib else {}
        # on CPU, a seeded request whose prefill is split fails (vLLM 0.32 rewinds its generator by an
        # offset, which a CPU generator has not): prompts are prefilled whole there
        whole = {"enable_chunked_prefill": False} if current_platform.is_cpu() else {}
        self.engine = LLM(model=str(path), tokenizer=str(path), dtype=dtype, seed=seed % 2 ** 32,
                          gpu_memory_utilization=e.gpu_memory_utilization, max_model_len=e.max_model_len,
                          enforce_eager=e.enforce_eager, logprobs_mode="processed_logprobs", **lora, **cache, **whole)
        self.max_model_len = self.engine.llm_engine.model_config.max_model_len
        self.threads = torch.get_num_threads()  # as the worker set them, before the engine's start
        self.adapters = Path(tempfile.mkdtemp(prefix=f"jointrl-{expert_id}-lora-")) if m.lora else None
        self.adapter = None  # the LoRA request of the version served (None: the base, as a fresh adapter is)
        self.loads = 0

    def _apply(self, fn, recurse=True):
        """`.to(device)` and the like: the engine placed itself, and the mirror holds no tensors."""
        return self

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], seeds: list[int]):
        """Up to max_new_tokens per context, each drawn by the engine under its own `seeds` entry.
        Returns tokens (B, M) (pad after the end), the engine's log-probs (B, M) and a validity
        mask (B, M), on the host."""
        from vllm import SamplingParams
        too_long = [len(p) for p in prompts if len(p) + self.max_new_tokens > self.max_model_len]
        if too_long:
            raise ValueError(f"experts.{self.expert_id}: a prompt of {max(too_long)} tokens + max_new_tokens="
                             f"{self.max_new_tokens} exceeds vllm.max_model_len={self.max_model_len}")
        params = [SamplingParams(temperature=self.temperature, max_tokens=self.max_new_tokens, logprobs=0,
                                 seed=seed, stop_token_ids=[self.eos]) for seed in seeds]
        # the CPU attention kernels check that the calling thread runs as many OpenMP threads as the
        # engine planned for; a Ray actor calls from threads of its own (vLLM disables torch.set_num_threads)
        torch._C.set_num_threads(self.threads)
        outs = self.engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                    lora_request=self.adapter)
        m = self.max_new_tokens
        tokens = torch.full((len(prompts), m), self.pad, dtype=torch.long)
        logps, mask = torch.zeros(len(prompts), m), torch.zeros(len(prompts), m, dtype=torch.bool)
        for row, out in enumerate(outs):
            drawn = out.outputs[0]
            ids = list(drawn.token_ids)[:m]
            tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logps[row, :len(ids)] = torch.tensor([step[t].logprob for step, t in zip(drawn.logprobs, ids)])
            mask[row, :len(ids)] = True
        return tokens, logps, mask

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Serve a version: `state_dict` is its tensors, as `synced_state` names them (on the host)."""
        try:
            if self.lora:
                self.serve_adapter(state_dict)
            else:
                weights = [(name.removeprefix(LM_PREFIX), t) for name, t in state_dict.items()]
                self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                                     "is_checkpoint_format": True})
                self.engine.reset_prefix_cache()  # cached prefixes were computed with the old weights
        except Exception as error:
            raise EngineLoadError(f"experts.{self.expert_id}: the vLLM engine could not load a version: "
                                  f"{type(error).__name__}: {error}") from error

    def serve_adapter(self, state_dict) -> None:
        """A new LoRA request per version, read from a folder of peft's layout; the one before it
        is kept (a request may still name it), older ones deleted."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest
        self.loads += 1
        folder = self.adapters / f"v{self.loads}"
        folder.mkdir()
        self.lm.peft_config["default"].save_pretrained(str(folder))
        prefix = LM_PREFIX
        save_file({name.removeprefix(prefix).replace(".default.", "."): t.contiguous()
                   for name, t in state_dict.items()}, str(folder / "adapter_model.safetensors"))
        self.adapter = LoRARequest(f"{self.expert_id}-{self.loads}", self.loads, str(folder))
        shutil.rmtree(self.adapters / f"v{self.loads - 2}", ignore_errors=True)

    def __del__(self):
        if getattr(self, "adapters", None) is not None:
            shutil.rmtree(self.adapters, ignore_errors=True)
