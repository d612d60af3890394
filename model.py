"""A Llama-style decoder and the arithmetic around it: parameters, FLOPs, MFU.

Read top to bottom: ModelConfig; the layers (RMSNorm, RoPE, attention with its optional QK-norm,
masks for documents and a sliding window, FP8 matmuls, the Attend context, SwiGLU or ReLU², block);
the fused loss; the model with its KV cache and optional soft-cap; then the closed-form arithmetic.
Generation, which drives the KV cache, is generate.py.

The recipe's options (mlp, qk_norm, zero_init, tie_embeddings, logit_softcap, and modded-nanogpt's
embed_norm, value_embeds, unet_skips, x0_mix, rope_truncate, attn_gate, attn_window, short_windows)
default to the article's Llama, so a checkpoint from before them computes what it trained with; the presets in
configs/ choose what the recipe ladder measured fastest (docs/PERFORMANCE.md, time to a good model).

Every fast path here has the plain PyTorch code beside it and a switch in ModelConfig:
`attention` picks the attention kernel (this file is the one place that choice is made),
`fused_loss` computes the output head and cross-entropy in chunks without keeping the logits,
`fp8` runs the MLP's matmuls in FP8 in training (`fp8_fast_accum`: their forward products and the FP8
head's with cuBLAS's fast accumulation), `bf16_residual` keeps the residual stream in bf16
in training under autocast, and `fused_swiglu`, `fused_relu2`, `fused_qk_norm_rope`, `loss_kernel` and
`fused_decode` hand SwiGLU, ReLU²'s activation, QK-norm with RoPE's backward, the training loss and a decoded
token's attention to Triton kernels, `split_decode` splits that kernel's cached positions over many
programs, `decode_matmuls` hands it the matmuls of a decode step and `decode_mlp` its ReLU² MLP, and
`decode_pdl` launches a decode step's kernels as programmatic dependents of the kernel before each.

Of the project, this file imports only onegpu_kernels.py, where those Triton kernels live.
"""

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

import onegpu_kernels as K

# How attention runs in training. "sdpa" lets PyTorch pick (cuDNN on an H100/H200 with torch 2.11);
# flash/cudnn/efficient/math pin one SDPA backend (CUDA); "textbook" writes out the T x T scores.
AttentionKind = Literal["sdpa", "flash", "cudnn", "efficient", "math", "textbook"]
MLPKind = Literal["swiglu", "relu2"]
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
# The fields that fix the weights' shapes and meaning; the rest choose kernels and may change
# between runs of the same checkpoint.
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "context",
                "tie_embeddings", "rope_theta", "norm_eps", "mlp", "qk_norm", "logit_softcap", "embed_norm",
                "value_embeds", "value_scale", "norm_gains", "unet_skips", "x0_mix", "rope_truncate", "attn_gate",
                "attn_window", "short_windows", "skip_attn_layer", "attn_scale")
# The training fast paths of ModelConfig, each a switch with its plain path beside it (fused_decode and
# decode_matmuls are generation's): switch -> the name tables give it. fast_path_applies says which a
# model can run. The fused loss has its own head and loss, so it excludes the FP8 head and the loss
# kernel; bench's ladder takes the switches in this order and skips one that a switch before it excludes,
# so it keeps those two, which the default presets (configs/recipes/record.toml) run. FP8 matmuls and the
# fused ReLU² exclude each other (each has its own MLP); FP8 comes first, as it measured faster at 88m.
# Fast accumulation changes how the FP8 matmuls compute: it follows them, and tried alone (REFINES) it runs
# with the FP8 block matmuls.
TRAINING_FAST_PATHS = {"fp8_head": "fp8 head", "loss_kernel": "loss kernel", "fused_loss": "fused loss",
                       "fused_swiglu": "fused SwiGLU", "fp8": "fp8 matmuls",
                       "fp8_fast_accum": "fp8 fast accumulation", "fused_relu2": "fused ReLU²",
                       "fused_qk_norm_rope": "fused QK-norm + RoPE", "bf16_residual": "bf16 residual"}
GENERATION_FAST_PATHS = {"fused_decode": "fused decode", "split_decode": "split decode",
                         "decode_matmuls": "decode matmuls", "decode_mlp": "decode MLP",
                         "decode_pdl": "dependent launches"}
# A training fast path that changes how another one computes -> that one, which runs beside it wherever it is
# tried alone (fast_path_alone): fast accumulation alone would leave every product in bf16.
REFINES = {"fp8_fast_accum": "fp8"}
GATE_CHANNELS = 12  # attn_gate reads this many channels of the block input (modded-nanogpt's attn_gate_dim)


@dataclass
class ModelConfig:
    d_model: int = 768  # width of the residual stream
    n_layers: int = 10  # transformer blocks
    n_heads: int = 12  # query heads
    n_kv_heads: int = 4  # key/value heads, shared by n_heads // n_kv_heads query heads (GQA)
    ffn_hidden: int = 0  # MLP width; 0 means SwiGLU's 8/3 * d_model rounded up to 256 (relu2: 1.5x that, same params)
    vocab_size: int = 32768  # 2**15; at most 2**16 = 65,536, what a uint16 token shard holds
    context: int = 1024  # longest sequence the model attends over
    tie_embeddings: bool = True  # output head shares the token-embedding matrix
    rope_theta: float = 10000.0  # RoPE base (Su et al. 2021; Llama 2 uses 10,000)
    norm_eps: float = 1e-5  # RMSNorm epsilon (Llama 2's value)
    # The recipe: each default is the article's (Llama 2's) choice; the presets pick the measured winners.
    mlp: MLPKind = "swiglu"  # swiglu: (silu(x W1) * x W3) W2; relu2: relu(x W1)^2 W2 (Primer, So et al. 2021)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (as Qwen3 and modded-nanogpt)
    zero_init: bool = False  # attention and MLP output projections start at zero (each block starts as identity)
    logit_softcap: float = 0.0  # logits = c * tanh(logits / c) (Gemma 2, modded-nanogpt); 0 turns it off
    # modded-nanogpt's architecture (its train_gpt.py at the record-#28 commit 9d9dc969 and its records/
    # READMEs); each is off by default and on in the presets that measured it to pay:
    embed_norm: bool = False  # RMSNorm without gain on the token embedding (modded record #8)
    value_embeds: int = 0  # k token tables mixed into the values of the first k and the last k layers (record #14)
    value_scale: bool = False  # and every other attention layer's values times a learned scalar from 0.5 (modded's)
    norm_gains: bool = True  # False: every RMSNorm without a learned gain, as modded's norm(x)
    unet_skips: bool = False  # block L-1-i adds a learned multiple of block i's output, i < L/2 (record #9)
    x0_mix: bool = False  # each block's input is a*x + b*x0, x0 the (normed) embedding, a=1 b=0 learned (record #11)
    rope_truncate: bool = False  # RoPE on the first quarter of frequencies only (1 to 1/1024); the rest unrotated
    attn_gate: bool = False  # each head's output times sigmoid(a gate of the block input's first 12 channels)
    attn_window: int = 0  # sliding-window attention: a query sees itself and the attn_window - 1 keys before it (0: all)
    short_windows: bool = False  # half the window on all layers but every fourth and the last (record #28's long-short)
    skip_attn_layer: int = -1  # this layer has no attention, only its MLP (record #28: layer 7 of 12); -1: none
    attn_scale: float = 0.0  # the attention logits' scale; 0: 1/sqrt(head_dim) (modded-nanogpt's: 0.12 at head 128)
    attention: AttentionKind = "sdpa"  # attention kernel in training
    # Fast paths: each computes what its plain path does (within rounding) and is off here, so that a
    # config that does not name it, and a checkpoint from before it existed, runs the plain path; the
    # presets in configs/ turn on the ones measured to pay (docs/PERFORMANCE.md, training speed).
    fused_loss: bool = False  # head + cross-entropy in chunks, never holding all logits (less memory)
    fp8: bool = False  # the MLP's matmuls' forward and input gradients in FP8 (e4m3, a scale a row), in training
    fp8_head: bool = False  # the untied output head's training matmuls in FP8, its gradient at a fixed scale
    fp8_fast_accum: bool = False  # with fp8 / fp8_head: their forward products with cuBLAS's fast accumulation
    fused_decode: bool = False  # a new token's RoPE, cache write and attention in one Triton kernel (CUDA)
    split_decode: bool = False  # with fused_decode, each head's cached positions over many programs (CUDA)
    decode_matmuls: bool = False  # generation's matmuls of at most 16 tokens as Triton's small_matmul (CUDA)
    decode_mlp: bool = False  # generation's ReLU² MLP of at most 16 tokens as one Triton kernel (CUDA)
    decode_pdl: bool = False  # generation's kernels launched while the one before them runs (Hopper and newer)
    bf16_residual: bool = False  # with --bf16, the residual stream in bf16 too, not float32 (training)
    fused_swiglu: bool = False  # SwiGLU forward and backward as one Triton kernel each (CUDA, training)
    fused_relu2: bool = False  # ReLU²'s square and its derivative in its matmuls' epilogues (CUDA, training)
    fused_qk_norm_rope: bool = False  # QK-norm and RoPE's backward as one Triton kernel (CUDA, training)
    loss_kernel: bool = False  # the (soft-capped) cross-entropy as one Triton kernel each way (CUDA, training)

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size > 2**16:  # onegpu's corpora are uint16 shards (data.py): a larger id would wrap
            raise ValueError(f"model.vocab_size={self.vocab_size} is more than 65,536, the most a uint16 token shard "
                             f"holds: pick a vocabulary of at most 65,536 (2**15 = 32,768 is the presets')")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                f"pick n_heads that divides d_model (head size 64 means n_heads = d_model / 64)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}: "
                f"each kv head serves a whole group of query heads, so pick a divisor of n_heads")
        if self.head_dim % 2:
            raise ValueError(
                f"head size d_model/n_heads = {self.head_dim} is odd, but RoPE rotates pairs of "
                f"dimensions: change model.d_model or model.n_heads so that the head size is even")
        if self.ffn_hidden < 0:
            raise ValueError(f"model.ffn_hidden must be >= 0 (0 means automatic), got {self.ffn_hidden}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"model.rope_theta ({self.rope_theta}) and model.norm_eps ({self.norm_eps}) "
                             f"must be positive")
        if self.attention not in SDPA_BACKENDS and self.attention not in ("sdpa", "textbook"):
            raise ValueError(f"model.attention={self.attention!r}: choose sdpa, textbook or one of "
                             f"{list(SDPA_BACKENDS)}")
        if self.logit_softcap < 0:
            raise ValueError(f"model.logit_softcap must be >= 0 (0 turns it off), got {self.logit_softcap}")
        if not 0 <= self.value_embeds <= self.n_layers // 2:
            raise ValueError(f"model.value_embeds={self.value_embeds} is out of range: the first and the last "
                             f"value_embeds layers each take one table, so it must be in [0, n_layers/2 = "
                             f"{self.n_layers // 2}]")
        if self.attn_gate and self.d_model < GATE_CHANNELS:
            raise ValueError(f"model.attn_gate reads {GATE_CHANNELS} channels, more than d_model={self.d_model}: "
                             f"use --no-attn-gate or a wider model")
        if self.attn_scale < 0:
            raise ValueError(f"model.attn_scale must be >= 0 (0: 1/sqrt(head size)), got {self.attn_scale}")
        if self.attn_window < 0:
            raise ValueError(f"model.attn_window must be >= 0 (0: attend over the whole context), got "
                             f"{self.attn_window}")
        if self.short_windows and not self.windowed:
            raise ValueError(f"model.short_windows halves model.attn_window on most layers, but attn_window="
                             f"{self.attn_window} hides nothing in a context of {self.context}: set attn_window "
                             f"below the context, or --no-short-windows")
        if self.skip_attn_layer != -1 and not 0 < self.skip_attn_layer < self.n_layers:
            raise ValueError(f"model.skip_attn_layer={self.skip_attn_layer} is not a layer after the first of "
                             f"{self.n_layers}: pick one in [1, {self.n_layers - 1}] (modded-nanogpt: 7 of 12), or -1 for none")
        if self.skip_attn_layer != -1 and self.value_table(self.skip_attn_layer) is not None:
            raise ValueError(f"model.skip_attn_layer={self.skip_attn_layer} is a layer that mixes a value embedding "
                             f"into its attention (model.value_embeds={self.value_embeds}): pick a middle layer")
        if self.fp8_head and not fast_path_applies("fp8_head", self):
            raise ValueError("model.fp8_head runs the untied head's matmul in FP8: it needs --no-tie-embeddings and "
                             "--no-fused-loss (the fused loss has its own head), or use --no-fp8-head")
        if self.mlp not in ("swiglu", "relu2"):
            raise ValueError(f"model.mlp={self.mlp!r}: choose swiglu or relu2")
        if self.ffn_hidden == 0:
            # relu2 has two matrices to SwiGLU's three: 1.5x the width holds the same parameters
            self.ffn_hidden = swiglu_hidden(self.d_model) * (3 if self.mlp == "relu2" else 2) // 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def windowed(self) -> bool:
        """Whether the sliding window ever hides a key the causal mask would show."""
        return 0 < self.attn_window < self.context

    def short_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends over the short window: with short_windows, all layers but every
        fourth counted from either end, as the U-net mirrors them. modded-nanogpt's record #28 alternates
        long and short windows this way (long on layers 0, 4, 7 and 11 of 12, its layer 7 without attention),
        after Gemma 2: a few long layers carry the far context, the rest look nearby at half the cost."""
        return self.short_windows and min(layer, self.n_layers - 1 - layer) % 4 != 0

    def attends(self, layer: int) -> bool:
        """Whether layer `layer` has attention (all but skip_attn_layer)."""
        return layer != self.skip_attn_layer

    def windows(self, window: int | None = None) -> tuple[int, int]:
        """(long, short): the windows of the long and the short layers when the long ones see `window`
        keys (None: attn_window; 0: no window). short is half of long, or 0 without short_windows."""
        window = self.attn_window if window is None else window
        return window, (max(1, window // 2) if self.short_windows and window else 0)

    def value_table(self, layer: int) -> int | None:
        """The value-embedding table layer `layer` mixes in, or None: tables 0..k-1 serve the first k
        layers and again the last k (modded-nanogpt's "012 ... 012" layout)."""
        k = self.value_embeds
        if layer < k:
            return layer
        if layer >= self.n_layers - k:
            return layer - (self.n_layers - k)
        return None


def for_device(cfg: ModelConfig, device: torch.device) -> tuple[ModelConfig, str]:
    """(cfg for a model that will train on `device`, why it differs: "" where it does not). On a GPU
    Triton cannot run (older than Ampere) the Triton fast paths are off, and the FP8 matmuls wherever
    there are no FP8 units, where the plain paths compute the same functions in bf16. FP8 tensor cores
    came with compute capability 8.9 (Ada, then Hopper), so an A100 or an RTX 3090 trains the default
    presets with the plain head. A CPU has none either: torch._scaled_mm emulates them there, and one
    step of the tiny model with an FP8 head at 2,048 tokens took 176 s against 8 s without (2 cores,
    torch 2.13). On CPU the Triton paths pick the plain path themselves; the decode kernel asks the same
    question per cache (KVCache.fusable)."""
    whys = []
    if device.type == "cuda" and not K.device_supported(device):
        cfg = replace(cfg, fused_swiglu=False, loss_kernel=False, fused_relu2=False, fused_qk_norm_rope=False)
        whys.append("its Triton kernels need a GPU of compute capability 8.0 (Ampere) or newer")
    if (cfg.fp8 or cfg.fp8_head) and not fp8_units(device):
        cfg = replace(cfg, fp8=False, fp8_head=False, fp8_fast_accum=False)
        whys.append("a CPU has no FP8 matmul units (emulated, about 20x slower)" if device.type == "cpu" else
                    "FP8 matmuls need a GPU of compute capability 8.9 (Ada, Hopper) or newer")
    return cfg, "; ".join(whys)


def fp8_units(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores: an NVIDIA GPU of compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fast_path_applies(name: str, cfg: "ModelConfig") -> bool:
    """Whether fast path `name` runs for cfg's architecture (a GPU that has it aside): the fused
    SwiGLU for the SwiGLU MLP alone, the fused ReLU² for the ReLU² MLP outside FP8 block matmuls (each has
    its own matmuls; with both set the FP8 ones run, as ReLU2 picks), the fused loss (its own head and loss)
    outside the FP8 head and the loss kernel, those two outside the fused loss (the FP8 head for an untied
    head), FP8 fast accumulation beside an FP8 path, the fused QK-norm + RoPE for a model with QK-norm; the
    fused decode for every model (its kernel reads a sliding window's keys alone), and its split only with
    it; the decode MLP for the ReLU² MLP (FP8 matmuls run in training alone)."""
    if name == "split_decode":
        return cfg.fused_decode
    if name == "decode_mlp":
        return cfg.mlp == "relu2"
    if name == "fused_swiglu":
        return cfg.mlp == "swiglu"
    if name == "fused_relu2":
        return cfg.mlp == "relu2" and not cfg.fp8
    if name == "fused_qk_norm_rope":
        return cfg.qk_norm
    if name == "fused_loss":
        return not cfg.fp8_head and not cfg.loss_kernel
    if name == "loss_kernel":
        return not cfg.fused_loss
    if name == "fp8_head":
        return not cfg.tie_embeddings and not cfg.fused_loss
    if name == "fp8_fast_accum":
        return cfg.fp8 or cfg.fp8_head
    return True


def fast_path_alone(name: str) -> dict[str, bool]:
    """The switches that try training fast path `name` alone: it, and the path it refines (REFINES)."""
    return {name: True, **({REFINES[name]: True} if name in REFINES else {})}


def runnable_fast_paths(cfg: "ModelConfig") -> list[str]:
    """The training fast paths cfg's architecture can run, each tried alone (fast_path_alone, the others
    off): what bench's ladder and kernels study and the loss curves give a rung."""
    plain = replace(cfg, **dict.fromkeys(TRAINING_FAST_PATHS, False))
    # a refinement is asked with the path it refines on; none turns itself on (fp8_head raises on a tied head)
    return [s for s in TRAINING_FAST_PATHS
            if fast_path_applies(s, replace(plain, **{REFINES[s]: True}) if s in REFINES else plain)]


def swiglu_hidden(d: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4d (three matrices cost what two of width 4d do), rounded up."""
    hidden = int(8 * d / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


# --- Layers --------------------------------------------------------------------------------

def rms_norm(x, eps: float):
    """x / rms(x) without a gain, in at least float32 (RMSNorm; embed_norm alone: modded-nanogpt's norm(x))."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class RMSNorm(nn.Module):
    """x / rms(x) * g (Zhang & Sennrich 2019): no mean, no bias. Computed in at least float32.
    gain False (ModelConfig.norm_gains): g stays ones, a buffer no optimizer steps, as modded-nanogpt's
    norm(x); the fused kernels and export read it as they read a learned gain."""

    def __init__(self, dim: int, eps: float, gain: bool = True):
        super().__init__()
        self.eps = eps
        if gain:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_buffer("weight", torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.eps) * self.weight


def rope_tables(head_dim: int, length: int, theta: float, truncate: bool = False):
    """cos and sin, each (length, head_dim), in the "rotate half" layout HuggingFace Llama uses,
    so exported q/k weights need no permutation. Frequencies from Su et al. (2021).

    truncate: modded-nanogpt's half-truncated RoPE. The first head_dim/4 frequencies run from 1 down to
    1/1024 radians per token (a base tuned there in place of theta), the other head_dim/4 are zero:
    those dimensions are not rotated at all and can match keys by content at any distance."""
    # Computed on the CPU in float64 whatever the default device: exact, and cheap on "meta".
    if truncate:
        rotated = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float64, device="cpu")
        inv_freq = torch.cat([rotated, torch.zeros(head_dim // 2 - head_dim // 4, dtype=torch.float64, device="cpu")])
    else:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), inv_freq)  # (length, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (B, T, heads, head_dim), the QKV projection's own layout; cos, sin: (T, head_dim).
    Rotates pairs (i, i + head_dim/2). Applied before q and k are transposed for attention: in
    this layout each token's heads are contiguous, so the compiled forward and backward are one
    coalesced pass over the projection's output (on (B, heads, T, hd) views they were strided)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def textbook_attention(q, k, v, mask=None, scale: float | None = None):
    """Attention written out: full scores, a boolean mask, softmax in float32, K/V copied per
    query head. The reference the fused kernels are measured against. mask: (Tq, Tk) or None
    for causal; scale: the scores' (None: 1/sqrt(head size), as SDPA's)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    Tq, Tk = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


# FlexAttention's kernel options in training (torch.nn.attention.flex_attention.FlexKernelOptions): none, so
# Inductor's heuristics pick its tiles. `python bench.py --attention-rate` times the candidates in
# bench.FLEX_CANDIDATES at the preset's shape; one that pays goes here.
FLEX_OPTIONS: dict = {}


def attention(q, k, v, kind: str = "sdpa", *, doc_ids=None, block_mask=None, window: int = 0,
              scale: float | None = None, kernel_options: dict | None = None):
    """Causal attention in training and evaluation (Tq == Tk): the one place the kernel is chosen.

    q: (B, H, T, hd); k, v: (B, Hkv, T, hd) with H a multiple of Hkv (grouped-query heads are
    passed natively: no copies of K/V). doc_ids: (B, T) document index per token, to keep packed
    documents from attending into each other. window: a query sees at most this many keys, itself
    included (0: all before it). block_mask: FlexAttention's mask for doc_ids and window, built
    once per micro-batch on CUDA (see mask_inputs); without it they become a boolean mask.
    scale: the scores' scale (None: 1/sqrt(hd)). kernel_options: FlexAttention's (None: FLEX_OPTIONS)."""
    if block_mask is not None:
        options = FLEX_OPTIONS if kernel_options is None else kernel_options
        return flex_attention_compiled()(q, k, v, block_mask=block_mask, enable_gqa=True, scale=scale,
                                         kernel_options=options or None)
    if doc_ids is not None or window:
        mask = doc_mask(doc_ids, window, q.shape[2], q.device)[:, None]  # (B or 1, 1, T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    if kind == "textbook":
        return textbook_attention(q, k, v, scale=scale)
    if kind in SDPA_BACKENDS and q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # Entered here, inside the model, so that torch.compile traces the backend choice too.
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[kind])):
            if kind == "efficient":  # this kernel refuses enable_gqa: give it K/V per query head
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)


def cached_attention(q, k, v, mask, scale: float | None = None):
    """Attention of Tq new tokens over the cache. q: (B, H, Tq, hd); k, v: (B, Hkv, S, hd) with S
    the cache positions read; mask: (Tq, S) booleans, True where a query may look.

    The G = H / Hkv query heads that share a kv head are folded into the query axis,
    (B, Hkv, G * Tq, hd), so grouped-query attention needs no copies of K/V. On CUDA this is two
    matmuls and a softmax (decode_attention_matmuls); elsewhere one masked SDPA call, which is
    fewer operations for the CPU to dispatch. (With fused_decode a single new token skips all of
    this: Attention.forward hands it to onegpu_kernels.decode_step.)"""
    B, H, Tq, hd = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    q = q.reshape(B, Hkv, G * Tq, hd)
    if Tq > 1:  # one decoded token's (1, S) mask broadcasts over the G folded rows as it is
        mask = mask.repeat(G, 1)
    if q.is_cuda:
        y = decode_attention_matmuls(q, k, v, mask, scale)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return y.reshape(B, H, Tq, hd)


def decode_attention_matmuls(q, k, v, mask, scale: float | None = None):
    """softmax(q k^T * scale, masked) v for a few queries (scale None: 1/sqrt(hd)). With a handful of queries a fused
    attention kernel runs one thread block per (batch, kv head) down all the keys; a matmul
    spreads the keys over the whole GPU (the decode step is latency-bound, not FLOP-bound)."""
    scores = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def doc_mask(doc_ids, window: int = 0, T: int | None = None, device=None):
    """(B, T) document ids (or None) -> (B, T, T) boolean, (1, T, T) without ids: query i may see
    key j iff j <= i, both in the same document, and i - j < window (when window > 0)."""
    T = doc_ids.shape[1] if doc_ids is not None else T
    i = torch.arange(T, device=doc_ids.device if doc_ids is not None else device)
    allowed = i[:, None] >= i[None, :]
    if window:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    if doc_ids is None:
        return allowed[None]
    return (doc_ids[:, :, None] == doc_ids[:, None, :]) & allowed


def mask_inputs(seq_len: int, device: torch.device, doc_ids=None, windows: tuple[int, int] = (0, 0)) -> dict:
    """The model's keyword arguments for attention within documents (doc_ids (B, T), or None) and
    within sliding windows: windows is (long, short), ModelConfig.windows at this step (0: none).
    FlexAttention's block masks on a GPU Triton runs on (Ampere and newer), built once per micro-batch
    outside any compiled model, so blocks wholly outside the documents and the window cost nothing; the
    boolean masks elsewhere (a CPU, or a Turing card, where FlexAttention has no kernel).
    {} when neither applies: plain causal attention, the fastest kernel."""
    long, short = (w if 0 < w < seq_len else 0 for w in windows)  # a window as long as the sequence hides nothing
    if doc_ids is None and not long and not short:
        return {}
    if device.type == "cuda" and K.device_supported(device):
        masks = {"block_mask": flex_block_mask(doc_ids, long, seq_len, device)}
        if short:
            masks["short_block_mask"] = flex_block_mask(doc_ids, short, seq_len, device)
        return masks
    return {"doc_ids": doc_ids, "attn_window": long} | ({"short_window": short} if short else {})


_flex = None


def flex_attention_compiled():
    # FlexAttention only becomes a fused kernel when compiled; compile it once per process.
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


FLEX_BLOCK = 128  # FlexAttention's block of queries and of keys (its default)


def flex_block_mask(doc_ids, window: int, T: int, device):
    """FlexAttention block mask for causal attention within documents (doc_ids: (B, T) on CUDA, or
    None) and within `window` keys (0: no window)."""
    from torch.nn.attention.flex_attention import create_block_mask
    # The window is a tensor, not a Python int, so that the compiled kernel reads it instead of
    # specialising on it: the window schedule then changes it without a recompile. Filled on the
    # device: torch.tensor(window, device=...) would copy it from pageable memory, which waits for the
    # GPU to finish its queue, twice every micro-batch (tests/test_gpu.py checks that nothing here waits).
    reach = torch.full((), window or T, device=device)

    def causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < reach)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx, kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    mask_mod = causal if doc_ids is None else same_doc_causal
    if T % FLEX_BLOCK == 0:
        return block_mask_from_documents(doc_ids, window or T, T, mask_mod, device)
    # _compile: the mask is evaluated block by block in one compiled kernel, where the eager path
    # materialises all B x T x T booleans (268M for 4 sequences of 8,192 tokens) every micro-batch.
    return create_block_mask(mask_mod, None if doc_ids is None else doc_ids.shape[0], None, T, T, device=device,
                             _compile=True)


def block_mask_from_documents(doc_ids, reach: int, T: int, mask_mod, device):
    """flex_block_mask's BlockMask from each block's first and last document and the blocks' distance,
    for T a multiple of FLEX_BLOCK: (B, T/128, T/128) comparisons, where create_block_mask evaluates the
    mask at all B x T x T pairs (3.5 ms a step at 88m on an H200, 2 x 2 masks of 16 x 8,192 tokens,
    docs/PERFORMANCE.md "Where the time goes"). Exact, because documents are runs of equal, rising ids
    (data.ShardLoader numbers them by a cumulative sum): kv block j before query block i holds a pair of
    one document within reach iff its last id equals block i's first id and their nearest tokens are
    within reach; every pair is allowed iff both blocks lie in one document and their farthest tokens
    are within reach. tests/test_model.py checks it against create_block_mask."""
    from torch.nn.attention.flex_attention import BlockMask
    n, S = T // FLEX_BLOCK, FLEX_BLOCK
    i = torch.arange(n, device=device)[:, None]  # query block
    j = torch.arange(n, device=device)[None, :]  # key block
    some = (j <= i) & ((i - j) * S - (S - 1) < reach)  # (n, n): the nearest pair is causal and within reach
    every = (j < i) & ((i - j) * S + (S - 1) < reach)  # the farthest pair is
    if doc_ids is None:
        some, every = some[None], every[None]  # (1, n, n)
    else:
        blocks = doc_ids.reshape(doc_ids.shape[0], n, S)
        first, last = blocks[..., 0], blocks[..., -1]  # (B, n)
        some = some & (last[:, None, :] >= first[:, :, None])  # (B, n, n); for j < i, last_j <= first_i anyway
        # query block i in one document, which key block j (before it) starts in: then j lies in it too
        every = every & (first == last)[:, :, None] & (first[:, :, None] == first[:, None, :])
    partial = some & ~every

    def ordered(dense):  # (B, n, n) booleans -> each row's count and its blocks' indices first, rising
        count = dense.sum(-1, dtype=torch.int32)
        return count[:, None], torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(every), BLOCK_SIZE=S, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


# --- FP8 matmuls --------------------------------------------------------------------------
# Hopper's tensor cores multiply FP8 at twice the BF16 rate. Each operand is scaled so its largest
# magnitude lands at the top of the FP8 range, cast, multiplied with torch._scaled_mm, and the product
# unscaled. Master weights, optimizer state and everything outside these matmuls stay as they were.
#
# The MLP's matmuls (fp8, training only; the attention's too with FP8_ATTENTION) run two of their three
# products in FP8: the forward and the input gradient, whose operands are both contiguous along the inner
# side as they lie (the weight's transpose is a copy of a small matrix). The weight gradient multiplies over
# the tokens, which Hopper's FP8 matmul wants contiguous in both operands: two transposed copies of (tokens,
# width) tensors, which cost about what FP8 saves there, so it stays in bf16. Every operand, gradients
# included, is e4m3 with one scale a row (a token's, or a weight's output unit), so the kernel that writes a
# row can find its maximum and cast it in the same pass; whole-tensor scales needed a reduction over the
# tensor first, and the block matmuls that ran all three products so measured 3% slower than bf16 at 88m
# (docs/LOG.md, 2026-11-30). With the MLP's in FP8 the 88m defaults ran 1.8 to 3.6% faster on an H200, and
# 126m's 4.1%, with validation losses after 150 steps inside two seeds' spread of bf16's at both shapes: on in
# configs/88m.toml and configs/126m.toml (docs/PERFORMANCE.md, "Training speed").
#
# The output head (fp8_head) is the largest matmul of a small model, and its gradient the largest
# tensor: (tokens, vocab), 2 GiB in bf16 for 32,768 tokens of a 32,768 vocabulary. It scales x and w
# by their whole maxima (e4m3) and its gradient by a bound known in advance (e5m2), as modded-nanogpt's FP8
# head does with its fixed grad_s: the gradient of a mean cross-entropy over n tokens with respect to one
# logit, (softmax - one-hot) / n (a soft-cap's slope is at most 1), lies within 1/n, so it is never read
# for its maximum. fp8_linear's head runs its forward and input gradient in FP8 and its weight gradient in
# the output dtype; the head with the loss kernel (FP8HeadCrossEntropy) runs its weight gradient in FP8 too
# (FP8_HEAD_WEIGHT_GRAD).
#
# With fp8_fast_accum the forward products (the MLP's two and the head's) use cuBLAS's fast accumulation: the
# tensor cores' partial sums stay in their own precision along K, where by default cuBLAS promotes them to
# float32 at intervals. modded-nanogpt's FP8 head and torchao's float8 training accumulate their forward
# products so; the gradients keep the promotion here as there. At 131,072 tokens of the 88m shapes on one H100
# it took the up-projection from 0.644 to 0.573 ms, the down-projection from 0.509 to 0.428 and the head from
# 7.39 to 6.68; the 88m defaults ran 1.7% faster on another H100 (`python bench.py --plan
# configs/plans/fast-accum-88m-mb16.toml --repeats 2`) with a loss no worse after 150 steps, two seeds a side
# (docs/PERFORMANCE.md, "Training speed", 2026-12-05).

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The attention's two matmuls in FP8 too with fp8 (FP8Rows). Off: the 88m defaults with fp8 ran 907,429 tok/s
# without them and 890,229 with them, one after the other on an H200 (docs/LOG.md, 2026-12-04). Their four FP8
# products save about 0.55 ms a layer pass at 131,072 tokens, and the casts Inductor writes for them cost
# more: the (tokens, 2,304) QKV gradient, for one, is cast in two passes over memory (its rows' maxima, then
# the cast).
FP8_ATTENTION = False


def to_fp8_rows(t):
    """(t (N, K) in e4m3, each row scaled so its largest magnitude is e4m3's largest value, the (N, 1)
    float32 inverse scales). onegpu_kernels.relu2_fp8 and relu2_fp8_backward cast their rows so too."""
    top = torch.finfo(E4M3).max
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    return (t.float() * (top / amax)).clamp(-top, top).to(E4M3), amax / top


def to_fp8_cols(weight):
    """to_fp8_rows of weight (O, K) transposed: its K columns scaled each, for an input gradient's matmul."""
    return to_fp8_rows(weight.t().contiguous())


def rows_matmul(a, b, fast_accum: bool = False):
    """a @ b.T for a (N, K) and b (O, K) given as to_fp8_rows casts (a8, sa), (b8, sb): (N, O) in bf16.
    fast_accum: cuBLAS's fast accumulation (ModelConfig.fp8_fast_accum, for forward products)."""
    (a8, sa), (b8, sb) = a, b
    return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def to_fp8(t, dtype):
    """(t cast to dtype after scaling its absolute maximum to dtype's largest value, 1 / scale)."""
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), scale.reciprocal()


def to_fp8_within(t, dtype, bound: float):
    """to_fp8 for a tensor known to lie within +-bound: scaled by that bound, not by its maximum."""
    top = torch.finfo(dtype).max
    scale = torch.full((), bound / top, device=t.device, dtype=torch.float32)
    return (t.float() * (top / bound)).clamp(-top, top).to(dtype), scale


def matmul_dtype(x):
    """The dtype a fast path's matmuls run in: autocast's inside autocast, x's outside it. Asked before
    the fast path turns autocast off for its own casts."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def fp8_matmul(x, weight, out_dtype, fast_accum: bool = False):
    """x @ weight.T with both operands in e4m3, each scaled by its maximum, a forward product (fast_accum: see
    rows_matmul).
    x: (N, d_in); weight: (d_out, d_in). Returns (the product in out_dtype, x8, sx, w8, sw): the casts and
    their inverse scales, which a backward reuses."""
    x8, sx = to_fp8(x, E4M3)
    w8, sw = to_fp8(weight, E4M3)
    y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return y, x8, sx, w8, sw


class FP8Matmul(torch.autograd.Function):
    """The FP8 head's matmul (fp8_linear with a grad_bound): forward and input gradient in FP8, the
    gradient scaled by grad_bound; the weight gradient in the output dtype."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype, grad_bound, fast_accum):
        y, x8, sx, w8, sw = fp8_matmul(x, weight, out_dtype, fast_accum)
        ctx.save_for_backward(x.to(out_dtype), sw, w8)
        ctx.dtypes, ctx.grad_bound = (x.dtype, weight.dtype), grad_bound
        return y

    @staticmethod
    def backward(ctx, grad):
        x_saved, sw, w8 = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, sg = to_fp8_within(grad, E5M2, ctx.grad_bound)  # grad: (N, vocab)
        # w8 (vocab, d) column-major, as FP8HeadCrossEntropy's backward makes it (TRANSPOSE_KERNEL)
        grad_x = torch._scaled_mm(g8, transposed(w8, TRANSPOSE_KERNEL).t(), scale_a=sg, scale_b=sw, out_dtype=x_dtype)
        # The weight gradient multiplies over the tokens, and Hopper's FP8 matmul wants that axis contiguous
        # in both operands: the (tokens, vocab) gradient transposed, a copy of the largest tensor, which
        # Inductor fused into the loss kernel at three times its time (one H200, docs/LOG.md). In the output
        # dtype the gradient is read as it lies.
        return grad_x, (grad.t() @ x_saved).to(w_dtype), None, None, None


class FP8Rows(torch.autograd.Function):
    """x @ weight.T for fp8's matmuls outside FP8ReLU2MLP (the SwiGLU MLP's; the attention's with FP8_ATTENTION):
    forward and input gradient in FP8 (to_fp8_rows), the weight gradient in bf16. x: (N, d_in) bf16; weight:
    (d_out, d_in), the master weight."""

    @staticmethod
    def forward(ctx, x, weight, fast_accum):
        ctx.save_for_backward(x, weight)
        return rows_matmul(to_fp8_rows(x), to_fp8_rows(weight), fast_accum)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_x = rows_matmul(to_fp8_rows(grad), to_fp8_cols(weight))
        return grad_x, (grad.t() @ x).to(weight.dtype), None


def fp8_linear(x, weight, grad_bound: float | None = None, fast_accum: bool = False):
    """F.linear(x, weight) with FP8 operands. x: (..., d_in); weight: (d_out, d_in). grad_bound: where the
    output's gradient is known to lie within +-grad_bound (the head: FP8Matmul, the output in autocast's
    dtype inside autocast, x's outside it); None: a block matmul (FP8Rows, the output in bf16). fast_accum:
    the forward product with fast accumulation (ModelConfig.fp8_fast_accum)."""
    dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        flat = x.reshape(-1, x.shape[-1])
        y = FP8Rows.apply(flat.to(torch.bfloat16), weight, fast_accum) if grad_bound is None else \
            FP8Matmul.apply(flat, weight, dtype, grad_bound, fast_accum)
    return y.view(*x.shape[:-1], weight.shape[0])


# The FP8 head's weight gradient, (vocab, d) = dz.T @ x over the tokens, in FP8 too (as modded-nanogpt's head):
# the loss kernel then writes the logits' gradient once, in e5m2 (1 byte a logit, where its bf16 copy took 2), and
# the matmul takes it transposed (torch._scaled_mm wants the tokens contiguous in both operands), a copy of 1 byte a
# logit. False: the gradient in bf16 as well, and a bf16 matmul. The head and loss of 131,072 tokens at 88m took
# 27.27 ms forward and backward against 30.38 on an H200 (`python bench.py --loss --preset 88m --micro-batch 16`,
# docs/PERFORMANCE.md, "Training speed").
FP8_HEAD_WEIGHT_GRAD = True
# That transposed copy, and the head's operands' column-major copies for its backward, by onegpu_kernels.transposed,
# a kernel of 32-bit words, where True; False: t.t().contiguous(), the reference. The head and loss of 131,072
# tokens at 88m, forward and backward, took 26.37 ms with the kernel against 26.71 with Inductor's copy on an H200
# (`python bench.py --loss --preset 88m --micro-batch 16`, 2026-12-04, after its GPU tests passed; docs/LOG.md).
TRANSPOSE_KERNEL = True


def transposed(t, kernel: bool):
    """t (R, C) transposed and contiguous, (C, R): by onegpu_kernels.transposed where kernel and it handles t
    (one-byte elements where Triton runs), otherwise t.t().contiguous(), its plain twin."""
    return K.transposed(t) if kernel and K.transposed_supported(t) else t.t().contiguous()


class FP8HeadCrossEntropy(torch.autograd.Function):
    """The FP8 head and the loss kernel as one function: FP8Matmul's forward, then
    onegpu_kernels.cross_entropy_and_gradient, which writes the logits' gradient in the forward, in the same
    launch as the loss: in e5m2, scaled by the bound 1/n, for the input gradient and, with fp8_weight_grad, the
    weight gradient; without, also in the logits' dtype for a weight gradient in that dtype. The backward is
    two matmuls, whose products it scales by the incoming gradient (a scalar: the step's 1 / accumulation),
    where a loss kernel of its own would have read the logits again. The model runs it where fp8_head and
    loss_kernel are both on."""

    @staticmethod
    def forward(ctx, x, weight, targets, cap, out_dtype, fp8_weight_grad, transpose_kernel, fast_accum):
        logits, x8, sx, w8, sw = fp8_matmul(x, weight, out_dtype, fast_accum)  # x: (N, d); weight: (vocab, d)
        # Each logit's gradient of the mean loss lies within 1 / n, so e5m2 holds it scaled by top * n,
        # never read for its maximum (as FP8Matmul's head).
        n, top = targets.numel(), torch.finfo(E5M2).max
        loss, dz, dz8 = K.cross_entropy_and_gradient(logits, targets, cap, top * n, fp8_only=fp8_weight_grad)
        ctx.save_for_backward(x8 if fp8_weight_grad else x.to(out_dtype), sx, w8, sw, dz, dz8)
        ctx.scale, ctx.dtypes, ctx.fp8_weight_grad = top * n, (x.dtype, weight.dtype), fp8_weight_grad
        ctx.transpose_kernel = transpose_kernel
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        x_saved, sx, w8, sw, dz, dz8 = ctx.saved_tensors
        sg = grad.float() / ctx.scale  # dz8's inverse scale, times the incoming gradient
        # w8 (vocab, d) and x8 (N, d) column-major: views of their transposed copies, made by the same kernel
        # (where transpose_kernel). As strided copies, t.t().contiguous().t(), they ran as PyTorch's
        # element-at-a-time FP8 copy, 1.67 ms of the 88m profile step (docs/PERFORMANCE.md, "Where the time
        # goes", 2026-12-05).
        kernel = ctx.transpose_kernel
        grad_x = torch._scaled_mm(dz8, transposed(w8, kernel).t(), scale_a=sg, scale_b=sw, out_dtype=ctx.dtypes[0])
        if ctx.fp8_weight_grad:  # dz8.T: (vocab, N) row-major; x8: (N, d) column-major
            grad_w = torch._scaled_mm(transposed(dz8, kernel), transposed(x_saved, kernel).t(), scale_a=sg,
                                      scale_b=sx, out_dtype=ctx.dtypes[1])
        else:
            grad_w = (dz.t() @ x_saved).to(ctx.dtypes[1]) * grad
        return grad_x, grad_w, None, None, None, None, None, None


def fp8_head_cross_entropy(x, weight, targets, cap: float, fp8_weight_grad: bool = FP8_HEAD_WEIGHT_GRAD,
                           transpose_kernel: bool | None = None, fast_accum: bool = False):
    """cross_entropy(fp8_linear(x, weight, 1 / n), targets, cap, kernel=True), its gradient written in the
    forward (FP8HeadCrossEntropy): for training, where a backward follows. x: (N, d); weight: (vocab, d);
    targets: (N,). fp8_weight_grad: the weight gradient's matmul in FP8 too, its operand transposed by
    `transposed` (transpose_kernel: our kernel, or the plain copy; None: TRANSPOSE_KERNEL). fast_accum: the forward
    product with fast accumulation (ModelConfig.fp8_fast_accum). Where K.runs_on(x)."""
    transpose_kernel = TRANSPOSE_KERNEL if transpose_kernel is None else transpose_kernel
    dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return FP8HeadCrossEntropy.apply(x, weight, targets, cap, dtype, fp8_weight_grad, transpose_kernel,
                                         fast_accum)


def linear(x, weight, small: bool = False, relu2: bool = False):
    """F.linear without a bias (relu2: then relu(.)^2, the ReLU² MLP's activation). With small (generation
    on a GPU with decode_matmuls: Llama.setup_cache), a decode step's product, one new token for each of
    at most 16 sequences (x: (B, 1, d)), runs as onegpu_kernels.small_matmul, the square in its epilogue, tested
    against these lines. Not the prompt's: its kernel is autotuned per shape, once, and the compiled decode
    step's warm-up is where that costs nothing a user waits for."""
    one_token = x.dim() == 3 and x.shape[1] == 1
    if small and one_token and not torch.is_grad_enabled() and K.small_matmul_supported(x, weight):
        return K.small_matmul(x, weight, relu2)
    y = F.linear(x, weight)
    return F.relu(y).square() if relu2 else y


class Linear(nn.Linear):
    """A bias-free nn.Linear whose matmul runs in FP8 in training when fp8 is set (ModelConfig.fp8:
    fp8_linear, its forward product with fast accumulation where fast_accum: ModelConfig.fp8_fast_accum); the
    plain F.linear is the reference it is tested against, and what evaluation and generation run. Same
    parameters either way, so checkpoints move freely between the two. small: see linear (set by
    Llama.setup_cache)."""

    def __init__(self, d_in: int, d_out: int, fp8: bool = False, fast_accum: bool = False):
        super().__init__(d_in, d_out, bias=False)
        self.fp8, self.fast_accum, self.small = fp8, fast_accum, False

    def forward(self, x):
        if self.fp8 and torch.is_grad_enabled():
            return fp8_linear(x, self.weight, fast_accum=self.fast_accum)
        return linear(x, self.weight, self.small)


@dataclass
class Attend:
    """What attention needs besides its input, built once per forward by Llama.forward and passed
    down unchanged: the rotary tables for the tokens' positions, and the one mask of the mode.
      training and evaluation: doc_ids and window (the boolean mask), or block_mask (FlexAttention, CUDA);
      generation: pos, the tokens' cache positions, and cache_mask, which cache positions each may read."""
    cos: torch.Tensor  # (T, head_dim)
    sin: torch.Tensor  # (T, head_dim)
    doc_ids: torch.Tensor | None = None  # (B, T) document of each token
    window: int = 0  # a query sees at most this many keys (0: all before it)
    block_mask: object = None  # FlexAttention's BlockMask for doc_ids and window
    pos: torch.Tensor | None = None  # (T,) cache positions of the tokens (generation)
    cache_mask: torch.Tensor | None = None  # (T, S) booleans: which of the first S cache positions each token reads
    # The same three for the short layers (ModelConfig.short_layer), where short_windows is on:
    short_window: int = 0
    short_block_mask: object = None
    short_cache_mask: torch.Tensor | None = None


class KVCache(nn.Module):
    """One layer's keys and values for generation, preallocated for the whole context:
    (batch, n_kv_heads, context, head_dim), sized for the kv heads, not the query heads.
    Tokens are written in place at their positions, so every decode step sees tensors of the
    same shape at the same address, which is what lets a compiled step replay as a CUDA graph
    (generate.GraphDecoder). Buffers of the model, not persistent: never saved."""

    def __init__(self, batch: int, n_kv_heads: int, context: int, head_dim: int, device, dtype):
        super().__init__()
        shape = (batch, n_kv_heads, context, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        # Whether onegpu_kernels.decode_step can run here (Ampere or newer), asked once, outside compiled code.
        self.fusable = K.device_supported(torch.device(device))
        # split_decode's count of each head's finished programs (onegpu_kernels.decode_step), zero between steps.
        self.register_buffer("counts", torch.zeros(batch, n_kv_heads, device=device, dtype=torch.int32),
                             persistent=False)

    def update(self, pos, k, v):
        """Write k, v (B, Hkv, T, hd) at positions pos (T,); return the whole cache."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        return self.k, self.v


class QKNormRope(torch.autograd.Function):
    """fused_qk_norm_rope: QK-norm and RoPE on qkv (B, T, H + 2 Hkv, hd), the QKV projection's output, with
    the gains q_gain and k_gain (hd,), H = n_heads, and the tables cos, sin (T, hd). Forward, the plain lines
    (Attention.split_heads' norms, then apply_rope), which Inductor fuses into one kernel: 0.95 ms a layer at
    88m on an H200, where a forward kernel of ours took 1.28. Backward, one Triton kernel
    (onegpu_kernels.qk_norm_rope_backward, which recomputes the norm from qkv): 0.71 ms against Inductor's
    0.90 (`python bench.py --parts --preset 88m --micro-batch 16`, docs/LOG.md 2026-12-04). Returns q (B, T,
    H, hd), k and v (B, T, Hkv, hd) apart, v a copy of qkv's rows, so that their gradients come back apart,
    where attention leaves them, and the kernel writes qkv's whole gradient without a copy of the three
    into one first."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, q_gain, k_gain, n_heads: int, eps: float):
        ctx.save_for_backward(qkv, cos, sin, q_gain, k_gain)
        ctx.n_heads, ctx.eps = n_heads, eps
        kv_heads = (qkv.shape[2] - n_heads) // 2
        q, k, v = qkv.split([n_heads, kv_heads, kv_heads], dim=2)
        q = apply_rope(rms_norm(q, eps) * q_gain, cos, sin).type_as(qkv)
        k = apply_rope(rms_norm(k, eps) * k_gain, cos, sin).type_as(qkv)
        return q, k, v.clone()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, cos, sin, q_gain, k_gain = ctx.saved_tensors
        dqkv, dq_gain, dk_gain = K.qk_norm_rope_backward(dq, dk, dv, qkv, cos, sin, q_gain, k_gain, ctx.n_heads,
                                                         ctx.eps)
        return dqkv, None, None, dq_gain, dk_gain, None, None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.short = cfg.short_layer(layer)  # attends over the short window (Attend's short_* fields)
        self.kind = cfg.attention
        self.scale = cfg.attn_scale or None  # None: each kernel's own 1/sqrt(head size)
        self.fused_decode, self.split_decode = cfg.fused_decode, cfg.split_decode
        self.window = cfg.windows()[1 if self.short else 0]  # the keys decoding sees (0: all before it)
        self.fused_qk = cfg.fused_qk_norm_rope and fast_path_applies("fused_qk_norm_rope", cfg)  # with QK-norm
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one larger GEMM keeps the tensor cores busier than three.
        self.wqkv = Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, cfg.fp8 and FP8_ATTENTION, cfg.fp8_fast_accum)
        self.wo = Linear(cfg.d_model, cfg.d_model, cfg.fp8 and FP8_ATTENTION, cfg.fp8_fast_accum)
        # QK-norm: one RMSNorm gain of head_dim shared by all query heads, one by all key heads (Qwen3's
        # q_norm and k_norm; ones without norm_gains). It bounds the attention logits, which is what lets
        # Muon's larger steps stay stable.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_gains) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_gains) if cfg.qk_norm else None
        # Value embeddings: v = a * v + b * ve, with (a, b) learned from (0.5, 0.5) as in modded-nanogpt; with
        # value_scale a layer without a table keeps a alone (v = a * v), as modded's does.
        mixes = cfg.value_table(layer) is not None
        self.v_mix = nn.Parameter(torch.empty(2 if mixes else 1)) if mixes or cfg.value_scale else None
        # The gate: (B, T, 12) -> (B, T, H), zero-initialised, so every head starts at half its output
        # and can learn to switch itself off per token ("sparse attention gate", modded-nanogpt).
        self.gate = nn.Linear(GATE_CHANNELS, cfg.n_heads, bias=False) if cfg.attn_gate else None
        self.cache = None  # a KVCache while generating (Llama.setup_cache)
        self.pdl = False  # the fused decode's kernel launched as a dependent (decode_pdl): set by Llama.setup_cache

    def split_heads(self, qkv, ve=None):
        """(B, T, H + 2 Hkv, hd) -> q (B, T, H, hd), k, v (B, T, Hkv, hd): q and k normed with qk_norm, v
        mixed (mixed_values)."""
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self.mixed_values(v, ve)

    def mixed_values(self, v, ve=None):
        """v (B, T, Hkv, hd) with the value embedding ve (B, T, Hkv * hd) mixed in, or scaled alone
        (value_scale)."""
        if ve is not None:
            return self.v_mix[0] * v + self.v_mix[1] * ve.view_as(v)
        return v if self.v_mix is None else self.v_mix[0] * v

    def heads(self, qkv, cos, sin, ve=None, training: bool = True):
        """(B, T, H + 2 Hkv, hd) -> q, k, v (B, T, heads, hd): split_heads, then RoPE on q and k (cos, sin:
        (T, hd))."""
        if training and self.fused_qk and torch.is_grad_enabled() and K.qk_norm_rope_supported(qkv, cos):
            # Training: the same lines forward, QK-norm and RoPE's backward as one Triton kernel (QKNormRope),
            # tested against the lines below, which evaluation and decoding run.
            q, k, v = QKNormRope.apply(qkv, cos, sin, self.q_norm.weight, self.k_norm.weight, self.n_heads,
                                       self.q_norm.eps)
            return q, k, self.mixed_values(v, ve)
        q, k, v = self.split_heads(qkv, ve)
        return apply_rope(q, cos, sin).type_as(v), apply_rope(k, cos, sin).type_as(v), v

    def gated(self, y, x):
        """y: (B, T, H, hd) head outputs; x: (B, T, d) the attention's input."""
        if self.gate is None:
            return y
        return y * torch.sigmoid(self.gate(x[..., :GATE_CHANNELS]))[..., None]

    def forward(self, x, at: Attend, ve=None):
        """x: (B, T, d) the normed stream; ve: this layer's value embedding (B, T, Hkv * hd) or None."""
        B, T, _ = x.shape
        cos, sin, pos = at.cos, at.sin, at.pos
        qkv = self.wqkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        if (pos is not None and self.fused_decode and self.cache.fusable and not torch.is_grad_enabled()
                and K.decode_step_supported(qkv, self.cache.k)):
            # One new token: QK-norm, RoPE, the value's mix, the cache write, attention over positions
            # 0..pos and the gate in one Triton kernel (onegpu_kernels.decode_step), tested against the plain
            # path below. It has no backward pass: with gradients on, the plain path runs.
            parts = {}
            if self.q_norm is not None:
                parts.update(q_gain=self.q_norm.weight, k_gain=self.k_norm.weight, eps=self.q_norm.eps)
            if self.v_mix is not None:
                parts.update(v_mix=self.v_mix, ve=ve)
            if self.gate is not None:
                parts.update(gate_x=x, gate_w=self.gate.weight)
            if self.split_decode:
                parts.update(counts=self.cache.counts)
            if self.pdl:
                parts.update(pdl=True)
            y = K.decode_step(qkv, cos[0], sin[0], self.cache.k, self.cache.v, pos,
                              self.scale or self.head_dim ** -0.5, window=self.window, **parts)  # (B, 1, H, hd)
            return self.wo(y.reshape(B, T, -1))
        q, k, v = self.heads(qkv, cos, sin, ve, training=pos is None)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        if pos is not None:  # generation: attend over the first `cache_mask.shape[1]` cache positions
            k, v = self.cache.update(pos, k, v)
            mask = at.short_cache_mask if self.short else at.cache_mask
            read = mask.shape[1]
            y = cached_attention(q, k[:, :, :read].to(q.dtype), v[:, :, :read].to(q.dtype), mask, self.scale)
        elif self.short:
            y = attention(q, k, v, self.kind, doc_ids=at.doc_ids, block_mask=at.short_block_mask, window=at.short_window,
                          scale=self.scale)
        else:
            y = attention(q, k, v, self.kind, doc_ids=at.doc_ids, block_mask=at.block_mask, window=at.window,
                          scale=self.scale)
        return self.wo(self.gated(y.transpose(1, 2), x).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """(silu(x W1) * x W3) W2 (Shazeer 2020), with W1 and W3 stacked into one matmul. With
    fused_swiglu (CUDA, training; on in the presets, so it runs wherever mlp = "swiglu") the
    activation runs as onegpu_kernels.swiglu, forward and backward one kernel each, tested against the
    plain line below, which runs on CPU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fused = cfg.fused_swiglu
        self.w13 = Linear(cfg.d_model, 2 * cfg.ffn_hidden, cfg.fp8, cfg.fp8_fast_accum)
        self.w2 = Linear(cfg.ffn_hidden, cfg.d_model, cfg.fp8, cfg.fp8_fast_accum)

    def forward(self, x):
        h13 = self.w13(x)  # (B, T, 2 x ffn_hidden): [gate | up]
        # Training only: when decoding (no gradients) Inductor fuses SiLU into the GEMVs around it,
        # the path the generation numbers were measured on.
        if self.fused and torch.is_grad_enabled() and K.swiglu_supported(h13):
            return self.w2(K.swiglu(h13))
        gate, up = h13.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class ReLU2(nn.Module):
    """relu(x W1)^2 W2 (So et al. 2021, "Primer"; modded-nanogpt and nanochat use it). Two matrices
    to SwiGLU's three, so at 1.5x the width it has the same parameters and FLOPs. Compiled, the square
    is one elementwise kernel after the up-projection; with fused_relu2 (training, CUDA, not with fp8)
    it runs in the up-projection's epilogue instead (FusedReLU2MLP), tested against the plain line below;
    with fp8 (training) the MLP is FP8ReLU2MLP, the activation cast to FP8 as it is computed; with decode_mlp
    (generation, CUDA) a decode step's MLP is one kernel (onegpu_kernels.decode_mlp)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fused = cfg.fused_relu2 and fast_path_applies("fused_relu2", cfg)  # not with fp8
        self.decode = False  # decode_mlp where its kernel runs: set by Llama.setup_cache
        self.pdl = False  # its kernel launched as a dependent (decode_pdl): set by Llama.setup_cache
        self.w1 = Linear(cfg.d_model, cfg.ffn_hidden, cfg.fp8, cfg.fp8_fast_accum)
        self.w2 = Linear(cfg.ffn_hidden, cfg.d_model, cfg.fp8, cfg.fp8_fast_accum)

    def forward(self, x):
        if self.fused and torch.is_grad_enabled() and K.runs_on(x):
            return fused_relu2_mlp(x, self.w1.weight, self.w2.weight)
        if self.w1.fp8 and torch.is_grad_enabled():
            return fp8_relu2_mlp(x, self.w1.weight, self.w2.weight, self.w1.fast_accum)
        if self.decode and not torch.is_grad_enabled() and K.decode_mlp_supported(x, self.w1.weight, self.w2.weight):
            # (P, B, T, d) float32 partial sums, one per 32 hidden units: their sum is the MLP's output
            return K.decode_mlp(x, self.w1.weight, self.w2.weight, self.pdl).sum(0).to(x.dtype)
        if self.w1.small:  # decoding with decode_matmuls: the square in the matmul's epilogue
            return self.w2(linear(x, self.w1.weight, small=True, relu2=True))
        return self.w2(F.relu(self.w1(x)).square())


class FusedReLU2MLP(torch.autograd.Function):
    """relu(x W1^T)^2 W2^T with the square in the up-projection's epilogue (onegpu_kernels.relu2_matmul). It
    keeps the activation a = relu(h)^2 for the backward, which the down-projection's weight gradient needs
    anyway, and not h: relu(h) = sqrt(a), so the backward needs no more. Where the plain path keeps both
    h and a, this saves one (tokens, hidden) tensor per layer (3.7 GiB at 88m, micro-batch 64 on an H200).
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


def relu2_fp8_plain(u):
    """relu(u)^2 in u's dtype, then to_fp8_rows: (a8, inverse scales). u: (N, hidden). The plain twin of
    onegpu_kernels.relu2_fp8, which the tests hold to it."""
    return to_fp8_rows(F.relu(u).square())


def relu2_fp8_backward_plain(dh, u):
    """(relu(u)^2, du = dh 2 relu(u) in u's dtype, du's to_fp8_rows cast and inverse scales). The plain twin of
    onegpu_kernels.relu2_fp8_backward, which the tests hold to it."""
    r = F.relu(u.float())
    du = (dh.float() * 2 * r).to(u.dtype)
    return r.square().to(u.dtype), du, *to_fp8_rows(du)


def relu2_fp8(u):
    """relu2_fp8_plain, as one pass of onegpu_kernels.relu2_fp8 where K.runs_on(u)."""
    return K.relu2_fp8(u) if K.runs_on(u) and u.is_contiguous() else relu2_fp8_plain(u)


def relu2_fp8_backward(dh, u):
    """relu2_fp8_backward_plain, as one pass of onegpu_kernels.relu2_fp8_backward where K.runs_on(u)."""
    if K.runs_on(u) and u.is_contiguous() and dh.is_contiguous():
        return K.relu2_fp8_backward(dh, u)
    return relu2_fp8_backward_plain(dh, u)


class FP8ReLU2MLP(torch.autograd.Function):
    """relu(x W1^T)^2 W2^T with fp8 (FP8Rows's matmuls): both matmuls' forward and input gradients in FP8, the
    activation cast to e4m3 as it is computed and its derivative as it is computed (relu2_fp8 and its
    backward), the weight gradients in bf16. It keeps x and the up-projection's output u, not the activation:
    the backward's pass over u writes it again for the down-projection's weight gradient, so a (tokens,
    hidden) tensor less stays in memory a layer. x: (N, d) bf16; w1: (hidden, d); w2: (d, hidden)."""

    @staticmethod
    def forward(ctx, x, w1, w2, fast_accum):
        u = rows_matmul(to_fp8_rows(x), to_fp8_rows(w1), fast_accum)  # (N, hidden)
        ctx.save_for_backward(x, u, w1, w2)
        return rows_matmul(relu2_fp8(u), to_fp8_rows(w2), fast_accum)

    @staticmethod
    def backward(ctx, grad):
        x, u, w1, w2 = ctx.saved_tensors
        grad = grad.to(u.dtype)  # (N, d)
        dh = rows_matmul(to_fp8_rows(grad), to_fp8_cols(w2))  # (N, hidden)
        a, du, du8, s_du = relu2_fp8_backward(dh, u)
        grad_x = rows_matmul((du8, s_du), to_fp8_cols(w1))
        return grad_x, (du.t() @ x).to(w1.dtype), (grad.t() @ a).to(w2.dtype), None


def fp8_relu2_mlp(x, w1, w2, fast_accum: bool = False):
    """ReLU2's training forward through FP8ReLU2MLP, its output in bf16; fast_accum: its forward products with
    fast accumulation (ModelConfig.fp8_fast_accum). x: (..., d)."""
    with torch.autocast(x.device.type, enabled=False):
        y = FP8ReLU2MLP.apply(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), w1, w2, fast_accum)
    return y.view(*x.shape[:-1], w2.shape[0])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        # skip_attn_layer's block is its MLP alone, as modded-nanogpt's layer 7 of 12 (its train_gpt.py
        # at 9d9dc969): it saves that layer's attention and its two matmuls.
        attends = cfg.attends(layer)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_gains) if attends else None
        self.attn = Attention(cfg, layer) if attends else None
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_gains)
        self.mlp = ReLU2(cfg) if cfg.mlp == "relu2" else SwiGLU(cfg)
        self.x0_mix = nn.Parameter(torch.empty(2)) if cfg.x0_mix else None  # (a, b), from (1, 0)

    def forward(self, x, at: Attend, x0=None, ve=None, recompute_mlp: bool = False):
        """x: (B, T, d) the stream; x0: the embedding it started from (x0_mix); ve: this layer's value
        embedding (or None)."""
        if self.x0_mix is not None:
            x = self.x0_mix[0] * x + self.x0_mix[1] * x0
        if self.attn is not None:
            x = x + self.attn(self.attn_norm(x), at, ve)
        if recompute_mlp:  # keep only x for the backward pass: the norm, the up-projection (w13 or w1) and
            # the activation are recomputed there, one extra up-projection matmul (Llama.recompute_mlp)
            return x + torch.utils.checkpoint.checkpoint(self.mlp_branch, x, use_reentrant=False)
        return x + self.mlp_branch(x)

    def mlp_branch(self, x):
        return self.mlp(self.mlp_norm(x))


# --- The fused loss ------------------------------------------------------------------------
# The plain loss materialises (tokens x vocab) logits: at micro-batch 16 of 1,024 tokens and a
# 32,768 vocabulary that is 0.5 G values, 1 GiB in bf16 plus 2 GiB in float32 and again for their
# gradient. Here the head and the loss run over row chunks; each chunk's gradient is computed at
# once in the forward pass (the loss is the graph's end, so its incoming gradient is a scalar),
# and only the input's and the weight's gradients are kept: memory for one chunk's logits.

LOSS_CHUNK_ROWS = 2048  # at least 2,048 rows a chunk: 2,048 x 32,768 logits are 128 MiB in bf16
LOSS_MAX_CHUNKS = 16  # larger batches take larger chunks: each chunk adds into the (vocab, d) weight gradient


def _loss_chunk(x, w, targets, scale: float, cap: float = 0.0):
    """Sum of cross-entropy over one chunk, and the gradients of scale * that sum with respect
    to x (rows, d) and w (vocab, d). x and w in the matmul dtype; softmax in float32. cap: the
    logits' soft-cap (softcap; 0: none), whose slope 1 - tanh^2 scales the logits' gradient."""
    logits = (x @ w.t()).to(torch.promote_types(x.dtype, torch.float32))  # (rows, vocab), at least float32
    if cap:
        squashed = torch.tanh(logits / cap)
        logits = cap * squashed
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    # d loss / d logits = softmax - one-hot, written as one elementwise expression (no in-place
    # scatter), so the compiled chunk reads the logits once more and writes the gradient once, in
    # the matmul dtype as autocast's backward has it.
    onehot = torch.arange(logits.shape[1], device=x.device)[None, :] == targets[:, None]
    grad = (torch.exp(logits - lse[:, None]) - onehot.to(logits.dtype)) * scale
    if cap:
        grad = grad * (1 - squashed * squashed)
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
    def forward(ctx, x, weight, targets, compute_dtype, cap):
        n = x.shape[0]
        w = weight.to(compute_dtype)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        total = torch.zeros((), device=x.device, dtype=torch.promote_types(compute_dtype, torch.float32))
        chunk, size = loss_chunk_fn(x.device), max(LOSS_CHUNK_ROWS, -(-n // LOSS_MAX_CHUNKS))
        for start in range(0, n, size):
            rows = slice(start, start + size)
            loss, gx, gw = chunk(x[rows].to(compute_dtype), w, targets[rows], 1.0 / n, cap)
            total += loss
            grad_x[rows] = gx
            grad_w += gw  # float32 accumulation across chunks
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_out, grad_w * grad_out, None, None, None


def linear_cross_entropy(x, weight, targets, cap: float = 0.0):
    """Mean cross-entropy of softmax(softcap(x @ weight.T, cap)) against targets. x: (N, d); weight:
    (vocab, d); targets: (N,). Equals F.cross_entropy(softcap(F.linear(x, weight).float(), cap),
    targets), computed in chunks.
    Kept out of an enclosing torch.compile graph: a plain Python loop over compiled chunks is
    compiled once, where tracing it would unroll one copy per chunk."""
    global _uncompiled_loss
    if _uncompiled_loss is None:  # torch.compiler imports the compiler stack: only when this is used
        _uncompiled_loss = torch.compiler.disable(_linear_cross_entropy)
    return _uncompiled_loss(x, weight, targets, cap)


_uncompiled_loss = None


def _linear_cross_entropy(x, weight, targets, cap: float):
    dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return LinearCrossEntropy.apply(x, weight, targets, dtype, cap)


# --- The model -----------------------------------------------------------------------------

class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # An empty weight skips nn.Embedding's own init (reset_parameters below sets it), which on
        # the meta device would import torch.compile's machinery and cost a second.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, kv_dim, _weight=torch.empty(cfg.vocab_size, kv_dim))
                                          for _ in range(cfg.value_embeds))
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # U-net: the last L/2 blocks each add a learned multiple (from 1) of a first-half block's output,
        # the last block's from the first block's, and so on inwards.
        self.skip_weights = nn.Parameter(torch.empty(cfg.n_layers // 2)) if cfg.unet_skips else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_gains)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_theta, cfg.rope_truncate)
        # Buffers, not parameters; not saved in checkpoints (they follow from the config). Kept in
        # float64 and cast to the activations' dtype when used, so a float64 model is exact.
        device = self.embed.weight.device
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.activation_checkpointing = False  # recompute every block in backward (train.py sets these)
        self.recompute_mlp = False  # recompute only each block's norm + MLP: most of the memory, less of the work
        self.small_matmuls = False  # decode_matmuls switched on for this device by setup_cache
        self.dependent_launches = False  # decode_pdl switched on for this device by setup_cache
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2's init, as nanoGPT and llm.c use it: every matrix normal with std 0.02, and the
        two projections that write into the residual stream (wo, w2) scaled by 1/sqrt(2 * layers),
        so the stream's variance does not grow with depth. Norm gains start at one. With zero_init
        those two start at zero instead (modded-nanogpt): each block starts as the identity, and the
        first steps' gradients choose the projections' directions; an untied head starts at zero too
        (modded-nanogpt), so the first logits are uniform.

        The modded-nanogpt parts start where that code starts them: the mixing scalars as the plain
        model (x0_mix (1, 0), skip weights 1) or halfway (v_mix (0.5, 0.5)), the gate at zero, and the
        value embeddings, and the embedding behind embed_norm when untied, at nn.Embedding's N(0, 1):
        a norm follows them, so only their scale against the Adam step matters."""
        scalars = {"x0_mix": (1.0, 0.0), "v_mix": (0.5, 0.5)}
        unit_embedding = self.cfg.embed_norm and not self.cfg.tie_embeddings
        for name, p in self.named_parameters():
            if p.is_meta:  # shapes only (counting a 7B model): there are no values to set
                continue
            output_projection = name.endswith(("attn.wo.weight", "mlp.w2.weight"))
            last = name.rsplit(".", 1)[-1]
            if last in scalars:
                with torch.no_grad():
                    p.copy_(torch.tensor(scalars[last][:p.numel()]))  # a lone v_mix is (a,)
            elif name.startswith("value_embeds.") or (name == "embed.weight" and unit_embedding):
                nn.init.normal_(p, mean=0.0, std=1.0)
            elif (output_projection or name == "head.weight") and self.cfg.zero_init or name.endswith("attn.gate.weight"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02
                if output_projection:
                    std /= math.sqrt(2 * self.cfg.n_layers)
                nn.init.normal_(p, mean=0.0, std=std)
            else:
                nn.init.ones_(p)

    def output_weight(self):
        return self.embed.weight if self.head is None else self.head.weight

    def setup_cache(self, batch: int, dtype=None):
        """Give every layer a KVCache for `batch` sequences (see KVCache). A cache of the same
        size and dtype is kept, not reallocated: a captured CUDA graph holds its address."""
        device, dtype = self.embed.weight.device, dtype or self.embed.weight.dtype
        # decode_matmuls where its kernel runs, asked here, once, outside compiled code (as KVCache.fusable)
        self.small_matmuls = self.cfg.decode_matmuls and K.device_supported(device)
        decode_mlp = self.cfg.decode_mlp and fast_path_applies("decode_mlp", self.cfg) and K.device_supported(device)
        self.dependent_launches = self.cfg.decode_pdl and K.dependent_launch(device)
        for module in self.modules():
            if isinstance(module, Linear):
                module.small = self.small_matmuls
            elif isinstance(module, ReLU2):
                module.decode, module.pdl = decode_mlp, self.dependent_launches
            elif isinstance(module, Attention):
                module.pdl = self.dependent_launches
        for attn in self.attentions():
            cache = attn.cache
            if cache is None or cache.k.shape[0] != batch or cache.k.dtype != dtype or cache.k.device != device:
                attn.cache = KVCache(batch, self.cfg.n_kv_heads, self.cfg.context, self.cfg.head_dim, device, dtype)

    def attentions(self) -> list:
        """The blocks' attention modules (a skip_attn_layer block has none), first layer first."""
        return [block.attn for block in self.blocks if block.attn is not None]

    def forward(self, idx, targets=None, doc_ids=None, block_mask=None, pos=None, window: int | None = None,
                attn_window: int | None = None, short_window: int | None = None, short_block_mask=None):
        """idx: (B, T) token ids. Returns logits (B, T, vocab) or, given targets (B, T), the mean
        cross-entropy. doc_ids (B, T) restrict attention to each packed document and attn_window to
        a sliding window (None: model.attn_window, the window the model ends its training with), and
        short_window the short layers' (None: as ModelConfig.windows has it), or block_mask and
        short_block_mask do both on CUDA (mask_inputs builds these; they then decide alone).
        pos: (T,) positions of idx's tokens when generating with the cache (setup_cache): their
        keys and values are stored there and attention reads the cache up to them. window: how
        many cache positions attention reads, through a mask (default: all of them). Eager
        decoding passes the length so far; a CUDA-graph step passes the whole context
        (GraphDecoder), since its shapes cannot change between replays."""
        B, T = idx.shape
        if pos is None and T > self.cfg.context:
            raise ValueError(
                f"sequence of {T} tokens is longer than model.context={self.cfg.context}: "
                f"cut the input to the last {self.cfg.context} tokens or train with a longer context")
        x = self.embed(idx)
        if self.cfg.embed_norm:
            x = rms_norm(x, self.cfg.norm_eps)
        if pos is None:
            long, short = self.cfg.windows(attn_window)
            short = short if short_window is None else short_window
            long, short = (w if w < T else 0 for w in (long, short))  # a window as long as the sequence hides nothing
            at = Attend(self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype), doc_ids, long, block_mask,
                        short_window=short, short_block_mask=short_block_mask)
        else:
            # (T, window): a query at position p sees cached keys at positions <= p; positions past
            # the current length hold zeros or stale keys and are masked out.
            keys = torch.arange(window or self.cfg.context, device=idx.device)[None, :]
            causal = keys <= pos[:, None]
            long, short = self.cfg.windows()  # and no further back than the sliding windows
            cache_mask, short_mask = ((causal & (pos[:, None] - keys < w)) if w else causal for w in (long, short))
            at = Attend(self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype), pos=pos, cache_mask=cache_mask,
                        short_cache_mask=short_mask if short else None)
        if self.cfg.bf16_residual and torch.is_grad_enabled() and torch.is_autocast_enabled(x.device.type):
            # The stream every norm reads and every residual add writes, in bf16 instead of float32:
            # half the bytes in those memory-bound kernels (docs/PERFORMANCE.md, training speed). The
            # norms compute in float32; the gradient along the stream is rounded to bf16 at every
            # add, and the loss curves match. Only in training: evaluation and decoding move one
            # stream vector per token next to whole weight matrices, so they keep float32's
            # precision for free. (The RoPE tables above keep x's float32.)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        x0, ve, skips = x, [table(idx) for table in self.value_embeds], []
        if pos is not None and ve:
            # Generation: this token's rows of every table gathered into one buffer. The fused decode
            # kernel is opaque to Inductor, which otherwise gathers each layer's rows in a kernel of its
            # own just before it: 6 launches a token at 88m (its generated code, 2026-12-02).
            ve = torch.stack(ve).unbind(0)
        n_skips = len(self.skip_weights) if self.skip_weights is not None else 0
        for i, block in enumerate(self.blocks):
            if i >= len(self.blocks) - n_skips:  # the U-net's second half: add the mirrored block's output
                x = x + self.skip_weights[i - (len(self.blocks) - n_skips)] * skips.pop()
            table = self.cfg.value_table(i)
            layer_ve = ve[table] if table is not None else None
            if self.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, at, x0, layer_ve, use_reentrant=False)
            else:
                x = block(x, at, x0, layer_ve, self.recompute_mlp and self.training)
            if i < n_skips:
                skips.append(x)
        x = self.norm(x)
        if targets is not None and self.cfg.fused_loss:
            return linear_cross_entropy(x.flatten(0, 1), self.output_weight(), targets.flatten(), self.cfg.logit_softcap)
        if targets is not None and self.cfg.fp8_head and torch.is_grad_enabled():
            # Training only (evaluation and decoding keep the plain head): d loss / d logits of the
            # mean over targets.numel() tokens lies within 1 / targets.numel() (see the FP8 section).
            if self.cfg.loss_kernel and K.runs_on(x):  # head and loss in one function, the gradient written forward
                return fp8_head_cross_entropy(x.flatten(0, 1), self.head.weight, targets.flatten(),
                                              self.cfg.logit_softcap, fast_accum=self.cfg.fp8_fast_accum)
            logits = fp8_linear(x, self.head.weight, grad_bound=1.0 / targets.numel(),
                                fast_accum=self.cfg.fp8_fast_accum)
        else:
            logits = linear(x, self.output_weight(), self.small_matmuls)
        if targets is None:
            return softcap(logits, self.cfg.logit_softcap)
        # The loss kernel in training only, as the FP8 head: evaluation keeps the plain loss, the reference.
        return cross_entropy(logits.flatten(0, 1), targets.flatten(), self.cfg.logit_softcap,
                             kernel=self.cfg.loss_kernel and torch.is_grad_enabled())


def cross_entropy(logits, targets, cap: float, kernel: bool = False):
    """Mean cross-entropy of softcap(logits, cap) (N, vocab) against targets (N,). kernel: through
    onegpu_kernels.cross_entropy where it runs (ModelConfig.loss_kernel), else the plain loss, its reference."""
    if kernel and K.cross_entropy_supported(logits):
        return K.cross_entropy(logits, targets, cap)[0].mean()
    # Softmax in (at least) float32: bf16 logits lose about three digits of the loss.
    return F.cross_entropy(softcap(logits.to(torch.promote_types(logits.dtype, torch.float32)), cap), targets)


def softcap(logits, cap: float):
    """cap * tanh(logits / cap): logits stay within (-cap, cap), smoothly (Gemma 2's final-logit
    soft-cap). Near zero it is the identity, so it only bites on confident tokens. cap 0: off.
    modded-nanogpt's 30 * sigmoid(logits / 7.5) is 15 + 15 * tanh(logits / 15), and a softmax does not
    see a constant added to every logit: it is this function with cap 15, to the loss and its gradient."""
    return cap * torch.tanh(logits / cap) if cap else logits


# --- Arithmetic ----------------------------------------------------------------------------

def param_count(cfg: ModelConfig) -> int:
    """Parameters in closed form from the shapes (equals counting the module's tensors)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    gain = 1 if cfg.norm_gains else 0  # norm gains are parameters, or ones that no optimizer steps
    attn = d * (d + 2 * kv) + d * d + (2 * cfg.head_dim * gain if cfg.qk_norm else 0)  # wqkv, wo, q/k norm gains
    mlp = (2 if cfg.mlp == "relu2" else 3) * d * cfg.ffn_hidden  # w1, (w3,) w2
    attn += cfg.n_heads * GATE_CHANNELS if cfg.attn_gate else 0
    block = attn + mlp + 2 * d * gain + (2 if cfg.x0_mix else 0)  # two RMSNorm gains (and the x0 mix)
    attention_free = (attn + d * gain) * (cfg.skip_attn_layer != -1)  # skip_attn_layer's attention and its norm
    embed = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    value = cfg.value_embeds * (cfg.vocab_size * kv + 2 * 2)  # a table and two layers' (a, b) each
    if cfg.value_scale:  # every other layer with attention: its a
        value += sum(cfg.value_table(i) is None and cfg.attends(i) for i in range(cfg.n_layers))
    skips = cfg.n_layers // 2 if cfg.unet_skips else 0
    return embed + cfg.n_layers * block - attention_free + d * gain + head + value + skips


def multiplied_params(cfg: ModelConfig) -> int:
    """The parameters that multiply the activations: all but the lookup tables (an untied input
    embedding and the value embeddings), which a token only indexes."""
    lookups = (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    lookups += cfg.value_embeds * cfg.vocab_size * cfg.n_kv_heads * cfg.head_dim
    return param_count(cfg) - lookups


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token, PaLM appendix B: 6N for the weights that multiply (2 forward, 4
    backward) plus 12 * L * H * Q * T for attention's two weightless matmuls (the full T x T square,
    as PaLM counts it, masked half included). The token and value embeddings are lookups, not
    matmuls: an untied input embedding and the value tables are left out of N. A layer's sliding
    window of w keys counts as T = min(T, 2w), the same square with its masked half; what a document
    mask hides is not known in advance and still counts."""
    T = cfg.context if seq_len is None else seq_len
    long, short = cfg.windows()
    reach = sum(min(T, 2 * w) if w else T
                for w in (short if cfg.short_layer(i) else long for i in range(cfg.n_layers) if cfg.attends(i)))
    return 6 * multiplied_params(cfg) + 12 * cfg.n_heads * cfg.head_dim * reach


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilization: useful FLOP/s over the peak (a fraction, not a percent)."""
    return tokens_per_s * flops_per_tok / peak_flops
