"""`jointrl plan`: the memory plan of the real presets from their architectures on the meta device
(nothing downloaded), its refusals (exit 2, one paragraph), and its placement read back from a
CPU Ray that declares GPUs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from driver import cli
from driver.config import resolve_config
from driver.plan import PlanError, config_target, plan_for

GPU_PRESETS = ["gpu", "sd3", "flux1", "flux2-klein", "qwen-image", "geneval", "pickscore", "ocr", "wan2.1-1.3b",
               "wan2.2-5b", "wan-promptrl", "wan2.2-a14b"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_fits_its_target_on_whole_gpus(preset):
    config = resolve_config(preset)
    target = config_target(config)
    plan = plan_for(config, target)
    assert plan.target.gpus == target.gpus and len(plan.gpus) == target.gpus
    out = json.loads(json.dumps(plan.to_json()))
    for name, actor in out["actors"].items():
        assert isinstance(actor["gpus"], list) and all(isinstance(g, int) for g in actor["gpus"])
        assert all(isinstance(n, int) and n >= 0 for n in actor["params"].values())
        assert all(isinstance(b, int) and b >= 0 for b in actor["bytes"].values())
        if name.startswith(("expert/", "rollout/")):  # every GPU preset puts these on a GPU
            assert len(actor["gpus"]) == 1 and actor["bytes"] and actor["params"], name
        if name.startswith("reward/"):  # on a GPU as its term asks (OCR's PP-OCRv4 reads on the CPU)
            asked = config.reward.pools()[name.split("/")[1]][1].num_gpus > 0
            assert len(actor["gpus"]) == asked and (actor["params"] or not asked), name
    for gpu in plan.gpus:
        assert gpu.bytes <= target.usable, (gpu.id, gpu.bytes)
        assert gpu.bytes == sum(plan.actors[a].total for a in gpu.actors)
    ranks = [a for a in plan.actors if a.startswith("expert/generator")]
    assert len({plan.actors[a].gpus[0] for a in ranks}) == len(ranks)  # an expert's ranks never share a GPU
    assert all(g.actors for g in plan.gpus)  # the layout uses every GPU of its target
    gpu_actors = sum(1 for a in plan.actors.values() if a.gpus)  # whole GPUs: shared only when actors outnumber them
    assert sum(len(g.actors) - 1 for g in plan.gpus) == max(0, gpu_actors - target.gpus)
    from driver.commands.layout_plan import compare
    layouts = compare(config, target)  # the preset runs the faster layout, unless it refuses the other
    assert layouts["faster"] == config.cluster.layout, {k: getattr(v, "step_s", v) for k, v in layouts.items()
                                                        if k in ("separate", "colocated")}


# published sizes: FLUX.1-dev 12 B (model card; 11.9 B counted by diffusers), Qwen-Image 20 B (model card;
# 20.4 B), SD3.5 medium 2.5 B (model card), FLUX.2 klein 4 B and 9 B (model cards), Qwen2.5-0.5B 0.49 B,
# Qwen3-8B 8.2 B, Qwen2.5-VL-7B 8.3 B, CLIP ViT-L/14 428 M, TrOCR-base 334 M (each model card / paper), Wan2.2
# TI2V-5B 5 B (model card), Wan2.1-T2V-1.3B 1.42 B (named 1.3B; the Wan report's 1.3B model, dim 1536 x 30 layers)
PUBLISHED = [("flux1", "transformer", 11.9e9, 0.01), ("qwen-image", "transformer", 20.4e9, 0.01),
             ("sd3", "transformer", 2.5e9, 0.02), ("flux2-klein", "transformer", 9.0e9, 0.02),
             ("flux2-klein", "text_encoder", 8.2e9, 0.01), ("qwen-image", "text_encoder", 8.3e9, 0.01),
             ("wan2.2-5b", "transformer", 5.0e9, 0.01), ("wan2.1-1.3b", "transformer", 1.42e9, 0.01)]


@pytest.mark.parametrize("preset, part, size, tolerance", PUBLISHED)
def test_parameter_counts_of_the_real_generators_are_the_published_sizes(preset, part, size, tolerance):
    from experts.memory import generator_architecture
    config = resolve_config(preset)
    arch = generator_architecture(config.experts.generator.model, config.task.image_size, config.task.image_width,
                                  config.task.num_frames)
    counted = arch.transformer if part == "transformer" else arch.frontend[part]
    assert abs(counted - size) <= tolerance * size, counted


def test_the_plan_counts_wans_vae_in_float32_beside_a_bfloat16_transformer():
    """Wan's VAE is loaded in float32 whatever the model's dtype (as diffusers' Wan examples load it),
    and the plan counts it so; its text encoder is in the model's dtype."""
    from experts.memory import generator_architecture
    config = resolve_config("wan2.1-1.3b")
    m = config.experts.generator.model
    assert m.dtype == "bfloat16"
    arch = generator_architecture(m, config.task.image_size, config.task.image_width, config.task.num_frames)
    assert arch.frontend_width == {"vae": 4, "text_encoder": 2}
    flux = resolve_config("flux1")
    assert set(generator_architecture(flux.experts.generator.model, flux.task.image_size).frontend_width.values()) \
        == {2}


def test_parameter_counts_of_the_klein_4b_refiner_and_reward_models_are_the_published_sizes():
    from common.architectures import ARCHITECTURES, config_folder
    from experts.memory import count, meta_component, reward_architecture
    klein = ARCHITECTURES / "black-forest-labs" / "FLUX.2-klein-4B"
    assert abs(count(meta_component(klein / "transformer", "diffusers", "Flux2Transformer2DModel")) - 3.9e9) < 0.05e9
    from experts.memory import meta_causal_lm
    assert abs(count(meta_causal_lm(config_folder("Qwen/Qwen2.5-0.5B-Instruct"))) - 0.494e9) < 0.005e9
    assert abs(reward_architecture("openai/clip-vit-large-patch14", "float32").params - 428e6) < 1e6
    assert abs(reward_architecture("microsoft/trocr-base-printed", "float32").params - 334e6) < 1e6


def run(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_config_that_cannot_fit_exits_2_naming_the_actor_part_shortfall_and_remedies(capsys):
    code, _, err = run(capsys, "--config", "flux2-klein", "--set", "experts.generator.parallel.ranks=1",
                       "--set", "experts.generator.parallel.activation_checkpointing=false")
    assert code == 2 and err.count("\n") == 1
    assert "expert/generator needs" in err and "short by" in err and "its largest part is" in err
    for remedy in ("model.lora", "parallel.ranks", "micro_batch", "activation_checkpointing=true"):
        assert remedy in err


def test_no_gpu_an_unknown_model_and_collective_sync_on_a_shared_gpu_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "--config", "sd3", "--gpus", "0")
    assert code == 2 and "the target has no GPU" in err and "expert/generator" in err
    code, _, err = run(capsys, "--config", "gpu", "--set", f"experts.generator.model.path={tmp_path}")
    assert code == 2 and "without config.json or model_index.json" in err
    code, _, err = run(capsys, "--config", "gpu", "--set", "experts.generator.model.path=nobody/no-such-model")
    assert code == 2 and "no config files for 'nobody/no-such-model'" in err
    code, _, err = run(capsys, "--config", "gpu", "--set", "cluster.sync=collective",
                       "--set", "cluster.collective_backend=nccl")
    assert code == 2 and "cluster.sync=collective" in err and "share GPU 0" in err


def test_json_holds_per_actor_gpus_params_and_bytes(capsys):
    separate = ["cluster.layout=separate", "experts.generator.parallel.ranks=1", "cluster.rollout_workers=5",
                "cluster.rollout_resources={num_gpus: 1}"]  # the preset is colocated; rollout workers idle in turn
    code, out, _ = run(capsys, "--config", "sd3", "--json", "--gpus", "8", "--gpu-memory", "80",
                       *[a for k in separate for a in ("--set", k)])
    plan = json.loads(out)
    assert code == 0 and plan["target"]["source"] == "flags"
    generator = plan["actors"]["expert/generator"]
    assert generator["params"]["transformer"] > 2e9 and generator["params"]["lora"] > 0
    assert generator["bytes"]["activations (one micro-batch)"] > 0 and generator["gpus"] == [
        g["id"] for g in plan["gpus"] if "expert/generator" in g["actors"]]
    assert plan["idle"]["update"] and plan["idle"]["rollout"]  # workers idle while experts train, and back


def test_a_cpu_runs_memory_is_the_plans_host_figure():
    """A CPU run is refused exactly where the memory plan's host figure exceeds the memory there,
    and the refusal gives that figure and the plan's largest actor."""
    from driver.plan import host_plan
    from driver.preflight import memory_problem
    config = resolve_config("shapes-tiny", ["algorithm.group_size=64"])
    plan = host_plan(config)
    assert memory_problem(config, have=plan.host_bytes) is None
    problem = memory_problem(config, have=plan.host_bytes - 1, where="here")
    largest = max(plan.actors.values(), key=lambda a: a.total)
    assert f"one step needs {plan.host_bytes / 2**30:.1f} GiB by the memory plan" in problem
    assert f"the largest actor {largest.name}, {largest.total / 2**30:.1f} GiB" in problem
    assert f"here has {(plan.host_bytes - 1) / 2**30:.1f} GiB" in problem
    bigger = host_plan(resolve_config("shapes-tiny", ["algorithm.group_size=128"])).host_bytes
    assert bigger > plan.host_bytes and memory_problem(config, have=bigger) is None  # the batch is in the figure


@pytest.mark.cluster  # it starts the command, or a Ray, in a process of its own
def test_place_on_a_cpu_ray_declaring_gpus_gives_each_actor_the_plans_gpu(tmp_path):
    """A private local Ray declaring the target's 4 GPUs (the pytest session's Ray has none)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    asks = [f"{key}.num_gpus=1" for key in ("experts.refiner_0.resources", "experts.refiner_1.resources",
                                            "experts.refiner_2.resources", "experts.generator.resources",
                                            "cluster.rollout_resources")]
    sets = [a for k in [*asks, "cluster.rollout_workers=2"] for a in ("--set", k)]
    done = subprocess.run([sys.executable, "-m", "driver", "plan", "--config", "shapes-tiny", *sets, "--gpus", "4",
                           "--gpu-memory", "16", "--place", "--json"],  # 6 GPU actors on 4 GPUs: two share
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout[done.stdout.index("{"):])
    placed = plan["placed"]
    gpu_actors = {n: a for n, a in plan["actors"].items() if a["gpus"]}
    assert set(placed) == set(gpu_actors)
    ray_to_plan = {}
    for name, ids in placed.items():
        assert len(ids) == 1
        ray_to_plan.setdefault(ids[0], set()).add(gpu_actors[name]["gpus"][0])
    assert all(len(plans) == 1 for plans in ray_to_plan.values())  # one Ray id per planned GPU
    by_ray = {}
    for name, ids in placed.items():
        by_ray.setdefault(ids[0], set()).add(name)
    by_plan = {frozenset(g["actors"]) for g in plan["gpus"] if g["actors"]}
    assert {frozenset(v) for v in by_ray.values()} == by_plan  # actors share an id exactly where the plan says
    assert any(len(g) > 1 for g in by_plan)
    from cluster.runtime import GPU_ENV
    assert plan["placed_env"] == {name: GPU_ENV for name in placed}  # spawned as the run's GPU actors are


def test_gpu_actors_are_given_the_allocator_and_nccl_settings_unless_the_user_set_them(monkeypatch):
    from cluster.runtime import GPU_ENV, actor_env
    monkeypatch.setenv("HF_HOME", "/models")
    for k in GPU_ENV:
        monkeypatch.delenv(k, raising=False)
    assert actor_env({"num_cpus": 0, "num_gpus": 0}) == {"HF_HOME": "/models"}
    assert actor_env({"num_gpus": 0.5}) == {"HF_HOME": "/models", **GPU_ENV}
    assert GPU_ENV == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's choice, passed on through the driver actor
    assert actor_env({"num_gpus": 1})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert actor_env({"num_gpus": 0}) == {"HF_HOME": "/models", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_once_connected_to_a_cluster_with_gpus_train_is_planned_against_them(monkeypatch):
    import ray

    from driver.preflight import fits_cluster
    node = {"Alive": True, "Resources": {"GPU": 8.0, "CPU": 64.0}}
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 8.0, "CPU": 64.0, "memory": 2.0 ** 40})
    monkeypatch.setattr(ray, "nodes", lambda: [node])
    fits_cluster(resolve_config("sd3"))  # its layout fits 8 GPUs of 80 GB
    with pytest.raises(PlanError, match="do not fit the target's 8 GPUs"):  # 9 actors of 56-67 GB on 8 GPUs
        fits_cluster(resolve_config("qwen-image", ["cluster.layout=separate", "experts.generator.parallel.ranks=1",
                                                   "cluster.rollout_workers=8", "cluster.rollout_resources={num_gpus: 1}"]))
    node["Resources"]["GPU"] = 1.0
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 1.0, "CPU": 8.0})
    with pytest.raises(PlanError, match="expert/generator needs .* the Ray cluster"):
        fits_cluster(resolve_config("flux2-klein", ["experts.generator.parallel.ranks=1"]))


@pytest.mark.slow  # traces the video preset's tiny builds
def test_the_plan_of_the_video_preset_measures_its_tiny_builds(capsys):
    """A tiny generator of any kind (the video DiT too) has no architecture to count FLOPs of: its
    layouts' costs are measured."""
    assert cli.main(["plan", "--config", "shapes-video", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"]["faster"] in ("separate", "colocated")


@pytest.mark.parametrize("preset", ["wan2.1-1.3b", "wan-promptrl", "wan2.2-a14b"])
def test_the_layouts_of_a_video_preset_are_costed_at_its_clip_size(preset, capsys):
    """The FLOP estimate reads the video model at the task's frames and size (not as an image), and
    Wan2.2-A14B's two experts each train the steps their transformer denoises."""
    assert cli.main(["plan", "--config", preset, "--json"]) == 0
    costs = json.loads(capsys.readouterr().out)["layouts"]["costs"]
    assert costs["generate"] > 0 and all(v > 0 for v in costs["update"].values())
    if preset == "wan2.2-a14b":
        assert set(costs["update"]) >= {"generator", "generator_low"}


def flux_and_wan():
    """A small FLUX.1 transformer (joint attention over text and image tokens) and a small Wan one
    (self-attention over a clip's tokens, cross-attention to the text), with one sample's inputs."""
    import torch
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel
    flux = lambda: FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                          pooled_projection_dim=12, axes_dims_rope=(4, 6, 6))
    flux_inputs = lambda d: dict(hidden_states=torch.randn(1, 36, 16, device=d),
                                 encoder_hidden_states=torch.randn(1, 7, 24, device=d),
                                 pooled_projections=torch.randn(1, 12, device=d), timestep=torch.ones(1, device=d),
                                 img_ids=torch.zeros(36, 3, device=d), txt_ids=torch.zeros(7, 3, device=d))
    wan = lambda: WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=4, out_channels=4, text_dim=20, freq_dim=16, ffn_dim=40,
                                        num_layers=2, rope_max_seq_len=32)
    wan_inputs = lambda d: dict(hidden_states=torch.randn(1, 4, 3, 8, 8, device=d), timestep=torch.ones(1, device=d),
                                encoder_hidden_states=torch.randn(1, 9, 20, device=d))
    return [(flux, flux_inputs), (wan, wan_inputs)]


@pytest.mark.parametrize("which", [0, 1], ids=["flux1", "wan"])
def test_the_traced_flops_are_torchs_count_of_the_real_forward(which):
    """The time model's FLOPs (one pass traced on the meta device, attention as the fused kernel)
    equal torch's FlopCounterMode over the real forward with attention unfused (its products then
    are plain matrix products), and attention's share equals the formula 4 x heads x q-tokens x
    k-tokens x head width summed over the attentions."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from experts.memory import META, measure
    build, inputs = flux_and_wan()[which]
    torch.manual_seed(0)
    real = build().eval()
    with torch.device(META):
        meta = build()
    traced = measure(meta, lambda: meta(**inputs(META)), grad=False).flops
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        real(**inputs("cpu"))
    assert traced.linear + traced.attention == counter.get_total_flops()
    heads, width = real.config.num_attention_heads, real.config.attention_head_dim
    # FLUX: one joint (7 + 36 tokens) attention per block; Wan: self (3 x 4 x 4 tokens) and cross (9) per block
    attentions = [(43, 43)] * 2 if which == 0 else [(48, 48), (48, 9)] * 2
    assert traced.attention == sum(4 * heads * q * k * width for q, k in attentions)


def test_a_rollout_worker_is_planned_with_the_versions_delivered_ahead_of_its_rollout():
    """A delivered version waits beside the one served until the next rollout serves it, and under
    max_staleness=k so do k older ones: each trained expert's synced weights, 1 + k times (the
    adapter alone under LoRA); a frozen expert's never change."""
    from driver.plan import rollout_worker
    one = rollout_worker(resolve_config("shapes", ["experts.refiner_1.train=false"]), 0).bytes
    assert one["versions delivered ahead: refiner_0 (x1)"] == one["weights: refiner_0"] > 0
    assert one["versions delivered ahead: generator (x1)"] == one["weights: generator"] > 0
    assert not any(k.startswith("versions delivered ahead: refiner_1") for k in one)
    three = rollout_worker(resolve_config("shapes", ["cluster.max_staleness=2"]), 0).bytes
    assert three["versions delivered ahead: refiner_0 (x3)"] == 3 * one["weights: refiner_0"]
    lora = rollout_worker(resolve_config("sd3", ["cluster.layout=separate", "cluster.rollout_workers=1"]), 0).bytes
    adapter = lora["versions delivered ahead: generator (x1)"]
    assert 0 < adapter < lora["weights: generator"] / 10


def test_a_gpu_run_whose_snapshots_the_largest_object_store_cannot_hold_is_refused():
    """The driver's node keeps every trained expert's latest snapshot in its object store (the
    plan's `driver` actor): a cluster whose largest node's store is smaller is told by how much and
    what would fit; a store large enough, or one Ray does not report, passes."""
    from driver.plan import GB, Target
    from driver.preflight import store_problem
    plan = plan_for(resolve_config("flux2-klein"), Target(1, 8, 80.0, 4.0, "test"))
    need = plan.actors["driver"].total
    assert need > 30 * GB  # flux2-klein trains the whole 9 B transformer: fp32 weights and moments
    assert store_problem(plan, need) is None and store_problem(plan, 0) is None
    said = store_problem(plan, need - 1)
    assert f"{need / 2**30:.1f} GiB" in said and "--object-store-memory=" in said and "lora" in said
    asked = int(said.split("--object-store-memory=")[1].split()[0])
    assert asked >= need


def test_a_passs_flops_are_the_time_models_conventions():
    """A sampling pass is its products and attention; a trained step adds a backward of twice the
    products (once under LoRA: no weight gradients) and 2.5x the attention (FlashAttention-2's
    backward recomputes the scores), the forward again under activation checkpointing, and the
    reference's forward for the KL. bench/time_model.py checks these against this CPU's times."""
    from driver.commands.layout_plan import sampled_pass_flops, trained_pass_flops
    from experts.memory import Flops
    flops = Flops(linear=100, attention=40)
    assert sampled_pass_flops(flops) == 140
    assert trained_pass_flops(flops, lora=False, checkpointing=False, reference=False) == 140 + 200 + 100
    assert trained_pass_flops(flops, lora=True, checkpointing=False, reference=False) == 140 + 100 + 100
    assert trained_pass_flops(flops, lora=False, checkpointing=True, reference=True) == 3 * 140 + 200 + 100
