"""bench.py's code paths on CPU: every study runs with the tiny preset and lists what it skips."""

import json

import pytest
import torch

import bench as B
import model as M


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONEGPU_CACHE", str(tmp_path_factory.mktemp("empty-cache")))  # no shards: random tokens
        B.main(["--ladder", "--micro-batch", "--optimizer", "--profile", "--activation-checkpointing",
                "--compile-modes", "--attention", "--only", "textbook", "default", "doc-mask", "flash",
                "--out", str(out)])
    return out


def rows(out, study):
    return json.loads((out / f"{study}.json").read_text())["rows"]


def test_ladder_runs_first_rung_and_names_skipped_ones(results):
    ladder = rows(results, "ladder")
    assert ladder[0]["tok_s"] > 0 and ladder[0]["data"] == "random tokens" and ladder[0]["micro_batch"] == 4
    assert [r["skipped"] for r in ladder[1:]] == ["needs CUDA"] * 6
    assert (results / "ladder.png").stat().st_size > 1000


def test_attention_study_reports_the_kernel_it_saw(results):
    by_name = {r["rung"]: r for r in rows(results, "attention")}
    assert by_name["textbook eager"]["attention_kernels"].startswith("math")
    assert by_name["default eager"]["tok_s"] > 0 and by_name["doc-mask eager"]["tok_s"] > 0
    assert by_name["flash eager"]["skipped"] == "SDPA backends are CUDA kernels"
    assert "compiled variants are measured on CUDA" in by_name["default compiled"]["skipped"]


def test_compile_modes_compile_on_cpu_and_name_the_cuda_only_modes(results):
    by_name = {r["rung"]: r for r in rows(results, "compile_modes")}
    assert by_name["default"]["tok_s"] > 0 and by_name["default"]["warmup_s"] > 0
    for mode in ("reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"):
        assert by_name[mode]["skipped"] == "CUDA graphs and autotuning are CUDA features"


def test_micro_batch_study_fits_memory_line(results):
    sizes = [r["micro_batch"] for r in rows(results, "micro_batch") if "micro_batch" in r]
    assert sizes == [1, 2, 4]


def test_optimizer_and_profile(results):
    optimizer = {r["rung"]: r for r in rows(results, "optimizer")}
    assert optimizer["foreach"]["update_ms"] > 0 and optimizer["for-loop"]["update_ms"] > 0
    assert "skipped" in optimizer["fused"]
    profile = rows(results, "profile")
    assert abs(sum(r["share"] for r in profile) - 1) < 1e-6
    assert {r["rung"] for r in profile} >= {"matmul", "attention"}


def test_activation_checkpointing_rows(results):
    names = [r["rung"] for r in rows(results, "activation_checkpointing")]
    assert names[:2] == ["micro-batch 4", "micro-batch 4 +AC"]


def test_textbook_attention_equals_sdpa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(B.textbook_attention(q, k, v), M.attention(q, k, v))
    torch.testing.assert_close(B.repeated_kv_attention(q, k, v), M.attention(q, k, v))


def test_ladder_table_math():
    rows_ = [{"rung": "a", "micro_batch": 4, "tok_s": 100.0, "step_s": 1.0, "spread": 0.0, "warmup_s": 1.0,
              "sm_mhz": 2000, "power_w": 50, "peak_gib": 1.0},
             {"rung": "b", "micro_batch": 4, "tok_s": 250.0, "step_s": 0.4, "spread": 0.01, "warmup_s": 1.0,
              "sm_mhz": 1000, "power_w": 50, "peak_gib": 1.0}]
    table = B.ladder_table(rows_, flops_tok=1e12, roof=1000.0, spec_peak=2000.0)
    assert "| b | 4 | 250 | 0.400 | 2.50 | 2.50 | 25.0% | 12.5% | 1.00 | 1.0 | 1000 | 50 | 250 | 1.0% |" in table
