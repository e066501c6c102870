"""Memory measurements kept (experts/measurements.py): every preset plans from the shipped ones
without tracing a model, each shipped one equals a fresh trace, and this machine's store is keyed
by what a measurement depends on and survives a file it cannot read."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.architectures import config_folder
from common.tiny import cache_root
from driver.config import resolve_config
from experts import measurements, memory

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("measured_architectures", ROOT / "bench" / "measured_architectures.py")
writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(writer)
plan_preset = writer.plan_preset


def real_presets() -> list[str]:
    """The presets whose generator is a real model (the others' are built here and traced in a moment)."""
    return [name for name in writer.presets()
            if not str(getattr(resolve_config(name).experts.generator.model, "path", "tiny:")).startswith("tiny:")]


def forget_in_process():
    for cached in (memory._generator, memory._lm, memory.reward_architecture):
        cached.cache_clear()
    measurements.used.clear()


@pytest.fixture
def store(tmp_path, monkeypatch):
    """This machine's store in a folder of the test's own, and nothing remembered in the process."""
    monkeypatch.setattr(measurements, "local_store", lambda: tmp_path / "measured")
    forget_in_process()
    yield tmp_path / "measured"
    forget_in_process()


@pytest.fixture
def traces(monkeypatch):
    """The folders traced, by kind, while the test runs (each still traced)."""
    seen = []
    for name in ("_trace_generator", "_trace_lm", "_trace_reward"):
        original = getattr(memory, name)

        def counted(folder, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, Path(folder)))
            return _original(folder, *args, **kwargs)
        monkeypatch.setattr(memory, name, counted)
    return seen


def test_every_real_preset_plans_from_the_shipped_measurements_without_tracing(store, traces):
    for name in real_presets():
        plan_preset(name)
    built_here = cache_root()
    real = [(kind, folder) for kind, folder in traces if not folder.is_relative_to(built_here)]
    assert not real, f"traced, not shipped (python bench/measured_architectures.py writes them): {real}"
    shipped = measurements.shipped()
    assert set(shipped) <= set(measurements.used), "shipped measurements no preset asks for"
    assert not list(store.glob("*.json")) or all("tiny:" in json.loads(p.read_text())["what"] for p in store.glob("*.json"))


@pytest.mark.slow  # traces every shipped architecture again
def test_each_shipped_measurement_equals_a_fresh_trace(store, monkeypatch):
    monkeypatch.setenv("JOINTRL_REMEASURE", "1")
    shipped = measurements.shipped()
    for name in real_presets():
        plan_preset(name)
    for k, entry in shipped.items():
        assert k in measurements.used, f"{entry['what']}: no preset measures it"
        assert measurements.used[k]["value"] == entry["value"], entry["what"]


def tiny_refiner():
    return resolve_config("prompts-tiny").expert("refiner_0").model


def test_a_measurement_is_traced_once_then_read_back_and_a_file_it_cannot_read_is_traced_again(store, traces):
    model = tiny_refiner()
    first = memory.lm_architecture(model)
    assert len(traces) == 1 and len(list(store.glob("*.json"))) == 1
    forget_in_process()
    assert memory.lm_architecture(model) == first and len(traces) == 1  # read back, not traced
    (kept,) = store.glob("*.json")
    kept.write_text("{not json")
    forget_in_process()
    assert memory.lm_architecture(model) == first and len(traces) == 2
    assert json.loads(kept.read_text())["value"]["params"] == first.params  # rewritten whole
    entry = json.loads(kept.read_text())
    entry["value"]["params"] = "many"  # a record of another shape
    kept.write_text(json.dumps(entry))
    forget_in_process()
    assert memory.lm_architecture(model) == first and len(traces) == 3


def test_the_key_follows_the_config_files_and_the_inputs_but_not_where_the_model_is_read_from(store, traces,
                                                                                           tmp_path):
    model = tiny_refiner()
    copy = tmp_path / "copy"
    shutil.copytree(config_folder(model.path), copy)
    first = memory.lm_architecture(model)
    forget_in_process()
    assert memory.lm_architecture(model.model_copy(update={"path": str(copy)})) == first
    assert len(traces) == 1  # the same config files at another path: the same key
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] += 8
    (copy / "config.json").write_text(json.dumps(config))
    forget_in_process()
    deeper = memory.lm_architecture(model.model_copy(update={"path": str(copy)}))
    assert len(traces) == 2 and deeper.params > first.params
    bf16 = memory.lm_architecture(model.model_copy(update={"dtype": "bfloat16"}))
    assert len(traces) == 3 and bf16.kv_per_token * 2 == first.kv_per_token


def test_remeasure_traces_again_and_other_library_versions_are_said(store, traces, monkeypatch):
    model = tiny_refiner()
    memory.lm_architecture(model)
    assert measurements.version_notes() == []
    (kept,) = store.glob("*.json")
    entry = json.loads(kept.read_text())
    entry["versions"]["transformers"] = "0.0.1"
    kept.write_text(json.dumps(entry))
    forget_in_process()
    memory.lm_architecture(model)
    (note,) = measurements.version_notes()
    assert "transformers 0.0.1 (installed " in note and "JOINTRL_REMEASURE=1" in note and len(traces) == 1
    monkeypatch.setenv("JOINTRL_REMEASURE", "1")
    forget_in_process()
    memory.lm_architecture(model)
    assert len(traces) == 2 and measurements.version_notes() == []


def test_plan_of_a_real_preset_imports_no_model_library_when_its_measurements_are_shipped(tmp_path):
    """`jointrl plan` of a shipped preset reads its measurements: diffusers, transformers and peft
    (seconds of imports) are never loaded, and the report notes a library only where the installed
    version is not the one the shipped measurements ran under (a fresh install may get a newer
    release than bench/measured_architectures.py saw), naming both versions."""
    code = ("import sys\nfrom driver.cli import main\nmain(['plan', '--config', 'flux1'])\n"
            "print('loaded:', sorted(m for m in ('diffusers', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JOINTRL_TINY_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("loaded: []"), out.stdout[-500:]
    said = out.stdout + out.stderr
    stamps = {json.dumps(entry["versions"], sort_keys=True) for entry in measurements.shipped().values()}
    assert len(stamps) == 1  # bench/measured_architectures.py measures them all under one install
    installed = measurements.library_versions()
    differ = {n: v for n, v in json.loads(stamps.pop()).items() if installed[n] != v}
    assert ("measured under" in said) == bool(differ), said[-1000:]
    assert all(f"{n} {v} (installed {installed[n]})" in said for n, v in differ.items()), said[-1000:]
