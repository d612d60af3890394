"""checkpoint.py: safe loading (no code runs from a checkpoint), atomic saves, strict configs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint as CK
import train as TR
from conftest import tiny_run_config

ROOT = Path(__file__).resolve().parent.parent


class RunsACommand:
    """What a crafted checkpoint carries: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(data_cfg, tmp_path_factory):
    """A run folder after 3 CPU steps of the tiny test model."""
    cfg = tiny_run_config(data_cfg, steps=3)
    run = tmp_path_factory.mktemp("runs") / "run"
    TR.train(cfg, run, log=lambda *a, **k: None)
    return run


def malicious_checkpoint(trained: Path, folder: Path) -> tuple[Path, Path]:
    """A copy of a real checkpoint with one extra entry that runs a command when unpickled."""
    marker = folder / "pwned"
    state = torch.load(trained / "ckpt.pt", weights_only=True)
    state["note"] = RunsACommand(marker)
    run = folder / "evil"
    run.mkdir()
    torch.save(state, run / "ckpt.pt")
    (run / "config.json").write_text((trained / "config.json").read_text())
    return run, marker


def test_a_checkpoint_that_would_run_code_is_refused(trained, tmp_path):
    run, marker = malicious_checkpoint(trained, tmp_path)
    with pytest.raises(CK.CheckpointError, match=r"ckpt\.pt: refused, it holds Python objects other than tensors"):
        CK.load(run)
    assert not marker.exists()


@pytest.mark.parametrize("script", ["sample.py", "export.py", "train.py"])
def test_no_script_runs_code_from_a_checkpoint(trained, tmp_path, script):
    run, marker = malicious_checkpoint(trained, tmp_path)
    args = {"sample.py": ["--ckpt", str(run), "--prompt", "a", "--max-new-tokens", "2"],
            "export.py": ["--ckpt", str(run), "--out", str(tmp_path / "hf")],
            "train.py": ["--runs-dir", str(tmp_path), "--name", "evil", "--resume"]}[script]
    done = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0 and not marker.exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "refused" in lines[0], done.stderr
    assert not (tmp_path / "hf").exists()


def test_truncated_or_foreign_checkpoint_is_one_clear_error(trained, tmp_path):
    data = (trained / "ckpt.pt").read_bytes()
    (tmp_path / "ckpt.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CK.CheckpointError, match=r"not a readable checkpoint .* truncated or corrupt"):
        CK.load(tmp_path)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "ckpt.pt")
    with pytest.raises(CK.CheckpointError, match=r"checkpoint format none, this version of onegpu reads format 2"):
        CK.load(tmp_path)


def test_misspelled_key_in_a_checkpoints_config_is_named(trained, tmp_path):
    state = torch.load(trained / "ckpt.pt", weights_only=True)
    state["config"]["model"]["d_modle"] = state["config"]["model"].pop("d_model")
    torch.save(state, tmp_path / "ckpt.pt")
    with pytest.raises(CK.CheckpointError, match=r"saved config\): unknown key\(s\) model\.d_modle"):
        CK.load(tmp_path)


def test_a_checkpoint_from_before_a_switch_existed_runs_the_plain_path(trained, tmp_path):
    """Every switch defaults to its plain path, so a checkpoint whose saved config lacks a switch (written
    before it existed) computes what it trained with; one written before the [speed] section, its switches
    under [model], loads them where they live now."""
    state = torch.load(trained / "ckpt.pt", weights_only=True)
    for switch in ("mlp", "qk_norm", "zero_init", "logit_softcap"):
        del state["config"]["model"][switch]
    del state["config"]["speed"]
    state["config"]["model"].update(fused_loss=True, bf16_residual=False)  # as the code before [speed] saved them
    torch.save(state, tmp_path / "ckpt.pt")
    cfg = CK.load(tmp_path).config
    assert (cfg.speed.fused_loss, cfg.speed.bf16_residual, cfg.speed.fused_decode) == (True, False, False)
    assert (cfg.model.mlp, cfg.model.qk_norm, cfg.model.zero_init, cfg.model.logit_softcap) == ("swiglu", False, False, 0.0)


def test_full_disk_keeps_the_old_checkpoint_and_leaves_no_temp_file(trained, tmp_path, monkeypatch):
    ckpt = CK.load(trained)
    path = tmp_path / "ckpt.pt"
    path.write_bytes((trained / "ckpt.pt").read_bytes())

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CK.CheckpointError, match=r"could not write checkpoint .*ckpt\.pt .* the previous checkpoint is kept"):
        CK.save(path, model=ckpt.model, optimizer=ckpt.optimizer, step=9, tokens=0, skipped=0, loaders=ckpt.loaders,
                rngs=ckpt.rngs, config=ckpt.config, tokenizer_hash=ckpt.tokenizer_hash)
    assert CK.load(path).step == ckpt.step and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_rng_state_round_trips_through_a_safe_load(tmp_path):
    import random
    import numpy as np
    state = CK.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    CK.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_weights_that_contradict_their_config_are_refused_in_one_line_by_every_loader(trained, tmp_path):
    """A checkpoint whose tensors' shapes contradict its saved config (an edited config, a damaged file): load()
    refuses it naming the tensor, so resume, evaluate, sample, export and --init-from all say one line."""
    state = torch.load(trained / "ckpt.pt", weights_only=True)
    state["config"]["model"]["d_model"] = 2 * state["config"]["model"]["d_model"]
    torch.save(state, tmp_path / "ckpt.pt")
    with pytest.raises(CK.CheckpointError, match=r"ckpt\.pt: its weights contradict its own config \(\w.* is \("):
        CK.load(tmp_path)
    state = torch.load(trained / "ckpt.pt", weights_only=True)
    del state["model"]["norm.weight"]
    torch.save(state, tmp_path / "ckpt.pt")
    with pytest.raises(CK.CheckpointError, match=r"contradict its own config \(missing norm\.weight; 1 tensor"):
        CK.load(tmp_path)
