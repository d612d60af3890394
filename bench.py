"""Where the speed comes from: the ladder, one study per setting, and generation, on any GPU.

    python bench.py --ladder                 # FP32 -> TF32 -> BF16 -> compile -> micro-batch -> fused
                                             #   AdamW -> pinned -> each fast path the preset can run ->
                                             #   coordinate descent -> max-autotune
    python bench.py --kernels                # defaults, all kernels stacked, each alone: against compiled BF16
    python bench.py --kernels --repeats 3    # each rung 3 times in turn: the median run and the spread
    python bench.py --ladder --preset 22m    # any preset in configs/
    python bench.py --ladder --resume        # go on from where an interrupted ladder stopped
    python bench.py --attention              # textbook / SDPA backends / document mask, eager and compiled
    python bench.py --compile-modes --micro-batch-sweep --optimizer --activation-checkpointing --profile --loader
    python bench.py --generate               # decode speed: onegpu vs transformers' generate
    python bench.py --decode-parts           # a decoded token's attention and MLP kernels alone, against plain
    python bench.py --loss-curves            # 200 steps without, with each fast path, with the defaults
    python bench.py --budget --tok-s 88m=676284   # hours to train each preset at measured rates

Every training configuration ("rung") is a preset plus overrides, checked by the same strict
loader as config files (a misspelled setting fails before anything runs), and is measured in a
fresh process by measure.py, which uses train.py's own setup() and train_step(). Results go to
stdout as markdown tables and to results/<study>.json and .png. The ladder and the studies need
CUDA to say anything; on CPU they run the tiny preset as a smoke test of the code paths and say so.
"""

import argparse
import dataclasses
from dataclasses import dataclass
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import attention as A
import config as C
import data as D
import fastpaths as FP
import flops as FL
import fp8
import measure as ME
import model as M
import onegpu_kernels as K
import optim as O
import plots as PL
import recipes as RE
import tokenizer as tk
import train as TR

ROOT = Path(__file__).resolve().parent
# ModelConfig's training fast-path switches. The studies' base has them all off: each study and each
# ladder rung switches on what it measures, so every number compares with the same plain model.
# The optimizer's (optim.FAST_PATHS) are train settings.
PLAIN_KERNELS = {**{f"speed__{s}": False for s in FP.TRAINING_FAST_PATHS}, **{f"train__{s}": False for s in O.FAST_PATHS}}


def preset_kernels(preset: str) -> dict:
    """The fast paths the preset's file turns on: what train.py runs with it."""
    cfg = C.preset(preset)
    return {**{f"speed__{s}": getattr(cfg.speed, s) for s in FP.TRAINING_FAST_PATHS},
            **{f"train__{s}": getattr(cfg.train, s) for s in O.FAST_PATHS}}


FAST = {"train__tf32": True, "train__bf16": True, "train__compile": True, **PLAIN_KERNELS}


# --- Plans: which rungs a study compares (pure functions) -----------------------------------

FP32 = {"train__tf32": False, "train__bf16": False, "train__compile": False, "train__optimizer": "foreach",
        **PLAIN_KERNELS}


def ladder_rungs(preset: str, micro_batch: int, steps: int, base: dict | None = None) -> list[ME.Rung]:
    """The ladder's first rungs at one micro-batch, one setting added at a time. base: overrides
    every rung shares (the batch size in tokens)."""
    o = {**(base or {}), "train__micro_batch": micro_batch}
    return [ME.Rung("fp32 eager", preset, {**o, **FP32}, steps),
            ME.Rung("+tf32", preset, {**o, **FP32, "train__tf32": True}, steps),
            ME.Rung("+bf16 autocast", preset, {**o, **FP32, "train__tf32": True, "train__bf16": True}, steps),
            ME.Rung("+torch.compile", preset, {**o, **FP32, **FAST}, steps)]


COMPILE_TUNING = {"+coordinate descent": {"train__compile_mode": "coordinate-descent"},
                  "+max-autotune (no CUDA graphs)": {"train__compile_mode": "max-autotune-no-cudagraphs"}}
def fast_paths(preset: str) -> dict:
    """"+label" -> the setting, for each training fast path of model.TRAINING_FAST_PATHS that the
    preset's model can run (model.fast_path_applies; with the path it refines, model.fast_path_alone), then
    Muon's kernel where the preset runs Muon: the ladder's and the kernels study's rungs."""
    cfg = C.preset(preset)
    model = {f"+{FP.TRAINING_FAST_PATHS[s]}": {f"speed__{k}": on for k, on in FP.fast_path_alone(s).items()}
             for s in FP.runnable_fast_paths(cfg.model)}
    optimizer = {f"+{name}": {f"train__{s}": True} for s, name in O.FAST_PATHS.items()} if cfg.train.muon else {}
    return {**model, **optimizer}


def ladder_tail(preset: str, micro_batch: int, steps: int, base: dict | None = None) -> list[ME.Rung]:
    """After the best micro-batch is found: fused AdamW, pinned copies, the fast paths the preset can
    run (fast_paths), compile tuning (coordinate descent, then max-autotune, which includes it); each
    rung keeps the settings of the ones before it."""
    settings = [("+fused AdamW", {"train__optimizer": "fused"}), ("+pinned memory", {"train__pin": True}),
                *fast_paths(preset).items(), *COMPILE_TUNING.items()]
    return [ME.Rung(name, preset, overrides, steps) for name, overrides in
            stacked(preset, {**(base or {}), **FAST, "train__micro_batch": micro_batch}, settings)]


def stacked(preset: str, overrides: dict, settings) -> list[tuple[str, dict]]:
    """(name, overrides) for each setting added on top of the ones before it, skipping a model fast
    path that those already switched on exclude (the fused loss has its own head, which the FP8 head
    and the loss kernel replace). settings: (name, overrides) pairs, in order."""
    out = []
    for name, setting in settings:
        switch = next((k[len("speed__"):] for k in setting if k.startswith("speed__")), None)
        cfg = ME.Rung(name, preset, overrides).config() if switch else None
        if switch and not FP.fast_path_applies(switch, cfg.model, cfg.speed):
            continue
        overrides = {**overrides, **setting}
        out.append((name, overrides))
    return out


ATTENTION_VARIANTS = ["textbook", "math", "efficient", "cudnn", "flash", "sdpa", "doc-mask"]


def attention_rungs(preset: str, micro_batch: int, steps: int, only=None) -> list[ME.Rung]:
    rungs = []
    for variant in [v for v in ATTENTION_VARIANTS if not only or v in only]:
        kind = "sdpa" if variant == "doc-mask" else variant
        for compiled in (False, True):
            rungs.append(ME.Rung(f"{variant} {'compiled' if compiled else 'eager'}", preset,
                                 {**FAST, "train__compile": compiled, "train__micro_batch": micro_batch,
                                  "speed__attention": kind, "train__doc_mask": variant == "doc-mask"},
                                 steps, kernels=True))
    return rungs


def kernel_rungs(preset: str, micro_batch: int, steps: int, base: dict | None = None) -> list[ME.Rung]:
    """Compiled BF16 with fused AdamW; the preset's fast paths together, what `train.py` gains over
    plain torch.compile (second, so that a run cut short still answers that); the defaults with every
    other fast path the preset can run stacked on them (third: how far the kernels we have go together);
    then each fast path, and Inductor's own kernel tuning, switched on alone against the first: which of
    them pays at this preset, apart from the order of the ladder's rungs. The compile tuning comes last
    because max-autotune autotunes for about five minutes at 88m."""
    o = {**(base or {}), **FAST, "train__optimizer": "fused", "train__micro_batch": micro_batch}
    defaults = {**o, **preset_kernels(preset)}
    every = ([("", defaults)] + stacked(preset, defaults, fast_paths(preset).items()))[-1][1]
    alone = lambda switches: [ME.Rung(name, preset, {**o, **s}, steps) for name, s in switches.items()]  # noqa: E731
    # a preset whose defaults already run every fast path gets no third rung: it would time them again
    stack = [ME.Rung("the defaults + every other fast path", preset, every, steps)] if every != defaults else []
    return [ME.Rung("compiled BF16, fused AdamW", preset, o, steps),
            ME.Rung("the preset's defaults", preset, defaults, steps), *stack,
            *alone(fast_paths(preset)), *alone(COMPILE_TUNING)]


def compile_mode_rungs(preset: str, micro_batch: int, steps: int) -> list[ME.Rung]:
    return [ME.Rung(mode, preset, {**FAST, "train__micro_batch": micro_batch, "train__compile_mode": mode,
                                   "train__optimizer": "fused"}, steps)
            for mode in C.CompileMode.__args__]


PLAN_KEYS = {"preset", "steps", "rung"}
RUNG_KEYS = {"name", "plain", "model", "speed", "data", "train"}


def check_rung_table(table, where: str, configs: dict):
    """Refuse in one line a [[rung]] table without a name of its own, with an unknown key, a section that is not
    a table, or a plain = that is not true or false."""
    if not isinstance(table, dict) or not isinstance(table.get("name"), str) or table["name"] in configs:
        raise ValueError(f"{where}: each [[rung]] needs a name of its own (name = \"...\")")
    extra = sorted(set(table) - RUNG_KEYS)
    if extra:
        raise ValueError(f"{where} ({table['name']}): unknown key(s) {extra}; a rung has {sorted(RUNG_KEYS)}")
    for section in C.SECTIONS:
        if not isinstance(table.get(section, {}), dict):
            raise ValueError(f"{where} ({table['name']}): {section} = {table[section]!r} must be a table of "
                             f"settings, e.g. {section} = {{ micro_batch = 32 }}")
    if not isinstance(table.get("plain", False), bool):
        raise ValueError(f"{where} ({table['name']}): plain = {table['plain']!r}: give true (every fast path "
                         f"off, then this rung's settings) or false")


def checked_config(rung: ME.Rung, table: dict, where: str, configs: dict) -> C.Config:
    """The rung's config through the strict loader, refusing a fast path it names that cannot run for its model
    (the rung would be timed without it under its name) and a config an earlier rung already times."""
    try:
        cfg = rung.config()
        TR.accumulation_steps(cfg.train.batch_tokens, cfg.train.micro_batch, cfg.model.context, 1)
    except ValueError as e:
        raise ValueError(f"{where} ({table['name']}): {e}") from None
    asked = C.moved({s: table.get(s, {}) for s in ("model", "speed")}).get("speed", {})
    idle = [s for s in asked if s in FP.TRAINING_FAST_PATHS and getattr(cfg.speed, s)
            and not FP.fast_path_applies(s, cfg.model, cfg.speed)]
    if idle:
        raise ValueError(f"{where} ({table['name']}): speed.{idle[0]} = true does not run for this rung's model "
                         f"(fastpaths.fast_path_applies: e.g. the fused ReLU² not beside fp8): drop it, or turn off "
                         f"the setting it cannot run beside")
    # --repeats is how a plan asks for a rung again; two rungs of one config time one thing under two names
    same = next((name for name, other in configs.items() if other == cfg), None)
    if same:
        raise ValueError(f"{where} ({table['name']}): runs the same settings as rung '{same}' with preset "
                         f"{rung.preset}: drop one, or change what it sets (the preset may already set it)")
    return cfg


def plan_rungs(path: Path, preset: str | None = None, steps: int | None = None) -> list[ME.Rung]:
    """The rungs of a plan file (`python bench.py --plan FILE`): a preset, timed steps, and named
    rungs whose [model] / [speed] / [data] / [train] tables override the preset, e.g.

        preset = "88m"
        [[rung]]
        name = "plain compiled"
        train = { compile = true, micro_batch = 64 }
        speed = { fused_swiglu = false }

    `plain = true` turns every training fast path off first (PLAIN_KERNELS, from fastpaths.TRAINING_FAST_PATHS
    and optim.FAST_PATHS), so a plain rung stays plain when a preset gains a fast path; its own tables
    then switch on what it measures. Every rung's config goes through the strict loader here, so a
    misspelled key fails before any process starts. preset and steps given on the command line win over
    the file's."""
    values = C.read_plan(path)
    unknown = sorted(set(values) - PLAN_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; a plan has {sorted(PLAN_KEYS)}")
    timed = values.get("steps", 3)
    if not isinstance(timed, int) or isinstance(timed, bool) or timed < 1:
        raise ValueError(f"{path}: steps = {timed!r}: give the timed steps per rung as a whole number, 1 or more")
    if not isinstance(values.get("preset", "88m"), str):
        raise ValueError(f"{path}: preset = {values['preset']!r}: give a preset's name, e.g. preset = \"88m\"")
    tables = values.get("rung") or []
    if not isinstance(tables, list):
        raise ValueError(f"{path}: rung = {tables!r}: each rung is a [[rung]] table (name = \"...\" and its "
                         f"settings), one after another")
    rungs, configs = [], {}
    for i, table in enumerate(tables):
        where = f"{path}: rung {i + 1}"
        check_rung_table(table, where, configs)
        overrides = {**(PLAIN_KERNELS if table.get("plain") else {}),
                     **{f"{section}__{k}": v for section, settings in C.moved(
                         {s: table.get(s, {}) for s in C.SECTIONS}).items() for k, v in settings.items()}}
        rung = ME.Rung(table["name"], preset or values.get("preset", "88m"), overrides,
                       timed_steps=steps or values.get("steps", 3))
        configs[table["name"]] = checked_config(rung, table, where, configs)
        rungs.append(rung)
    if not rungs:
        raise ValueError(f"{path}: no [[rung]] tables: add one per configuration to measure")
    return rungs


CPU_PLAN = {"train__micro_batch": 4, "train__compile": False}  # a plan's rung as the CPU smoke test runs it


def cpu_sized(rung: ME.Rung, preset: str | None) -> ME.Rung:
    """A plan's rung for a CPU: the tiny preset (or the one asked for), four sequences a micro-batch and
    two a step, no compile, two timed steps; the rung's other settings as the plan has them."""
    overrides = {k: v for k, v in rung.overrides.items() if k != "train__batch_tokens"} | CPU_PLAN
    small = ME.Rung(rung.name, preset or "tiny", overrides, min(2, rung.timed_steps))
    context = small.config().model.context
    return dataclasses.replace(small, overrides={**overrides, "train__batch_tokens": 2 * 4 * context})


def largest_fitting(make, sizes, cuda: bool, timeout: int, journal: ME.Journal | None = None) -> dict:
    """The first of sizes (largest first) whose rung runs."""
    for mb in sizes:
        row = ME.run([make(mb)], cuda, timeout, journal)[0]
        if "skipped" not in row:
            return row
        print(f"  micro-batch {mb}: {row['skipped']}", flush=True)
    return {"rung": make(sizes[-1]).name, "skipped": "no micro-batch fits"}


FIRST_TOKENS = 64 * 1024  # the largest micro-batch the ladder's first rung tries, in tokens


def ladder(preset: str, batch_tokens: int, steps: int, cuda: bool, timeout: int,
           journal: ME.Journal | None = None) -> list[dict]:
    context = C.preset(preset).model.context
    base = {"train__batch_tokens": batch_tokens}
    # From 64 sequences of 1,024 tokens down: at most 65,536 tokens a micro-batch for the first, fp32 eager
    # rung, so a preset of 8,192-token sequences starts at 8 and not at a micro-batch that cannot fit
    # (each that does not costs a process start and a failed first step).
    fits = [mb for mb in (64, 32, 16, 8, 4, 2, 1)
            if batch_tokens % (mb * context) == 0 and mb * context <= FIRST_TOKENS]
    first = largest_fitting(lambda mb: ladder_rungs(preset, mb, steps, base)[0], fits if cuda else [4], cuda,
                            timeout, journal)
    mb = first.get("micro_batch", 4)
    rest = ladder_rungs(preset, mb, steps, base)[1:]
    if not cuda:  # the ladder's settings are CUDA settings: the CPU smoke test stops at its first rung
        return [first] + [{"rung": r.name, "skipped": ME.cpu_skip(r) or "CUDA-only setting"}
                          for r in rest + ladder_tail(preset, mb, steps, base)]
    rows = [first] + ME.run(rest, cuda, timeout, journal)
    best, compiled = rows[-1], len(rows) - 1  # from this row on, the compiled BF16 settings at each micro-batch
    for size in (16, 32, 64, 128, 256, 512):
        if size <= mb or batch_tokens % (size * context):
            continue
        name = f"micro-batch {size}"
        too_big = does_not_fit(rows[compiled:], size)
        row = {"rung": name, "skipped": too_big} if too_big else ME.run(
            [ME.Rung(name, preset, {**base, **FAST, "train__micro_batch": size}, steps)], cuda, timeout, journal)[0]
        rows.append(row)
        if "skipped" in row:
            break
        if row["tok_s"] > best.get("tok_s", 0):
            best = row
    return rows + ME.run(ladder_tail(preset, best.get("micro_batch", mb), steps, base), cuda, timeout, journal)


def micro_batch_study(preset: str, batch_tokens: int, steps: int, cuda: bool, timeout: int, ac: bool = False,
                      start: int = 1, journal: ME.Journal | None = None) -> list[dict]:
    """Doubling micro-batches from start until one no longer fits (or the step cannot be split further)."""
    rows, size = [], start
    context = C.preset(preset).model.context
    limit = 1024 if cuda else 4
    while size <= limit:
        name = f"micro-batch {size}{' +AC' if ac else ''}"
        row = ME.run([ME.Rung(name, preset, {**FAST, "train__compile": cuda, "train__batch_tokens": batch_tokens,
                                           "train__micro_batch": size, "train__activation_checkpointing": ac},
                           steps)], True, timeout, journal)[0]  # compile off on CPU: every size runs there too
        rows.append(row)
        if "skipped" in row or batch_tokens % (2 * size * context) != 0:
            break
        size *= 2
    fit = memory_line([r for r in rows if r.get("peak_gib")])
    return rows + ([fit] if fit else [])


def does_not_fit(rows: list[dict], micro_batch: int, margin: float = 0.95) -> str | None:
    """Why micro_batch will not fit, from the memory line through the measured rows of the same settings
    (None when it may, or when fewer than two rows were measured): each size that does not fit would cost
    a process start and a compile before its first step fails (about two minutes at 88m on an H200)."""
    measured = [r for r in rows if r.get("peak_gib") and r.get("device_gib")]
    fit = memory_line(measured)
    if fit is None:
        return None
    peak, card = fit["fixed_gib"] + fit["gib_per_seq"] * micro_batch, measured[-1]["device_gib"]
    if peak <= margin * card:
        return None
    return f"predicted peak {peak:.0f} GiB from the micro-batches before it, over {margin:.0%} of the card's {card:.0f} GiB"


def memory_line(rows: list[dict]) -> dict | None:
    """Peak memory = fixed + slope * sequences, least squares over the measured rows."""
    if len(rows) < 2:
        return None
    slope, fixed = np.polyfit([r["micro_batch"] for r in rows], [r["peak_gib"] for r in rows], 1)
    return {"rung": "fit", "fixed_gib": round(float(fixed), 3), "gib_per_seq": round(float(slope), 4),
            "largest_fitting": max(r["micro_batch"] for r in rows)}


def activation_checkpointing_study(preset, batch_tokens, micro_batch, steps, cuda, timeout,
                                   journal: ME.Journal | None = None) -> list[dict]:
    """Recomputation's cost at equal micro-batch: none, only each block's norm + SwiGLU
    (recompute_mlp), whole blocks; then how far the micro-batch can grow with whole-block
    recomputation: that sweep starts at the compared size, so its first row is the comparison."""
    base = {**FAST, "train__compile": cuda, "train__batch_tokens": batch_tokens, "train__micro_batch": micro_batch}
    plain = ME.run([ME.Rung(f"micro-batch {micro_batch}", preset, base, steps),
                 ME.Rung(f"micro-batch {micro_batch} +recompute MLP", preset, {**base, "train__recompute_mlp": True},
                         steps)], True, timeout, journal)
    return plain + micro_batch_study(preset, batch_tokens, steps, cuda, timeout, ac=True, start=micro_batch,
                                     journal=journal)


def optimizer_study(preset: str, cuda: bool) -> list[dict]:
    """Device time of clip + update (median of 20): AdamW in each implementation on every
    parameter, then Muon's part alone (the block matrices), ours (with and without onegpu_kernels.gram, which
    runs on CUDA only) against torch.optim.Muon."""
    device = torch.device("cuda" if cuda else "cpu")
    model = M.Llama(C.preset(preset).model).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rows, timing = [], {"repeats": 20, "warmup": 5} if cuda else {"repeats": 2, "warmup": 1}  # CPU: a smoke test
    for impl in ("fused", "foreach", "for-loop"):
        if impl == "fused" and not cuda:
            rows.append({"rung": f"AdamW {impl}", "skipped": "fused AdamW is measured on CUDA only"})
            continue
        opt = O.configure_optimizer(model, C.TrainConfig(steps=1, optimizer=impl))
        rows.append({"rung": f"AdamW {impl}", "update_ms": round(ME.update_ms(model, opt, device, **timing), 3)})
    matrices = O.param_groups(model)["matrices"]
    ours = [O.Muon([{"params": [p for _, p in matrices], "splits": [O.stacked_rows(n, p, model.cfg) for n, p in matrices]}],
                   kernel=kernel) for kernel in (False, True)]
    theirs = torch.optim.Muon([p for _, p in matrices], lr=0.02, adjust_lr_fn="original")
    for name, opt in (("Muon: optim.Muon (parts split, equal shapes batched)", ours[0]),
                      ("Muon: optim.Muon with the symmetric Gram kernel (train.muon_kernel)", ours[1]),
                      ("Muon: torch.optim.Muon (one matrix at a time)", theirs)):
        if opt is ours[1] and not cuda:
            rows.append({"rung": name, "skipped": "a Triton kernel: measured on CUDA only"})
            continue
        rows.append({"rung": name, "update_ms": round(ME.update_ms(model, opt, device, **timing), 3)})
    return rows


def loss_study(preset: str, micro_batch: int, cuda: bool) -> list[dict]:
    """Milliseconds of one micro-batch's training loss (micro_batch x context tokens against the
    preset's vocabulary and soft-cap, median of 20 after 5 warm-ups): forward alone and forward plus
    backward, the plain loss against the loss kernel, each compiled on CUDA, on bf16 logits and, for
    an untied head, behind the FP8 head (x of width d_model): apart (fp8.fp8_linear, then the loss),
    and as one function (fp8.fp8_head_cross_entropy, which the model runs where both are on, with its
    weight gradient in bf16 and in FP8, the FP8 one's operand transposed by Inductor's copy and by
    onegpu_kernels.transposed; its forward also writes the logits' gradient, so its forward_ms is not comparable
    with the others'), and the multi-token loss over four targets behind it, apart and as one function."""
    speed = C.preset(preset).speed
    mcfg = C.preset(preset).model
    device = torch.device("cuda" if cuda else "cpu")
    n, dtype = micro_batch * mcfg.context, torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device).manual_seed(0)
    targets = torch.randint(0, mcfg.vocab_size, (n,), device=device, generator=g)
    logits = (3 * torch.randn(n, mcfg.vocab_size, device=device, generator=g)).to(dtype).requires_grad_()
    x = torch.randn(n, mcfg.d_model, device=device, generator=g).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(mcfg.vocab_size, mcfg.d_model, device=device, generator=g)).requires_grad_()
    cap = mcfg.logit_softcap
    # (name, loss of its input, the input, whether only CUDA runs it)
    kernel_loss = lambda z: K.cross_entropy(z, targets, cap)[0].mean()  # noqa: E731
    cases = [("plain loss", lambda z: M.cross_entropy(z, targets, cap), logits, False),
             ("loss kernel", kernel_loss, logits, True)]

    def under_autocast(loss):  # the FP8 head's cases start from x, as the model hands it over
        def run(x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return loss(x)
        return run

    if FP.fast_path_applies("fp8_head", mcfg, speed):  # an untied head, its forward product as the preset runs it
        accum, one = speed.fp8_fast_accum, fp8.fp8_head_cross_entropy  # named here, so a CPU run resolves it too
        head = lambda x, bound=1.0: fp8.fp8_linear(x, w, grad_bound=bound / n, fast_accum=accum)  # noqa: E731
        # the multi-token loss as the 126m default starts it: 3 tokens ahead and the prefix token (M.MultiTargets)
        ahead = torch.randint(0, mcfg.vocab_size, (n, 4), device=device, generator=g)
        shares = torch.tensor([1.0, 0.5, 0.25, 0.25], device=device)
        cases += [(name, under_autocast(loss), x, True) for name, loss in (
            ("FP8 head + plain loss", lambda x: M.cross_entropy(head(x), targets, cap)),
            ("FP8 head + loss kernel, apart", lambda x: kernel_loss(head(x))),
            ("FP8 head + loss kernel, one function, bf16 weight gradient",
             lambda x: one(x, w, targets, cap, fp8_weight_grad=False, fast_accum=accum)),
            ("FP8 head + loss kernel, one function, FP8 weight gradient, the gradient transposed by Inductor",
             lambda x: one(x, w, targets, cap, fp8_weight_grad=True, transpose_kernel=False, fast_accum=accum)),
            ("FP8 head + loss kernel, one function, FP8 weight gradient, the gradient transposed by our kernel",
             lambda x: one(x, w, targets, cap, fp8_weight_grad=True, transpose_kernel=True, fast_accum=accum)),
            ("FP8 head + multi-token loss kernels (4 targets), apart",
             lambda x: K.multi_cross_entropy(head(x, 4.0), ahead, shares, cap)[0].mean()),
            ("FP8 head + multi-token loss (4 targets), one function, bf16 weight gradient",
             lambda x: one(x, w, ahead, cap, fp8_weight_grad=False, fast_accum=accum, weights=shares)))]
    rows, timing = [], {"repeats": 20, "warmup": 5} if cuda else {"repeats": 2, "warmup": 1}  # CPU: a smoke test
    for name, fn, inp, cuda_only in cases:
        if cuda_only and not cuda:
            rows.append({"rung": name, "skipped": "a Triton kernel or an FP8 matmul: measured on CUDA only"})
            continue
        fn = torch.compile(fn) if cuda else fn
        forward_backward = ME.backward_from_scratch(lambda: fn(inp), (inp, w))
        rows.append({"rung": name, "forward_ms": round(1000 * ME.median_seconds(lambda: fn(inp), device, **timing), 3),
                     "ms": round(1000 * ME.median_seconds(forward_backward, device, **timing), 3)})
    return rows


def parts_study(preset: str, micro_batch: int, cuda: bool) -> list[dict]:
    """Milliseconds of one micro-batch (micro_batch x context tokens) through each block part that a
    fused kernel replaces, forward and backward, compiled, plain against fused, at the preset's shape
    under bf16 autocast on bf16 inputs (median of 20 after 5 warm-ups): the ReLU² MLP (model.fused_relu2) and
    QK-norm + RoPE on the qkv projection's output (model.fused_qk_norm_rope), each through the model's
    own module. Muon's kernel is --optimizer's row."""
    mcfg = C.preset(preset).model
    device = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator(device).manual_seed(0)
    B, T, hd = micro_batch, mcfg.context, mcfg.head_dim
    # In bf16 on CUDA, as the model hands them over under autocast: qkv from a bf16 matmul, x from a norm of
    # the bf16 residual stream. (Float32 inputs would time an extra cast and twice the bytes.)
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(B, T, mcfg.d_model, device=device, generator=g).to(dtype).requires_grad_()
    qkv = torch.randn(B, T, mcfg.n_heads + 2 * mcfg.n_kv_heads, hd, device=device, generator=g).to(dtype).requires_grad_()
    cos, sin = (t.float().to(device) for t in M.rope_tables(hd, T, mcfg.rope_theta, mcfg.rope_truncate))
    rows, timing = [], {"repeats": 20, "warmup": 5} if cuda else {"repeats": 2, "warmup": 1}  # CPU: a smoke test
    for fused in (False, True):
        parts = []
        if mcfg.mlp == "relu2":
            mlp = M.ReLU2(mcfg).to(device)
            if fused:
                FP.swap(mlp, FP.FusedReLU2)
            parts.append((f"ReLU² MLP ({mcfg.d_model} -> {mcfg.ffn_hidden} -> {mcfg.d_model})", "fused_relu2",
                          lambda: mlp(x), x))
        if mcfg.qk_norm:
            attn = M.Attention(mcfg, layer=0).to(device)
            if fused:
                FP.swap(attn, FP.FusedQKAttention)
            parts.append(("QK-norm + RoPE", "fused_qk_norm_rope", lambda: torch.cat(attn.heads(qkv, (cos, sin)), 2), qkv))
        for name, switch, part, inp in parts:
            if fused and not cuda:
                rows.append({"rung": f"{name}, fused", "skipped": "a Triton kernel: measured on CUDA only"})
                continue

            def forward(part=part):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    return part()
            fn = torch.compile(forward) if cuda else forward
            out = fn()
            grad = torch.randn(out.shape, device=device, generator=g).to(out.dtype)
            rows.append({"rung": f"{name}, {'fused' if fused else 'plain'}", "switch": switch,
                         "forward_ms": round(1000 * ME.median_seconds(fn, device, **timing), 3),
                         "ms": round(1000 * ME.median_seconds(ME.backward_from_scratch(fn, (inp,), grad), device,
                                                               **timing), 3)})
    return rows


def attended_pairs(doc_ids: torch.Tensor, window: int) -> int:
    """(query, key) pairs causal attention within documents (doc_ids (B, T)) and `window` keys (0: all)
    computes: each token sees the tokens of its document up to itself, at most `window` of them."""
    T = doc_ids.shape[1]
    pos = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    first = torch.zeros_like(doc_ids, dtype=torch.long)
    first[:, 1:] = torch.where(doc_ids[:, 1:] != doc_ids[:, :-1], pos[:, 1:], 0)
    seen = pos - first.cummax(dim=1).values + 1  # tokens of its document up to itself
    return int((seen.clamp(max=window) if window else seen).sum())


# FlexAttention's kernel options that --attention-rate times at the long window, against Inductor's own
# choice. Its choice for head size 128 on Hopper (torch 2.13's template heuristics): forward tiles of
# 128 queries x 64 keys, 8 warps, 3 stages; backward 64 x 128 and 128 x 64, 8 warps, 3 stages. The backward
# took 39.0 of 55.7 ms of attention in the 88m default's step (docs/performance/training-speed.md, where the time goes).
FLEX_CANDIDATES = [
    ("every row sees a key", {"ROWS_GUARANTEED_SAFE": True}),  # causal: each query sees itself
    ("TMA loads", {"USE_TMA": True}),
    ("backward 64 x 64 tiles, 4 warps", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                                         "bwd_BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3}),
    ("backward 32 x 128 tiles, 4 warps", {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                          "bwd_BLOCK_N2": 32, "bwd_num_warps": 4, "bwd_num_stages": 3}),
    ("forward 128 x 128 tiles, 8 warps, 2 stages", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8,
                                                    "fwd_num_stages": 2}),
]


def attention_rate_study(preset: str, micro_batch: int, cuda: bool) -> list[dict]:
    """TFLOP/s of one layer's attention, forward and backward (median of 20 after 5 warm-ups), at the
    preset's shape (micro_batch sequences of its context, its heads, bf16): cuDNN's dense causal attention,
    then FlexAttention causal, and with documents masked apart (lengths drawn from 500 to 5,500 tokens)
    at the long and short windows the preset's schedule starts and ends with (train.window_at), then at the
    long window with each of FLEX_CANDIDATES' kernel options in place of Inductor's own; then FlashAttention-2's
    varlen kernels at each window (varlen_cases). FLOPs count the
    (query, key) pairs each computes: 4 hd a pair forward (two matmuls), 2.5 times that backward
    (FlashAttention-2's count), so a masked-out block adds no FLOPs and a kernel that computes it anyway
    shows a lower rate. kernel_ms: the device time of the call's kernels alone (torch.profiler)."""
    cfg = C.preset(preset)
    mcfg = cfg.model
    if not cuda:
        return [{"rung": "attention kernels", "skipped": "cuDNN and FlexAttention's kernels: measured on CUDA only"}]
    device, B, T = torch.device("cuda"), micro_batch, mcfg.context
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(B, h, T, mcfg.head_dim, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (mcfg.n_heads, mcfg.n_kv_heads, mcfg.n_kv_heads))
    starts = torch.zeros(B, T, dtype=torch.int32, device=device)
    starts[:, torch.cumsum(torch.randint(500, 5500, (T // 500,), device=device, generator=g), 0).clamp(max=T - 1)] = 1
    doc = torch.cumsum(starts, dim=1, dtype=torch.int32)
    causal = torch.zeros_like(doc)
    windows = sorted({w for step in (0, 1) for w in TR.window_at(step, 1, cfg) if 0 < w < T}) or [0]
    cases = [("cuDNN, dense causal", dict(mask=A.Mask(), backend="cudnn"), causal, 0),
             ("FlexAttention, causal", dict(mask=A.Mask(block_mask=A.flex_block_mask(None, 0, T, device))), causal, 0)]
    masks = {w: A.Mask(block_mask=A.flex_block_mask(doc, w, T, device)) for w in windows}
    cases += [(f"FlexAttention, documents, window {w or T}", dict(mask=masks[w]), doc, w) for w in windows]
    long = max(windows)
    cases += [(f"FlexAttention, documents, window {long or T}, {name}",
               dict(mask=masks[long], flex_options=options), doc, long) for name, options in FLEX_CANDIDATES]
    # one compiled flex_attention, recompiled for each candidate's options: past dynamo's limit (8) it would
    # fall back to the eager, unfused attention and time that
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(cases))
    rows, scale = [], mcfg.attn_scale or None
    # FlashAttention-2's variable-length kernels with a window (torch.nn.attention.varlen, in torch 2.11):
    # the documents as its sequences, q, k and v as (tokens, heads, hd), as the QKV projection
    # leaves them. Not what the model runs (docs/LOG.md, 2026-12-04): a row to compare with.
    varlen = varlen_cases(q, k, v, doc, windows, scale)
    cases += [(name, None, doc, w) for name, w in varlen]
    for name, how, ids, window in cases:
        if how is None:
            run = varlen[name, window]
        else:
            run = ME.backward_from_scratch(lambda: A.attend(q, k, v, scale=scale, **how).sum(), (q, k, v))
        try:
            seconds = ME.median_seconds(run, device, repeats=20, warmup=5)
        except Exception as e:  # cuDNN refuses some shapes, an option may not build here: say so, go on
            rows.append({"rung": name, "skipped": str(e).splitlines()[0][:200]})
            continue
        flops = 3.5 * 4 * mcfg.head_dim * mcfg.n_heads * attended_pairs(ids, window)
        # The kernels' own time too: wall time around a call also holds its launch and guard overhead,
        # which at small windows is most of it (a compiled model pays it per layer as well).
        kernel_s = sum(ME.kernel_times(run, device).values()) / 1000
        rows.append({"rung": name, "ms": round(1000 * seconds, 3), "tflops": round(flops / seconds / 1e12, 1),
                     "kernel_ms": round(1000 * kernel_s, 3), "kernel_tflops": round(flops / kernel_s / 1e12, 1)})
    return rows


def varlen_cases(q, k, v, doc, windows, scale) -> dict:
    """attention_rate_study's FlashAttention-2 varlen rows: {(name, window): a timed forward and backward}
    over copies of q, k, v (B, heads, T, hd) laid out (B x T, heads, hd), the documents of doc (B, T) as
    its sequences; none where this torch has no varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    B, T = doc.shape
    flat = doc.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True  # every sequence of the batch starts a document
    bounds = torch.cat([starts.nonzero().squeeze(1), torch.tensor([B * T], device=doc.device)]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    q, k, v = (t.detach().transpose(1, 2).reshape(B * T, t.shape[1], t.shape[3]).contiguous().requires_grad_()
               for t in (q, k, v))
    def run(window):
        return ME.backward_from_scratch(lambda: varlen_attn(q, k, v, bounds, bounds, longest, longest, scale=scale,
                                                            window_size=(window - 1 if window else -1, 0)).sum(),
                                        (q, k, v))
    return {(f"FlashAttention-2 varlen, documents, window {w or T}", w): run(w) for w in windows}


def loader_study(preset: str, micro_batch: int) -> list[dict]:
    """CPU microseconds per micro-batch of the shard loader, without and with document ids, on a
    shard of random tokens (the loader's cost does not depend on what the tokens say)."""
    mcfg = C.preset(preset).model
    with tempfile.TemporaryDirectory() as tmp:
        files = D.random_shards(Path(tmp), mcfg.vocab_size, 4 * micro_batch * mcfg.context + 1)
        return [{"rung": f"micro-batch {micro_batch} x {mcfg.context}" + (", document ids" if doc_ids else ""),
                 "cpu_us": round(ME.loader_us(D.ShardLoader(files, micro_batch, mcfg.context, doc_ids=doc_ids)), 1)}
                for doc_ids in (False, True)]


def profile_switches(preset: str, args) -> dict:
    """--profile's switches: the preset's fast paths with --defaults (preset_kernels), then each fast-path flag
    given (--fp8, --loss-kernel, ...) on."""
    return {**(preset_kernels(preset) if args.defaults else {}),
            **{f"speed__{m}": True for m in FP.TRAINING_FAST_PATHS if getattr(args, m)}}


def profile_study(preset: str, micro_batch: int, cuda: bool, switches: dict | None = None,
                  corpus: str | None = None) -> list[dict]:
    """Time per kernel class over 2 micro-batches and one optimizer step, at the sliding window the
    preset ends its schedule with and the loss's targets it starts with, and the rate of the classes whose
    FLOPs are known (matmul: 6N per token over the weights that multiply; attention: PaLM's 12LHQT, a
    window's layer at min(T, 2w) keys). The last row is the GPU's idle time: the same step's median wall
    time less its kernels', with the gaps between kernels in the profiled step (their sum and the largest,
    in the JSON's top_kernels).
    switches: the model switches to profile with on (none: the compiled BF16 base). corpus: profile
    on that prepared corpus, documents as it trains on them (None: random tokens, no corpus needed)."""
    base = C.preset(preset)
    context = (switches or {}).get("model__context") or base.model.context  # a batch of the two micro-batches
    data = RE.corpus_settings(base, corpus) if corpus else {}
    rung = ME.Rung("profile", preset, {**FAST, "train__compile": cuda, "train__micro_batch": micro_batch,
                                       "train__batch_tokens": 2 * micro_batch * context,
                                       "train__optimizer": "fused" if cuda else "foreach",
                                       **data, **(switches or {})}, 1)
    with tempfile.TemporaryDirectory() as workdir:
        r = TR.setup(rung.config(), log=lambda *a, **k: None, random_tokens_dir=None if corpus else Path(workdir))
        windows = r.cfg.model.windows()
        step = lambda: TR.train_step(r.model, r.optimizer, r.train_loader.next_batch, 2, r.cfg.train,  # noqa: E731
                                     r.device, 1e-4, windows=windows, prefetch=r.train_loader.prefetch,
                                     **TR.step_terms(r, 0))[0].item()
        step()  # warm-up and compile
        wall_ms = 1000 * statistics.median(ME.timed(step, r.device)[1] for _ in range(3))
        spans = []
        names = ME.kernel_times(step, r.device, spans)
    classes, top = {}, {}
    for name, ms in sorted(names.items(), key=lambda kv: -kv[1]):
        label = ME.kernel_class(name)
        classes[label] = classes.get(label, 0.0) + ms
        top.setdefault(label, []).append(f"{ms:.2f} ms {name[:100]}")
    mcfg = r.cfg.model
    tokens = 2 * micro_batch * mcfg.context  # what the profiled step ran: its FLOPs count at the model's own context
    matmul = 6 * FL.multiplied_params(mcfg)
    flops = {"matmul": matmul * tokens, "attention": (FL.flops_per_token(mcfg) - matmul) * tokens}
    if cuda:  # on a CPU the profile's times are the CPU's own, nested and overlapping: no idle time to read
        classes["GPU idle (wall less kernels)"] = max(0.0, wall_ms - sum(classes.values()))
        # where it idled, in the profiled step (the profiler adds its own cost to the host's launches): between
        # kernels, and the time before the first kernel and after the last, which the timed wall also holds
        between, gaps, largest = ME.gaps_between(spans)
        top["GPU idle (wall less kernels)"] = [f"{wall_ms:.2f} ms wall, median of 3 steps, unprofiled",
                                               f"{between:.2f} ms between kernels in {gaps:,} gaps, profiled; "
                                               f"the largest:", *largest]
        print("GPU idle: " + "\n  ".join(top["GPU idle (wall less kernels)"][:6]), flush=True)
    total = sum(classes.values())
    # top_kernels (in the JSON): enough of each class's largest kernels to see where its time goes
    return [{"rung": c, "ms": round(ms, 2), "share": ms / total,
             "tflops": flops[c] / (ms / 1000) / 1e12 if c in flops and ms > 0 else None, "top_kernels": top[c][:15]}
            for c, ms in sorted(classes.items(), key=lambda kv: -kv[1])]


# --- Loss curves ---------------------------------------------------------------------------

def flag(switch: str, on: bool = True) -> str:
    """train.py's (and --profile's) flag for a ModelConfig switch: fused_loss -> --fused-loss."""
    return f"--{'' if on else 'no-'}{switch.replace('_', '-')}"


def plot_curves(curves: dict, title: str, path: Path):
    if curves:
        PL.plot_lines({name: (range(1, len(losses) + 1), losses, "-") for name, losses in curves.items()},
                      "step", "training loss (nats)", title, path)


# --- Output ----------------------------------------------------------------------------------

def fmt(v, spec=",.0f"):
    return "" if v is None else format(v, spec)


def ladder_table(rows: list[dict], flops_tok: int, roof: float | None, spec_peak: float | None) -> str:
    head = ("| rung | micro-batch | tok/s | step s | x prev | x first | MFU (roof) | MFU (spec) | peak GiB "
            "| warm-up s | SM MHz | W | tok/s per GHz | spread |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    prev = first = None
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['rung']} | {r.get('micro_batch') or ''} | skipped: {r['skipped']} |" + " |" * 11)
            continue
        tok = r["tok_s"]
        first = first or tok
        mfu_roof = FL.mfu(tok, flops_tok, roof * 1e12) if roof else None
        mfu_spec = FL.mfu(tok, flops_tok, spec_peak * 1e12) if spec_peak else None
        per_ghz = tok / (r["sm_mhz"] / 1000) if r.get("sm_mhz") else None
        lines.append(f"| {r['rung']} | {r['micro_batch']} | {tok:,.0f} | {r['step_s']:.3f} | "
                     f"{fmt(tok / prev if prev else None, '.2f')} | {tok / first:.2f} | {fmt(mfu_roof, '.1%')} | "
                     f"{fmt(mfu_spec, '.1%')} | {fmt(r.get('peak_gib'), '.2f')} | {r['warmup_s']:.1f} | "
                     f"{fmt(r.get('sm_mhz'), '.0f')} | {fmt(r.get('power_w'), '.0f')} | {fmt(per_ghz)} | {r['spread']:.1%} |")
        prev = tok
    return "\n".join(lines)


def simple_table(rows: list[dict]) -> str:
    keys = [k for k in ("micro_batch", "batch", "tok_s", "runs", "runs_spread", "step_s", "peak_gib",
                        "reserved_gib", "warmup_s", "attention_kernels", "update_ms", "cpu_us", "forward_ms", "ms", "share", "tflops", "kernel_ms", "kernel_tflops",
                        "fixed_gib", "gib_per_seq", "largest_fitting", "first_token_ms", "prefill_tok_s",
                        "decode_tok_s", "replay_us", "kernels", "busy_us", "same_greedy_tokens")
            if any(k in r for r in rows)]
    # The clock and power over a rung's timed steps (NVML): a card held at its power limit clocks down the more the
    # faster its kernels go, which moves the ratios between rungs by several percent (docs/PERFORMANCE.md).
    keys += [k for k in ("sm_mhz", "power_w") if any(r.get(k) is not None for r in rows)]
    # --decode-parts: microseconds a call (at each cache position), and the largest difference from the plain twin
    keys += [k for k in dict.fromkeys(k for r in rows for k in r) if k.startswith("us")]
    keys += [k for k in ("max_abs_diff", "skipped") if any(k in r for r in rows)]
    lines = ["| rung | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append("" if v is None else f"{v:.1%}" if k in ("share", "runs_spread") else f"{v:.1e}"
                         if k == "max_abs_diff" else f"{v:,.2f}" if isinstance(v, float) else str(v))
        lines.append(f"| {r['rung']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


POWER_LIMITED = 0.97  # a rung whose median draw is within 3% of the card's limit ran held at it


def power_note(rows: list[dict]) -> str:
    """A line under a speed table whose rungs ran at the card's power limit, else "". Held there a card lowers
    its clock, the more the faster a rung's kernels go; how much that moves a ratio is not yet separated from the
    code's own changes (docs/performance/training-speed.md)."""
    held = [r for r in rows if r.get("power_w") and r.get("power_limit_w")
            and r["power_w"] >= POWER_LIMITED * r["power_limit_w"]]
    if not held:
        return ""
    limit = max(r["power_limit_w"] for r in held)
    return (f"\n\n{len(held)} of {len(rows)} rungs drew within {1 - POWER_LIMITED:.0%} of the card's {limit:.0f} W "
            f"power limit: held there it lowers its clock, the more the faster a rung's kernels go, so the ratios "
            f"between rungs may read lower than on a card with headroom")


def graph_break_note(rows: list[dict]) -> str:
    """A line under a speed table naming the rungs torch.compile split (train.graph_breaks), else "": such a rung
    measures its code partly uncompiled, whatever its name says."""
    split = [f"{r['rung']} ({r['graph_breaks']})" for r in rows if r.get("graph_breaks")]
    return (f"\n\ntorch.compile split the graph in {len(split)} of {len(rows)} rungs, which ran the code around each "
            f"break uncompiled: {', '.join(split)}; TORCH_LOGS=graph_breaks names them" if split else "")


def plot_rows(rows: list[dict], value: str, label: str, title: str, path: Path, mfu_of=None):
    """A bar per measured row (value), optionally with MFU on a second axis; rows without it are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in rows if r.get(value) is not None]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["rung"] for r in done]
    ax.bar(names, [r[value] for r in done], color="#4477aa")
    ax.set_ylabel(label)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", rotation=30)
    if mfu_of:
        ax2 = ax.twinx()
        ax2.plot(names, [100 * mfu_of(r) for r in done], "o-", color="#cc6677")
        ax2.set_ylabel("MFU vs measured roof (%)")
        ax2.set_ylim(0, 100)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)





# --- The budget: hours to train each preset, Chinchilla-style ------------------------------------

@dataclass
class Budget:
    name: str
    params: int  # N: the parameters that multiply (model.multiplied_params; a lookup table does no arithmetic)
    tokens: int  # D = 20 N (Chinchilla, Hoffmann et al. 2022, Table 3)
    flops: float  # C = 6 N D
    hours: float
    tokens_per_param_8h: float
    tokens_per_param_48h: float


def budget(name: str, params: int, tokens_per_s: float) -> Budget:
    D = 20 * params
    return Budget(name, params, D, 6.0 * params * D, D / tokens_per_s / 3600,
                  tokens_per_s * 8 * 3600 / params, tokens_per_s * 48 * 3600 / params)


def budget_rows(rates: dict[str, tuple[M.ModelConfig, float]]) -> str:
    """rates: preset name -> (its ModelConfig, measured tokens/s). N counts the parameters that multiply:
    the default presets' value tables and untied input embedding (56% of 88m's 180M) are lookups, which
    neither cost FLOPs nor, by that count, call for tokens; for the article's tied models N is all of them."""
    lines = ["| preset | params | N (multiply) | tok/s | D = 20N | C = 6ND | hours | tok/N in 8 h | in 48 h |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (cfg, tok_s) in rates.items():
        b = budget(name, FL.multiplied_params(cfg), tok_s)
        lines.append(f"| {name} | {FL.param_count(cfg):,} | {b.params:,} | {tok_s:,.0f} | {b.tokens / 1e9:.2f}B "
                     f"| {b.flops:.1e} | {b.hours:.1f} | {b.tokens_per_param_8h:.0f} | {b.tokens_per_param_48h:.0f} |")
    return "\n".join(lines)


def budget_table(rates: list[str]) -> str:
    parsed = {}
    for item in rates:
        name, sep, value = item.partition("=")
        try:
            parsed[name] = (C.preset(name).model, float(value))
        except ValueError:
            raise ValueError(f"--tok-s {item!r}: expected PRESET=TOKENS_PER_S with a preset from configs/, "
                             f"e.g. 88m=29408") from None
        if not sep:
            raise ValueError(f"--tok-s {item!r}: expected PRESET=TOKENS_PER_S, e.g. 88m=29408")
    return budget_rows(parsed)


def build_parser(cuda: bool | None = None) -> argparse.ArgumentParser:
    """bench's command line; its help gives the defaults of this machine (with or without CUDA)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    here = f"default {'with CUDA' if cuda else 'on this CPU'}"
    p = argparse.ArgumentParser(description="Speed ladder and studies; every training rung in its own process.")
    what = p.add_argument_group("what to run (any number of them)")
    for study in STUDIES:
        what.add_argument("--" + study.replace("_", "-"), action="store_true",
                          help=f"the {study.replace('_', ' ')} study")
    what.add_argument("--all", action="store_true",
                      help="every study but --loss-curves (it trains a model per fast path)")
    what.add_argument("--plan", type=Path, default=None, metavar="FILE",
                      help="measure the rungs a TOML plan names (see configs/plans/), each in its own process")
    what.add_argument("--recipes", action="store_true", help="the time-to-loss ladder: each recipe change trained to "
                      "the same token budget and timed to the article recipe's final loss (recipes.py)")
    what.add_argument("--budget", action="store_true", help="print the training budget of each preset at --tok-s rates")
    every = p.add_argument_group("every study; named as train.py's flags where they mean the same")
    every.add_argument("--preset", default=None, help=f"model preset from configs/ ({here}: "
                       f"{'88m' if cuda else 'tiny'}; --recipes: {'22m' if cuda else 'tiny'})")
    every.add_argument("--micro-batch", "--micro-batch-size", dest="micro_batch", type=int, default=None, metavar="N",
                       help=f"sequences per forward pass ({here}: {16 if cuda else 4}; --recipes: the preset's)")
    every.add_argument("--batch-tokens", type=int, default=None, metavar="N", help=f"tokens per step ({here}: "
                       f"{'524,288' if cuda else 'eight sequences of the preset'})")
    every.add_argument("--timeout", type=int, default=900, metavar="S", help="seconds allowed per rung (default 900)")
    every.add_argument("--resume", action="store_true", help="reuse the rungs an interrupted study measured "
                       "(results/<study>.partial.json, or the --recipes and --loss-curves runs' folders)")
    every.add_argument("--out", default=str(ROOT / "results"),
                       help="folder for JSON and PNG results (default ./results)")
    speed = p.add_argument_group("the speed studies and --plan")
    speed.add_argument("--timed-steps", dest="steps", type=int, default=None, metavar="N",
                       help=f"optimizer steps timed per rung ({here}: {3 if cuda else 2})")
    speed.add_argument("--repeats", type=int, default=1, metavar="N", help="measure the kernels, attention and "
                       "compile-modes rungs this many times in turn and report each rung's median run and spread "
                       "(default 1)")
    speed.add_argument("--only", nargs="+", choices=ATTENTION_VARIANTS,
                       help="--attention: the variants to run (default: all)")
    speed.add_argument("--defaults", action="store_true", help="--profile the preset's fast paths as its file sets "
                       "them, what train.py runs with it (without: the compiled BF16 base); the flags below add to them")
    for switch in FP.TRAINING_FAST_PATHS:
        speed.add_argument(flag(switch), action="store_true", help=f"--profile with speed.{switch} on")
    add_recipe_flags(p.add_argument_group("--recipes"), here, cuda)
    other = p.add_argument_group("--generate, --loss-curves and --budget")
    other.add_argument("--new-tokens", type=int, default=500, metavar="N", help="--generate: tokens each run decodes "
                       f"({here}: {500 if cuda else 40})")
    other.add_argument("--curve-steps", type=int, default=None, metavar="N",
                       help=f"--loss-curves: steps of each run ({here}: {200 if cuda else 4})")
    other.add_argument("--no-transformers", action="store_true", help="--generate: measure onegpu only")
    other.add_argument("--tok-s", nargs="+", default=[], metavar="PRESET=TOK_S", help="--budget: measured tokens/s per "
                       "preset (default: an RTX 4060 Laptop GPU's, from \"What a Laptop Can Train\")")
    return p


def add_recipe_flags(recipes, here: str, cuda: bool):
    """--recipes' flags (the time-to-loss ladder)."""
    recipes.add_argument("--versus", action="store_true", help="only the article recipe against the preset's default")
    recipes.add_argument("--muon", action="store_true", help="with --versus: against the Muon recipe, "
                         "configs/<preset>-muon.toml (the default until 2026-12-02), instead of the default")
    recipes.add_argument("--fractions", type=float, nargs="+", default=None, metavar="F", help="with --versus: "
                         "train the default recipe on these fractions of the tokens (default 1; e.g. 1 0.4): a "
                         "warm-down reaches its lowest loss at the end of its own schedule, so the shortest schedule "
                         "that reaches the article's loss is the recipe's time to it")
    recipes.add_argument("--seconds", type=float, default=None, metavar="S", help="the record ladder: every rung "
                         "trained for this many training seconds (e.g. 150), its steps sized from its own speed")
    recipes.add_argument("--newest", nargs="*", default=None, choices=list(RE.NEWEST), metavar="IDEA",
                         help=f"with --seconds or --tokens: instead of the ladder, record #28's recipe, each of the newest "
                              f"records' ideas on top of it alone and the default where it adopted some, every one "
                              f"once per seed, with each seed's loss minus record #28's; no IDEA: all of "
                              f"{', '.join(RE.NEWEST)}; with --versus: each IDEA also on the default, timed to the "
                              f"article's loss beside it (e.g. --newest stack)")
    recipes.add_argument("--inside", action="store_true",
                         help="with --newest: the default first, then each idea inside it (taken out where the default "
                              "has it, added where it has not), each seed's loss minus the default's")
    recipes.add_argument("--at-once", type=int, default=1, metavar="K",
                         help="with --newest --tokens: K rungs side by side on each GPU (their losses compare; "
                              "their speeds share the card), at a micro-batch that leaves each a K-th of its memory")
    recipes.add_argument("--seeds", type=int, default=2, metavar="N",
                         help="seeds for the article and the final recipe (default 2)")
    recipes.add_argument("--tokens", type=int, default=None, metavar="N",
                         help="training tokens per rung (default: the preset's full budget)")
    recipes.add_argument("--corpus", default=None, metavar="NAME_OR_GLOB",
                         help=f"corpus ({here}: {'python' if cuda else 'stdlib'}); with --profile, profile on this "
                              f"prepared corpus, its documents as training masks them (default: random tokens)")


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.out = str(Path(args.out).expanduser().absolute())  # rungs run from the checkout: the folder is the user's
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: measure each rung at least once (--repeats 1 or more)")
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: run each compared recipe at least once (--seeds 1 or more)")
    if args.seconds is not None and (not args.recipes or args.versus or args.tokens or args.seconds <= 0):
        p.error(f"--seconds {args.seconds:g}: the record ladder's training seconds per rung, more than 0; give it "
                f"with --recipes, without --versus or --tokens")
    if args.newest is not None and not (args.recipes and (args.seconds or args.tokens or args.versus)):
        p.error("--newest: its ideas are measured at equal training seconds or equal tokens, or against the article; "
                "add --recipes and --seconds S (e.g. 70), --tokens N or --versus")
    if args.newest is not None and args.versus and (not args.newest or args.muon or args.inside):
        p.error("--versus --newest: name the ideas to put on the default beside it (e.g. --newest stack), without "
                "--muon or --inside")
    if args.inside and args.newest is None:
        p.error("--inside: it measures the newest ideas inside the default; add --newest (and --recipes --seconds S)")
    if args.at_once != 1 and (args.newest is None or args.seconds or args.at_once < 1):
        p.error(f"--at-once {args.at_once}: rungs share a card only where their speed is not compared: give it "
                f"with --newest --tokens N, at least 1")
    if args.fractions and not (args.recipes and args.versus):
        p.error("--fractions: they size the default recipe's schedules in --recipes --versus; add both flags")
    if args.muon and not (args.recipes and args.versus):
        p.error("--muon: it picks the other side of --recipes --versus; add both flags")
    if any(not 0 < f <= 1 for f in args.fractions or ()):
        p.error(f"--fractions {' '.join(map(str, args.fractions))}: each is a share of the token budget, "
                "more than 0 and at most 1 (e.g. --fractions 1 0.4)")
    try:
        if args.plan:
            plan_study(args, argv)
        if args.recipes:
            recipes_study(args, argv)
        if args.budget:
            if not args.tok_s:
                print("rates: an 8 GB RTX 4060 Laptop GPU's, measured for \"What a Laptop Can Train\" on its models "
                      "(configs/<preset>-gpt3.toml); give your own with --tok-s PRESET=TOK_S (python bench.py "
                      "--ladder measures them)")
            print(budget_table(args.tok_s or [f"{k}={v}" for k, v in LAPTOP_TOK_S.items()]))
        chosen = [s for s in STUDIES if (args.all and s != "loss_curves") or getattr(args, s)]
        if not chosen and not args.budget and not args.recipes and not args.plan:
            p.error("choose a study: " + ", ".join("--" + s.replace("_", "-") for s in STUDIES) + ", --all or --budget")
        if chosen:
            run_studies(args, chosen, argv)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


def cpu_distinct(rungs: list) -> list:
    """The rungs a CPU runs differently: one whose settings are all CUDA-only (a fast path, a precision) runs
    there as an earlier rung does, so it is left out, saying which, rather than timed again for nothing."""
    cpu, kept, seen = torch.device("cpu"), [], {}
    for rung in rungs:
        cfg = rung.config()
        speed = FP.for_device(cfg.speed, cpu)[0]
        key = repr((cfg.model, FP.running(FP.TRAINING_FAST_PATHS, cfg.model, speed),
                    TR.cpu_fallbacks(cfg.train, cpu, log=lambda *a: None), cfg.data))
        if key in seen:
            print(f"rung '{rung.name}' runs on a CPU as rung '{seen[key]}' does (what it changes is CUDA-only): "
                  f"left out here", flush=True)
            continue
        seen[key] = rung.name
        kept.append(rung)
    return kept


def plan_study(args, argv):
    """--plan FILE: its rungs, each checked before any runs, measured as the studies' rungs are."""
    cuda = C.pick_device("auto").type == "cuda"
    rungs = plan_rungs(args.plan, args.preset, args.steps)
    if not cuda:
        print(f"no CUDA device: a smoke test of the plan's code paths on the {args.preset or 'tiny'} preset (micro-"
              f"batch 4, 2 timed steps, no compile); CPU numbers say nothing about a GPU", flush=True)
        rungs = cpu_distinct([cpu_sized(r, args.preset) for r in rungs])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    journal = ME.Journal(out / f"plan-{args.plan.stem}.partial.json", {"plan": str(args.plan)}, args.resume)
    rows = ME.run(rungs, cuda, args.timeout, journal, args.repeats)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    (out / f"plan-{args.plan.stem}.json").write_text(json.dumps(
        {"device": device, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
         "command": "python bench.py " + " ".join(argv or sys.argv[1:]), "rows": rows}, indent=2, default=str))
    journal.done()
    plot_rows(rows, "tok_s", "tokens / s", f"plan {args.plan.stem} | {device} | {time.strftime('%Y-%m-%d')}",
              out / f"plan-{args.plan.stem}.png")
    print(f"## plan {args.plan} | {device}\n\n{simple_table(rows)}{power_note(rows)}{graph_break_note(rows)}\n\n"
          f"{out / f'plan-{args.plan.stem}'}.json, .png")


def recipes_study(args, argv):
    """--recipes: recipes.py runs the rungs and writes the table, JSON and plot."""
    cuda = C.pick_device("auto").type == "cuda"
    preset = args.preset or ("22m" if cuda else "tiny")
    devices = [str(i) for i in range(torch.cuda.device_count())] if cuda else [None]
    where = {"out": Path(args.out), "device_name": torch.cuda.get_device_name() if cuda else "cpu",
             "devices": devices, "command": "python bench.py " + " ".join(argv or sys.argv[1:])}
    corpus = args.corpus or ("python" if cuda else "stdlib")
    if corpus not in tk.CORPORA:  # a path or glob: the user's, not the rungs' working folder
        corpus = str(Path(corpus).expanduser().absolute())
    if not cuda:
        print("no CUDA device: the ladder runs on the CPU, a smoke test of the code; CPU numbers say nothing "
              "about a GPU", flush=True)
    if not cuda and (args.seconds or 0) + (args.tokens or 0) == 0 and preset != "tiny":
        budget = C.preset(f"{preset}-gpt3").train.tokens
        print(f"note: every rung trains {budget:,} tokens (--preset {preset}'s full budget) on the CPU, days of work "
              f"at a CPU's few thousand tokens/s; for a smoke test pass --tokens 16384, or --preset tiny", flush=True)
    if args.newest is not None and not args.versus:
        found = RE.newest_study(preset, tuple(args.newest or RE.NEWEST), args.seeds, corpus, args.micro_batch,
                                where["out"], args.timeout, args.resume, devices * args.at_once,
                                seconds=args.seconds or 0.0, tokens=args.tokens or 0, inside=args.inside)
        print(RE.report_record(found, preset, **{**where, "devices": devices * args.at_once}))
    elif args.seconds:
        found = RE.seconds_study(preset, args.seconds, args.seeds, corpus, args.micro_batch, where["out"],
                                 args.timeout, args.resume, devices)
        print(RE.report_record(found, preset, **where))
    else:
        found = RE.study(preset, args.tokens, args.seeds, corpus, args.micro_batch, where["out"], args.timeout,
                         args.resume, args.versus, devices, tuple(args.fractions or RE.WHOLE_BUDGET), args.muon,
                         tuple(args.newest or ()))
        print(RE.report_ladder(found, preset, args.versus, **where))


# Short-run rates of "What a Laptop Can Train" on an 8 GB RTX 4060 Laptop GPU (tokens/s), for its models: the
# -gpt3 presets (today's defaults are other models).
LAPTOP_TOK_S = {"22m-gpt3": 103_618, "47m-gpt3": 49_459, "88m-gpt3": 29_508, "126m-gpt3": 19_096}


@dataclass
class Study:
    """What every study reads: the command line and the setting it resolves to."""
    args: argparse.Namespace
    preset: str
    cuda: bool
    batch_tokens: int
    steps: int
    mb: int
    out: Path
    device_name: str
    results: dict  # the JSON written beside each study's table
    journal: ME.Journal | None = None


def curves(s: Study) -> list[dict]:
    rows, found = RE.curves_study(s.preset, s.args.curve_steps or (200 if s.cuda else 4),
                                  s.args.micro_batch or (64 if s.cuda else 4), s.out, s.args.timeout, s.args.resume,
                                  [None], s.args.batch_tokens or (None if s.cuda else s.batch_tokens))
    plot_curves(found, f"loss curves | {s.preset} | stdlib corpus | {s.device_name} | {s.results['date']}",
                s.out / "loss_curves.png")
    s.results["curves"] = found  # the losses step by step, to compare runs on other days
    return rows


# The studies: name -> (how its rows are measured, the row value its plot shows, the plot's axis label).
STUDY_TABLE = {
    "ladder": (lambda s: ladder(s.preset, s.batch_tokens, s.steps, s.cuda, s.args.timeout, s.journal),
               "tok_s", "tokens / s"),
    "kernels": (lambda s: ME.run(kernel_rungs(s.preset, s.mb, s.steps, {"train__batch_tokens": s.batch_tokens}), s.cuda,
                              s.args.timeout, s.journal, s.args.repeats), "tok_s", "tokens / s"),
    "attention": (lambda s: ME.run(attention_rungs(s.preset, s.mb, s.steps, s.args.only), s.cuda, s.args.timeout,
                                s.journal, s.args.repeats), "tok_s", "tokens / s"),
    "compile_modes": (lambda s: ME.run(compile_mode_rungs(s.preset, s.mb, s.steps), s.cuda, s.args.timeout, s.journal,
                                    s.args.repeats), "tok_s", "tokens / s"),
    "micro_batch_sweep": (lambda s: micro_batch_study(s.preset, s.batch_tokens, s.steps, s.cuda, s.args.timeout,
                                                      journal=s.journal), "tok_s", "tokens / s"),
    "activation_checkpointing": (lambda s: activation_checkpointing_study(s.preset, s.batch_tokens, s.mb, s.steps,
                                                                          s.cuda, s.args.timeout, s.journal),
                                 "tok_s", "tokens / s"),
    "optimizer": (lambda s: optimizer_study(s.preset, s.cuda), "update_ms", "ms per update"),
    "loader": (lambda s: loader_study(s.preset, s.mb), "cpu_us", "CPU microseconds per micro-batch"),
    "loss": (lambda s: loss_study(s.preset, s.mb, s.cuda), "ms", "ms per micro-batch, forward and backward"),
    "parts": (lambda s: parts_study(s.preset, s.mb, s.cuda), "ms", "ms per micro-batch, forward and backward"),
    "attention_rate": (lambda s: attention_rate_study(s.preset, s.mb, s.cuda), "tflops",
                       "TFLOP/s of one layer's attention, forward and backward"),
    "profile": (lambda s: profile_study(s.preset, s.mb, s.cuda, profile_switches(s.preset, s.args), s.args.corpus),
                "ms", "ms per 2 micro-batches"),
    "generate": (lambda s: ME.generate_study(s.preset, s.cuda,
                                             s.args.new_tokens if s.cuda else min(s.args.new_tokens, 40),
                                          vs_transformers=not s.args.no_transformers),
                 "decode_tok_s", "decoded tokens / s"),
    "decode_parts": (lambda s: ME.decode_parts_study(s.preset, s.cuda), None, "microseconds a call"),
    "loss_curves": (curves, None, "training loss"),
}
STUDIES = tuple(STUDY_TABLE)
PLOTTED = {name: (value, label) for name, (_, value, label) in STUDY_TABLE.items()}


def run_studies(args, chosen: list[str], argv):
    cuda = C.pick_device("auto").type == "cuda"
    preset = args.preset or ("88m" if cuda else "tiny")
    mcfg = C.preset(preset).model
    flops_tok = FL.flops_per_token(mcfg)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    s = Study(args, preset, cuda, args.batch_tokens or (524_288 if cuda else 4 * mcfg.context * 2),
              args.steps or (3 if cuda else 2), args.micro_batch or (16 if cuda else 4), Path(args.out),
              device_name, {})
    s.out.mkdir(parents=True, exist_ok=True)
    print(f"device: {device_name} | torch {torch.__version__} | preset {preset} ({FL.param_count(mcfg):,} params, "
          f"{flops_tok:,} FLOPs/token) | {s.batch_tokens:,} tokens per step")
    if not cuda:
        print("no CUDA device: a smoke test of the code paths on the tiny model; CPU numbers say nothing about a GPU")
    roof = ME.measure_roof(mcfg, s.mb) if cuda else {}
    spec_peak = TR.peak_tflops(device_name) if cuda else None
    if cuda:
        print(f"roof: {roof['roof_tflops']:.0f} TFLOP/s (bf16 8192^3, measured); model's matmul shapes "
              f"{roof['model_matmul_tflops']:.0f} TFLOP/s {roof['model_shapes_tflops']}; spec sheet "
              f"{spec_peak or 'unknown'}; ceiling {roof['roof_tflops'] * 1e12 / flops_tok:,.0f} tok/s")
    s.results.update({"device": device_name, "torch": torch.__version__, "preset": preset,
                      "flops_per_token": flops_tok, "date": time.strftime("%Y-%m-%d"),
                      "command": "python bench.py " + " ".join(argv or sys.argv[1:]), "spec_peak_tflops": spec_peak,
                      **roof})
    tables = []
    for study in chosen:
        s.journal = ME.Journal(s.out / f"{study}.partial.json", {"preset": preset, "device": device_name,
                                                               "batch_tokens": s.batch_tokens}, args.resume)
        measure, value, label = STUDY_TABLE[study]
        rows = measure(s)
        table, mfu_of = simple_table(rows), None
        if study == "ladder":
            table = ladder_table(rows, flops_tok, roof.get("roof_tflops"), spec_peak)
            if roof:
                table += (f"\n\nMFU (roof) is also the share of the ceiling, "
                          f"{roof['roof_tflops'] * 1e12 / flops_tok:,.0f} tok/s")
                mfu_of = lambda r: FL.mfu(r["tok_s"], flops_tok, roof["roof_tflops"] * 1e12)  # noqa: E731
        table += power_note(rows) + graph_break_note(rows)
        if value is not None:
            plot_rows(rows, value, label, f"{study.replace('_', ' ')} | {preset} | {device_name} | "
                      f"{s.results['date']}", s.out / f"{study}.png", mfu_of)
        s.results[study] = rows
        sources = sorted({r["data"] for r in rows if r.get("data")})
        tables.append(f"## {study.replace('_', ' ')}\n\n{table}" + (f"\n\ndata: {', '.join(sources)}" if sources else ""))
        (s.out / f"{study}.json").write_text(json.dumps({**s.results, "rows": rows}, indent=2, default=str))
        s.journal.done()
    print("\n\n".join(tables) + f"\n\nresults: {', '.join(f'{study}.json' for study in chosen)} and their plots "
          f"in {s.out}")


if __name__ == "__main__":
    main()
