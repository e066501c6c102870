"""The diagnostics every run logs (docs/reference.md, "Metrics"): groups/zero_std and groups/reward_std of the
total reward per prompt group, groups/similarity of a group's samples and grad_norm/<id> before
clipping, on hand-made inputs whose answer is known, through a rollout split between workers,
and in the rows of short inline runs."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from algorithm.batch import Sample
from algorithm.credit import group_normalise
from algorithm.similarity import SimilaritySums, group_similarity, group_sums, signatures
from driver.metrics import group_metrics
from experts.pipeline import RolloutMeta
from tasks.shapes import prompt_set
from tests.conftest import gradients_applied, make_config, run_training
from tests.test_parallel_experts import refiner_batch

NO_IMAGES = SimilaritySums(np.zeros(0, int), np.zeros(0, int), np.zeros((0, 192)))


def similarity_of(samples: torch.Tensor, groups: list[int]) -> dict[int, float]:
    return group_similarity(group_sums(signatures(samples), groups))


def halves(columns: int) -> torch.Tensor:
    """A 32 x 32 image, white in its first `columns` columns and black elsewhere, in [-1, 1]."""
    image = -torch.ones(3, 32, 32)
    image[:, :, :columns] = 1.0
    return image


def test_a_group_with_equal_totals_has_zero_spread_and_the_std_is_credits_population_std():
    groups = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4])
    total = np.array([0.5, 0.5, 0.5, 0.0, 1.0, 2.0, 0.3, 0.3 + 1e-9, 0.7, 0.7, 5.0, 1.0, 2.0])
    valid = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], dtype=bool)  # group 4 has no valid sample
    image = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    row = group_metrics(total, {"image": image}, valid, groups, similarity=NO_IMAGES)
    # groups 0 (equal), 2 (within the 1e-8 tolerance) and 3 (equal over its valid samples) of 0-3
    assert row["groups/zero_std"] == 0.75
    assert row["groups/zero_std/image"] == 0.75  # groups 0, 1 and 3: each term alone
    assert row["groups/reward_std"] == pytest.approx((math.sqrt(2 / 3) + 5e-10) / 4, rel=1e-9)
    # the std GRPO's advantage divides by (algorithm/credit.py): A = (R - mean) / (std + 1e-4)
    adv = group_normalise(total, groups, valid, clip=10.0)
    assert 1.0 / adv[5] - 1e-4 == pytest.approx(math.sqrt(2 / 3), rel=1e-9)
    assert row["groups/similarity"] is None
    assert group_metrics(total, {"image": image}, np.zeros_like(valid), groups, similarity=NO_IMAGES) == \
        {"groups/zero_std": None, "groups/reward_std": None, "groups/zero_std/image": None, "groups/similarity": None}


def test_identical_samples_are_similarity_one_and_two_known_images_their_correlation():
    a, b = halves(16), halves(8)
    assert similarity_of(torch.stack([a, a, a]), [0, 0, 0])[0] == pytest.approx(1.0, abs=1e-12)
    # a: +-1 on halves (mean 0); b: 1 on a quarter, mean -1/2, centred +3/2 and -1/2:
    # mean product 1/2, mean squares 1 and 3/4, so the cosine is (1/2) / sqrt(3/4) = 1/sqrt(3)
    assert similarity_of(torch.stack([a, b]), [7, 7]) == {7: pytest.approx(1 / math.sqrt(3), abs=1e-12)}
    assert similarity_of(torch.stack([a, -a]), [0, 0])[0] == pytest.approx(-1.0, abs=1e-12)


def test_the_similarity_is_the_mean_pairwise_pearson_correlation_of_the_8x8_images_whatever_the_split():
    images = torch.rand(7, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    groups = [0, 0, 0, 0, 1, 1, 1]
    small = F.avg_pool2d(images, 4).flatten(1).double().numpy()  # 32 / 8: each 8 x 8 cell a 4 x 4 block
    expected = {g: np.mean([np.corrcoef(small[i], small[j])[0, 1] for i in members for j in members if i < j])
                for g, members in ((0, range(4)), (1, range(4, 7)))}
    whole = similarity_of(images, groups)
    assert whole == {g: pytest.approx(v, abs=1e-12) for g, v in expected.items()}
    assert abs(whole[0] - whole[1]) > 1e-3  # the groups are told apart
    # a group split between parts (chunks, workers, ranks): the parts' sums merge to the same value
    parts = SimilaritySums.join([group_sums(signatures(images[:2]), groups[:2]),
                                 group_sums(signatures(images[2:5]), groups[2:5]),
                                 group_sums(signatures(images[5:]), groups[5:])])
    assert group_similarity(parts) == {g: pytest.approx(v, abs=1e-12) for g, v in whole.items()}


def test_a_clip_is_one_flattened_sample_and_a_flat_sample_is_left_out():
    clip = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1  # (F, 3, H, W)
    moved = clip.clone()
    moved[-1] = clip[0]  # another last frame
    clips = torch.stack([clip, clip, moved])
    assert signatures(clips).shape == (3, 4 * 3 * 8 * 8)
    assert similarity_of(clips[:2], [0, 0])[0] == pytest.approx(1.0, abs=1e-12)
    assert 0.5 < similarity_of(clips[1:], [0, 0])[0] < 1 - 1e-3
    flat = torch.full((3, 32, 32), 0.25)
    assert similarity_of(torch.stack([flat, halves(16)]), [0, 0]) == {}  # one patterned sample: no pair
    assert similarity_of(torch.stack([flat, halves(16), halves(8)]), [0, 0, 0])[0] == \
        pytest.approx(1 / math.sqrt(3), abs=1e-12)


def test_a_rollout_split_between_workers_mid_group_gives_the_whole_rollouts_similarity():
    from cluster.rollout_worker import RolloutWorker
    cfg = make_config("experts.n_refiners=1", "rollout.batch_size=3", preset="shapes-tiny")
    worker = RolloutWorker(cfg, 0)
    prompts = prompt_set(2, seed=0)
    items = [Sample(g * 4 + k, g, prompts[g], k < 3) for g in range(2) for k in range(4)]
    whole = group_similarity(worker.run(0, items).meta.similarity)
    split = RolloutMeta.join([worker.run(0, items[:3]).meta, worker.run(0, items[3:]).meta])
    assert sorted(whole) == [0, 1] and all(-1 <= v <= 1 for v in whole.values())
    assert group_similarity(split.similarity) == {g: pytest.approx(v, abs=1e-6) for g, v in whole.items()}


def test_grad_norm_is_torchs_norm_of_the_gradient_before_clipping():
    from experts.expert import Expert
    clip = 1e-4
    expert = Expert(make_config(f"algorithm.grad_clip={clip}", "experts.refiner_0.kl_beta=0.05",
                                preset="shapes-tiny"), "refiner_0")
    batch, adv = refiner_batch(expert.model)
    shard = {"prompts": batch["prompts"], **{k: batch[k].numpy() for k in ("tokens", "logps", "mask")}}
    expert.model.train()
    expert.kind.backward(expert.model, expert.reference, expert.kind.merge(expert.model, [shard], expert.device), adv)
    unclipped = float(torch.nn.utils.clip_grad_norm_(expert.trainable, math.inf))  # torch's value, nothing clipped
    with gradients_applied(expert) as applied:
        stats = expert.apply(0, adv.numpy(), (shard,))
    assert unclipped > 100 * clip and stats["grad_norm"] == pytest.approx(unclipped, rel=1e-6)
    clipped = float(torch.nn.utils.get_total_norm(applied[0]))
    assert clipped == pytest.approx(clip, rel=1e-3)  # what the step used was clipped; the stat is from before


@pytest.mark.parametrize("preset, layout, smaller", [
    ("shapes-tiny", "separate", []),
    ("shapes-video", "colocated", ["trainer.prompts_per_step=2", "experts.generator.sample_steps=4"])],
    ids=["shapes-tiny-separate", "shapes-video-colocated"])
def test_every_row_of_a_run_carries_the_four_diagnostics(preset, layout, smaller, tmp_path):
    cfg = make_config("cluster.mode=inline", f"cluster.layout={layout}", "trainer.steps=2", *smaller, preset=preset)
    rows, _, _ = run_training(cfg, tmp_path)
    experts = cfg.experts.ids()
    for row in rows:
        values = [row["groups/zero_std"], row["groups/reward_std"], row["groups/similarity"],
                  *(row[f"grad_norm/{e}"] for e in experts)]
        assert all(isinstance(v, float) and math.isfinite(v) for v in values), row
        assert 0 <= row["groups/zero_std"] <= 1 and row["groups/reward_std"] >= 0
        assert -1 <= row["groups/similarity"] <= 1 and all(row[f"grad_norm/{e}"] > 0 for e in experts)
