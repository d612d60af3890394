import dataclasses
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import boards as BO
import checkpoint as CK
import config as C
import data as D
import model as M
import optim as O
import sizing as SZ
import plots as PL
import train as TR
from conftest import cpu_sized_preset, tiny_model_cfg, tiny_run_config, with_train

ROOT = Path(__file__).resolve().parent.parent


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if "loss" in r]


def weights(run_dir: Path) -> dict:
    return CK.load(run_dir).model


QUIET = dict(log=lambda *a, **k: None)


# --- Exact resume --------------------------------------------------------------------------

# Today's recipe: Muon (its momentum lives in the checkpoint), ReLU², QK-norm, zero-init, and a
# warm-down over the last half of the 6 steps, so a stop after step 4 resumes in the middle of it.
TODAYS_RECIPE = ({"mlp": "relu2", "qk_norm": True, "zero_init": True},
                 {"muon": True, "schedule": "wsd", "warmdown_fraction": 0.5, "min_lr_ratio": 0.0})


# modded-nanogpt's parts (the newest record's bigram table, backout and smear too) on documents masked apart, with
# Polar Express and NorMuon (whose second moments a resume must restore), Muon's momentum, the sliding window (16,
# 32, 32, 32, 48, 48 tokens), the multi-token loss's weights and the batch (half, then whole) all changing over the 6
# steps, the prefix-token loss fading out, and the head and the embedding one matrix for the first 3: a stop after
# step 3 resumes inside each.
RECORD_RECIPE = ({"mlp": "relu2", "qk_norm": True, "zero_init": True, "tie_embeddings": False, "embed_norm": True,
                  "logit_softcap": 15.0, "value_embeds": 1, "unet_skips": True, "x0_mix": True, "rope_truncate": True,
                  "attn_gate": True, "attn_window": 48, "bigram_rows": 1000, "bigram_signs": True, "backout": True,
                  "smear": True, "key_offset": True, "value_gate": True, "rope_yarn": 16},
                 {"muon": True, "schedule": "wsd", "warmdown_fraction": 0.5, "min_lr_ratio": 0.1, "warmup_steps": 0,
                  "muon_momentum_warmup": 5, "window_start": 16, "doc_mask": True, "embed_lr": 0.05,
                  "scalar_lr": 0.01, "head_lr": 0.002, "beta1": 0.8, "adam_eps": 1e-10,
                  "muon_iteration": "polar-express", "muon_beta2": 0.95, "mtp_tokens": 3, "batch_stages": 2,
                  "untie_at": 0.5, "adam_weight_decay": 0.005, "prefix_weight": 0.25})


# fp16 with its gradient scaler (the path of GPUs without bf16), which CPU autocast runs too: the
# scaler's state is in the checkpoint and goes on from it.
FP16_RECIPE = (TODAYS_RECIPE[0], {**TODAYS_RECIPE[1], "fp16": True})


@pytest.fixture
def one_thread():
    """PyTorch's CPU kernels on one thread. On two, a gradient norm came out one ulp apart between two
    runs of the same step about once in 20 (0.8400015830993652 and ...5234947205), and the weights after
    the last step by up to 1e-5: the split of some reduction between threads is not fixed. A bitwise
    comparison of two runs asks for the same arithmetic, which one thread gives (60 runs out of 60)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_yarn_tables_follow_the_window_as_it_grows(train_config, tmp_path, monkeypatch):
    """model.rope_yarn: the model is built with the last window's tables, and each step whose window has grown (16,
    32, 32, 32, 48, 48) first sets RoPE's tables for it; a resumed run sets them for its own first step."""
    seen, set_tables = [], M.Llama.set_tables
    monkeypatch.setattr(M.Llama, "set_tables", lambda self, window=None: (seen.append(window), set_tables(self, window)))
    cfg = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, attn_window=48, rope_yarn=16),
                              train=dataclasses.replace(train_config.train, window_start=16))
    TR.train(cfg, tmp_path / "run", **QUIET)
    assert seen == [None, 16, 32, 48]
    seen.clear()
    with pytest.raises(TR.Interrupted):
        TR.train(cfg, tmp_path / "split", stop_after=3, **QUIET)
    seen.clear()
    TR.train(cfg, tmp_path / "split", resume=True, **QUIET)
    assert [w for w in seen if w is not None] == [32, 48]


# Paired heads (layer 1 of 4) on documents masked apart, their window growing with the others'.
PAIRED_RECIPE = ({"n_layers": 4, "n_heads": 2, "n_kv_heads": 2, "attn_window": 48, "short_windows": True,
                  "paired_heads": True}, {"doc_mask": True, "window_start": 16})


@pytest.mark.parametrize("recipe, stop", [(({}, {}), 3), (TODAYS_RECIPE, 4), (RECORD_RECIPE, 3), (FP16_RECIPE, 3),
                                          (PAIRED_RECIPE, 3)],
                         ids=["article", "muon-mid-warm-down", "record-mid-window-schedule", "fp16-scaler", "paired-heads"])
def test_resume_is_bitwise_exact(train_config, tmp_path, recipe, stop, one_thread):
    model, train = recipe
    train_config = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, **model),
                                       train=dataclasses.replace(train_config.train, **train))
    straight, split = tmp_path / "straight", tmp_path / "split"
    TR.train(train_config, straight, **QUIET)
    with pytest.raises(TR.Interrupted, match=f"--stop-after: saved .* at step {stop} of 6; continue with --resume"):
        TR.train(train_config, split, stop_after=stop, **QUIET)
    assert CK.load(split).step == stop
    carried = CK.load(split).train_seconds  # the time-to-loss clock goes on from where it stopped
    assert carried > 0
    TR.train(train_config, split, resume=True, **QUIET)
    assert json.loads((split / "summary.json").read_text())["train_seconds"] > carried
    assert losses(straight) == losses(split) and len(losses(split)) == 6
    if train.get("window_start"):  # the schedule went on growing across the resume
        assert [r["window"] for r in PL.read_log(split / "log.jsonl") if "loss" in r] == [16, 32, 32, 32, 48, 48]
    a, b = weights(straight), weights(split)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if train.get("fp16"):
        assert CK.load(split).scaler == CK.load(straight).scaler and CK.load(split).scaler["scale"] > 0


def test_fp16_trains_with_its_scaler_and_says_so(train_config, tmp_path):
    lines = []
    cfg = with_train(train_config, fp16=True, steps=12)
    summary = TR.train(cfg, tmp_path / "run", log=lines.append)
    curve = losses(tmp_path / "run")
    assert all(math.isfinite(v) for v in curve) and curve[-1] < curve[0] - 0.5
    assert math.isfinite(summary["val_loss"])
    assert any("fp16=True (gradient scaler)" in line for line in lines)
    saved = CK.load(tmp_path / "run").scaler
    assert set(saved) >= {"scale", "growth_factor", "backoff_factor", "_growth_tracker"}


def test_checkpoint_carries_its_context(train_config, tmp_path):
    TR.train(train_config, tmp_path / "run", **QUIET)
    ckpt = CK.load(tmp_path / "run")
    assert ckpt.optimizer["state"] and ckpt.step == 6 and ckpt.tokenizer_hash
    assert {"python", "numpy", "torch"} <= set(ckpt.rngs[0]) and ckpt.loaders[0]["pos"] > 0
    assert ckpt.config == train_config
    assert not list((tmp_path / "run").glob("*.tmp"))


# --- The recipe ----------------------------------------------------------------------------

def test_accumulation_matches_one_big_batch(train_config):
    """The loss is scaled by 1/accum: 4 micro-batches of 1 sequence update the weights as one
    micro-batch of 4 does (SGD with lr 1, so the update is the gradient itself)."""
    cfg = train_config.model
    x, y = torch.randint(0, cfg.vocab_size, (2, 4, 32), generator=torch.Generator().manual_seed(0))
    tcfg = with_train(train_config, grad_clip=1e9).train
    updated = []
    for micro in (4, 1):
        torch.manual_seed(0)
        model = M.Llama(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        batches = iter([(x[i:i + micro], y[i:i + micro]) for i in range(0, 4, micro)])
        loss, _ = TR.train_step(model, opt, lambda: next(batches), 4 // micro, tcfg, torch.device("cpu"), 1.0)
        updated.append((loss, [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(updated[0][0], updated[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(updated[0][1], updated[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_multi_token_loss_weights_each_later_target_in_float64(train_config):
    """The multi-token loss: the mean over positions t of sum_j w_j * -log softmax(softcap(logits[t]))[y[t + j]], a
    target past the sequence counting 0, written out here position by position; with only the next token weighted,
    train_step's loss is the model's own."""
    logits = torch.randn(2, 6, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    log_p = torch.log_softmax(M.softcap(logits, 3.0), dim=-1)
    expected = sum(w * -log_p[b, t, y[b, t + j]] for j, w in enumerate((1.0, 0.5, 0.25))
                   for b in range(2) for t in range(6 - j)) / 12
    targets = TR.multi_targets(y, (1.0, 0.5, 0.25))
    assert targets.ids.shape == (2, 6, 3) and targets.ids[0, 5].tolist() == [y[0, 5], -1, -1]
    found = M.cross_entropy(logits.flatten(0, 1), targets.ids.flatten(0, 1), 3.0, targets.weights.double())
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=0)
    next_only = M.cross_entropy(logits.flatten(0, 1), targets.ids.flatten(0, 1), 3.0, torch.tensor([1.0, 0, 0]).double())
    torch.testing.assert_close(next_only, M.cross_entropy(logits.flatten(0, 1), y.flatten(), 3.0), rtol=1e-12, atol=0)
    cfg = train_config.model
    model = M.Llama(cfg).eval()
    x, y = torch.randint(0, cfg.vocab_size, (2, 2, 32), generator=torch.Generator().manual_seed(2))
    tcfg, cpu = train_config.train, torch.device("cpu")
    with torch.no_grad():
        plain = TR.forward_loss(model, (x, y), tcfg, cpu)
        torch.testing.assert_close(TR.forward_loss(model, (x, y), tcfg, cpu, mtp=(1.0, 0.0)), plain)
        torch.testing.assert_close(TR.forward_loss(model, (x, y), tcfg, cpu, mtp=(1.0, 0.0, 0.0)), plain)
        two = TR.forward_loss(model, (x, y), tcfg, cpu, mtp=(1.0, 0.5))
        assert two > plain


def test_the_loss_targets_keep_one_form_all_run(train_config):
    """A faded multi-token or prefix-token weight stays a target column at weight 0: the model sees (B, T, K) targets
    at every step of a run that starts with K of them (a compiled model given another form compiles again, mid-run)."""
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, idx, targets, masks=None):
            seen.append(tuple(targets.ids.shape) if isinstance(targets, M.MultiTargets) else tuple(targets.shape))
            return torch.zeros(())

    x = y = torch.zeros(2, 8, dtype=torch.long)
    for prefix_weight, k in ((0.25, 4), (0.0, 3)):
        seen.clear()
        tcfg = dataclasses.replace(train_config.train, mtp_tokens=3, prefix_weight=prefix_weight)
        for step in (0, 30, 59):  # all three weights, the third faded, only the next token's
            TR.forward_loss(Recorder(), (x, y), tcfg, torch.device("cpu"), mtp=TR.mtp_weights_at(step, 60, 3),
                            prefix=TR.prefix_at(step, 60, tcfg, torch.zeros(5, dtype=torch.long)))
        assert seen == [(2, 8, k)] * 3


def test_the_prefix_token_loss_adds_the_next_tokens_prefix_token_at_its_weight():
    """The prefix-token loss (record #88), in float64 against the sum written out: beside the next tokens, each
    position's logits learn table[next token] at the prefix weight, a token without a prefix (-1) counting 0."""
    logits = torch.randn(2, 6, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    table = torch.tensor([-1, 0, 0, 1, -1, 4, 2, 6, 6, -1, 3])
    log_p = torch.log_softmax(logits, dim=-1)
    expected = sum(w * -log_p[b, t, y[b, t + j]] for j, w in enumerate((1.0, 0.5)) for b in range(2) for t in range(6 - j))
    expected += sum(0.25 * -log_p[b, t, table[y[b, t]]] for b in range(2) for t in range(6) if table[y[b, t]] >= 0)
    targets = TR.multi_targets(y, (1.0, 0.5), (table, 0.25))
    assert targets.ids.shape == (2, 6, 3) and torch.equal(targets.ids[..., 2], table[y])
    found = M.cross_entropy(logits.flatten(0, 1), targets.ids.flatten(0, 1), 0.0, targets.weights.double())
    torch.testing.assert_close(found, expected / 12, rtol=1e-12, atol=0)


def test_the_prefix_weight_holds_a_third_of_the_run_and_fades_out_by_two_thirds(train_config):
    tcfg, table = dataclasses.replace(train_config.train, prefix_weight=0.25), torch.zeros(3, dtype=torch.long)
    at = [TR.prefix_at(step, 60, tcfg, table) for step in (0, 20, 30, 40, 59)]
    assert [a[1] for a in at] == pytest.approx([0.25, 0.25, 0.125, 0.0, 0.0])  # faded, its column stays (one graph)
    assert all(a[0] is table for a in at) and TR.prefix_at(0, 60, train_config.train, table) is None


def test_a_run_with_the_prefix_token_loss_trains_and_checks_its_first_loss(train_config, tmp_path, capsys):
    TR.train(with_train(train_config, prefix_weight=0.25, steps=3), tmp_path / "run", **QUIET)
    first, = [s for s in capsys.readouterr().out.splitlines() if s.startswith("step 0 loss")]
    assert "more from prefix tokens" in first and "WARNING" not in first
    assert float(first.split()[3]) > math.log(train_config.model.vocab_size) + 0.3  # the prefix targets' share


def test_the_first_multi_token_loss_is_checked_against_its_weights_times_ln_vocab(train_config, tmp_path, capsys):
    TR.train(with_train(train_config, mtp_tokens=3, steps=1), tmp_path / "run", **QUIET)
    first, = [s for s in capsys.readouterr().out.splitlines() if s.startswith("step 0 loss")]  # the progress bar's
    assert f"vs 1.75 x ln(vocab) = {1.75 * math.log(train_config.model.vocab_size):.4f}" in first and "WARNING" not in first


def test_the_multi_token_weights_fade_as_modded_nanogpts():
    """3 tokens: [1, 0.5, 0.25 -> 0] over the first third, [1, 0.5 -> 0] over the second, [1] after (record #53)."""
    at = [w for step in (0, 10, 20, 30, 40, 60) for w in TR.mtp_weights_at(step, 60, 3)]
    assert at == pytest.approx([1, 0.5, 0.25, 1, 0.5, 0.125, 1, 0.5, 0, 1, 0.25, 0, 1, 0, 0, 1, 0, 0])
    assert TR.mtp_weights_at(30, 60, 1) == (1.0,) and TR.mtp_weights_at(15, 60, 2) == pytest.approx((1, 0.25))


def test_the_next_steps_first_micro_batch_is_drawn_before_the_update(train_config, tmp_path, monkeypatch):
    """train_step asks for the next step's first micro-batch once the last backward is queued, before the
    update and the caller's synchronization, so the GPU does not wait for it at the step's start; a
    training run hands it the loader's prefetch, once a step."""
    cfg = train_config.model
    model = M.Llama(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events, update = [], opt.step
    monkeypatch.setattr(opt, "step", lambda: events.append("update") or update())
    batch = tuple(torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)) for _ in "xy")
    TR.train_step(model, opt, lambda: events.append("batch") or batch, 3, train_config.train, torch.device("cpu"), 0.1,
                  prefetch=lambda: events.append("prefetch"))
    assert events == ["batch"] * 3 + ["prefetch", "update"]
    drawn, prefetch = [], D.ShardLoader.prefetch
    monkeypatch.setattr(D.ShardLoader, "prefetch", lambda loader: drawn.append(loader) or prefetch(loader))
    TR.train(train_config, tmp_path / "run", **QUIET)
    assert len(drawn) == 6 and len(set(map(id, drawn))) == 1  # six steps, the training loader's


def test_cuda_graph_modes_accumulate_into_kept_buffers(train_config):
    """Under reduce-overhead / max-autotune, gradients accumulate into buffers of our own, zeroed
    in place after each step (CUDA graphs overwrite adopted ones); training is bitwise unchanged."""
    cfg = train_config.model
    data = torch.randint(0, cfg.vocab_size, (3, 2, 2, 32), generator=torch.Generator().manual_seed(2))
    trained = []
    for mode in ("default", "reduce-overhead"):
        tcfg = with_train(train_config, compile=True, compile_mode=mode).train  # model itself left eager
        torch.manual_seed(0)
        model = M.Llama(cfg)
        opt = O.configure_optimizer(model, tcfg)
        batches = iter([(x, y) for x, y in data for _ in range(2)])
        for _ in range(3):
            TR.train_step(model, opt, lambda: next(batches), 2, tcfg, torch.device("cpu"), 1e-3)
        grads = [p.grad for p in model.parameters()]
        if mode == "default":
            assert all(g is None for g in grads)
        else:
            assert all(g is not None and not g.any() for g in grads)
        trained.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*trained):
        assert torch.equal(a, b)


def test_each_compile_mode_reaches_torch_compile(train_config, monkeypatch):
    """Every train.compile_mode becomes torch.compile arguments torch accepts: its own modes by
    name, coordinate-descent as the default mode with Inductor's coordinate-descent option."""
    import torch._inductor as inductor
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    for mode in C.CompileMode.__args__:
        TR.build_model(with_train(train_config, compile=True, compile_mode=mode), train_config.speed,
                       torch.device("cpu"), 0)
    assert calls[:2] == [{"mode": None}, {"options": {"coordinate_descent_tuning": True}}]
    for kwargs in calls[2:]:
        inductor.list_mode_options(kwargs["mode"])  # a mode torch knows (raises on an unknown one)
    assert set(inductor.config.get_config_copy()) >= set(calls[1]["options"])  # an option Inductor has


def test_a_compiled_run_says_when_torch_compile_split_the_model(train_config, tmp_path, monkeypatch, capsys):
    """A graph break runs the code around it uncompiled, silently: the run says so once, after its first step."""
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # the CPU need not compile
    cfg = with_train(train_config, compile=True, steps=2)
    for breaks in (0, 2):
        monkeypatch.setattr(TR, "graph_breaks", lambda: breaks)
        TR.train(cfg, tmp_path / f"run{breaks}")  # the step lines go through the progress bar's write
        split = [line for line in capsys.readouterr().out.splitlines() if "graph break" in line]
        assert split == ([] if not breaks else ["torch.compile split the model at 2 graph break(s), each run without "
                                                "Inductor's fusions around it: TORCH_LOGS=graph_breaks names them"])


@pytest.mark.parametrize("switch", ["activation_checkpointing", "recompute_mlp"])
def test_recomputation_gives_the_same_gradients_and_keeps_less(train_config, switch):
    """Recomputing in backward changes what is kept between the passes, not the gradients. With
    recompute_mlp the w13 outputs (2 x ffn_hidden per token and layer) are among what goes."""
    cfg = train_config.model
    x, y = torch.randint(0, cfg.vocab_size, (2, 2, 32), generator=torch.Generator().manual_seed(1))
    grads, kept = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = M.Llama(cfg)
        if recompute:
            TR.FP.apply_recompute(model, switch == "activation_checkpointing", switch == "recompute_mlp")
        storages = {}

        def keep(t):  # bytes the autograd graph holds for backward, each storage once
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(x, y)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        kept.append(sum(storages.values()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    w13_out = cfg.n_layers * x.numel() * 2 * cfg.ffn_hidden * 4  # float32 bytes of every w13 output
    assert kept[0] - kept[1] > w13_out, (kept, w13_out)


def test_batch_must_divide(train_config):
    with pytest.raises(ValueError, match=r"batch_tokens=1,000 is not a multiple of micro_batch x context x world size = 4 x 64 x 1 = 256"):
        TR.accumulation_steps(1000, 4, 64, 1)


def test_overfit_one_batch_drives_loss_near_zero(train_config, tmp_path):
    cfg = with_train(train_config, overfit_batch=True, steps=150, warmup_steps=10, lr=1e-2, batch_tokens=256,
                     ckpt_every=1000)
    summary = TR.train(cfg, tmp_path / "overfit", **QUIET)
    assert summary["steps"] == 150
    assert losses(tmp_path / "overfit")[-1] < 0.1


# --- Logging -------------------------------------------------------------------------------

def test_log_plot_and_summary(train_config, tmp_path):
    lines = []
    summary = TR.train(train_config, tmp_path / "run", log=lines.append)
    rows = [json.loads(r) for r in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "loss" in r]
    assert {"step", "loss", "lr", "grad_norm", "tok_s", "mfu", "peak_mem_gib"} <= set(step_rows[0])
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert summary["val_loss"] < math.log(512) and summary["val_bpb"] > 0 and summary["mfu"] is None
    text = "\n".join(lines)
    assert "git " in text and "torch " in text and "parameters" in text
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["config"]["train"]["steps"] == 6 and "git_commit" in config["provenance"]


def test_plots_keep_the_legend_off_the_curves_and_give_each_line_its_own_colour():
    """16 runs, as the 22m recipe ladder plots them: the legend lies right of the axes and no two
    lines share a colour; a target draws its line and one crossing per line that reaches it."""
    series = {f"run {i}": ([0, 1, 2], [3.0, 2.0 - i / 20, 1.0 + i / 10], "-") for i in range(16)}
    title = "validation loss as trained | 126m | python | 150 training s | NVIDIA H200 | 2026-12-02 | 19 rungs"
    fig = PL.line_figure(series, "s", "loss", title, target=1.5)
    ax = fig.axes[0]
    fig.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1
    heading = fig.texts[0].get_window_extent()  # a title as long as the ladder's stays inside the figure
    assert fig.texts[0].get_text() == title and heading.x0 >= 0 and heading.x1 <= fig.bbox.x1
    colours = [tuple(line.get_color()) for line in ax.get_lines() if line.get_label() in series]
    assert len(colours) == 16 and len(set(colours)) == 16
    crossings = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert len(crossings) == 12  # runs 0-5 end at or below 1.5, runs 10-15 pass it at x = 1
    assert abs(crossings[0].get_xdata()[0] - 1.5) < 1e-9  # run 0: 2.0 at 1, 1.0 at 2


def test_tensorboard_draws_each_step_once_across_a_resume(data_cfg, tmp_path):
    """A run stopped at step 5 whose last checkpoint is then the one at step 4 (as after a crash): the
    resumed session trains 5 and 6 again, and TensorBoard's reader finds every step once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = tiny_run_config(data_cfg, ckpt_every=2, tensorboard=True)
    run = tmp_path / "run"
    with pytest.raises(TR.Interrupted):
        TR.train(cfg, run, stop_after=5, **QUIET)
    (run / "ckpt.prev.pt").replace(run / "ckpt.pt")  # the checkpoint of step 4
    TR.train(cfg, run, resume=True, **QUIET)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("val/val_loss")] == [3, 6]
    assert [e.step for e in events.Scalars("lr/matrices")] == [1, 2, 3, 4, 5, 6]
    logged = {r["step"]: r["loss"] for r in PL.read_log(run / "log.jsonl") if "loss" in r}
    assert [round(e.value, 4) for e in events.Scalars("train/loss")] == [round(logged[s], 4) for s in range(1, 7)]
    assert {"train/tok_s", "train/grad_norm", "train/peak_mem_gib", "val/val_bpb"} <= set(events.Tags()["scalars"])


@pytest.mark.parametrize("board", ["tensorboard", "wandb"])
def test_a_board_without_its_package_says_how_to_install_it(train_config, tmp_path, monkeypatch, board):
    real = BO.importlib.util.find_spec
    monkeypatch.setattr(BO.importlib.util, "find_spec", lambda name: None if name == board else real(name))
    with pytest.raises(ValueError, match=rf"^train.{board} needs the {board} package: pip install {board} .* --{board}$"):
        TR.train(with_train(train_config, **{board: True}), tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()


def test_wandb_logs_offline_and_a_resume_continues_the_same_run(data_cfg, tmp_path, monkeypatch):
    """WANDB_MODE=offline: the curves of both sessions go to one W&B run, the one the folder's wandb_id names."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = []
    real_log = wandb.sdk.wandb_run.Run.log
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log",
                        lambda self, data, step=None, **k: (logged.append((self.id, step, data)),
                                                            real_log(self, data, step=step, **k))[1])
    cfg = tiny_run_config(data_cfg, ckpt_every=2, wandb=True, wandb_project="onegpu-test")
    run = tmp_path / "run"
    with pytest.raises(TR.Interrupted):
        TR.train(cfg, run, stop_after=4, **QUIET)
    TR.train(cfg, run, resume=True, **QUIET)
    run_id = (run / "wandb_id").read_text().strip()
    assert {i for i, _, _ in logged} == {run_id}
    assert [s for _, s, d in logged if "train/loss" in d] == [1, 2, 3, 4, 5, 6]
    assert [s for _, s, d in logged if "val/val_loss" in d] == [3, 6]
    # W&B names a session's folder by the second it began and the run id, adding "-1" where two quick sessions began
    # in the same second; none names another id
    folders = list((run / "wandb").glob("offline-run-*"))
    assert folders and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", f.name) for f in folders)


def test_help_after_config_shows_that_files_values():
    shown = " ".join(TR.build_parser(["--config", str(C.PRESETS_DIR / "88m.toml"), "--help"]).format_help().split())
    assert "width of the residual stream (default in configs/88m.toml: 768)" in shown
    assert "(default in configs/tiny.toml: 128)" in " ".join(TR.build_parser([]).format_help().split())
    assert "(default in configs/tiny.toml: 128)" in " ".join(TR.build_parser(["--config", "no.toml"]).format_help().split())


def test_a_log_file_gets_lines_without_progress_bars(train_config, tmp_path, capsys):
    """Output to a file (capsys: not a terminal) holds the step lines alone: no carriage returns or
    escape codes of a progress bar drawn over itself."""
    TR.train(train_config, tmp_path / "run")
    captured = capsys.readouterr()
    assert "step      6 | val loss" in captured.out
    assert not any(c in captured.out + captured.err for c in "\r\x1b"), (captured.out + captured.err)[-500:]


def test_bits_per_byte_are_the_summed_loss_in_bits_over_the_decoded_bytes(train_config):
    """Independently of token_byte_lengths: the validation targets decoded to text by the tokenizer
    give the bytes; the mean loss times the tokens gives the nats, over ln 2 the bits."""
    import tokenizer as tk
    r = TR.setup(train_config, **QUIET)
    token_bytes = torch.tensor(tk.token_byte_lengths(tk.load_tokenizer(r.tokenizer_path)), dtype=torch.float32)
    found = TR.evaluate(r.model, r.val_loader, 2 * r.val_loader.B, token_bytes, r.cfg.train, r.device)
    r.val_loader.rewind()
    tok = tk.load_tokenizer(r.tokenizer_path)
    targets = [r.val_loader.next_batch()[1] for _ in range(2)]
    n_bytes = sum(len(tok.decode(row.tolist()).encode("utf-8")) for y in targets for row in y)
    n_tokens = sum(y.numel() for y in targets)
    assert found["val_bpb"] == pytest.approx(found["val_loss"] * n_tokens / math.log(2) / n_bytes, rel=1e-6)


def test_evaluation_scores_every_target_once_whatever_rows_its_loss_takes_at_a_time(train_config, monkeypatch):
    r = TR.setup(train_config, **QUIET)
    token_bytes = torch.ones(r.model.cfg.vocab_size)
    whole = TR.evaluate(r.model, r.val_loader, 2 * r.val_loader.B, token_bytes, r.cfg.train, r.device)
    monkeypatch.setattr(TR, "EVAL_LOSS_ROWS", 5)  # divides no batch's rows: the last part is short
    assert TR.evaluate(r.model, r.val_loader, 2 * r.val_loader.B, token_bytes, r.cfg.train, r.device) == \
        pytest.approx(whole, rel=1e-6)


def test_one_muon_step_moves_a_block_matrix_by_muon_lr_over_its_width(train_config):
    """An orthogonalised update has singular values near one, so its RMS is about 1/sqrt(width): one
    step at muon_lr (here 100x AdamW's lr) moves a square block matrix by muon_lr/sqrt(d) RMS."""
    cfg = with_train(train_config, muon=True, muon_lr=0.02, lr=2e-4, grad_clip=0.0)
    r = TR.setup(cfg, **QUIET)
    wo = r.raw.blocks[0].attn.wo.weight
    before = wo.detach().clone()
    TR.train_step(r.model, r.optimizer, r.train_loader.next_batch, r.accum, r.cfg.train, r.device, cfg.train.lr)
    rms = (wo.detach() - before).pow(2).mean().sqrt().item()
    assert 0.6 < rms / (0.02 / math.sqrt(wo.shape[1])) < 1.3


def test_peak_lookup_never_invents_a_number():
    assert TR.peak_tflops("NVIDIA H200") == 989.4 and TR.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert TR.peak_tflops("NVIDIA GeForce RTX 4060 Laptop GPU") == 29.1
    assert TR.peak_tflops("Some Future GPU") is None


def test_cuda_only_flags_are_named_on_cpu(train_config):
    said = []
    cfg = TR.cpu_fallbacks(dataclasses.replace(train_config.train, bf16=True, tf32=True, optimizer="fused"),
                           torch.device("cpu"), said.append)
    assert said == ["note: running on CPU, so --tf32, --bf16, --fused are ignored (CUDA-only)"]
    assert not cfg.bf16 and cfg.optimizer == "foreach"


def test_fp8_settings_are_named_and_off_on_cpu(train_config):
    said = []
    cfg = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, tie_embeddings=False),
                              speed=dataclasses.replace(train_config.speed, fp8_head=True))
    r = TR.setup(cfg, log=said.append)
    # the config keeps what was asked (the same command resumes on any card); the model runs the plain head
    assert r.cfg.speed.fp8_head and r.swapped == [] and type(r.raw.output) is TR.M.Output
    assert "note: --no-fp8-head on CPU: a CPU has no FP8 matmul units (emulated, about 20x slower); the plain " \
           "paths compute the same functions" in said


# --- Faults --------------------------------------------------------------------------------

def poison(monkeypatch, at_call: int, value=float("nan"), error=None, raise_signal=None):
    """Make the at_call-th forward pass return loss * `value`, raise `error`, or deliver a signal."""
    calls = {"n": 0}
    real = TR.forward_loss

    def forward(*args):
        calls["n"] += 1
        if calls["n"] != at_call:
            return real(*args)
        if error is not None:
            raise error
        if raise_signal is not None:
            signal.raise_signal(raise_signal)
            return real(*args)
        return real(*args) * value

    monkeypatch.setattr(TR, "forward_loss", forward)


@pytest.mark.parametrize("grad_clip", [1.0, 0.0], ids=["clipped", "no-norm-computed"])
def test_nan_loss_stops_and_keeps_last_good_checkpoint(train_config, tmp_path, monkeypatch, grad_clip):
    """Without clipping the gradient norm is not computed (it reads 0): the loss alone must stop the run."""
    run = tmp_path / "run"
    poison(monkeypatch, at_call=9)  # step 4's first micro-batch (2 per step)
    with pytest.raises(SystemExit, match=r"loss is nan .* at step 4: stopping; the last good checkpoint .*ckpt\.pt \(step 3\) is kept"):
        TR.train(with_train(train_config, grad_clip=grad_clip), run, **QUIET)
    assert CK.load(run).step == 3


def test_each_log_row_counts_its_tokens_and_times_its_step(train_config, tmp_path, capsys, monkeypatch):
    # A clock whose readings move further apart each time, so that no two steps take the same time.
    clock = itertools.count()
    monkeypatch.setattr(TR.time, "perf_counter", lambda: 0.001 * next(clock) ** 2)
    cfg = with_train(train_config, steps=4, warmup_steps=1)  # a warm-up that fits: the config is the run's
    summary = TR.train(cfg, tmp_path / "run", **QUIET)
    said = capsys.readouterr().out.splitlines()  # the step lines go through the progress bar's write
    rows = [r for r in map(json.loads, (tmp_path / "run" / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["tokens"] for r in rows] == [512, 1024, 1536, 2048]
    assert [r["lr"] for r in rows] == [O.lr_at(step, cfg.train, 4) for step in range(4)]  # the rate each step ran at
    assert all(r["tok_s"] == pytest.approx(512 / r["step_s"], rel=0.01, abs=1) for r in rows)
    # The first two steps compile (the second once more where a step is one micro-batch): the third stands in for
    # them in the training time (until it comes, the faster of them), and the mean rate leaves them out.
    assert rows[0]["step_s"] < rows[1]["step_s"] < rows[2]["step_s"] < rows[3]["step_s"]
    assert rows[0]["train_seconds"] == pytest.approx(rows[0]["step_s"], abs=1e-3)
    assert rows[1]["train_seconds"] == pytest.approx(2 * rows[0]["step_s"], abs=1e-3)
    assert rows[-1]["train_seconds"] == pytest.approx(3 * rows[2]["step_s"] + rows[3]["step_s"], abs=1e-3)
    assert summary["mean_tok_s"] == pytest.approx((rows[2]["tok_s"] + rows[3]["tok_s"]) / 2, abs=2)
    first, = [s for s in said if s.startswith("step 0 loss")]  # said once, at the first step
    assert f"vs ln(vocab) = {math.log(train_config.model.vocab_size):.4f}" in first and "WARNING" not in first


def test_nan_right_after_a_checkpoint_falls_back_to_the_one_before(train_config, tmp_path, monkeypatch):
    """The checkpoint saved at step 3 holds the weights that give NaN at step 3: resuming from it
    would stop again, so the one before it (step 2) takes its place."""
    run = tmp_path / "run"
    cfg = with_train(train_config, ckpt_every=1, steps=6)
    poison(monkeypatch, at_call=7)  # step 3's first micro-batch
    with pytest.raises(SystemExit, match=r"the last good checkpoint .*ckpt\.pt \(step 2\) is kept"):
        TR.train(cfg, run, **QUIET)
    assert CK.load(run).step == 2 and CK.load(run / "ckpt.diverged.pt").step == 3


def test_nan_step_can_be_skipped_and_counted(train_config, tmp_path, monkeypatch):
    poison(monkeypatch, at_call=5)
    summary = TR.train(with_train(train_config, skip_nonfinite=True), tmp_path / "run", **QUIET)
    assert summary["skipped"] == 1 and summary["steps"] == 6
    assert all(torch.isfinite(w).all() for w in weights(tmp_path / "run").values())


def test_sigterm_saves_and_resume_continues(train_config, tmp_path, monkeypatch):
    run = tmp_path / "run"
    poison(monkeypatch, at_call=5, raise_signal=signal.SIGTERM)  # during step 3
    old = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(TR.Interrupted, match="SIGTERM: saved"):
            TR.train(with_train(train_config, ckpt_every=100), run, **QUIET)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    assert CK.load(run).step == 3
    monkeypatch.undo()
    summary = TR.train(train_config, run, resume=True, **QUIET)
    assert summary["steps"] == 6


def test_out_of_memory_names_the_micro_batch(train_config, tmp_path, monkeypatch):
    poison(monkeypatch, at_call=1, error=torch.cuda.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(SystemExit, match=r"out of memory at step 0 with micro_batch=4 .* try --micro-batch 2"):
        TR.train(train_config, tmp_path / "run", **QUIET)


def test_checkpoint_from_another_shape_or_tokenizer_is_refused(train_config, tmp_path):
    run = tmp_path / "run"
    TR.train(train_config, run, **QUIET)
    wider = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, d_model=128, n_heads=2, n_kv_heads=2))
    with pytest.raises(ValueError, match=r"another model shape \(d_model: checkpoint 64, config 128; n_heads"):
        TR.train(with_train(wider, steps=9), run, resume=True, **QUIET)
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    ckpt["tokenizer_hash"] = "0123456789abcdef"
    torch.save(ckpt, run / "ckpt.pt")
    with pytest.raises(ValueError, match=r"trained with tokenizer 0123456789abcdef, but the data now uses tokenizer"):
        TR.train(with_train(train_config, steps=9), run, resume=True, **QUIET)


def test_existing_run_is_not_overwritten(train_config, tmp_path):
    TR.train(train_config, tmp_path / "run", **QUIET)
    with pytest.raises(ValueError, match="already holds a checkpoint: pass --resume"):
        TR.train(train_config, tmp_path / "run", **QUIET)


# --- Training for a budget of seconds ------------------------------------------------------

def test_step_time_fit_is_the_weighted_line_through_each_windows_median():
    times = [1.0, 1.2, 9.0, 2.0, 2.1, 2.0, 3.0]  # window 128: median 1.2 over 3; 640: 2.0 over 3; 1152: 3.0 over 1
    windows = [128, 128, 128, 640, 640, 640, 1152]
    x, y, w = np.array([128, 640, 1152.0]), np.array([1.2, 2.0, 3.0]), np.sqrt([3, 3, 1.0])
    A = np.stack([x, np.ones(3)], axis=1) * w[:, None]  # weighted least squares, solved apart from np.polyfit
    slope, intercept = np.linalg.lstsq(A, y * w, rcond=None)[0]
    fit = SZ.step_time_fit(times, windows)
    assert fit(896) == pytest.approx(intercept + slope * 896, rel=1e-12)
    assert SZ.step_time_fit([0.5, 0.7, 0.6], [0, 0, 0])(0) == 0.6  # one window: its median


def record_window(step, steps):
    """A schedule that grows 128 to 1,792 keys in blocks of 128, as window_at does for the 126m default."""
    return min(1792, 128 * math.ceil((128 + step / steps * 1664) / 128))


def test_steps_to_fill_is_the_most_steps_whose_predicted_times_fit():
    window = record_window
    step_time = lambda w: 0.64 + 0.96e-4 * w / 1.664  # 0.64 s at no window, 0.74 s at 1,792 (126m's pace)
    cost = lambda done, steps: sum(step_time(window(s, steps)) for s in range(done, steps))
    for seconds, done in ((157.0, 0), (145.0, 12), (0.1, 30)):
        steps = SZ.steps_to_fill(seconds, done, step_time, window)
        assert steps == done + 1 or cost(done, steps) <= seconds
        assert cost(done, steps + 1) > seconds
    assert SZ.steps_to_fill(0.1, 30, step_time, window) == 31  # never fewer than one step more


def test_a_run_sized_with_the_margin_ends_inside_its_seconds_when_steps_come_slower_than_predicted():
    """The 126m default's seed 1338 (2026-12-02): 41.7 s spent at its second sizing, then steps 0.7%
    slower than the fit said; sized to all of the 115.3 s left it overran 157 s by 0.6 s."""
    window = record_window
    step_time = lambda w: 0.6138 + 0.0536e-3 * w  # its fit: 620 ms at window 128, 710 at 1,792
    cost = lambda done, steps: sum(step_time(window(s, steps)) for s in range(done, steps))
    slower, spent, done = 1.007, 41.679, 65
    ends = lambda left: spent + slower * cost(done, SZ.steps_to_fill(left, done, step_time, window))
    assert ends(157 - spent) > 157  # without the margin
    assert ends(SZ.seconds_to_fill(157, spent)) <= 157


def test_the_second_sizing_falls_halfway_through_the_stable_share():
    assert SZ.resize_step(C.TrainConfig(steps=1, warmdown_fraction=0.5), 100) == 25  # stable: steps 0-49
    assert SZ.resize_step(C.TrainConfig(steps=1, warmdown_fraction=0.2), 100) == 40  # stable: steps 0-79


def test_a_seconds_run_sizes_itself_again_halfway_through_its_stable_share(train_config, tmp_path, capsys,
                                                                           monkeypatch):
    # A clock that moves 50 ms a reading, so a step takes 50 ms whatever else the machine runs: on the real
    # clock, with the suite's other worker on the second core, the probe's steps came out slow enough (twice)
    # that the run was sized too short to size itself again past the probe's 12 steps.
    clock = itertools.count()
    monkeypatch.setattr(TR.time, "perf_counter", lambda: 0.05 * next(clock))
    cfg = with_train(train_config, steps=0, seconds=4.0, schedule="wsd", eval_every=1000, ckpt_every=1000)
    summary = TR.train(cfg, tmp_path / "run", **QUIET)
    out = capsys.readouterr().out
    first = int(out.split("so the run takes ")[1].split()[0])
    again = SZ.resize_step(cfg.train, first)
    assert again > SZ.PROBE_STEPS, "the run is too short to size itself again: give it more seconds"
    assert f"train.seconds=4: at step {again}, steps take" in out
    assert summary["steps"] == json.loads((tmp_path / "run" / "config.json").read_text())["config"]["train"]["steps"]


def test_a_seconds_budget_sizes_the_run_from_its_probe_and_a_resume_keeps_the_size(train_config, tmp_path, capsys):
    """train.seconds: the first PROBE_STEPS steps run unsized, the second half of them at the window
    schedule's last window; then the steps are fixed, written into config.json and the checkpoint,
    and a resume keeps them whatever its own speed."""
    cfg = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, attn_window=48),
                              train=dataclasses.replace(train_config.train, steps=0, seconds=1.5, schedule="wsd",
                                                        window_start=16, eval_every=1000, ckpt_every=1000))
    with pytest.raises(TR.Interrupted):
        TR.train(cfg, tmp_path / "run", stop_after=SZ.PROBE_STEPS, **QUIET)  # sized at this step, whatever its pace
    steps = CK.load(tmp_path / "run").config.train.steps
    assert steps > SZ.PROBE_STEPS
    assert json.loads((tmp_path / "run" / "config.json").read_text())["config"]["train"]["steps"] == steps
    assert "train.seconds=1.5: steps take " in capsys.readouterr().out
    windows = [r["window"] for r in PL.read_log(tmp_path / "run" / "log.jsonl") if "loss" in r]
    assert windows[:SZ.PROBE_STEPS] == [16] * 7 + [48] * 5  # both ends of the schedule timed
    resumed, _ = TR.resolve_config(TR.build_parser().parse_args(["--runs-dir", str(tmp_path), "--name", "run",
                                                                 "--resume"]), tmp_path / "run", **QUIET)
    assert resumed.train.steps == steps
    again, _ = TR.resolve_config(TR.build_parser().parse_args(  # the command that started it, plus --resume
        ["--runs-dir", str(tmp_path), "--name", "run", "--steps", "0", "--seconds", "1.5", "--resume"]), tmp_path / "run",
        **QUIET)
    assert again == resumed
    summary = TR.train(resumed, tmp_path / "run", resume=True, **QUIET)
    assert summary["steps"] == steps


@pytest.mark.parametrize("changes, message", [
    (dict(seconds=10.0, tokens=1000, steps=0), r"train.seconds=10 and train.tokens=1,000 both say how long"),
    (dict(seconds=10.0, steps=0, schedule="cosine"), r"which a cosine schedule cannot allow .* use schedule = \"wsd\""),
])
def test_a_seconds_budget_refuses_what_it_cannot_size(changes, message):
    with pytest.raises(ValueError, match=message):
        C.TrainConfig(**changes)


def test_a_window_schedule_needs_a_window_to_grow_to():
    with pytest.raises(ValueError, match=r"train.window_start=256 grows the window to model.attn_window=0"):
        C.load_config(C.PRESETS_DIR / "tiny.toml", train__window_start=256)
    cfg = C.load_config(C.PRESETS_DIR / "tiny.toml", train__window_start=128, model__attn_window=1792, train__steps=100)
    assert [TR.window_at(s, 100, cfg)[0] for s in (0, 1, 50, 99, 100)] == [128, 256, 1024, 1792, 1792]


def test_a_run_on_long_or_masked_sequences_also_reports_plain_windows(train_config, tmp_path, monkeypatch):
    """Beside the loss as it trains, the loss on plain causal windows (here the tiny model's 64 tokens
    stand for 1,024): with document masks at that length, and on a longer context; a plain run at
    that length has only the one loss. A sliding window shorter than the context adds the loss with
    whole windows."""
    short = with_train(train_config, steps=3, eval_every=3)
    monkeypatch.setattr(TR, "PLAIN_CONTEXT", 64)
    masked = TR.train(with_train(short, doc_mask=True), tmp_path / "masked", **QUIET)
    assert math.isfinite(masked["val_loss_1024"]) and masked["val_loss_1024"] > 0
    assert "val_loss_1024" not in TR.train(short, tmp_path / "plain", **QUIET)
    monkeypatch.setattr(TR, "PLAIN_CONTEXT", 32)
    longer = TR.train(short, tmp_path / "longer", **QUIET)
    assert longer["val_loss_1024"] > longer["val_loss"]  # half the context to predict from
    assert "val_loss_whole" not in longer  # no window shorter than the context: no target is cut short
    windowed = dataclasses.replace(short, model=dataclasses.replace(short.model, attn_window=16))
    whole = TR.train(windowed, tmp_path / "windowed", **QUIET)
    assert math.isfinite(whole["val_loss_whole"]) and whole["val_loss_whole"] != whole["val_loss"]


def test_a_resume_applies_the_optimizer_changes_it_reports(train_config, tmp_path):
    """Changed Muon and AdamW settings on --resume run from the resumed step on: the checkpoint the
    resumed run writes holds them, not the ones saved before. A resume that drops Muon is refused."""
    cfg = with_train(train_config, muon=True, ckpt_every=1)
    with pytest.raises(TR.Interrupted):
        TR.train(cfg, tmp_path / "run", stop_after=2, **QUIET)
    changed = with_train(cfg, muon_momentum=0.9, muon_lr=0.04, beta2=0.99)
    with pytest.raises(TR.Interrupted):
        TR.train(changed, tmp_path / "run", resume=True, stop_after=3, **QUIET)
    muon, adamw = CK.load(tmp_path / "run").optimizer["optimizers"]
    assert muon["param_groups"][0]["momentum"] == 0.9
    assert muon["param_groups"][0]["lr_ratio"] == pytest.approx(0.04 / cfg.train.lr)
    assert all(g["betas"] == (0.9, 0.99) for g in adamw["param_groups"])
    with pytest.raises(ValueError, match="optimizer is Muon \\+ AdamW, this run's is AdamW alone: resume with --muon"):
        TR.train(with_train(cfg, muon=False), tmp_path / "run", resume=True, **QUIET)


def test_resume_past_the_asked_steps_is_refused(train_config, tmp_path):
    TR.train(with_train(train_config, steps=4, eval_every=4, ckpt_every=4), tmp_path / "run", **QUIET)
    (tmp_path / "run" / "summary.json").unlink()  # as a run stopped at its last step without a summary
    with pytest.raises(ValueError, match=r"is at step 4, past the 2 steps asked for: pass --steps 4 or more"):
        TR.train(with_train(train_config, steps=2), tmp_path / "run", resume=True, **QUIET)


# --- Config files and flags ----------------------------------------------------------------

def test_flags_override_file_override_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nd_model = 128\nn_heads = 2\nn_kv_heads = 1\n[train]\nsteps = 7\nlr = 1\ncompile = true\n')
    args = TR.build_parser().parse_args(["--config", str(path), "--steps", "9", "--no-compile", "--fused"])
    cfg, _ = TR.resolve_config(args)
    assert cfg == C.load_config(path, train__steps=9, train__compile=False, train__optimizer="fused")
    assert (cfg.model.d_model, cfg.model.n_layers) == (128, 10)  # file, default
    assert (cfg.train.steps, cfg.train.lr, cfg.train.compile, cfg.train.optimizer) == (9, 1.0, False, "fused")


# The 126m default (docs/PERFORMANCE.md, against the record holder) as flags over configs/126m-muon.toml:
# the record's ideas, then long-short windows, the record's shape, its attention-free layer and FP8 head,
# pinned copies, modded's optimizer details, the loss kernel, and the value scales, Adam epsilon at
# modded's gradient scale and gainless norms (measured: 1.355 with whole windows in 157 s). The runs had
# --no-fused-decode, a generation switch, which training never reads; the preset decodes fused since,
# and with split decode and the decode MLP (generation's too) since 2026-12-03, and its MLP's matmuls in FP8 since
# 2026-12-04 (a speed setting, measured apart: +4.1%, a loss after 150 steps within two seeds' spread), and its FP8
# forward products with fast accumulation since 2026-12-05 (a speed setting, measured apart: +1.7%, losses after 150
# steps no worse, two seeds a side). Since 2026-12-06 the newest records' ideas, measured together at 70 s
# (configs/recipes/newest.toml), with the fused decode off: it has no key offset or value gates; since 2026-12-07
# the quarter batch with five more ideas, and the newer records' warm-down; then the shifted soft-cap, gated XSA and
# the saved attention input, together; then the first block dropped (the record's 11 blocks).
NEWEST_FLAGS = ("--bigram-rows 163840 --backout --smear --key-offset --value-gate --mtp-tokens 3 "
                "--muon-iteration polar-express --muon-beta2 0.95 --muon-weight-decay 0.013 --muon-cautious "
                "--no-fused-decode --no-split-decode --batch-tokens 98304 --bigram-signs --paired-heads "
                "--adam-weight-decay 0.005 --untie-at 0.6667 --prefix-weight 0.25 --eval-every 1000 --ckpt-every 1000 "
                "--warmdown-fraction 0.6 --min-lr-ratio 0.15 --logit-softcap 11.5 --logit-shift 5 --logit-temperature 15 "
                "--xsa --saved-attn-input --n-layers 11 --skip-attn-layer 6")
RECORD_FLAGS = ("--no-tie-embeddings --embed-norm --logit-softcap 15 --lr 0.008 --embed-lr 0.6 --head-lr 0.008 "
                "--scalar-lr 0.04 --beta1 0.8 --adam-eps 2.5e-16 --value-scale --muon-lr 0.05 --muon-momentum-warmup 300 "
                "--warmup-steps 0 --warmdown-fraction 0.45 --min-lr-ratio 0.1 --value-embeds 3 --unet-skips --x0-mix "
                "--rope-truncate --attn-gate --batch-tokens 393216 --context 8192 --doc-mask --attn-window 1792 "
                "--window-start 128 --micro-batch 4 --short-windows --n-layers 12 --n-heads 6 --n-kv-heads 6 "
                "--skip-attn-layer 7 --fp8-head --pin --attn-scale 0.12 --no-muon-tall-scale "
                "--grad-clip 0 --loss-kernel --no-norm-gains --split-decode --decode-mlp --decode-pdl --fp8 "
                "--fp8-fast-accum")


def test_the_126m_default_is_the_measured_recipe():
    measured, _ = TR.resolve_config(TR.build_parser().parse_args(["--config", str(C.PRESETS_DIR / "126m-muon.toml"),
                                                                  *RECORD_FLAGS.split(), *NEWEST_FLAGS.split()]))
    assert C.preset("126m", train__micro_batch=4) == measured


def test_extends_reads_the_base_first_and_refuses_a_cycle(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n[train]\nlr = 0.5\n')
    (tmp_path / "b.toml").write_text('extends = "tiny"\n[train]\nlr = 0.1\nsteps = 7\n')
    cfg = C.load_config(tmp_path / "a.toml")
    assert (cfg.train.lr, cfg.train.steps, cfg.model.d_model) == (0.5, 7, 128)  # a over b over tiny
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(ValueError, match="extends 'a.toml' leads back to itself"):
        C.load_config(tmp_path / "a.toml")


@pytest.mark.parametrize("name", ["tiny", "22m", "47m", "88m", "126m", "tiny-muon", "88m-muon", "126m-muon"])
def test_every_preset_file_loads(name):
    cfg, _ = TR.resolve_config(TR.build_parser().parse_args(["--config", str(ROOT / "configs" / f"{name}.toml")]))
    assert cfg == C.preset(name)
    if not name.startswith("tiny"):  # the fast path is on for the GPU presets
        assert cfg.train.compile and cfg.train.bf16 and cfg.train.tf32 and cfg.train.optimizer == "fused"
        assert TR.accumulation_steps(cfg.train.batch_tokens, cfg.train.micro_batch, cfg.model.context, 1) > 0


# The fastest settings measured on an H200 (docs/PERFORMANCE.md, training speed): on by default,
# and the slower ones (the fused loss, the fused ReLU², compile tuning) off. Each flag turns one part off.
FASTEST = {"train.tf32": True, "train.bf16": True, "train.compile": True, "train.compile_mode": "default",
           "train.optimizer": "fused", "speed.fused_swiglu": False, "speed.bf16_residual": True,
           "speed.fused_loss": False, "speed.fp8": True, "speed.fused_relu2": False}


@pytest.mark.parametrize("flag, key, off", [
    (None, None, None), ("--no-tf32", "train.tf32", False), ("--no-bf16", "train.bf16", False),
    ("--no-compile", "train.compile", False), ("--no-fused", "train.optimizer", "foreach"),
    ("--no-bf16-residual", "speed.bf16_residual", False), ("--no-fp8", "speed.fp8", False)])
def test_88m_config_runs_the_fastest_measured_settings_and_each_flag_turns_one_off(flag, key, off):
    argv = ["--config", str(ROOT / "configs" / "88m.toml"), *([flag] if flag else [])]
    cfg, _ = TR.resolve_config(TR.build_parser().parse_args(argv))
    settings = {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in FASTEST}
    assert settings == ({**FASTEST, key: off} if flag else FASTEST)


def test_bad_config_errors_name_key_and_file(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nstep = 7\n')
    with pytest.raises(SystemExit, match=r"c\.toml: unknown key\(s\) train\.step; valid keys in \[train\] are: .*steps"):
        TR.main(["--config", str(path)])
    path.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(SystemExit, match=r"train\.steps must be int, got str 'many'"):
        TR.main(["--config", str(path)])


# --- Several processes ---------------------------------------------------------------------

# In the slow tier (CI runs it): each costs about 10 s of the suite's 2 minutes, two processes on two cores.
@pytest.mark.slow
# Paired heads with Muon on the matrices, as the 126m default trains them (under AdamW one entry of a paired layer's
# output projection, moved by about one lr, differed by 1.6e-5: Adam's step on a near-zero gradient, as below).
@pytest.mark.parametrize("recipe", [({}, {}), TODAYS_RECIPE, RECORD_RECIPE,
                                    (PAIRED_RECIPE[0], {**PAIRED_RECIPE[1], "muon": True})],
                         ids=["article", "muon", "record", "paired-heads"])
def test_two_gloo_processes_equal_one(train_config, tmp_path, recipe, free_port):
    """torchrun with 2 CPU ranks, each half the micro-batches, matches 1 process (same global batch),
    with AdamW and with Muon (each rank orthogonalises the same all-reduced gradients)."""
    cfg = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, **recipe[0]),
                              train=dataclasses.replace(train_config.train, **recipe[1]))
    common = ["--config", str(tmp_path / "c.toml"), "--runs-dir", str(tmp_path), "--steps", "3",
              "--eval-every", "3", "--ckpt-every", "3"]
    toml = ["[model]"] + [f"{k} = {json.dumps(v)}" for k, v in dataclasses.asdict(cfg.model).items()]
    toml += ["[data]"] + [f"{k} = {json.dumps(v)}" for k, v in dataclasses.asdict(cfg.data).items()]
    train = {"batch_tokens": 512, "micro_batch": 2, "device": "cpu", "sample_tokens": 0, "warmup_steps": 2, **recipe[1]}
    toml += ["[train]"] + [f"{k} = {json.dumps(v)}" for k, v in train.items()]
    (tmp_path / "c.toml").write_text("\n".join(toml))  # JSON scalars are valid TOML values
    assert_two_ranks_equal_one(common, tmp_path, free_port, steps=3)


@pytest.mark.slow
def test_the_126m_default_on_two_gloo_processes_equals_one(data_cfg, tmp_path, free_port):
    """Every part and setting the 126m default adopted (at a CPU's size) trains the same on 2 ranks as on 1."""
    path = cpu_sized_preset("126m", data_cfg, tmp_path / "c.toml")
    assert_two_ranks_equal_one(["--config", str(path), "--runs-dir", str(tmp_path), "--device", "cpu"], tmp_path,
                               free_port, steps=3)


def assert_two_ranks_equal_one(common: list, tmp_path: Path, free_port: int, steps: int):
    """train.py with `common` run twice at once, as one process and as torchrun's 2 CPU ranks: the same weights
    after `steps` steps and the same losses on the way."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Both runs at once: each process uses one thread, so the one-process run takes the core the launcher leaves.
    running = [subprocess.Popen([sys.executable, *launcher, str(ROOT / "train.py"), *common, "--name", name], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
               for launcher, name in (([], "one"), (["-m", "torch.distributed.run", "--nproc_per_node=2",
                                                     f"--master_port={free_port}"], "two"))]
    for process in running:
        out, err = process.communicate()
        assert process.returncode == 0, out[-3000:] + err[-3000:]
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    lookups = ("embed.weight", "bigram.weight", "value_embeds.")
    for k in one:
        if not k.startswith(lookups):  # every matrix and scalar stays close
            torch.testing.assert_close(one[k], two[k], rtol=1e-4, atol=1e-5)
            continue
        # Adam steps an entry of a rarely seen table row by about its lr whatever its gradient's size, so an entry
        # whose gradient is the ranks' summation noise may step either way (one of a value table's 32,768 entries,
        # by 5.5e-3, at the 126m default's 11 blocks); a wrong sum would move every row the batch saw
        apart = (one[k] - two[k]).abs()
        assert (apart > 5e-4).sum() <= max(1, apart.numel() // 1000) and apart.max() < 0.05, (k, apart.max())
    for a, b in zip(losses(tmp_path / "one"), losses(tmp_path / "two")):
        assert a == pytest.approx(b, rel=1e-5)
    assert len(losses(tmp_path / "two")) == steps


def test_a_warm_up_longer_than_half_the_run_is_shortened_and_said(train_config, tmp_path):
    said = []
    cfg = with_train(train_config, steps=4, warmup_steps=4, schedule="wsd", warmdown_fraction=0.5, min_lr_ratio=0.0)
    r = TR.setup(cfg, log=said.append)
    assert r.cfg.train.warmup_steps == 2
    assert any("train.warmup_steps=4 would warm up over more than half of the run's 4 steps" in line for line in said)
    TR.train(cfg, tmp_path / "run", **QUIET)
    lrs = [row["lr"] for row in PL.read_log(tmp_path / "run" / "log.jsonl") if "loss" in row]
    assert lrs[-1] < max(lrs)  # it warmed down


# --- Starting from a trained model (train.init_from) ------------------------------------------

@pytest.fixture(scope="module")
def trained(data_cfg, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    TR.train(tiny_run_config(data_cfg, steps=6), runs / "a", **QUIET)
    return runs / "a"


def new_run(trained, tmp_path, *flags):
    TR.main(["--init-from", str(trained), "--corpus", "stdlib", "--max-documents", "40", "--steps", "2",
             "--eval-every", "2", "--runs-dir", str(tmp_path), "--name", "b", "--sample-tokens", "0", *flags])
    return tmp_path / "b"


def test_init_from_continues_a_trained_model_on_another_corpus_with_its_tokenizer(trained, tmp_path, capsys):
    run = new_run(trained, tmp_path)
    out = capsys.readouterr().out
    src = TR.CK.load(trained)
    assert f"init-from: stdlib is tokenized with {src.path}'s tokenizer ({src.tokenizer_hash})" in out
    assert f"weights: from {src.path} (its step 6)" in out
    saved = json.loads((run / "config.json").read_text())["config"]
    assert saved["train"]["init_from"] == str(src.path) and saved["model"] == dataclasses.asdict(src.config.model)
    assert saved["data"]["corpus"] == "stdlib" and TR.CK.load(run).tokenizer_hash == src.tokenizer_hash
    first = [r for r in PL.read_log(run / "log.jsonl") if "loss" in r][0]["loss"]
    # a new model starts at ln(vocab) (its head is zero); six steps on the test corpus carry over to code
    assert first < math.log(src.config.model.vocab_size) - 0.2
    assert "ln(vocab)" not in out  # no step-0 warning for a model that starts trained


def test_init_from_refuses_another_model_value_or_tokenizer_in_one_line(trained, tmp_path, data_cfg):
    with pytest.raises(SystemExit, match=r"^error: --init-from .*ckpt.pt: model.n_layers is 3 here but 2 in the "
                                         r"checkpoint, whose weights fix the model"):
        new_run(trained, tmp_path, "--n-layers", "3")
    other = tmp_path / "other.json"
    other.write_text(tokenizer_file_of(trained).read_text() + " ")  # the same tokenizer, another hash
    with pytest.raises(SystemExit, match=r"^error: data.tokenizer_file=.* has hash .* but .* was trained with tokenizer"):
        new_run(trained, tmp_path, "--tokenizer-file", str(other))


def test_init_from_a_run_that_tied_its_head_starts_them_apart(data_cfg, tmp_path, capsys):
    """A run trained with train.untie_at (the 126m default's) is a start for a new run, which does not tie trained
    weights again: untie_at 0, said in one line; asking for it by flag is refused by the config's own check."""
    cfg = tiny_run_config(data_cfg, tiny_model_cfg(tie_embeddings=False), steps=2, eval_every=2, ckpt_every=2,
                          untie_at=0.5)
    TR.train(cfg, tmp_path / "a", **QUIET)
    run = new_run(tmp_path / "a", tmp_path)
    assert "init-from: the head and the embedding start apart" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["config"]["train"]["untie_at"] == 0.0
    with pytest.raises(SystemExit, match=r"train.untie_at=0.5 starts the head and the embedding as one matrix"):
        new_run(tmp_path / "a", tmp_path / "c", "--untie-at", "0.5")


def tokenizer_file_of(run):
    ckpt = TR.CK.load(run)
    return TR.D.data_dir(ckpt.config.data, ckpt.config.model.vocab_size) / "tokenizer.json"


def val_split(data_cfg):
    """The tiny corpus' validation shards and each token's UTF-8 length, as evaluate takes them."""
    import data as D
    import tokenizer as tk
    from conftest import VOCAB
    folder = D.data_dir(data_cfg, VOCAB)
    token_bytes = torch.tensor(tk.token_byte_lengths(tk.load_tokenizer(folder / "tokenizer.json")), dtype=torch.float32)
    return D.shard_files(folder, "val"), token_bytes


def test_whole_window_evaluation_equals_the_loss_of_one_long_sequence(data_cfg):
    """One layer with a window of 12 keys: a target's loss depends on its window alone, so the whole-window
    evaluation (a loader with stride T - 12) equals the loss over one sequence of all the targets, where the
    plain evaluation of 32-token windows cuts each window's first targets short."""
    import data as D
    from conftest import tiny_model_cfg
    T, W, B, n = 32, 12, 2, 6
    files, token_bytes = val_split(data_cfg)
    cfg = C.TrainConfig(steps=1, device="cpu", bf16=False)
    torch.manual_seed(0)
    model = M.Llama(tiny_model_cfg(n_layers=1, context=T, attn_window=W)).double()
    long = M.Llama(tiny_model_cfg(n_layers=1, context=n * T, attn_window=W)).double()
    long.load_state_dict(model.state_dict())
    tokens = torch.from_numpy(D.ShardLoader(files, 1, n * T, shuffle=False).shards[0][0][:n * T + 1].astype("int64"))
    want = long(tokens[None, :-1], tokens[None, 1:]).item()
    device = torch.device("cpu")
    whole = D.ShardLoader(files, B, T, shuffle=False, stride=T - W)
    got = TR.evaluate(model, whole, n, token_bytes, cfg, device, (W, 0))  # the targets of the first n plain windows
    plain = TR.evaluate(model, D.ShardLoader(files, B, T, shuffle=False), n, token_bytes, cfg, device, (W, 0))
    assert got["val_loss"] == pytest.approx(want, rel=1e-6)  # evaluate takes the loss of float32 logits
    assert abs(plain["val_loss"] - want) > 1e-4  # the cut windows differ
    assert got["val_bpb"] == pytest.approx(want / math.log(2) * n * T / token_bytes[tokens[1:]].sum().item(), rel=1e-6)


def test_evaluation_scores_the_same_windows_at_any_micro_batch(data_cfg):
    """n windows are n windows whether micro-batches of 1, 2 or 3 read them: the last batch's rows past the
    n-th are not scored (eval_tokens over a micro-batch that does not divide it once dropped the rest)."""
    import data as D
    from conftest import tiny_model_cfg
    T, n = 32, 5
    files, token_bytes = val_split(data_cfg)
    cfg, device = C.TrainConfig(steps=1, device="cpu", bf16=False), torch.device("cpu")
    torch.manual_seed(0)
    model = M.Llama(tiny_model_cfg(n_layers=1, context=T)).double()
    found = [TR.evaluate(model, D.ShardLoader(files, B, T, shuffle=False), n, token_bytes, cfg, device) for B in (1, 2, 3)]
    tokens = torch.from_numpy(D.ShardLoader(files, 1, T, shuffle=False).shards[0][0][:n * T + 1].astype("int64"))
    x, y = tokens[:-1].view(n, T), tokens[1:].view(n, T)
    want = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()
    for f in found:
        assert f["val_loss"] == pytest.approx(want, rel=1e-6)


def test_every_train_command_in_the_readme_loads_and_its_batch_divides():
    """A README line `python train.py --config ...` (or torchrun's) is a config that loads with its flags and a
    micro-batch that divides its batch, on as many processes as it asks for: the examples run as written."""
    import re
    import shlex
    lines = [line.split("#")[0] for line in (ROOT / "README.md").read_text().splitlines()
             if re.match(r"(python|torchrun .*) train\.py --config", line)]
    assert len(lines) >= 5
    for line in lines:
        words = shlex.split(line)
        world = int(next((w.split("=")[1] for w in words if w.startswith("--nproc_per_node=")), 1))
        argv = [w for w in words[words.index("train.py") + 1:] if w != "--resume"]
        cfg, _ = TR.resolve_config(TR.build_parser().parse_args(argv))
        assert TR.accumulation_steps(cfg.train.batch_tokens, cfg.train.micro_batch, cfg.model.context, world), line


# --- The small functions a run is sized and reported by ---------------------------------------

def test_run_length_in_steps_from_steps_or_tokens():
    assert SZ.total_steps(C.TrainConfig(steps=7, tokens=10**9)) == 7  # steps win over tokens
    assert SZ.total_steps(C.TrainConfig(tokens=10 * 524_288 + 5)) == 10  # whole steps of batch_tokens
    assert SZ.total_steps(C.TrainConfig(tokens=1000)) == 1  # fewer tokens than one step still takes one
    assert SZ.total_steps(C.TrainConfig(tokens=0, seconds=60, schedule="wsd")) == SZ.UNSIZED  # train.seconds sizes it later


def test_a_growing_batch_takes_equal_shares_of_the_steps_and_counts_its_tokens():
    """batch_stages: stage i of n trains on i/n of batch_tokens over an equal share of the steps, the run's tokens
    are their sum, a token budget is the most steps that fit it, and sizing counts each step at its share."""
    cfg = C.TrainConfig(batch_tokens=300, micro_batch=1, batch_stages=3, steps=9)
    assert [SZ.batch_stage(s, 9, 3) for s in range(9)] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [SZ.step_tokens(cfg, s, 9) for s in (0, 3, 8)] == [100, 200, 300] and SZ.run_tokens(cfg, 9) == 1800
    assert SZ.batch_stage(5, SZ.UNSIZED, 3) == 1 and SZ.batch_stage(5, 9, 1) == 1  # an unsized run probes at stage 1
    assert SZ.total_steps(dataclasses.replace(cfg, steps=0, tokens=1800)) == 9
    assert SZ.total_steps(dataclasses.replace(cfg, steps=0, tokens=1799)) == 8  # 8 steps: 3 x 100 + 3 x 200 + 2 x 300
    # a whole batch takes 1 s: 9 steps at shares 1/3, 2/3, 1 take 6 s, and 7 s fit 10 (with 0 + 1 + 2 + 2.67 + ...)
    share = lambda step, steps: SZ.step_tokens(cfg, step, steps) / cfg.batch_tokens
    assert SZ.steps_to_fill(6.0, 0, lambda w: 1.0, lambda s, n: 0, share) == 9


def test_the_growing_batch_draws_its_stages_micro_batches_at_sqrt_stage_times_the_rate(train_config, tmp_path):
    """Over 6 steps of batch_stages 2: 1 micro-batch of 4 x 64 tokens a step, then 2; the log's tokens and rate
    follow; micro-batches that do not divide into the stages are refused in one line, naming a micro-batch that does."""
    cfg = with_train(train_config, batch_stages=2, warmup_steps=0, schedule="wsd", warmdown_fraction=0.5)
    TR.train(cfg, tmp_path / "run", **QUIET)
    rows = [r for r in PL.read_log(tmp_path / "run" / "log.jsonl") if "loss" in r]
    assert [r["tokens"] for r in rows] == [256, 512, 768, 1280, 1792, 2304]
    assert [r["lr"] for r in rows][2:4] == pytest.approx([3e-3, 3e-3 * math.sqrt(2)])  # the warm-down starts at 3
    with pytest.raises(ValueError, match=r"^train.batch_stages=2 grows the batch in whole micro-batches, but a step's "
                                         r"micro-batches \(1 of 8 x 64 tokens a rank\) do not divide into 2: use --micro-batch 4$"):
        TR.train(with_train(train_config, batch_stages=2, micro_batch=8), tmp_path / "bad", **QUIET)


@pytest.mark.parametrize("fp16, bf16, dtype", [(False, True, torch.bfloat16), (True, False, torch.float16),
                                               (True, True, torch.float16), (False, False, torch.float32)])
def test_autocast_runs_matmuls_in_the_precision_asked_for(fp16, bf16, dtype):
    a = torch.randn(4, 8)
    with TR.autocast(C.TrainConfig(steps=1, fp16=fp16, bf16=bf16), torch.device("cpu")):
        assert (a @ a.T).dtype == dtype


def test_bf16_becomes_fp16_on_a_gpu_without_it_and_only_there(monkeypatch):
    said = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    cfg = C.TrainConfig(steps=1, bf16=True)
    turned = TR.half_precision(cfg, torch.device("cuda"), log=said.append)
    assert turned.fp16 and "Tesla T4 has no bf16 tensor cores: training in fp16" in said[0]
    assert TR.half_precision(cfg, torch.device("cpu"), log=said.append) == cfg and len(said) == 1  # CPU autocast has bf16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert TR.half_precision(cfg, torch.device("cuda"), log=said.append) == cfg and len(said) == 1


def test_mfu_is_each_ranks_share_of_the_named_peak():
    meter = TR.Meter(info={}, flops_tok=1_000_000, peak=100.0, peak_source="given", title="")
    assert meter.mfu(50_000_000, world=1) == pytest.approx(0.5)  # 5e13 FLOP/s of 100 TFLOP/s
    assert meter.mfu(50_000_000, world=2) == pytest.approx(0.25)
    assert dataclasses.replace(meter, peak=None).mfu(50_000_000, world=1) is None


def test_peak_memory_on_a_cpu_is_the_process_peak_in_gib():
    assert 0.01 < TR.peak_memory_gib(torch.device("cpu")) < 64  # this test process: a few hundred MiB to a few GiB


def test_a_warm_up_that_fits_is_kept_without_a_note(train_config):
    said = []
    r = TR.setup(with_train(train_config, steps=6, warmup_steps=3), log=said.append)
    assert r.cfg.train.warmup_steps == 3 and not any("warmup_steps" in s for s in said)
    r = TR.setup(with_train(train_config, steps=6, warmup_steps=5), log=said.append)
    assert r.cfg.train.warmup_steps < 5 and any("train.warmup_steps=5 would warm up" in s for s in said)


def test_skipping_non_finite_steps_under_fp16_skips_none_of_a_healthy_run(train_config, tmp_path):
    """Under fp16 the scaler, not the gradient norm, decides on a finite gradient: a healthy run skips nothing."""
    summary = TR.train(with_train(train_config, fp16=True, skip_nonfinite=True), tmp_path / "run", **QUIET)
    assert summary["skipped"] == 0 and summary["steps"] == 6


@pytest.mark.parametrize("first, then", [({"bf16": True}, {"fp16": True}), ({"fp16": True}, {"bf16": True})],
                         ids=["bf16-then-fp16", "fp16-then-bf16"])
def test_a_run_resumes_across_bf16_and_fp16_cards(train_config, tmp_path, first, then):
    """A run moved to a card without bf16 goes on in fp16 with a fresh loss scale, and back: the scaler's
    state loads only where both the checkpoint and this run have a scaler."""
    run = tmp_path / "run"
    with pytest.raises(TR.Interrupted):
        TR.train(with_train(train_config, **first), run, stop_after=3, **QUIET)
    summary = TR.train(with_train(train_config, **then), run, resume=True, **QUIET)
    assert summary["steps"] == 6 and math.isfinite(summary["val_loss"])


def test_the_run_header_says_what_runs(train_config, tmp_path):
    said = []
    cfg = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, skip_attn_layer=1,
                                                                        tie_embeddings=False))
    cfg = with_train(cfg, fp16=True, muon=True, lr=0.01, muon_lr=0.02, embed_lr=0.05, head_lr=0.002, scalar_lr=0.04,
                     muon_momentum_warmup=5)
    TR.announce(TR.setup(cfg, log=said.append), tmp_path, said.append)
    assert "model parts: no attention in layer 1" in said
    assert ("optimizer: Muon + AdamW (peak lr by group: matrices 0.02, embed 0.05, head 0.002, scalars 0.04, "
            "momentum 0.85 -> 0.95 over 5 steps), cosine schedule, clipping 1.0") in said
    assert any(s.startswith("batch: 512 tokens = 4 seq x 64 tokens x 2 accumulation x 1 rank(s); 6 steps = 3,072 "
                            "tokens") for s in said)
    assert any(s.startswith("flags: tf32=False bf16=False fp16=True (gradient scaler) compile=False") for s in said)
    said.clear()
    meter = TR.announce(TR.setup(with_train(train_config, peak_tflops=100.0), log=said.append), tmp_path, said.append)
    assert not any(s.startswith("model parts") for s in said)  # the plain model has none of them
    assert any(s.startswith("optimizer: AdamW (peak lr by group: matrices 0.003, ") for s in said)
    assert any(s.startswith("flags: tf32=False bf16=False fp16=False compile=False") for s in said)
    assert meter.peak == 100.0 and meter.peak_name == "100 TFLOP/s given"  # MFU against --peak-tflops, on any device
    said.clear()
    newest = dataclasses.replace(train_config, model=dataclasses.replace(
        train_config.model, bigram_rows=100, bigram_signs=True, backout=True, smear=True, key_offset=True,
        rope_truncate=True, value_embeds=1, value_gate=True))
    TR.announce(TR.setup(with_train(newest, batch_stages=2, mtp_tokens=3, adam_weight_decay=0.005), log=said.append),
                tmp_path, said.append)
    assert any(", AdamW's embeddings and head decayed cautiously (0.005 x lr^2 by role)), cosine schedule" in s
               for s in said)
    assert ("model parts: 1 value embeddings, truncated RoPE, signed bigram table of 100 rows, backout of layer 0, smear, key "
            "offset on the long layers, value-embedding gates") in said
    assert ("batch: 512 tokens = 4 seq x 64 tokens x 2 accumulation x 1 rank(s), grown over 2 stages; 6 steps = 2,304 "
            "tokens; the loss over the next 3 tokens, fading to the next one's") in said


def test_the_validation_loaders_read_the_split_in_order(train_config, monkeypatch):
    """Evaluation scores the val split's first windows, the same ones at every evaluation and in
    evaluate.py: its loaders never shuffle, the whole-window one stepping by context - window, and the
    plain one (here 32 tokens stand for 1,024) reading plain windows without document ids."""
    monkeypatch.setattr(TR, "PLAIN_CONTEXT", 32)
    cfg = dataclasses.replace(train_config, model=dataclasses.replace(train_config.model, attn_window=48))
    r = TR.setup(with_train(cfg, doc_mask=True), **QUIET)
    T = cfg.model.context
    for loader, stride, length, parts in ((r.val_loader, T, T, 3), (r.whole_val_loader, T - 48, T, 3),
                                          (r.plain_val_loader, 32, 32, 2)):
        batch = loader.next_batch()
        x = batch[0]
        tokens = torch.from_numpy(np.asarray(loader.shards[0][0][:stride * len(x) + length], dtype=np.int64))
        assert len(batch) == parts and x.shape[1] == length
        assert all(torch.equal(row, tokens[i * stride:i * stride + length]) for i, row in enumerate(x))


def test_an_evaluation_draws_only_the_batches_it_scores(train_config):
    r = TR.setup(train_config, **QUIET)
    loader, drawn = r.val_loader, []
    assert len(loader) > 1, "the test's val split must hold more than one batch"
    draw = loader.next_batch
    loader.next_batch = lambda: drawn.append(1) or draw()
    found = TR.evaluate(r.model, loader, 1, torch.ones(train_config.model.vocab_size), train_config.train, r.device)
    assert len(drawn) == 1 and math.isfinite(found["val_loss"])  # one window: one batch, not the whole split


def test_seconds_alone_wins_over_the_presets_steps_and_says_so():
    """`--seconds 70` on a preset that sets train.tokens (or steps) trains for 70 seconds, with one line saying
    so, where it once trained the preset's length without a word; --steps beside it is the file's pair again."""
    said = []
    args = TR.build_parser([]).parse_args(["--config", str(ROOT / "configs" / "126m.toml"), "--seconds", "70"])
    cfg, _ = TR.resolve_config(args, log=said.append)
    assert (cfg.train.seconds, cfg.train.steps, cfg.train.tokens) == (70.0, 0, 0)
    assert said == [f"note: --seconds 70 sizes the run, in place of {ROOT / 'configs' / '126m.toml'}'s train.tokens = "
                    f"{C.preset('126m').train.tokens:,}"]
    args = TR.build_parser([]).parse_args(["--config", str(ROOT / "configs" / "126m.toml"), "--seconds", "70",
                                           "--steps", "5"])
    cfg, _ = TR.resolve_config(args, log=said.append)
    assert (cfg.train.seconds, cfg.train.steps) == (70.0, 5) and len(said) == 1
