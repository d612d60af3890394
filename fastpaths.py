"""Training's speed paths: the [speed] settings, the rule of each path, and apply(), which swaps them in.

model.py computes the model plainly. Each path here computes the same function faster (within rounding) on
the hardware that has it, and is a swap applied once, when a run builds its model: apply() changes a module's
class to its faster twin, a subclass with the same parameters (so checkpoints' keys never change), whose
forward falls back to the plain one where the path does not run (evaluation, an unsupported shape). Each keeps
its switch below (--fp8 / --no-fp8, ...), its rule (fast_path_applies), CPU and GPU agreement tests and a
bench rung. What each one saves is docs/performance/training-speed.md's; generation's paths are generate.py's.

  attention            pins one SDPA kernel (Attention.backend)
  fp8, fp8_fast_accum  the MLP's matmuls in FP8 (fp8.py): FP8Linear (SwiGLU's), FP8ReLU2 (the whole ReLU² MLP)
  fp8_head, loss_kernel  the head's matmul in FP8 and the loss as one Triton kernel each way: TrainingLoss
  fused_loss           head and loss in chunks without holding all logits: FusedLoss
  fused_swiglu         SwiGLU's activation as one Triton kernel each way: FusedSwiGLU
  fused_relu2          ReLU²'s square in its up-projection's epilogue: FusedReLU2
  fused_qk_norm_rope   QK-norm and RoPE's backward as one Triton kernel: FusedQKAttention
  bf16_residual        the residual stream in bf16 under autocast: BF16Stream
and two memory settings of [train] (activation_checkpointing, recompute_mlp), applied the same way by
apply_recompute().
"""

from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import model as M
import onegpu_kernels as K
from fp8 import fp8_head_cross_entropy, fp8_linear, fp8_relu2_mlp, matmul_dtype

AttentionKind = Literal["sdpa", "flash", "cudnn", "efficient", "math", "textbook"]


@dataclass
class SpeedConfig:
    """How fast the model computes, never what: every switch is off here (the plain path), so a config that
    names none runs plainly, and the presets turn on what was measured to pay."""
    attention: AttentionKind = "sdpa"  # attention kernel in training: sdpa lets PyTorch pick; flash/cudnn/efficient/math pin one
    fused_loss: bool = False  # head + cross-entropy in chunks, never holding all logits (less memory)
    fp8: bool = False  # the MLP's matmuls' forward and input gradients in FP8 (e4m3, a scale a row), in training
    fp8_head: bool = False  # the untied output head's training matmuls in FP8, its gradient at a fixed scale
    fp8_fast_accum: bool = False  # with fp8 / fp8_head: their forward products with cuBLAS's fast accumulation
    bf16_residual: bool = False  # with --bf16, the residual stream in bf16 too, not float32 (training)
    fused_swiglu: bool = False  # SwiGLU forward and backward as one Triton kernel each (CUDA, training)
    fused_relu2: bool = False  # ReLU²'s square and its derivative in its matmuls' epilogues (CUDA, training)
    fused_qk_norm_rope: bool = False  # QK-norm and RoPE's backward as one Triton kernel (CUDA, training)
    loss_kernel: bool = False  # the (soft-capped) cross-entropy as one Triton kernel each way (CUDA, training)
    fused_decode: bool = False  # a new token's RoPE, cache write and attention in one Triton kernel (CUDA)
    split_decode: bool = False  # with fused_decode, each head's cached positions over many programs (CUDA)
    decode_matmuls: bool = False  # generation's matmuls of at most 16 tokens as Triton's small_matmul (CUDA)
    decode_mlp: bool = False  # generation's ReLU² MLP of at most 16 tokens as one Triton kernel (CUDA)
    decode_pdl: bool = False  # generation's kernels launched while the one before them runs (Hopper and newer)


SPEED_FIELDS = tuple(f.name for f in fields(SpeedConfig))
# The training fast paths, switch -> the name tables give it, in the order bench's ladder adds them. The fused loss
# has its own head and loss, so it excludes the FP8 head and the loss kernel; the ladder skips a switch that one
# before it excludes, so it keeps those two, which the default presets run. FP8 matmuls and the fused ReLU²
# exclude each other (each has its own MLP); FP8 comes first, as it measured faster at 88m. Fast accumulation
# changes how the FP8 matmuls compute: it follows them, and tried alone (REFINES) it runs with them.
TRAINING_FAST_PATHS = {"fp8_head": "fp8 head", "loss_kernel": "loss kernel", "fused_loss": "fused loss",
                       "fused_swiglu": "fused SwiGLU", "fp8": "fp8 matmuls",
                       "fp8_fast_accum": "fp8 fast accumulation", "fused_relu2": "fused ReLU²",
                       "fused_qk_norm_rope": "fused QK-norm + RoPE", "bf16_residual": "bf16 residual"}
GENERATION_FAST_PATHS = {"fused_decode": "fused decode", "split_decode": "split decode",
                         "decode_matmuls": "decode matmuls", "decode_mlp": "decode MLP",
                         "decode_pdl": "dependent launches"}
# A path that changes how another computes -> that one, which runs beside it wherever it is tried alone.
REFINES = {"fp8_fast_accum": "fp8"}
TRITON_PATHS = ("fused_swiglu", "loss_kernel", "fused_relu2", "fused_qk_norm_rope")


def fast_path_applies(name: str, cfg: M.ModelConfig, speed: SpeedConfig) -> bool:
    """Whether fast path `name` runs for cfg's architecture beside speed's other switches (a GPU that has it
    aside): the fused SwiGLU for the SwiGLU MLP alone, the fused ReLU² for the ReLU² MLP outside FP8 matmuls
    (each has its own MLP), the fused loss outside the FP8 head and the loss kernel, those two outside the
    fused loss (the FP8 head for an untied head whose soft-cap is at most 1 steep), fast accumulation beside an
    FP8 path, the fused QK-norm +
    RoPE for a model with QK-norm (swap_in leaves paired layers plain); the decode kernel (and its split) outside
    the key offset, the value gates, paired heads, XSA and dense_last's value addend, which it does not compute;
    the decode MLP for the ReLU² MLP."""
    plain_attention = not (cfg.key_offset or cfg.value_gate or cfg.paired_heads or cfg.xsa or cfg.dense_last)
    rules = {"fused_decode": plain_attention, "split_decode": speed.fused_decode and plain_attention,
             "decode_mlp": cfg.mlp == "relu2",
             "fused_swiglu": cfg.mlp == "swiglu", "fused_relu2": cfg.mlp == "relu2" and not speed.fp8,
             "fused_qk_norm_rope": cfg.qk_norm, "fused_loss": not speed.fp8_head and not speed.loss_kernel,
             "loss_kernel": not speed.fused_loss,
             "fp8_head": not cfg.tie_embeddings and not speed.fused_loss and not steep_cap(cfg),
             "fp8_fast_accum": speed.fp8 or speed.fp8_head}
    return rules.get(name, True)


def running(names, cfg: M.ModelConfig, speed: SpeedConfig) -> list[str]:
    """Of the paths `names`, in their order, those speed turns on that run for cfg (fast_path_applies)."""
    return [n for n in names if getattr(speed, n) and fast_path_applies(n, cfg, speed)]


def steep_cap(cfg: M.ModelConfig) -> bool:
    """Whether the logits' soft-cap can be steeper than 1 (a temperature below the cap): the FP8 head scales the
    logits' gradient to e5m2 by its bound, 1 / tokens, which holds for a slope of at most 1 (fp8.py)."""
    return 0 < cfg.logit_temperature < cfg.logit_softcap


def check(cfg: M.ModelConfig, speed: SpeedConfig):
    """Refuse in one line a switch that cannot run beside cfg (those that merely do nothing pass)."""
    if speed.fp8_head and steep_cap(cfg):
        raise ValueError(f"speed.fp8_head bounds the logits' gradient by a soft-cap slope of at most 1, but "
                         f"model.logit_temperature={cfg.logit_temperature:g} below logit_softcap={cfg.logit_softcap:g} "
                         f"is steeper: give a temperature of at least the cap, or use --no-fp8-head")
    if speed.fp8_head and not fast_path_applies("fp8_head", cfg, speed):
        raise ValueError("speed.fp8_head runs the untied head's matmul in FP8: it needs --no-tie-embeddings and "
                         "--no-fused-loss (the fused loss has its own head), or use --no-fp8-head")


def fast_path_alone(name: str) -> dict[str, bool]:
    """The switches that try training fast path `name` alone: it, and the path it refines (REFINES)."""
    return {name: True, **({REFINES[name]: True} if name in REFINES else {})}


def plain(speed: SpeedConfig) -> SpeedConfig:
    """speed with every training fast path off."""
    return replace(speed, **dict.fromkeys(TRAINING_FAST_PATHS, False))


def runnable_fast_paths(cfg: M.ModelConfig, speed: SpeedConfig | None = None) -> list[str]:
    """The training fast paths cfg's architecture can run, each tried alone (fast_path_alone, the others
    off): what bench's ladder and kernels study and the loss curves give a rung."""
    base = plain(speed or SpeedConfig())
    return [s for s in TRAINING_FAST_PATHS
            if fast_path_applies(s, cfg, replace(base, **{REFINES[s]: True}) if s in REFINES else base)]


def fp8_units(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores: an NVIDIA GPU of compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def for_device(speed: SpeedConfig, device: torch.device) -> tuple[SpeedConfig, str]:
    """(speed for a model that will train on `device`, why it differs: "" where it does not). On a GPU
    Triton cannot run (older than Ampere) the Triton fast paths are off, and the FP8 matmuls wherever
    there are no FP8 units (compute capability 8.9: Ada, then Hopper), where the plain paths compute the
    same functions in bf16. A CPU has none either: torch._scaled_mm emulates them there, far slower. On a CPU
    the Triton paths run only under Triton's interpreter (TRITON_INTERPRET=1, as the tests run them)."""
    whys = []
    if not K.device_supported(device) and any(getattr(speed, name) for name in TRITON_PATHS):
        speed = replace(speed, **dict.fromkeys(TRITON_PATHS, False))
        whys.append("its Triton kernels need a GPU of compute capability 8.0 (Ampere) or newer"
                    if device.type == "cuda" else "Triton's kernels run on a GPU (on a CPU only under its interpreter)")
    if (speed.fp8 or speed.fp8_head) and not fp8_units(device):
        speed = replace(speed, fp8=False, fp8_head=False, fp8_fast_accum=False)
        whys.append("a CPU has no FP8 matmul units (emulated, about 20x slower)" if device.type == "cpu" else
                    "FP8 matmuls need a GPU of compute capability 8.9 (Ada, Hopper) or newer")
    return speed, "; ".join(whys)


def swap(module: torch.nn.Module, faster: type, **settings):
    """Make `module` its faster twin in place: `faster` subclasses its class, so the parameters, buffers and
    state_dict keys stay as they are; settings become its attributes."""
    assert issubclass(faster, type(module)), (faster, type(module))
    module.__class__ = faster
    for name, value in settings.items():
        setattr(module, name, value)


def apply(model: M.Llama, speed: SpeedConfig, device: torch.device) -> list[str]:
    """Swap into `model` every training fast path speed turns on that applies to it and runs on `device`
    (for_device), once, after the model is on its device. Returns the paths swapped in, in
    TRAINING_FAST_PATHS' order: what the run header prints."""
    return swap_in(model, for_device(speed, device)[0])


def swap_in(model: M.Llama, speed: SpeedConfig) -> list[str]:
    """apply() without asking the device: every path speed turns on that applies to the model (the CPU tests
    run the FP8 paths so, emulated)."""
    on = running(TRAINING_FAST_PATHS, model.cfg, speed)
    fast_accum = "fp8_fast_accum" in on
    for module in list(model.modules()):
        if isinstance(module, M.Attention):
            module.backend = speed.attention
            if "fused_qk_norm_rope" in on and not module.paired:  # its kernel reads heads unpaired
                swap(module, FusedQKAttention)
        elif isinstance(module, M.SwiGLU):
            if "fp8" in on:
                swap(module.w13, FP8Linear, fast_accum=fast_accum)
                swap(module.w2, FP8Linear, fast_accum=fast_accum)
            if "fused_swiglu" in on:
                swap(module, FusedSwiGLU)
        elif isinstance(module, M.ReLU2):
            if "fp8" in on:
                swap(module, FP8ReLU2, fast_accum=fast_accum)
            elif "fused_relu2" in on:
                swap(module, FusedReLU2)
    if "bf16_residual" in on:
        swap(model.stream, BF16Stream)
    if "fused_loss" in on:
        swap(model.output, FusedLoss)
    elif "fp8_head" in on or "loss_kernel" in on:
        swap(model.output, TrainingLoss, fp8_head="fp8_head" in on, loss_kernel="loss_kernel" in on,
             fast_accum=fast_accum)
    return on


def apply_recompute(model: M.Llama, activation_checkpointing: bool, recompute_mlp: bool):
    """train.activation_checkpointing: every block recomputed in backward; else train.recompute_mlp: only each
    block's norm + MLP (most of the memory, less of the work)."""
    for block in model.blocks:
        if activation_checkpointing:
            swap(block, CheckpointedBlock)
        elif recompute_mlp:
            swap(block, RecomputedMLPBlock)


# --- The swaps -----------------------------------------------------------------------------
# Each is a subclass of the plain module it replaces. Training runs the fast forward; with gradients off
# (evaluation, generation) or where a kernel does not handle the inputs, the plain forward runs.

class FP8Linear(torch.nn.Linear):
    """nn.Linear (bias-free) whose training matmul runs in FP8 (fp8.fp8_linear)."""
    fast_accum = False

    def forward(self, x):
        if torch.is_grad_enabled():
            return fp8_linear(x, self.weight, fast_accum=self.fast_accum)
        return super().forward(x)


class FP8ReLU2(M.ReLU2):
    """The ReLU² MLP with both matmuls in FP8 and the activation cast as it is computed (fp8.FP8ReLU2MLP)."""
    fast_accum = False

    def forward(self, x):
        if torch.is_grad_enabled():
            return fp8_relu2_mlp(x, self.w1.weight, self.w2.weight, self.fast_accum)
        return super().forward(x)


class FusedSwiGLU(M.SwiGLU):
    """SwiGLU's activation as onegpu_kernels.swiglu, forward and backward one kernel each. Training only: when
    decoding Inductor fuses SiLU into the matmuls around it."""

    def forward(self, x):
        h13 = self.w13(x)  # (B, T, 2 x ffn_hidden): [gate | up]
        if torch.is_grad_enabled() and K.swiglu_supported(h13):
            return self.w2(K.swiglu(h13))
        gate, up = h13.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class FusedReLU2(M.ReLU2):
    """ReLU²'s square in its up-projection's epilogue (FusedReLU2MLP)."""

    def forward(self, x):
        if torch.is_grad_enabled() and K.runs_on(x):
            return fused_relu2_mlp(x, self.w1.weight, self.w2.weight)
        return super().forward(x)


class FusedQKAttention(M.Attention):
    """Attention whose QK-norm and RoPE run forward as the plain lines and backward as one Triton kernel
    (QKNormRope)."""

    def heads(self, qkv, rope, ve=None):
        if torch.is_grad_enabled() and K.qk_norm_rope_supported(qkv, rope[0]):
            q, k, v = QKNormRope.apply(qkv, *rope, self.q_norm.weight, self.k_norm.weight, self.n_heads,
                                       self.q_norm.eps)
            return q, k, self.mixed_values(v, ve)
        return super().heads(qkv, rope, ve)


class BF16Stream(M.Stream):
    """The stream every norm reads and every residual add writes in bf16 instead of float32, in training under
    autocast: half the bytes in those memory-bound kernels. The norms compute in float32; the gradient along
    the stream is rounded to bf16 at every add, and the loss curves match. Evaluation and decoding move one
    stream vector per token next to whole weight matrices, so they keep float32's precision for free."""

    def forward(self, x):
        x = super().forward(x)
        if torch.is_grad_enabled() and torch.is_autocast_enabled(x.device.type):
            return x.to(torch.get_autocast_dtype(x.device.type))
        return x


class TrainingLoss(M.Output):
    """The training loss with the head's matmul in FP8 (fp8_head: its gradient within 1 / tokens, see fp8.py)
    and/or the soft-capped cross-entropy as one Triton kernel each way (loss_kernel); both: one function that
    writes the logits' gradient in the forward (fp8.FP8HeadCrossEntropy)."""
    fp8_head = loss_kernel = fast_accum = False

    def loss(self, x, weight, targets):
        if not torch.is_grad_enabled():
            return super().loss(x, weight, targets)
        multi = isinstance(targets, M.MultiTargets)  # the multi-token loss: its own kernels
        ids, weights = (targets.ids.flatten(0, 1), targets.weights) if multi else (targets.flatten(), None)  # (N[, K])
        if self.fp8_head and self.loss_kernel and K.runs_on(x):
            # With K targets a row the gradient's bound is K / N, a coarser e5m2 grid than one target's: the head's
            # weight gradient then stays in bf16, as the FP8 head alone computes it (fp8_head_loss_check's tests)
            return fp8_head_cross_entropy(x.flatten(0, 1), weight, ids, self.cap, fp8_weight_grad=not multi,
                                          fast_accum=self.fast_accum, shift=self.shift, temperature=self.temperature,
                                          weights=weights)
        if self.fp8_head:  # a logit's gradient is at most its row's weights' sum (each at most 1) over the rows
            logits = fp8_linear(x, weight, grad_bound=(ids.shape[1] if multi else 1) / ids.shape[0],
                                fast_accum=self.fast_accum)
        else:
            logits = F.linear(x, weight)
        logits = logits.flatten(0, 1)
        if self.loss_kernel and K.cross_entropy_supported(logits):
            if multi:
                return K.multi_cross_entropy(logits, ids, weights, self.cap, self.shift, self.temperature)[0].mean()
            return K.cross_entropy(logits, ids, self.cap, self.shift, self.temperature)[0].mean()
        return M.cross_entropy(logits, ids, self.cap, weights, self.shift, self.temperature)


class FusedLoss(M.Output):
    """Head and loss over row chunks, never holding all the logits (linear_cross_entropy)."""

    def loss(self, x, weight, targets):
        ids, weights = targets if isinstance(targets, M.MultiTargets) else (targets, None)
        return linear_cross_entropy(x.flatten(0, 1), weight, ids.flatten(0, 1), self.cap, weights, self.shift,
                                    self.temperature)


class CheckpointedBlock(M.Block):
    """A block that keeps only its input for the backward pass and recomputes the rest there (training)."""

    def forward(self, x, x0, rope, masks, ve=None, attn_in=None, v_add=None):
        if not self.training:
            return super().forward(x, x0, rope, masks, ve, attn_in, v_add)
        return torch.utils.checkpoint.checkpoint(super().forward, x, x0, rope, masks, ve, attn_in, v_add,
                                                 use_reentrant=False)


class RecomputedMLPBlock(M.Block):
    """A block whose norm, up-projection and activation are recomputed in the backward pass: one extra
    up-projection matmul for the widest activations' memory (training)."""

    def mlp_branch(self, x):
        if not self.training:
            return super().mlp_branch(x)
        return torch.utils.checkpoint.checkpoint(super().mlp_branch, x, use_reentrant=False)


# --- Their autograd functions ----------------------------------------------------------------

class FusedReLU2MLP(torch.autograd.Function):
    """relu(x W1^T)^2 W2^T with the square in the up-projection's epilogue (onegpu_kernels.relu2_matmul). It
    keeps the activation a = relu(h)^2 for the backward, which the down-projection's weight gradient needs
    anyway, and not h: relu(h) = sqrt(a), so the backward needs no more. Where the plain path keeps both
    h and a, this saves one (tokens, hidden) tensor per layer.
    The other matmuls are cuBLAS's. x: (N, d); w1: (hidden, d); w2: (d, hidden)."""

    @staticmethod
    def forward(ctx, x, w1, w2, dtype):
        xc, w1c, w2c = x.to(dtype), w1.to(dtype), w2.to(dtype)
        a = K.relu2_matmul(xc, w1c.t())  # (N, hidden)
        ctx.save_for_backward(xc, a, w1c, w2c)
        ctx.dtypes = (x.dtype, w1.dtype, w2.dtype)
        return a @ w2c.t()

    @staticmethod
    def backward(ctx, grad):
        x, a, w1, w2 = ctx.saved_tensors
        grad = grad.to(a.dtype)
        grad_h = (grad @ w2) * (2 * a.sqrt())  # d relu(h)^2 / dh = 2 relu(h) = 2 sqrt(a): (N, hidden)
        return ((grad_h @ w1).to(ctx.dtypes[0]), (grad_h.t() @ x).to(ctx.dtypes[1]),
                (grad.t() @ a).to(ctx.dtypes[2]), None)


def fused_relu2_mlp(x, w1, w2):
    """ReLU2's forward through FusedReLU2MLP, in autocast's dtype inside autocast (x's outside it).
    x: (..., d)."""
    dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        y = FusedReLU2MLP.apply(x.reshape(-1, x.shape[-1]), w1, w2, dtype)
    return y.view(*x.shape[:-1], w2.shape[0])


class QKNormRope(torch.autograd.Function):
    """fused_qk_norm_rope: QK-norm and RoPE on qkv (B, T, H + 2 Hkv, hd), the QKV projection's output, with
    the gains q_gain and k_gain (hd,), H = n_heads, and the tables cos, sin (T, hd). Forward, the plain lines
    (Attention.heads' norms, then apply_rope), which Inductor fuses into one kernel faster than one of ours
    did. Backward, one Triton kernel (onegpu_kernels.qk_norm_rope_backward, which recomputes the norm from
    qkv), faster than Inductor's (docs/performance/training-speed.md). Returns q (B, T,
    H, hd), k and v (B, T, Hkv, hd) apart, v a copy of qkv's rows, so that their gradients come back apart,
    where attention leaves them, and the kernel writes qkv's whole gradient without a copy of the three
    into one first."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, q_gain, k_gain, n_heads: int, eps: float):
        ctx.save_for_backward(qkv, cos, sin, q_gain, k_gain)
        ctx.n_heads, ctx.eps = n_heads, eps
        kv_heads = (qkv.shape[2] - n_heads) // 2
        q, k, v = qkv.split([n_heads, kv_heads, kv_heads], dim=2)
        q = M.apply_rope(M.rms_norm(q, eps) * q_gain, cos, sin).type_as(qkv)
        k = M.apply_rope(M.rms_norm(k, eps) * k_gain, cos, sin).type_as(qkv)
        return q, k, v.clone()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, cos, sin, q_gain, k_gain = ctx.saved_tensors
        dqkv, dq_gain, dk_gain = K.qk_norm_rope_backward(dq, dk, dv, qkv, cos, sin, q_gain, k_gain, ctx.n_heads,
                                                         ctx.eps)
        return dqkv, None, None, dq_gain, dk_gain, None, None


# The plain loss materialises (tokens x vocab) logits: at micro-batch 16 of 1,024 tokens and a
# 32,768 vocabulary that is 0.5 G values, 1 GiB in bf16 plus 2 GiB in float32 and again for their
# gradient. Here the head and the loss run over row chunks; each chunk's gradient is computed at
# once in the forward pass (the loss is the graph's end, so its incoming gradient is a scalar),
# and only the input's and the weight's gradients are kept: memory for one chunk's logits.

LOSS_CHUNK_ROWS = 2048  # at least 2,048 rows a chunk: 2,048 x 32,768 logits are 128 MiB in bf16
LOSS_MAX_CHUNKS = 16  # larger batches take larger chunks: each chunk adds into the (vocab, d) weight gradient


def _loss_chunk(x, w, targets, weights, scale: float, cap: float = 0.0, shift: float = 0.0, temperature: float = 0.0):
    """Sum over one chunk of each row's weighted cross-entropies, and the gradients of scale * that sum with respect
    to x (rows, d) and w (vocab, d). targets (rows, K): the k-th target of each row (-1: none, counting 0), weighted
    by weights[k] (K,) (M.MultiTargets; one target of weight 1 is the plain loss). x and w in the matmul dtype;
    softmax in float32. cap, shift, temperature: the logits' soft-cap (M.softcap; cap 0: none), whose slope
    cap / temperature (1 - tanh^2) scales the logits' gradient."""
    logits = (x @ w.t()).to(torch.promote_types(x.dtype, torch.float32))  # (rows, vocab), at least float32
    if cap:
        squashed = torch.tanh((logits + shift) / (temperature or cap))
        logits = cap * squashed
    lse = torch.logsumexp(logits, dim=-1)
    share = (targets >= 0) * weights.to(logits.dtype)  # (rows, K): each target's weight, 0 where there is none
    picked = logits.gather(1, targets.clamp(min=0))  # (rows, K)
    loss = ((lse[:, None] - picked) * share).sum()
    # d loss / d logits = sum_k share_k (softmax - one-hot_k), written as one elementwise expression (no in-place
    # scatter), so the compiled chunk reads the logits once more and writes the gradient once, in the matmul dtype
    # as autocast's backward has it. K is small (1 to 3): the sum over it unrolls.
    column = torch.arange(logits.shape[1], device=x.device)[None, :]
    hot = sum((column == targets[:, k:k + 1]) * share[:, k:k + 1] for k in range(targets.shape[1]))
    grad = (torch.exp(logits - lse[:, None]) * share.sum(-1, keepdim=True) - hot) * scale
    if cap:
        grad = grad * (cap / (temperature or cap) * (1 - squashed * squashed))
    grad = grad.to(x.dtype)
    return loss, grad @ w, grad.t() @ x


_compiled_chunk = None


def loss_chunk_fn(device: torch.device):
    """On CUDA the chunk's elementwise work is one compiled kernel (compiled once per process,
    reused by every chunk); on CPU it is the plain function."""
    global _compiled_chunk
    if device.type != "cuda":
        return _loss_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_loss_chunk, dynamic=False)
    return _compiled_chunk


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, weights, compute_dtype, cap, shift, temperature):
        n = x.shape[0]
        w = weight.to(compute_dtype)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        total = torch.zeros((), device=x.device, dtype=torch.promote_types(compute_dtype, torch.float32))
        chunk, size = loss_chunk_fn(x.device), max(LOSS_CHUNK_ROWS, -(-n // LOSS_MAX_CHUNKS))
        for start in range(0, n, size):
            rows = slice(start, start + size)
            loss, gx, gw = chunk(x[rows].to(compute_dtype), w, targets[rows], weights, 1.0 / n, cap, shift,
                                 temperature)
            total += loss
            grad_x[rows] = gx
            grad_w += gw  # float32 accumulation across chunks
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_out, grad_w * grad_out, None, None, None, None, None, None


def linear_cross_entropy(x, weight, targets, cap: float = 0.0, weights=None, shift: float = 0.0,
                         temperature: float = 0.0):
    """Mean cross-entropy of softmax(softcap(x @ weight.T, cap, shift, temperature)) against targets. x: (N, d);
    weight: (vocab, d); targets: (N,), or (N, K) with weights (K,) for the multi-token loss. Equals
    M.cross_entropy(F.linear(x, weight), targets, cap, weights, shift, temperature), computed in chunks.
    Kept out of an enclosing torch.compile graph: a plain Python loop over compiled chunks is
    compiled once, where tracing it would unroll one copy per chunk."""
    global _uncompiled_loss
    if _uncompiled_loss is None:  # torch.compiler imports the compiler stack: only when this is used
        _uncompiled_loss = torch.compiler.disable(_linear_cross_entropy)
    if weights is None:
        targets, weights = targets[:, None], torch.ones(1, device=x.device)
    return _uncompiled_loss(x, weight, targets, cap, weights, shift, temperature)


_uncompiled_loss = None


def _linear_cross_entropy(x, weight, targets, cap: float, weights, shift: float, temperature: float):
    dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return LinearCrossEntropy.apply(x, weight, targets, weights, dtype, cap, shift, temperature)
