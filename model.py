"""The model: a Llama-style decoder (its parameter and FLOP counts are flops.py's).

This file is what the model computes, one path per forward; how fast it runs is fastpaths.py's business
(training) and generate.py's (decoding), each of which swaps a module here for a faster twin computing the
same function, once, when a model is built. Attention and its masks are attention.py; which configs are refused,
and why, model_checks.py.

The default presets (configs/22m.toml to configs/126m.toml, the recipe in configs/recipes/record.toml) compute,
for each of a micro-batch's (B, T) tokens:
  - x = the token embedding, RMS-normed without a gain (embed_norm);
  - n_layers blocks, each x = a*x + b*x0 (x0_mix: x0 the normed embedding) then
      attention:  x += wo(gate * attend(RoPE(norm(q)), RoPE(norm(k)), v)) of norm(x), where RoPE rotates only
                  a quarter of the frequencies (rope_truncate), v is mixed with a value embedding in the first
                  and last value_embeds layers (scaled alone elsewhere: value_scale), the scores are scaled by
                  attn_scale, each token sees its own document within a sliding window (half of it on the short
                  layers: short_windows), and the gate is a sigmoid of 12 input channels per head (attn_gate);
                  one middle layer has none (skip_attn_layer);
      MLP:        x += w2(relu(w1(norm(x)))^2) (mlp = "relu2");
    the second half of the blocks adds a learned multiple of the first half's outputs (unet_skips);
  - logits = 15 tanh(x W / 15) with W an untied head (logit_softcap, tie_embeddings = false), and the mean
    cross-entropy against the targets.
The norms have no gains (norm_gains = false) and the output projections and head start at zero (zero_init).
126m adds the newest records' parts (configs/recipes/newest.toml): a hashed (previous, current) token-pair table added
to every block's input, its rows signed by pair (bigram_rows, bigram_signs), each embedding smeared with its
predecessor's (smear), the long layers' keys offset by a token (key_offset), gated value embeddings (value_gate),
paired heads in every other short layer (paired_heads), the head reading x minus its 2/3-depth state (backout), later
blocks attending over that state, not their own input (saved_attn_input), each unpaired head's output less a learned
share along its own value (xsa), and logits 11.5 tanh((x W + 5) / 15) (logit_shift, logit_temperature). With
dense_last the last two blocks gain per-token mixes of earlier streams, the last block's values one (DenseMix, #81).
Every recipe option defaults to the article's Llama 2, so a config that names none computes that.
"""

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import attention as A
from model_checks import check_config

MLPKind = Literal["swiglu", "relu2"]
# The fields that fix the weights' shapes and meaning: a checkpoint resumes only with the same values.
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "context", "tie_embeddings",
                "rope_theta", "norm_eps", "mlp", "qk_norm", "logit_softcap", "logit_shift", "logit_temperature",
                "embed_norm", "value_embeds", "value_scale", "norm_gains", "unet_skips", "x0_mix", "rope_truncate",
                "attn_gate", "attn_window", "short_windows", "skip_attn_layer", "attn_scale", "bigram_rows",
                "bigram_signs", "backout", "smear", "key_offset", "value_gate", "paired_heads", "rope_yarn", "xsa",
                "saved_attn_input", "dense_last")
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
    logit_shift: float = 0.0  # ... c * tanh((logits + shift) / temperature) (softcap; modded #54: 5)
    logit_temperature: float = 0.0  # the soft-cap's width; 0: the cap itself (modded #54: 15, with a cap of 11.5)
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
    # modded-nanogpt's records since #28 (records/track_1_short/ READMEs), each off until measured here:
    bigram_rows: int = 0  # rows of a hashed (previous, current) token-pair table added to every block's input (#62)
    bigram_signs: bool = False  # each pair's bigram row times a fixed +-1 pattern of the pair (record #83)
    backout: bool = False  # subtract a learned multiple of the stream at 2/3 depth before the head (record #40)
    smear: bool = False  # each token's embedding gains a gated multiple of its predecessor's (record #34)
    key_offset: bool = False  # long layers' keys take their unrotated dims from the token before (record #49)
    value_gate: bool = False  # each value embedding times a gate of the input, per token and kv head (record #55)
    paired_heads: bool = False  # every other short layer's heads attend in pairs over both heads' keys (record #58)
    xsa: bool = False  # each unpaired head's output less a learned share of its part along its own value (record #82)
    saved_attn_input: bool = False  # the blocks after backout_layer attend over its output, not their own input (#77)
    dense_last: bool = False  # the last two blocks' outputs gain learned per-token mixes of earlier streams (MUDD, #81)
    rope_yarn: int = 0  # YaRN: RoPE first trained over this window (train.window_start), stretched as it grows (#31)
    mimetic_init: float = 0.0  # b: each attention's v and wo start at +-sqrt(b) I plus noise, wo v = -b I (#64: 0.05)

    def __post_init__(self):
        check_config(self, GATE_CHANNELS)  # every range and cross-field rule, each refusal one line
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

    def paired_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends with paired heads (paired_heads): every other short layer, from the first
        (of 12 layers with layer 7 long: 1, 3, 6 and 9; record #58 chose four short layers, 1, 3, 6 and 10 in ours)."""
        shorts = [i for i in range(self.n_layers) if self.short_layer(i) and self.attends(i)]
        return self.paired_heads and layer in shorts[::2]

    def attends(self, layer: int) -> bool:
        """Whether layer `layer` has attention (all but skip_attn_layer)."""
        return layer != self.skip_attn_layer

    def windows(self, window: int | None = None) -> tuple[int, ...]:
        """(long, short): the windows of the long and the short layers when the long ones see `window`
        keys (None: attn_window; 0: no window). short is half of long, or 0 without short_windows. With
        paired_heads a third, the paired layers' window over their sequence of both heads' keys: as many keys as
        the short window, so half its tokens back (record #58 kept the window so)."""
        window = self.attn_window if window is None else window
        short = max(1, window // 2) if self.short_windows and window else 0
        return (window, short, short) if self.paired_heads else (window, short)

    @property
    def backout_layer(self) -> int:
        """The block at 2/3 depth (modded-nanogpt's 7 of 12), whose output builds context, not the prediction."""
        return max(0, 2 * self.n_layers // 3 - 1)

    def value_table(self, layer: int) -> int | None:
        """The value-embedding table layer `layer` mixes in, or None: tables 0..k-1 serve the first k
        layers and again the last k (modded-nanogpt's "012 ... 012" layout)."""
        k = self.value_embeds
        if layer < k:
            return layer
        if layer >= self.n_layers - k:
            return layer - (self.n_layers - k)
        return None


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
    """x / rms(x) * g (Zhang & Sennrich 2019): no mean, no bias, in at least float32. gain False (norm_gains): g
    stays ones, a buffer no optimizer steps (modded-nanogpt's norm(x)), read as the fused kernels read a gain."""

    def __init__(self, dim: int, eps: float, gain: bool = True):
        super().__init__()
        self.eps = eps
        if gain:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_buffer("weight", torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.eps) * self.weight


def rope_tables(head_dim: int, length: int, theta: float, truncate: bool = False, yarn: tuple[int, int] | None = None):
    """cos and sin, each (length, head_dim), in the "rotate half" layout HuggingFace Llama uses, so exported q/k
    weights need no permutation. Frequencies from Su et al. (2021). truncate: modded-nanogpt's half-truncated RoPE:
    the first head_dim/4 frequencies run from 1 down to 1/1024 radians per token (a base tuned there in place of
    theta), the other head_dim/4 are zero: those dims are not rotated and match keys by content at any distance.
    yarn (trained, window): the frequencies stretched by YaRN (yarn_stretch), and both tables times the square root of
    its attention factor, so that q . k, both rotated by them, is sharpened by it at no cost of its own."""
    # Computed on the CPU in float64 whatever the default device: exact, and cheap on "meta".
    if truncate:
        rotated = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float64, device="cpu")
        inv_freq = torch.cat([rotated, torch.zeros(head_dim // 2 - head_dim // 4, dtype=torch.float64, device="cpu")])
    else:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    factor = 1.0
    if yarn is not None:
        inv_freq, factor = yarn_stretch(inv_freq, *yarn)
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), inv_freq)  # (length, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * factor ** 0.5, angles.sin() * factor ** 0.5


def yarn_stretch(inv_freq, trained: int, window: int, alpha: float = 1.0, beta: float = 32.0):
    """YaRN (Peng et al. 2023; record #31) for frequencies inv_freq (head_dim/2,) trained over `trained` keys, now over
    `window`: one that turns less than alpha times over `trained` is slowed by trained / window (its angles stay those
    it learned), one that turns over beta times is kept, those between blend. Returns them and the attention factor
    0.2 ln(window / trained) + 1 (the record's 0.2): normed q and k need sharper scores among more keys."""
    ratio = trained / window
    keep = ((trained * inv_freq / (2 * math.pi) - alpha) / (beta - alpha)).clamp(0, 1)
    return inv_freq * (ratio + keep * (1 - ratio)), 0.2 * math.log(window / trained) + 1


def apply_rope(x, cos, sin):
    """x: (B, T, heads, head_dim), the QKV projection's own layout; cos, sin: (T, head_dim). Rotates pairs (i, i +
    head_dim/2), before q and k are transposed for attention: here each token's heads are contiguous, so the
    compiled forward and backward are one coalesced pass (on (B, heads, T, hd) views they were strided)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def bigram_row(prev, idx, rows: int):
    """The bigram table's row of each (previous, current) pair, prev and idx (B, T): a hash over rows - 1 rows
    (modded-nanogpt's, record #62), the last for "none before" (prev -1). The frequent pairs rarely collide."""
    hashed = torch.bitwise_xor(36313 * idx, 27191 * prev) % (rows - 1)
    return torch.where(prev < 0, rows - 1, hashed)


SIGN_PATTERNS = 8192  # bigram_signs' patterns (record #83's 8,192; 500 to 15,000 did as well there)


def sign_patterns(d: int):
    """bigram_signs' fixed patterns (SIGN_PATTERNS, d) of +-1 as int8: drawn once from a seeded generator on the
    CPU, so every machine, checkpoint and export computes the same ones without saving them."""
    bits = torch.randint(0, 2, (SIGN_PATTERNS, d), generator=torch.Generator().manual_seed(83), dtype=torch.int8)
    return 2 * bits - 1


def sign_row(prev, idx):
    """Each (previous, current) pair's sign pattern (B, T): previous xor current, modulo the patterns; the first
    for "none before" (prev -1)."""
    return torch.where(prev < 0, 0, torch.bitwise_xor(prev, idx) % SIGN_PATTERNS)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.short = cfg.short_layer(layer)  # attends over the short window (Masks.short)
        self.paired = cfg.paired_layer(layer)  # its heads attend in pairs (Masks.paired, heads())
        self.key_offset = cfg.key_offset and not self.short  # the long layers', which carry the far context
        self.scale = cfg.attn_scale or None  # None: each kernel's own 1/sqrt(head size)
        self.backend = "sdpa"  # attention.attend's kernel: PyTorch's pick (fastpaths may pin one)
        self.window = cfg.windows()[1 if self.short else 0]  # the keys decoding sees (0: all before it)
        self.n_heads, self.n_kv_heads, self.head_dim, self.context = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.context
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one larger GEMM keeps the tensor cores busier than three.
        self.wqkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
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
        # value_gate: ve times 2 sigmoid(a gate of the same 12 channels), per kv head: 1 at init
        self.ve_gate = nn.Linear(GATE_CHANNELS, cfg.n_kv_heads, bias=False) if mixes and cfg.value_gate else None
        self.xsa = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.xsa and not self.paired else None  # a head, from 0
        self.cache = None  # an attention.KVCache while generating (Llama.setup_cache)

    def new_cache(self, batch: int, device, dtype) -> A.KVCache:
        pairs = 2 if self.paired else 1  # paired: half the heads, each over two keys a token
        return A.KVCache(batch, self.n_kv_heads // pairs, pairs * self.context, self.head_dim, device, dtype)

    def mixed_values(self, v, ve=None):
        """v (B, T, Hkv, hd) with the value embedding ve (B, T, Hkv * hd) mixed in, or scaled alone
        (value_scale)."""
        if ve is not None:
            return self.v_mix[0] * v + self.v_mix[1] * ve.view_as(v)
        return v if self.v_mix is None else self.v_mix[0] * v

    def heads(self, qkv, rope, ve=None):
        """(B, T, H + 2 Hkv, hd) -> q (B, T, H, hd), k, v (B, T, Hkv, hd): q and k normed (qk_norm) and
        rotated (rope: cos, sin (T, hd)), v mixed (mixed_values). Paired (record #58): head j and head j + H/2
        become one head over a sequence of 2T, token t's two at 2t and 2t + 1, so each query sees both heads' keys
        in one softmax: q (B, 2T, H/2, hd), k, v (B, 2T, Hkv/2, hd), rotated by that position (rope (2T, hd))."""
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.mixed_values(v, ve)
        if self.paired:
            q, k, v = (t.reshape(t.shape[0], 2 * t.shape[1], t.shape[2] // 2, t.shape[3]) for t in (q, k, v))
        return apply_rope(q, *rope).type_as(v), apply_rope(k, *rope).type_as(v), v

    def gated(self, y, x):
        """y: (B, T, H, hd) head outputs; x: (B, T, d) the attention's input."""
        if self.gate is None:
            return y
        return y * torch.sigmoid(self.gate(x[..., :GATE_CHANNELS]))[..., None]

    def forward(self, x, rope, masks: A.Masks, ve=None, v_add=None):
        """x: (B, T, d) the normed stream; ve: this layer's value embedding (B, T, Hkv * hd) or None; v_add: (B, T, d)
        added to the values as they leave wqkv (dense_last: n_kv_heads = n_heads), or None."""
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        if v_add is not None:  # padded with zeros over the q and k heads
            qkv = qkv + F.pad(v_add.view(B, T, self.n_kv_heads, self.head_dim), (0, 0, self.n_heads + self.n_kv_heads, 0))
        if self.ve_gate is not None:  # (B, T, Hkv) gates: each kv head's part of ve times 2 sigmoid(gate)
            ve = ve.view(B, T, self.n_kv_heads, -1) * 2 * torch.sigmoid(self.ve_gate(x[..., :GATE_CHANNELS]))[..., None]
        return self.wo(self.gated(self.attend(qkv, rope, masks, ve), x).reshape(B, T, -1))

    def attend(self, qkv, rope, masks: A.Masks, ve=None):
        """(B, T, H + 2 Hkv, hd) -> the heads' outputs (B, T, H, hd). Generating (masks.pos), the new keys and
        values go into the cache and the queries read it."""
        q, k, v = (t.transpose(1, 2) for t in self.heads(qkv, rope, ve))  # (B, heads, T, hd)
        own = v  # the tokens' own values (xsa)
        mask = masks.paired if self.paired else masks.short if self.short else masks.long
        if masks.pos is None:
            y = A.attend(q, self.offset(k), v, mask, self.scale, self.backend)
        else:
            k, v = self.cache.update(A.interleaved(masks.pos) if self.paired else masks.pos, k, v)
            read = mask.cache.shape[1]
            k, v = self.offset(k[:, :, :read]).to(q.dtype), v[:, :, :read].to(q.dtype)
            y = A.cached_attention(q, k, v, mask.cache, self.scale)
        y = y.transpose(1, 2)  # (B, T, H, hd); paired (B, 2T, H/2, hd): token t's heads j and j + H/2 at 2t and 2t + 1
        if self.xsa is not None:
            y = self.less_own_value(y, own.transpose(1, 2))
        return y.reshape(*qkv.shape[:2], self.n_heads, self.head_dim) if self.paired else y

    def less_own_value(self, y, v):
        """xsa (record #82's gated XSA): each head's output y (B, T, H, hd) less tanh(a_head) times its part along its
        token's own value v (B, T, Hkv, hd), normed: what a head carries of the token itself, a share learned from 0."""
        v = F.normalize(v, dim=-1, eps=1e-4).repeat_interleave(self.n_heads // self.n_kv_heads, dim=2)
        return y - torch.tanh(self.xsa).to(y.dtype)[:, None] * (y * v).sum(-1, keepdim=True) * v

    def offset(self, k):
        """The keys (B, Hkv, S, hd) of a sequence from its start, with key_offset each one's unrotated dims (hd/4 to
        hd/2 and 3hd/4 to hd under truncated RoPE) taken from the key before it, the first keeping its own: a
        query can then find "the token after an X" in one layer (modded-nanogpt record #49)."""
        if not self.key_offset:
            return k
        lo, hi = self.head_dim // 4, self.head_dim // 2
        before = torch.cat([k[:, :, :1], k[:, :, :-1]], dim=2)
        return torch.cat([k[..., :lo], before[..., lo:hi], k[..., hi:hi + lo], before[..., hi + lo:]], dim=-1)


class SwiGLU(nn.Module):
    """(silu(x W1) * x W3) W2 (Shazeer 2020), with W1 and W3 stacked into one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)  # (B, T, ffn_hidden) each
        return self.w2(F.silu(gate) * up)


class ReLU2(nn.Module):
    """relu(x W1)^2 W2 (So et al. 2021, "Primer"; modded-nanogpt and nanochat use it). Two matrices
    to SwiGLU's three, so at 1.5x the width it has the same parameters and FLOPs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)).square())


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

    def forward(self, x, x0, rope, masks: A.Masks, ve=None, attn_in=None, v_add=None):
        """x: (B, T, d) the stream; x0: the embedding it started from (x0_mix); ve: this layer's value
        embedding (or None); attn_in: (B, T, d) what the attention reads in x's place (saved_attn_input), or None;
        v_add: (B, T, d) added to the attention's values (dense_last), or None."""
        if self.x0_mix is not None:
            x = self.x0_mix[0] * x + self.x0_mix[1] * x0
        if self.attn is not None:
            x = x + self.attn(self.attn_norm(x if attn_in is None else attn_in), rope, masks, ve, v_add)
        return x + self.mlp_branch(x)

    def mlp_branch(self, x):
        return self.mlp(self.mlp_norm(x))


class Stream(nn.Module):
    """Where the stream starts: the token embedding (B, T, d), RMS-normed without a gain where embed_norm (record #8)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm, self.eps = cfg.embed_norm, cfg.norm_eps

    def forward(self, x):
        return rms_norm(x, self.eps) if self.norm else x


class Smear(nn.Module):
    """x + m * sigmoid(gate(x[..., :12])) * x_prev: each token's embedding x (B, T, d) gains a gated multiple of
    its predecessor's, x_prev (modded-nanogpt record #34). Gate and m start at zero: the model starts without it."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(GATE_CHANNELS, 1, bias=False)
        self.mix = nn.Parameter(torch.empty(1))

    def forward(self, x, x_prev):
        return x + self.mix * torch.sigmoid(self.gate(x[..., :GATE_CHANNELS])) * x_prev


class DenseMix(nn.Module):
    """A dense connection (dense_last; record #81, after MUDD, Xiao et al. 2025's multiway dynamic dense connections):
    from the stream x (B, T, d), `ways` sums of `sources` earlier streams (each (B, T, d)), each token weighting them
    by a small MLP of its own x, 0.2 / sqrt(sources) (gelu(x W1) W2 + b). reset_parameters starts W2 and b at zero:
    the connection starts as nothing and learns its way in."""

    def __init__(self, d: int, sources: int, ways: int, hidden: int = 64):
        super().__init__()
        self.sources, self.ways = sources, ways
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, ways * sources)

    def forward(self, x, sources: list) -> list:
        w = self.w2(F.gelu(self.w1(x))).unflatten(-1, (self.ways, self.sources)) * (0.2 / math.sqrt(self.sources))
        return [sum(w[..., way, k, None] * s for k, s in enumerate(sources)) for way in range(self.ways)]


class MultiTargets(NamedTuple):
    """The multi-token loss's targets (train.mtp_tokens): ids (B, T, K), the k+1-th token after each position (-1
    past the sequence's end), and weights (K,), each one's share of the loss (modded-nanogpt record #53)."""
    ids: torch.Tensor
    weights: torch.Tensor


class Output(nn.Module):
    """Where it ends: logits = softcap(x W^T) (W the head's, or the tied embedding's), and in training the mean
    cross-entropy against the targets. x: (B, T, d); W: (vocab, d); targets: (B, T), or MultiTargets."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cap, self.shift, self.temperature = cfg.logit_softcap, cfg.logit_shift, cfg.logit_temperature

    def logits(self, x, weight):
        return softcap(F.linear(x, weight), self.cap, self.shift, self.temperature)

    def loss(self, x, weight, targets):
        ids, weights = targets if isinstance(targets, MultiTargets) else (targets, None)
        return cross_entropy(F.linear(x, weight).flatten(0, 1), ids.flatten(0, 1), self.cap, weights, self.shift,
                             self.temperature)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # An empty weight skips nn.Embedding's own init (reset_parameters sets it; on "meta" it costs a second).
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.smear = Smear() if cfg.smear else None
        self.stream = Stream(cfg)
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, kv_dim, _weight=torch.empty(cfg.vocab_size, kv_dim))
                                          for _ in range(cfg.value_embeds))
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # U-net: the last L/2 blocks each add a learned multiple (from 1) of a first-half block's output,
        # the last block's from the first block's, and so on inwards.
        self.skip_weights = nn.Parameter(torch.empty(cfg.n_layers // 2)) if cfg.unet_skips else None
        # The bigram table (bigram_rows, d), zero at init: block i's input gains bigram_mix[i] (from 0.1) times
        # the row of each token's (previous, current) pair, statistics attention need not build. A lookup.
        rows = cfg.bigram_rows
        self.bigram = nn.Embedding(rows, cfg.d_model, _weight=torch.empty(rows, cfg.d_model)) if rows else None
        self.bigram_mix = nn.Parameter(torch.empty(cfg.n_layers)) if rows else None
        self.history = None  # an attention.TokenCache while generating with the bigram table (setup_cache)
        # Backout: the head reads x - b * (block backout_layer's output), b learned from 0.5.
        self.backout_mix = nn.Parameter(torch.empty(1)) if cfg.backout else None
        # dense_last: after block L-2, to the last block's values and to the stream, from (x0, block backout_layer's
        # output, its own); after block L-1, to the stream, from (x0, block L-2's output) (DenseMix, dense_step)
        self.dense = nn.ModuleList([DenseMix(cfg.d_model, 3, 2), DenseMix(cfg.d_model, 2, 1)]) if cfg.dense_last else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_gains)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.output = Output(cfg)
        for name in ("cos", "sin", "signs"):  # buffers, not parameters: they follow from the config (set_tables)
            self.register_buffer(name, None, persistent=False)
        self.set_tables()
        self.reset_parameters()

    def set_tables(self, window: int | None = None):
        """Set the buffers that follow from the config, never saved, on the embedding's device: RoPE's cos and sin
        (T, head_dim), kept in float64 and cast to the activations' dtype when used, so a float64 model is exact;
        bigram_signs' patterns (SIGN_PATTERNS, d), so a row the hash shares serves each pair in its own directions
        (record #83). At build, and again where a model was built without values (export's loader). rope_yarn: the
        tables of the long layers' `window` (None: attn_window), set in place as training grows it (train.follow_window)."""
        cfg, device = self.cfg, self.embed.weight.device
        self.tables_window = window or cfg.attn_window
        length = cfg.context * (2 if cfg.paired_heads else 1)  # paired heads: two keys a token
        yarn = (cfg.rope_yarn, self.tables_window) if cfg.rope_yarn else None
        cos, sin = rope_tables(cfg.head_dim, length, cfg.rope_theta, cfg.rope_truncate, yarn)
        if self.cos is not None and self.cos.shape == cos.shape:
            self.cos.copy_(cos)
            self.sin.copy_(sin)
        else:
            self.cos, self.sin = cos.to(device), sin.to(device)
        self.signs = sign_patterns(cfg.d_model).to(device) if cfg.bigram_signs else None

    def reset_parameters(self):
        """GPT-2's init, as nanoGPT and llm.c use it: every matrix normal with std 0.02, and the two projections
        that write into the residual stream (wo, w2) scaled by 1/sqrt(2 * layers), so the stream's variance does
        not grow with depth. Norm gains start at one. With zero_init those two start at zero instead (modded-
        nanogpt): each block starts as the identity; an untied head starts at zero too: uniform first logits.

        The modded-nanogpt parts start where that code starts them: the mixing scalars as the plain model
        (x0_mix (1, 0), skip weights 1, smear's 0) or not far (v_mix (0.5, 0.5), bigram_mix 0.1, backout_mix 0.5),
        gates and the bigram table at zero, and the value embeddings, and the embedding behind embed_norm when
        untied, at nn.Embedding's N(0, 1): a norm follows them, so only their scale against Adam's step matters."""
        scalars = {"x0_mix": (1.0, 0.0), "v_mix": (0.5, 0.5), "bigram_mix": (0.1,), "backout_mix": (0.5,), "mix": (0.0,),
                   "xsa": (0.0,)}
        unit_embedding = self.cfg.embed_norm and not self.cfg.tie_embeddings
        for name, p in self.named_parameters():
            if p.is_meta:  # shapes only (counting a 7B model): there are no values to set
                continue
            output_projection = name.endswith(("attn.wo.weight", "mlp.w2.weight"))
            last = name.rsplit(".", 1)[-1]
            if last in scalars:
                with torch.no_grad():  # a lone v_mix is (a,); bigram_mix is a layer's 0.1 each
                    p.copy_(torch.tensor(scalars[last][:p.numel()], dtype=p.dtype).expand(p.shape))
            elif name.startswith("value_embeds.") or (name == "embed.weight" and unit_embedding):
                nn.init.normal_(p, mean=0.0, std=1.0)
            elif ((output_projection or name == "head.weight") and self.cfg.zero_init
                  or name.endswith(("attn.gate.weight", "attn.ve_gate.weight", "bigram.weight", "smear.gate.weight"))
                  or name.startswith("dense.") and ".w2." in name):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02
                if output_projection:
                    std /= math.sqrt(2 * self.cfg.n_layers)
                nn.init.normal_(p, mean=0.0, std=std)
            else:
                nn.init.ones_(p)
        if self.cfg.mimetic_init and not self.embed.weight.is_meta:
            self.mimetic_value_output(self.cfg.mimetic_init)

    @torch.no_grad()
    def mimetic_value_output(self, b: float, noise: float = 0.01):
        """mimetic_init (modded-nanogpt record #64, after Trockman and Kolter's mimetic initialisation of attention):
        each attention's value map (wqkv's last d rows) starts at sqrt(b) I and its output map wo at -sqrt(b) I, each
        plus N(0, noise^2) to break the symmetry, so wo v = -b I: a layer starts by subtracting b times the average of
        the inputs it attends to, where trained layers end up, instead of at zero (zero_init)."""
        for attn in (block.attn for block in self.blocks if block.attn is not None):
            v, wo = attn.wqkv.weight[-self.cfg.d_model:], attn.wo.weight  # (d, d) each: n_kv_heads = n_heads
            eye = math.sqrt(b) * torch.eye(self.cfg.d_model, dtype=wo.dtype, device=wo.device)
            v.copy_(eye + noise * torch.randn_like(v))
            wo.copy_(-eye + noise * torch.randn_like(wo))

    def output_weight(self):
        return self.embed.weight if self.head is None else self.head.weight

    def setup_cache(self, batch: int, dtype=None):
        """Give every layer an attention.KVCache for `batch` sequences (and the model a TokenCache where a part reads
        predecessors). A cache of the same size and dtype is kept, not reallocated: a graph holds its address."""
        device, dtype = self.embed.weight.device, dtype or self.embed.weight.dtype
        for attn in self.attentions():
            cache = attn.cache
            if cache is None or cache.k.shape[0] != batch or cache.k.dtype != dtype or cache.k.device != device:
                attn.cache = attn.new_cache(batch, device, dtype)
        if self.reads_previous and (self.history is None or self.history.ids.shape[0] != batch
                                        or self.history.ids.device != device):
            self.history = A.TokenCache(batch, self.cfg.context, device)

    def value_rows(self, idx) -> list:
        """Each value-embedding table's rows for idx (B, T): a list of (B, T, n_kv_heads * head_dim)."""
        return [table(idx) for table in self.value_embeds]

    @property
    def reads_previous(self) -> bool:  # whether a part reads each token's predecessor (previous)
        return self.bigram is not None or self.smear is not None

    def previous(self, idx, masks: A.Masks):
        """Each token's predecessor (B, T), -1 before a sequence's first (across a packed document's start, as
        modded-nanogpt's); generating (masks.pos), read from the tokens seen so far. None where no part reads it."""
        if not self.reads_previous:
            return None
        if masks.pos is None:
            return torch.cat([idx.new_full((idx.shape[0], 1), -1), idx[:, :-1]], dim=1)
        seen, before = self.history.update(masks.pos, idx), masks.pos - 1  # (B, context), (T,)
        return torch.where(before >= 0, seen[:, before.clamp(min=0)], -1)

    def bigram_input(self, prev, idx):
        """The bigram table's row of each (previous, current) pair (B, T, d), times the pair's sign pattern."""
        xb = self.bigram(bigram_row(prev, idx, self.cfg.bigram_rows))
        return xb if self.signs is None else xb * self.signs[sign_row(prev, idx)]

    def embedded(self, idx, prev):
        """The stream's start (B, T, d): the token embedding, smeared with its predecessor's (smear), normed."""
        x = self.embed(idx)
        if self.smear is not None:
            x = self.smear(x, self.embed(prev.clamp(min=0)) * (prev >= 0)[..., None])
        return self.stream(x)

    def rope(self, T: int, pos, dtype):
        """RoPE's (cos, sin) at the tokens' positions (0..T-1, or pos (T,) when generating), each (T, head_dim); and with
        paired_heads the paired layers' at their two keys a token, 2p and 2p + 1 (2T, head_dim), else None."""
        at = slice(0, T) if pos is None else pos
        paired = (slice(0, 2 * T) if pos is None else A.interleaved(pos)) if self.cfg.paired_heads else None
        return tuple(None if p is None else (self.cos[p].to(dtype), self.sin[p].to(dtype)) for p in (at, paired))

    def attentions(self) -> list:
        """The blocks' attention modules (a skip_attn_layer block has none), first layer first."""
        return [block.attn for block in self.blocks if block.attn is not None]

    def dense_step(self, x, x0, backout, late):
        """dense_last (record #81) after block L-2 (late None): x plus a mix of (x0, block backout_layer's output, x),
        1.15 times another for the last block's values, and x itself as late; after block L-1: x plus a mix of (x0,
        late). Returns (x, the values' addend or None, late)."""
        if late is None:
            v_add, mix = self.dense[0](x, [x0, backout, x])
            return x + mix, 1.15 * v_add, x
        return x + self.dense[1](x, [x0, late])[0], None, late

    def forward(self, idx, targets=None, masks: A.Masks | None = None):
        """idx: (B, T) token ids. Returns logits (B, T, vocab) or, given targets (B, T), the mean
        cross-entropy. masks: attention.masks() for packed documents and the window schedule, or
        attention.cache_masks() when generating through the cache (setup_cache); None: causal within the
        model's own windows."""
        B, T = idx.shape
        if masks is None:
            masks = A.window_masks(T, self.cfg.windows())
        if masks.pos is None and T > self.cfg.context:
            raise ValueError(
                f"sequence of {T} tokens is longer than model.context={self.cfg.context}: "
                f"cut the input to the last {self.cfg.context} tokens or train with a longer context")
        prev = self.previous(idx, masks)
        x = self.embedded(idx, prev)
        rope, paired_rope = self.rope(T, masks.pos, x.dtype)
        xb = None if self.bigram is None else self.bigram_input(prev, idx)
        x0, ve, skips, saved, v_add, late = x, self.value_rows(idx), [], None, None, None
        n_skips = len(self.skip_weights) if self.skip_weights is not None else 0
        for i, block in enumerate(self.blocks):
            if i >= len(self.blocks) - n_skips:  # the U-net's second half: add the mirrored block's output
                x = x + self.skip_weights[i - (len(self.blocks) - n_skips)] * skips.pop()
            if xb is not None:
                x = x + self.bigram_mix[i] * xb.type_as(x)
            table, rope_i = self.cfg.value_table(i), paired_rope if self.cfg.paired_layer(i) else rope
            x = block(x, x0, rope_i, masks, ve[table] if table is not None else None, saved, v_add)
            if i < n_skips:
                skips.append(x)
            if i == self.cfg.backout_layer:
                backout = x
                saved = x if self.cfg.saved_attn_input else None
            if self.dense is not None and i >= len(self.blocks) - 2:
                x, v_add, late = self.dense_step(x, x0, backout, late)
        if self.backout_mix is not None:
            x = x - self.backout_mix * backout
        x = self.norm(x)
        if targets is None:
            return self.output.logits(x, self.output_weight())
        return self.output.loss(x, self.output_weight(), targets)


def cross_entropy(logits, targets, cap: float, weights=None, shift: float = 0.0, temperature: float = 0.0):
    """Mean cross-entropy of softcap(logits, cap, shift, temperature) (N, vocab) against targets (N,), the softmax in
    (at least) float32: bf16 logits lose about three digits of the loss. With weights (K,), targets (N, K): the mean
    over rows of sum_k weights[k] * the cross-entropy against targets[:, k], a -1 target counting 0 (MultiTargets)."""
    logits = softcap(logits.to(torch.promote_types(logits.dtype, torch.float32)), cap, shift, temperature)
    if weights is None:
        return F.cross_entropy(logits, targets)
    nll = -F.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0))  # (N, K)
    return (nll * (targets >= 0) * weights).sum(-1).mean()


def softcap(logits, cap: float, shift: float = 0.0, temperature: float = 0.0):
    """cap * tanh(logits / cap): logits stay within (-cap, cap), smoothly (Gemma 2's final-logit soft-cap). Near
    zero it is the identity, so it only bites on confident tokens. cap 0: off. modded-nanogpt's 30 * sigmoid(logits /
    7.5) is 15 + 15 * tanh(logits / 15), and a softmax does not see a constant added to every logit: it is this with
    cap 15. Shifted and wider, cap * tanh((logits + shift) / temperature) (temperature 0: the cap): record #54's
    23 * sigmoid((logits + 5) / 7.5) is cap 11.5, shift 5, temperature 15 (from 0, less room above than below)."""
    return cap * torch.tanh((logits + shift) / (temperature or cap)) if cap else logits
