"""An expert across several processes (`experts.<id>.parallel`): two ranks give the one-rank run's
metrics step for step, by data parallelism (ddp) and by FSDP2 sharding (fsdp), for a refiner and
for the generator at once, on gloo between two CPU processes."""
import numpy as np
import pytest

from tests.conftest import assert_same_training, make_config, run_training

GANG = ("experts.refiner_0.parallel.ranks=2", "experts.generator.parallel.ranks=2")


def gang_config(strategy: str | None, *extra: str):
    parallel = [*GANG, f"experts.refiner_0.parallel.strategy={strategy}",
                f"experts.generator.parallel.strategy={strategy}"] if strategy else []
    return make_config("experts.generator.kl_beta=0.05", *parallel, *extra, preset="shapes-tiny")


TRAINED = ("refiner_0", "generator")


@pytest.fixture(scope="module")
def one_rank(ray_session, tmp_path_factory):
    rows, _, weights = run_training(gang_config(None), tmp_path_factory.mktemp("one-rank"), TRAINED)
    return rows, weights


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_give_the_one_rank_metrics_and_weights(strategy, one_rank, ray_session, tmp_path):
    rows, info, weights = run_training(gang_config(strategy), tmp_path, TRAINED)
    assert_same_training(rows, one_rank[0], tol=1e-5)
    for e in TRAINED:
        assert weights[e].keys() == one_rank[1][e].keys()
        # Adam divides each gradient by its own scale, so rounding in gradients near zero moves
        # single weights by up to a few percent of one step (lr 3e-3): 2e-4 is a fifteenth of one
        worst = max(float(np.abs(weights[e][k] - one_rank[1][e][k]).max()) for k in weights[e])
        assert worst < 2e-4, (e, worst)
    assert rows[-1]["version/refiner_0"] == rows[-1]["version/generator"] == 3
    assert info["snapshots"]["generator"]["version"] == 3


def test_more_ranks_than_samples_or_a_collective_sync_is_refused_naming_the_key():
    from driver.config import ConfigError, resolve_config
    with pytest.raises(ConfigError, match=r"experts.refiner_0.parallel.ranks=7 is more than the 6 samples"):
        resolve_config("shapes-tiny", ["experts.refiner_0.parallel.ranks=7"])  # 2 prompts x (4 - 1)
    resolve_config("shapes-tiny", ["experts.generator.parallel.ranks=8"])      # 2 prompts x 4
    with pytest.raises(ConfigError, match="cluster.sync=object_store"):
        resolve_config("shapes-tiny", ["experts.generator.parallel.ranks=2", "cluster.sync=collective"])
