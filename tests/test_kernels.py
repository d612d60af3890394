"""The Triton kernels of kernels.py against the plain PyTorch paths they replace, on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported: hence one subprocess for all).
tests/test_gpu.py runs the same comparisons compiled, on CUDA, in bfloat16."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels as K
import model as M

ROOT = Path(__file__).resolve().parent.parent

# float16 in the checks: the interpreter computes with NumPy, which has no bfloat16.
CHECKS = ("decode_check", "swiglu_check", "cross_entropy_check", "fp8_head_loss_check", "relu2_check", "gram_check", "qk_norm_rope_check")


@pytest.fixture(scope="module")
def interpreted():
    """Every check of tests/interpreted_kernels.py, run in one process with the interpreter on:
    check -> "" where it passed, else its traceback."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    code = ("import json, traceback\nimport interpreted_kernels as I\nout = {}\n"
            f"for check in {CHECKS!r}:\n"
            "    try:\n        getattr(I, check)()\n        out[check] = ''\n"
            "    except Exception:\n        out[check] = traceback.format_exc()\n"
            "print(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_under_interpreter(results: dict, check: str):
    assert results[check] == "", results[check][-2000:]


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton for its CPU interpreter (pip install triton)")


@needs_triton
def test_fused_decode_step_matches_the_plain_path_and_stops_at_the_token(interpreted):
    run_under_interpreter(interpreted, "decode_check")


@needs_triton
def test_fused_swiglu_matches_the_plain_path_forward_and_backward(interpreted):
    run_under_interpreter(interpreted, "swiglu_check")


def test_kernels_run_on_ampere_and_newer_only(monkeypatch):
    """Triton supports compute capability 8.0 and newer, and bfloat16 needs it: on an older GPU
    (a Turing laptop card, 7.5) the model keeps its plain paths."""
    monkeypatch.setattr(K, "AVAILABLE", True)
    for capability, expected in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert K.device_supported(torch.device("cuda")) is expected
        # fused_swiglu is on in the SwiGLU presets; where Triton cannot run, train.setup builds the model
        # without it and says so in one line (generation never uses it: no gradients).
        assert M.for_device(M.ModelConfig(fused_swiglu=True), torch.device("cuda")).fused_swiglu is expected
    assert M.for_device(M.ModelConfig(fused_swiglu=True), torch.device("cpu")).fused_swiglu  # CPU: SwiGLU's own check


@needs_triton
def test_cross_entropy_kernel_matches_the_plain_loss_and_gradient(interpreted):
    run_under_interpreter(interpreted, "cross_entropy_check")


@needs_triton
def test_the_fp8_head_and_loss_kernel_in_one_function_match_them_apart(interpreted):
    run_under_interpreter(interpreted, "fp8_head_loss_check")


@needs_triton
def test_the_fused_relu2_mlp_matches_the_plain_one_forward_and_backward(interpreted):
    run_under_interpreter(interpreted, "relu2_check")


@needs_triton
def test_the_symmetric_gram_kernel_matches_the_matmuls_and_muons_step(interpreted):
    run_under_interpreter(interpreted, "gram_check")


@needs_triton
def test_qk_norm_and_rope_in_one_kernel_match_the_plain_lines_forward_and_backward(interpreted):
    run_under_interpreter(interpreted, "qk_norm_rope_check")
