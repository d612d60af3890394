"""Measuring: every number bench.py reports is timed here. Mostly one rung: a configuration set
up by train.py's own setup(), timed over full optimizer steps of train.py's own train_step(),
with the GPU's clock and the kernels that ran; also an optimizer update, a matmul, a decode step
and a generation (onegpu's and transformers').

bench.py decides which rungs a study compares; this module measures them (run(), with a journal
that an interrupted study resumes from) and one rung at a time. Each rung runs in a fresh process
(so one rung's compilation, allocator state or crash cannot touch the next):

    python measure.py RUNG.json RESULT.json

reads a Rung and writes a Result (both JSON). Timing: a warm-up of up to 4 micro-batches and one
optimizer step (compilation happens here and is reported as warm-up), then `timed_steps` full
steps, wall clock with the device synchronised on both sides; the median is reported with the
spread (max - min over median).
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
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import attention as A
import checkpoint as CK
import config as C
import fastpaths as FP
import generate as G
import model as M
import onegpu_kernels as K
import train as TR

ROOT = Path(__file__).resolve().parent


@dataclass
class Rung:
    """One configuration to measure: a preset and overrides checked by the config loader."""
    name: str
    preset: str
    overrides: dict = field(default_factory=dict)  # "section__name": value, as config.load_config takes
    timed_steps: int = 3
    kernels: bool = False  # also record which attention kernel ran (one extra profiled micro-batch)

    def config(self) -> C.Config:
        """The rung's config through the strict loader: a misspelled key or a bad value raises."""
        return C.preset(self.preset, **{"train__sample_tokens": 0, **self.overrides,
                                        "train__steps": self.timed_steps + 1})


@dataclass
class Result:
    rung: str
    micro_batch: int = 0
    tok_s: float | None = None
    step_s: float | None = None
    spread: float | None = None
    warmup_s: float | None = None
    loss: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None  # CUDA graphs replay in a private pool the allocated peak does not see
    device_gib: float | None = None  # the card's memory, against which the next micro-batch's peak is predicted
    accum: int | None = None
    device: str = ""
    data: str = ""
    sm_mhz: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None  # the card's enforced power limit, against which power_w is read
    attention_kernels: str | None = None
    graph_breaks: int | None = None  # torch.compile's in the rung's process, by its last timed step (train.graph_breaks)
    skipped: str | None = None  # why the rung did not run (out of memory, timed out, needs CUDA ...)

    def row(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


# --- Timing: the clocks every measurement below reads ----------------------------------------

def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    """fn()'s result and the wall seconds it took, the device synchronised before and after: the
    time a user waits, the host's work included."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def gpu_seconds(fn, n: int = 1) -> float:
    """Seconds of GPU work for fn() run n times back to back, from CUDA events: the kernels
    alone, without the host's wait around them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def median_and_spread(values: list[float]) -> tuple[float, float]:
    """The median, and the spread: (max - min) over the median."""
    mid = statistics.median(values)
    return mid, (max(values) - min(values)) / mid


def median_seconds(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """The median of `repeats` timed calls of fn(), after `warmup` calls that are not counted."""
    return statistics.median([timed(fn, device)[1] for _ in range(warmup + repeats)][warmup:])


def backward_from_scratch(forward, leaves, grad=None):
    """A call that runs forward().backward(grad) with the leaves' gradients unset first, for timing one
    forward and backward: left set, every call after the first adds into them, a read and a write of
    each that a training step does not make for its activations (the loss study's bf16 logits at 88m:
    17 GB a call, about 4 ms of an H200's bandwidth)."""
    def call():
        for leaf in leaves:
            leaf.grad = None
        forward().backward(grad)
    return call


class ClockSampler(threading.Thread):
    """SM clock (MHz) and board power (W) sampled while a rung runs: through NVML (nvidia-ml-py)
    every 100 ms, or by polling nvidia-smi when that is not installed."""

    def __init__(self, device_index: int):
        super().__init__(daemon=True)
        # NVML and nvidia-smi number GPUs ignoring CUDA_VISIBLE_DEVICES; the UUID names the same card.
        self.card = f"GPU-{torch.cuda.get_device_properties(device_index).uuid}"
        self.samples, self.stop_flag = [], threading.Event()
        self.nvml, self.smi_path = None, None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByUUID(self.card)
        except Exception:  # no nvidia-ml-py, or no driver access through it
            self.smi_path = shutil.which("nvidia-smi")
        self.limit = self.power_limit()

    def smi(self, fields: str) -> list[float] | None:
        """nvidia-smi's values of the comma-separated query fields; None where one is not a number ("[N/A]")."""
        out = subprocess.run([self.smi_path, "-i", self.card, f"--query-gpu={fields}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        try:
            return [float(v) for v in out.strip().split(",")]
        except ValueError:
            return None

    def power_limit(self) -> float | None:
        """The card's enforced power limit in watts; None where it reports none."""
        if self.nvml:
            try:
                return self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000
            except self.nvml.NVMLError:
                return None
        return (self.smi("power.limit") or [None])[0] if self.smi_path else None

    def read(self) -> tuple[float, float] | None:
        if self.nvml:
            return (self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM),
                    self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000)
        values = self.smi("clocks.sm,power.draw") if self.smi_path else None
        return tuple(values) if values and len(values) == 2 else None

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
            return {}
        clocks, powers = zip(*self.samples)
        return {"sm_mhz": statistics.median(clocks), "power_w": round(statistics.median(powers), 1),
                "power_limit_w": self.limit}


def kernel_stats(fn, device, spans: list | None = None) -> dict[str, tuple[int, float]]:
    """(launches, total device (or CPU) milliseconds) per kernel name while fn() runs, from torch.profiler.
    spans: a list to append each CUDA kernel's (start, end, name) to, in microseconds (for gaps_between)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    stats = {}
    for e in prof.events():
        if device.type == "cuda" and e.device_type.name != "CUDA":
            continue
        t = (e.device_time if device.type == "cuda" else e.self_cpu_time_total) / 1000  # CPU ops nest: self time
        n, total = stats.get(e.name, (0, 0.0))
        stats[e.name] = (n + 1, total + t)
        if spans is not None and device.type == "cuda":
            spans.append((e.time_range.start, e.time_range.end, e.name))
    return stats


def kernel_times(fn, device, spans: list | None = None) -> dict[str, float]:
    """Total device (or CPU) milliseconds per kernel name while fn() runs (spans: as kernel_stats)."""
    return {name: ms for name, (_, ms) in kernel_stats(fn, device, spans).items()}


def gaps_between(spans: list[tuple[float, float, str]], largest: int = 8) -> tuple[float, int, list[str]]:
    """Where a device ran no kernel, from kernels' (start, end, name) spans in microseconds: (the milliseconds
    between the first kernel's start and the last one's end that no kernel covers, how many such gaps, the
    largest of them, each with the kernels that ended before it and started after it). Kernels that overlap
    (other streams) cover their time together. Whether the idle time of a step is spread over its thousands of
    launches or sits in a few places (a wait for the host, the step's start) is what this tells apart."""
    if not spans:
        return 0.0, 0, []
    found, total = [], 0.0
    ordered = sorted(spans)
    reach, before = ordered[0][1], ordered[0][2]
    for start, end, name in ordered[1:]:
        if start > reach:
            found.append((start - reach, before, name))
            total += start - reach
        if end > reach:
            reach, before = end, name
    found.sort(key=lambda g: -g[0])
    return total / 1000, len(found), [f"{gap / 1000:.3f} ms after {a[:70]} before {b[:70]}"
                                      for gap, a, b in found[:largest]]


# What a kernel's name says it does: one table for the profile's classes and for naming the attention
# kernel that ran. (backend, sign): cuDNN's names contain "flash" too (cudnn_generated_..._flash_fprop),
# so cudnn is tested first; the math backend shows only as softmax kernels, which the profile counts
# as elementwise.
ATTENTION_SIGNS = [("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "fmha"), ("efficient", "efficient_attention"),
                   ("flex", "flex_attention"), ("math", "softmax")]
FUSED_ATTENTION = tuple(sign for backend, sign in ATTENTION_SIGNS if backend != "math")
KERNEL_CLASSES = [("attention", FUSED_ATTENTION + ("attention", "sdpa")),
                  ("loss", ("nll", "log_softmax", "cross_entropy", "_loss_chunk", "logsumexp")),
                  # the gradient clipping's norm and clamp by their ATen names: a bare "norm" or "clamp" also names
                  # the fused QK-norm kernel and the FP8 casts, which the 2026-12-04 profile counted as optimizer
                  ("optimizer", ("adam", "multi_tensor", "foreach", "normtwo", "launch_clamp", "clip")),
                  ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "::mm", "bmm", "addmm", "cublas", "mm_"))]


def kernel_class(name: str) -> str:
    lower = name.lower()
    # Inductor names its pointwise and reduction kernels after the graph's ops around them: one with
    # "_scaled_mm" in its name is an FP8 cast before the matmul, not the matmul
    fused = lower.startswith(("triton_poi", "triton_red", "triton_per"))
    return next((c for c, signs in KERNEL_CLASSES if any(s in lower for s in signs) and not (fused and c == "matmul")),
                "elementwise/other")


def attention_kernels(run: TR.Run) -> str:
    """Which attention implementation really ran, read from the kernel names of one micro-batch:
    a silent fallback to the math backend shows up as softmax kernels and no fused kernel."""
    def one():
        TR.forward_loss(run.model, run.train_loader.next_batch(), run.cfg.train, run.device,
                        run.cfg.model.windows()).backward()
    names = kernel_times(one, run.device)
    seen = [label for label, sign in ATTENTION_SIGNS if any(sign in n.lower() for n in names)]
    fused = [s for s in seen if s != "math"]
    return fused[0] if fused else ("math (softmax kernels, no fused attention)" if "math" in seen else "unknown")


def measure(rung: Rung) -> Result:
    """Set up and time one rung in this process (see the module docstring)."""
    with tempfile.TemporaryDirectory() as workdir:
        run = TR.setup(rung.config(), log=lambda *a, **k: None, random_tokens_dir=Path(workdir))
        return time_run(run, rung)


def time_run(run: TR.Run, rung: Rung) -> Result:
    device, tcfg = run.device, run.cfg.train
    cuda = device.type == "cuda"

    # A windowed model is timed at its last, longest window, and the step with every term of the run's start (the
    # multi-token and prefix-token losses, a head tied to the embedding): each step at the most the run computes.
    targets = TR.step_terms(run, 0)

    def step(accum):
        loss, _ = TR.train_step(run.model, run.optimizer, run.train_loader.next_batch, accum, tcfg, device, 1e-4,
                                windows=run.cfg.model.windows(), prefetch=run.train_loader.prefetch, **targets)
        return loss.item()  # one read-back per step, as a logger would

    _, warmup_s = timed(lambda: step(min(4, run.accum)), device)  # compilation happens here
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sampler = ClockSampler(device.index or 0) if cuda else None
    if sampler:
        sampler.start()
    steps = [timed(lambda: step(run.accum), device) for _ in range(rung.timed_steps)]
    step_s, spread = median_and_spread([seconds for _, seconds in steps])
    result = Result(rung=rung.name, micro_batch=tcfg.micro_batch, tok_s=tcfg.batch_tokens / step_s, step_s=step_s,
                    spread=spread, warmup_s=warmup_s, loss=steps[-1][0], accum=run.accum,
                    peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                    reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
                    device_gib=torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None,
                    device=torch.cuda.get_device_name() if cuda else "cpu", data=run.data_source,
                    graph_breaks=TR.graph_breaks() if tcfg.compile else None, **(sampler.summary() if sampler else {}))
    if rung.kernels:
        result.attention_kernels = attention_kernels(run)
    return result


def run_in_subprocess(rung: Rung, timeout: int) -> Result:
    """Measure a rung in a fresh Python process; a failure (out of memory, a compile error, a
    timeout) comes back as a Result with `skipped` saying why."""
    rung.config()  # a typo in a rung fails here, before any process starts
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "rung.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps(dataclasses.asdict(rung)))
        try:
            done = subprocess.run([sys.executable, str(ROOT / "measure.py"), str(spec), str(out)],
                                  capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return Result(rung=rung.name, skipped=f"timed out after {timeout} s")
        if out.exists():
            return Result(**json.loads(out.read_text()))
        tail = (done.stderr or done.stdout).strip().splitlines()
        return Result(rung=rung.name, skipped=f"crashed (exit {done.returncode}): {tail[-1][:160] if tail else ''}")


def failure_reason(error: BaseException) -> str:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "out of memory"
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160] if str(error).strip() else ''}"


# --- The card's ceilings ---------------------------------------------------------------------

def matmul_tflops(m: int, k: int, n: int, device, repeats: int = 20) -> float:
    """Median TFLOP/s of a bf16 (m x k) @ (k x n) matmul on random data (never zeros: they run
    faster than real data would)."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * m * k * n / statistics.median([gpu_seconds(lambda: a @ b) for _ in range(repeats)]) / 1e12


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


# --- What the other studies time -------------------------------------------------------------

def update_ms(model: M.Llama, optimizer, device: torch.device, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of one gradient clip and optimizer update, the gradients already set."""
    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return median_seconds(update, device, repeats, warmup) * 1000


def loader_us(loader, repeats: int = 2000, warmup: int = 10) -> float:
    """Median CPU microseconds of one micro-batch from a ShardLoader (on the CPU: no copy)."""
    return median_seconds(loader.next_batch, torch.device("cpu"), repeats, warmup) * 1e6


GENERATE_REPEATS = 3  # timed generations per decoder, after one untimed; odd, so the median is one of the runs


def decode_speed(net: M.Llama, prompt: list[int], batch: int, new_tokens: int, decode) -> tuple[dict, list]:
    """Greedy decoding of `batch` continuations of prompt with one decoder: once untimed
    (compilation and graph capture; and a decode step is so light that the GPU's clock is still
    rising during the first run: single runs moved by up to 17% on an H200), then the median of
    GENERATE_REPEATS runs. The rate comes from generate's own marks (the device synchronised at
    the first token and at the end), the ones sample.py prints. Returns the row and the tokens."""
    def generate():
        return G.generate_batch(net, prompt, batch, new_tokens, 0.0, 0, 1.0, None, decode=decode)

    def warm_up():
        if decode is not G.decode_one:
            decode.capture_all(batch, greedy=True)
        generate()
    _, warm = timed(warm_up, net.embed.weight.device)
    runs = []
    for _ in range(GENERATE_REPEATS):
        tokens, timer = generate()
        start, first, end = timer.marks
        runs.append((batch * (new_tokens - 1) / (end - first), first - start))
    rate, spread = median_and_spread([r for r, _ in runs])
    first = next(f for r, f in runs if r == rate)  # the first-token time of the median run
    row = {"batch": batch, "first_token_ms": round(first * 1000, 2), "prefill_tok_s": batch * len(prompt) / first,
           "decode_tok_s": rate, "spread": round(spread, 3), "warmup_s": round(warm, 1)}
    if decode is not G.decode_one:
        row.update(step_us=round(batch * 1e6 / rate, 1), replay_us=round(replay_us(decode, batch), 1))
        try:  # the profile explains the rate; a profiler that fails here must not lose the rate measured
            row.update(decode_kernels(decode, batch))
        except RuntimeError as e:
            print(f"  the decode step was not profiled: {e}", flush=True)
    return row, tokens


def greedy_graph(decode: G.GraphDecoder, batch: int):
    """(tokens a replay, (graph, token, pos, recent tokens)) of the graph greedy decoding replays at `batch`:
    greedy_step's of the most tokens a replay, captured by a generation."""
    return max(((s, c) for (b, _, fn, s), c in decode.graphs.items() if b == batch and fn is G.greedy_step),
               key=lambda sc: sc[0])


def decode_graph(decode: G.GraphDecoder, batch: int, replays: int):
    """greedy_graph's graph and its tokens a replay, its position moved back by as many as `replays` replays
    advance it (not below 0), so that the replays to come end where the generation left it, inside the cache."""
    steps, (graph, _, pos, _) = greedy_graph(decode, batch)
    pos.sub_(replays * steps).clamp_(min=0)
    return graph, steps


def replay_us(decode: G.GraphDecoder, batch: int, n: int = 200) -> float:
    """GPU time of one decode step: the batch's graph replayed back to back for about n tokens (positions
    the generation wrote, not past them: a step reads its whole window), over the tokens decoded. Beside the
    step time of a real generation (step_us) it shows how much of each token is the GPU's work and how much
    the host's loop around it."""
    replays = max(1, n // greedy_graph(decode, batch)[0])
    graph, steps = decode_graph(decode, batch, replays)
    return gpu_seconds(graph.replay, replays) * 1e6 / (replays * steps)


def step_kernels(stats: dict[str, tuple[int, float]], steps: int, top: int = 8) -> dict:
    """A decode step's kernels from kernel_stats over `steps` replays of its graph: how many it
    launches, the microseconds they keep the GPU busy (against replay_us, the rest is the gaps
    between launches that wait for each other) and the `top` busiest, each as (launches, us) a step."""
    busiest = sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": round(sum(n for n, _ in stats.values()) / steps, 1),
            "busy_us": round(sum(ms for _, ms in stats.values()) * 1e3 / steps, 1),
            "top_kernels": {name: (round(n / steps, 1), round(ms * 1e3 / steps, 1)) for name, (n, ms) in busiest}}


def decode_kernels(decode: G.GraphDecoder, batch: int, n: int = 50) -> dict:
    """step_kernels of the batch's decode graph, replayed for about n tokens under torch.profiler (after
    one replay outside it), a token's share. The profiler sees each kernel of a replayed graph as its own
    launch."""
    replays = max(1, n // greedy_graph(decode, batch)[0])
    graph, steps = decode_graph(decode, batch, replays + 1)
    graph.replay()
    return step_kernels(kernel_stats(lambda: [graph.replay() for _ in range(replays)], torch.device("cuda")),
                        replays * steps)


def transformers_speed(model: M.Llama, prompt: list[int], new_tokens: int, batches, ours: dict) -> list[dict]:
    """transformers' generate on the same weights (written as export.py writes them: a stock class, or our own
    model as remote code for the default presets), the same prompt and number of new tokens: its dynamic cache,
    and on CUDA its compiled static cache. ours: {batch: onegpu's tokens}, to count the greedy tokens both agree
    on."""
    try:
        import transformers
    except ImportError:
        return [{"rung": "transformers", "skipped": "transformers is not installed (pip install -e '.[dev]')"}]
    device, dtype = model.embed.weight.device, model.embed.weight.dtype
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        CK.write_transformers_model(model.state_dict(), model.cfg, Path(tmp), eot_id=0)  # float32, as export.py
        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, trust_remote_code=True,
                                                               **{key: dtype}).to(device).eval()
    for batch in batches:
        for cache in ["dynamic"] + (["static"] if device.type == "cuda" else []):
            name = f"transformers {cache} cache batch {batch}"
            idx = torch.tensor([prompt] * batch, device=device)
            kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(idx),
                          **({"cache_implementation": "static"} if cache == "static" else {}))  # static: compiled

            def gen(n):
                return timed(lambda: hf.generate(idx, max_new_tokens=n, min_new_tokens=n, **kwargs), device)
            try:
                _, warm = gen(new_tokens)  # warm-up: compilation for the static cache
                _, first = gen(1)
                out, total = sorted((gen(new_tokens) for _ in range(GENERATE_REPEATS)), key=lambda r: r[1])[
                    GENERATE_REPEATS // 2]  # the median run, as for onegpu
            except Exception as e:  # an option this transformers version lacks
                rows.append({"rung": name, "skipped": failure_reason(e)})
                continue
            same = sum(a == b for a, b in zip(out[0, len(prompt):].tolist(), ours[batch][0]))
            rows.append({"rung": name, "batch": batch, "first_token_ms": round(first * 1000, 2),
                         "decode_tok_s": batch * (new_tokens - 1) / (total - first), "warmup_s": round(warm, 1),
                         "same_greedy_tokens": f"{same}/{new_tokens}", "transformers": transformers.__version__})
    return rows


# --- Running a study's rungs (bench.py decides which) ----------------------------------------

class Journal:
    """The rungs one study has measured so far, in results/<study>.partial.json, rewritten after
    each rung: a study stopped part-way (Ctrl-C, a lost machine, a time limit) keeps what it
    measured, and `bench.py --resume` reuses those rows instead of measuring them again. A rung
    is reused only with the same name, preset, settings and steps; one that timed out is measured
    again. The file is removed when the study completes (results/<study>.json is then written)."""

    def __init__(self, path: Path, header: dict, resume: bool):
        self.path, self.header, self.kept, self.measured = path, header, {}, []
        if not path.exists():
            return
        earlier = json.loads(path.read_text())
        if not resume:
            print(f"note: starting over; `--resume` would reuse the {len(earlier['measured'])} rungs in {path}")
            return
        for key in ("preset", "device", "batch_tokens"):
            if earlier.get(key) != header.get(key):
                raise ValueError(f"{path} was measured with {key}={earlier.get(key)!r}, this run has "
                                 f"{header.get(key)!r}: drop --resume, or pass --out with another folder")
        self.kept = {e["key"]: e["row"] for e in earlier["measured"]
                     if not e["row"].get("skipped", "").startswith("timed out")}

    @staticmethod
    def key(rung: Rung) -> str:
        return json.dumps([rung.name, rung.preset, rung.overrides, rung.timed_steps], sort_keys=True)

    def measure(self, rung: Rung, timeout: int) -> dict:
        key = self.key(rung)
        if key in self.kept:
            print(f"  kept from {self.path.name}", flush=True)
            row = self.kept[key]
        else:
            row = run_in_subprocess(rung, timeout).row()
        self.measured.append({"key": key, "row": row})
        self.path.write_text(json.dumps({**self.header, "measured": self.measured}, indent=2, default=str))
        return row

    def done(self):
        self.path.unlink(missing_ok=True)


def run(rungs: list[Rung], cuda: bool, timeout: int, journal: Journal | None = None,
        repeats: int = 1) -> list[dict]:
    """Each rung in its own process, one row per rung. repeats > 1 measures the whole list that many
    times in turn (A B C, A B C, ...), so a clock that drifts while the card warms touches every
    rung alike; each rung's row is then its median run (median_row)."""
    for r in rungs:  # every rung's config is checked before the first one runs
        r.config()
    runs = {r.name: [] for r in rungs}
    for i in range(repeats):
        for base in rungs:
            r = base if repeats == 1 else dataclasses.replace(base, name=f"{base.name} (run {i + 1} of {repeats})")
            reason = None if cuda else cpu_skip(r)
            print(f"rung: {r.name} ...", flush=True)
            if reason:
                row = Result(rung=r.name, micro_batch=r.config().train.micro_batch, skipped=reason).row()
            else:
                row = journal.measure(r, timeout) if journal else run_in_subprocess(r, timeout).row()
            if not row.get("micro_batch"):  # a rung that failed before measuring: its setting, not 0
                row["micro_batch"] = r.config().train.micro_batch
            runs[base.name].append(row)
    return [rows[0] if repeats == 1 else median_row(name, rows) for name, rows in runs.items()]


def median_row(name: str, rows: list[dict]) -> dict:
    """One rung's repeated runs as one row: the run with the median tok/s (the lower of the middle
    two for an even count), its runs counted and their spread, (fastest - slowest) / median. Two
    settings whose difference is inside both spreads are not told apart by this measurement."""
    measured = sorted((r for r in rows if r.get("tok_s")), key=lambda r: r["tok_s"])
    if not measured:
        return {**rows[-1], "rung": name}
    middle = measured[(len(measured) - 1) // 2]
    return {**middle, "rung": name, "runs": len(measured),
            "runs_spread": (measured[-1]["tok_s"] - measured[0]["tok_s"]) / middle["tok_s"]}


def cpu_skip(rung: Rung) -> str | None:
    """Why a rung is not measured on CPU, or None. CPU numbers are a smoke test of the code
    (setup() turns the CUDA-only settings off on CPU, and says so)."""
    o = rung.overrides
    if o.get("speed__attention") in A.SDPA_BACKENDS:
        return "SDPA backends are CUDA kernels"
    if o.get("train__compile"):  # the ladder is cumulative: every rung from compile on carries it
        return "a GPU rung (torch.compile and what is added after it): the CPU smoke test does not time it"
    return None



# --- The generation study (bench.py --generate) ------------------------------------------------------------------------------

# CUDA-graph decoders compared: (label, Inductor mode, generation fast paths on: model.GENERATION_FAST_PATHS, greedy
# tokens a graph replays: generate.GraphDecoder). Rows measured before and dropped (docs/performance/generation.md,
# has their figures): max-autotune without the fast paths (slower than the fused decode at both batches, 2026-11-30
# and 2026-12-02), the decode matmuls (no faster than Inductor's default, 2026-12-02, and below the decode MLP
# since), the fused decode without its split and without the decode MLP (below both with them, 2026-12-03), the
# presets' switches without dependent launches (below them at both modes and batches, twice on 2026-12-04). A
# max-autotune row costs a minute of autotuning.
PRESET_DECODE = ("fused_decode", "split_decode", "decode_mlp", "decode_pdl")  # configs/recipes/record.toml's
DECODE_VARIANTS = [("CUDA graph, Inductor default", "default", (), G.TOKENS_PER_REPLAY),
                   ("CUDA graph, Inductor default, the presets' switches, one token a replay", "default",
                    PRESET_DECODE, 1),
                   ("CUDA graph, max-autotune, the presets' switches, one token a replay", "max-autotune-no-cudagraphs",
                    PRESET_DECODE, 1),
                   (f"CUDA graph, Inductor default, the presets' switches, {G.TOKENS_PER_REPLAY} tokens a replay",
                    "default", PRESET_DECODE, G.TOKENS_PER_REPLAY),
                   (f"CUDA graph, max-autotune, the presets' switches, {G.TOKENS_PER_REPLAY} tokens a replay",
                    "max-autotune-no-cudagraphs", PRESET_DECODE, G.TOKENS_PER_REPLAY)]


def decode_variant(switches: tuple) -> FP.SpeedConfig:
    """Speed settings with the generation fast paths named in `switches` on and every other one off."""
    return FP.SpeedConfig(**dict.fromkeys(switches, True))


def generate_study(preset: str, cuda: bool, new_tokens: int, batches=(1, 8), prompt_len: int = 16,
                   vs_transformers: bool = True) -> list[dict]:
    """Greedy decoding speed of onegpu's sample path against transformers' generate on the same
    weights (written by export.py), same prompt, same number of new tokens, each timed by
    measure.py (one untimed generation, then the median of three). Random weights: speed does
    not depend on what the model learned."""
    device = torch.device("cuda" if cuda else "cpu")
    cfg = C.preset(preset).model
    torch.manual_seed(0)
    model = M.Llama(cfg).to(device).eval()
    dtype = torch.bfloat16 if cuda else torch.float32
    model = model.to(dtype)
    prompt = torch.randint(1, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    variants = [("eager", None, (), 1)] + ([v for v in DECODE_VARIANTS if K.AVAILABLE or not v[2]] if cuda else [])
    nets = {(): model}
    for _, _, switches, _ in variants:  # the same weights with Triton's decode paths switched on
        if switches not in nets:
            nets[switches] = M.Llama(cfg).to(device, dtype).eval()
            nets[switches].load_state_dict(model.state_dict())
            G.apply(nets[switches], decode_variant(switches), device)
    rows, ours = [], {}
    for batch in batches:
        for label, mode, switches, tokens_per_replay in variants:
            net = nets[switches]
            decode = G.decoder(net, device, mode is not None, mode or "default", tokens_per_replay)
            row, tokens = decode_speed(net, prompt, batch, new_tokens, decode)
            rows.append({"rung": f"onegpu {label} batch {batch}", **row})
            ours.setdefault(batch, tokens)  # the plain (eager) path's tokens: every other decoder is compared with them
            if label != "eager":
                same = sum(a == b for a, b in zip(tokens[0], ours[batch][0]))
                rows[-1]["same_greedy_tokens"] = f"{same}/{new_tokens}"
            print(f"{rows[-1]['rung']}: {row['decode_tok_s']:,.0f} tok/s", flush=True)
            if "top_kernels" in row:  # where the step's GPU time goes
                print(f"  a step: {row['kernels']:g} kernels, busy {row['busy_us']:,.1f} of {row['replay_us']:,.1f} us; "
                      "busiest (launches, us): " + "; ".join(f"{name[:60]} ({n:g}, {us:g})"
                                                            for name, (n, us) in row["top_kernels"].items()))
    if vs_transformers:
        rows += transformers_speed(model, prompt, new_tokens, batches, ours)
    return rows


# --- The decode parts alone (bench.py --decode-parts) ------------------------------------------------------------------

# The split attention's launch settings compared, (keys a loop step, programs in all): onegpu_kernels.py's own, and
# the one it replaced on 2026-12-03 (docs/LOG.md, "The split decode's launch settings, swept alone").
DECODE_LAUNCHES = ((K.SPLIT_BLOCK_KEYS, K.DECODE_PROGRAMS), (32, 128))
DECODE_POSITIONS = (16, 256, 516, 1000)  # cache positions timed: a 500-token generation's range and beyond
# decode_mlp's hidden units a program compared (onegpu_kernels.DECODE_MLP_HIDDEN): at 88m's 3,072 hidden units, 192,
# 96 and 48 programs on the H200's 132 SMs.
DECODE_MLP_UNITS = (16, 32, 64)


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Microseconds a call of fn() takes on the GPU: a CUDA graph of `calls` calls, after three calls on a
    side stream (Triton's autotuning among them), timed by gpu_seconds over `replays` replays (median).
    One replay's launches run back to back as in a decode step's graph, without the CPU between them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return statistics.median(gpu_seconds(graph.replay) for _ in range(replays)) * 1e6 / calls


def decode_mlp_rows(x, w1, w2, units) -> list[dict]:
    """decode_parts_study's ReLU² MLP rows for x (B, 1, d) through one (w1, w2) pair a layer, (L, hidden, d)
    and (L, d, hidden), taken in turn so that their bytes come from memory, as in a decode step."""
    (B, _, _), L, bf = x.shape, w1.shape[0], x.dtype
    up_plain = lambda i: F.relu(F.linear(x, w1[i])).square()  # noqa: E731
    plain = lambda i: F.linear(up_plain(i), w2[i])  # noqa: E731
    kernel = lambda i: K.decode_mlp(x, w1[i], w2[i])  # noqa: E731
    summed = lambda i: kernel(i).sum(0).to(bf)  # noqa: E731
    # Each half of the MLP alone, through the small matmul's tiles: which half the fused kernel loses in.
    hidden = up_plain(0)  # (B, 1, hidden)
    up = lambda i: K.small_matmul(x, w1[i], True)  # noqa: E731
    down = lambda i: K.small_matmul(hidden, w2[i])  # noqa: E731
    down_plain = lambda i: F.linear(hidden, w2[i])  # noqa: E731
    # name -> (onegpu_kernels.py's launch settings, {}: as they are; what is timed; its output; the plain
    # output; the autotuned kernel it times, whose picked tiles the row names, or None)
    mlp_k, matmul_k = K._decode_mlp_kernel, K._small_matmul_kernel
    variants = {"plain (matmul, ReLU², matmul)": ({}, plain, plain, plain, None),
                **{f"decode_mlp alone, {n} hidden units a program":
                   (dict(DECODE_MLP_HIDDEN=n), kernel, summed, plain, mlp_k) for n in units},
                "decode_mlp + the sum of its partials": ({}, summed, summed, plain, mlp_k),
                "the up-projection and square alone (small_matmul)": ({}, up, up, up_plain, matmul_k),
                "the down-projection alone (small_matmul)": ({}, down, down, down_plain, matmul_k)}
    rows = []
    for name, (settings, timed, output, reference, tuned) in variants.items():
        with K.launch_settings(**settings):
            row = {"rung": f"ReLU² MLP, batch {B}, {name}, {L} layers' weights in turn",
                   "us": round(graph_us(lambda: [timed(i) for i in range(L)]) / L, 2)}
            if output is not reference:
                row["max_abs_diff"] = round((output(0).float() - reference(0).float()).abs().max().item(), 5)
            if tuned is not None:
                row["tiles"] = K.chosen_tiles(tuned)
        rows.append(row)
    return rows


def decode_parts_study(preset: str, cuda: bool, batches=(1, 8), units=DECODE_MLP_UNITS) -> list[dict]:
    """Microseconds of a decoded token's fused parts alone at the preset's shapes (graph_us), each against
    its plain twin: one layer's attention (onegpu_kernels.decode_step with the preset's QK-norm, value mix,
    gate and window) with one program a head, then its positions split at each of DECODE_LAUNCHES
    (model.split_decode), at DECODE_POSITIONS; and the ReLU² MLP as the plain chain of matmuls, as
    onegpu_kernels.decode_mlp alone (at each of `units` hidden units a program: each autotunes its own
    tiles), with the sum of its partials (model.decode_mlp), and each of
    its halves alone (onegpu_kernels.small_matmul). The attention's calls reuse one cache, which stays in
    the L2 cache: its rows are the kernel's floor. The MLP's calls take each layer's weights in turn
    (88m: 8 x 9.4 MB, more than an H200's 50 MB of L2), which come from memory as in a decode step."""
    if not (cuda and K.AVAILABLE):
        return [{"rung": "decode parts", "skipped": "Triton kernels in CUDA graphs: measured on CUDA only"}]
    cfg, dev, bf = C.preset(preset).model, torch.device("cuda"), torch.bfloat16
    H, Hkv, hd, S = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, max(DECODE_POSITIONS) + 1
    g = torch.Generator(dev).manual_seed(0)
    cos, sin = (t[0].to(dev, bf) for t in M.rope_tables(hd, 1, cfg.rope_theta, cfg.rope_truncate))
    L = cfg.n_layers  # one (w1, w2) pair a layer, (L, hidden, d) and (L, d, hidden)
    w1 = torch.randn(L, cfg.ffn_hidden, cfg.d_model, device=dev, generator=g).to(bf) * cfg.d_model ** -0.5
    w2 = torch.randn(L, cfg.d_model, cfg.ffn_hidden, device=dev, generator=g).to(bf) * cfg.ffn_hidden ** -0.5
    rows = []
    for B in batches:
        qkv = torch.randn(B, 1, H + 2 * Hkv, hd, device=dev, generator=g).to(bf)
        k_cache, v_cache = (torch.randn(B, Hkv, S, hd, device=dev, generator=g).to(bf) for _ in range(2))
        parts = dict(scale=cfg.attn_scale or hd ** -0.5, window=cfg.attn_window)
        if cfg.qk_norm:
            parts.update(q_gain=torch.ones(hd, device=dev, dtype=bf), k_gain=torch.ones(hd, device=dev, dtype=bf),
                         eps=cfg.norm_eps)
        if cfg.value_embeds:
            parts.update(v_mix=torch.tensor([0.5, 0.5], device=dev, dtype=bf),
                         ve=torch.randn(B, 1, Hkv * hd, device=dev, generator=g).to(bf))
        if cfg.attn_gate:
            parts.update(gate_x=torch.randn(B, 1, cfg.d_model, device=dev, generator=g).to(bf),
                         gate_w=torch.randn(H, M.GATE_CHANNELS, device=dev, generator=g).to(bf))
        counts = torch.zeros(B, Hkv, device=dev, dtype=torch.int32)
        for launch in (None, *DECODE_LAUNCHES):
            keys, programs = launch or (None, None)
            row = {"rung": f"attention, batch {B}, " + ("one program a head" if launch is None else
                                                         f"split: {keys} keys a step, {programs} programs")}
            for pos in DECODE_POSITIONS:
                at = torch.tensor([pos], device=dev)
                step = lambda c: K.decode_step(qkv, cos, sin, k_cache, v_cache, at, counts=c, **parts)  # noqa: E731
                with K.launch_settings(SPLIT_BLOCK_KEYS=keys, DECODE_PROGRAMS=programs):
                    row[f"us_at_{pos}"] = round(graph_us(lambda: step(None if launch is None else counts)), 2)
                    if launch is not None:  # the split's output against one program a head's, and its counters reset
                        err = (step(counts).float() - step(None).float()).abs().max().item()
                        row["max_abs_diff"] = max(row.get("max_abs_diff", 0.0), round(err, 5))
                        assert not counts.any(), "decode_step left its split counters set"
            rows.append(row)
        if not FP.fast_path_applies("decode_mlp", cfg, FP.SpeedConfig()):
            continue
        rows += decode_mlp_rows(torch.randn(B, 1, cfg.d_model, device=dev, generator=g).to(bf), w1, w2, units)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="Measure one rung in this process (bench.py runs this for each rung).")
    p.add_argument("rung", type=Path, help="JSON file holding a Rung (name, preset, overrides, timed_steps, kernels)")
    p.add_argument("result", type=Path, help="JSON file to write the Result to")
    args = p.parse_args(argv)
    rung = Rung(**json.loads(args.rung.read_text()))
    try:
        result = measure(rung)
    except Exception as e:  # the parent reads why from the result file
        traceback.print_exc()
        result = Result(rung=rung.name, skipped=failure_reason(e))
    args.result.write_text(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    main()
