"""Train the model.

    python train.py                                   # embedded default: tiny model, stdlib corpus
    python train.py --config configs/88m.toml         # the real run (compile, fused, bf16, tf32 on)
    python train.py --config configs/88m.toml --resume
    torchrun --nproc_per_node=2 train.py --config configs/88m.toml

Settings come from dataclass defaults, then the --config file, then command-line flags (every
field of ModelConfig, DataConfig and TrainConfig is a flag: --micro-batch 32, --no-compile).
A run lives in runs/<name>/: config.json, log.jsonl, ckpt.pt, loss.png, summary.json.

bench.py imports train_step() and the setup functions from here; nothing is copied.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data as D
import model as M
import tokenizer as tk

ROOT = Path(__file__).resolve().parent
OPTIMIZERS = ("fused", "foreach", "for-loop")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class TrainConfig:
    batch_tokens: int = 524_288  # tokens per optimizer step, all ranks (GPT-3 125M's 0.5M; seed 002)
    micro_batch: int = 16  # sequences per forward/backward; the rest is gradient accumulation
    lr: float = 6e-4  # peak learning rate (GPT-3's for 125M)
    min_lr_ratio: float = 0.1  # cosine decays to this share of lr (Llama, GPT-3)
    warmup_steps: int = 200  # linear warm-up
    steps: int = 0  # optimizer steps; 0 means tokens // batch_tokens
    tokens: int = 0  # training tokens, used when steps is 0
    weight_decay: float = 0.1  # on matrices only, see configure_optimizer
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm
    eval_every: int = 250  # steps between validation passes (and at the end)
    eval_tokens: int = 1_048_576  # validation tokens per pass
    ckpt_every: int = 250  # steps between checkpoints (and at the end, and on SIGINT/SIGTERM)
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    tf32: bool = False  # TF32 tensor-core matmuls for float32 (CUDA)
    bf16: bool = False  # bfloat16 autocast, float32 master weights and optimizer (CUDA)
    compile: bool = False  # torch.compile the model
    compile_mode: str = "default"  # one of COMPILE_MODES
    optimizer: str = "foreach"  # AdamW implementation: fused | foreach | for-loop
    pin: bool = False  # pinned host memory and non_blocking copies (CUDA)
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~30% more compute
    doc_mask: bool = False  # attend only within each packed document (see README)
    overfit_batch: bool = False  # train on one fixed micro-batch: the loss must go to ~0
    skip_nonfinite: bool = False  # skip (and count) steps with a NaN/inf loss instead of stopping
    peak_tflops: float = 0.0  # dense BF16 peak for MFU; 0 looks the GPU up in PEAK_BF16_TFLOPS
    sample_tokens: int = 200  # tokens of text generated at the end of the run

    def __post_init__(self):
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"train.compile_mode={self.compile_mode!r}: choose one of {COMPILE_MODES}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer={self.optimizer!r}: choose one of {OPTIMIZERS}")
        for name in ("batch_tokens", "micro_batch", "eval_every", "ckpt_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.steps <= 0 and self.tokens <= 0:
            raise ValueError("set train.steps or train.tokens (how long to train)")


@dataclass
class Config:
    model: M.ModelConfig
    data: D.DataConfig
    train: TrainConfig

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"model": M.ModelConfig, "data": D.DataConfig, "train": TrainConfig}

# Dense BF16 tensor-core peaks (FP32 accumulate, no sparsity) in TFLOP/s, matched against
# torch.cuda.get_device_name(). Sources: NVIDIA's H100/H200, A100, L4 and L40S datasheets,
# the Ada and Ampere GA102 whitepapers; the 4060 Laptop figure is seed 000's spec-sheet 29.1.
# Order matters: the first substring that matches wins.
PEAK_BF16_TFLOPS = [
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.1),
    ("L4", 121.0), ("RTX 4090", 165.2), ("RTX 4060 Laptop", 29.1), ("RTX 3090", 71.0),
]


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


# --- Configuration -------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train the Llama-style model.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"), help="TOML file with [model] [data] [train]")
    p.add_argument("--name", default=None, help="run name; outputs go to <runs-dir>/<name> (default: the config file's name)")
    p.add_argument("--runs-dir", default=str(ROOT / "runs"))
    p.add_argument("--resume", action="store_true", help="continue from runs/<name>/ckpt.pt")
    p.add_argument("--overwrite", action="store_true", help="start over even if the run has a checkpoint")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="save a checkpoint and stop after this step (continue later with --resume)")
    p.add_argument("--fused", dest="optimizer", action="store_const", const="fused", default=argparse.SUPPRESS,
                   help="fused AdamW (same as --optimizer fused)")
    p.add_argument("--no-fused", dest="optimizer", action="store_const", const="foreach", default=argparse.SUPPRESS)
    names = set()
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(f"[{section}] overrides")
        for f in dataclasses.fields(cls):
            assert f.name not in names, f"flag --{f.name} would be ambiguous"
            names.add(f.name)
            flag = "--" + f.name.replace("_", "-")
            kind = M.field_types(cls)[f.name]
            if kind is bool:
                group.add_argument(flag, dest=f"{section}.{f.name}", action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS)
            else:
                choices = {"compile_mode": COMPILE_MODES, "optimizer": OPTIMIZERS}.get(f.name)
                dest = f"{section}.{f.name}" if f.name != "optimizer" else "optimizer"
                group.add_argument(flag, dest=dest, type=kind, choices=choices, default=argparse.SUPPRESS)
    return p


def resolve_config(args: argparse.Namespace, base: dict | None = None) -> Config:
    """Defaults, then the config file (or a checkpoint's saved config), then flags."""
    values = base if base is not None else M.read_toml(args.config, tuple(SECTIONS))
    values = {s: dict(values.get(s, {})) for s in SECTIONS}
    for dest, value in vars(args).items():
        if "." in dest:
            section, name = dest.split(".")
            values[section][name] = value
    if "optimizer" in vars(args):
        values["train"]["optimizer"] = args.optimizer
    source = "checkpoint" if base is not None else args.config
    return Config(**{s: M.from_dict(cls, values[s], source, s) for s, cls in SECTIONS.items()})


def accumulation_steps(batch_tokens: int, micro_batch: int, context: int, world: int) -> int:
    per_pass = micro_batch * context * world
    if batch_tokens % per_pass:
        raise ValueError(f"train.batch_tokens={batch_tokens:,} is not a multiple of micro_batch x context x "
                         f"world size = {micro_batch} x {context} x {world} = {per_pass:,}: change "
                         f"batch_tokens or micro_batch")
    return batch_tokens // per_pass


def total_steps(cfg: TrainConfig) -> int:
    return cfg.steps if cfg.steps > 0 else max(1, cfg.tokens // cfg.batch_tokens)


def lr_at(step: int, cfg: TrainConfig, steps: int) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# --- Setup pieces bench.py shares ----------------------------------------------------------

def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available: use device = \"auto\" or \"cpu\"")
    return torch.device(name)


def cpu_fallbacks(cfg: TrainConfig, device: torch.device, log=print) -> TrainConfig:
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


def set_precision(cfg: TrainConfig):
    # "high" lets float32 matmuls use TF32 tensor cores (10 mantissa bits in the multiply,
    # float32 sums); "highest", PyTorch's default, keeps full float32.
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = cfg.tf32


def autocast(cfg: TrainConfig, device: torch.device):
    """BF16 autocast: matmuls in bfloat16, weights, gradients and AdamW state stay float32."""
    if cfg.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_model(mcfg: M.ModelConfig, cfg: TrainConfig, device: torch.device, seed: int):
    """(raw model, model to call): the second is compiled and/or DDP-wrapped as configured."""
    torch.manual_seed(seed)
    raw = M.Llama(mcfg).to(device)
    raw.activation_checkpointing = cfg.activation_checkpointing
    run = raw
    if cfg.compile:
        run = torch.compile(raw, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    if dist.is_initialized():
        run = torch.nn.parallel.DistributedDataParallel(run, device_ids=[device.index] if device.type == "cuda" else None)
    return raw, run


def configure_optimizer(model: M.Llama, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the block matrices only. Norm gains are not decayed (decay
    would pull them toward zero, not toward the initial one), and neither is the embedding:
    it is also the output head here, and a token that is rare in the data would see its row
    shrink between the few steps that update it."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and name.startswith("blocks.") else no_decay).append(p)
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[cfg.optimizer]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **impl)


def mask_inputs(batch, cfg: TrainConfig, device: torch.device) -> dict:
    """The document-mask arguments for the model: FlexAttention's block mask on CUDA (built once
    per micro-batch, outside the compiled model), the boolean-mask path's doc_ids on CPU."""
    if not cfg.doc_mask:
        return {}
    if device.type == "cuda":
        return {"block_mask": M.flex_block_mask(batch[2])}
    return {"doc_ids": batch[2]}


def forward_loss(model, batch, cfg: TrainConfig, device: torch.device):
    """Mean loss of one micro-batch (x, y[, doc_ids])."""
    with autocast(cfg, device):
        return model(batch[0], batch[1], **mask_inputs(batch, cfg, device))


def train_step(model, optimizer, next_batch, accum: int, cfg: TrainConfig, device: torch.device, lr: float):
    """One optimizer step over `accum` micro-batches. Returns (loss, grad norm) as 0-d tensors on
    the device; reading them is the caller's one synchronization per step. With skip_nonfinite,
    a step whose loss or gradient is NaN/inf changes nothing and returns them as they were."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # CUDA graphs replay into the same output memory, so a gradient that autograd adopted as .grad
    # would be overwritten by the next micro-batch: under those modes gradients accumulate into
    # buffers of our own, zeroed in place.
    keep_grads = cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES
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
            loss = forward_loss(model, batch, cfg, device) / accum  # mean over the whole step
            loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    if cfg.skip_nonfinite and not bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=not keep_grads)
        return loss_sum, grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=not keep_grads)
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model, loader: D.ShardLoader, n_batches: int, token_bytes: torch.Tensor, cfg: TrainConfig,
             device: torch.device) -> dict:
    """Mean validation loss and bits per byte over the first n_batches of the val split.
    Bits per byte divide the summed loss (in bits) by the UTF-8 bytes the targets decode to,
    so runs with different tokenizers compare."""
    model.eval()
    loader.rewind()
    nats, n_tokens, n_bytes = torch.zeros((), device=device, dtype=torch.float64), 0, torch.zeros((), device=device)
    for _ in range(min(n_batches, len(loader))):
        batch = loader.next_batch()
        x, y = batch[0], batch[1]
        with autocast(cfg, device):
            logits = model(x, **mask_inputs(batch, cfg, device))
        nats += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        n_tokens += y.numel()
        n_bytes += token_bytes[y].sum()
    model.train()
    if dist.is_initialized():
        totals = torch.stack([nats, torch.tensor(float(n_tokens), device=device, dtype=torch.float64),
                              n_bytes.double()])
        dist.all_reduce(totals)
        nats, n_tokens, n_bytes = totals[0], totals[1].item(), totals[2]
    return {"val_loss": nats.item() / n_tokens, "val_bpb": nats.item() / math.log(2) / max(n_bytes.item(), 1)}


# --- Checkpoints ---------------------------------------------------------------------------

def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, **state):
    """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def check_compatible(ckpt: dict, cfg: Config, tok_hash: str, path: Path):
    """Refuse a checkpoint from another model shape or tokenizer, naming what differs."""
    saved = ckpt["config"]["model"]
    now = dataclasses.asdict(cfg.model)
    diff = [f"{k}: checkpoint {saved.get(k)!r}, config {now[k]!r}" for k in now if saved.get(k) != now[k]]
    if diff:
        raise ValueError(f"{path} is from another model shape ({'; '.join(diff)}): use the run's own "
                         f"config or start a new run with --name NAME")
    if ckpt["tokenizer_hash"] != tok_hash:
        raise ValueError(f"{path} was trained with tokenizer {ckpt['tokenizer_hash']}, but the data now uses "
                         f"tokenizer {tok_hash}: point the run at its original tokenizer and shards")


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


def plot_losses(log_path: Path, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


class _Stop:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint after the step in flight and exits."""

    def __init__(self):
        self.signal = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second Ctrl-C: the user really wants out
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name


# --- The run -------------------------------------------------------------------------------

def train(cfg: Config, run_dir: Path, resume: bool = False, overwrite: bool = False,
          stop_after: int | None = None, log=print) -> dict:
    """Run training as configured; returns the summary. Rank 0 alone writes files.
    stop_after: save a checkpoint and stop after this step, as SIGINT would."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    master = rank == 0
    say = log if master else (lambda *a, **k: None)
    device = pick_device(cfg.train.device)
    if dist.is_initialized() and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    tcfg = cpu_fallbacks(cfg.train, device, say)
    cfg = dataclasses.replace(cfg, train=tcfg)
    set_precision(tcfg)
    ckpt_path = run_dir / "ckpt.pt"
    if ckpt_path.exists() and not resume and not overwrite:
        raise ValueError(f"{run_dir} already holds a checkpoint: pass --resume to continue it, --overwrite to "
                         f"start over, or --name NAME for a new run")
    if resume and not ckpt_path.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")

    # Data: tokenizer and shards (built once, on rank 0; the others wait).
    if master:
        D.prepare(cfg.data, cfg.model.vocab_size, log=say)
    if dist.is_initialized():
        dist.barrier()
    folder = D.data_dir(cfg.data, cfg.model.vocab_size)
    tok_path = folder / "tokenizer.json"
    tok_hash = tk.tokenizer_hash(tok_path)
    T, B = cfg.model.context, tcfg.micro_batch
    accum = accumulation_steps(tcfg.batch_tokens, B, T, world)
    steps = total_steps(tcfg)
    train_loader = D.ShardLoader(D.shard_files(folder, "train"), B, T, vocab_size=cfg.model.vocab_size,
                                 tokenizer_hash=tok_hash, seed=tcfg.seed, rank=rank, world=world,
                                 doc_ids=tcfg.doc_mask, device=device, pin=tcfg.pin)
    val_loader = D.ShardLoader(D.shard_files(folder, "val"), B, T, vocab_size=cfg.model.vocab_size,
                               tokenizer_hash=tok_hash, rank=rank, world=world, shuffle=False,
                               doc_ids=tcfg.doc_mask, device=device)
    token_bytes = torch.tensor(tk.token_byte_lengths(tk.load_tokenizer(tok_path)), device=device, dtype=torch.float32)

    raw, model = build_model(cfg.model, tcfg, device, tcfg.seed)
    optimizer = configure_optimizer(raw, tcfg)
    step, tokens_seen, skipped = 0, 0, 0
    if resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        check_compatible(ckpt, cfg, tok_hash, ckpt_path)
        raw.load_state_dict(ckpt["model"], strict=True)
        optimizer.load_state_dict(ckpt["optimizer"])
        train_loader.load_state_dict(ckpt["loader"][rank] if isinstance(ckpt["loader"], list) else ckpt["loader"])
        set_rng_state(ckpt["rng"][rank] if isinstance(ckpt["rng"], list) else ckpt["rng"])
        step, tokens_seen, skipped = ckpt["step"], ckpt["tokens"], ckpt.get("skipped", 0)
        say(f"resumed {ckpt_path} at step {step} ({tokens_seen:,} tokens)")
    elif master:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "log.jsonl").write_text("")

    info = provenance(device)
    n_params = M.param_count(cfg.model)
    flops_tok = M.flops_per_token(cfg.model)
    peak = tcfg.peak_tflops or (peak_tflops(info["device"]) if device.type == "cuda" else None)
    say(f"run {run_dir} | {info['device']} | torch {info['torch']} (CUDA {info['cuda']}) | "
        f"git {info['git_commit'][:10]}{' (dirty)' if info['git_dirty'] else ''} | world {world}")
    say(f"model: {n_params:,} parameters, head size {cfg.model.head_dim}, SwiGLU {cfg.model.ffn_hidden}, "
        f"{flops_tok / 1e6:,.1f} MFLOPs/token")
    say(f"batch: {tcfg.batch_tokens:,} tokens = {B} seq x {T} tokens x {accum} accumulation x {world} rank(s); "
        f"{steps} steps = {steps * tcfg.batch_tokens:,} tokens")
    say(f"flags: tf32={tcfg.tf32} bf16={tcfg.bf16} compile={tcfg.compile}"
        f"{'(' + tcfg.compile_mode + ')' if tcfg.compile else ''} adamw={tcfg.optimizer} pin={tcfg.pin} "
        f"activation_checkpointing={tcfg.activation_checkpointing} doc_mask={tcfg.doc_mask}")
    if device.type == "cuda" and peak is None:
        say(f"note: no BF16 peak known for {info['device']}: MFU is not shown (pass --peak-tflops)")
    if master:
        (run_dir / "config.json").write_text(json.dumps({"config": cfg.to_dict(), "provenance": info,
                                                         "tokenizer_hash": tok_hash}, indent=2))

    def checkpoint():
        loaders = [train_loader.state_dict()]
        rngs = [rng_state()]
        if dist.is_initialized():  # every rank's cursor and RNG, so each resumes exactly
            loaders, rngs = [None] * world, [None] * world
            dist.all_gather_object(loaders, train_loader.state_dict())
            dist.all_gather_object(rngs, rng_state())
        if master:
            save_checkpoint(ckpt_path, model=raw.state_dict(), optimizer=optimizer.state_dict(), step=step,
                            tokens=tokens_seen, skipped=skipped, loader=loaders if world > 1 else loaders[0],
                            rng=rngs if world > 1 else rngs[0], config=cfg.to_dict(), tokenizer_hash=tok_hash)

    def write_log(row: dict):
        if master:
            with open(run_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    fixed = train_loader.next_batch() if tcfg.overfit_batch else None
    next_batch = (lambda: fixed) if fixed is not None else train_loader.next_batch
    eval_batches = max(1, tcfg.eval_tokens // (B * T * world))
    stopper = _Stop()
    bar = tqdm(total=steps, initial=step, desc="train", unit="step", disable=not master, dynamic_ncols=True)
    say_bar = (lambda s: bar.write(s)) if master else (lambda s: None)
    rates, last_eval, start_time, first_step = [], {}, time.perf_counter(), step
    while True:
        last_step = step == steps
        fresh = step > first_step  # a resumed run already evaluated and saved this step
        # Evaluate and save first, so the state on disk always matches the step counter.
        if fresh and (step % tcfg.eval_every == 0 or last_step) and not tcfg.overfit_batch:
            last_eval = evaluate(model, val_loader, eval_batches, token_bytes, tcfg, device)
            say_bar(f"step {step:>6} | val loss {last_eval['val_loss']:.4f} | val bpb {last_eval['val_bpb']:.4f}")
            write_log({"step": step, "tokens": tokens_seen, **last_eval})
        if fresh and (step % tcfg.ckpt_every == 0 or last_step):
            checkpoint()
        if last_step:
            break
        if stopper.signal or step == stop_after:
            checkpoint()
            say_bar(f"{stopper.signal or '--stop-after'}: saved {ckpt_path} at step {step}; continue with --resume")
            break
        t0 = time.perf_counter()
        try:
            loss, grad_norm = train_step(model, optimizer, next_batch, accum, tcfg, device,
                                         lr_at(step, tcfg, steps))
            if dist.is_initialized():
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            loss_value, norm_value = torch.stack([loss.float(), grad_norm.float()]).tolist()
        except torch.cuda.OutOfMemoryError:
            raise SystemExit(
                f"CUDA out of memory at step {step} with micro_batch={B} sequences of {T} tokens "
                f"(peak {peak_memory_gib(device):.1f} GiB): try --micro-batch {max(1, B // 2)} (the batch stays "
                f"{tcfg.batch_tokens:,} tokens through more accumulation) or --activation-checkpointing") from None
        dt = time.perf_counter() - t0
        if not math.isfinite(loss_value) or not math.isfinite(norm_value):
            if not tcfg.skip_nonfinite:
                checkpoint_note = f"the last good checkpoint {ckpt_path} is kept" if ckpt_path.exists() else "no checkpoint was written"
                raise SystemExit(f"loss is {loss_value} (gradient norm {norm_value}) at step {step}: stopping; "
                                 f"{checkpoint_note}. Lower train.lr, or pass --skip-nonfinite to skip such steps")
            skipped += 1
            say_bar(f"step {step}: non-finite loss {loss_value}, step skipped ({skipped} so far)")
        if step == 0:
            expected = math.log(cfg.model.vocab_size)
            warn = "" if abs(loss_value - expected) < 1.0 else "  WARNING: far from ln(vocab); check the init and the data"
            say_bar(f"step 0 loss {loss_value:.4f} vs ln(vocab) = {expected:.4f}{warn}")
        step += 1
        tokens_seen += tcfg.batch_tokens
        tok_s = tcfg.batch_tokens / dt
        if step > first_step + 1:  # the first step includes compilation and warm-up
            rates.append(tok_s)
        step_mfu = M.mfu(tok_s / world, flops_tok, peak * 1e12) if peak else None
        row = {"step": step, "tokens": tokens_seen, "loss": loss_value, "lr": lr_at(step - 1, tcfg, steps),
               "grad_norm": norm_value, "tok_s": round(tok_s), "mfu": step_mfu,
               "peak_mem_gib": round(peak_memory_gib(device), 3), "step_s": round(dt, 4), "skipped": skipped}
        write_log(row)
        say_bar(f"step {step:>6} | loss {loss_value:.4f} | lr {row['lr']:.2e} | gnorm {norm_value:.3f} | "
                f"{tok_s:,.0f} tok/s | MFU {f'{step_mfu:.1%}' if step_mfu is not None else 'n/a'} | "
                f"mem {row['peak_mem_gib']:.2f} GiB")
        bar.update(1)
    bar.close()

    elapsed = time.perf_counter() - start_time
    mean_rate = float(np.mean(rates)) if rates else None
    summary = {"run": str(run_dir), "steps": step, "tokens": tokens_seen, "seconds": round(elapsed, 1),
               "mean_tok_s": round(mean_rate) if mean_rate else None,
               "mfu": M.mfu(mean_rate / world, flops_tok, peak * 1e12) if (peak and mean_rate) else None,
               "peak_mem_gib": round(peak_memory_gib(device), 3), "skipped": skipped, "device": info["device"],
               **{k: round(v, 4) for k, v in last_eval.items()}}
    if master and step == steps:
        plot_losses(run_dir / "log.jsonl", run_dir / "loss.png")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        say(f"done: {tokens_seen:,} tokens in {elapsed:.0f} s, mean {summary['mean_tok_s'] or 0:,} tok/s, "
            f"MFU {'n/a' if summary['mfu'] is None else format(summary['mfu'], '.1%')}, "
            + (f"val loss {last_eval['val_loss']:.4f} (ln vocab {math.log(cfg.model.vocab_size):.2f}), "
               f"val bpb {last_eval['val_bpb']:.4f}" if last_eval else "no validation pass")
            + f"; plot {run_dir / 'loss.png'}")
        if tcfg.sample_tokens:
            say("sample:\n" + sample_text(raw, tk.load_tokenizer(tok_path), "def ", tcfg.sample_tokens, device))
    return summary


def sample_text(model: M.Llama, tok, prompt: str, n: int, device: torch.device) -> str:
    idx = torch.tensor([tok.encode(prompt).ids], device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    new = [t.item() for t in M.generate(model.eval(), idx, n, temperature=0.8, top_k=50, generator=gen)]
    model.train()
    return prompt + tok.decode(new)


def main(argv=None):
    args = build_parser().parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        if distributed:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        run_dir = Path(args.runs_dir) / (args.name or Path(args.config).stem)
        base = None
        if args.resume and (run_dir / "ckpt.pt").exists():
            # Resume with the run's own resolved config; flags may still change the train section.
            base = json.loads((run_dir / "config.json").read_text())["config"]
        cfg = resolve_config(args, base)
        if not distributed or dist.get_rank() == 0:
            print("config: " + json.dumps(cfg.to_dict()))
        train(cfg, run_dir, resume=args.resume, overwrite=args.overwrite, stop_after=args.stop_after)
    except (ValueError, FileNotFoundError, tk.CorpusError) as e:
        sys.exit(f"error: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
