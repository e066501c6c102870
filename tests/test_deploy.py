"""The deploy manifests parse and carry the fields that make them work: the same entrypoint, a
preset that loads, autoscaling on, resources that hold the preset's placement demand."""
import re
import shlex
from pathlib import Path

import pytest
import yaml

from cluster.placement import demand
from driver.cli import parse_args
from driver.preflight import load_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
ENTRYPOINT = "python -m driver train --config shapes-cluster --run-dir"


def manifest(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def preset_bundles(command: str) -> list[dict[str, float]]:
    """The placement bundles of the config an entrypoint trains (the CLI parses the command)."""
    args = parse_args(shlex.split(command)[3:])
    config = load_config(args.config, args.overrides)
    return [b for group in demand(config).values() for b in group.values()]


def fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in bundle.items())


def k8s_resources(container: dict) -> dict[str, float]:
    limits = container["resources"]["limits"]
    return {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}


@pytest.fixture(scope="module")
def launcher():
    (cfg,) = manifest("cluster.yaml")
    return cfg


def test_cluster_launcher_autoscales_cpu_and_gpu_workers(launcher):
    types = launcher["available_node_types"]
    workers = {name: t for name, t in types.items() if name != launcher["head_node_type"]}
    assert types[launcher["head_node_type"]]["resources"] == {"CPU": 0}      # the head runs only the driver
    assert any(t["resources"].get("GPU", 0) >= 1 for t in workers.values())
    for t in workers.values():
        assert 0 <= t["min_workers"] <= t["max_workers"] and t["max_workers"] > 0
    assert launcher["max_workers"] >= max(t["max_workers"] for t in workers.values())
    assert launcher["idle_timeout_minutes"] > 0
    head_start = " ".join(launcher["head_start_ray_commands"])
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head_start
    assert "--dashboard-host=127.0.0.1" in head_start and "--num-cpus=0" in head_start
    bundles = preset_bundles(f"{ENTRYPOINT} runs/x")
    assert all(any(fits(b, t["resources"]) for t in workers.values()) for b in bundles)
    capacity = sum(t["resources"]["CPU"] * t["max_workers"] for t in workers.values())
    assert sum(b.get("CPU", 0) for b in bundles) <= capacity


@pytest.fixture(scope="module")
def raycluster():
    docs = manifest("kuberay/raycluster.yaml")
    return next(d for d in docs if d["kind"] == "RayCluster"), docs


def test_raycluster_autoscales_with_token_auth_and_holds_the_preset(raycluster):
    cluster, docs = raycluster
    spec = cluster["spec"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert spec["authOptions"] == {"mode": "token"}
    assert tuple(map(int, spec["rayVersion"].split(".")[:2])) >= (2, 52)         # authOptions needs it
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head.get("serviceType", "ClusterIP") == "ClusterIP"
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    volumes = head["template"]["spec"]["volumes"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in volumes} <= claims
    nodes = []
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"] and group["maxReplicas"] > 0
        (container,) = group["template"]["spec"]["containers"]
        have = k8s_resources(container)
        params = group["rayStartParams"]
        assert float(params["num-cpus"]) == have["CPU"]                           # Ray advertises what k8s gives
        assert float(params.get("num-gpus", 0)) == have["GPU"]
        assert container["resources"]["requests"] == container["resources"]["limits"]
        nodes.append((have, group["maxReplicas"]))
    assert any(have["GPU"] >= 1 for have, _ in nodes)
    bundles = preset_bundles(f"{ENTRYPOINT} runs/x")
    assert all(any(fits(b, have) for have, _ in nodes) for b in bundles)
    assert sum(b.get("CPU", 0) for b in bundles) <= sum(have["CPU"] * n for have, n in nodes)


def test_rayjob_runs_the_entrypoint_on_that_cluster(raycluster):
    cluster, _ = raycluster
    (job,) = manifest("kuberay/rayjob.yaml")
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    entrypoint = job["spec"]["entrypoint"]
    assert entrypoint.startswith(ENTRYPOINT) and job["spec"]["entrypointNumCpus"] == 0
    run_dir = entrypoint.split("--run-dir ")[1]
    mounts = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(run_dir.startswith(m["mountPath"]) for m in mounts)               # runs survive the pod
    assert preset_bundles(entrypoint)


def test_dockerfile_pins_torch_then_installs_the_project_in_the_image_the_manifests_use(launcher, raycluster):
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"ARG BASE=rayproject/ray:(\S+)", dockerfile).group(1)
    cluster, _ = raycluster
    assert base.startswith(cluster["spec"]["rayVersion"])                         # the image's Ray is the cluster's
    steps = [line for line in dockerfile.splitlines() if line.startswith("RUN")]
    torch_at = next(i for i, s in enumerate(steps) if '"torch==' in s)
    project_at = next(i for i, s in enumerate(steps) if re.search(r"pip install --no-cache-dir \"?\.", s))
    assert torch_at < project_at and "--index-url" in steps[torch_at]
    for package in ("algorithm", "cluster", "configs", "experts", "driver", "tasks"):
        assert f"COPY --chown=ray:users {package} ./{package}" in dockerfile
    images = {launcher["docker"]["image"]}
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        images |= {c["image"] for c in group["template"]["spec"]["containers"]}
    assert {i.split("-gpu")[0] for i in images} == {"jointrl:0.1.0"}


def test_every_documented_command_uses_the_entrypoint():
    readme = (DEPLOY / "README.md").read_text()
    assert readme.count(ENTRYPOINT) >= 3
