"""recipes.py: the ladder's plan and the reading of its runs, as pure functions; the whole ladder
end to end on the tiny preset in the slow tier."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import config as C
import recipes as RE

ROOT = Path(__file__).resolve().parents[1]


def test_the_plan_runs_the_article_per_seed_the_sweep_then_a_cumulative_chain():
    plan = RE.ladder_plan("22m", seeds=2)
    assert [r.group for r in plan[:2]] == ["article", "article"] and [r.seed for r in plan[:2]] == [1337, 1338]
    assert all(r.config == "22m-gpt3" for r in plan)
    sweep = [r for r in plan if r.group == "sweep"]
    assert [r.overrides for r in sweep][:3] == [{"train__lr": 1.5e-3 * m} for m in RE.SWEEP_LR]
    chain = [r for r in plan if r.group == "chain"]
    assert [r.name for r in chain] == [name for name, _ in RE.CHAIN] + ["262K batch"]
    for before, after in zip(chain, chain[1:]):  # each rung keeps every change before it
        assert before.overrides.items() <= after.overrides.items()
    assert chain[-1].overrides["train__muon"] is True and chain[-1].overrides["train__batch_tokens"] == 262_144
    assert len({r.folder for r in plan}) == len(plan)  # one run folder per rung and seed
    assert all(r.folder.isascii() for r in plan) and "relu2-s1337" in {r.folder for r in plan}  # "+ ReLU²"


def test_every_rung_config_passes_the_strict_loader_with_its_run_settings():
    base = C.preset("22m-gpt3")
    fixed = RE.fixed_settings(base, tokens=83_886_080, corpus="python", micro_batch=64)
    versus = RE.versus_plan("88m", 1, muon=True) + RE.versus_plan("88m", 1, micro_batch=64)
    for recipe in RE.ladder_plan("22m", 1) + versus:
        cfg, overrides = RE.resolved(recipe, fixed)
        steps = cfg.train.tokens // cfg.train.batch_tokens
        assert cfg.data.corpus == "python" and cfg.data.max_documents == 0 and cfg.train.sample_tokens == 0
        warms_up = C.preset(recipe.config).train.warmup_steps > 0  # the record recipe warms up none: 1 step
        assert cfg.train.warmup_steps >= (steps // 10 if warms_up else 1)
        assert cfg.train.eval_every == max(1, steps // RE.EVALS_PER_RUN)
    assert RE.to_flags({"train__lr": 0.003, "train__muon": True, "model__qk_norm": False}) == [
        "--lr", "0.003", "--muon", "--no-qk-norm"]


def test_a_full_budget_rung_warms_up_as_its_preset_and_a_short_one_for_the_same_share():
    article, default = RE.versus_plan("22m", 1, muon=True)
    full = RE.fixed_settings(C.preset("22m-gpt3"), tokens=440_401_920, corpus="python", micro_batch=64)
    assert RE.resolved(article, full)[0].train.warmup_steps == 200  # 200 of 840 steps, as configs/22m-gpt3.toml
    assert RE.resolved(default, full)[0].train.warmup_steps == 200  # 200 of 1,680
    short = RE.fixed_settings(C.preset("22m-gpt3"), tokens=83_886_080, corpus="python", micro_batch=64)
    assert RE.resolved(article, short)[0].train.warmup_steps == 38  # 24% of 160 steps, as at full budget
    assert RE.resolved(default, short)[0].train.warmup_steps == 38  # 12% of 320 steps, as at full budget
    article, _ = RE.versus_plan("88m", 1)  # 88m warms up over 200 of 3,357 steps: 6%, 24 of a 400-step run
    short = RE.fixed_settings(C.preset("88m-gpt3"), tokens=209_715_200, corpus="python", micro_batch=32)
    assert RE.resolved(article, short)[0].train.warmup_steps == 40  # the 10% floor


def test_versus_runs_the_default_on_each_fraction_of_the_budget_seed_by_seed():
    """The default (the record recipe) on 8,192-token sequences holds as many tokens a micro-batch as the
    article's 64 x 1,024: 8 of them; its warm-up is the recipe's none (one step)."""
    plan = RE.versus_plan("22m", 2, tokens=440_401_920, fractions=(1, 0.4), micro_batch=64)
    assert [(r.name, r.seed) for r in plan] == [
        ("article (GPT-3 2020)", 1337), ("default recipe", 1337), ("default recipe, 40% of the tokens", 1337),
        ("article (GPT-3 2020)", 1338), ("default recipe", 1338), ("default recipe, 40% of the tokens", 1338)]
    fixed = RE.fixed_settings(C.preset("22m-gpt3"), tokens=440_401_920, corpus="python", micro_batch=64)
    cfg = RE.resolved(plan[2], fixed)[0]
    short = cfg.train
    assert short.tokens == 176_160_768 and short.schedule == "wsd"  # the whole warm-down, on 40% of the tokens
    assert short.warmup_steps == 1 and short.eval_every == 22  # 448 steps of 393,216 tokens; 20 passes
    assert (cfg.model.context, short.micro_batch, short.doc_mask, short.batch_tokens) == (8192, 8, True, 393_216)
    assert plan[2].overrides == {"train__micro_batch": 8, "train__tokens": 176_160_768}
    assert cfg.model.value_embeds and cfg.train.embed_lr == 0.6  # the record's parts, from configs/22m.toml
    assert len({r.folder for r in plan}) == len(plan)
    only_short = RE.versus_plan("22m", 1, tokens=440_401_920, fractions=(0.4,))  # the full-length default left out
    assert [r.name for r in only_short] == ["article (GPT-3 2020)", "default recipe, 40% of the tokens"]


def test_versus_with_newest_puts_each_idea_on_the_default_beside_it_on_the_same_tokens():
    """--versus --newest stack: per seed and fraction, the default and the default with the 126m default's ideas
    (what this shape can take: 22m's three heads leave paired heads out), on the same tokens, each timed to the
    article's loss; the idea's rung at the quarter batch holds a micro-batch that divides it."""
    plan = RE.versus_plan("22m", 2, tokens=440_401_920, fractions=(0.4,), micro_batch=64, newest=("stack",))
    stack = f"default recipe {RE.NEWEST['stack'][0]}, 40% of the tokens"
    assert [(r.name, r.seed) for r in plan] == [
        ("article (GPT-3 2020)", 1337), ("default recipe, 40% of the tokens", 1337), (stack, 1337),
        ("article (GPT-3 2020)", 1338), ("default recipe, 40% of the tokens", 1338), (stack, 1338)]
    fixed = RE.fixed_settings(C.preset("22m-gpt3"), tokens=440_401_920, corpus="python", micro_batch=64)
    default, ideas = (RE.resolved(r, fixed)[0] for r in plan[1:3])
    assert ideas.train.tokens == default.train.tokens == 176_160_768
    adopted = C.preset("126m")
    assert (ideas.model.xsa, ideas.model.bigram_rows, ideas.train.mtp_tokens) == (True, 163840, 3)
    assert ideas.train.warmdown_fraction == adopted.train.warmdown_fraction and not ideas.model.paired_heads
    assert (ideas.train.batch_tokens, ideas.train.micro_batch) == (98_304, 6)  # 12 sequences a step: 6 divides them
    assert len({r.folder for r in plan}) == len(plan)
    with pytest.raises(ValueError, match="--newest paired-heads does not apply to 22m"):
        RE.versus_plan("22m", 1, tokens=440_401_920, fractions=(0.4,), micro_batch=64, newest=("paired-heads",))


def test_versus_muon_runs_the_muon_recipe_against_the_article():
    """--versus --muon: the other side is configs/<preset>-muon.toml, on the article's 1,024-token windows at
    the same micro-batch, warming up over the same share of its steps as at its full budget."""
    plan = RE.versus_plan("22m", 1, tokens=440_401_920, fractions=(0.4,), micro_batch=64, muon=True)
    assert [(r.name, r.config) for r in plan] == [("article (GPT-3 2020)", "22m-gpt3"),
                                                  ("Muon recipe, 40% of the tokens", "22m-muon")]
    assert plan[1].overrides == {"train__tokens": 176_160_768}
    fixed = RE.fixed_settings(C.preset("22m-gpt3"), tokens=440_401_920, corpus="python", micro_batch=64)
    cfg = RE.resolved(plan[1], fixed)[0]
    assert (cfg.model.context, cfg.train.micro_batch, cfg.train.muon, cfg.train.warmup_steps) == (1024, 64, True, 80)
    assert RE.record_recipe("126m", 32) == RE.record_plan("126m", 1, 32)[-1].overrides | {
        "train__warmup_steps": 0}  # the ladder's rung 0 warm-up, which the chain's "no warm-up" sets to 0


def test_a_rung_on_long_sequences_is_timed_and_tabled_at_equal_context():
    """time_to reads the 1,024-window loss where a run has one: its 8,192-token loss as trained is lower, and
    would reach the article's target (measured on 1,024 windows) sooner than the model does at equal context."""
    curve = [dict(p, val_loss=p["val_loss"] - 1, val_loss_1024=p["val_loss"], val_bpb_1024=p["val_bpb"]) for p in CURVE]
    assert RE.time_to(curve, 3.5) == (250.0, 2.5)
    row = RE.summarize("record", [{"curve": curve, "tok_s": 100.0}], 3.5, 100.0)
    assert row["seconds_to_target"] == 2.5 and row["val_loss_1024"] == 3.0 and row["val_loss"] == 2.0
    assert "| record | 1 | 3.0000 (2.0000 as trained) |  | 1.2000 | 250 | 2.5 |" in RE.table([row])


def test_muon_needs_the_versus_study(capsys):
    import bench as B
    with pytest.raises(SystemExit):
        B.main(["--recipes", "--muon"])
    assert "--muon: it picks the other side of --recipes --versus; add both flags" in capsys.readouterr().err


def test_fractions_need_the_versus_study_and_a_share_of_the_budget(capsys):
    import bench as B
    with pytest.raises(SystemExit):
        B.main(["--recipes", "--fractions", "0.4"])
    assert "--fractions: they size the default recipe's schedules in --recipes --versus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        B.main(["--recipes", "--versus", "--fractions", "1.5"])
    assert "--fractions 1.5: each is a share of the token budget, more than 0 and at most 1" in capsys.readouterr().err


def test_misspelled_recipe_setting_fails_before_anything_runs(tmp_path):
    bad = RE.Recipe("typo", "tiny-gpt3", "chain", {"train__muon_lrr": 0.02})
    with pytest.raises(ValueError, match=r"unknown key\(s\) train\.muon_lrr"):
        RE.run_all([bad], {}, tmp_path, [None], timeout=60, resume=False)
    assert not any(tmp_path.iterdir())


CURVE = [{"step": 1, "tokens": 100, "train_seconds": 1.0, "val_loss": 5.0, "val_bpb": 2.0},
         {"step": 2, "tokens": 200, "train_seconds": 2.0, "val_loss": 4.0, "val_bpb": 1.6},
         {"step": 3, "tokens": 300, "train_seconds": 3.0, "val_loss": 3.0, "val_bpb": 1.2}]


def test_time_to_a_loss_interpolates_between_passes():
    assert RE.time_to(CURVE, 3.5) == (250.0, 2.5)
    assert RE.time_to(CURVE, 5.5) == (100.0, 1.0)  # reached at the first pass
    assert RE.time_to(CURVE, 2.9) is None


def test_a_change_helps_when_it_lowers_the_loss_or_matches_it_faster():
    rows = [{"rung": "article", "val_loss": 4.0, "train_seconds": 10.0},
            {"rung": "lower", "val_loss": 3.9, "train_seconds": 10.0},
            {"rung": "worse", "val_loss": 3.95, "train_seconds": 9.0},
            {"rung": "same, faster", "val_loss": 3.952, "train_seconds": 8.0},
            {"rung": "same, as fast", "val_loss": 3.951, "train_seconds": 7.9}]
    assert RE.helped(rows) == ["lower", "same, faster"]


def test_rows_average_seeds_and_time_each_rung_to_the_articles_mean_loss():
    runs = {"a1": {"curve": CURVE, "tok_s": 100.0},
            "a2": {"curve": [dict(p, val_loss=p["val_loss"] + 0.2) for p in CURVE], "tok_s": 100.0},
            "b1": {"curve": [dict(p, val_loss=p["val_loss"] - 1) for p in CURVE], "tok_s": 80.0}}
    plan = [RE.Recipe("article", "tiny-gpt3", "article", seed=1), RE.Recipe("article", "tiny-gpt3", "article", seed=2),
            RE.Recipe("b", "tiny-gpt3", "chain", seed=1)]
    results = dict(zip([r.folder for r in plan], runs.values()))
    article, b = RE.rows_for(plan, results)
    assert article["seeds"] == 2 and article["val_loss"] == pytest.approx(3.1) and article["spread"] == pytest.approx(0.2)
    assert b["tokens_to_target"] == pytest.approx(190.0) and b["seconds_to_target"] == pytest.approx(1.9)
    assert b["step_overhead"] == pytest.approx(0.25)
    table = RE.table([article, b])
    assert "| article | 2 | 3.1000 | 0.2000 | 1.2000 | 300 | 3.0 | 1.00 | 100 | +0.0% |" in table
    assert "| b | 1 | 2.0000 |  | 1.2000 | 190 | 1.9 | 0.63 | 80 | +25.0% |" in table  # one seed: no spread


def test_tokens_are_printed_in_a_unit_that_fits():
    assert [RE.tokens_text(n) for n in (512, 327_680, 21_040_000, 440_401_920, 2.5e9)] == \
        ["512", "328K", "21.0M", "440M", "2.5B"]


def test_a_rungs_tok_s_is_its_whole_runs_not_its_last_sessions(tmp_path):
    run = tmp_path / "rung-s1337"
    run.mkdir()
    (run / "summary.json").write_text('{"mean_tok_s": 8336}')  # the second session's alone, after --resume
    (run / "log.jsonl").write_text('{"step": 4, "tokens": 4000, "train_seconds": 2.0, "val_loss": 5.0, "val_bpb": 2.0}\n')
    assert RE.read_run(run)["tok_s"] == 2000.0


@pytest.mark.slow
def test_the_recipe_ladder_runs_end_to_end_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--recipes", "--preset", "tiny", "--tokens", "16384",
                           "--seeds", "1", "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = json.loads((tmp_path / "recipes-tiny.json").read_text())
    names = [r["rung"] for r in found["rows"]]
    chain = [n for n, _ in RE.CHAIN] + ["8K batch"]  # half the tiny preset's 16,384 tokens
    assert names[0] == "article (GPT-3 2020)" and chain == names[1 + len(RE.SWEEP_LR) + len(RE.SWEEP_WD):-1]
    assert names[-1].startswith("final: ") and all("val_loss" in r for r in found["rows"])
    assert (tmp_path / "recipes-tiny.png").exists() and "| rung | seeds | final val loss" in done.stdout


@pytest.mark.slow
def test_versus_with_a_fraction_runs_end_to_end_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--recipes", "--versus", "--preset", "tiny",
                           "--tokens", "32768", "--fractions", "1", "0.5", "--seeds", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "recipes-tiny-versus.json").read_text())["rows"]
    assert [(r["rung"], r["tokens"]) for r in rows] == [("article (GPT-3 2020)", 32768), ("default recipe", 32768),
                                                         ("default recipe, 50% of the tokens", 16384)]
    assert sorted(p.name for p in (tmp_path / "recipes" / "tiny_stdlib_32768").iterdir()) == [
        "article-gpt-3-2020-s1337", "default-recipe-50-of-the-tokens-s1337", "default-recipe-s1337"]


@pytest.mark.slow
def test_versus_muon_runs_end_to_end_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--recipes", "--versus", "--muon", "--preset",
                           "tiny", "--tokens", "32768", "--seeds", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = json.loads((tmp_path / "recipes-tiny-versus-muon.json").read_text())
    assert [r["rung"] for r in found["rows"]] == ["article (GPT-3 2020)", "Muon recipe"] and found["muon"]


def test_the_record_ladder_adds_one_idea_a_rung_and_ends_at_the_record_preset():
    """--seconds: the Muon recipe, then RECORD_CHAIN cumulatively; its last rung is configs/126m.toml without the
    newest records' ideas (at the micro-batch that holds as many tokens: 32 x 1,024 = 4 x 8,192, and without the FP8
    block matmuls, a speed setting the ladder leaves off), so record #28's recipe is what the ladder measures;
    further seeds repeat only the last rung."""
    plan = RE.record_plan("126m", seeds=2, micro_batch=32)
    assert [r.name for r in plan] == ["Muon recipe", *(n for n, _ in RE.RECORD_CHAIN), RE.RECORD_CHAIN[-1][0]]
    assert {r.config for r in plan} == {"126m-muon"}
    assert [r.seed for r in plan[-2:]] == [RE.SEED, RE.SEED + 1] and plan[0].overrides == {"train__warmup_steps": 30}
    fixed = {**RE.fixed_settings(C.preset("126m-muon"), 0, "python", 32), "train__seconds": 150.0}
    last = C.preset("126m-muon", **{**fixed, **plan[-1].overrides})
    assert last == C.preset("126m", **{**fixed, **RE.newest_off("126m"), "train__micro_batch": 4, "speed__fp8": False})
    long = C.preset("tiny", **{**RE.fixed_settings(C.preset("tiny"), 0, "stdlib", 16), "train__seconds": 5.0,
                               **RE.record_plan("tiny", 1, 16)[-1].overrides})
    assert (long.model.context, long.model.attn_window, long.train.window_start, long.train.micro_batch) == (4096, 896, 64, 2)


def test_the_record_table_compares_rungs_at_equal_seconds():
    curve = [dict(CURVE[-1], step=40, val_loss_1024=2.5)]
    rows = [RE.summarize("all", [{"curve": curve, "tok_s": 100.0}, {"curve": [dict(curve[0], val_loss=2.2)],
                                                                   "tok_s": 100.0}], None, None),
            RE.summarize("default", [{"curve": [dict(CURVE[-1], step=50)], "tok_s": 120.0}], None, None)]
    table = RE.seconds_table(rows)
    assert "| all | 2 | 2.6000 | - | 2.5000 | 0.8000 | 40 |" in table
    assert "| default | 1 | 3.0000 | - | 3.0000 |  | 50 |" in table  # one seed: no spread; its own loss is plain


def test_the_newest_ideas_run_each_on_record_28_alone_and_compare_by_seed():
    """--newest: record #28's recipe (every idea off), then each idea on top of it alone (not carried), then the
    default where it adopted some, once per seed; each rung's config loads; the table gives each seed's loss minus
    record #28's at that seed, and the whole-window loss."""
    plan = RE.newest_plan("126m", 2, ("bigram", "mtp"), 12)
    assert [(r.name, r.seed) for r in plan] == [
        (RE.WITHOUT_NEWEST, 1337), (RE.WITHOUT_NEWEST, 1338), (RE.NEWEST["bigram"][0], 1337),
        (RE.NEWEST["bigram"][0], 1338), (RE.NEWEST["mtp"][0], 1337), (RE.NEWEST["mtp"][0], 1338),
        (RE.ADOPTED, 1337), (RE.ADOPTED, 1338)]
    record = RE.newest_off("126m")  # 126m took the newest recipe's quarter batch, warm-down and soft-cap: record #28's
    assert record == {**RE.NEWEST_OFF, "train__batch_tokens": 393216, "train__eval_every": 250, "train__ckpt_every": 250,
                      "train__warmdown_fraction": 0.45, "train__min_lr_ratio": 0.1, "model__logit_softcap": 15.0,
                      "model__n_layers": 12, "model__skip_attn_layer": 7}
    assert RE.newest_off("22m") == RE.NEWEST_OFF
    assert plan[2].overrides == {**record, "model__bigram_rows": 5 * 32768}
    assert plan[4].overrides == {**record, "train__mtp_tokens": 3} and plan[-1].overrides == {}
    assert RE.newest_plan("126m", 1, ("quarter-batch",), 12)[1].overrides == {**record, "train__batch_tokens": 98304}
    assert RE.newest_plan("tiny", 1, ("quarter-batch",), 16)[1].overrides["train__micro_batch"] == 8
    assert RE.newest_plan("126m", 1, ("batch-stages",), 12)[1].overrides == {**record, "train__batch_stages": 3,
                                                                             "train__micro_batch": 8}
    assert [r.name for r in RE.newest_plan("22m", 1, ("smear",), 12)] == [RE.WITHOUT_NEWEST, RE.NEWEST["smear"][0]]
    for preset, corpus in (("126m", "python"), ("tiny", "stdlib")):  # each idea's config loads on each
        fixed = {**RE.fixed_settings(C.preset(preset), 0, corpus, 12), "train__seconds": 70.0}
        for key in RE.NEWEST:
            off, idea = RE.newest_plan(preset, 1, (key,), 12)[:2]
            changed = C.preset(idea.config, **{**fixed, **idea.overrides}) != C.preset(preset, **{**fixed, **off.overrides})
            assert changed
    # configs/recipes/newest.toml is every idea's own setting but those not measured yet or not adopted, the fused
    # decode off (it has no key offset, value gates or paired heads), and at the quarter batch evaluations and
    # checkpoints as many tokens apart as record #28's
    unadopted = ("batch-stages", "tied-head", "mimetic", "yarn", "momentum-cooldown", "adam-betas", "dense")
    ideas = [RE.newest_plan("126m", 1, (key,), 12)[1].overrides for key in RE.NEWEST
             if key not in unadopted and key != "stack"]
    adopted = {k: v for idea in ideas for k, v in idea.items() if k not in record or record[k] != v}
    rest = {"speed__fused_decode": False, "speed__split_decode": False, "train__eval_every": 1000,
            "train__ckpt_every": 1000}
    assert C.preset("126m", **{**record, **adopted, **rest}) == C.preset("126m")
    final = lambda loss, whole: {"curve": [dict(CURVE[-1], val_loss=loss, val_loss_whole=whole)], "tok_s": 1.0}
    results = {plan[0].folder: final(3.0, 2.9), plan[1].folder: final(2.9, 2.8), plan[2].folder: final(2.95, 2.7),
               plan[3].folder: final(2.8, 2.75), plan[4].folder: final(3.1, 3.0), plan[5].folder: {"error": "timed out"}}
    assert RE.paired(plan, results, plan[2].name) == pytest.approx([-0.2, -0.05])  # with whole windows
    assert RE.paired(plan, results, plan[4].name) == pytest.approx([0.1])  # the seed that finished
    row = RE.summarize(plan[2].name, [results[plan[2].folder], results[plan[3].folder]], None, None)
    row["paired"] = RE.paired(plan, results, plan[2].name)
    assert "| 2 | 2.8750 | 2.7250 | 2.8750 | 0.1500 | 3 | 300 | 3.0 | 1 | -0.2000 -0.0500 |" in RE.seconds_table([row])


def test_the_newest_ideas_evaluate_on_as_many_tokens_as_far_apart_whatever_the_batch(monkeypatch, tmp_path):
    """Every --newest rung validates on the tokens record #28's batch sizes (2 x 393,216 at 126m), not on the quarter
    batch's, so the ladder's losses compare with those measured before 126m took it; and every 25 steps of that
    batch: the default's quarter batch every 100, record #28's rung every 25."""
    seen = {}
    def run_all(plan, fixed, *args, **kwargs):
        seen.update(fixed, every={r.name: r.overrides["train__eval_every"] for r in plan})
        return {r.folder: {} for r in plan}
    monkeypatch.setattr(RE, "check_and_prepare", lambda *args, **kwargs: C.preset("126m"))
    monkeypatch.setattr(RE, "run_all", run_all)
    monkeypatch.setattr(RE, "summarize", lambda *args: {"rung": args[0]})
    monkeypatch.setattr(RE, "paired", lambda *args: [])
    RE.newest_study("126m", ("smear",), 1, "python", 12, tmp_path, 60, False, [None], seconds=70.0)
    assert seen["train__eval_tokens"] == 2 * 393216
    assert seen["every"] == {RE.WITHOUT_NEWEST: 25, RE.NEWEST["smear"][0]: 25, RE.ADOPTED: 100}


def test_an_idea_a_preset_cannot_take_is_named_in_one_line():
    with pytest.raises(ValueError, match=r"^--newest paired-heads does not apply to 22m: model.paired_heads pairs the "
                                         r"heads, but model.n_heads=3 is odd: make it even; leave it out of --newest"):
        RE.newest_plan("22m", 1, ("smear", "paired-heads"), 12)


def test_inside_the_newest_ideas_leave_out_what_the_default_has_and_add_what_it_has_not():
    """--newest --inside: the 126m default first, then each idea inside it: the bigram table (adopted) taken out, the
    mimetic init (not adopted) added; pairs by seed against the default."""
    plan = RE.newest_plan("126m", 2, ("bigram", "mimetic", "value-gate"), 12, inside=True)
    assert [r.name for r in plan[::2]] == [RE.ADOPTED, "- bigram hash table, 5x the vocabulary (#62)",
                                           RE.NEWEST["mimetic"][0], "- gates on the value embeddings (#55)"]
    assert [r.overrides for r in plan[::2]] == [{}, {"model__bigram_rows": 0, "model__bigram_signs": False},
                                                {"model__mimetic_init": 0.05, "model__n_kv_heads": 6},
                                                {"model__value_gate": False}]
    assert [r.seed for r in plan[:2]] == [1337, 1338]
    without = C.preset("126m", **plan[2].overrides)
    assert without.model.bigram_rows == 0 and without.train == C.preset("126m").train
    # one block fewer (adopted): taken out, record #28's 12 blocks with the attention-free one at 7; added to a
    # preset without it, the attention-free block stays behind the one dropped (126m-record's 7 of 12 is 6 of 11)
    fewer = RE.newest_plan("126m", 1, ("first-block",), 12, inside=True)[1]
    assert (fewer.name, fewer.overrides) == ("- one block fewer, the first dropped (#30, #35)",
                                             {"model__n_layers": 12, "model__skip_attn_layer": 7})
    assert RE.sized("first-block", C.preset("126m-record"), 12) == {"model__n_layers": 11, "model__skip_attn_layer": 6}
    assert RE.newest_plan("tiny", 1, ("first-block",), 12, inside=True)[1].overrides == {"model__n_layers": 3}
    # the quarter batch and the warm-down (adopted) out: record #28's; the batch stages added: sized on the preset's
    # own batch
    batch = RE.newest_plan("126m", 1, ("quarter-batch", "warmdown", "batch-stages"), 12, inside=True)
    assert [r.overrides for r in batch[1:]] == [{"train__batch_tokens": 393216},
                                                {"train__warmdown_fraction": 0.45, "train__min_lr_ratio": 0.1},
                                                {"train__batch_stages": 3, "train__micro_batch": 4}]


@pytest.mark.parametrize("args, message", [
    (["--recipes", "--newest", "bigram"], "--newest: its ideas are measured at equal training seconds or equal tokens"),
    (["--recipes", "--newest", "--seconds", "70", "--at-once", "2"], "--at-once 2: rungs share a card only where"),
    (["--recipes", "--tokens", "1000", "--at-once", "2"], "--at-once 2: rungs share a card only where"),
    (["--recipes", "--seconds", "70", "--inside"], "--inside: it measures the newest ideas inside the default")])
def test_newest_ideas_are_measured_at_equal_seconds_alone_or_equal_tokens(args, message, capsys):
    import bench
    with pytest.raises(SystemExit):
        bench.main(args)
    assert message in capsys.readouterr().err


def test_seconds_belong_to_the_record_ladder(capsys):
    import bench
    with pytest.raises(SystemExit):
        bench.main(["--recipes", "--versus", "--seconds", "150"])
    assert "--seconds 150: the record ladder's training seconds per rung" in capsys.readouterr().err


# A rung stands in for train.py: on SIGINT it writes its checkpoint and exits 130.
RUNG = ("import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *a: (pathlib.Path('ckpt.pt').write_text('saved'), sys.exit(130)))\n"
        "pathlib.Path('started').write_text('')\n"
        "time.sleep(60)\n")


def started_rung(folder: Path) -> subprocess.Popen:
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", RUNG], cwd=folder, start_new_session=True)  # as _run_queue's
    while not (folder / "started").exists():
        time.sleep(0.01)
    return proc


def test_ctrl_c_passes_one_sigint_to_each_rung_waits_for_its_save_and_says_what_is_kept(tmp_path, capsys):
    folder = tmp_path / "rung-s1337"
    proc = started_rung(folder)
    out = open(folder / "stdout.log", "w")
    with pytest.raises(SystemExit) as stop:
        RE.stop_children({"rung-s1337": (proc, None, 0.0, out)}, tmp_path)
    assert stop.value.code == 130 and proc.returncode == 130 and (folder / "ckpt.pt").read_text() == "saved"
    assert "1 interrupted one(s) with a checkpoint (rung-s1337)" in capsys.readouterr().err


def test_sigterm_stops_the_rungs_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """`kill` or `timeout` sends bench SIGTERM: each rung (in a session of its own, which a signal to bench does not
    reach) gets its SIGINT and saves, where it used to train on alone, holding its card and its folder."""
    def queue(todo, running, free, results, runs_dir, timeout):
        folder = runs_dir / "rung-s1337"
        running["rung-s1337"] = (started_rung(folder), None, 0.0, open(folder / "stdout.log", "w"))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    def unheard(signum, frame):
        raise RuntimeError("SIGTERM reached the handler run_all found, not its own")
    monkeypatch.setattr(RE, "_run_queue", queue)
    before = signal.signal(signal.SIGTERM, unheard)
    try:
        with pytest.raises(SystemExit) as stop:
            RE.run_all([], {}, tmp_path, [None], 60, False)
        assert signal.getsignal(signal.SIGTERM) is unheard  # run_all's handler is gone when it is
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stop.value.code == 130 and (tmp_path / "rung-s1337" / "ckpt.pt").read_text() == "saved"
    assert "SIGTERM: stopped; 0 finished rung(s) and 1 interrupted one(s)" in capsys.readouterr().err


def test_a_cut_off_summary_or_log_is_named_in_one_line(tmp_path):
    run = tmp_path / "rung-s1337"
    run.mkdir()
    (run / "summary.json").write_text('{"steps": 4, "mean')
    with pytest.raises(ValueError, match=r"rung-s1337/summary.json is not JSON .* delete it and run with --resume"):
        RE.read_run(run)
    (run / "summary.json").write_text('{"steps": 4}')
    (run / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')
    with pytest.raises(ValueError, match=r"rung-s1337/log.jsonl: line 2 is not a JSON row"):
        RE.read_run(run)


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused_before_any_rung(tmp_path):
    fixed = RE.fixed_settings(C.preset("tiny-gpt3"), 16384, "stdlib", 3)
    with pytest.raises(ValueError, match=r"train.batch_tokens=16,384 is not a multiple of micro_batch x context"):
        RE.run_all(RE.ladder_plan("tiny", 1), fixed, tmp_path, [None], 60, False)
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_relative_corpus_and_out_are_the_users_not_the_checkouts(tmp_path, monkeypatch):
    """The rungs run with the checkout as their working folder: bench hands them absolute paths."""
    import bench

    class Seen(Exception):
        pass

    def study(*args, **kwargs):
        raise Seen(args[3], args[5])

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench.RE, "study", study)
    with pytest.raises(Seen) as seen:
        bench.main(["--recipes", "--corpus", "texts/*.txt", "--out", "mine", "--tokens", "16384"])
    assert seen.value.args == (str(tmp_path / "texts" / "*.txt"), tmp_path / "mine")


def test_a_full_budget_ladder_on_a_cpu_says_what_it_costs_first(monkeypatch, capsys):
    import bench

    class Stop(Exception):
        pass

    def study(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(bench.C, "pick_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(bench.RE, "study", study)
    with pytest.raises(Stop):
        bench.main(["--recipes", "--preset", "22m"])
    assert "every rung trains 440,401,920 tokens (--preset 22m's full budget) on the CPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["22m", "47m", "88m", "126m"])
def test_each_default_preset_is_the_record_ladders_last_rung_at_its_own_micro_batch(name):
    """configs/<preset>.toml without the newest records' ideas is configs/<preset>-muon.toml with every RECORD_CHAIN
    rung, at the micro-batch that holds the Muon preset's tokens (an 8 GB card's): what the record ladder measures is
    record #28's recipe but for the preset's own speed settings, which its rungs leave off (--versus runs the preset
    itself): FP8 block matmuls (88m's and 126m's) and the fused QK-norm + RoPE (88m's). Only 126m adopted the newest
    ideas (configs/recipes/newest.toml); the others are record #28's."""
    muon, default = C.preset(f"{name}-muon"), C.preset(name, **RE.newest_off(name))
    assert (C.preset(name) != default) == (name == "126m")
    assert default.speed.fp8 == (name in ("88m", "126m")) and default.speed.fused_qk_norm_rope == (name == "88m")
    assert C.preset(f"{name}-muon", **RE.record_recipe(name, muon.train.micro_batch), speed__fp8=default.speed.fp8,
                    speed__fused_qk_norm_rope=default.speed.fused_qk_norm_rope) == default
    head = default.model.head_dim  # a power of two up to 128: FlexAttention pads any other to the next one
    assert head <= 128 and head & (head - 1) == 0 and default.model.n_kv_heads == default.model.n_heads


def test_each_finished_rung_says_how_long_it_took_and_what_is_left(tmp_path, capsys):
    quick = [sys.executable, "-c", "pass"]
    todo = [(RE.Recipe(name, "tiny", "chain", {}), quick) for name in ("one", "two", "three")]
    RE._run_queue(todo, {}, [None], {}, tmp_path, timeout=60)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("finished:")]
    assert len(lines) == 3
    assert "2 rung(s) left" in lines[0] and "1 rung(s) left" in lines[1] and lines[2].endswith("none left")
    assert RE.progress_line("a", [200.0, 300.0], 5, 2) == \
        "finished: a in 300 s; 5 rung(s) left, about 12 min at 250 s a rung"  # 3 rounds of 250 s on 2 devices


def test_the_stack_rung_is_the_126m_default_and_takes_what_each_shape_can():
    """--newest stack: every idea the 126m default adopted, on a preset's record #28 recipe: at 126m the default
    itself (but for the evaluations' spacing, which a study sets); on 22m's three heads all but paired heads."""
    assert "xsa" in RE.adopted() and "dense" not in RE.adopted() and "stack" not in RE.adopted()
    stack = RE.newest_plan("126m", 1, ("stack",), 12)[1].overrides
    got, default = C.preset("126m", **stack), C.preset("126m")
    assert got.model == default.model
    assert replace(got.train, eval_every=1000, ckpt_every=1000) == default.train
    small = C.preset("22m", **RE.newest_plan("22m", 1, ("stack",), 12)[1].overrides)
    assert small.model.xsa and small.model.bigram_rows == 5 * small.model.vocab_size and not small.model.paired_heads
    assert small.train.batch_tokens == C.preset("22m").train.batch_tokens // 4
    assert C.preset("88m", **RE.newest_plan("88m", 1, ("stack",), 12)[1].overrides).model.paired_heads
