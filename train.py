"""Train the model.

    python train.py                                   # embedded default: tiny model, stdlib corpus
    python train.py --config configs/88m.toml         # the real run (compile, fused AdamW, bf16, tf32 on)
    python train.py --config configs/88m.toml --resume
    torchrun --nproc_per_node=2 train.py --config configs/88m.toml

Settings come from dataclass defaults, then the --config file, then command-line flags (every
field of ModelConfig, DataConfig and TrainConfig is a flag: --micro-batch 32, --no-compile; see
config.py). A run lives in runs/<name>/: config.json, log.jsonl, ckpt.pt, loss.png, summary.json.

Read top to bottom: the schedule, setup() (device, data, model, optimizer: the one place a run
is assembled, which bench.py's rungs use too), train_step(), evaluate(), then train(): resume,
the loop, the summary.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import attention as A
import boards as BO
import checkpoint as CK
import config as C
import data as D
import fastpaths as FP
import flops as FL
import generate as G
import model as M
import optim as O
import plots as PL
import sizing as SZ
import tokenizer as tk

ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = C.PRESETS_DIR / "tiny.toml"  # what `python train.py` with no --config trains

# Dense BF16 tensor-core peaks (FP32 accumulate, no sparsity) in TFLOP/s, matched against
# torch.cuda.get_device_name(). Sources: NVIDIA's H100/H200, A100, L4 and L40S datasheets,
# the Ada and Ampere GA102 whitepapers; the 4060 Laptop figure is the spec-sheet 29.1 quoted in
# "Making Training Fast on One GPU". Order matters: the first substring that matches wins.
PEAK_BF16_TFLOPS = [
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.1),
    ("L4", 121.0), ("RTX 4090", 165.2), ("RTX 4060 Laptop", 29.1), ("RTX 3090", 71.0),
]


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def staged_micro_batch(batch_tokens: int, micro_batch: int, context: int, world: int, stages: int) -> int | None:
    """The largest micro-batch up to micro_batch whose step of batch_tokens divides into `stages` stages of whole
    micro-batches (train.batch_stages), or None."""
    return next((b for b in range(micro_batch, 0, -1) if batch_tokens % (b * context * world) == 0
                 and batch_tokens // (b * context * world) % stages == 0), None)


def accumulation_steps(batch_tokens: int, micro_batch: int, context: int, world: int) -> int:
    per_pass = micro_batch * context * world
    if batch_tokens % per_pass:
        raise ValueError(f"train.batch_tokens={batch_tokens:,} is not a multiple of micro_batch x context x "
                         f"world size = {micro_batch} x {context} x {world} = {per_pass:,}: change "
                         f"batch_tokens or micro_batch")
    return batch_tokens // per_pass


WINDOW_BLOCK = 128  # FlexAttention's block size: a scheduled window grows by whole blocks
PLAIN_CONTEXT = 1024  # every run's loss is also reported on plain causal windows of this many tokens
def probing_end(r: "Run", p: "Progress", session: "Session") -> bool:
    """Whether this step is one of the unsized run's probe steps timed at the window schedule's end."""
    return (r.steps == SZ.UNSIZED and bool(r.cfg.train.window_start)
            and p.step >= session.first_step + 2 + (SZ.PROBE_STEPS - 2) // 2)


def window_at(step: int, steps: int, cfg: C.Config) -> tuple[int, ...]:
    """The sliding windows (long, short[, paired]) at `step` (ModelConfig.windows): model.attn_window, or with
    train.window_start a window grown linearly from window_start to attn_window over the run, rounded
    up to whole blocks of 128 tokens (FlexAttention's block), or of window_start where that is smaller.
    modded-nanogpt grows 128 to 1,792 this way: short windows cost less while the model learns local
    statistics, and the long ones come when it can use them."""
    start, end = cfg.train.window_start, cfg.model.attn_window
    if not start:
        return cfg.model.windows(end)
    if steps == SZ.UNSIZED:  # a train.seconds run before size_steps: its probe times the schedule's two ends
        return cfg.model.windows(start)
    block = min(WINDOW_BLOCK, start)
    width = start + min(1.0, step / steps) * (end - start)
    return cfg.model.windows(min(end, block * math.ceil(width / block)))


def follow_window(model: M.Llama, windows: tuple[int, ...]):
    """With model.rope_yarn, RoPE's tables stretched to the long layers' window of this step (Llama.set_tables), when
    it has grown since the last: outside the compiled forward, which reads the same buffers."""
    if model.cfg.rope_yarn and model.tables_window != windows[0]:
        model.set_tables(windows[0])


# --- Setting up a run ----------------------------------------------------------------------

def cpu_fallbacks(cfg: C.TrainConfig, device: torch.device, log=print) -> C.TrainConfig:
    """On CPU, turn off the CUDA-only settings and say so in one line."""
    if device.type == "cuda":
        return cfg
    ignored = [n for n in ("tf32", "bf16", "pin") if getattr(cfg, n)]
    if cfg.optimizer == "fused":
        ignored.append("fused")
    if ignored:
        log(f"note: running on CPU, so {', '.join('--' + n for n in ignored)} "
            f"{'is' if len(ignored) == 1 else 'are'} ignored (CUDA-only)")
    return dataclasses.replace(cfg, tf32=False, bf16=False, pin=False,
                               optimizer="foreach" if cfg.optimizer == "fused" else cfg.optimizer)


def set_precision(cfg: C.TrainConfig):
    # "high" lets float32 matmuls use TF32 tensor cores (10 mantissa bits in the multiply,
    # float32 sums); "highest", PyTorch's default, keeps full float32.
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = cfg.tf32


def autocast(cfg: C.TrainConfig, device: torch.device):
    """BF16 autocast: matmuls in bfloat16, weights, gradients and AdamW state stay float32. FP16 (train.fp16)
    wins over it where both are on: float16 matmuls, whose gradients a GradScaler keeps in range."""
    if cfg.fp16 or cfg.bf16:
        return torch.autocast(device.type, dtype=torch.float16 if cfg.fp16 else torch.bfloat16)
    return contextlib.nullcontext()


def half_precision(cfg: C.TrainConfig, device: torch.device, log=print) -> C.TrainConfig:
    """bf16 on a GPU without it (before Ampere: T4, V100, RTX 20) becomes fp16 with a gradient scaler,
    as nanochat does by compute capability; said in one line."""
    if (cfg.bf16 and not cfg.fp16 and device.type == "cuda"
            and not torch.cuda.is_bf16_supported(including_emulation=False)):
        log(f"note: {torch.cuda.get_device_name(device)} has no bf16 tensor cores: training in fp16 with a gradient "
            f"scaler instead (--no-bf16 --no-fp16 for float32)")
        return dataclasses.replace(cfg, fp16=True)
    return cfg


def compile_args(mode: C.CompileMode) -> dict:
    """torch.compile's keyword arguments for train.compile_mode. coordinate-descent is not one of
    torch's modes but one Inductor option on the default mode (torch takes a mode or options, not both)."""
    if mode == "coordinate-descent":
        return {"options": {"coordinate_descent_tuning": True}}
    return {"mode": None if mode == "default" else mode}


def graph_breaks() -> int:
    """How many times torch.compile has split a graph in this process so far. Each break runs the code around it
    without Inductor's fusions, and one inside an autograd function runs that whole function eagerly, silently
    (the FP8 head's did: docs/LOG.md, 2026-12-05)."""
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def build_model(cfg: C.Config, speed: FP.SpeedConfig, device: torch.device, seed: int):
    """(raw model, model to call, the fast paths swapped in): the plain model on `device`, then the speed paths
    of `speed` (cfg.speed as this device runs it) and the recomputation cfg.train turns on, swapped in; the
    second is compiled and/or DDP-wrapped as configured."""
    torch.manual_seed(seed)
    raw = M.Llama(cfg.model).to(device)
    if cfg.train.untie_at:  # the head and the embedding start as one matrix (a resume loads its own weights over it)
        O.share_init(raw)
    swapped = FP.apply(raw, speed, device)
    FP.apply_recompute(raw, cfg.train.activation_checkpointing, cfg.train.recompute_mlp)
    run = raw
    if cfg.train.compile:
        run = torch.compile(raw, **compile_args(cfg.train.compile_mode))
    if dist.is_initialized():
        run = torch.nn.parallel.DistributedDataParallel(run, device_ids=[device.index] if device.type == "cuda" else None)
    return raw, run, swapped


@dataclass
class Run:
    """Everything a training run (or one bench rung) works with, assembled by setup()."""
    cfg: C.Config  # with the CPU fallbacks applied
    device: torch.device
    rank: int
    world: int
    raw: M.Llama  # the module itself: its state_dict is what checkpoints hold
    model: torch.nn.Module  # what is called: compiled and/or DDP-wrapped
    optimizer: torch.optim.Optimizer
    train_loader: D.ShardLoader
    val_loader: D.ShardLoader | None  # None with random tokens
    accum: int
    steps: int
    tokenizer_path: Path | None
    tokenizer_hash: str
    data_source: str  # "<corpus> shards" or "random tokens"
    # Plain causal windows of PLAIN_CONTEXT tokens from the same validation split, where the run trains on
    # something else (a longer context or document masks): the loss every recipe can be compared by.
    plain_val_loader: D.ShardLoader | None = None
    scaler: torch.amp.GradScaler | None = None  # train.fp16's gradient scaler
    # With a sliding window shorter than the context: the same targets as val_loader's, each with the whole
    # window before it (ShardLoader.scored_targets), as in one long sequence (modded-nanogpt evaluates on
    # sequences of 262,144 tokens, where few documents are cut).
    whole_val_loader: D.ShardLoader | None = None
    swapped: list = dataclasses.field(default_factory=list)  # the fast paths fastpaths.apply swapped in
    # With train.prefix_weight: each token id's prefix token (tokenizer.prefix_ids), (vocab,) on the device.
    prefix_table: torch.Tensor | None = None


def device_speed(speed: FP.SpeedConfig, tcfg: C.TrainConfig, device: torch.device, say) -> FP.SpeedConfig:
    """The speed paths this device runs of those asked for, saying in one line which it turns off and why. The
    config keeps what was asked: a checkpoint resumes with the same command on any card."""
    runs, why = FP.for_device(speed, device)
    if runs != speed:
        off = [f"--no-{name.replace('_', '-')}" for name in FP.SPEED_FIELDS if getattr(runs, name) != getattr(speed, name)]
        say(f"note: {', '.join(off)} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}: "
            f"{why}; the plain paths compute the same functions")
    if not tcfg.bf16 or tcfg.fp16:  # the bf16 stream needs bf16 autocast
        runs = dataclasses.replace(runs, bf16_residual=False)
    if runs.fp8_head and tcfg.fp16:  # after for_device: a card without bf16 has no FP8 units either
        raise ValueError("speed.fp8_head scales the head's gradient by a fixed bound, which fp16's loss scale would "
                         "overflow: use --no-fp8-head with --fp16")
    return runs


def validation_loader(files: list, say, **args) -> D.ShardLoader:
    """A validation loader at the run's micro-batch, or, where a small corpus's split holds fewer windows than
    that, at as many as it holds (saying so where `say` is given): the loss is the same mean over the same
    windows, only computed in smaller batches. A split of no window at all is still refused."""
    one = D.ShardLoader(files, **{**args, "batch": 1})
    if one.per_rank >= args["batch"]:
        return D.ShardLoader(files, **args)
    if say is not None:
        say(f"note: the validation split holds {one.per_rank} window(s) of {args['seq_len'] + 1} tokens a rank, "
            f"fewer than the micro-batch of {args['batch']}: evaluating {one.per_rank} at a time (a larger "
            f"data.val_fraction evaluates on more)")
    return D.ShardLoader(files, **{**args, "batch": one.per_rank})


def setup(cfg: C.Config, rank: int = 0, world: int = 1, log=print, random_tokens_dir: Path | None = None) -> Run:
    """Device, data, model and optimizer for cfg. Rank 0 prepares the data (the others wait).
    random_tokens_dir: train on random token ids written there instead of the corpus (bench's
    speed rungs: no tokenizer or corpus needed)."""
    say = log if rank == 0 else (lambda *a, **k: None)
    device = C.pick_device(cfg.train.device)
    if dist.is_initialized() and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    tcfg = half_precision(cpu_fallbacks(cfg.train, device, say), device, say)
    cfg = dataclasses.replace(cfg, train=tcfg)
    speed = device_speed(cfg.speed, tcfg, device, say)
    set_precision(tcfg)
    T, B, V = cfg.model.context, tcfg.micro_batch, cfg.model.vocab_size
    accum = accumulation_steps(tcfg.batch_tokens, B, T, world)
    if accum % tcfg.batch_stages:
        fits = staged_micro_batch(tcfg.batch_tokens, B, T, world, tcfg.batch_stages)
        raise ValueError(f"train.batch_stages={tcfg.batch_stages} grows the batch in whole micro-batches, but a step's "
                         f"micro-batches ({accum} of {B} x {T} tokens a rank) do not divide into {tcfg.batch_stages}: "
                         + (f"use --micro-batch {fits}" if fits else "change batch_tokens or micro_batch"))
    steps = SZ.total_steps(tcfg)
    if steps != SZ.UNSIZED and SZ.fitted_warmup(tcfg, steps) < tcfg.warmup_steps:
        say(f"note: train.warmup_steps={tcfg.warmup_steps} would warm up over more than half of the run's {steps} "
            f"steps and leave no room for its stable phase and warm-down: warming up over "
            f"{SZ.fitted_warmup(tcfg, steps)} steps instead")
        tcfg = dataclasses.replace(tcfg, warmup_steps=SZ.fitted_warmup(tcfg, steps))
        cfg = dataclasses.replace(cfg, train=tcfg)
    if steps == SZ.UNSIZED and random_tokens_dir is not None:
        raise ValueError("train.seconds sizes a run on its corpus; random-token speed rungs time fixed steps: "
                         "give train.steps")
    loader_args = dict(batch=B, seq_len=T, vocab_size=V, rank=rank, world=world, doc_ids=tcfg.doc_mask,
                       device=device)
    plain_val = whole_val = None
    if random_tokens_dir is not None:
        needed = (steps + 1) * tcfg.batch_tokens + 8 * B * (T + 1)
        files = D.random_shards(Path(random_tokens_dir), V, needed)
        tok_path, tok_hash, val_loader, source = None, "random0000000000", None, "random tokens"
    else:
        if rank == 0:
            D.prepare(cfg.data, V, log=say)
        if dist.is_initialized():
            dist.barrier()
        folder = D.data_dir(cfg.data, V)
        tok_path = folder / "tokenizer.json"
        tok_hash = tk.tokenizer_hash(tok_path)
        files, source = D.shard_files(folder, "train"), f"{cfg.data.corpus} shards"
        val = dict(loader_args, tokenizer_hash=tok_hash, shuffle=False)
        val_loader = validation_loader(D.shard_files(folder, "val"), say, **val)
        if T > PLAIN_CONTEXT or (tcfg.doc_mask and T == PLAIN_CONTEXT):
            plain_val = validation_loader(D.shard_files(folder, "val"), None,
                                          **{**val, "seq_len": PLAIN_CONTEXT, "doc_ids": False})
        if cfg.model.windowed:
            whole_val = validation_loader(D.shard_files(folder, "val"), None, stride=T - cfg.model.attn_window, **val)
    train_loader = D.ShardLoader(files, tokenizer_hash=tok_hash, seed=tcfg.seed, pin=tcfg.pin, **loader_args)
    raw, model, swapped = build_model(cfg, speed, device, tcfg.seed)
    scaler = torch.amp.GradScaler(device.type) if tcfg.fp16 else None
    return Run(cfg, device, rank, world, raw, model, O.configure_optimizer(raw, tcfg), train_loader, val_loader,
               accum, steps, tok_path, tok_hash, source, plain_val, scaler, whole_val, swapped,
               prefix_table(tok_path, V, device) if tcfg.prefix_weight else None)


def prefix_table(tok_path: Path | None, vocab_size: int, device: torch.device) -> torch.Tensor:
    """train.prefix_weight's table: each token id's prefix token (tokenizer.prefix_ids), -1 where none. Random
    tokens (speed rungs) have no vocabulary: every entry is -1, so the loss still computes the column."""
    ids = tk.prefix_ids(tk.load_tokenizer(tok_path)) if tok_path else [-1] * vocab_size
    return torch.tensor(ids, dtype=torch.long, device=device)


# --- The step ------------------------------------------------------------------------------

def masks_for(batch, device: torch.device, windows: tuple[int, ...] | None = None) -> A.Masks | None:
    """The attention masks of a micro-batch (x, y[, doc_ids]): its documents when the loader gives their ids
    (train.doc_mask), and the sliding windows (long, short) (window_at; None: the model's own, applied by it)."""
    doc_ids = batch[2] if len(batch) > 2 else None
    if windows is None and doc_ids is None:
        return None
    return A.masks(batch[0].shape[1], device, doc_ids, windows or (0, 0))


def forward_loss(model, batch, cfg: C.TrainConfig, device: torch.device, windows: tuple[int, ...] | None = None,
                 mtp: tuple[float, ...] = (1.0,), prefix: tuple[torch.Tensor, float] | None = None):
    """Mean loss of one micro-batch (x, y[, doc_ids]); with later tokens weighted in mtp (mtp_weights_at), the
    multi-token loss; with prefix (table, weight) (prefix_at), the prefix-token loss beside it. The targets keep their
    form all run, a faded one at weight 0: a compiled model given another form compiles again, mid-run."""
    masks = masks_for(batch, device, windows)
    multi = len(mtp) > 1 or prefix is not None
    with autocast(cfg, device):
        return model(batch[0], multi_targets(batch[1], mtp, prefix) if multi else batch[1], masks)


def multi_targets(y, weights: tuple[float, ...], prefix: tuple[torch.Tensor, float] | None = None) -> M.MultiTargets:
    """y (B, T), each position's next token -> model.MultiTargets: the K = len(weights) tokens after each position,
    (B, T, K), -1 past the sequence's end, with their weights. Each position's logits also learn the tokens after
    the next, with no parameter added (modded-nanogpt record #53); weights[0] = 1 is the next-token loss. With
    prefix (table, weight), one more target: the next token's prefix token (table[y], -1 where it has none), at
    that weight (record #88): a shorter guess the next token extends, an easier target early in the run."""
    ids = [F.pad(y[:, k:], (0, k), value=-1) for k in range(len(weights))]
    if prefix is not None:
        table, weight = prefix
        ids, weights = ids + [table[y]], (*weights, weight)
    # The weights change as they fade, so they cross to the GPU every micro-batch: pinned, so the copy does not
    # stall the queue (data.to_device)
    weights = D.to_device(torch.tensor(weights, dtype=torch.float32), y.device, pin=y.is_cuda)
    return M.MultiTargets(torch.stack(ids, dim=-1), weights)


def step_lr(step: int, tcfg: C.TrainConfig, steps: int) -> float:
    """The scheduled learning rate at `step` (optim.lr_at), times sqrt(stage) of the batch schedule (sizing.batch_stage):
    each group's rate follows it at its own ratio."""
    return O.lr_at(step, tcfg, steps) * math.sqrt(SZ.batch_stage(step, steps, tcfg.batch_stages))


def prefix_at(step: int, steps: int, tcfg: C.TrainConfig,
              table: torch.Tensor | None) -> tuple[torch.Tensor, float] | None:
    """The prefix-token loss at `step` of `steps`: (table, weight), train.prefix_weight for the run's first third,
    fading linearly to 0 over the second (modded-nanogpt record #88's 0.25 -> 0.25 -> 0), then at weight 0 (one
    form of the targets all run: forward_loss); None in a run without it."""
    weight = tcfg.prefix_weight * min(1.0, max(0.0, 2.0 - 3.0 * step / max(1, steps)))
    return (table, weight) if tcfg.prefix_weight and table is not None else None


def step_terms(r: Run, step: int) -> dict:
    """train_step's terms at `step` of the run: the multi-token loss's weights, the prefix-token loss, and with
    train.untie_at the head and the embedding with whether they step as one matrix (optim.tie_grads)."""
    tcfg = r.cfg.train
    tie = (r.raw.head.weight, r.raw.embed.weight, step < tcfg.untie_at * r.steps) if tcfg.untie_at else None
    return {"mtp": mtp_weights_at(step, r.steps, tcfg.mtp_tokens),
            "prefix": prefix_at(step, r.steps, tcfg, r.prefix_table), "tie": tie}


def mtp_weights_at(step: int, steps: int, tokens: int) -> tuple[float, ...]:
    """The multi-token loss's weights at `step` of `steps` (train.mtp_tokens of them): 1, 1/2, 1/4, ... with the
    run cut in `tokens` parts, part p predicting the first tokens - p, its last weight fading linearly to 0.
    For 3, modded-nanogpt's [1, 0.5, 0.25 -> 0] -> [1, 0.5 -> 0] -> [1]."""
    part, into = divmod(min(1.0, step / max(1, steps)) * tokens, 1.0)
    kept = max(1, tokens - int(part))  # the last step is the last part's
    return tuple(0.0 if j >= kept else 0.5 ** j * ((1 - into) if j == kept - 1 and j else 1.0) for j in range(tokens))


def train_step(model, optimizer, next_batch, accum: int, cfg: C.TrainConfig, device: torch.device, lr: float,
               momentum: float | None = None, windows: tuple[int, ...] | None = None, scaler=None, prefetch=None,
               mtp: tuple[float, ...] = (1.0,), prefix: tuple[torch.Tensor, float] | None = None,
               tie: tuple[torch.Tensor, torch.Tensor, bool] | None = None):
    """One optimizer step over `accum` micro-batches. Returns (loss, grad norm) as 0-d tensors on
    the device; reading them is the caller's one synchronization per step. With skip_nonfinite,
    a step whose loss or gradient is NaN/inf changes nothing and returns them as they were.
    lr: the scheduled AdamW rate (each group runs at its lr_ratio of it); momentum: Muon's at this
    step (None: as configured); windows: the sliding windows (long, short) at this step (window_at).
    scaler: fp16's GradScaler: the loss is scaled before backward, the gradients unscaled before
    clipping, and a step whose gradients overflowed is skipped by the scaler (its norm comes back inf).
    prefetch: called once the last micro-batch's backward is queued, to draw the next step's first
    micro-batch while the GPU works (data.ShardLoader.prefetch); None: it is drawn when that step asks.
    mtp: the multi-token loss's weights at this step (mtp_weights_at); prefix: the prefix-token loss's (prefix_at).
    tie: (head, embedding, tied) with train.untie_at: tied, they step as one matrix (optim.tie_grads)."""
    O.set_step_rates(optimizer, lr, momentum)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # CUDA graphs replay into the same output memory, so a gradient that autograd adopted as .grad
    # would be overwritten by the next micro-batch: under those modes gradients accumulate into
    # buffers of our own, zeroed in place.
    keep_grads = cfg.compile and cfg.compile_mode in C.CUDA_GRAPH_MODES
    if keep_grads:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    loss_sum = torch.zeros((), device=device)
    for i in range(accum):
        batch = next_batch()
        # Under DDP, only the last micro-batch all-reduces the accumulated gradients.
        sync = i == accum - 1 or not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = forward_loss(model, batch, cfg, device, windows, mtp, prefix) / accum  # mean over the whole step
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach()
    if prefetch is not None:
        prefetch()
    if tie is not None:
        O.tie_grads(optimizer, *tie)
    if scaler is not None:
        for opt in O.inner_optimizers(optimizer):
            scaler.unscale_(opt)
    if cfg.grad_clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    else:  # no clipping: the norm is not computed (nanochat measured clipping at +2% time for no gain)
        grad_norm = torch.zeros((), device=device)
    # Under fp16 an overflowed gradient is the scaler's to skip (it lowers its scale in update()).
    finite = torch.isfinite(loss_sum) & (torch.isfinite(grad_norm) if scaler is None else True)
    if cfg.skip_nonfinite and not bool(finite):
        optimizer.zero_grad(set_to_none=not keep_grads)
        return loss_sum, grad_norm
    if scaler is not None:
        for opt in O.inner_optimizers(optimizer):
            scaler.step(opt)
        scaler.update()
    else:
        optimizer.step()
    if tie is not None and tie[2]:
        tie[1].data.copy_(tie[0].data)  # the embedding is the head again (optim.tie_grads)
    optimizer.zero_grad(set_to_none=not keep_grads)
    return loss_sum, grad_norm


# Validation logits turned to float32 this many rows at a time: 8,192 x 32,768 is 1 GiB, and its log-softmax as
# much again. Whole, a micro-batch of 16 x 8,192 at 88m took 16 GiB twice over on top of its bf16 logits, more than
# its training step's peak (39.6 GiB): a second run on the same H200 ran out of memory in its first evaluation
# (docs/LOG.md, 2026-12-04).
EVAL_LOSS_ROWS = 8192


@torch.no_grad()
def evaluate(model, loader: D.ShardLoader, n_windows: int, token_bytes: torch.Tensor, cfg: C.TrainConfig,
             device: torch.device, windows: tuple[int, ...] | None = None) -> dict:
    """Mean validation loss and bits per byte over the targets of the val split's first n_windows windows
    of loader.T tokens (over all ranks), whatever the micro-batch: the last batch's rows past them are
    not scored, so two runs with different micro-batches or ranks score the same tokens. The model runs
    with the masks the run trains with (documents, the sliding window at this step) where the loader
    has document ids. Bits per byte divide the summed loss (in bits) by the UTF-8 bytes the targets
    decode to, so runs with different tokenizers compare. A loader with a stride (whole windows) scores
    the same targets, each once, with its window before it (ShardLoader.scored_targets), over as many
    batches as that takes."""
    model.eval()
    loader.rewind()
    nats, n_tokens, n_bytes = (torch.zeros((), device=device, dtype=torch.float64) for _ in range(3))
    for _ in range(min(loader.batches_covering(n_windows), len(loader))):
        batch = loader.next_batch()
        x, y = batch[0], batch[1]
        with autocast(cfg, device):
            logits = model(x, masks=masks_for(batch, device, windows)).flatten(0, 1)
        losses = torch.cat([torch.nn.functional.cross_entropy(rows.float(), targets, reduction="none") for rows, targets
                            in zip(logits.split(EVAL_LOSS_ROWS), y.flatten().split(EVAL_LOSS_ROWS))])
        keep = loader.scored_targets(n_windows).flatten().to(losses.dtype)
        nats += (losses * keep).sum()
        n_tokens += keep.sum()
        n_bytes += (token_bytes[y.flatten()] * keep).sum()
    model.train()
    if dist.is_initialized():
        totals = torch.stack([nats, n_tokens, n_bytes])
        dist.all_reduce(totals)
        nats, n_tokens, n_bytes = totals
    return {"val_loss": nats.item() / n_tokens.item(), "val_bpb": nats.item() / math.log(2) / max(n_bytes.item(), 1)}


# --- Provenance and logging ----------------------------------------------------------------

def provenance(device: torch.device) -> dict:
    def git(*a):
        try:
            done = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""
    commit = git("rev-parse", "HEAD")
    info = {"git_commit": commit or "unknown (not a git checkout)", "git_dirty": bool(commit and git("status", "--porcelain")),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    return info


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # process peak RSS (KiB on Linux)


def logged_eval(log_path: Path, step: int) -> dict:
    """The validation figures log.jsonl holds for `step` ({} where it holds none): what a run resumed at
    its last step reports, whose last evaluation ran before the process stopped short of its summary."""
    rows = PL.read_log(log_path) if log_path.exists() else []
    return next(({k: v for k, v in row.items() if k.startswith("val_")} for row in reversed(rows)
                 if row["step"] == step and "val_loss" in row), {})


class Stopper:
    """Ctrl-C (SIGINT) or SIGTERM: say at once that the run will save after the step in flight,
    then stop there. A second one stops at once without saving, whenever it arrives.

    Python runs a signal's handler only between bytecodes, and two signals that arrive while a long
    step is inside PyTorch's C++ become one call of it: a quick second Ctrl-C would be lost. The C
    handler also writes a byte per signal to a wakeup socket (signal.set_wakeup_fd), at once and one
    per signal. A thread reads them: it says the first, and after a second it gives the handler
    SECOND_GRACE seconds to raise SystemExit (the main thread is between bytecodes) before it ends
    the process itself (the main thread is stuck in C++)."""

    SECOND_GRACE = 1.0

    def __init__(self, say, ckpt_path: Path | None = None):
        self.signal, self.say, self.stopped, self.ckpt_path = None, say, threading.Event(), ckpt_path
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        self.wakeup, self.write_end = socket.socketpair()
        self.write_end.setblocking(False)
        self.previous_fd = signal.set_wakeup_fd(self.write_end.fileno())
        threading.Thread(target=self._watch, daemon=True).start()

    def _handle(self, signum, frame):
        if self.signal is not None:
            quit_at_once(signal.Signals(signum).name + " again", ckpt_path=self.ckpt_path)
        self.signal = signal.Signals(signum).name  # the watcher has said so already

    def _watch(self):
        seen = 0
        while not self.stopped.is_set():
            try:
                numbers = self.wakeup.recv(64)
            except OSError:  # closed by restore()
                return
            for number in numbers:
                if number not in (signal.SIGINT, signal.SIGTERM):
                    continue
                seen += 1
                name = signal.Signals(number).name
                if seen == 1:
                    self.say(f"{name}: saving a checkpoint after the current step (press Ctrl-C again to quit "
                             f"without saving)")
                elif not self.stopped.wait(self.SECOND_GRACE):
                    quit_at_once(f"{name} again", now=True, ckpt_path=self.ckpt_path)
            if not numbers:
                return

    def restore(self):
        self.stopped.set()
        signal.set_wakeup_fd(self.previous_fd)
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.write_end.close()
        self.wakeup.close()


def quit_at_once(what: str, now: bool = False, ckpt_path: Path | None = None):
    """Leave at once, in one line and with Ctrl-C's exit code (128 + SIGINT): a checkpoint being
    written is a temporary file until its rename, so the last complete one stays. now: from a thread
    other than the main one, which may be inside a long C++ call, the process ends here (os._exit).
    ckpt_path: the run's checkpoint, so the line says whether there is one to continue from."""
    if ckpt_path is not None and not ckpt_path.exists():
        kept = "no checkpoint was written yet, so the run starts again from its first step"
    else:
        kept = "the last complete checkpoint is kept, continue from it with --resume"
    tqdm.write(f"{what}: stopped at once; {kept}", file=sys.stderr)
    if now:
        sys.stdout.flush()
        os._exit(130)
    raise SystemExit(130)


class Interrupted(Exception):
    """The run stopped early after saving: on a signal (main() exits 130, as Ctrl-C does) or at
    --stop-after, a planned stop (main() exits 0)."""

    def __init__(self, message: str, planned: bool = False):
        super().__init__(message)
        self.planned = planned


def check_run_name(name: str):
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"--name {name!r}: a run name is one folder name under the runs folder (letters, digits, "
                         f"-, _), not a path; use --runs-dir to put runs elsewhere")


@dataclass
class Progress:
    """Where a run stands: what a checkpoint records and each step advances."""
    step: int = 0
    tokens: int = 0
    skipped: int = 0  # steps skipped for a non-finite loss (--skip-nonfinite)
    # Seconds spent in training steps, summed over sessions: evaluation and saving left out, and a
    # session's first two steps (which compile) counted at its third step's time (train.clock_step). Time-to-loss
    # reads it.
    train_seconds: float = 0.0


@dataclass
class Session:
    """This process's share of a run: what the summary reports beside the Progress."""
    first_step: int
    first_tokens: int = 0  # the run's tokens before this session
    first_seconds: float = 0.0  # and its training seconds
    start: float = field(default_factory=time.perf_counter)
    rates: list = field(default_factory=list)  # tok/s of each step after the untimed ones (UNTIMED_STEPS)
    step_seconds: list = field(default_factory=list)  # and their times (train.seconds sizes the run by them)
    step_windows: list = field(default_factory=list)  # and each one's long window
    untimed: list = field(default_factory=list)  # the times of the session's first steps, which compile
    first_timed: float = 0.0  # the time of the step after them, which stands in for each of them
    timed_seconds: float = 0.0  # the time of every step after them
    sized: bool = False  # whether this session sized a train.seconds run (and so sizes it again, once)
    last_eval: dict = field(default_factory=dict)


@dataclass
class Meter:
    """How the run's speed is reported: FLOPs per token and the named peak MFU is taken against."""
    info: dict  # provenance()
    flops_tok: int
    peak: float | None  # TFLOP/s
    peak_source: str  # "spec" (the spec sheet's dense BF16) or "given" (--peak-tflops)
    title: str

    @property
    def peak_name(self) -> str:
        # bench.py's ladder reports MFU against the roof it measures, which is lower, so its MFU reads higher
        return f"{self.peak:,.0f} TFLOP/s {self.peak_source}" if self.peak else ""

    def mfu(self, tok_s: float, world: int) -> float | None:
        return FL.mfu(tok_s / world, self.flops_tok, self.peak * 1e12) if self.peak else None


def train(cfg: C.Config, run_dir: Path, resume: bool = False, overwrite: bool = False,
          stop_after: int | None = None, log=print, checkpoint: CK.Checkpoint | None = None) -> dict:
    """Run training as configured; returns the summary. Rank 0 alone writes files.
    stop_after: save a checkpoint and stop after this step, as Ctrl-C would (raises Interrupted).
    checkpoint: the run's checkpoint when the caller has already loaded it (resume)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    say = log if rank == 0 else (lambda *a, **k: None)
    with claimed(run_dir, say) if rank == 0 else contextlib.nullcontext():  # one process trains in a folder
        ckpt = check_start(cfg, run_dir, resume, overwrite, checkpoint)
        if ckpt is not None and ckpt.step >= SZ.total_steps(cfg.train) and (run_dir / "summary.json").exists():
            say(f"{run_dir} already finished at step {ckpt.step}: nothing to do (its summary.json is kept; raise "
                f"--steps or --tokens to train further)")
            return json.loads((run_dir / "summary.json").read_text())
        if ckpt is not None and ckpt.step > SZ.total_steps(cfg.train):
            raise ValueError(f"{ckpt.path} is at step {ckpt.step}, past the {SZ.total_steps(cfg.train)} steps asked "
                             f"for: pass --steps {ckpt.step} or more (or the matching --tokens) to resume it")
        r = setup(cfg, rank, world, log=say)
        progress = resume_run(r, ckpt, run_dir, say) if ckpt is not None else start_run(r, run_dir)
        if ckpt is None and cfg.train.init_from:
            start_from(r, cfg.train.init_from, say)
        meter = announce(r, run_dir, say)
        session = run_loop(r, progress, meter, run_dir, stop_after, resumed=ckpt is not None)
        return summarize(r, progress, session, meter, run_dir, say)


UNTIMED_STEPS = 2  # a session's first steps, which compile: left out of its pace (timed_step)
PACE_NOTE_SECONDS = 3600  # a run with more than this left after its first timed step says how long, once
CPU_STEP_FLOPS = 1e13  # a step past this on a CPU (a minute or more at its best) is a GPU config's: said at the start
LOCK = ".lock"  # in a run's folder while a process trains in it: "<host> <pid>"


@contextlib.contextmanager
def claimed(run_dir: Path, say):
    """The run's folder, held by this process alone while it trains: a second run started with the same name
    (at the same time, or while this one runs) is refused in one line, where both would write one log and one
    checkpoint. A lock left by a process that no longer runs on this machine (a killed run) is taken over, saying
    so; one held from another machine is refused naming it. A folder this made and nothing filled is removed."""
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock, me = run_dir / LOCK, f"{socket.gethostname()} {os.getpid()}"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        holder = lock.read_text().split()
        host, pid = (holder[0], int(holder[1])) if len(holder) == 2 and holder[1].isdigit() else ("?", -1)
        if host != socket.gethostname() or pid_alive(pid):
            raise ValueError(f"{run_dir} is in use by process {pid} on {host}: wait for that run to end, give this one "
                             f"another --name, or delete {lock} if that run is gone") from None
        say(f"note: {lock} was left by process {pid}, which no longer runs: taking the folder over")
        lock.unlink()
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, me.encode())
    os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        if made and not any(run_dir.iterdir()):
            run_dir.rmdir()


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_start(cfg: C.Config, run_dir: Path, resume: bool, overwrite: bool,
                checkpoint: CK.Checkpoint | None) -> CK.Checkpoint | None:
    """The guards: never overwrite a run by accident; the checkpoint to resume, or None."""
    ckpt_path = run_dir / "ckpt.pt"
    if ckpt_path.exists() and not resume and not overwrite:
        raise ValueError(f"{run_dir} already holds a checkpoint: pass --resume to continue it, --overwrite to "
                         f"start over, or --name NAME for a new run")
    if resume and not ckpt_path.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
    BO.check_installed(cfg.train)
    return checkpoint or (CK.load(ckpt_path) if resume else None)


def start_run(r: Run, run_dir: Path) -> Progress:
    if r.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "log.jsonl").write_text("")
        (run_dir / "summary.json").unlink(missing_ok=True)
        shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)  # a fresh start draws fresh curves
    return Progress()


def resume_run(r: Run, ckpt: CK.Checkpoint, run_dir: Path, say) -> Progress:
    """Load the checkpoint's weights, optimizer, loader cursor and RNG into the run set up by
    setup(); drop log rows written after it (a crash before the next checkpoint)."""
    CK.check_compatible(ckpt, r.cfg, r.tokenizer_hash)
    if len(ckpt.loaders) != r.world:
        raise ValueError(f"{ckpt.path} was written by {len(ckpt.loaders)} rank(s), this run has {r.world}: "
                         f"resume with the same number of processes")
    r.raw.load_state_dict(ckpt.model, strict=True)
    O.load_state(r.optimizer, ckpt.optimizer)  # the moments from the checkpoint, the hyperparameters from the config
    if r.scaler is not None and ckpt.scaler is not None:  # fp16's loss scale goes on where it was
        r.scaler.load_state_dict(ckpt.scaler)
    r.train_loader.load_state_dict(ckpt.loaders[r.rank])
    CK.set_rng_state(ckpt.rngs[r.rank])
    progress = Progress(ckpt.step, ckpt.tokens, ckpt.skipped, ckpt.train_seconds)
    log_path = run_dir / "log.jsonl"
    if r.rank == 0 and log_path.exists():
        rows = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= ckpt.step]
        log_path.write_text("".join(line + "\n" for line in rows))
    say(f"resumed {ckpt.path} at step {ckpt.step} ({ckpt.tokens:,} tokens)")
    return progress


def loss_targets(tcfg: C.TrainConfig) -> str:
    """What the loss learns beside the next token, for the batch line: '' where it is the next token alone."""
    said = f"; the loss over the next {tcfg.mtp_tokens} tokens, fading to the next one's" if tcfg.mtp_tokens > 1 else ""
    if tcfg.prefix_weight:
        said += f"; the next token's prefix token at weight {tcfg.prefix_weight:g}, fading out by two thirds"
    return said


def optimizer_line(tcfg: C.TrainConfig, optimizer) -> str:
    """The run header's optimizer: each group's peak rate, the momentum schedule, the decays, the schedule, the tie."""
    groups = ", ".join(f"{g['role']} {tcfg.lr * g['lr_ratio']:g}" for g in optimizer.param_groups)
    more = (f", momentum {tcfg.muon_momentum_start:g} -> {tcfg.muon_momentum:g} over {tcfg.muon_momentum_warmup} "
            f"steps" if tcfg.muon and tcfg.muon_momentum_warmup else "")
    if tcfg.muon and tcfg.muon_momentum_cooldown:
        more += f", back to {tcfg.muon_momentum_start:g} over the last {tcfg.muon_momentum_cooldown}"
    if tcfg.muon and tcfg.muon_weight_decay and tcfg.muon_cautious:
        more += ", cautious weight decay"
    if tcfg.adam_weight_decay:
        more += f", AdamW's embeddings and head decayed cautiously ({tcfg.adam_weight_decay:g} x lr^2 by role)"
    tie = f"; head and embedding one matrix until {tcfg.untie_at:.0%} of the run" if tcfg.untie_at else ""
    return (f"{'Muon + AdamW' if tcfg.muon else 'AdamW'} (peak lr by group: {groups}{more}), {tcfg.schedule} "
            f"schedule, clipping {tcfg.grad_clip or 'off'}{tie}")


def announce(r: Run, run_dir: Path, say) -> Meter:
    """Provenance and what runs, printed and saved in config.json; the Meter for the log lines."""
    cfg, tcfg, device, m = r.cfg, r.cfg.train, r.device, r.cfg.model
    info = provenance(device)
    spec = peak_tflops(info["device"]) if device.type == "cuda" else None
    meter = Meter(info, FL.flops_per_token(m), tcfg.peak_tflops or spec, "given" if tcfg.peak_tflops else "spec",
                  f"{run_dir.name} | {m.d_model}d x {m.n_layers} layers | {info['device']}")
    say(f"run {run_dir} | {info['device']} | torch {info['torch']} (CUDA {info['cuda']}) | "
        f"git {info['git_commit'][:10]}{' (dirty)' if info['git_dirty'] else ''} | world {r.world}")
    # What runs, not only what was asked: the fused SwiGLU is a CUDA kernel, for the SwiGLU MLP only.
    say(f"model: {FL.param_count(m):,} parameters, head size {m.head_dim}, {m.mlp} {m.ffn_hidden} wide, "
        f"QK-norm {m.qk_norm}, {'tied' if m.tie_embeddings else 'untied'} head, soft-cap {m.logit_softcap or 'off'}, "
        f"{meter.flops_tok / 1e6:,.1f} MFLOPs/token")
    # What runs, read from what was swapped in, not from what was asked
    say(f"speed: attention {cfg.speed.attention}; fast paths swapped in: "
        f"{', '.join(FP.TRAINING_FAST_PATHS[n] for n in r.swapped) or 'none (the plain model)'}")
    parts = [name for name, on in (("embed-norm", m.embed_norm), (f"{m.value_embeds} value embeddings", m.value_embeds),
                                    ("U-net skips", m.unet_skips), ("x0 mix", m.x0_mix), ("truncated RoPE", m.rope_truncate),
                                    ("attention gate", m.attn_gate),
                                    (f"no attention in layer {m.skip_attn_layer}", m.skip_attn_layer != -1),
                                    (f"attention scale {m.attn_scale:g}", m.attn_scale),
                                    (f"window {m.attn_window}" + (f", {m.windows()[1]} on short layers" if m.short_windows
                                                                  else ""), m.attn_window),
                                    (f"{'signed ' if m.bigram_signs else ''}bigram table of {m.bigram_rows:,} rows", m.bigram_rows),
                                    (f"backout of layer {m.backout_layer}", m.backout), ("smear", m.smear),
                                    ("key offset on the long layers", m.key_offset),
                                    ("value-embedding gates", m.value_gate),
                                    (f"paired heads in layers {', '.join(str(i) for i in range(m.n_layers) if m.paired_layer(i))}",
                                     m.paired_heads), (f"YaRN from a window of {m.rope_yarn}", m.rope_yarn),
                                    ("gated XSA on the unpaired layers", m.xsa),
                                    (f"layers after {m.backout_layer} attending over its output", m.saved_attn_input),
                                    ("dense connections into the last two blocks", m.dense_last)) if on]
    if parts:
        say(f"model parts: {', '.join(parts)}")
    say(f"optimizer: {optimizer_line(tcfg, r.optimizer)}")
    length = (f"steps sized after {SZ.PROBE_STEPS} to fill {tcfg.seconds:g} training seconds" if r.steps == SZ.UNSIZED
              else f"{r.steps} steps = {SZ.run_tokens(tcfg, r.steps):,} tokens")
    stages = f", grown over {tcfg.batch_stages} stages" if tcfg.batch_stages > 1 else ""
    say(f"batch: {tcfg.batch_tokens:,} tokens = {tcfg.micro_batch} seq x {m.context} tokens x {r.accum} accumulation "
        f"x {r.world} rank(s){stages}; {length}{loss_targets(tcfg)}")
    say(f"flags: tf32={tcfg.tf32} bf16={tcfg.bf16 and not tcfg.fp16} fp16={tcfg.fp16}"
        f"{' (gradient scaler)' if tcfg.fp16 else ''} compile={tcfg.compile}"
        f"{'(' + tcfg.compile_mode + ')' if tcfg.compile else ''} adamw={tcfg.optimizer} pin={tcfg.pin} "
        f"activation_checkpointing={tcfg.activation_checkpointing} recompute_mlp={tcfg.recompute_mlp} "
        f"doc_mask={tcfg.doc_mask}")
    step_flops = meter.flops_tok * tcfg.batch_tokens
    if device.type == "cpu" and step_flops > CPU_STEP_FLOPS:
        say(f"note: each step of this config is {step_flops / 1e12:,.0f} TFLOP, sized for a GPU: on a CPU a step takes "
            f"many minutes and prints only when it ends (then the run's pace is said); `python train.py` (configs/"
            f"tiny.toml) trains in minutes on a CPU")
    if device.type == "cuda" and meter.peak is None:
        say(f"note: no BF16 peak known for {info['device']}: MFU is not shown (pass --peak-tflops)")
    if r.rank == 0:
        (run_dir / "config.json").write_text(json.dumps({"config": cfg.to_dict(), "provenance": info,
                                                         "tokenizer_hash": r.tokenizer_hash}, indent=2))
    return meter


def save_checkpoint(r: Run, p: Progress, path: Path):
    """Every rank's loader cursor and RNG (so each resumes exactly), written by rank 0."""
    loaders, rngs = [r.train_loader.state_dict()], [CK.rng_state()]
    if dist.is_initialized():
        loaders, rngs = [None] * r.world, [None] * r.world
        dist.all_gather_object(loaders, r.train_loader.state_dict())
        dist.all_gather_object(rngs, CK.rng_state())
    if r.rank == 0:
        CK.save(path, model=r.raw.state_dict(), optimizer=r.optimizer.state_dict(), step=p.step, tokens=p.tokens,
                skipped=p.skipped, loaders=loaders, rngs=rngs, config=r.cfg, tokenizer_hash=r.tokenizer_hash,
                train_seconds=p.train_seconds, scaler=r.scaler.state_dict() if r.scaler is not None else None)


def write_log(r: Run, run_dir: Path, row: dict, boards: list = ()):
    if r.rank == 0:
        with open(run_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        for board in boards:
            board.add(row)


def run_loop(r: Run, p: Progress, meter: Meter, run_dir: Path, stop_after: int | None, resumed: bool) -> Session:
    """Save and then evaluate first (so the state on disk always matches the step counter, and a stop during an
    evaluation loses at most that evaluation, which a resume then runs), then stop, then step and log, until the
    last step or a stop (Ctrl-C, SIGTERM, stop_after)."""
    tcfg, ckpt_path = r.cfg.train, run_dir / "ckpt.pt"  # r.steps, not a copy: train.seconds sizes it on the way
    fixed = r.train_loader.next_batch() if tcfg.overfit_batch else None
    next_batch = (lambda: fixed) if fixed is not None else r.train_loader.next_batch
    prefetch = None if fixed is not None else r.train_loader.prefetch
    token_bytes = torch.tensor(tk.token_byte_lengths(tk.load_tokenizer(r.tokenizer_path)), device=r.device,
                               dtype=torch.float32)
    bar = tqdm(total=None if r.steps == SZ.UNSIZED else r.steps, initial=p.step, desc="train", unit="step",
               disable=True if r.rank else None, dynamic_ncols=True)  # None: no bar where stderr is not a terminal
    say = (lambda s: bar.write(s)) if r.rank == 0 else (lambda s: None)
    boards = BO.open_boards(tcfg, run_dir, p.step if resumed else None, r.cfg.to_dict()) if r.rank == 0 else []
    stopper, session = Stopper(say, ckpt_path), Session(p.step, p.tokens, first_seconds=p.train_seconds)
    # a resumed step was saved; its evaluation is owed where a stop cut it short (none logged at an evaluation step)
    logged = logged_eval(run_dir / "log.jsonl", p.step) if resumed else {}
    owed = resumed and p.step > 0 and not logged
    if resumed and p.step == r.steps:  # stopped between its last checkpoint and its summary
        session.last_eval = logged
    last_saved = p.step if resumed else None
    try:
        while True:
            last_step, fresh = p.step == r.steps, p.step > session.first_step
            if fresh and (p.step % tcfg.ckpt_every == 0 or last_step):
                save_checkpoint(r, p, ckpt_path)
                last_saved = p.step
            if (fresh or owed) and (p.step % tcfg.eval_every == 0 or last_step) and not tcfg.overfit_batch:
                session.last_eval = logged_evaluation(r, p, run_dir, token_bytes, boards, say)
            owed = False
            if last_step:
                break
            if stopper.signal or p.step == stop_after:
                if last_saved != p.step:
                    save_checkpoint(r, p, ckpt_path)
                raise Interrupted(f"{stopper.signal or '--stop-after'}: saved {ckpt_path} at step {p.step} of "
                                  f"{'unsized' if r.steps == SZ.UNSIZED else r.steps}; continue with --resume",
                                  planned=not stopper.signal)
            row = timed_step(r, p, session, next_batch, prefetch, meter, ckpt_path, say)
            write_log(r, run_dir, row, boards)
            if sized_now(r, p, session, run_dir, say):
                bar.total = r.steps
            say(step_line(p.step, row, meter))
            if p.step == session.first_step + UNTIMED_STEPS + 1 and r.steps != SZ.UNSIZED:  # the first timed pace
                pace_note(r, p, row, say)
            bar.update(1)
    finally:
        bar.close()
        for board in boards:
            board.close()
        try:  # still under the Stopper: a second signal while plotting quits in one line
            log_path = run_dir / "log.jsonl"
            if r.rank == 0 and log_path.exists() and log_path.stat().st_size:  # a plot even for a stopped run
                PL.plot_losses(log_path, run_dir / "loss.png", meter.title)
        finally:
            stopper.restore()
    return session


def logged_evaluation(r: Run, p: Progress, run_dir: Path, token_bytes: torch.Tensor, boards: list, say) -> dict:
    """Evaluate at p's step, say the losses in one line and log them; returns them."""
    last = evaluations(r, p.step, token_bytes)
    say(f"step {p.step:>6} | val loss {last['val_loss']:.4f} | val bpb {last['val_bpb']:.4f}"
        + (f" | with whole windows {last['val_loss_whole']:.4f}" if r.whole_val_loader else "")
        + (f" | on plain 1,024-token windows {last['val_loss_1024']:.4f}" if r.plain_val_loader else ""))
    write_log(r, run_dir, {"step": p.step, "tokens": p.tokens, "train_seconds": round(p.train_seconds, 3), **last},
              boards)
    return last


def sized_now(r: Run, p: Progress, session: Session, run_dir: Path, say) -> bool:
    """A train.seconds run sizes its steps after its probe steps, and again where its schedule's window has grown
    (sizing.resize_step): whether it did so at this step."""
    if r.steps == SZ.UNSIZED and p.step == session.first_step + SZ.PROBE_STEPS:
        size_steps(r, p, session, run_dir, say)
        session.sized = True
        return True
    if session.sized and p.step == SZ.resize_step(r.cfg.train, r.steps):
        size_steps(r, p, session, run_dir, say, again=True)
        session.sized = False
        return True
    return False


def pace_note(r: Run, p: Progress, row: dict, say):
    """Where the steps left would take over an hour at this step's pace, say how long, once."""
    left = SZ.run_tokens(r.cfg.train, r.steps, p.step) / max(row["tok_s"], 1e-9)
    if left > PACE_NOTE_SECONDS:
        say(f"note: at {row['tok_s']:,.0f} tok/s the {r.steps - p.step:,} steps left take about {left / 3600:,.1f} h")


def step_line(step: int, row: dict, meter: "Meter") -> str:
    norm, mfu = row["grad_norm"], row["mfu"]
    gnorm = f" | gnorm {norm:.3f}" if norm is not None else ""  # computed only to clip (train.grad_clip)
    return (f"step {step:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e}{gnorm} | {row['tok_s']:,.0f} tok/s | MFU "
            f"{'n/a' if mfu is None else f'{mfu:.1%} of {meter.peak_name}'} | mem {row['peak_mem_gib']:.2f} GiB")


def evaluations(r: Run, step: int, token_bytes: torch.Tensor) -> dict:
    """The validation loss and bits per byte at `step`, with the windows of that step: on the run's own
    sequences, with whole windows (where the model has a sliding window) and on plain 1,024-token windows (where
    it trains on something else), each over eval_tokens' worth of the same targets at any micro-batch and world."""
    tcfg, windows = r.cfg.train, window_at(step, r.steps, r.cfg)
    follow_window(r.raw, windows)
    eval_windows = max(1, tcfg.eval_tokens // r.cfg.model.context)
    found = evaluate(r.model, r.val_loader, eval_windows, token_bytes, tcfg, r.device, windows)
    if r.whole_val_loader is not None:
        whole = evaluate(r.model, r.whole_val_loader, eval_windows, token_bytes, tcfg, r.device, windows)
        found |= {"val_loss_whole": whole["val_loss"], "val_bpb_whole": whole["val_bpb"]}
    if r.plain_val_loader is not None:
        plain = evaluate(r.model, r.plain_val_loader, max(1, tcfg.eval_tokens // PLAIN_CONTEXT), token_bytes, tcfg,
                         r.device, windows)
        found |= {"val_loss_1024": plain["val_loss"], "val_bpb_1024": plain["val_bpb"]}
    return found


def timed_step(r: Run, p: Progress, session: Session, next_batch, prefetch, meter: Meter, ckpt_path: Path,
               say) -> dict:
    """One optimizer step, timed; stops on a non-finite loss unless it may be skipped. Advances p
    and returns the step's log row."""
    tcfg, B, T = r.cfg.train, r.cfg.train.micro_batch, r.cfg.model.context
    t0 = time.perf_counter()
    try:
        windows = r.cfg.model.windows() if probing_end(r, p, session) else window_at(p.step, r.steps, r.cfg)
        follow_window(r.raw, windows)
        stage = SZ.batch_stage(p.step, r.steps, tcfg.batch_stages)
        loss, grad_norm = train_step(r.model, r.optimizer, next_batch, r.accum * stage // tcfg.batch_stages, tcfg,
                                     r.device, step_lr(p.step, tcfg, r.steps), O.muon_momentum_at(p.step, tcfg, r.steps),
                                     windows, r.scaler, prefetch, **step_terms(r, p.step))
        if dist.is_initialized():
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        loss_value, norm_value = torch.stack([loss.float(), grad_norm.float()]).tolist()
    except torch.cuda.OutOfMemoryError:
        raise SystemExit(
            f"CUDA out of memory at step {p.step} with micro_batch={B} sequences of {T} tokens "
            f"(peak {peak_memory_gib(r.device):.1f} GiB): try --micro-batch {max(1, B // 2)} (the batch "
            f"stays {tcfg.batch_tokens:,} tokens through more accumulation), --fused-loss or "
            f"--activation-checkpointing") from None
    dt = time.perf_counter() - t0
    if r.scaler is not None and math.isfinite(loss_value) and not math.isfinite(norm_value):
        p.skipped += 1  # fp16's gradients overflowed: the scaler skipped the step and halved its scale
        say(f"step {p.step}: fp16 gradients overflowed; the scaler skipped the step and lowered its scale to "
            f"{r.scaler.get_scale():g}")
    elif not math.isfinite(loss_value) or not math.isfinite(norm_value):
        if not tcfg.skip_nonfinite:
            raise SystemExit(f"loss is {loss_value} (gradient norm {norm_value}) at step {p.step}: stopping; "
                             f"{CK.keep_before(ckpt_path, p.step)}. Lower train.lr, or pass "
                             f"--skip-nonfinite to skip such steps")
        p.skipped += 1
        say(f"step {p.step}: non-finite loss {loss_value}, step skipped ({p.skipped} so far)")
    breaks = graph_breaks() if p.step == session.first_step and tcfg.compile else 0
    if breaks:
        say(f"torch.compile split the model at {breaks} graph break(s), each run without Inductor's fusions "
            f"around it: TORCH_LOGS=graph_breaks names them")
    if p.step == 0 and not tcfg.init_from:  # a model started from trained weights is far from ln(vocab) by design
        times = sum(mtp_weights_at(0, r.steps, tcfg.mtp_tokens))  # the multi-token loss: ln(vocab) for each weight
        expected, what = times * math.log(r.cfg.model.vocab_size), "ln(vocab)" if times == 1 else f"{times:g} x ln(vocab)"
        # the prefix-token loss adds its weight x ln(vocab) for each target that has a prefix token
        extra = tcfg.prefix_weight * math.log(r.cfg.model.vocab_size)
        near = expected - 1.0 < loss_value < expected + extra + 1.0
        warn = "" if near else f"  WARNING: far from {what}; check the init and the data"
        beside = f" (and up to {extra:.4f} more from prefix tokens)" if extra else ""
        say(f"step 0 loss {loss_value:.4f} vs {what} = {expected:.4f}{beside}{warn}")
    p.step += 1
    tokens = SZ.step_tokens(tcfg, p.step - 1, r.steps)
    p.tokens += tokens
    tok_s = tokens / dt
    clock_step(p, session, dt, tokens, tcfg.batch_tokens, windows[0])
    lrs = {g.get("role", f"group{i}"): g["lr"] for i, g in enumerate(r.optimizer.param_groups)}  # as this step ran
    return {"step": p.step, "tokens": p.tokens, "loss": loss_value, "lr": step_lr(p.step - 1, tcfg, r.steps), "lrs": lrs,
            "grad_norm": norm_value if tcfg.grad_clip else None, "window": windows[0], "tok_s": round(tok_s),
            "mfu": meter.mfu(tok_s, r.world),
            "peak_mem_gib": round(peak_memory_gib(r.device), 3), "step_s": round(dt, 4), "skipped": p.skipped,
            "train_seconds": round(p.train_seconds, 3)}


def clock_step(p: Progress, session: Session, dt: float, tokens: int, batch_tokens: int, window: int):
    """Count the step just taken (`dt` seconds on `tokens` of a whole batch's `batch_tokens`, at long window `window`)
    in the session's pace and the run's training seconds. A session's first two steps compile: the first its forward
    and backward, the second once more where the first step's only micro-batch ran without gradients yet. They are
    left out of the pace and counted at the first timed step's time (until there is one, at the faster of theirs)."""
    if p.step <= session.first_step + UNTIMED_STEPS:
        session.untimed.append(dt)
    else:
        session.rates.append(tokens / dt)
        session.step_seconds.append(dt * batch_tokens / tokens)  # as a whole batch's: what sizing counts in
        session.step_windows.append(window)
        session.first_timed = session.first_timed or dt
        session.timed_seconds += dt
    stand_in = session.first_timed or min(session.untimed)
    p.train_seconds = session.first_seconds + stand_in * len(session.untimed) + session.timed_seconds


def size_steps(r: Run, p: Progress, session: Session, run_dir: Path, say, again: bool = False):
    """train.seconds: fix the run's length from the times of this session's steps so far, leaving out
    the first two (compilation; a second compile when gradients first exist), each at its window (a
    window schedule's probe times both ends, probing_end). Until now the schedule ran at its stable
    rate, which a wsd schedule has anyway. `again`: the second sizing at sizing.resize_step. The steps go into
    the run's config, so a checkpoint resumes with the same length."""
    tcfg = r.cfg.train
    step_time = SZ.step_time_fit(session.step_seconds, session.step_windows)
    steps = SZ.steps_to_fill(SZ.seconds_to_fill(tcfg.seconds, p.train_seconds), p.step, step_time,
                             lambda step, steps: window_at(step, steps, r.cfg)[0],
                             lambda step, steps: SZ.step_tokens(tcfg, step, steps) / tcfg.batch_tokens)
    if dist.is_initialized():  # every rank must take the same number of steps: the slowest rank's count
        t = torch.tensor(steps, device=r.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        steps = int(t.item())
    r.steps = steps
    warmup = SZ.fitted_warmup(tcfg, steps, done=p.step)  # as setup() does, from here on
    if warmup < tcfg.warmup_steps:
        say(f"note: train.warmup_steps={tcfg.warmup_steps} is more than half of the {steps} steps: warming up over "
            f"{warmup} steps instead")
    r.cfg = dataclasses.replace(r.cfg, train=dataclasses.replace(tcfg, steps=steps, warmup_steps=warmup))
    stable = round((1 - tcfg.warmdown_fraction) * steps)
    note = "" if p.step <= stable else (f"; WARNING: the warm-down should have begun at step {stable}: "
                                        f"give train.seconds more time")
    pace = (f"steps take {step_time(r.cfg.model.windows()[0]) * 1e3:.1f} ms" if not tcfg.window_start else
            f"steps take {step_time(tcfg.window_start) * 1e3:.1f} to {step_time(r.cfg.model.attn_window) * 1e3:.1f} ms "
            f"from the first window to the last") + (" at the whole batch" if tcfg.batch_stages > 1 else "")
    say(f"train.seconds={tcfg.seconds:g}: {'at step ' + str(p.step) + ', ' if again else ''}{pace}, so the run "
        f"takes {steps} steps ({p.tokens + SZ.run_tokens(tcfg, steps, p.step):,} tokens){note}")
    if r.rank == 0:
        saved = json.loads((run_dir / "config.json").read_text())
        saved["config"] = r.cfg.to_dict()
        (run_dir / "config.json").write_text(json.dumps(saved, indent=2))


def summarize(r: Run, p: Progress, session: Session, meter: Meter, run_dir: Path, say) -> dict:
    """summary.json, the closing line and the sample."""
    elapsed, last_eval = time.perf_counter() - session.start, session.last_eval
    mean_rate = float(np.mean(session.rates)) if session.rates else None
    summary = {"run": str(run_dir), "steps": p.step, "tokens": p.tokens, "session_seconds": round(elapsed, 1),
               "mean_tok_s": round(mean_rate) if mean_rate else None,
               "mfu": meter.mfu(mean_rate, r.world) if mean_rate else None,
               "peak_mem_gib": round(peak_memory_gib(r.device), 3), "skipped": p.skipped,
               "device": meter.info["device"], "train_seconds": round(p.train_seconds, 3),
               **{k: round(v, 4) for k, v in last_eval.items()}}
    if r.rank != 0:
        return summary
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    say(f"done: step {p.step}, {p.tokens - session.first_tokens:,} tokens in this "
        f"session's {elapsed:.0f} s (its steps alone at a mean {summary['mean_tok_s'] or 0:,} tok/s, compiling and "
        f"evaluating left out), MFU {'n/a' if summary['mfu'] is None else format(summary['mfu'], '.1%') + ' of ' + meter.peak_name}, "
        + (f"val loss {last_eval['val_loss']:.4f} (ln vocab {math.log(r.cfg.model.vocab_size):.2f}), "
           f"val bpb {last_eval['val_bpb']:.4f}" if last_eval else "no validation pass")
        + f"; plot {run_dir / 'loss.png'}")
    if r.cfg.train.sample_tokens:
        tok = tk.load_tokenizer(r.tokenizer_path)
        say("sample:\n" + sample_text(r.raw, tok, r.cfg.train.sample_prompt, r.cfg.train.sample_tokens, r.device))
    return summary


def sample_text(model: M.Llama, tok, prompt: str, n: int, device: torch.device) -> str:
    idx = torch.tensor([tok.encode(prompt).ids], device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    new = [t.item() for t in G.generate(model.eval(), idx, n, temperature=0.8, top_k=50, generator=gen)]
    model.train()
    return prompt + tok.decode(new)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line. argv, when given, is read for --config first, so that --help shows that file's
    values (a file that does not load shows the default file's; the run itself then says why)."""
    p = argparse.ArgumentParser(description="Train the Llama-style model.")
    p.add_argument("--config", default=None,
                   help="TOML file with [model] [data] [train] (default: configs/tiny.toml; on --resume the "
                        "checkpoint's own config)")
    p.add_argument("--name", default=None, help="run name; outputs go to <runs-dir>/<name> (default: the config "
                                                "file's name)")
    p.add_argument("--runs-dir", default=str(ROOT / "runs"), help="folder holding the runs (default: ./runs)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name>/ckpt.pt with its saved config "
                                                         "(flags still change [train] settings)")
    p.add_argument("--overwrite", action="store_true", help="start over even if the run has a checkpoint")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="save a checkpoint and stop after this step (continue later with --resume)")
    p.add_argument("--fused", dest="train__optimizer", action="store_const", const="fused",
                   default=argparse.SUPPRESS, help="fused AdamW (same as --optimizer fused)")
    p.add_argument("--no-fused", dest="train__optimizer", action="store_const", const="foreach",
                   default=argparse.SUPPRESS, help="foreach AdamW (same as --optimizer foreach)")
    C.add_config_flags(p, base=shown_config(argv))
    return p


def shown_config(argv: list[str] | None) -> Path:
    """The config file whose values --help shows: argv's --config where it loads, else DEFAULT_CONFIG."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    given = pre.parse_known_args(argv)[0].config if argv is not None else None
    if given:
        try:
            C.load_config(given)
            return Path(given)
        except (OSError, ValueError):
            pass
    return DEFAULT_CONFIG


def seconds_win(overrides: dict, config: str | Path, log) -> dict:
    """`--seconds S` alone on a config that sets train.steps or train.tokens (every preset does): the budget of
    seconds is what was asked for, so it wins, and the run says so in one line. With --steps or --tokens
    given too, TrainConfig refuses the pair as it would in a file."""
    if not overrides.get("train__seconds") or {"train__steps", "train__tokens"} & overrides.keys():
        return overrides
    base = C.load_config(config).train
    if not (base.steps or base.tokens):
        return overrides
    log(f"note: --seconds {overrides['train__seconds']:g} sizes the run, in place of {config}'s "
        f"{f'train.steps = {base.steps}' if base.steps else f'train.tokens = {base.tokens:,}'}")
    return {**overrides, "train__steps": 0, "train__tokens": 0}


def resolve_config(args: argparse.Namespace, run_dir: Path | None = None, log=print):
    """(config, checkpoint): the config file and flags; on --resume, the loaded checkpoint and its
    own config. On resume the checkpoint's config is the base: a model or data value the file or
    a flag gives must equal it (the same command plus --resume always works), and [train] values
    may change, each reported."""
    overrides = seconds_win(C.flag_overrides(args), args.config or DEFAULT_CONFIG, log)
    from_file = C.read_toml(args.config) if args.config else {}
    given = {f"{s}__{k}": v for s, table in C.moved(from_file).items() for k, v in table.items()}
    given |= {C.moved_key(k): v for k, v in overrides.items()}
    if not (args.resume and run_dir is not None and (run_dir / "ckpt.pt").exists()):
        if given.get("train__init_from"):
            return init_config(args.config, given, log, flags=set(overrides)), None
        return C.load_config(args.config or DEFAULT_CONFIG, **overrides), None
    ckpt = CK.load(run_dir / "ckpt.pt")
    # What the user asked for: the file's settings (when --config is given) and the flags, resolved
    # on the checkpoint's config, so that fields they leave out compare equal.
    asked = C.load_config(values=dataclasses.asdict(ckpt.config), source=args.config or "flags", **given)
    saved = ckpt.config.train
    if asked.train.seconds and asked.train.seconds == saved.seconds and not asked.train.steps and saved.steps:
        # the same --seconds command again: its steps were sized when it started, and the run keeps them
        asked = dataclasses.replace(asked, train=dataclasses.replace(asked.train, steps=saved.steps))
        given.pop("train__steps", None)
    differ = {}
    for key in sorted(given):
        section, name = key.split("__")
        now, then = getattr(getattr(asked, section), name), getattr(getattr(ckpt.config, section), name)
        if now != then:
            differ[key] = (then, now)
    fixed = [f"{k.replace('__', '.')} (checkpoint {a!r}, asked {b!r})" for k, (a, b) in differ.items()
             if not k.startswith(("train__", "speed__"))]
    if fixed:
        raise ValueError(f"--resume continues {run_dir / 'ckpt.pt'}, whose model and data cannot change, but "
                         f"{'; '.join(fixed)}: drop those flags or settings, or start a new run with --name NAME")
    for key, (then, now) in differ.items():
        note = " (the learning-rate schedule stretches to the new length)" if key in ("train__steps",
                                                                                       "train__tokens") else ""
        log(f"resume: {key.replace('__', '.')} {then!r} -> {now!r}{note}")
    return asked, dataclasses.replace(ckpt, config=asked)  # only [train] values differ from the saved config


def init_config(config: str | None, given: dict, log=print, flags: set = frozenset()) -> C.Config:
    """train.init_from: the config of a new run that starts from a checkpoint's weights. given: the --config
    file's settings and the flags (whose keys are `flags`), as load_config overrides. The model is the checkpoint's:
    a shape setting given must equal it. Data, schedule and optimizer are the given ones over the checkpoint's run;
    the data is tokenized with the checkpoint's tokenizer (checkpoint.data_for). Kernel switches may differ. The
    head and the embedding start apart, as they were trained: train.untie_at is 0 unless a flag asks otherwise."""
    src = CK.load(given["train__init_from"], "cpu")
    untie = given.get("train__untie_at", src.config.train.untie_at)
    if untie and "train__untie_at" not in flags:
        given = {**given, "train__untie_at": 0.0}
        log(f"init-from: the head and the embedding start apart, as {src.path} trained them (train.untie_at "
            f"{untie:g} -> 0)")
    asked = C.load_config(values=dataclasses.asdict(src.config), source=config or "flags", **given)
    for name in M.SHAPE_FIELDS:
        mine, theirs = getattr(asked.model, name), getattr(src.config.model, name)
        if mine != theirs:
            raise ValueError(f"--init-from {src.path}: model.{name} is {mine!r} here but {theirs!r} in the checkpoint, "
                             f"whose weights fix the model: drop that setting (the model comes from the checkpoint)")
    data = CK.data_for(src, asked.data)
    if data.tokenizer_file and not asked.data.tokenizer_file:
        log(f"init-from: {data.corpus} is tokenized with {src.path}'s tokenizer ({src.tokenizer_hash}), in "
            f"{D.data_dir(data, asked.model.vocab_size)}")
    return dataclasses.replace(asked, data=data, train=dataclasses.replace(asked.train, init_from=str(src.path)))


def start_from(r: Run, path: str, say):
    """Put the weights of the checkpoint at `path` (train.init_from) into a new run's model."""
    src = CK.load(path, "cpu")
    if src.tokenizer_hash != r.tokenizer_hash:
        raise ValueError(f"--init-from {src.path} was trained with tokenizer {src.tokenizer_hash}, but this run's "
                         f"corpus is tokenized with {r.tokenizer_hash}: leave data.tokenizer_file out, and the corpus "
                         f"is tokenized with the checkpoint's")
    r.raw.load_state_dict(src.model, strict=True)
    say(f"weights: from {src.path} (its step {src.step}); data, schedule and optimizer start anew")


class PipeGuard:
    """A text stream (stdout or stderr) that survives its reader going away: `python train.py | tee log`, then
    Ctrl-C, signals tee too, and a line written after that (the Ctrl-C note, a step's line) would raise
    BrokenPipeError in whichever thread writes it, before the checkpoint is saved. The first such error turns
    the stream into a sink: the run goes on to save, and the files it writes say what happened."""

    def __init__(self, stream):
        self.stream, self.closed_pipe = stream, False

    def write(self, text: str) -> int:
        if not self.closed_pipe:
            try:
                return self.stream.write(text)
            except (BrokenPipeError, ConnectionResetError):
                self.closed_pipe = True
        return len(text)

    def flush(self):
        if not self.closed_pipe:
            try:
                self.stream.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.closed_pipe = True

    def __getattr__(self, name):  # isatty, fileno, encoding...: the stream's own
        return getattr(self.stream, name)


def guard_pipes():
    """stdout and stderr as PipeGuards, once per process."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, PipeGuard):
            setattr(sys, name, PipeGuard(stream))


def main(argv=None):
    guard_pipes()
    args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        if distributed:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        name = args.name or Path(args.config or DEFAULT_CONFIG).stem
        check_run_name(name)
        run_dir = Path(args.runs_dir) / name
        master = not distributed or dist.get_rank() == 0
        cfg, ckpt = resolve_config(args, run_dir, log=print if master else (lambda *a: None))
        if master:
            for section, values in cfg.to_dict().items():  # one line per section, as in the config file
                print(f"config [{section}] " + " ".join(f"{k}={v}" for k, v in values.items()))
        train(cfg, run_dir, resume=args.resume, overwrite=args.overwrite, stop_after=args.stop_after,
              checkpoint=ckpt)
        if distributed:  # leave together: rank 0 still plots and writes the summary, and a gloo rank that
            dist.barrier()  # tears its group down while a peer is still in the group can abort at exit
    except Interrupted as e:
        print(e, file=sys.stderr)
        sys.exit(0 if e.planned else 130)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop: preparing data, the final sample
        quit_at_once("SIGINT")
    except (ValueError, FileNotFoundError, tk.CorpusError, OSError) as e:
        sys.exit(f"error: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
