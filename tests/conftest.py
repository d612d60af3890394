"""Shared fixtures: a tiny corpus, tokenizer and shards built once per test session."""

import dataclasses
import json
import os
import socket

import numpy as np
import pytest
import torch

import config as C
import data as D
import fp8
import model as M

VOCAB = 512
# The suite's PyTorch CPU ops run on one thread, and so do the scripts its tests start: its tensors are small, where a
# second thread gains little, and on a 2-core machine the Triton interpreter's checks (tests/test_kernels.py) run
# beside the tests on the other core, which a second thread here took from them (docs/LOG.md, 2026-12-07).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def cpu_rows_fp8() -> bool:
    """Whether this torch's CPU _scaled_mm takes a scale a row, as fp8.rows_matmul asks (torch 2.13 does; 2.11,
    the oldest torch onegpu runs on, scales whole tensors only there, and runs FP8 on a GPU alone)."""
    x = torch.ones(16, 16)
    try:
        fp8.rows_matmul(fp8.to_fp8_rows(x), fp8.to_fp8_rows(x))
    except RuntimeError:
        return False
    return True


needs_cpu_fp8 = pytest.mark.skipif(not cpu_rows_fp8(), reason="this torch's CPU _scaled_mm has no row-wise scales "
                                   "(torch 2.13 has); tests/test_gpu.py checks the FP8 paths on a GPU")

# The default GPU presets, 126m in the fast tier (it has every part the others have, and the most layers) and the
# others in the slow one (CI runs both).
DEFAULT_PRESET_CASES = (*(pytest.param(p, marks=pytest.mark.slow) for p in ("22m", "47m", "88m")), "126m")


def cpu_sized_preset(preset: str, data, path, model_lines: str = ""):
    """A config file that extends configs/<preset>.toml (its recipe and its [speed] section) and shrinks it to a
    CPU's size: width 64, a 128-token context with 48-key windows (24 on the short layers), a bigram table (where
    the preset has one) as many times the 512-token vocabulary as the preset's is its vocabulary, the test corpus
    (data), 3 steps of 512 tokens, no compile; model_lines adds settings to its [model] section. Returns path."""
    full = C.preset(preset).model
    rows = "" if not full.bigram_rows or "bigram_rows" in model_lines else \
        f"bigram_rows = {full.bigram_rows * 512 // full.vocab_size}\n"
    path.write_text(f'extends = "{C.PRESETS_DIR / (preset + ".toml")}"\n'
                    "[model]\nd_model = 64\nn_heads = 2\nn_kv_heads = 2\nffn_hidden = 128\nvocab_size = 512\n"
                    f"context = 128\nattn_window = 48\n{rows}{model_lines}"
                    f"[data]\ncorpus = {json.dumps(data.corpus)}\ncache_dir = {json.dumps(data.cache_dir)}\n"
                    f"val_fraction = {data.val_fraction}\nmax_documents = {data.max_documents}\n"
                    f"tokenizer_documents = {data.tokenizer_documents}\n"
                    "[train]\nbatch_tokens = 512\nmicro_batch = 2\nsteps = 3\neval_every = 3\neval_tokens = 256\n"
                    "window_start = 32\nsample_tokens = 0\ncompile = false\n")
    return path


STARTED = []  # the module whose interpreter checks were started (tests/test_kernels.py)


def pytest_collection_modifyitems(config, items):
    """Once the tests are chosen: if one needs the Triton interpreter's checks (tests/test_kernels.py), start
    them now, in processes of their own, so they are done by the time that test runs."""
    for item in items:
        if "interpreted" in getattr(item, "fixturenames", ()):
            item.module.start_interpreter_checks()
            STARTED.append(item.module)
            return


def pytest_sessionfinish(session, exitstatus):
    """A run stopped early (-x, Ctrl-C) leaves no interpreter check running on after it."""
    for module in STARTED:
        for process in module.RUNNING:
            if process.poll() is None:
                process.kill()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """60 small text documents written by the test: .txt files, one document each."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(300)]
    for i in range(60):
        body = " ".join(rng.choice(words, 400, p=np.arange(300, 0, -1) / 45150))
        (folder / f"doc{i:03d}.txt").write_text(f"# document {i}\n{body}\n")
    return folder


@pytest.fixture(scope="session")
def data_cfg(corpus_dir, tmp_path_factory):
    cfg = D.DataConfig(corpus=str(corpus_dir / "*.txt"), val_fraction=0.1,
                       cache_dir=str(tmp_path_factory.mktemp("cache")))
    D.prepare(cfg, VOCAB, log=lambda *a: None)
    return cfg


def tiny_model_cfg(**overrides) -> M.ModelConfig:
    return M.ModelConfig(**{**dict(d_model=64, n_layers=2, n_heads=1, n_kv_heads=1, vocab_size=VOCAB,
                                   context=64), **overrides})


# The tiny test model's training run: a few CPU steps per second. Fixtures and tests change what they need.
TINY_TRAIN = dict(batch_tokens=512, micro_batch=4, lr=3e-3, warmup_steps=2, steps=6, eval_every=3, eval_tokens=512,
                  ckpt_every=3, sample_tokens=0, device="cpu")


def tiny_run_config(data_cfg, model: M.ModelConfig | None = None, **train):
    """A complete run config of the tiny test model on the test corpus; train overrides TINY_TRAIN."""
    return C.Config(model=model or tiny_model_cfg(), data=dataclasses.replace(data_cfg),
                    train=C.TrainConfig(**{**TINY_TRAIN, **train}))


def with_train(cfg, **changes):
    """cfg with its [train] values changed."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


@pytest.fixture
def free_port():
    """A TCP port nothing holds now, for torchrun's rendezvous, where a fixed one may still be held by an
    earlier run's."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


@pytest.fixture
def train_config(data_cfg):
    """A complete run config small enough for a few CPU steps per second."""
    return tiny_run_config(data_cfg)
