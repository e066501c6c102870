"""task.rare_wording: a share of the training prompts say their colours, shapes, counts and
relations in rare synonyms, words the base's captions use rarely and the refiners' supervised start
has seen as often as the usual ones (PromptRL's third mechanism: the LM knows language the
generator reads poorly). Off by default, where everything computes as before."""
from pathlib import Path

import numpy as np
import pytest
import torch

import driver.cli as cli
from driver.bases import base_dir, refiner_dir
from driver.commands.pretrain import caption_batch, refinement_batch
from experts.frontend import ShapesFrontEnd
from experts.kinds import build_model
from tasks import build_task, refiner_vocabulary, text_vocabulary
from tasks.shapes import (EOS, RARE_SYNONYMS, RARE_VOCAB, RARE_WORD_TO_ID, VOCAB, WORD_TO_ID, ObjectClause, Prompt,
                          prompt_set, rare_worded)
from tests.conftest import make_config, run_training

ROOT = Path(__file__).resolve().parent.parent
USUAL = set(WORD_TO_ID)
RARE_IDS = set(range(len(VOCAB), len(RARE_VOCAB)))


def test_a_rare_worded_prompt_says_every_clause_word_in_its_synonym_with_the_same_clauses():
    prompts = prompt_set(120, seed=3)
    for p in prompts:
        rare = rare_worded(p)
        assert (rare.objects, rare.relation, rare.category) == (p.objects, p.relation, p.category)
        assert len(rare.text.split()) == len(p.text.split())
        assert not set(rare.text.split()) & set(RARE_SYNONYMS)  # no usual colour, shape, count or relation left
        assert list(rare.ids) == [RARE_WORD_TO_ID[w] for w in rare.text.split()]
    said = {w for p in prompts for w in rare_worded(p).text.split()}
    assert set(RARE_SYNONYMS.values()) - {"discs", "tiles", "wedges"} <= said  # plurals: only where counted
    assert RARE_VOCAB[:len(VOCAB)] == VOCAB  # the usual words keep their ids
    two = Prompt.make("two red squares", "counting", [ObjectClause("square", "red", 2)])
    assert rare_worded(two).text == "twin crimson tiles"


def test_off_by_default_every_vocabulary_prompt_and_base_is_as_before():
    config = make_config()
    assert list(text_vocabulary(config.task).words) == list(refiner_vocabulary(config.task).words) == VOCAB
    assert base_dir(config).name == "base-8485d353bac7"  # the shipped base's hash: unchanged
    assert refiner_dir(config, "refiner_0").name == "refiner-f795d29c64c1"
    task = build_task(config)
    assert [p.text for p in task.train_prompts()] == [p.text for p in prompt_set(40, seed=_prompt_seed(config))]
    assert set(task.eval_sets()) == {"held_out", "paraphrased"}


def _prompt_seed(config) -> int:
    from common.seeding import derive_seed
    return derive_seed(config.trainer.seed, "prompts")


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_the_set_share_of_training_prompts_is_rare_worded_and_held_out_is_evaluated_in_both(share):
    config = make_config(f"task.rare_wording={share}")
    usual = build_task(make_config()).train_prompts()
    prompts = build_task(config).train_prompts()
    rare = [p for p in prompts if set(p.ids) & RARE_IDS]
    assert len(rare) == round(share * len(usual))
    assert [p.objects for p in prompts] == [p.objects for p in usual]  # the same requests, some said rarely
    sets = build_task(config).eval_sets()
    assert [p.objects for p in sets["rare_wording"]] == [p.objects for p in sets["held_out"]]
    assert all(set(p.ids) & RARE_IDS for p in sets["rare_wording"])
    assert build_task(config).train_prompts() == prompts  # from the run's seed alone


def test_the_text_encoder_and_the_refiner_read_the_rare_words():
    config = make_config("task.rare_wording=0.5")
    assert list(text_vocabulary(config.task).words) == list(refiner_vocabulary(config.task).words) == RARE_VOCAB
    prompt = rare_worded(Prompt.make("a red circle", "single_object", [ObjectClause("circle", "red")]))
    refiner = build_model(config, "refiner_0")
    assert refiner.prompt_ids(prompt) == list(prompt.ids)  # no rare word left out
    assert refiner.tok.num_embeddings == refiner.head.out_features == len(RARE_VOCAB)
    frontend = ShapesFrontEnd(config, "cpu")
    usual = Prompt.make("a red circle", "single_object", [ObjectClause("circle", "red")])
    text = frontend.condition([prompt, usual], [{}, {}])["text"]
    assert not np.allclose(text[0].numpy(), text[1].numpy())  # crimson disc is read, and is not red circle


def test_pretraining_sees_rare_words_in_its_share_and_the_refiners_in_half_their_examples():
    def rare_share(ids) -> float:
        return float(np.mean([bool(set(np.asarray(row).tolist()) & RARE_IDS) for row in ids]))
    ids, _ = caption_batch(np.random.default_rng(0), 400, 32, rare_share=0.1)
    assert 0.05 < rare_share(ids) < 0.15
    usual, _ = caption_batch(np.random.default_rng(0), 400, 32)
    assert rare_share(usual) == 0.0
    prompts, tokens = refinement_batch(np.random.default_rng(0), 400, degraded_share=0.2, max_new_tokens=6,
                                       restate_share=1.0, rare_share=0.5)
    assert 0.4 < rare_share(prompts) < 0.6
    written = {int(t) for row in tokens for t in row}
    assert not written & RARE_IDS  # a refiner restates a request in the usual words, the ones the base reads


@pytest.mark.parametrize("sets, named", [(["task.rare_wording=1.5"], "task.rare_wording"),
                                         (["task.rare_wording=-0.1"], "task.rare_wording"),
                                         (["task.name=shapes_video", "task.num_frames=4", "task.rare_wording=0.5"],
                                          "task.rare_wording")])
def test_a_rare_wording_the_task_cannot_have_exits_2_naming_the_key(sets, named, capsys):
    assert cli.main(["train", "--config", "shapes-tiny", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_run_with_rare_wording_evaluates_both_wordings(tmp_path):
    config = make_config("task.rare_wording=0.5", "trainer.steps=2", "cluster.mode=inline", "evaluation.every=2",
                         "evaluation.per_category=1", preset="shapes-tiny")
    rows, _, _ = run_training(config, tmp_path)
    assert {"eval/rare_wording/refined/image/strict", "eval/held_out/refined/image/strict"} <= set(rows[-1])


def test_a_rewriting_start_is_taught_the_whole_request_in_its_usual_words():
    """pretrain.rewrite_share=1: every supervised example of a refiner is its prompt restated whole,
    a rare-worded prompt in the usual words, then <eos>; off (0) the examples draw as before."""
    usual = {v: k for k, v in RARE_SYNONYMS.items()}
    prompts, tokens = refinement_batch(np.random.default_rng(0), 200, degraded_share=0.2, max_new_tokens=17,
                                       rare_share=0.5, rewrite_share=1.0)
    for ids, row in zip(prompts, tokens.tolist()):
        asked = [RARE_VOCAB[i] for i in ids]
        assert row[:row.index(EOS)] == [WORD_TO_ID[usual.get(w, w)] for w in asked]
    before = refinement_batch(np.random.default_rng(0), 50, degraded_share=0.2, max_new_tokens=6, restate_share=0.25)
    off = refinement_batch(np.random.default_rng(0), 50, degraded_share=0.2, max_new_tokens=6, restate_share=0.25,
                           rewrite_share=0.0)
    assert before[0] == off[0] and torch.equal(before[1], off[1])


def test_the_shipped_rewriting_start_restates_rare_prompts_and_its_base_is_named_by_file():
    """The rewriter shipped beside the rare-wording base (made with `jointrl pretrain --refiners`):
    the base's generator and text encoder named by their files (the base was made for the detail
    refiners' captions), `experts.base` finds only the refiner's start, which restates nearly every
    rare-worded held-out prompt in the usual words, sampled at its temperature."""
    base = ROOT / "configs" / "bases" / "shapes-rare"
    made = next(base.glob("base-*"))
    cfg = make_config("task.rare_wording=0.5", f"experts.base={base}", "experts.n_refiners=1",
                      "experts.refiner_0.max_new_tokens=17", "pretrain.rewrite_share=1.0",
                      f"experts.generator.init={made / 'generator.safetensors'}",
                      f"experts.text_encoder.init={made / 'text_encoder.safetensors'}", preset="shapes")
    assert cfg.expert("refiner_0").init == str(refiner_dir(cfg, "refiner_0", base) / "refiner.safetensors")
    model = build_model(cfg, "refiner_0")
    asked = [rare_worded(p) for p in prompt_set(64, 1)]
    tokens, _, _ = model.sample([list(p.ids) for p in asked], torch.rand(64, 17, generator=torch.Generator().manual_seed(0)))
    usual = {v: k for k, v in RARE_SYNONYMS.items()}
    restated = [row[:row.index(EOS)] == [WORD_TO_ID[usual.get(w, w)] for w in p.text.split()] if EOS in row else False
                for row, p in zip(tokens.tolist(), asked)]
    assert np.mean(restated) > 0.9


def test_one_refiner_rewrites_beside_detail_refiners_from_the_shipped_starts(capsys):
    """pretrain.rewrite_shares={refiner_0: 1.0}: refiner_0 starts from the rewriter shipped beside
    the rare-wording base (the start pretrain.rewrite_share=1.0 makes for one refiner), the other
    refiners from the detail refiners' start; a name that is not a refiner of the run exits 2."""
    base = ROOT / "configs" / "bases" / "shapes-rare"
    made = next(base.glob("base-*"))
    named = [f"experts.generator.init={made / 'generator.safetensors'}",
             f"experts.text_encoder.init={made / 'text_encoder.safetensors'}"]
    cfg = make_config("task.rare_wording=0.5", f"experts.base={base}", "experts.refiner_0.max_new_tokens=17",
                      "pretrain.rewrite_shares={refiner_0: 1.0}", *named, preset="shapes")
    rewriter = make_config("task.rare_wording=0.5", f"experts.base={base}", "experts.n_refiners=1",
                           "experts.refiner_0.max_new_tokens=17", "pretrain.rewrite_share=1.0", *named, preset="shapes")
    detail = make_config("task.rare_wording=0.5", f"experts.base={base}", preset="shapes")
    assert cfg.expert("refiner_0").init == rewriter.expert("refiner_0").init
    assert [cfg.expert(e).init for e in ("refiner_1", "refiner_2")] == [detail.expert("refiner_1").init] * 2
    assert cfg.pretrain.rewrite_share_of("refiner_0") == 1.0 and cfg.pretrain.rewrite_share_of("refiner_1") == 0.0
    assert cli.main(["config", "show", "--config", "shapes", "--set", "pretrain.rewrite_shares={refiner_3: 1.0}"]) == 2
    assert "pretrain.rewrite_shares names ['refiner_3']" in capsys.readouterr().err
