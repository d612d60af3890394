"""House rules. The project's modules import one way: each only from modules below it in LAYERS, with no
circle, so `python data.py prepare` loads every module once (a module run as a script and
imported again by a module below it would exist twice, with two copies of each exception class)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a module may import only modules to its left.
LAYERS = ["onegpu_kernels", "attention", "model_checks", "model", "flops", "fp8", "fastpaths", "generate", "tokenizer", "plots", "config", "sizing",
          "optim", "data", "checkpoint", "boards", "train", "measure", "recipes", "bench", "sample", "export", "evaluate"]
# Not imported by the project: what export.py ships beside model.py, a file of the export folder's package.
SHIPPED = ["modeling_onegpu"]


def project_imports(module: str) -> set[str]:
    """Every project module `module` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found & set(LAYERS)


def test_every_module_is_in_a_layer():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(LAYERS + SHIPPED)


def test_no_module_takes_the_import_name_of_an_installed_package():
    """The modules install flat, each its own top-level name, where another distribution's package of the
    same name wins or loses by chance. transformers 5.25 brought Hugging Face's `kernels` package, whose
    import found this project's kernels.py (and export failed) until that file became onegpu_kernels.py."""
    from importlib.metadata import packages_distributions
    taken = {name: dists for name, dists in packages_distributions().items() if set(dists) - {"onegpu"}}
    assert {m: taken[m] for m in LAYERS if m in taken} == {}


def test_imports_only_point_down():
    upward = [f"{m} imports {d}" for m in LAYERS for d in project_imports(m) if LAYERS.index(d) >= LAYERS.index(m)]
    assert upward == []
    assert project_imports("tokenizer") == set() and project_imports("model") == {"attention", "model_checks"}
    assert project_imports("attention") == project_imports("model_checks") == set()  # the plain model reaches no kernel module


def test_a_script_loads_its_own_module_once():
    code = ("import runpy, sys; sys.argv = ['data.py', '--help']\n"
            "try: runpy.run_path('data.py', run_name='__main__')\n"
            "except SystemExit: pass\n"
            "print('data' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr[-2000:]


def test_numbers_are_cited_by_topic_and_docs_hold_no_scripts():
    """Comments and docs cite docs/PERFORMANCE.md's topics or docs/LOG.md's dated entries, never a
    round or a work session that a later edit would renumber; docs/ holds results, not code."""
    import re
    texts = [p for p in ROOT.glob("*.py")] + list((ROOT / "tests").glob("*.py")) + [ROOT / "README.md"] + \
        list((ROOT / "docs").glob("*.md"))
    stale = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh) round\b|BENCHMARKS\.md|docs/h200|session\d")
    found = [f"{p.name}: {m.group(0)}" for p in texts if p.name != "test_house.py" for m in stale.finditer(p.read_text())
             if not (p.name == "LOG.md" and m.group(0) == "BENCHMARKS.md")]  # the log says where its entries came from
    assert found == []
    assert sorted(p.name for p in (ROOT / "docs").rglob("*") if p.suffix in (".py", ".sh")) == []


def test_no_paragraph_of_the_docs_restates_the_one_before_it():
    """A paragraph pasted twice (docs/LOG.md's first entry had its setup twice after the move from
    BENCHMARKS.md) reads as two measurements: adjacent prose paragraphs may not open alike."""
    import re
    doubled = []
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", path.read_text()) if p.strip()]
        doubled += [f"{path.name}: {a[:60]!r}" for a, b in zip(paragraphs, paragraphs[1:])
                    if a[:40] == b[:40] and not a.startswith(("|", "*", "-", "#", "`", "!"))]
    assert doubled == []


# What the text said about defaults that have since changed (issue: text about the old defaults): the
# fused SwiGLU as the default, recompute_mlp as SwiGLU's, a function under the wrong module.
OLD_DEFAULTS = [r"fused_swiglu \(the default", r"on by default for the SwiGLU MLP", r"fused AdamW and SwiGLU, bf16",
                r"recompute each block's norm \+ SwiGLU", r"\bmodel\.decode_one\b"]


def test_no_text_describes_the_old_defaults():
    """The code and README say what runs today; the ladder's table in PERFORMANCE.md names the
    preset it was measured on (the article's model), so its command reproduces it."""
    import re
    texts = [*ROOT.glob("*.py"), ROOT / "README.md"]
    found = [f"{p.name}: {m.group(0)}" for p in texts for pattern in OLD_DEFAULTS
             for m in re.finditer(pattern, p.read_text())]
    assert found == []
    performance = "".join(p.read_text() for p in (ROOT / "docs" / "performance").glob("*.md"))
    assert "`python bench.py --ladder --preset 88m-gpt3`" in performance


def test_performance_shows_each_tables_own_plot_and_names_what_it_measured():
    """The 88m table shows the plot of its two-seed runs, not the one-seed 30% probe; the profile's
    column of the 2026-11-30 SwiGLU model says so, instead of calling it "defaults"."""
    text = "".join(p.read_text() for p in (ROOT / "docs" / "performance").glob("*.md"))
    assert "recipes-88m-versus-30pct-probe.png)" not in text
    assert "2026-12-01_recipes-88m-fixed-budget_h200/recipes-88m-versus.png)" in text
    assert "| defaults (ms) |" not in text and "the presets' settings that day (ms)" in text


def test_what_bench_reports_is_timed_in_measure_only():
    """One owner of the clocks bench's numbers come from (measure.py's timed, gpu_seconds and
    median_and_spread): bench.py and recipes.py decide what to run and read results."""
    clocks = ("perf_counter", "synchronize(", "Event(")
    found = [f"{m}.py: {c}" for m in ("bench", "recipes") for c in clocks if c in (ROOT / f"{m}.py").read_text()]
    assert found == []


def test_the_wheel_lists_every_module_on_disk():
    """pyproject.toml's py-modules is what a wheel installs: a module left out imports in the checkout
    (and in an editable install) and fails from the wheel."""
    import tomllib
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert sorted(listed) == sorted(p.stem for p in ROOT.glob("*.py"))


# --- Fast paths: one list (fastpaths.TRAINING_FAST_PATHS, GENERATION_FAST_PATHS), each with its switch, its
# plain twin and its tests against that twin: on CPU (the plain twin or the Triton interpreter) and on a GPU.
AGREEMENT = {
    "fused_loss": ["test_fastpaths.py::test_fused_loss_equals_plain_loss_and_gradients",
                   "test_gpu.py::test_fused_kernels_match_plain_in_bf16",
                   "test_gpu.py::test_the_fused_loss_with_a_soft_cap_matches_plain_in_bf16"],
    "loss_kernel": ["test_kernels.py::test_cross_entropy_kernel_matches_the_plain_loss_and_gradient",
                    "test_gpu.py::test_the_loss_kernel_matches_the_plain_loss_in_bf16",
                    # with fp8_head: the two as one function, its gradient's transposed copy by our kernel
                    "test_kernels.py::test_the_fp8_head_and_loss_kernel_in_one_function_match_them_apart",
                    "test_kernels.py::test_the_fp8_transpose_kernel_moves_every_byte_where_the_plain_copy_does",
                    "test_gpu.py::test_the_fp8_head_and_loss_kernel_in_one_function_stay_close_to_bf16",
                    "test_gpu.py::test_the_transpose_kernel_copies_the_bytes_of_the_plain_transpose"],
    "fused_relu2": ["test_kernels.py::test_the_fused_relu2_mlp_matches_the_plain_one_forward_and_backward",
                    "test_gpu.py::test_the_fused_relu2_mlp_matches_plain_in_bf16"],
    "fused_qk_norm_rope": ["test_kernels.py::test_qk_norm_and_rope_with_the_backward_kernel_match_the_plain_lines",
                           "test_gpu.py::test_the_fused_qk_norm_and_rope_match_plain_in_bf16"],
    "fused_swiglu": ["test_kernels.py::test_fused_swiglu_matches_the_plain_path_forward_and_backward",
                     "test_gpu.py::test_fused_kernels_match_plain_in_bf16"],
    "bf16_residual": ["test_fastpaths.py::test_bf16_residual_stream_only_in_training_under_autocast_and_close_to_float32",
                      "test_gpu.py::test_fused_kernels_match_plain_in_bf16"],
    "fp8": ["test_fastpaths.py::test_fp8_linear_is_close_to_the_plain_matmul_and_its_gradients",
            "test_fastpaths.py::test_the_fp8_relu2_mlp_is_close_to_the_plain_one_and_evaluates_plainly",
            "test_kernels.py::test_the_fp8_relu2_row_kernels_match_the_plain_lines",
            "test_gpu.py::test_fp8_block_matmuls_stay_close_to_bf16",
            "test_gpu.py::test_the_fp8_relu2_row_kernels_cast_as_torch_does"],
    "fp8_head": ["test_fastpaths.py::test_fp8_head_trains_close_to_the_plain_head_and_evaluates_plainly",
                 "test_gpu.py::test_fp8_head_stays_close_to_bf16"],
    # the same products with fast accumulation: its switch reaches each forward product (CPU), and both FP8
    # paths' GPU tests run with it and without
    "fp8_fast_accum": ["test_fastpaths.py::test_fp8_forward_products_alone_take_the_fast_accumulation_switch",
                       "test_gpu.py::test_fp8_block_matmuls_stay_close_to_bf16",
                       "test_gpu.py::test_fp8_head_stays_close_to_bf16"],
    "fused_decode": ["test_kernels.py::test_fused_decode_step_matches_the_plain_path_and_stops_at_the_token",
                     "test_gpu.py::test_fused_decode_step_matches_the_plain_path_in_bf16"],
    "split_decode": ["test_kernels.py::test_fused_decode_step_matches_the_plain_path_and_stops_at_the_token",
                     "test_gpu.py::test_fused_decode_step_matches_the_plain_path_in_bf16"],
    "decode_matmuls": ["test_kernels.py::test_the_small_matmul_matches_f_linear_and_decodes_as_the_plain_model",
                       "test_gpu.py::test_the_small_matmul_matches_f_linear_in_bf16"],
    "decode_mlp": ["test_kernels.py::test_the_decode_mlp_matches_the_plain_mlp_and_decodes_as_the_plain_model",
                   "test_gpu.py::test_the_decode_mlp_matches_the_plain_mlp_in_bf16"],
    "decode_pdl": ["test_kernels.py::test_dependent_launches_wait_for_the_kernel_before_ahead_of_every_memory_access",
                   "test_sample_export.py::test_dependent_launches_reach_every_decode_kernel_only_where_the_card_has_them",
                   "test_gpu.py::test_fused_decode_matches_the_plain_step_eager_and_captured",
                   "test_gpu.py::test_dependent_launches_give_the_same_greedy_tokens"],
    "muon_kernel": ["test_kernels.py::test_the_symmetric_gram_kernel_matches_the_matmuls_and_muons_step",
                    "test_gpu.py::test_muons_symmetric_gram_kernel_matches_the_batched_matmuls_in_bf16"],
}


def test_every_fast_path_has_a_switch_off_by_default_and_its_agreement_tests():
    import dataclasses
    import config as C
    import fastpaths as FP
    import optim as O
    import train as TR
    assert set(AGREEMENT) == set(FP.TRAINING_FAST_PATHS) | set(FP.GENERATION_FAST_PATHS) | set(O.FAST_PATHS)
    defaults = {f.name: f.default for cls in (FP.SpeedConfig, C.TrainConfig) for f in dataclasses.fields(cls)}
    flags = {o for a in TR.build_parser()._actions for o in a.option_strings}
    for name, tests in AGREEMENT.items():
        assert defaults[name] is False, name  # a config that does not name it runs the plain path
        assert {f"--{name.replace('_', '-')}", f"--no-{name.replace('_', '-')}"} <= flags, name
        for test in tests:
            module, function = test.split("::")
            assert f"def {function}(" in (ROOT / "tests" / module).read_text(), test


def test_no_preset_names_a_fast_path_that_does_not_run_for_it():
    import config as C
    import fastpaths as FP
    for preset in C.preset_names():
        full = C.preset(preset)
        on = [s for s in FP.TRAINING_FAST_PATHS | FP.GENERATION_FAST_PATHS if getattr(full.speed, s)]
        idle = [s for s in on if not FP.fast_path_applies(s, full.model, full.speed)]
        assert idle == [], (preset, idle)
        assert full.train.muon or not full.train.muon_kernel, preset  # Muon's kernel needs Muon


# --- The shape of the house (the plain core and its speed wing) ----------------------------------------------------

def functions(module: str):
    return [n for n in ast.walk(ast.parse((ROOT / f"{module}.py").read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_model_py_is_the_plain_model_a_person_reads():
    """At most 700 lines (ModelConfig's checks are model_checks.py's since the model reached 715 lines with record
    #82's gated XSA; 660 until record #81's dense connections); no kernel module, FP8 or 'does this run here' test in it; Llama.forward of at most 40 lines and 4 parameters; ModelConfig of at most 40
    fields (the house's 26 and room for the newest record's ideas, each a recipe field; 35 until the soft-cap's
    shift and temperature, 37 until XSA, 38 until record #77's saved attention input, 39 until #81's dense
    connections): shape and recipe, no speed switch."""
    import dataclasses
    import fastpaths as FP
    import model as M
    source = (ROOT / "model.py").read_text()
    assert len(source.splitlines()) <= 700
    assert "onegpu_kernels" not in source and "fp8" not in source.lower() and "is_grad_enabled" not in source
    llama = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Llama")
    forward = next(n for n in llama.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert forward.end_lineno - forward.lineno + 1 <= 40 and len(forward.args.args) - 1 <= 4
    fields = {f.name for f in dataclasses.fields(M.ModelConfig)}
    assert len(fields) <= 40 and not fields & set(FP.SPEED_FIELDS)


def test_no_function_over_60_lines_outside_the_triton_kernels():
    """The Triton kernels (onegpu_kernels.py's @triton.jit functions) are one launch each; everything else fits
    a screen."""
    long = []
    for module in LAYERS:
        for n in functions(module):
            jit = any("jit" in ast.unparse(d) for d in n.decorator_list)
            if not jit and n.end_lineno - n.lineno + 1 > 60:
                long.append(f"{module}.{n.name}: {n.end_lineno - n.lineno + 1} lines")
    assert long == []


def test_no_mutable_module_global_switch():
    """A study switch is an argument, never a module global that code flips at run time: no module assigns
    another's upper-case name, and none declares a `global` of an upper-case name."""
    import re
    flips = []
    for module in LAYERS + [p.stem for p in (ROOT / "tests").glob("*.py")]:
        path = ROOT / f"{module}.py" if (ROOT / f"{module}.py").exists() else ROOT / "tests" / f"{module}.py"
        source = path.read_text()
        flips += [f"{module}: {m.group(0)}" for m in re.finditer(r"\b[A-Z]{1,2}\.[A-Z][A-Z0-9_]+\s*=[^=]", source)]
        flips += [f"{module}: {m.group(0)}" for m in re.finditer(r"global [A-Z][A-Z0-9_]+", source)]
        flips += [f"{module}: {m.group(0)}" for m in re.finditer(r'patch\.object\(\w+, "[A-Z][A-Z0-9_]+"', source)]
    assert flips == []


def test_no_comment_quotes_a_measured_rate_and_performance_is_one_screen():
    """A measured figure lives in docs/: code and config comments name the topic. docs/PERFORMANCE.md answers the
    user's questions on one screen (120 lines), its detail in docs/performance/."""
    import re
    rate = re.compile(r"#.*\d[\d,.]* ?(tok/s|TFLOP/s|tokens/s)")
    files = list(ROOT.glob("*.py")) + list(ROOT.glob("configs/**/*.toml"))
    quoted = [f"{p.name}:{i + 1}" for p in files for i, line in enumerate(p.read_text().splitlines()) if rate.search(line)]
    assert quoted == []
    assert len((ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines()) <= 120
