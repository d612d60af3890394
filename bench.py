"""Where the speed comes from: seed 000's ladder, and one study per setting, on any GPU.

    python bench.py --ladder                 # FP32 -> TF32 -> BF16 -> compile -> micro-batch -> fused -> pinned
    python bench.py --attention              # textbook / SDPA backends / document mask, eager and compiled
    python bench.py --compile-modes --micro-batch --optimizer --activation-checkpointing --profile
    python bench.py --ladder --preset 22m --steps 5

Every configuration ("rung") runs in its own process, as seed 000 did: a warm-up of 4
micro-batches and one optimizer step (compilation happens here and is timed), then --steps
full optimizer steps of train.py's own train_step(), wall clock with torch.cuda.synchronize()
on both sides; the median is reported with the spread. Results go to stdout as a markdown
table and to results/<study>.json and .png. On CPU every study runs with the tiny preset for a
couple of short steps, and CUDA-only rungs are listed as skipped.
"""

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import data as D
import model as M
import train as TR

ROOT = Path(__file__).resolve().parent
MIB = 2**20


# --- Measuring one rung (runs in its own process) -------------------------------------------

def textbook_attention(q, k, v, *, doc_ids=None, block_mask=None, offset=0):
    """Full T x T scores, a boolean mask, softmax in float32, K/V copied per query head."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    T = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def repeated_kv_attention(q, k, v, *, doc_ids=None, block_mask=None, offset=0):
    """SDPA with K/V copied to every query head: the memory-efficient kernel refuses enable_gqa."""
    group = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=True)


def pinned(attention, backend: str):
    """attention with SDPA restricted to one backend. The context is entered inside the function,
    so torch.compile traces it too (a context entered around a compiled model is not seen)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v, **kwargs):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return attention(q, k, v, **kwargs)
    return attend


SDPA_BACKENDS = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "flash": "FLASH_ATTENTION"}


class ClockSampler(threading.Thread):
    """SM clock (MHz) and board power (W) sampled while a rung runs: through NVML (nvidia-ml-py)
    every 100 ms, or by polling nvidia-smi when that is not installed."""

    def __init__(self, device_index: int):
        super().__init__(daemon=True)
        # NVML and nvidia-smi number GPUs ignoring CUDA_VISIBLE_DEVICES; the UUID names the same card.
        self.card = f"GPU-{torch.cuda.get_device_properties(device_index).uuid}"
        self.samples, self.stop_flag = [], threading.Event()
        self.nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByUUID(self.card)
        except Exception:  # no nvidia-ml-py, or no driver access through it
            self.smi = shutil.which("nvidia-smi")

    def read(self) -> tuple[float, float] | None:
        if self.nvml:
            return (self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM),
                    self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000)
        if self.smi:
            out = subprocess.run([self.smi, "-i", self.card, "--query-gpu=clocks.sm,power.draw",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            try:
                clock, power = (float(v) for v in out.strip().split(","))
                return clock, power
            except ValueError:
                return None
        return None

    def run(self):
        while True:
            sample = self.read()
            if sample is None:
                return
            self.samples.append(sample)
            if self.stop_flag.wait(0.1):
                return

    def summary(self) -> dict:
        self.stop_flag.set()
        if not self.samples:
            return {"sm_mhz": None, "power_w": None}
        clocks, powers = zip(*self.samples)
        return {"sm_mhz": statistics.median(clocks), "power_w": round(statistics.median(powers), 1)}


def random_shards(folder: Path, vocab: int, tokens: int, seed: int = 1337) -> list[Path]:
    """A shard of random token ids with random document lengths (mean 512), so every rung reads
    through the real ShardLoader. Throughput does not depend on what the tokens say."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, tokens, dtype=np.uint16)
    starts = np.unique(np.concatenate([[0], rng.integers(1, tokens, tokens // 512)])).astype(np.uint64)
    path = folder / "train_00000.bin"
    D.write_shard(path, ids, starts, vocab, "random0000000000", tokens)
    return [path]


@dataclass
class Rung:
    """Everything one configuration trains with: train.py's own pieces, set up as spec says."""
    device: torch.device
    mcfg: M.ModelConfig
    tcfg: TR.TrainConfig
    loader: D.ShardLoader
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    accum: int
    data: str  # "<corpus> shards" or "random tokens"


def build_rung(spec: dict, workdir: Path) -> Rung:
    """spec: preset, batch_tokens, micro_batch, timed_steps, attention, corpus, and any TrainConfig
    field (tf32, bf16, compile, optimizer, pin, ...). Random shards, when needed, go in workdir."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TR.resolve_config(TR.build_parser().parse_args(["--config", str(M.PRESETS_DIR / f"{spec['preset']}.toml")]))
    mcfg = cfg.model
    train_fields = {f.name for f in dataclasses.fields(TR.TrainConfig)}
    tcfg = TR.TrainConfig(steps=1, **{k: v for k, v in spec.items() if k in train_fields})
    tcfg = TR.cpu_fallbacks(tcfg, device, log=lambda s: None)
    TR.set_precision(tcfg)
    if spec.get("attention") == "textbook":
        M.attention = textbook_attention
    elif spec.get("attention") == "efficient":
        M.attention = repeated_kv_attention
    if spec.get("attention") in SDPA_BACKENDS and device.type == "cuda":
        M.attention = pinned(M.attention, SDPA_BACKENDS[spec["attention"]])
    # Real shards of the corpus when they exist, random tokens otherwise.
    data_cfg = dataclasses.replace(cfg.data, corpus=spec.get("corpus") or cfg.data.corpus)
    try:
        files, source = D.shard_files(D.data_dir(data_cfg, mcfg.vocab_size), "train"), f"{data_cfg.corpus} shards"
    except FileNotFoundError:
        needed = (spec.get("timed_steps", 1) + 2) * tcfg.batch_tokens + 4 * tcfg.micro_batch * (mcfg.context + 1)
        files, source = random_shards(workdir, mcfg.vocab_size, needed), "random tokens"
    loader = D.ShardLoader(files, tcfg.micro_batch, mcfg.context, doc_ids=tcfg.doc_mask, device=device, pin=tcfg.pin)
    raw, model = TR.build_model(mcfg, tcfg, device, seed=1337)
    return Rung(device, mcfg, tcfg, loader, model, TR.configure_optimizer(raw, tcfg),
                TR.accumulation_steps(tcfg.batch_tokens, tcfg.micro_batch, mcfg.context, 1), source)


def measure_rung(spec: dict) -> dict:
    """Time one configuration (see build_rung for spec)."""
    with tempfile.TemporaryDirectory() as workdir:
        r = build_rung(spec, Path(workdir))
        return time_rung(r, spec)


def time_rung(r: Rung, spec: dict) -> dict:
    """Warm up (4 micro-batches and a step), then time spec["timed_steps"] full steps."""
    device, tcfg, model, optimizer, loader, accum = r.device, r.tcfg, r.model, r.optimizer, r.loader, r.accum

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Warm-up: 4 micro-batches and one optimizer step; compilation happens here.
    sync()
    t0 = time.perf_counter()
    loss, _ = TR.train_step(model, optimizer, loader.next_batch, min(4, accum), tcfg, device, 1e-4)
    loss.item()
    sync()
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sampler = ClockSampler(device.index or 0) if device.type == "cuda" else None
    if sampler:
        sampler.start()
    times, losses = [], []
    for _ in range(spec["timed_steps"]):
        sync()
        t0 = time.perf_counter()
        loss, _ = TR.train_step(model, optimizer, loader.next_batch, accum, tcfg, device, 1e-4)
        losses.append(loss.item())  # one read-back per step, as a logger would
        sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    result = {"tok_s": tcfg.batch_tokens / step_s, "step_s": step_s,
              "spread": (max(times) - min(times)) / step_s, "warmup_s": warmup_s, "loss": losses[-1],
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              # CUDA graphs replay inside a private pool reserved while warming up, which the allocated
              # peak above does not see; the reserved peak does.
              "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
              "data": r.data, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "accum": accum, **(sampler.summary() if sampler else {"sm_mhz": None, "power_w": None})}
    if spec.get("kernels"):
        result["attention_kernels"] = attention_kernels(model, loader, tcfg, device)
    return result


def kernel_times(fn, device) -> dict[str, float]:
    """Total device (or CPU) milliseconds per kernel name while fn() runs, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if device.type == "cuda" and e.device_type.name != "CUDA":
            continue
        t = (e.device_time if device.type == "cuda" else e.self_cpu_time_total) / 1000  # CPU ops nest: self time
        totals[e.name] = totals.get(e.name, 0.0) + t
    return totals


# cuDNN's kernel names contain "flash" too (cudnn_generated_..._flash_fprop): test for cudnn first.
ATTENTION_SIGNS = [("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "fmha"), ("efficient", "efficient_attention"),
                   ("flex", "flex_attention"), ("math", "softmax")]


def attention_kernels(model, loader, cfg, device) -> str:
    """Which attention implementation really ran, read from the kernel names of one micro-batch:
    a silent fallback to the math backend shows up as softmax kernels and no fused kernel."""
    def one():
        TR.forward_loss(model, loader.next_batch(), cfg, device).backward()
    names = kernel_times(one, device)
    seen = [label for label, sign in ATTENTION_SIGNS if any(sign in n.lower() for n in names)]
    fused = [s for s in seen if s != "math"]
    return fused[0] if fused else ("math (softmax kernels, no fused attention)" if "math" in seen else "unknown")


# --- Roof and ceilings (runs in the parent, once) -------------------------------------------

def matmul_tflops(m: int, k: int, n: int, device, repeats: int = 20) -> float:
    """Median TFLOP/s of a bf16 (m x k) @ (k x n) matmul on random data (never zeros: they run
    faster than real data would)."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * m * k * n / statistics.median(times) / 1e12


def measure_roof(mcfg: M.ModelConfig, micro_batch: int) -> dict:
    """The card's BF16 roof (8192^3 matmul) and the rate at the model's own matmul shapes."""
    device = torch.device("cuda")
    roof = matmul_tflops(8192, 8192, 8192, device)
    rows = micro_batch * mcfg.context
    d, kv, f, v = mcfg.d_model, mcfg.n_kv_heads * mcfg.head_dim, mcfg.ffn_hidden, mcfg.vocab_size
    shapes = {"wqkv": (rows, d, d + 2 * kv), "wo": (rows, d, d), "w13": (rows, d, 2 * f), "w2": (rows, f, d),
              "head": (rows, d, v)}
    rates = {name: matmul_tflops(*s, device) for name, s in shapes.items()}
    flops = {name: 2 * math.prod(s) * (1 if name == "head" else mcfg.n_layers) for name, s in shapes.items()}
    blended = sum(flops.values()) / sum(flops[n] / rates[n] for n in rates)
    return {"roof_tflops": roof, "model_shapes_tflops": {k: round(r, 1) for k, r in rates.items()},
            "model_matmul_tflops": blended}


# --- Running rungs in subprocesses -----------------------------------------------------------

def run_rung(spec: dict, timeout: int) -> dict:
    """Measure spec in a fresh Python process; a failure (OOM, compile error) becomes a skipped row."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rung", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**spec, "skipped": f"timed out after {timeout} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return {**spec, **json.loads(line[7:])}
    tail = (done.stderr or done.stdout).strip().splitlines()
    reason = "out of memory" if "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr else (tail[-1] if tail else "failed")
    return {**spec, "skipped": reason[:160]}


def largest_fitting(spec: dict, sizes, timeout: int) -> dict:
    """The first of sizes (largest first) whose rung runs; skipped rows are dropped."""
    for mb in sizes:
        result = run_rung({**spec, "micro_batch": mb}, timeout)
        if "skipped" not in result:
            return result
        print(f"  micro-batch {mb}: {result['skipped']}", flush=True)
    return {**spec, "skipped": "no micro-batch fits"}


# --- Studies ---------------------------------------------------------------------------------

def ladder(base: dict, cuda: bool, timeout: int) -> list[dict]:
    """Seed 000's ladder, one setting at a time."""
    rows = []

    def add(name, spec):
        print(f"rung: {name} ...", flush=True)
        rows.append({"rung": name, **(run_rung(spec, timeout) if "micro_batch" in spec else largest_fitting(spec, [64, 32, 16, 8, 4, 2, 1], timeout))})
        return rows[-1]

    fp32 = dict(base, tf32=False, bf16=False, compile=False, optimizer="foreach", pin=False)
    if not cuda:
        add("fp32 eager (CPU)", dict(fp32, micro_batch=4))
        rows += [{"rung": r, "skipped": "needs CUDA"} for r in
                 ("+tf32", "+bf16 autocast", "+torch.compile", "micro-batch 16+", "+fused AdamW", "+pinned memory")]
        return rows
    first = add("fp32 eager", fp32)
    mb = first.get("micro_batch", 4)
    add("+tf32", dict(fp32, tf32=True, micro_batch=mb))
    add("+bf16 autocast", dict(fp32, tf32=True, bf16=True, micro_batch=mb))
    compiled = dict(fp32, tf32=True, bf16=True, compile=True)
    best = add("+torch.compile", dict(compiled, micro_batch=mb))
    for size in (16, 32, 64, 128, 256, 512):
        if size > mb and base["batch_tokens"] % (size * M.preset(base["preset"]).context) == 0:
            row = add(f"micro-batch {size}", dict(compiled, micro_batch=size))
            if "skipped" in row:
                break
            if row["tok_s"] > best.get("tok_s", 0):
                best = row
    best_mb = best.get("micro_batch", mb)
    add("+fused AdamW", dict(compiled, micro_batch=best_mb, optimizer="fused"))
    add("+pinned memory", dict(compiled, micro_batch=best_mb, optimizer="fused", pin=True))
    return rows


ATTENTION_VARIANTS = ["textbook", "math", "efficient", "cudnn", "flash", "default", "doc-mask"]


def attention_study(base: dict, cuda: bool, timeout: int, only=None) -> list[dict]:
    variants = [v for v in ATTENTION_VARIANTS if not only or v in only]
    rows = []
    for variant in variants:
        for compiled in (False, True):
            name = f"{variant} {'compiled' if compiled else 'eager'}"
            if not cuda and variant in SDPA_BACKENDS:
                rows.append({"rung": name, "skipped": "SDPA backends are CUDA kernels"})
                continue
            if not cuda and compiled:
                rows.append({"rung": name, "skipped": "compiled variants are measured on CUDA (on CPU compiling "
                                                      "takes longer than the study)"})
                continue
            spec = dict(base, tf32=True, bf16=True, compile=compiled, kernels=True,
                        attention=variant, doc_mask=variant == "doc-mask")
            print(f"rung: {name} ...", flush=True)
            rows.append({"rung": name, **run_rung(spec, timeout)})
    return rows


def compile_modes_study(base: dict, cuda: bool, timeout: int) -> list[dict]:
    rows = []
    for mode in TR.COMPILE_MODES:
        if not cuda and mode != "default":
            rows.append({"rung": mode, "skipped": "CUDA graphs and autotuning are CUDA features"})
            continue
        print(f"rung: {mode} ...", flush=True)
        rows.append({"rung": mode, **run_rung(dict(base, tf32=True, bf16=True, compile=True, compile_mode=mode,
                                                   optimizer="fused" if cuda else "foreach"), timeout)})
    return rows


def micro_batch_study(base: dict, cuda: bool, timeout: int, ac: bool = False, start: int = 1) -> list[dict]:
    """Doubling micro-batches from start until one no longer fits (or the step cannot be split further)."""
    rows, size = [], start
    context = M.preset(base["preset"]).context
    limit = 1024 if cuda else 4
    while size <= limit:
        print(f"rung: micro-batch {size}{' +AC' if ac else ''} ...", flush=True)
        row = {"rung": f"micro-batch {size}{' +AC' if ac else ''}",
               **run_rung(dict(base, tf32=True, bf16=True, compile=cuda, micro_batch=size,
                               activation_checkpointing=ac), timeout)}
        rows.append(row)
        if "skipped" in row or base["batch_tokens"] % (2 * size * context) != 0:
            break
        size *= 2
    fitted = [r for r in rows if r.get("peak_gib")]
    if len(fitted) >= 2:  # memory = fixed + slope * sequences (least squares)
        slope, fixed = np.polyfit([r["micro_batch"] for r in fitted], [r["peak_gib"] for r in fitted], 1)
        rows.append({"rung": "fit", "fixed_gib": round(float(fixed), 3), "gib_per_seq": round(float(slope), 4),
                     "largest_fitting": max(r["micro_batch"] for r in fitted)})
    return rows


def activation_checkpointing_study(base: dict, cuda: bool, timeout: int) -> list[dict]:
    """Recomputation's cost at equal micro-batch, then how far the micro-batch can grow with it:
    the sweep with recomputation starts at the compared size, so its first row is the comparison."""
    mb = base["micro_batch"]
    print(f"rung: micro-batch {mb} ...", flush=True)
    plain = {"rung": f"micro-batch {mb}", **run_rung(dict(base, tf32=True, bf16=True, compile=cuda), timeout)}
    return [plain] + micro_batch_study(base, cuda, timeout, ac=True, start=mb)


def optimizer_study(preset: str, cuda: bool) -> list[dict]:
    """GPU time of clip + AdamW update for each implementation (CUDA events, median of 20)."""
    device = torch.device("cuda" if cuda else "cpu")
    model = M.Llama(M.preset(preset)).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for impl in TR.OPTIMIZERS:
        if impl == "fused" and not cuda:
            rows.append({"rung": impl, "skipped": "fused AdamW is measured on CUDA only"})
            continue
        opt = TR.configure_optimizer(model, TR.TrainConfig(steps=1, optimizer=impl))
        times = []
        for i in range(25):
            t0 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if cuda:
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end) / 1000
            else:
                elapsed = time.perf_counter() - t0
            if i >= 5:
                times.append(elapsed)
        rows.append({"rung": impl, "update_ms": round(statistics.median(times) * 1000, 3)})
    return rows


KERNEL_CLASSES = [("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
                  ("loss", ("nll", "log_softmax", "cross_entropy")),
                  ("optimizer", ("adam", "multi_tensor", "foreach", "norm", "clamp", "clip")),
                  ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "::mm", "bmm", "addmm", "cublas", "mm_"))]


def profile_study(base: dict, cuda: bool) -> list[dict]:
    """Time per kernel class over 2 micro-batches and one optimizer step, and the rate of the
    classes whose FLOPs are known (matmul: 6N per token; attention: PaLM's 12LHQT)."""
    spec = dict(base, tf32=True, bf16=True, compile=cuda, optimizer="fused" if cuda else "foreach",
                batch_tokens=2 * base["micro_batch"] * M.preset(base["preset"]).context)
    workdir = tempfile.TemporaryDirectory()
    r = build_rung(spec, Path(workdir.name))
    device, tcfg, mcfg = r.device, r.tcfg, r.mcfg
    step = lambda: TR.train_step(r.model, r.optimizer, r.loader.next_batch, 2, tcfg, device, 1e-4)[0].item()  # noqa: E731
    step()  # warm-up and compile
    names = kernel_times(step, device)
    classes, top = {}, {}
    for name, ms in sorted(names.items(), key=lambda kv: -kv[1]):
        lower = name.lower()
        label = next((c for c, signs in KERNEL_CLASSES if any(s in lower for s in signs)), "elementwise/other")
        classes[label] = classes.get(label, 0.0) + ms
        top.setdefault(label, []).append(f"{ms:.2f} ms {name[:100]}")
    total = sum(classes.values())
    tokens = 2 * tcfg.micro_batch * mcfg.context
    flops = {"matmul": 6 * M.param_count(mcfg) * tokens,
             "attention": 12 * mcfg.n_layers * mcfg.n_heads * mcfg.head_dim * mcfg.context * tokens}
    rows = [{"rung": c, "ms": round(ms, 2), "share": ms / total,
             "tflops": flops[c] / (ms / 1000) / 1e12 if c in flops and ms > 0 else None, "top_kernels": top[c][:5]}
            for c, ms in sorted(classes.items(), key=lambda kv: -kv[1])]
    workdir.cleanup()
    return rows


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
            lines.append(f"| {r['rung']} | {r.get('micro_batch', '')} | skipped: {r['skipped']} |" + " |" * 11)
            continue
        tok = r["tok_s"]
        first = first or tok
        mfu_roof = M.mfu(tok, flops_tok, roof * 1e12) if roof else None
        mfu_spec = M.mfu(tok, flops_tok, spec_peak * 1e12) if spec_peak else None
        per_ghz = tok / (r["sm_mhz"] / 1000) if r.get("sm_mhz") else None
        lines.append(f"| {r['rung']} | {r['micro_batch']} | {tok:,.0f} | {r['step_s']:.3f} | "
                     f"{fmt(tok / prev if prev else None, '.2f')} | {tok / first:.2f} | {fmt(mfu_roof, '.1%')} | "
                     f"{fmt(mfu_spec, '.1%')} | {fmt(r.get('peak_gib'), '.2f')} | {r['warmup_s']:.1f} | "
                     f"{fmt(r.get('sm_mhz'), '.0f')} | {fmt(r.get('power_w'), '.0f')} | {fmt(per_ghz)} | {r['spread']:.1%} |")
        prev = tok
    return "\n".join(lines)


def simple_table(rows: list[dict]) -> str:
    keys = [k for k in ("micro_batch", "tok_s", "step_s", "peak_gib", "reserved_gib", "warmup_s",
                        "attention_kernels", "update_ms", "ms", "share", "tflops", "fixed_gib", "gib_per_seq",
                        "largest_fitting", "skipped")
            if any(k in r for r in rows)]
    lines = ["| rung | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append("" if v is None else f"{v:.1%}" if k == "share" else f"{v:,.2f}" if isinstance(v, float) else str(v))
        lines.append(f"| {r['rung']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_ladder(rows: list[dict], flops_tok: int, roof: float | None, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in rows if "tok_s" in r]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["rung"] for r in done]
    ax.bar(names, [r["tok_s"] for r in done], color="#4477aa")
    ax.set_ylabel("tokens / s")
    ax.tick_params(axis="x", rotation=30)
    if roof:
        ax2 = ax.twinx()
        ax2.plot(names, [100 * M.mfu(r["tok_s"], flops_tok, roof * 1e12) for r in done], "o-", color="#cc6677")
        ax2.set_ylabel("MFU vs measured roof (%)")
        ax2.set_ylim(0, 100)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


STUDIES = ("ladder", "attention", "compile_modes", "micro_batch", "optimizer", "activation_checkpointing", "profile")


def main(argv=None):
    p = argparse.ArgumentParser(description="Speed ladder and studies; every rung in its own process.")
    p.add_argument("--rung", help=argparse.SUPPRESS)  # internal: measure one spec (JSON) and print it
    for study in STUDIES:
        p.add_argument("--" + study.replace("_", "-"), action="store_true")
    p.add_argument("--all", action="store_true", help="every study")
    p.add_argument("--preset", default=None, help="model preset (default: 88m on CUDA, tiny on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per rung (default 3 on CUDA, 1 on CPU)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 524,288 on CUDA)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="micro-batch for the studies (default 16)")
    p.add_argument("--only", nargs="+", choices=ATTENTION_VARIANTS, help="attention variants to run (default: all)")
    p.add_argument("--corpus", default=None, help="read this corpus' prepared shards when they exist "
                                                  "(default: the preset's [data] corpus)")
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed per rung")
    p.add_argument("--out", default=str(ROOT / "results"), help="folder for JSON and PNG results")
    args = p.parse_args(argv)
    if args.rung:
        print("RESULT " + json.dumps(measure_rung(json.loads(args.rung))), flush=True)
        return
    chosen = [s for s in STUDIES if args.all or getattr(args, s)]
    if not chosen:
        p.error("choose a study: --ladder, --attention, --compile-modes, --micro-batch, --optimizer, "
                "--activation-checkpointing, --profile or --all")
    cuda = torch.cuda.is_available()
    preset = args.preset or ("88m" if cuda else "tiny")
    mcfg = M.preset(preset)
    batch_tokens = args.batch_tokens or (524_288 if cuda else 4 * mcfg.context * 2)
    base = {"preset": preset, "timed_steps": args.steps or (3 if cuda else 1), "batch_tokens": batch_tokens,
            "corpus": args.corpus, "micro_batch": args.micro_batch_size or (16 if cuda else 4)}
    flops_tok = M.flops_per_token(mcfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {device_name} | torch {torch.__version__} | preset {preset} ({M.param_count(mcfg):,} params, "
          f"{flops_tok:,} FLOPs/token) | {batch_tokens:,} tokens per step")
    roof = measure_roof(mcfg, base["micro_batch"]) if cuda else {}
    spec_peak = TR.peak_tflops(device_name) if cuda else None
    if cuda:
        print(f"roof: {roof['roof_tflops']:.0f} TFLOP/s (bf16 8192^3, measured); model's matmul shapes "
              f"{roof['model_matmul_tflops']:.0f} TFLOP/s {roof['model_shapes_tflops']}; spec sheet "
              f"{spec_peak or 'unknown'}; ceiling {roof['roof_tflops'] * 1e12 / flops_tok:,.0f} tok/s")
    ladder_base = dict(base)
    ladder_base.pop("micro_batch")
    results = {"device": device_name, "torch": torch.__version__, "preset": preset, "flops_per_token": flops_tok,
               "date": time.strftime("%Y-%m-%d"), "command": "python bench.py " + " ".join(argv or sys.argv[1:]),
               "spec_peak_tflops": spec_peak, **roof}
    tables = []
    for study in chosen:
        if study == "ladder":
            rows = ladder(ladder_base, cuda, args.timeout)
            table = ladder_table(rows, flops_tok, roof.get("roof_tflops"), spec_peak)
            plot_ladder(rows, flops_tok, roof.get("roof_tflops"), out / "ladder.png")
        elif study == "attention":
            rows = attention_study(base, cuda, args.timeout, args.only)
        elif study == "compile_modes":
            rows = compile_modes_study(base, cuda, args.timeout)
        elif study == "micro_batch":
            rows = micro_batch_study(base, cuda, args.timeout)
        elif study == "activation_checkpointing":
            rows = activation_checkpointing_study(base, cuda, args.timeout)
        elif study == "optimizer":
            rows = optimizer_study(preset, cuda)
        else:
            rows = profile_study(base, cuda)
        if study != "ladder":
            table = simple_table(rows)
        results[study] = rows
        sources = sorted({r["data"] for r in rows if "data" in r})
        note = f"\n\ndata: {', '.join(sources)}" if sources else ""
        if study == "ladder" and roof:
            note += f"; MFU (roof) is also the share of the ceiling, {roof['roof_tflops'] * 1e12 / flops_tok:,.0f} tok/s"
        tables.append(f"## {study.replace('_', ' ')}\n\n{table}{note}")
        (out / f"{study}.json").write_text(json.dumps({**results, "rows": rows}, indent=2, default=str))
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
