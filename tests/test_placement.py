"""Resources from the config: actors that ask for resources get bundles reserved up front as
placement groups (given back at the end); a run asking for more than the cluster has stops after
`cluster.placement_timeout_s`, naming the bundles and what is missing, instead of hanging."""
import time

import pytest
import ray
from ray.util import placement_group_table

from cluster.placement import PlacementError, demand, shortfall
from cluster.runtime import get
from driver import cli
from driver.launch import start_driver, stop_driver
from tests.conftest import make_config

QUARTER = "resources.num_cpus=0.25"


def free_cpus_once_settled() -> float:
    """Available CPUs once Ray's resource view has caught up with groups removed just before
    (it is eventually consistent); every other actor of the tests asks for no CPU."""
    for _ in range(100):
        if ray.available_resources().get("CPU", 0.0) == ray.cluster_resources()["CPU"]:
            break
        time.sleep(0.1)
    return ray.available_resources()["CPU"]


def groups_of(run_name: str) -> dict[str, str]:
    return {t["name"]: t["state"] for t in placement_group_table().values() if t["name"].startswith(run_name + "/")}


def test_demand_groups_experts_and_workers_as_configured():
    cfg = make_config(f"experts.generator.{QUARTER}", f"cluster.rollout_{QUARTER}", "cluster.rollout_workers=2")
    assert demand(cfg) == {"actors": {"expert/generator": {"CPU": 0.25}, "rollout/0": {"CPU": 0.25},
                                      "rollout/1": {"CPU": 0.25}}}
    cfg.cluster.colocate = False
    assert demand(cfg) == {"experts": {"expert/generator": {"CPU": 0.25}},
                           "rollout": {"rollout/0": {"CPU": 0.25}, "rollout/1": {"CPU": 0.25}}}
    assert shortfall([{"CPU": 1, "GPU": 1}] * 3, {"CPU": 2.0}) == {"CPU": 1.0, "GPU": 3.0}


@pytest.mark.parametrize("colocate", [True, False])
def test_bundles_are_reserved_used_and_given_back(ray_session, tmp_path, colocate):
    name = f"placed-{colocate}"
    cfg = make_config("experts.n_refiners=1", *[f"experts.{e}.{QUARTER}" for e in ("refiner_0", "generator")],
                      f"cluster.rollout_{QUARTER}", f"cluster.colocate={colocate}", f"trainer.run_name={name}",
                      "trainer.steps=1", preset="shapes-tiny")
    free = free_cpus_once_settled()
    driver = start_driver(cfg, tmp_path)
    get(driver.run.remote())
    want = {f"{name}/actors"} if colocate else {f"{name}/experts", f"{name}/rollout"}
    assert groups_of(name) == {g: "CREATED" for g in want}
    assert ray.available_resources()["CPU"] == pytest.approx(free - 3 * 0.25)  # 2 experts + 1 worker, reserved
    stop_driver(driver)
    assert groups_of(name) == {g: "REMOVED" for g in want}


def test_a_run_the_cluster_cannot_hold_names_what_is_missing(ray_session, tmp_path):
    cfg = make_config("experts.generator.resources.num_gpus=2", "experts.refiner_1.resources.custom={tpu: 1}",
                      "cluster.placement_timeout_s=1", "trainer.run_name=unplaceable", preset="shapes-tiny")
    with pytest.raises(PlacementError) as err:
        start_driver(cfg, tmp_path)
    message = str(err.value)
    assert "expert/generator {'GPU': 2.0}" in message and "expert/refiner_1 {'tpu': 1.0}" in message
    assert "short of {'GPU': 2.0, 'tpu': 1.0}" in message and "placement_timeout_s=1" in message
    assert set(groups_of("unplaceable").values()) == {"REMOVED"}               # nothing left reserved


def test_cli_reports_the_missing_resources(ray_session, tmp_path, capsys):
    assert cli.main(["train", "--config", "shapes-tiny", "--set", "experts.generator.resources.num_gpus=1",
                     "--set", "cluster.placement_timeout_s=1", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "PlacementError" in err and "short of {'GPU': 1.0}" in err
