"""Refiner sampling with a vLLM engine (`engine: vllm`) against jointrl's own loop over the HF model
(`engine: hf`), on a ~100M-parameter random Qwen2 (`random:` of the config written below: 12 layers,
hidden 512, 8 heads of 64, 2 key-value heads, a 32000-word stand-in tokenizer), fp32 unless --dtype says:

1. seconds to refine P prompts (the shapes prompts, chat-templated with the default system prompt,
   about 60 tokens each) x 48 new tokens, for P = 64 and 256: the median of --repeats timed calls
   after one warm-up call, each path in a fresh process of its own, one after the other. Goal:
   engine / hf <= 0.5. `--dtype bfloat16` runs both in bfloat16 (AMX where the CPU has it).
2. each process's peak resident memory after the sampling (ru_maxrss): the model (and for the
   engine its KV cache, `vllm.kv_cache_gib`) and its activations.

On a GPU (when one is there) both run on it; on CPU both use --threads torch threads.

    python bench/vllm_refiner.py [--repeats 3] [--threads 2] [--out bench/results/vllm-refiner.md]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 48
ARCHITECTURE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 32000,
                "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8,
                "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def model_folder() -> Path:
    folder = Path(tempfile.gettempdir()) / "jointrl-bench-qwen2-100m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(ARCHITECTURE, indent=1))
    return folder


def measure(engine: str, n_prompts: int, repeats: int, threads: int, compiled: bool, dtype: str) -> dict:
    """In this process: build the refiner as a rollout worker would, refine `n_prompts` once to warm
    up, then `repeats` times timed."""
    import torch

    from driver.preflight import load_config
    from experts.kinds import build_model
    from experts.pipeline import refine_samples
    from algorithm.batch import Sample
    from tasks.shapes import prompt_set
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = load_config("shapes-tiny", [
        "experts.n_refiners=1", f"experts.refiner_0.engine={engine}", f"experts.refiner_0.max_new_tokens={NEW_TOKENS}",
        f"experts.refiner_0.model={{kind: hf_causal_lm, path: 'random:{model_folder()}', answer_tag: null, "
        f"dtype: {dtype}}}",
        "experts.refiner_0.vllm.max_model_len=256", "experts.refiner_0.vllm.kv_cache_gib=1",
        f"experts.refiner_0.vllm.enforce_eager={not compiled}"])
    model = build_model(config, "refiner_0", device=torch.device(device), serving=True).eval().to(device)
    samples = [Sample(i, i, p, True) for i, p in enumerate(prompt_set(n_prompts, seed=0))]
    times, drawn = [], 0
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        _, batch = refine_samples(model, "refiner_0", 0, attempt, samples=samples, device=torch.device(device))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        drawn = int(batch["mask"].sum())
    params = sum(p.numel() for p in model.lm.parameters())
    return {"engine": engine, "prompts": n_prompts, "device": device, "seconds": statistics.median(times[1:]),
            "fastest": min(times[1:]), "tokens": drawn, "params": params,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
            "context_tokens": statistics.mean(len(model.prompt_ids(s.prompt)) for s in samples)}


def run_fresh(engine: str, n_prompts: int, repeats: int, threads: int, compiled: bool, dtype: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", engine, "--prompts", str(n_prompts),
                          "--repeats", str(repeats), "--threads", str(threads), "--dtype", dtype,
                          *(["--compiled"] if compiled else [])],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{engine} x {n_prompts} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--compiled", action="store_true", help="the engine with vllm.enforce_eager=false (CUDA "
                        "graphs and torch.compile; a slower start)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the refiner's model.dtype (the engine's too)")
    parser.add_argument("--one", choices=["hf", "vllm"], help="measure one path in this process (internal)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.prompts[0], args.repeats, args.threads, args.compiled, args.dtype)))
        return
    rows = []
    for n in args.prompts:
        hf, vllm = (run_fresh(engine, n, args.repeats, args.threads, args.compiled, args.dtype) for engine in ("hf", "vllm"))
        rows.append((n, hf, vllm))
        print(f"{n} prompts x {NEW_TOKENS}: hf {hf['seconds']:.2f} s, vllm {vllm['seconds']:.2f} s, "
              f"ratio {vllm['seconds'] / hf['seconds']:.3f}; peak memory hf {hf['peak_rss_gib']:.2f} GiB, "
              f"vllm {vllm['peak_rss_gib']:.2f} GiB", flush=True)
    first = rows[0][1]
    flag = (" --compiled" if args.compiled else "") + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
    lines = [f"# Refiner sampling: vLLM engine against the HF loop\n",
             f"`python bench/vllm_refiner.py --repeats {args.repeats} --threads {args.threads}{flag}` on {first['device']}"
             f" ({args.threads} torch threads on CPU): a random Qwen2 of {first['params'] / 1e6:.0f}M parameters, "
             f"{args.dtype}, contexts of {first['context_tokens']:.0f} tokens on average (chat-templated shapes prompts), "
             f"{NEW_TOKENS} new tokens each; the median of {args.repeats} timed calls after a warm-up, each path "
             f"in a fresh process. Goal: ratio <= 0.5.\n",
             "| prompts | hf s | vllm s | ratio vllm/hf | peak RSS hf GiB | peak RSS vllm GiB | memory ratio |",
             "|---|---|---|---|---|---|---|"]
    for n, hf, vllm in rows:
        lines.append(f"| {n} | {hf['seconds']:.2f} | {vllm['seconds']:.2f} | {vllm['seconds'] / hf['seconds']:.3f} | "
                     f"{hf['peak_rss_gib']:.2f} | {vllm['peak_rss_gib']:.2f} | "
                     f"{vllm['peak_rss_gib'] / hf['peak_rss_gib']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
