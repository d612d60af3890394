"""bench.py and measure.py on CPU: plans as pure functions, one rung measured in this process,
one through the subprocess path, and (marked slow) every study end to end on the tiny preset."""

import dataclasses
import json

import numpy as np
import pytest
import torch

import attention as A
import bench as B
import config as C
import fastpaths as FP
import flops as FL
import generate as G
import measure as ME
import model as M
import recipes as RE
import train as TR


# --- Plans ---------------------------------------------------------------------------------

def test_ladder_plan_adds_one_setting_per_rung():
    rungs = B.ladder_rungs("88m-muon", 16, 3) + B.ladder_tail("88m-muon", 64, 3)
    names = [r.name for r in rungs]
    # 88m-muon is ReLU² with a tied head: no fused SwiGLU rung, no FP8 head rung, and no fused ReLU² once the
    # FP8 matmuls run the MLP their own way (fastpaths.fast_path_applies); fast accumulation right after them
    assert names == ["fp32 eager", "+tf32", "+bf16 autocast", "+torch.compile", "+fused AdamW", "+pinned memory",
                     "+loss kernel", "+fp8 matmuls", "+fp8 fast accumulation", "+fused QK-norm + RoPE",
                     "+bf16 residual", "+muon kernel", "+coordinate descent", "+max-autotune (no CUDA graphs)"]
    configs = [r.config() for r in rungs]  # every rung passes the strict loader
    assert [c.train.bf16 for c in configs[:3]] == [False, False, True]
    # The fast paths are off until their own rung, whatever the preset's file turns on.
    kernels = [(c.speed.loss_kernel, c.speed.fp8, c.speed.fp8_fast_accum, c.speed.fused_qk_norm_rope,
                c.speed.bf16_residual) for c in configs]
    assert kernels == [(False,) * 5] * 6 + [(True, False, False, False, False), (True, True, False, False, False),
                                            (True, True, True, False, False), (True, True, True, True, False)] + \
        [(True,) * 5] * 4
    assert [c.train.muon_kernel for c in configs] == [False] * 11 + [True] * 3
    assert not any(c.speed.fused_relu2 for c in configs)
    assert [c.train.compile_mode for c in configs[-4:]] == ["default", "default", "coordinate-descent",
                                                             "max-autotune-no-cudagraphs"]
    assert configs[-1].train.micro_batch == 64 and configs[-6].train.pin
    assert [r.name for r in B.ladder_tail("88m-gpt3", 64, 3)][2:4] == ["+loss kernel", "+fused SwiGLU"]  # SwiGLU runs it
    # the record's untied head runs the FP8 head and the loss kernel; the fused loss would need its own head and loss
    record = B.ladder_tail("126m", 4, 3)
    assert {"+fp8 head", "+loss kernel"} <= {r.name for r in record} and "+fused loss" not in {r.name for r in record}
    assert all(r.config() for r in record)  # no rung combines what the model refuses


def test_each_ladder_rung_changes_only_what_its_name_says():
    """"fp32 eager" is FP32, eager and unfused, and each rung after it differs from the one before it in the
    one setting it names, so the ladder's table says what each step gave."""
    rungs = B.ladder_rungs("88m-muon", 16, 3) + B.ladder_tail("88m-muon", 16, 3)
    configs = [r.config() for r in rungs]
    first = configs[0].train
    assert (first.tf32, first.bf16, first.compile, first.optimizer, first.pin) == (False, False, False, "foreach", False)
    assert not any(getattr(configs[0].speed, s) for s in FP.TRAINING_FAST_PATHS)

    def changed(a, b):
        return {f"{part}.{f.name}" for part in ("model", "speed", "data", "train") for f in dataclasses.fields(getattr(a, part))
                if getattr(getattr(a, part), f.name) != getattr(getattr(b, part), f.name)}
    names = {"+tf32": "train.tf32", "+bf16 autocast": "train.bf16", "+torch.compile": "train.compile",
             "+fused AdamW": "train.optimizer", "+pinned memory": "train.pin", "+loss kernel": "speed.loss_kernel",
             "+fp8 matmuls": "speed.fp8", "+fp8 fast accumulation": "speed.fp8_fast_accum",
             "+fused QK-norm + RoPE": "speed.fused_qk_norm_rope",
             "+bf16 residual": "speed.bf16_residual", "+muon kernel": "train.muon_kernel",
             "+coordinate descent": "train.compile_mode", "+max-autotune (no CUDA graphs)": "train.compile_mode"}
    assert [(r.name, changed(a, b)) for r, a, b in zip(rungs[1:], configs, configs[1:])] == \
        [(r.name, {names[r.name]}) for r in rungs[1:]]


def test_the_ladders_first_rung_tries_at_most_65536_tokens_a_micro_batch(monkeypatch):
    """A preset of 8,192-token sequences starts its fp32 eager rung at 8 sequences, the 1,024-token presets
    at 64: what fits is found walking down from there (here nothing fits, so every size is tried)."""
    tried = []
    def run(rungs, cuda, timeout, journal=None):
        tried.append(rungs[0].config().train.micro_batch)
        return [{"rung": rungs[0].name, "skipped": "out of memory"}]
    monkeypatch.setattr(B.ME, "run", run)
    for preset, sizes in (("88m", [8, 4, 2, 1]), ("88m-muon", [64, 32, 16, 8, 4, 2, 1])):
        tried.clear()
        rows = B.ladder(preset, 524_288, 3, cuda=True, timeout=60)
        assert tried[:len(sizes)] == sizes and rows[0]["skipped"] == "no micro-batch fits", (preset, tried)


def test_the_ladder_skips_a_micro_batch_its_memory_line_says_will_not_fit(monkeypatch):
    """88m on a 139 GiB card: 25 GiB at 8 sequences and 46 at 16 put 32 at 88 (it runs) and 64 at 172 (it
    is skipped without a process: it would only compile and fail)."""
    peaks, tried = {8: 25.0, 16: 46.0, 32: 88.0}, []
    def run(rungs, cuda, timeout, journal=None):
        out = []
        for r in rungs:
            mb = r.config().train.micro_batch
            tried.append(mb)
            out.append({"rung": r.name, "micro_batch": mb, "tok_s": 1000.0 + mb, "peak_gib": peaks[mb],
                        "device_gib": 139.8})
        return out
    monkeypatch.setattr(B.ME, "run", run)
    rows = B.ladder("88m", 524_288, 3, cuda=True, timeout=60)
    sweep = {r["rung"]: r for r in rows if r["rung"].startswith("micro-batch")}
    assert 64 not in tried and "tok_s" in sweep["micro-batch 32"]
    assert sweep["micro-batch 64"]["skipped"].startswith("predicted peak 172 GiB")
    assert tried[-1] == 32 and rows[-1]["micro_batch"] == 32  # the tail runs at the fastest size that fit
    assert B.does_not_fit(rows[3:4], 64) is None  # one measured size gives no line: try it


def test_kernel_plan_switches_on_one_kernel_at_a_time():
    base, *others = [r.config() for r in B.kernel_rungs("88m-muon", 64, 3)]
    assert base.train.compile and base.train.bf16 and base.train.optimizer == "fused" and base.train.micro_batch == 64
    assert (base.speed.loss_kernel, base.speed.fused_loss, base.speed.bf16_residual) == (False, False, False)
    F, T = False, True
    assert [(c.speed.loss_kernel, c.speed.fused_loss, c.speed.fp8, c.speed.fp8_fast_accum, c.speed.fused_relu2,
             c.speed.fused_qk_norm_rope, c.speed.bf16_residual, c.train.muon_kernel, c.train.compile_mode)
            for c in others] == [
        (F, F, F, F, F, F, T, F, "default"),  # the preset's defaults
        (T, F, T, T, F, T, T, T, "default"),  # and every other fast path (not the fused loss: the loss kernel,
        # stacked first, excludes it; not the fused ReLU²: the FP8 matmuls, stacked before it, run their own MLP)
        (T, F, F, F, F, F, F, F, "default"), (F, T, F, F, F, F, F, F, "default"), (F, F, T, F, F, F, F, F, "default"),
        (F, F, T, T, F, F, F, F, "default"),  # fast accumulation alone runs with the FP8 matmuls it changes
        (F, F, F, F, T, F, F, F, "default"), (F, F, F, F, F, T, F, F, "default"), (F, F, F, F, F, F, T, F, "default"),
        (F, F, F, F, F, F, F, T, "default"), (F, F, F, F, F, F, F, F, "coordinate-descent"),
        (F, F, F, F, F, F, F, F, "max-autotune-no-cudagraphs")]
    assert not any(c.speed.fused_swiglu for c in others)  # ReLU²: no SwiGLU to fuse
    defaults = others[0]  # what train.py runs with the preset: its file's fast paths, whatever they are
    preset = B.C.preset("88m").speed
    assert (defaults.speed.fused_swiglu, defaults.speed.bf16_residual) == (preset.fused_swiglu, preset.bf16_residual)


def test_the_kernel_plan_stacks_nothing_onto_defaults_that_already_run_every_fast_path(monkeypatch):
    every = B.kernel_rungs("88m", 16, 3)[2].config()
    on = {**{f"speed__{s}": getattr(every.speed, s) for s in FP.TRAINING_FAST_PATHS},
          **{f"train__{s}": getattr(every.train, s) for s in B.O.FAST_PATHS}}
    monkeypatch.setattr(B, "preset_kernels", lambda preset: on)
    assert "the defaults + every other fast path" not in [r.name for r in B.kernel_rungs("88m", 16, 3)]


def test_the_decode_parts_table_has_a_column_per_cache_position_and_the_difference_in_full():
    rows = [{"rung": "attention, one program a head", "us_at_16": 4.72, "us_at_256": 6.64},
            {"rung": "attention, split", "us_at_16": 6.35, "max_abs_diff": 0.0039, "us_at_256": 6.56},
            {"rung": "ReLU² MLP, plain", "us": 12.07}, {"rung": "on a CPU", "skipped": "CUDA only"}]
    table = B.simple_table(rows).splitlines()
    assert table[0] == "| rung | us_at_16 | us_at_256 | us | max_abs_diff | skipped |"
    assert table[3] == "| attention, split | 6.35 | 6.56 |  | 3.9e-03 |  |"  # not rounded to 0.00
    assert table[5] == "| on a CPU |  |  |  |  | CUDA only |"


def test_a_study_whose_rungs_ran_at_the_cards_power_limit_says_so():
    held = {"rung": "defaults", "tok_s": 939_430.0, "power_w": 691.0, "power_limit_w": 700.0}
    free = {"rung": "compiled", "tok_s": 766_066.0, "power_w": 610.0, "power_limit_w": 700.0}
    note = B.power_note([free, held])
    assert note.startswith("\n\n1 of 2 rungs drew within 3% of the card's 700 W power limit")
    assert B.power_note([free]) == "" and B.power_note([{"rung": "on a CPU", "tok_s": 5.0}]) == ""
    at_the_line = {**free, "power_w": 679.0}  # 97% of 700 W to the watt
    assert B.power_note([at_the_line, held]).startswith("\n\n2 of 2 rungs drew within 3% of the card's 700 W")
    other_card = {**held, "power_w": 580.0, "power_limit_w": 600.0}
    assert "the card's 700 W power limit" in B.power_note([other_card, held])  # the larger limit of those held


def test_a_study_whose_rungs_torch_compile_split_says_which():
    rows = [{"rung": "compiled", "tok_s": 7.0, "graph_breaks": 0}, {"rung": "+fp8 head", "tok_s": 6.0, "graph_breaks": 2},
            {"rung": "eager", "tok_s": 1.0}]
    assert B.graph_break_note(rows) == ("\n\ntorch.compile split the graph in 1 of 3 rungs, which ran the code around "
                                        "each break uncompiled: +fp8 head (2); TORCH_LOGS=graph_breaks names them")
    assert B.graph_break_note(rows[:1] + rows[2:]) == ""


@pytest.mark.parametrize("printed, limit", [("700.00", 700.0), ("[N/A]", None)])
def test_the_power_limit_is_read_from_nvidia_smi_where_nvml_is_missing(tmp_path, printed, limit):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{printed}'\n")
    smi.chmod(0o755)
    sampler = ME.ClockSampler.__new__(ME.ClockSampler)  # its __init__ asks CUDA for the card's UUID
    sampler.card, sampler.nvml, sampler.smi_path = "GPU-test", None, str(smi)
    assert sampler.power_limit() == limit
    smi.write_text("#!/bin/sh\necho '1740, 691.20'\n")
    assert sampler.read() == (1740.0, 691.2)  # the clock and power sampled the same way


def test_speed_tables_show_the_clock_and_power_where_they_were_read():
    rows = [{"rung": "a", "tok_s": 100.0, "sm_mhz": 1740.0, "power_w": 691.2}, {"rung": "b", "tok_s": 90.0}]
    assert B.simple_table(rows).splitlines()[2:] == ["| a | 100.00 | 1,740.00 | 691.20 |", "| b | 90.00 |  |  |"]
    assert "sm_mhz" not in B.simple_table([{"rung": "on a CPU", "tok_s": 5.0, "sm_mhz": None, "power_w": None}])


def test_repeats_measure_the_whole_plan_in_turn_and_report_each_rungs_median(monkeypatch):
    order, rates = [], iter([100.0, 200.0, 90.0, 260.0, 110.0, 230.0])
    monkeypatch.setattr(ME, "run_in_subprocess",
                        lambda rung, timeout: order.append(rung.name) or ME.Result(rung.name, 4, tok_s=next(rates)))
    rows = ME.run([ME.Rung("a", "tiny"), ME.Rung("b", "tiny")], cuda=True, timeout=10, repeats=3)
    assert order == [f"{n} (run {i} of 3)" for i in (1, 2, 3) for n in "ab"]  # A B, A B, A B
    assert [(r["rung"], r["tok_s"], r["runs"]) for r in rows] == [("a", 100.0, 3), ("b", 230.0, 3)]
    assert rows[0]["runs_spread"] == pytest.approx(0.2) and rows[1]["runs_spread"] == pytest.approx(60 / 230)
    assert "| a | 4 | 100.00 | 3 | 20.0% |" in B.simple_table(rows)
    skipped = [{"rung": f"c (run {i} of 2)", "skipped": "out of memory"} for i in (1, 2)]
    assert ME.median_row("c", skipped) == {"rung": "c", "skipped": "out of memory"}


def test_a_misspelled_rung_setting_fails_before_anything_runs():
    rung = ME.Rung("typo", "tiny", {"train__micro_batchs": 4})
    with pytest.raises(ValueError, match=r"unknown key\(s\) train\.micro_batchs"):
        ME.run([ME.Rung("fine", "tiny"), rung], cuda=False, timeout=10)


def test_an_interrupted_study_resumes_from_its_journal(tmp_path, monkeypatch):
    """Rows measured before a stop are reused by --resume (same rung, same settings); a timed-out
    rung, a changed setting or a run without --resume measures again; another preset is refused."""
    measured = []

    def fake_measure(rung, timeout):
        measured.append(rung.name)
        skipped = "timed out after 1 s" if rung.name == "slow" else None
        return ME.Result(rung=rung.name, tok_s=None if skipped else 100.0, skipped=skipped)
    monkeypatch.setattr(ME, "run_in_subprocess", fake_measure)
    path, header = tmp_path / "ladder.partial.json", {"preset": "tiny", "device": "cpu", "batch_tokens": 64}
    rungs = [ME.Rung("a", "tiny", {"train__micro_batch": 2}), ME.Rung("slow", "tiny")]
    ME.run(rungs, cuda=True, timeout=1, journal=ME.Journal(path, header, resume=False))
    assert measured == ["a", "slow"] and len(json.loads(path.read_text())["measured"]) == 2
    changed = ME.Rung("a", "tiny", {"train__micro_batch": 4})
    rows = ME.run(rungs + [changed], cuda=True, timeout=1, journal=ME.Journal(path, header, resume=True))
    assert measured == ["a", "slow", "slow", "a"] and rows[0]["tok_s"] == 100.0
    ME.run(rungs[:1], cuda=True, timeout=1, journal=ME.Journal(path, header, resume=False))
    assert measured[-1] == "a"
    with pytest.raises(ValueError, match="preset='tiny'.*drop --resume"):
        ME.Journal(path, {**header, "preset": "22m"}, resume=True)
    ME.Journal(path, header, resume=False).done()
    assert not path.exists()


def test_a_timed_backward_starts_each_call_with_its_leaves_gradients_unset():
    """Called again and again (as median_seconds does), each call leaves one backward's gradient, as a
    training step's activations get: not a sum over the calls."""
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    call = ME.backward_from_scratch(lambda: x @ w, (x, w), torch.ones(3))
    for _ in range(3):
        call()
    assert torch.equal(x.grad, w.expand(3, 4)) and torch.equal(w.grad, x.detach().sum(0))


def test_attention_plan_is_a_model_setting():
    rungs = B.attention_rungs("tiny", 4, 1, only=["textbook", "doc-mask"])
    assert [r.name for r in rungs] == ["textbook eager", "textbook compiled", "doc-mask eager", "doc-mask compiled"]
    assert rungs[0].config().speed.attention == "textbook" and rungs[2].config().train.doc_mask
    assert ME.cpu_skip(B.attention_rungs("tiny", 4, 1, only=["flash"])[0]) == "SDPA backends are CUDA kernels"


def test_memory_line_recovers_a_known_fit():
    rows = [{"micro_batch": mb, "peak_gib": 1.5 + 0.25 * mb} for mb in (1, 2, 4, 8)]
    fit = B.memory_line(rows)
    assert fit["fixed_gib"] == pytest.approx(1.5) and fit["gib_per_seq"] == pytest.approx(0.25)
    assert B.memory_line(rows[:1]) is None
    assert B.memory_line(rows[:2])["gib_per_seq"] == pytest.approx(0.25)  # two sizes draw a line
    card = [{**r, "device_gib": 10.0} for r in rows]  # 95% of 10 GiB is 9.5: 32 sequences at 9.5 GiB fit, 33 not
    assert B.does_not_fit(card, 32) is None and B.does_not_fit(card, 33).startswith("predicted peak 10 GiB")
    assert B.does_not_fit(rows, 64) is None  # no card's size in the rows: nothing to compare with


def test_the_micro_batch_sweep_doubles_until_the_step_cannot_be_split_and_draws_its_memory_line(monkeypatch):
    """A step of 2 x 512 tokens (tiny's context) holds two sequences: the sweep stops at micro-batch 2, where
    the step cannot be split into two micro-batches any more, short of the CPU's limit of 4."""
    def run(rungs, cuda, timeout, journal=None):
        mb = rungs[0].config().train.micro_batch
        return [{"rung": rungs[0].name, "micro_batch": mb, "tok_s": 10.0 * mb, "peak_gib": 1.0 + 0.5 * mb}]
    monkeypatch.setattr(B.ME, "run", run)
    rows = B.micro_batch_study("tiny", 2 * 512, 2, cuda=False, timeout=10)
    assert [r.get("micro_batch") for r in rows] == [1, 2, None] and rows[-1]["rung"] == "fit"
    assert rows[-1]["gib_per_seq"] == pytest.approx(0.5)


def test_ladder_table_math():
    rows_ = [{"rung": "a", "micro_batch": 4, "tok_s": 100.0, "step_s": 1.0, "spread": 0.0, "warmup_s": 1.0,
              "sm_mhz": 2000, "power_w": 50, "peak_gib": 1.0},
             {"rung": "b", "micro_batch": 4, "tok_s": 250.0, "step_s": 0.4, "spread": 0.01, "warmup_s": 1.0,
              "sm_mhz": 1250, "power_w": 50, "peak_gib": 1.0},
             {"rung": "c", "micro_batch": 8, "skipped": "out of memory"}]
    table = B.ladder_table(rows_, flops_tok=1e12, roof=1000.0, spec_peak=2000.0).splitlines()
    assert table[3] == "| b | 4 | 250 | 0.400 | 2.50 | 2.50 | 25.0% | 12.5% | 1.00 | 1.0 | 1250 | 50 | 200 | 1.0% |"
    assert table[4].startswith("| c | 8 | skipped: out of memory |")
    assert len({line.count("|") for line in table}) == 1  # the skipped row has every column too


def test_bench_without_a_study_names_the_studies_to_choose(capsys):
    with pytest.raises(SystemExit):
        B.main([])
    assert "choose a study: --ladder, " in capsys.readouterr().err


def test_versus_takes_newest_ideas_by_name_only(capsys, monkeypatch):
    """--versus --newest puts named ideas on the default beside it; with no idea, --muon or --inside it is refused
    in one line before anything runs."""
    monkeypatch.setattr(B.RE, "study", lambda *a, **k: pytest.fail("the study ran"))
    for extra in ([], ["stack", "--muon"], ["stack", "--inside"]):
        with pytest.raises(SystemExit):
            B.main(["--recipes", "--versus", "--preset", "tiny", "--newest", *extra])
        assert "--versus --newest: name the ideas to put on the default beside it" in capsys.readouterr().err


def test_budget_command_prints_table(capsys):
    B.main(["--budget", "--tok-s", "88m-muon=29408", "88m=29408"])
    out = capsys.readouterr().out
    assert "| 88m-muon | 88,097,792 | 88,097,792 | 29,408 | 1.76B | 9.3e+17 | 16.6 |" in out
    # the default 88m: its three value tables and untied input embedding are lookups, left out of N
    cfg = B.C.preset("88m").model
    lookups = (3 + 1) * cfg.vocab_size * cfg.d_model
    assert f"| 88m | {FL.param_count(cfg):,} | {FL.param_count(cfg) - lookups:,} | 29,408 |" in out
    with pytest.raises(SystemExit, match=r"--tok-s '99m=5': expected PRESET=TOKENS_PER_S with a preset from configs/"):
        B.main(["--budget", "--tok-s", "99m=5"])


# --- Measuring -----------------------------------------------------------------------------

def test_each_decode_variant_turns_on_its_own_fast_paths_and_no_other():
    for _, _, switches, _ in ME.DECODE_VARIANTS:
        variant = ME.decode_variant(switches)
        assert {n for n in FP.GENERATION_FAST_PATHS if getattr(variant, n)} == set(switches)
        assert not any(getattr(variant, n) for n in FP.TRAINING_FAST_PATHS)


def test_generate_times_transformers_on_a_model_no_stock_class_computes():
    """--generate on a default preset's recipe (value tables, a soft-cap, ...): transformers runs our own model
    as export.py writes it, and its greedy tokens are onegpu's."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = M.ModelConfig(d_model=64, n_layers=2, n_heads=1, n_kv_heads=1, vocab_size=256, context=64, value_embeds=1,
                        tie_embeddings=False, logit_softcap=15.0)
    model = M.Llama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    ours = torch.cat(list(G.generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0)), 1).tolist()
    [row] = ME.transformers_speed(model, [1, 2, 3], 4, (1,), {1: ours})
    assert row["rung"] == "transformers dynamic cache batch 1" and row["same_greedy_tokens"] == "4/4", row


def test_one_rung_in_process_uses_train_setup_and_step_as_training_runs_them(monkeypatch):
    """The timed step is train.py's, with the loader drawing each step's first micro-batch ahead as training does."""
    ahead, step = [], TR.train_step
    monkeypatch.setattr(TR, "train_step", lambda *a, **k: ahead.append(k["prefetch"].__self__ is a[2].__self__)
                        or step(*a, **k))
    result = ME.measure(ME.Rung("fp32", "tiny", {"train__micro_batch": 2, "train__batch_tokens": 2048}, 1))
    assert result.tok_s > 0 and result.data == "random tokens" and result.accum == 2 and result.skipped is None
    assert np.isfinite(result.loss) and ahead == [True, True]  # the warm-up step and the timed one


def test_a_rung_times_the_loss_with_every_target_the_run_starts_with(monkeypatch):
    """The multi-token and prefix-token losses are part of the step a run times: a rung of a preset with them
    times its step with all their targets, as the run's first steps compute."""
    seen, step = [], TR.train_step
    monkeypatch.setattr(TR, "train_step", lambda *a, **k: seen.append((k["mtp"], k["prefix"])) or step(*a, **k))
    ME.measure(ME.Rung("targets", "tiny", {"train__micro_batch": 2, "train__batch_tokens": 1024,
                                           "train__mtp_tokens": 3, "train__prefix_weight": 0.25}, 1))
    (mtp, (table, weight)), _ = seen
    assert mtp == (1.0, 0.5, 0.25) and weight == 0.25 and table.shape == (C.preset("tiny").model.vocab_size,)


def test_a_compiled_rung_counts_torch_compiles_graph_breaks(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # the CPU need not compile
    monkeypatch.setattr(TR, "graph_breaks", lambda: 3)
    settings = {"train__micro_batch": 2, "train__batch_tokens": 1024}
    assert ME.measure(ME.Rung("compiled", "tiny", {**settings, "train__compile": True}, 1)).graph_breaks == 3
    assert ME.measure(ME.Rung("eager", "tiny", {**settings, "train__compile": False}, 1)).graph_breaks is None


@pytest.mark.slow  # a whole process with its profile: the slow tier's (CI runs it); the in-process rung above stays
def test_one_rung_through_a_subprocess_returns_a_typed_result():
    result = ME.run_in_subprocess(ME.Rung("fp32", "tiny", {"train__micro_batch": 2, "train__batch_tokens": 1024},
                                          1, kernels=True), timeout=300)
    assert result.skipped is None and result.tok_s > 0 and result.micro_batch == 2
    # On CPU, SDPA runs PyTorch's CPU flash-attention op (aten::_scaled_dot_product_flash_attention_for_cpu),
    # and the rung names it from the profiler's op names, as it names cuDNN's or FlashAttention's kernels on a GPU
    assert result.attention_kernels == "flash", result.attention_kernels


def test_one_table_names_kernels_for_the_profile_and_the_attention_check():
    names = {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention", "flash_fwd_kernel": "attention",
             "fmha_cutlassF_bf16_aligned_64x64": "attention", "nvjet_tst_128x256_64x4": "matmul",
             "triton_red_fused__softmax_3": "elementwise/other", "multi_tensor_apply_kernel": "optimizer",
             "reduce_kernel<512, 1, ReduceOp<BFloat16, NormTwoOps<float>>>": "optimizer",
             "vectorized_elementwise_kernel<8, launch_clamp_scalar>": "optimizer",
             "_qk_norm_rope_backward_kernel": "elementwise/other",
             "triton_poi_fused__scaled_mm__to_copy_clamp_mul_reciprocal_t_view_24": "elementwise/other"}
    assert {n: ME.kernel_class(n) for n in names} == names
    backend = lambda n: next(b for b, sign in ME.ATTENTION_SIGNS if sign in n.lower())  # noqa: E731
    assert [backend(n) for n in list(names)[:3]] == ["cudnn", "flash", "efficient"]  # cuDNN's "flash" is cuDNN's


def test_kernel_stats_count_each_launch_and_a_decode_step_is_their_sum_per_replay():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    stats = ME.kernel_stats(lambda: [a @ b for _ in range(3)] + [a + b], torch.device("cpu"))
    assert stats["aten::mm"][0] == 3 and stats["aten::add"][0] == 1
    fake = {"gemv": (100, 1.0), "decode_step": (50, 3.0), "add": (50, 0.5)}  # 50 replays: ms in total
    step = ME.step_kernels(fake, 50, top=2)
    assert step == {"kernels": 4.0, "busy_us": 90.0, "top_kernels": {"decode_step": (1.0, 60.0), "gemv": (2.0, 20.0)}}


def test_gaps_between_kernels_count_only_time_that_no_kernel_covers():
    # (start, end, name) in microseconds: b overlaps a (another stream) and ends later; c starts 1,000 us after b
    # ends, d 50 us after c; e and f lie inside d; g starts 100 us after d ends. The idle time is those three gaps.
    spans = [(0, 100, "a"), (50, 300, "b"), (1300, 1400, "c"), (1450, 2000, "d"), (1500, 1600, "e"),
             (1700, 1800, "f"), (2100, 2200, "g")]
    total, count, largest = ME.gaps_between(spans[::-1])  # in any order
    assert (round(total, 6), count) == (1.15, 3)
    assert largest == ["1.000 ms after b before c", "0.100 ms after d before g", "0.050 ms after c before d"]
    assert ME.gaps_between([]) == (0.0, 0, [])


def test_timing_reports_the_median_and_the_spread_of_what_it_times(monkeypatch):
    clock = iter([0.0, 2.0, 2.0, 2.5, 3.0, 4.5])  # perf_counter before and after each call
    monkeypatch.setattr(ME.time, "perf_counter", lambda: next(clock))
    assert ME.timed(lambda: "out", ME.torch.device("cpu")) == ("out", 2.0)
    assert [ME.timed(lambda: None, ME.torch.device("cpu"))[1] for _ in range(2)] == [0.5, 1.5]
    assert ME.median_and_spread([1.0, 2.0, 4.0]) == (2.0, 1.5)


def test_the_loader_study_times_both_kinds_of_micro_batch():
    rows = B.loader_study("tiny", 2)
    assert [r["rung"] for r in rows] == ["micro-batch 2 x 512", "micro-batch 2 x 512, document ids"]
    assert all(r["cpu_us"] > 0 for r in rows)


def test_a_failing_rung_comes_back_as_skipped_with_the_reason():
    # batch_tokens not a multiple of micro_batch x context: setup() refuses inside the child process
    result = ME.run_in_subprocess(ME.Rung("bad", "tiny", {"train__micro_batch": 3, "train__batch_tokens": 1000}, 1),
                                  timeout=300)
    assert result.tok_s is None and "ValueError: train.batch_tokens=1,000 is not a multiple" in result.skipped


# --- Every study end to end (slow: .ci/run runs it) ------------------------------------------

@pytest.mark.slow
def test_every_study_runs_on_cpu(tmp_path, capsys):
    B.main(["--all", "--only", "textbook", "sdpa", "doc-mask", "flash", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "no CUDA device: a smoke test of the code paths" in out
    assert out.rstrip().endswith(f"results: {', '.join(f'{s}.json' for s in B.STUDIES if s != 'loss_curves')} and "
                                 f"their plots in {tmp_path}")

    def rows(study):
        return json.loads((tmp_path / f"{study}.json").read_text())["rows"]
    ladder = rows("ladder")
    assert ladder[0]["tok_s"] > 0 and ladder[0]["micro_batch"] == 4
    assert [r["skipped"] for r in ladder[1:3]] == ["CUDA-only setting"] * 2  # +tf32, +bf16
    assert ladder[3]["skipped"].startswith("a GPU rung (torch.compile")  # +torch.compile
    attention = {r["rung"]: r for r in rows("attention")}
    assert attention["textbook eager"]["attention_kernels"].startswith("math") and attention["sdpa eager"]["tok_s"] > 0
    assert attention["flash eager"]["skipped"] == "SDPA backends are CUDA kernels"
    assert [r["micro_batch"] for r in rows("micro_batch_sweep") if "micro_batch" in r] == [1, 2, 4]
    assert [r["rung"] for r in rows("kernels")] == ["compiled BF16, fused AdamW", "the preset's defaults",
                                                    "the defaults + every other fast path",
                                                    *B.fast_paths("tiny"), *B.COMPILE_TUNING]
    assert abs(sum(r["share"] for r in rows("profile")) - 1) < 1e-6
    assert [r["rung"] for r in rows("optimizer") if r.get("update_ms")][-2:] == [
        "Muon: optim.Muon (parts split, equal shapes batched)", "Muon: torch.optim.Muon (one matrix at a time)"]
    assert rows("generate")[0]["decode_tok_s"] > 0
    assert [r["rung"] for r in rows("loss")] == ["plain loss", "loss kernel"] and rows("loss")[0]["ms"] > 0
    parts = {r["rung"].rsplit(", ", 1)[1]: r for r in rows("parts")}  # tiny: the ReLU² MLP, then QK-norm + RoPE
    assert [r["rung"] for r in rows("parts")][1] == "QK-norm + RoPE, plain" and parts["plain"]["ms"] > 0
    assert parts["fused"]["skipped"] == "a Triton kernel: measured on CUDA only"
    for study in B.STUDIES:  # a plot of every study that measured something (compile modes: none on CPU)
        if study != "loss_curves" and any(r.get(B.PLOTTED[study][0]) for r in rows(study)):
            assert (tmp_path / f"{study}.png").stat().st_size > 1000, study


@pytest.mark.slow
def test_the_newest_ideas_study_runs_on_cpu(tmp_path, capsys):
    B.main(["--recipes", "--tokens", "65536", "--newest", "smear", "--at-once", "2", "--preset", "tiny", "--seeds", "1",
            "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "## the newest records' ideas, each alone on the preset without them | tiny | stdlib corpus | 65,536 tokens per rung" in out
    assert "equal tokens; 2 rung(s) at a time" in out
    rows = json.loads((tmp_path / "newest-tiny-tokens.json").read_text())["rows"]
    assert [r["rung"] for r in rows] == [RE.WITHOUT_NEWEST, RE.NEWEST["smear"][0]] and len(rows[1]["paired"]) == 1
    assert rows[1]["paired"][0] == pytest.approx(rows[1]["val_loss"] - rows[0]["val_loss"])


@pytest.mark.slow
def test_loss_curves_train_each_fast_path_through_train_py(tmp_path):
    B.main(["--loss-curves", "--curve-steps", "3", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "loss_curves.json").read_text())
    by_name = {r["rung"]: r for r in saved["rows"]}
    assert {name: len(losses) for name, losses in saved["curves"].items()} == dict.fromkeys(by_name, 3)
    assert set(by_name) == {"plain", "loss kernel", "fused loss", "fused ReLU²", "fused QK-norm + RoPE", "bf16 residual",
                            "fp8 matmuls", "fp8 fast accumulation", "defaults"}
    assert all("skipped" not in r for r in by_name.values())
    assert by_name["fused loss"]["max_loss_diff"] < 1e-4  # float32 on CPU: the same numbers
    assert by_name["loss kernel"]["max_loss_diff"] == 0  # on CPU without Triton's interpreter: the plain loss
    assert by_name["fused ReLU²"]["max_loss_diff"] == 0  # the same: the plain ReLU²
    assert by_name["fused QK-norm + RoPE"]["max_loss_diff"] == 0  # and the plain QK-norm and RoPE
    assert by_name["bf16 residual"]["max_loss_diff"] < 1e-4  # no autocast on CPU, so a float32 stream
    assert by_name["fp8 matmuls"]["max_loss_diff"] < 0.1  # FP8 rounding
    assert saved["curves"]["fp8 fast accumulation"] == saved["curves"]["fp8 matmuls"]  # on a CPU: both the plain MLP
    assert by_name["defaults"]["max_loss_diff"] < 1e-4  # the fused SwiGLU and bf16 stream, as above
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000 and not list(tmp_path.rglob("ckpt*.pt"))


def test_bench_trains_through_recipes_alone_and_shares_train_py_flag_names():
    """One trainer of train.py runs, recipes.run_all: bench.py starts none of its own, and its loss
    curves are a recipe plan. A flag that bench.py and train.py both have means the same in both."""
    source = open(B.__file__).read()
    assert "import subprocess" not in source and "Popen" not in source
    plan = RE.curves_plan("tiny")  # ReLU², tied: neither the fused SwiGLU nor the FP8 head runs for it
    assert [r.name for r in plan] == ["plain", "loss kernel", "fused loss", "fp8 matmuls", "fp8 fast accumulation",
                                      "fused ReLU²", "fused QK-norm + RoPE", "bf16 residual", "defaults"]
    plain = {f"speed__{s}": False for s in FP.TRAINING_FAST_PATHS}
    assert plan[0].overrides == plain and plan[7].overrides == {**plain, "speed__bf16_residual": True}
    # fast accumulation's curve is the FP8 matmuls' with it, to set beside theirs
    assert plan[4].overrides == {**plain, "speed__fp8": True, "speed__fp8_fast_accum": True}
    assert [r.name for r in RE.curves_plan("126m")] == ["plain", "fp8 head", "loss kernel", "fused loss",
                                                               "fp8 matmuls", "fp8 fast accumulation", "fused ReLU²",
                                                               "fused QK-norm + RoPE", "bf16 residual", "defaults"]
    ours = {o: a.dest for a in B.build_parser()._actions for o in a.option_strings}
    theirs = {o: a.dest for a in TR.build_parser()._actions for o in a.option_strings}
    shared = set(ours) & set(theirs) - {"-h", "--help"}
    assert {"--micro-batch", "--batch-tokens", "--tokens", "--corpus", "--resume"} <= shared
    assert {o: ours[o] for o in shared} == {o: theirs[o].split(".")[-1].split("__")[-1] for o in shared}


def test_help_gives_this_machines_defaults_and_budget_says_whose_rates(capsys):
    cpu = " ".join(B.build_parser(cuda=False).format_help().split())
    assert "(default on this CPU: 4; --recipes: the preset's)" in cpu and "(default on this CPU: tiny; --recipes: tiny)" in cpu
    assert "(default with CUDA: 16; --recipes: the preset's)" in " ".join(B.build_parser(cuda=True).format_help().split())
    B.main(["--budget"])
    assert capsys.readouterr().out.startswith("rates: an 8 GB RTX 4060 Laptop GPU's")
    B.main(["--budget", "--tok-s", "88m=600000"])
    assert capsys.readouterr().out.startswith("| preset |")


# --- Plans: a user's rungs from a TOML file ------------------------------------------------

def test_a_plan_names_its_rungs_and_checks_them_before_anything_runs(tmp_path, monkeypatch):
    plan = tmp_path / "mine.toml"
    plan.write_text('preset = "tiny"\nsteps = 2\n[[rung]]\nname = "eager"\ntrain = { compile = false }\n'
                    '[[rung]]\nname = "muon"\ntrain = { muon = true, micro_batch = 4 }\n')
    rungs = B.plan_rungs(plan)
    assert [(r.name, r.preset, r.timed_steps) for r in rungs] == [("eager", "tiny", 2), ("muon", "tiny", 2)]
    assert rungs[1].overrides == {"train__muon": True, "train__micro_batch": 4}
    assert B.plan_rungs(plan, preset="22m", steps=5)[0].preset == "22m"  # the command line wins
    plan.write_text('preset = "tiny"\nsteps = 1\n[[rung]]\nname = "once"\n')
    assert B.plan_rungs(plan)[0].timed_steps == 1  # one timed step is a plan's least
    plan.write_text('[[rung]]\nname = "ok"\n[[rung]]\nname = "typo"\ntrain = { micro_bach = 4 }\n')
    monkeypatch.setattr(B.ME, "run_in_subprocess", lambda *a: pytest.fail("a process started"))
    with pytest.raises(SystemExit, match=r"mine\.toml: rung 2 \(typo\): .*unknown key\(s\) train\.micro_bach"):
        B.main(["--plan", str(plan), "--out", str(tmp_path)])
    plan.write_text('preset = "tiny"\nrungs = []\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rungs'\]; a plan has \['preset', 'rung', 'steps'\]"):
        B.plan_rungs(plan)


@pytest.mark.parametrize("text, message", [
    ('preset = "tiny"\nsteps = "x"\n[[rung]]\nname = "a"\n', r"steps = 'x': give the timed steps per rung as a whole"),
    ('preset = "tiny"\n[[rung]]\nname = "a"\ntrain = "fast"\n', r"rung 1 \(a\): train = 'fast' must be a table"),
    ('preset = "tiny"\n[[rung]]\nname = "a"\ntrain = { batch_tokens = 1000 }\n',
     r"rung 1 \(a\): train.batch_tokens=1,000 is not a multiple of micro_batch x context"),
    ('preset = "tiny"\nsteps = 0\n[[rung]]\nname = "a"\n', r"steps = 0: give the timed steps per rung as a whole"),
    ('preset = "tiny"\n[[rung]]\ntrain = { micro_batch = 4 }\n', r"rung 1: each \[\[rung\]\] needs a name of its own"),
    ('preset = "tiny"\n[[rung]]\nname = "a"\n[[rung]]\nname = "a"\n', r"rung 2: each \[\[rung\]\] needs a name of its own"),
    ('preset = "88m"\n[[rung]]\nname = "a"\n[[rung]]\nname = "b"\nmodel = { fused_qk_norm_rope = true }\n',
     r"rung 2 \(b\): runs the same settings as rung 'a' with preset 88m: drop one"),
], ids=["steps-not-a-number", "table-not-a-table", "batch-not-divisible", "no-timed-steps", "rung-without-a-name",
        "two-rungs-one-name", "two-rungs-one-config"])
def test_a_bad_plan_is_refused_in_one_line_before_any_process_starts(tmp_path, monkeypatch, text, message):
    plan = tmp_path / "bad.toml"
    plan.write_text(text)
    monkeypatch.setattr(B.ME, "run_in_subprocess", lambda *a: pytest.fail("a process started"))
    with pytest.raises(SystemExit, match=message):
        B.main(["--plan", str(plan), "--out", str(tmp_path)])


def test_a_plan_on_a_cpu_is_a_smoke_test_said_so_with_a_plot_and_its_paths(tmp_path, monkeypatch, capsys):
    """configs/plans/recipe-speed.toml asks for 88m at micro-batch 256, compiled: on a CPU each rung runs
    on the tiny preset, four sequences a micro-batch, uncompiled, and the table names its micro-batch
    even where a rung failed."""
    monkeypatch.setattr(B.C, "pick_device", lambda _: B.torch.device("cpu"))
    measured = []

    def fake(rung, timeout):
        measured.append(rung)
        return B.ME.Result(rung=rung.name, micro_batch=4, tok_s=1000.0) if len(measured) > 1 else \
            B.ME.Result(rung=rung.name, skipped="out of memory")
    monkeypatch.setattr(B.ME, "run_in_subprocess", fake)
    B.main(["--plan", str(C.PRESETS_DIR / "plans" / "recipe-speed.toml"), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith("no CUDA device: a smoke test of the plan's code paths on the tiny preset")
    for rung in measured:
        cfg = rung.config()
        assert (rung.preset, cfg.train.micro_batch, cfg.train.compile, rung.timed_steps) == ("tiny", 4, False, 2)
        assert cfg.train.batch_tokens == 2 * 4 * cfg.model.context
    assert measured[0].overrides["model__mlp"] == "swiglu"  # the rung's own settings stay
    rows = json.loads((tmp_path / "plan-recipe-speed.json").read_text())["rows"]
    assert rows[0]["micro_batch"] == 4 and rows[0]["skipped"] == "out of memory"
    assert (tmp_path / "plan-recipe-speed.png").stat().st_size > 1000
    assert out.rstrip().endswith(f"{tmp_path / 'plan-recipe-speed'}.json, .png")


def test_a_plain_rung_turns_every_fast_path_off_before_its_own_settings(tmp_path):
    """`plain = true`: the preset's fast paths all off (a list kept by hand in the file would miss one a preset
    gains later), then the rung's own tables."""
    plan = tmp_path / "plain.toml"
    plan.write_text('preset = "88m"\n[[rung]]\nname = "plain"\nplain = true\n'
                    '[[rung]]\nname = "plain + fp8"\nplain = true\nmodel = { fp8 = true }\n'
                    '[[rung]]\nname = "the defaults"\n')
    plain, fp8, defaults = (r.config() for r in B.plan_rungs(plan))
    assert any(getattr(defaults.speed, s) for s in FP.TRAINING_FAST_PATHS)  # the preset has some to turn off
    assert not any(getattr(plain.speed, s) for s in FP.TRAINING_FAST_PATHS)
    assert not any(getattr(plain.train, s) for s in B.O.FAST_PATHS)
    assert fp8.speed.fp8 and not fp8.speed.fp8_head
    plan.write_text('preset = "88m"\n[[rung]]\nname = "p"\nplain = "yes"\n')
    with pytest.raises(ValueError, match=r"rung 1 \(p\): plain = 'yes': give true"):
        B.plan_rungs(plan)


def test_the_shipped_plans_load():
    for path in (C.PRESETS_DIR / "plans").glob("*.toml"):
        assert B.plan_rungs(path)


def test_a_plan_rung_whose_fast_path_cannot_run_is_refused(tmp_path):
    plan = tmp_path / "idle.toml"
    plan.write_text('preset = "88m"\n[[rung]]\nname = "relu2 beside fp8"\nmodel = { fused_relu2 = true }\n')
    with pytest.raises(ValueError, match=r"rung 1 \(relu2 beside fp8\): speed.fused_relu2 = true does not run"):
        B.plan_rungs(plan)
    plan.write_text('preset = "88m"\n[[rung]]\nname = "relu2"\nmodel = { fused_relu2 = true, fp8 = false }\n')
    assert B.plan_rungs(plan)[0].config().speed.fused_relu2


@pytest.mark.slow
def test_a_plan_runs_end_to_end_on_cpu(tmp_path, capsys):
    plan = tmp_path / "two.toml"
    plan.write_text('preset = "tiny"\nsteps = 1\n[[rung]]\nname = "adamw"\ntrain = { muon = false }\n[[rung]]\nname = "muon"\n'
                    'train = { muon = true }\n')
    B.main(["--plan", str(plan), "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "plan-two.json").read_text())["rows"]
    assert [r["rung"] for r in rows] == ["adamw", "muon"] and all(r.get("tok_s") for r in rows)
    assert "| adamw |" in capsys.readouterr().out


def test_budget_matches_the_laptop_article():
    b = B.budget("88m", 88_096_512, 29_508)  # "What a Laptop Can Train": 88m at 29,508 tok/s
    assert b.tokens == 1_761_930_240 and f"{b.flops:.1e}" == "9.3e+17"
    assert round(b.hours, 1) == 16.6 and round(b.tokens_per_param_8h) == 10 and round(b.tokens_per_param_48h) == 58


def test_the_profile_runs_the_presets_fast_paths_with_defaults_and_the_flags_on_top():
    """--profile --defaults profiles what train.py runs with the preset (every fast path its file sets, on or
    off), without it the compiled BF16 base; each fast-path flag adds its path to either."""
    args = B.build_parser().parse_args(["--profile", "--preset", "88m", "--defaults"])
    assert B.profile_switches("88m", args) == B.preset_kernels("88m")
    assert B.profile_switches("88m", args)["speed__fp8_fast_accum"] and B.profile_switches("88m", args)["speed__fp8"]
    args = B.build_parser().parse_args(["--profile", "--preset", "88m", "--fused-relu2"])
    assert B.profile_switches("88m", args) == {"speed__fused_relu2": True}
    args = B.build_parser().parse_args(["--profile", "--preset", "88m-muon", "--defaults", "--fp8"])
    assert B.profile_switches("88m-muon", args) == {**B.preset_kernels("88m-muon"), "speed__fp8": True}


def test_the_profile_reads_a_prepared_corpus_at_the_window_the_run_ends_with(data_cfg, monkeypatch):
    """--profile --corpus: the micro-batches come from the corpus (document ids and all), the step runs
    at the preset's last window, and a CPU, whose profile times nest, reports no idle time."""
    monkeypatch.setattr(RE, "corpus_settings", lambda *a: {"data__corpus": data_cfg.corpus, "data__cache_dir": data_cfg.cache_dir,
                                                          "data__val_fraction": data_cfg.val_fraction})
    seen, step = [], TR.train_step
    monkeypatch.setattr(TR, "train_step", lambda *a, **k: seen.append((len(a[2]()), k["windows"],
                                                                      k["prefetch"].__self__ is a[2].__self__))
                        or step(*a, **k))
    rows = B.profile_study("tiny", 2, False, {"model__vocab_size": 512, "model__context": 64, "model__attn_window": 32,
                                              "train__doc_mask": True}, corpus="the test corpus")
    assert set(seen) == {(3, (32, 0), True)}  # (x, y, document ids) from the corpus; the long window 32; drawn ahead
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-6 and not any("idle" in r["rung"] for r in rows)
    # Each rate is its class's counted FLOPs over its time: the step's 2 x 2 x 64 tokens, 6 N a token for the
    # matmuls (N: the weights that multiply) and the rest of flops.flops_per_token for attention.
    mcfg = C.preset("tiny", model__vocab_size=512, model__context=64, model__attn_window=32).model
    matmul, tokens = 6 * FL.multiplied_params(mcfg), 2 * 2 * 64
    counted = {"matmul": matmul * tokens, "attention": (FL.flops_per_token(mcfg) - matmul) * tokens}
    rates = {r["rung"]: r["tflops"] for r in rows if r["rung"] in counted}
    assert rates and rates == {c: pytest.approx(counted[c] / (next(r["ms"] for r in rows if r["rung"] == c) / 1000)
                                                / 1e12, rel=1e-2) for c in rates}


def test_attended_pairs_count_what_the_document_and_window_mask_lets_through():
    """The attention rate study's FLOP count: (query, key) pairs equal the boolean mask's trues."""
    doc = torch.cumsum(torch.rand(3, 300, generator=torch.Generator().manual_seed(0)) < 0.02, dim=1).int()
    for window in (0, 1, 17, 64, 300):
        assert B.attended_pairs(doc, window) == int(A.doc_mask(doc, window, 300).sum()), window
    assert B.attended_pairs(torch.zeros(1, 8, dtype=torch.int32), 0) == 36  # dense causal: T (T + 1) / 2


def test_the_varlen_attention_rows_take_each_document_as_a_sequence(monkeypatch):
    """--attention-rate's FlashAttention-2 rows: every document, and every row of the batch, starts a
    sequence; the longest one bounds the kernel's grid; window w reads w keys (the query's own and w - 1
    before it, FA2's left window), 0 all of them."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size:
                        calls.append((cu_q.tolist(), cu_k is cu_q, max_q, window_size, q.shape)) or q.float())
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]], dtype=torch.int32)  # documents within each row
    q = torch.randn(2, 3, 6, 4)  # (B, heads, T, hd)
    runs = B.varlen_cases(q, q, q, doc, [3, 0], None)
    for run in runs.values():
        run()
    assert calls == [([0, 2, 5, 6, 10, 12], True, 4, (2, 0), (12, 3, 4)), ([0, 2, 5, 6, 10, 12], True, 4, (-1, 0), (12, 3, 4))]


def test_a_plan_that_is_missing_a_folder_or_not_tables_is_one_line(tmp_path):
    """bench.py --plan with a missing file, a folder, or `rung = 3`: one line naming the file and what to give,
    exit 1, no traceback."""
    bad = tmp_path / "bad.toml"
    bad.write_text("rung = 3\n")
    for plan, says in ((tmp_path / "none.toml", "does not exist"), (tmp_path, "is a folder"),
                       (bad, "rung = 3: each rung is a [[rung]] table")):
        with pytest.raises(SystemExit) as e:
            B.main(["--plan", str(plan)])
        assert str(e.value.code).startswith(f"error: ") and says in str(e.value.code), e.value.code


def test_a_plan_on_a_cpu_leaves_out_rungs_that_differ_only_in_cuda_settings(capsys):
    """configs/plans/fast-accum-88m-mb16.toml's two rungs differ in FP8 fast accumulation, which a CPU does not run:
    its smoke test times one of them, saying why the other is left out (it spent minutes timing both)."""
    rungs = [B.cpu_sized(r, None) for r in B.plan_rungs(B.ROOT / "configs" / "plans" / "fast-accum-88m-mb16.toml")]
    kept = B.cpu_distinct(rungs)
    assert [r.name for r in kept] == [rungs[0].name]
    assert f"rung '{rungs[1].name}' runs on a CPU as rung '{rungs[0].name}' does" in capsys.readouterr().out
    mixed = [B.cpu_sized(r, None) for r in B.plan_rungs(B.ROOT / "configs" / "plans" / "recipe-speed.toml")]
    assert len(B.cpu_distinct(mixed)) >= 2  # rungs that change what a CPU computes all run


def test_the_loss_study_lists_each_fp8_head_case_and_resolves_what_they_call(monkeypatch):
    """--loss on an untied head: the FP8 head's cases, the multi-token loss's apart and as one function among them,
    skipped on a CPU (CUDA times them), and the functions they call named when the cases are built, so a CPU run
    fails where one is missing (the one function moved from model.py to fp8.py once, and the study kept calling
    model.py's)."""
    untied = C.preset("tiny", model__tie_embeddings=False)
    monkeypatch.setattr(B.C, "preset", lambda name, **overrides: untied)
    rows = B.loss_study("tiny", 1, False)
    names = [r["rung"] for r in rows]
    assert "FP8 head + multi-token loss (4 targets), one function, bf16 weight gradient" in names
    assert "FP8 head + multi-token loss kernels (4 targets), apart" in names
    assert [r["rung"] for r in rows if "ms" in r] == ["plain loss"]  # the rest need CUDA
