"""What a user can rely on when things go wrong: every bad input is one line naming the file and
a non-zero exit with nothing else touched; interrupted and finished runs lose nothing."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import checkpoint as CK
import config as C
import data as D
import export as E
import plots as PL
import sample as S
import train as TR
from conftest import DEFAULT_PRESET_CASES, cpu_sized_preset, tiny_run_config, with_train

QUIET = dict(log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def finished(data_cfg, tmp_path_factory):
    """A finished 4-step run of the tiny test model, its config written as a TOML file."""
    cfg = tiny_run_config(data_cfg, steps=4, eval_every=2, ckpt_every=2)
    runs = tmp_path_factory.mktemp("runs")
    TR.train(cfg, runs / "run", **QUIET)
    return cfg, runs / "run"


def snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def one_line_error(excinfo, names: str):
    message = str(excinfo.value.code)
    assert message.startswith("error: ") and "\n" not in message and names in message, message
    assert "Traceback" not in message


# --- Bad inputs: one line naming the file, non-zero exit, nothing touched ------------------

@pytest.mark.parametrize("content", [b"[model\nd_model = 64", b"\x89PNG\r\n\x1a\n\x00\x00", b"[train]\nsteps = -3\n"],
                         ids=["truncated", "not-utf8", "out-of-range"])
def test_bad_config_file(tmp_path, content):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        TR.main(["--config", str(path), "--runs-dir", str(tmp_path / "runs")])
    one_line_error(e, "bad.toml")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated zip", b"not a checkpoint at all"],
                         ids=["empty", "truncated", "wrong-kind"])
@pytest.mark.parametrize("script", ["sample", "export"])
def test_bad_checkpoint_file(tmp_path, content, script):
    (tmp_path / "ckpt.pt").write_bytes(content)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        if script == "sample":
            S.main(["--ckpt", str(tmp_path), "--prompt", "a", "--max-new-tokens", "2"])
        else:
            E.main(["--ckpt", str(tmp_path), "--out", str(tmp_path / "hf")])
    one_line_error(e, "ckpt.pt")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name, content", [("a.jsonl", b'{"text": "ok"}\n{not json\n'), ("a.txt", b"")],
                         ids=["malformed-jsonl", "empty-txt"])
def test_bad_corpus_file(tmp_path, name, content):
    import data as D
    (tmp_path / name).write_bytes(content)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        D.main(["prepare", "--corpus", str(tmp_path / name), "--cache-dir", str(tmp_path / "cache")])
    one_line_error(e, name)
    assert snapshot(tmp_path) == before  # no cache folder, tokenizer or shard left behind


def test_bad_tokenizer_file(finished, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "truncated')
    before = snapshot(tmp_path), snapshot(finished[1])
    with pytest.raises(SystemExit) as e:
        S.main(["--ckpt", str(finished[1]), "--tokenizer", str(tmp_path / "tokenizer.json"), "--prompt", "a"])
    one_line_error(e, "tokenizer.json")
    assert (snapshot(tmp_path), snapshot(finished[1])) == before


def test_stdin_that_is_not_text(finished, monkeypatch):
    import io
    import sys

    class Stdin(io.TextIOWrapper):
        def isatty(self):
            return False
    monkeypatch.setattr(sys, "stdin", Stdin(io.BytesIO(b"\xff\xfe\x00binary")))
    before = snapshot(finished[1])
    with pytest.raises(SystemExit) as e:
        S.main(["--ckpt", str(finished[1]), "--max-new-tokens", "2"])
    one_line_error(e, "stdin is not UTF-8")
    assert snapshot(finished[1]) == before


def test_device_cuda_without_a_gpu(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as e:
        TR.main(["--device", "cuda", "--runs-dir", str(tmp_path)])
    one_line_error(e, "CUDA is not available on this machine: use auto or cpu")
    assert not any(tmp_path.iterdir())


def test_unwritable_runs_folder(finished, tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(toml_of(finished[0]))
    with pytest.raises(SystemExit) as e:
        TR.main(["--config", str(cfg_path), "--runs-dir", str(tmp_path / "file")])
    one_line_error(e, "file")


def test_run_name_cannot_leave_the_runs_folder(tmp_path):
    with pytest.raises(SystemExit) as e:
        TR.main(["--name", "../../x", "--runs-dir", str(tmp_path / "runs")])
    one_line_error(e, "--name '../../x': a run name is one folder name")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", ".hidden"])
def test_a_run_name_is_one_plain_folder_name(name):
    with pytest.raises(ValueError, match=re.escape(f"--name {name!r}: a run name is one folder name")):
        TR.check_run_name(name)


def toml_of(cfg: C.Config) -> str:
    lines = []
    for section, values in cfg.to_dict().items():
        lines += [f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


# --- Results are never lost ----------------------------------------------------------------

def test_resume_of_a_finished_run_keeps_its_summary(finished):
    cfg, run = finished
    summary = json.loads((run / "summary.json").read_text())
    said = []
    again = TR.train(cfg, run, resume=True, log=said.append)
    assert again == summary and "val_loss" in summary and "already finished at step 4" in said[0]
    assert json.loads((run / "summary.json").read_text()) == summary


def test_a_run_stopped_between_its_last_checkpoint_and_its_summary_resumes_to_the_summary(finished, tmp_path):
    """The last step's checkpoint is on disk, the summary is not (the process was killed between the two,
    say while it plotted its losses; the summary is written before the closing sample): resume trains no
    step and writes the summary the run would have, its last validation figures taken from the log."""
    cfg, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "summary.json").unlink()
    summary = TR.train(cfg, copy, resume=True, **QUIET)
    validation = lambda s: {k: v for k, v in s.items() if k.startswith("val_")}  # noqa: E731
    assert summary["steps"] == 4 and CK.load(copy).step == 4 and summary["val_loss"]
    assert validation(summary) == validation(json.loads((run / "summary.json").read_text()))
    assert json.loads((copy / "summary.json").read_text()) == summary


def test_a_run_folder_is_started_over_only_when_asked(finished, tmp_path):
    cfg, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = snapshot(copy)
    with pytest.raises(ValueError, match="already holds a checkpoint: pass --resume to continue it, --overwrite"):
        TR.train(cfg, copy, **QUIET)
    assert snapshot(copy) == before
    summary = TR.train(with_train(cfg, steps=2), copy, overwrite=True, **QUIET)
    assert summary["steps"] == 2 and CK.load(copy).step == 2
    assert max(json.loads(line)["step"] for line in (copy / "log.jsonl").read_text().splitlines()) == 2


def test_a_new_run_makes_its_runs_folder(finished, tmp_path):
    cfg = finished[0]
    TR.train(with_train(cfg, steps=1), tmp_path / "new" / "runs" / "a", **QUIET)
    assert CK.load(tmp_path / "new" / "runs" / "a").step == 1


def test_a_run_ends_with_a_sample_that_continues_its_prompt(finished, tmp_path):
    cfg = finished[0]
    said = []
    TR.train(with_train(cfg, steps=1, sample_tokens=5, sample_prompt="Once upon"), tmp_path / "run", log=said.append)
    sample = said[-1]
    assert sample.startswith("sample:\nOnce upon") and len(sample) > len("sample:\nOnce upon")


def test_export_never_writes_into_a_run_or_a_full_folder(finished, tmp_path):
    run = finished[1]
    before = snapshot(run)
    with pytest.raises(SystemExit) as e:
        E.main(["--ckpt", str(run), "--out", str(run)])
    one_line_error(e, "is a training run's folder")
    assert snapshot(run) == before
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as e:
        E.main(["--ckpt", str(run), "--out", str(tmp_path / "hf")])
    one_line_error(e, "is not empty")
    E.main(["--ckpt", str(run), "--out", str(tmp_path / "hf"), "--force"])
    assert (tmp_path / "hf" / "mine.txt").read_text() == "keep me" and (tmp_path / "hf" / "config.json").exists()


def test_log_has_each_step_once_after_a_crash_and_resume(finished, tmp_path, monkeypatch):
    cfg = finished[0]
    run = tmp_path / "run"
    real, calls = TR.forward_loss, {"n": 0}

    def crash_in_step_3(*args):
        calls["n"] += 1
        if calls["n"] == 7:  # step 3's first micro-batch: steps 0-2 were logged, the checkpoint is at 2
            raise RuntimeError("the machine went away")
        return real(*args)
    monkeypatch.setattr(TR, "forward_loss", crash_in_step_3)
    with pytest.raises(RuntimeError):
        TR.train(cfg, run, **QUIET)
    monkeypatch.undo()
    TR.train(cfg, run, resume=True, **QUIET)
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert (run / "loss.png").stat().st_size > 1000


def test_a_run_killed_in_its_last_evaluation_keeps_its_training_and_a_resume_evaluates_it(finished, tmp_path,
                                                                                          monkeypatch):
    """A run stopped hard inside its final evaluation (a scheduler's second signal, a kill) has saved its last step
    first: --resume trains nothing, runs the evaluation it owes and reports its losses, those of the run never
    stopped."""
    cfg, run = finished[0], tmp_path / "run"
    real = TR.evaluate

    def killed_at_the_end(*args, **kwargs):
        if CK.load(run).step == 4:
            raise RuntimeError("killed")
        return real(*args, **kwargs)
    monkeypatch.setattr(TR, "evaluate", killed_at_the_end)
    with pytest.raises(RuntimeError):
        TR.train(cfg, run, **QUIET)
    monkeypatch.undo()
    assert CK.load(run).step == 4 and not TR.logged_eval(run / "log.jsonl", 4)
    TR.train(cfg, run, resume=True, **QUIET)
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert TR.logged_eval(run / "log.jsonl", 4) == TR.logged_eval(finished[1] / "log.jsonl", 4) != {}
    assert json.loads((run / "summary.json").read_text())["val_loss"] == pytest.approx(
        json.loads((finished[1] / "summary.json").read_text())["val_loss"])


def toml_config(cfg: C.Config, path: Path) -> Path:
    path.write_text(toml_of(cfg))
    return path


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("phase, first, kept", [("save", 3, 2), ("evaluation", 4, 4), ("plot", 3, 3)])
def test_a_second_ctrl_c_while_the_run_stops_exits_130_in_one_line(finished, tmp_path, monkeypatch, capsys, phase,
                                                                    first, kept):
    """The first Ctrl-C arrives during step `first` (checkpoints every 2 steps); the second during
    the stop's save, the evaluation at step 4 (after step 4's checkpoint, which is kept), or the plot, each made
    slow enough to hit by sending the signal from inside it."""
    cfg = with_train(finished[0], steps=6)
    real_step, real_save, real_plot, real_eval = TR.train_step, CK.save, PL.plot_losses, TR.evaluate
    steps = []

    def step(*a, **k):
        steps.append(1)
        if len(steps) == first:
            ctrl_c()
        return real_step(*a, **k)

    def second(real, when=lambda *a, **k: True):
        def slow(*a, **k):
            if len(steps) >= first and when(*a, **k):
                ctrl_c()
            return real(*a, **k)
        return slow

    monkeypatch.setattr(TR, "train_step", step)
    monkeypatch.setattr(TR.CK, "save", second(real_save, lambda path, **k: k["step"] > 2) if phase == "save"
                        else real_save)
    monkeypatch.setattr(TR, "evaluate", second(real_eval) if phase == "evaluation" else real_eval)
    monkeypatch.setattr(PL, "plot_losses", second(real_plot) if phase == "plot" else real_plot)
    with pytest.raises(SystemExit) as e:
        TR.main(["--config", str(toml_config(cfg, tmp_path / "c.toml")), "--runs-dir", str(tmp_path), "--name", "r"])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err
    assert "SIGINT again: stopped at once; the last complete checkpoint is kept" in err
    assert CK.load(tmp_path / "r").step == kept
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_through_a_pipe_whose_reader_went_away_still_saves_and_resumes_bitwise(finished, tmp_path, monkeypatch):
    """`python train.py ... | tee out`, then Ctrl-C: the terminal signals tee too, so every line written after it
    (the signal's note, the step's line) meets a closed pipe. The run still saves after the step in flight, exits
    130, and --resume finishes it with the losses of a run never stopped."""
    import io

    class Pipe(io.StringIO):  # a pipe whose reader exits at the Ctrl-C
        gone = False

        def write(self, text):
            if self.gone:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

        def flush(self):
            if self.gone:
                raise BrokenPipeError(32, "Broken pipe")

    cfg_path = toml_config(with_train(finished[0], steps=6), tmp_path / "c.toml")
    TR.main(["--config", str(cfg_path), "--runs-dir", str(tmp_path), "--name", "straight"])
    pipe, real_step, steps = Pipe(), TR.train_step, []

    def step(*a, **k):
        steps.append(1)
        if len(steps) == 3:
            pipe.gone = True
            ctrl_c()
        return real_step(*a, **k)
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", pipe)
        m.setattr(sys, "stderr", pipe)
        m.setattr(TR, "train_step", step)
        with pytest.raises(SystemExit) as e:
            TR.main(["--config", str(cfg_path), "--runs-dir", str(tmp_path), "--name", "r"])
    assert e.value.code == 130 and CK.load(tmp_path / "r").step == 3
    TR.main(["--config", str(cfg_path), "--runs-dir", str(tmp_path), "--name", "r", "--resume"])
    losses = [[row["loss"] for row in PL.read_log(tmp_path / name / "log.jsonl") if "loss" in row]
              for name in ("straight", "r")]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_a_quick_second_ctrl_c_inside_a_long_cpu_call_quits_at_once(tmp_path):
    """Two Ctrl-Cs 0.3 s apart while the main thread is inside one long C++ call (a matrix power of
    20 products of 4,000 x 4,000, about 20 s on a 2-core CPU): Python would run its handler once, after the call; the run quits within
    Stopper.SECOND_GRACE of the second instead, in one line and with exit code 130."""
    script = tmp_path / "long_call.py"
    script.write_text(
        "import os, signal, sys, threading, time\n"
        f"sys.path.insert(0, {str(TR.ROOT)!r})\n"
        "import torch, train\n"
        "stopper = train.Stopper(lambda s: print(s, flush=True))\n"
        "def twice():\n"
        "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGINT); time.sleep(0.3); os.kill(os.getpid(), signal.SIGINT)\n"
        "threading.Thread(target=twice, daemon=True).start()\n"
        "torch.linalg.matrix_power(torch.zeros(4000, 4000, dtype=torch.float64), 2**20)\n"  # 20 products
        "print('the long call finished', flush=True)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130 and "the long call finished" not in done.stdout, done.stdout + done.stderr
    assert "SIGINT: saving a checkpoint after the current step" in done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith("SIGINT again: stopped at once")
    assert time.monotonic() - started < 20  # the import and the signals; the matrix power takes longer


def test_ctrl_c_during_the_final_sample_or_prepare_exits_130_in_one_line(finished, tmp_path, monkeypatch, capsys):
    cfg = with_train(finished[0], sample_tokens=5)
    monkeypatch.setattr(TR, "sample_text", lambda *a: ctrl_c())
    with pytest.raises(SystemExit) as e:
        TR.main(["--config", str(toml_config(cfg, tmp_path / "c.toml")), "--runs-dir", str(tmp_path), "--name", "r"])
    assert e.value.code == 130 and "SIGINT: stopped at once" in capsys.readouterr().err
    assert (tmp_path / "r" / "summary.json").exists()  # the run had finished: everything is saved

    def slow_tokenizer(*a, **k):
        ctrl_c()
    monkeypatch.setattr(D.tk, "train_tokenizer", slow_tokenizer)
    with pytest.raises(SystemExit) as e:
        D.main(["prepare", "--corpus", finished[0].data.corpus, "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err and "SIGINT: stopped" in err


def test_a_run_stopped_as_planned_exits_zero_and_plots(finished, tmp_path, capsys):
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(toml_of(finished[0]))
    with pytest.raises(SystemExit) as e:
        TR.main(["--config", str(cfg_path), "--runs-dir", str(tmp_path), "--name", "r", "--stop-after", "1"])
    assert e.value.code == 0 and "--stop-after: saved" in capsys.readouterr().err  # a planned stop
    assert CK.load(tmp_path / "r").step == 1 and (tmp_path / "r" / "loss.png").exists()
    assert not (tmp_path / "r" / "summary.json").exists()


def test_the_same_command_plus_resume_continues_on_a_card_without_the_fp8_units_it_asks_for(finished, tmp_path, capsys):
    """The default presets ask for FP8 paths; a CPU (or an A100) runs the plain ones and says so. The config saved
    keeps what was asked, so the same command plus --resume continues, where it was refused while the speed
    switches were [model] keys saved as the device ran them."""
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(toml_of(finished[0]))
    command = ["--config", str(cfg_path), "--runs-dir", str(tmp_path), "--name", "r", "--no-tie-embeddings",
               "--fp8-head", "--fp8-fast-accum"]
    with pytest.raises(SystemExit) as e:
        TR.main(command + ["--stop-after", "1"])
    assert e.value.code == 0 and "note: --no-fp8-head, --no-fp8-fast-accum on CPU" in capsys.readouterr().out
    assert CK.load(tmp_path / "r").config.speed.fp8_head  # what was asked
    TR.main(command + ["--resume"])
    assert CK.load(tmp_path / "r").step == finished[0].train.steps


def test_a_run_folder_in_use_is_refused_and_a_stale_lock_taken_over(finished, tmp_path, capsys):
    """Two runs started with one name once both wrote one folder: the second is refused in one line while the
    first holds it; a lock whose process is gone (a killed run) is taken over, saying so, and released at the end."""
    import socket
    cfg_path = toml_config(finished[0], tmp_path / "c.toml")
    run = tmp_path / "r"
    run.mkdir()
    (run / TR.LOCK).write_text(f"{socket.gethostname()} {os.getpid()}")  # a live process: this one
    with pytest.raises(SystemExit) as e:
        TR.main(["--config", str(cfg_path), "--runs-dir", str(tmp_path), "--name", "r"])
    one_line_error(e, f"{run} is in use by process {os.getpid()} on {socket.gethostname()}: wait for that run to end")
    assert not (run / "ckpt.pt").exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run / TR.LOCK).write_text(f"{socket.gethostname()} {gone.pid}")
    TR.main(["--config", str(cfg_path), "--runs-dir", str(tmp_path), "--name", "r"])
    assert f"note: {run / TR.LOCK} was left by process {gone.pid}, which no longer runs" in capsys.readouterr().out
    assert (run / "summary.json").exists() and not (run / TR.LOCK).exists()


def test_a_gpu_sized_run_on_a_cpu_says_so_and_how_long_it_will_take(finished, tmp_path, monkeypatch, capsys):
    """A GPU preset on a CPU printed nothing for 24 minutes (its first step): the run says at its start that its
    steps are GPU-sized and points to tiny, and after its first timed step (the third: the first two may compile) how
    long the rest takes. (The thresholds are
    lowered here so the tiny test model crosses them.)"""
    said = []
    monkeypatch.setattr(TR, "CPU_STEP_FLOPS", 1.0)
    monkeypatch.setattr(TR, "PACE_NOTE_SECONDS", 0.0)
    TR.train(with_train(finished[0], steps=5), tmp_path / "r", log=said.append)
    assert any(line.startswith("note: each step of this config is") and "configs/tiny.toml" in line for line in said)
    paces = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: at ")]  # the loop's lines
    assert len(paces) == 1 and "tok/s the 2 steps left take about" in paces[0]


def test_a_second_ctrl_c_before_any_checkpoint_says_none_is_kept(tmp_path, capsys):
    """Quitting at once before the first checkpoint says so, where it claimed one was kept."""
    with pytest.raises(SystemExit) as e:
        TR.quit_at_once("SIGINT again", ckpt_path=tmp_path / "ckpt.pt")
    assert e.value.code == 130
    assert "SIGINT again: stopped at once; no checkpoint was written yet" in capsys.readouterr().err


def test_resume_cannot_change_the_model(finished, tmp_path):
    with pytest.raises(SystemExit) as e:
        TR.main(["--runs-dir", str(finished[1].parent), "--name", "run", "--resume", "--d-model", "128"])
    one_line_error(e, "model.d_model (checkpoint 64, asked 128)")


# --- Rough edges ---------------------------------------------------------------------------

def test_help_names_each_default_once(capsys):
    with pytest.raises(SystemExit):
        TR.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index("--name NAME run name")
    name_help = text[start:text.index("--runs-dir", start)]
    assert name_help.count("default") == 1


def test_one_name_and_one_default_per_setting(capsys):
    """data.py's commands take --vocab-size, defaulting to the config's model.vocab_size, as
    train.py does; bench's micro-batch study is --micro-batch-sweep, not --micro-batch."""
    import bench as B
    for command in ("prepare", "stats"):
        with pytest.raises(SystemExit):
            D.main([command, "--help"])
        text = capsys.readouterr().out
        assert "--vocab-size" in text and "--vocab " not in text and "model.vocab_size" in text
    with pytest.raises(SystemExit):
        B.main(["--help"])
    assert "--micro-batch-sweep" in capsys.readouterr().out


def test_sample_says_when_the_context_cuts_generation(finished, capsys):
    S.main(["--ckpt", str(finished[1]), "--prompt", "a", "--max-new-tokens", "100", "--temperature", "0"])
    err = capsys.readouterr().err
    assert "the context holds 64 tokens and the prompt uses 1, so at most 63 new tokens are generated" in err


def test_resumed_summary_counts_this_sessions_tokens_and_the_plot_has_a_title(finished, tmp_path, monkeypatch):
    cfg = finished[0]
    titles = []
    real_plot = PL.plot_losses
    monkeypatch.setattr(PL, "plot_losses", lambda log, out, title: (titles.append(title), real_plot(log, out, title)))
    with pytest.raises(TR.Interrupted):
        TR.train(cfg, tmp_path / "run", stop_after=2, **QUIET)
    said = []
    TR.train(cfg, tmp_path / "run", resume=True, log=said.append)
    done = next(s for s in said if s.startswith("done:"))
    assert done.startswith("done: step 4, 1,024 tokens in this session's")  # 2 steps of 512, not all 4
    assert titles and all(t.startswith("run | 64d x 2 layers | ") for t in titles)


def test_a_json_file_passed_as_a_checkpoint_is_not_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"config": {}}')
    with pytest.raises(CK.CheckpointError, match=r"config\.json: not a checkpoint \(it starts with b'\{\"co'"):
        CK.load(tmp_path / "config.json")


def test_the_small_validation_split_is_named_with_the_flags_that_help(tmp_path):
    import numpy as np
    path = tmp_path / "val_00000.bin"
    D.write_shard(path, np.arange(1, 600, dtype=np.uint16), np.array([0], np.uint64), 1024, "0" * 16, 600)
    with pytest.raises(ValueError, match=r"the validation split's 1 shard\(s\) hold 9 windows of 65 tokens, fewer "
                                         r"than --micro-batch 16 .* raise --val-fraction .*lower --micro-batch"):
        D.ShardLoader([path], 16, 64)


def test_a_validation_split_smaller_than_the_micro_batch_is_evaluated_in_smaller_batches(tmp_path):
    """A small corpus (154 source files) once failed by default because its validation split held fewer windows
    than the micro-batch: the run evaluates those windows, fewer at a time, and says so in one line."""
    import numpy as np
    path = tmp_path / "val_00000.bin"
    D.write_shard(path, np.arange(1, 600, dtype=np.uint16), np.array([0], np.uint64), 1024, "0" * 16, 600)
    said = []
    loader = TR.validation_loader([path], said.append, batch=16, seq_len=64, shuffle=False)
    assert loader.B == 9 and said == ["note: the validation split holds 9 window(s) of 65 tokens a rank, fewer than "
                                      "the micro-batch of 16: evaluating 9 at a time (a larger data.val_fraction "
                                      "evaluates on more)"]
    assert TR.validation_loader([path], said.append, batch=4, seq_len=64, shuffle=False).B == 4 and len(said) == 1


def test_mfu_names_the_peak_it_is_measured_against(finished, tmp_path):
    said = []
    cfg = with_train(finished[0], peak_tflops=2.0, steps=3)  # the third step is the first one timed
    TR.train(cfg, tmp_path / "r", log=said.append)
    assert any("MFU" in line and "of 2 TFLOP/s given" in line for line in said if line.startswith("done:"))


# --- Resume: the checkpoint's config is the base --------------------------------------------

def resume_args(finished, tmp_path, *extra):
    cfg, run = finished
    path = toml_config(cfg, tmp_path / "same.toml")
    return TR.build_parser().parse_args(["--runs-dir", str(run.parent), "--name", "run", "--resume", *extra]), path


def test_the_same_command_or_file_plus_resume_is_accepted(finished, tmp_path):
    cfg, run = finished
    said = []
    args, path = resume_args(finished, tmp_path, "--d-model", "64", "--n-layers", "2", "--corpus", cfg.data.corpus)
    resumed, ckpt = TR.resolve_config(args, run, log=said.append)
    assert resumed == cfg and ckpt.step == 4 and said == []
    args, _ = resume_args(finished, tmp_path, "--config", str(path))
    assert TR.resolve_config(args, run, log=said.append)[0] == cfg and said == []


def test_a_differing_model_or_data_value_is_refused_naming_both_values(finished, tmp_path):
    cfg, run = finished
    args, _ = resume_args(finished, tmp_path, "--d-model", "128", "--corpus", "stdlib")
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"data\.corpus \(checkpoint '.*\*\.txt', asked 'stdlib'\); model\.d_model "
                                         r"\(checkpoint 64, asked 128\): drop those flags"):
        TR.resolve_config(args, run)
    with pytest.raises(SystemExit):  # the same refusal through the command: the run folder is untouched
        TR.main(["--runs-dir", str(run.parent), "--name", "run", "--resume", "--d-model", "128"])
    assert snapshot(run) == before
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=3))
    args, _ = resume_args(finished, tmp_path, "--config", str(toml_config(other, tmp_path / "other.toml")))
    with pytest.raises(ValueError, match=r"model\.n_layers \(checkpoint 2, asked 3\)"):
        TR.resolve_config(args, run)


def test_a_changed_train_value_is_applied_and_reported(finished, tmp_path):
    cfg, run = finished
    said = []
    args, _ = resume_args(finished, tmp_path, "--lr", "0.001", "--steps", "8")
    resumed, ckpt = TR.resolve_config(args, run, log=said.append)
    assert resumed.train.lr == 0.001 and resumed.train.steps == 8 and ckpt.config == resumed
    assert said == ["resume: train.lr 0.003 -> 0.001",
                    "resume: train.steps 4 -> 8 (the learning-rate schedule stretches to the new length)"]


def test_help_shows_what_runs_with_no_flags(capsys):
    with pytest.raises(SystemExit):
        TR.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "width of the residual stream (default in configs/tiny.toml: 128)" in text  # not the dataclass's 768


def test_a_bad_flag_value_is_blamed_on_the_flag_not_the_file(tmp_path):
    with pytest.raises(SystemExit) as e:
        TR.main(["--lr", "-1", "--runs-dir", str(tmp_path)])
    one_line_error(e, "flags (--lr): train.lr=-1.0 is out of range")
    assert "tiny.toml" not in str(e.value.code)


def test_the_cpu_run_header_reports_what_runs(finished, tmp_path):
    said = []
    cfg = with_train(finished[0], steps=1)
    cfg = dataclasses.replace(cfg, speed=dataclasses.replace(cfg.speed, fused_swiglu=True, bf16_residual=True))
    assert cfg.speed.fused_swiglu  # asked for, but a GPU kernel, and the stream in bf16 needs bf16 autocast
    TR.train(cfg, tmp_path / "r", log=said.append)
    assert "swiglu 256 wide" in next(line for line in said if line.startswith("model: "))
    assert "speed: attention sdpa; fast paths swapped in: none (the plain model)" in said
    assert any(line.startswith("note: --no-fused-swiglu on CPU: Triton's kernels run on a GPU") for line in said)
    assert any(line.startswith("optimizer: AdamW (peak lr by group: matrices 0.003, head 0.003, scalars 0.003), "
                               "cosine schedule, clipping 1.0") for line in said)


def test_ctrl_c_while_train_prepares_its_data_exits_130_in_one_line(finished, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(TR.D, "prepare", lambda *a, **k: ctrl_c())
    with pytest.raises(SystemExit) as e:
        TR.main(["--config", str(toml_config(finished[0], tmp_path / "c.toml")), "--runs-dir", str(tmp_path),
                 "--name", "r"])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err and "SIGINT: stopped at once" in err


def test_the_config_is_printed_one_short_line_per_section(finished, tmp_path, capsys):
    cfg = with_train(finished[0], steps=1)
    TR.main(["--config", str(toml_config(cfg, tmp_path / "c.toml")), "--runs-dir", str(tmp_path), "--name", "r"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["[model]", "[data]", "[train]"]
    assert max(len(line) for line in lines[:3]) < 1500  # key=value for each field: [train] has about 85


def test_exported_models_stay_out_of_git():
    root = Path(__file__).resolve().parents[1]
    assert "/exported/" in (root / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("preset", DEFAULT_PRESET_CASES)
def test_every_default_preset_resumes_with_the_same_command_on_a_cpu(finished, tmp_path, capsys, preset):
    """Each default preset's file (its recipe and its [speed] section, FP8 and Triton paths a CPU lacks), shrunk to a
    CPU's size by a file that extends it: the run stops after a step, and the same command plus --resume finishes
    it, with the FP8 switches kept as asked in its checkpoint."""
    small = cpu_sized_preset(preset, finished[0].data, tmp_path / "small.toml")
    command = ["--config", str(small), "--runs-dir", str(tmp_path), "--name", "r"]
    with pytest.raises(SystemExit) as e:
        TR.main(command + ["--stop-after", "1"])
    assert e.value.code == 0, capsys.readouterr().err
    assert CK.load(tmp_path / "r").config.speed == C.preset(preset).speed  # what the preset asks, not what ran
    TR.main(command + ["--resume"])
    assert CK.load(tmp_path / "r").step == 3 and (tmp_path / "r" / "summary.json").exists()
