"""The Triton kernels of onegpu_kernels.py against the plain PyTorch paths they replace, on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported: hence one subprocess for all).
tests/test_gpu.py runs the same comparisons compiled, on CUDA, in bfloat16."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import attention as A
import fastpaths as FP
import onegpu_kernels as K
import model as M
from conftest import needs_cpu_fp8

ROOT = Path(__file__).resolve().parent.parent

# float16 in the checks: the interpreter computes with NumPy, which has no bfloat16.
CHECKS = ("decode_check", "cross_entropy_check", "multi_cross_entropy_check", "relu2_check", "relu2_fp8_check", "transposed_check", "gram_check",
          "swiglu_check",
          "fp8_head_loss_check", "qk_norm_rope_check", "small_matmul_check", "decode_mlp_check",
          "one_graph_check")
# each in a process of its own, in the slow tier (CI runs it): the ones that compile with Inductor for the CPU
SLOW_CHECKS = ("compiled_custom_ops_check", "compiled_fp8_mlp_check", "decode_model_check")
RUNNING = []  # the process that runs CHECKS, once started


def start_interpreter_checks():
    """Start the process that runs CHECKS, once. tests/conftest.py calls this as soon as pytest has chosen
    the tests, when one of them needs `interpreted`: the checks (about 25 s) then run on one core beside
    the tests before this module's, which keep the other busy, instead of holding the whole suite as a
    fixture of their own (19 s in two processes at once on a 2-core machine, 2026-12-02)."""
    if RUNNING:
        return
    RUNNING.append(subprocess.Popen([sys.executable, "-c", checks_code(CHECKS)], env=interpreter_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))


@pytest.fixture(scope="module")
def interpreted():
    """Every check of tests/interpreted_kernels.py, run with the interpreter on in start_interpreter_checks':
    check -> "" where it passed, else its traceback."""
    start_interpreter_checks()
    results = {}
    for process in RUNNING:
        out, err = process.communicate()
        assert process.returncode == 0, err[-2000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


def interpreter_env() -> dict:
    """The environment of a process that runs checks: Triton's interpreter on, the repository importable."""
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def checks_code(checks: tuple[str, ...]) -> str:
    """A program that runs `checks` and prints {check: "" or its traceback} as JSON."""
    return ("import json, traceback\nimport interpreted_kernels as I\nout = {}\n"
            f"for check in {checks!r}:\n"
            "    try:\n        getattr(I, check)()\n        out[check] = ''\n"
            "    except Exception:\n        out[check] = traceback.format_exc()\n"
            "print(json.dumps(out))")


def test_every_interpreted_check_runs():
    import re
    source = (ROOT / "tests" / "interpreted_kernels.py").read_text()
    assert set(re.findall(r"^def (\w+_check)\(", source, re.M)) == set(CHECKS) | set(SLOW_CHECKS)


def run_under_interpreter(results: dict, check: str):
    assert results[check] == "", results[check][-2000:]


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton for its CPU interpreter (pip install triton)")


@needs_cpu_fp8
@needs_triton
def test_the_training_fast_paths_trace_as_one_graph(interpreted):
    run_under_interpreter(interpreted, "one_graph_check")


@needs_triton
def test_fused_decode_step_matches_the_plain_path_and_stops_at_the_token(interpreted):
    run_under_interpreter(interpreted, "decode_check")


@needs_triton
def test_decode_step_hands_its_op_every_argument_by_position(monkeypatch):
    """torch 2.11's custom ops find a mutated argument (counts) by its index among the arguments
    passed: one given by keyword, or left to its default, raised IndexError on the GPU (2026-12-03)."""
    arguments = torch.ops.onegpu.decode_step.default._schema.arguments  # the op's, all 16
    calls = []
    monkeypatch.setattr(K, "_decode_step", lambda *a, **k: calls.append((len(a), k)))
    K.decode_step(*[torch.zeros(1)] * 6, 0.125, window=8, counts=torch.zeros(1, 1, dtype=torch.int32))
    assert calls == [(len(arguments), {})]


@needs_triton
def test_the_small_matmul_matches_f_linear_and_decodes_as_the_plain_model(interpreted):
    run_under_interpreter(interpreted, "small_matmul_check")


@needs_triton
def test_the_decode_mlp_matches_the_plain_mlp_and_decodes_as_the_plain_model(interpreted):
    run_under_interpreter(interpreted, "decode_mlp_check")


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
        assert FP.for_device(FP.SpeedConfig(fused_swiglu=True), torch.device("cuda"))[0].fused_swiglu is expected
    # a CPU runs them only under Triton's interpreter (the checks below), so a CPU run trains the plain paths
    speed, why = FP.for_device(FP.SpeedConfig(fused_swiglu=True), torch.device("cpu"))
    assert not speed.fused_swiglu and "interpreter" in why


def test_fp8_matmuls_are_off_on_a_cpu_which_emulates_them_slowly():
    """A CPU has no FP8 units: train.setup builds the model with the plain head and block matmuls there."""
    speed = FP.SpeedConfig(fp8=True, fp8_head=True, fp8_fast_accum=True)
    plain, why = FP.for_device(speed, torch.device("cpu"))
    assert (plain.fp8, plain.fp8_head, plain.fp8_fast_accum) == (False,) * 3 and "FP8" in why
    assert FP.for_device(FP.SpeedConfig(), torch.device("cpu")) == (FP.SpeedConfig(), "")


def test_fp8_matmuls_are_off_on_a_gpu_without_fp8_units_and_on_from_ada(monkeypatch):
    """FP8 tensor cores came with compute capability 8.9: the default presets' FP8 head trains on an A100
    (8.0) with the plain head, saying why in one line, and stays on for an RTX 4060 (8.9) or an H200 (9.0)."""
    monkeypatch.setattr(K, "AVAILABLE", True)
    speed = FP.SpeedConfig(fp8=True, fp8_head=True, fp8_fast_accum=True)
    for capability, expected in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        on, why = FP.for_device(speed, torch.device("cuda"))
        assert (on.fp8, on.fp8_head, on.fp8_fast_accum) == (expected,) * 3
        assert ("compute capability 8.9" in why) is not expected
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # Turing: both reasons
    on, why = FP.for_device(replace(speed, loss_kernel=True), torch.device("cuda"))
    assert not (on.fp8_head or on.loss_kernel) and "8.0 (Ampere)" in why and "8.9" in why
    # ...and its documents and windows are boolean masks for SDPA: FlexAttention needs Ampere
    doc = torch.zeros(1, 8, dtype=torch.long)
    assert A.masks(8, torch.device("cuda"), doc, (4, 2)) == A.Masks(A.Mask(doc, 4), A.Mask(doc, 2))


@needs_triton
def test_cross_entropy_kernel_matches_the_plain_loss_and_gradient(interpreted):
    run_under_interpreter(interpreted, "cross_entropy_check")


@needs_triton
def test_the_multi_token_loss_kernel_matches_the_plain_loss_and_gradient(interpreted):
    run_under_interpreter(interpreted, "multi_cross_entropy_check")


def test_the_fp8_head_and_loss_kernel_in_one_function_match_them_apart(interpreted):
    run_under_interpreter(interpreted, "fp8_head_loss_check")


@needs_triton
def test_the_fused_relu2_mlp_matches_the_plain_one_forward_and_backward(interpreted):
    run_under_interpreter(interpreted, "relu2_check")


@needs_triton
def test_the_fp8_relu2_row_kernels_match_the_plain_lines(interpreted):
    run_under_interpreter(interpreted, "relu2_fp8_check")


@needs_triton
def test_the_fp8_transpose_kernel_moves_every_byte_where_the_plain_copy_does(interpreted):
    run_under_interpreter(interpreted, "transposed_check")


@needs_triton
def test_the_symmetric_gram_kernel_matches_the_matmuls_and_muons_step(interpreted):
    run_under_interpreter(interpreted, "gram_check")


@needs_triton
def test_qk_norm_and_rope_with_the_backward_kernel_match_the_plain_lines(interpreted):
    run_under_interpreter(interpreted, "qk_norm_rope_check")


# Every Triton kernel as a GPU would build it, on a CPU: Triton compiles to PTX and ptxas (shipped in the
# triton wheel) assembles it for Hopper (sm_90), with no GPU present. A kernel that only the interpreter
# accepts (it checks no types, no register or shared-memory budget) fails here. Pointers are bf16 but
# where named; the autotuned kernels build every tile they may pick.
FLOATS = {"scale", "eps", "cap", "fp8_scale", "fp8_max", "alpha", "beta", "row_grad", "top"}
HOPPER_SHARED = 232_448  # bytes of shared memory one block may use on an H100 or H200
BUILDS = [  # (kernel, constexprs, pointer dtypes other than bf16)
    ("_decode_step_kernel", dict(H=12, HKV=4, G=3, G_PAD=16, D=64, BLOCK=K.BLOCK_KEYS, QK_NORM=True, V_MIX=0,
                                 GATE=False, GC=1, GC_PAD=16, SPLITS=1, PDL=False), {"pos_ptr": "*i64", "count_ptr": "*i64"}),
    ("_decode_step_kernel", dict(H=6, HKV=6, G=1, G_PAD=16, D=128, BLOCK=128, QK_NORM=False, V_MIX=1, GATE=False,
                                 GC=1, GC_PAD=16, SPLITS=1, PDL=False), {"pos_ptr": "*i64", "count_ptr": "*i64"}),
    # the record's attention: gainless QK-norm (ones), a value table, the gate; then its positions split
    ("_decode_step_kernel", dict(H=6, HKV=6, G=1, G_PAD=16, D=128, BLOCK=K.BLOCK_KEYS, QK_NORM=True, V_MIX=2,
                                 GATE=True, GC=12, GC_PAD=16, SPLITS=1, PDL=False), {"pos_ptr": "*i64", "count_ptr": "*i64"}),
    ("_decode_step_kernel", dict(H=6, HKV=6, G=1, G_PAD=16, D=128, BLOCK=K.SPLIT_BLOCK_KEYS, QK_NORM=True, V_MIX=2,
                                 GATE=True, GC=12, GC_PAD=16, SPLITS=K.MAX_DECODE_SPLITS, PDL=False),
     {"pos_ptr": "*i64", "part_ptr": "*fp32", "count_ptr": "*i32"}),
    ("_swiglu_forward_kernel", dict(BLOCK=1024), {}),
    ("_swiglu_backward_kernel", dict(BLOCK=1024), {}),
    ("_cross_entropy_forward_kernel", dict(BLOCK=2048, CAPPED=True, FIXED_SHIFT=True),
     {"t_ptr": "*i64", "loss_ptr": "*fp32", "lse_ptr": "*fp32"}),
    ("_cross_entropy_forward_kernel", dict(BLOCK=2048, CAPPED=False, FIXED_SHIFT=False),
     {"t_ptr": "*i64", "loss_ptr": "*fp32", "lse_ptr": "*fp32"}),
    ("_cross_entropy_backward_kernel", dict(BLOCK=2048, CAPPED=True, FP8=True),
     {"t_ptr": "*i64", "lse_ptr": "*fp32", "g_ptr": "*fp32", "dz8_ptr": "*fp8e5"}),
    ("_cross_entropy_backward_kernel", dict(BLOCK=2048, CAPPED=False, FP8=False),
     {"t_ptr": "*i64", "lse_ptr": "*fp32", "g_ptr": "*fp32"}),
    ("_cross_entropy_and_gradient_kernel", dict(BLOCK=2048, CAPPED=True, FIXED_SHIFT=True, FP8=True, DZ=False),
     {"t_ptr": "*i64", "loss_ptr": "*fp32", "dz8_ptr": "*fp8e5"}),
    ("_multi_cross_entropy_forward_kernel", dict(K=3, BLOCK=2048, CAPPED=True, FIXED_SHIFT=True),
     {"t_ptr": "*i64", "w_ptr": "*fp32", "loss_ptr": "*fp32", "lse_ptr": "*fp32"}),
    ("_multi_cross_entropy_backward_kernel", dict(K=3, BLOCK=2048, CAPPED=True),
     {"t_ptr": "*i64", "w_ptr": "*fp32", "lse_ptr": "*fp32", "g_ptr": "*fp32"}),
    ("_multi_cross_entropy_and_gradient_kernel", dict(K=4, BLOCK=2048, CAPPED=True, FIXED_SHIFT=True, FP8=True, DZ=True),
     {"t_ptr": "*i64", "w_ptr": "*fp32", "loss_ptr": "*fp32", "dz8_ptr": "*fp8e5"}),
    ("_relu2_matmul_kernel", dict(GROUP_M=8), {}),
    ("_relu2_fp8_kernel", dict(BLOCK=4096), {"a8_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
    ("_relu2_fp8_backward_kernel", dict(BLOCK=4096), {"du8_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
    ("_qk_norm_rope_backward_kernel", dict(H=6, HKV=6, D=128, BLOCKS=K.QK_BLOCKS),
     {"qg_ptr": "*fp32", "kg_ptr": "*fp32", "dg_ptr": "*fp32"}),
    ("_qk_norm_rope_backward_kernel", dict(H=12, HKV=4, D=64, BLOCKS=K.QK_BLOCKS),
     {"qg_ptr": "*fp32", "kg_ptr": "*fp32", "dg_ptr": "*fp32"}),
    ("_small_matmul_kernel", dict(ROWS=K.SMALL_MATMUL_ROWS, RELU2=True), {}),
    ("_decode_mlp_kernel", dict(ROWS=K.SMALL_MATMUL_ROWS, BLOCK_H=K.DECODE_MLP_HIDDEN, PDL=False), {"part_ptr": "*fp32"}),
    ("_gram_kernel", dict(ADD=False), {}),
    ("_gram_kernel", dict(ADD=True), {}),
    ("_transpose_kernel", {}, {"src_ptr": "*i32", "dst_ptr": "*i32"}),
]


# The kernels that a decode step launches as programmatic dependents (model.decode_pdl), with PDL on: the 88m
# default's split decode, and its MLP.
DEPENDENT_BUILDS = [(name, {**constexprs, "PDL": True}, pointers) for name, constexprs, pointers in BUILDS
                    if name == "_decode_mlp_kernel" or constexprs.get("SPLITS", 1) > 1]


def build_for_hopper(name: str, constexprs: dict, pointers: dict, ptx: bool = False) -> list:
    """Compile kernels.<name> for sm_90 with each launch configuration it may take; their shared memory
    (ptx: their PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner
    kernel = getattr(K, name)
    configs = kernel.configs if isinstance(kernel, Autotuner) else [None]
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    shared = []
    for config in configs:
        consts = {**constexprs, **(config.kwargs if config else {})}
        signature = {a: "constexpr" if a in consts else pointers.get(a, "*bf16") if a.endswith("_ptr")
                     else "fp32" if a in FLOATS else "i32" for a in fn.arg_names}
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages} if config else {}
        if consts.get("PDL"):
            options["launch_pdl"] = True
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        shared.append(compiled.asm["ptx"] if ptx else compiled.metadata.shared)
    return shared


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("check", SLOW_CHECKS)
def test_the_custom_op_fast_paths_compile_as_they_run_eager(check):
    """tests/interpreted_kernels.py's compiled checks, each in an interpreter process of its own (an Inductor
    compile for the CPU: the slow tier's, not the suite's)."""
    done = subprocess.run([sys.executable, "-c", checks_code((check,))], env=interpreter_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    run_under_interpreter(json.loads(done.stdout.strip().splitlines()[-1]), check)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("name, constexprs, pointers", BUILDS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BUILDS)])
def test_every_triton_kernel_compiles_for_hopper_without_a_gpu(name, constexprs, pointers):
    assert all(0 <= s <= HOPPER_SHARED for s in build_for_hopper(name, constexprs, pointers))


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("name, constexprs, pointers", DEPENDENT_BUILDS, ids=[b[0] for b in DEPENDENT_BUILDS])
def test_dependent_launches_wait_for_the_kernel_before_ahead_of_every_memory_access(name, constexprs, pointers):
    """A kernel launched as a programmatic dependent may run beside the kernel before it: its PTX must wait
    (griddepcontrol.wait) before its first global store or atomic, and load ahead of the wait only what the
    kernel before it does not write (the decode step its position and first block of cached keys and
    values, the MLP its first block of w1), and then let the next kernel launch. The same kernel without
    PDL neither waits nor lets go."""
    def lines(ptx, *instructions):  # the lines of these instructions, predicated ("@%p3 ld...") or not
        ops = [line.split()[1 if line.lstrip().startswith("@") else 0] for line in ptx.splitlines() if line.split()]
        return [i for i, op in enumerate(ops) if op.startswith(instructions)]
    kernel = getattr(K, name)
    # loads a thread may issue ahead of the wait, one element a load at most (this build has no divisibility to
    # vectorize with): the MLP's (BLOCK_H, BLOCK_K) block of w1 over its threads; the decode step's position and
    # its (BLOCK, D) blocks of keys and values. The new token's row of qkv would add more.
    if name == "_decode_mlp_kernel":
        ahead = [constexprs["BLOCK_H"] * c.kwargs["BLOCK_K"] // (32 * c.num_warps) for c in kernel.configs]
    else:
        ahead = [1 + 2 * constexprs["BLOCK"] * constexprs["D"] // (32 * K.DECODE_WARPS)]
    for ptx, loads_ahead in zip(build_for_hopper(name, constexprs, pointers, ptx=True), ahead, strict=True):
        wait, = lines(ptx, "griddepcontrol.wait")
        writes = lines(ptx, "st.global", "atom.global", "red.global", "cp.reduce")
        reads = lines(ptx, "ld.global", "cp.async.ca", "cp.async.cg")
        assert writes and min(writes) > wait and sum(r < wait for r in reads) <= loads_ahead and len(reads) > loads_ahead
        assert wait < min(lines(ptx, "griddepcontrol.launch_dependents"))
    for ptx in build_for_hopper(name, {**constexprs, "PDL": False}, pointers, ptx=True)[:1]:
        assert "griddepcontrol" not in ptx


def test_the_hopper_builds_cover_every_kernel():
    names = {n for n in dir(K) if n.startswith("_") and n.endswith("_kernel")}
    assert {b[0] for b in BUILDS} == names or not K.AVAILABLE


def test_launch_settings_hold_inside_and_are_put_back_after_an_error():
    before = K.DECODE_MLP_HIDDEN, K.SPLIT_BLOCK_KEYS
    with pytest.raises(RuntimeError):
        with K.launch_settings(DECODE_MLP_HIDDEN=16, SPLIT_BLOCK_KEYS=None):
            assert (K.DECODE_MLP_HIDDEN, K.SPLIT_BLOCK_KEYS) == (16, before[1])  # None leaves one as it is
            raise RuntimeError
    assert (K.DECODE_MLP_HIDDEN, K.SPLIT_BLOCK_KEYS) == before
