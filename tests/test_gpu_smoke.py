"""bench/gpu_smoke.py on the CPU: every GPU preset's tiny stand-in is planned onto one GPU as the
acceptance run would plan it, and the verdict passes a run that held its plan and fails each way a
run can miss it (the GPU run itself needs a GPU)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_smoke  # noqa: E402

from driver.plan import config_target, plan_for  # noqa: E402

GB = 1e9


@pytest.mark.parametrize("preset", gpu_smoke.GPU_PRESETS)
def test_every_gpu_presets_tiny_stand_in_is_planned_onto_one_gpu(preset):
    config = gpu_smoke.smoke_config(preset, tiny=True, gpus=1, gpu_memory_gb=80.0, steps=2, prompts=None,
                                    collective=False)
    plan = plan_for(config, config_target(config))
    on_gpu = [a for a in plan.actors.values() if a.wants_gpu]
    assert {a.name for a in on_gpu} >= {"expert/generator", "rollout/0", *(f"expert/{e}" for e in
                                                                          config.experts.active_refiners())}
    assert all(a.gpus == [0] for a in on_gpu) and [g.actors for g in plan.gpus if g.actors]
    g = config.experts.generator
    assert g.model.path == gpu_smoke.TINY_FAMILY.get(preset, "tiny:sd3") and g.model.dtype == "bfloat16"
    from driver.config import resolve_config
    preset_generator = resolve_config(preset).experts.generator
    assert all(getattr(g, k) == getattr(preset_generator, k) for k in gpu_smoke.PRESET_GENERATOR_KEYS)
    assert config.trainer.steps == 2 and config.trainer.prompts_per_step == gpu_smoke.smallest_batch(config)
    if importlib.util.find_spec("vllm"):  # where vLLM is installed, refiner_0 is sampled by an engine, planned
        r = config.experts.active_refiners()["refiner_0"]
        assert r.engine == "vllm" and r.model.path == gpu_smoke.ENGINE_LM and r.model.dtype == "bfloat16"
        kv_cache = plan.actors["rollout/0"].bytes["KV cache: refiner_0 (vLLM engine)"]
        assert kv_cache == int(r.vllm.kv_cache_gib * 2**30)


CONFIG = SimpleNamespace(trainer=SimpleNamespace(steps=2), experts=SimpleNamespace(ids=lambda: ["refiner_0", "generator"]),
                         expert=lambda e: SimpleNamespace(train=True))
ON_ENGINE = SimpleNamespace(trainer=CONFIG.trainer, experts=CONFIG.experts,  # refiner_0 sampled by a vLLM engine
                            expert=lambda e: SimpleNamespace(train=True, engine="vllm" if e == "refiner_0" else "hf"))


def rows_of(**changes) -> list[dict]:
    """A two-step run's metrics rows that pass, with `changes` made to each."""
    rows = [{"version/refiner_0": s + 1, "version/generator": s + 1, "sync/via": "object_store",
             "ppo/ratio_mean/refiner_0": 1.0 + 2e-4, "ppo/ratio_mean/generator": 1.0 - 5e-4} for s in range(2)]
    return [{k: v for k, v in {**r, **changes}.items() if v is not None} for r in rows]


def failed(gpus, rows=None, asked="object_store", config=CONFIG) -> list[str]:
    return [c.what for c in gpu_smoke.checks(rows or rows_of(), config, gpus, asked) if c.ok is False]


def test_the_verdict_passes_a_run_that_held_its_plan_and_fails_each_miss():
    held = [gpu_smoke.GPURow(0, ["expert/generator"], int(40 * GB), [3], int(44 * GB)),
            gpu_smoke.GPURow(1, ["expert/refiner_0", "rollout/0"], int(20 * GB), [5], int(18 * GB))]
    verdict = gpu_smoke.checks(rows_of(), CONFIG, held, "object_store")
    assert all(c.ok for c in verdict), verdict
    assert gpu_smoke.table("x", held, verdict).endswith("PASSED")
    over = [held[0], gpu_smoke.GPURow(1, held[1].actors, int(20 * GB), [5], int(24 * GB))]  # 1.2x its plan
    assert failed(over) == ["GPU 1 peak against the plan"]
    split = [held[0], gpu_smoke.GPURow(1, held[1].actors, int(20 * GB), [5, 6], int(18 * GB))]  # one GPU split
    assert failed(split) == ["every planned GPU used, as planned"]
    merged = [held[0], gpu_smoke.GPURow(1, held[1].actors, int(20 * GB), [3], int(18 * GB))]  # two on one id
    assert failed(merged) == ["every planned GPU used, as planned"]
    idle = [held[0], gpu_smoke.GPURow(1, held[1].actors, int(20 * GB), [5], 0)]  # placed, never used
    assert "every planned GPU used, as planned" in failed(idle)
    assert failed(held, rows_of(**{"ppo/ratio_mean/generator": 1.002})) == ["first update on policy"]
    assert failed(held, rows_of(**{"ppo/ratio_mean/refiner_0": None})) == ["first update on policy"]
    engine_gap = rows_of(**{"ppo/ratio_mean/refiner_0": 1.0 + gpu_smoke.ENGINE_RATIO_TOL / 2})
    assert failed(held, engine_gap) == ["first update on policy"]  # beyond the HF loop's bound
    assert failed(held, engine_gap, config=ON_ENGINE) == []  # within an engine's
    assert failed(held, rows_of(**{"ppo/ratio_mean/refiner_0": 1.0 + 2 * gpu_smoke.ENGINE_RATIO_TOL}),
                  config=ON_ENGINE) == ["first update on policy"]
    assert failed(held, asked="collective") == ["weights travelled as asked"]  # it fell back to the object store
    assert failed(held, rows_of()[:1]) == ["completed"]
    tiny = [gpu_smoke.GPURow(0, ["expert/generator"], int(0.05 * GB), [0], int(0.09 * GB))]
    verdict = gpu_smoke.checks(rows_of(), CONFIG, tiny, "object_store")
    assert [c.ok for c in verdict if c.what.startswith("GPU 0")] == [None]  # shown without a verdict
    assert gpu_smoke.table("tiny", tiny, verdict).endswith("PASSED")


def test_the_ratio_bounds_are_at_least_the_margin_times_what_smoke_bounds_measured():
    """bench/smoke_bounds.py measures the first-step gaps of the tiny stand-ins in bfloat16 and writes
    the bounds they call for; the smoke run's bounds are not below them."""
    text = (Path(gpu_smoke.ROOT) / "bench" / "results" / "smoke_bounds.md").read_text()
    bound = r"- bound, (HF loop|vLLM engine): .* = \*\*([0-9.e+-]+)\*\*"
    called = {kind: float(v) for kind, v in re.findall(bound, text)}
    assert set(called) == {"HF loop", "vLLM engine"}, text
    assert gpu_smoke.RATIO_TOL >= called["HF loop"] and gpu_smoke.ENGINE_RATIO_TOL >= called["vLLM engine"]
