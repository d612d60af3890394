"""Attention and its masks: which keys each query may see, and the one call that computes it.

A training or evaluation forward attends within each packed document (doc_ids) and within a sliding
window of keys; with short windows, most layers see half of it (ModelConfig.short_layer). masks() builds
all of that once per micro-batch into a Masks object, outside any compiled model: FlexAttention's block
masks on a GPU that runs them (blocks wholly hidden cost nothing), boolean masks elsewhere, nothing at all
for plain causal attention (the fastest kernel). Generation reads the KV cache through cache_masks().

model.py calls attend() in training and evaluation and cached_attention() when generating, through the caches
generation writes in place (KVCache, TokenCache); nothing else here is the model's business.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

# SDPA's backends a speed setting may pin (fastpaths.SpeedConfig.attention); "sdpa" lets PyTorch pick (cuDNN
# on an H100/H200 with torch 2.11), "textbook" writes out the T x T scores.
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
FLEX_BLOCK = 128  # FlexAttention's block of queries and of keys (its default)


@dataclass
class Mask:
    """What one kind of layer (long or short) may see. Training and evaluation: doc_ids and window (boolean
    masks), or block_mask (FlexAttention); generation: cache, which cache positions each new token reads."""
    doc_ids: torch.Tensor | None = None  # (B, T) document of each token
    window: int = 0  # a query sees at most this many keys, itself included (0: all before it)
    block_mask: object = None  # FlexAttention's BlockMask for doc_ids and window
    cache: torch.Tensor | None = None  # (T, S) booleans over the first S cache positions (generation)


@dataclass
class Masks:
    """The masks of one forward: the long layers', the short layers', the paired layers' (their sequence of two
    keys a token, token t's at 2t and 2t + 1: ModelConfig.paired_heads) and, when generating, the new tokens'
    cache positions pos (T,)."""
    long: Mask = field(default_factory=Mask)
    short: Mask = field(default_factory=Mask)
    paired: Mask = field(default_factory=Mask)
    pos: torch.Tensor | None = None


def interleaved(pos):
    """Token positions pos (T,) -> the positions (2T,) of their paired heads' keys: token p's at 2p and 2p + 1."""
    return torch.stack([2 * pos, 2 * pos + 1], dim=-1).flatten()


def flex_runs_on(device: torch.device) -> bool:
    """FlexAttention has a kernel on NVIDIA GPUs from Ampere (compute capability 8.0) on."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def masks(seq_len: int, device: torch.device, doc_ids=None, windows: tuple[int, ...] = (0, 0)) -> Masks:
    """The Masks of a micro-batch of seq_len tokens: within documents (doc_ids (B, T), or None) and within
    the sliding windows (long, short[, paired]) (ModelConfig.windows at this step; 0: none). A window as long as
    the sequence hides nothing. Block masks where FlexAttention runs, built here, once per micro-batch."""
    paired = Mask()
    if len(windows) > 2:  # the paired layers' sequence of 2T keys: token t's two at 2t and 2t + 1, in t's document
        paired = masks(2 * seq_len, device, None if doc_ids is None else doc_ids.repeat_interleave(2, dim=1),
                       (windows[2], 0)).long
    long, short = (w if 0 < w < seq_len else 0 for w in windows[:2])
    if flex_runs_on(device) and (doc_ids is not None or long or short):
        return Masks(Mask(block_mask=flex_block_mask(doc_ids, long, seq_len, device)),
                     Mask(block_mask=flex_block_mask(doc_ids, short, seq_len, device)) if short else Mask(), paired)
    return Masks(Mask(doc_ids, long), Mask(doc_ids, short), paired)


def window_masks(seq_len: int, windows: tuple[int, ...]) -> Masks:
    """Masks of causal attention within the windows (long, short[, paired]) alone, as boolean masks wherever the
    model runs: what a forward given no masks attends with (compiled inside it, where block masks would not be)."""
    long, short = (w if 0 < w < seq_len else 0 for w in windows[:2])
    paired = windows[2] if len(windows) > 2 and windows[2] < 2 * seq_len else 0  # over 2 * seq_len keys
    return Masks(Mask(window=long), Mask(window=short), Mask(window=paired))


def cache_masks(pos, read: int, windows: tuple[int, ...]) -> Masks:
    """The Masks of new tokens at cache positions pos (T,) reading the first `read` cache positions: a
    token at p sees positions <= p (those past the current length hold zeros or stale keys), and no further
    back than each kind of layer's window (long, short[, paired]). The paired layers' cache holds two keys a
    token (interleaved), and their 2T queries read its first 2 * read positions."""
    def seen(pos, read: int, window: int):  # (T, read) booleans
        keys = torch.arange(read, device=pos.device)[None, :]
        return (keys <= pos[:, None]) & ((pos[:, None] - keys < window) if window else True)

    paired = Mask(cache=seen(interleaved(pos), 2 * read, windows[2])) if len(windows) > 2 else Mask()
    return Masks(Mask(cache=seen(pos, read, windows[0])), Mask(cache=seen(pos, read, windows[1])), paired, pos=pos)


def attend(q, k, v, mask: Mask, scale: float | None = None, backend: str = "sdpa", flex_options: dict | None = None):
    """Causal attention in training and evaluation (Tq == Tk). q: (B, H, T, hd); k, v: (B, Hkv, T, hd), H a
    multiple of Hkv (grouped-query heads passed natively: no copies of K/V). mask: this layer's Mask.
    scale: the scores' (None: 1/sqrt(hd)). backend: "sdpa", an SDPA backend to pin, or "textbook".
    flex_options: FlexAttention's kernel options (None: Inductor's heuristics pick its tiles)."""
    if mask.block_mask is not None:
        return flex_attention_compiled()(q, k, v, block_mask=mask.block_mask, enable_gqa=True, scale=scale,
                                         kernel_options=flex_options or None)
    if mask.doc_ids is not None or mask.window:
        allowed = doc_mask(mask.doc_ids, mask.window, q.shape[2], q.device)[:, None]  # (B or 1, 1, T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True, scale=scale)
    if backend == "textbook":
        return textbook_attention(q, k, v, scale=scale)
    if backend in SDPA_BACKENDS and q.is_cuda:
        return pinned_sdpa(q, k, v, scale, backend)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)


def pinned_sdpa(q, k, v, scale: float | None, backend: str):
    """Causal SDPA through one backend. Entered inside the model, so that torch.compile traces the choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
        if backend == "efficient":  # this kernel refuses enable_gqa: give it K/V per query head
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)


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


def cached_attention(q, k, v, mask, scale: float | None = None):
    """Attention of Tq new tokens over the cache. q: (B, H, Tq, hd); k, v: (B, Hkv, S, hd) with S
    the cache positions read; mask: (Tq, S) booleans, True where a query may look.

    The G = H / Hkv query heads that share a kv head are folded into the query axis,
    (B, Hkv, G * Tq, hd), so grouped-query attention needs no copies of K/V. On CUDA this is two
    matmuls and a softmax (decode_attention_matmuls); elsewhere one masked SDPA call, which is
    fewer operations for the CPU to dispatch."""
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
    """softmax(q k^T * scale, masked) v for a few queries (scale None: 1/sqrt(hd)). With a handful of queries a
    fused attention kernel runs one thread block per (batch, kv head) down all the keys; a matmul
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


_flex = None


def flex_attention_compiled():
    # FlexAttention only becomes a fused kernel when compiled; compile it once per process.
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


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
    mask at all B x T x T pairs (docs/performance/training-speed.md, where the time goes). Exact, because
    documents are runs of equal, rising ids (data.ShardLoader numbers them by a cumulative sum): kv block j
    before query block i holds a pair of one document within reach iff its last id equals block i's first
    id and their nearest tokens are within reach; every pair is allowed iff both blocks lie in one document
    and their farthest tokens are within reach. tests/test_model.py checks it against create_block_mask."""
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


# --- Generation's caches -----------------------------------------------------------------

class KVCache(nn.Module):
    """One layer's keys and values for generation, (batch, n_kv_heads, context, head_dim), preallocated and
    written in place at their positions: every decode step sees tensors of the same shape at the same
    address, which lets a compiled step replay as a CUDA graph (generate.GraphDecoder). Never saved."""

    def __init__(self, batch: int, n_kv_heads: int, context: int, head_dim: int, device, dtype):
        super().__init__()
        shape = (batch, n_kv_heads, context, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, pos, k, v):
        """Write k, v (B, Hkv, T, hd) at positions pos (T,); return the whole cache."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        return self.k, self.v


class TokenCache(nn.Module):
    """The token ids generation has seen, (batch, context), written in place as KVCache's keys: where each new
    token's predecessor is read (Llama.previous). Never saved."""

    def __init__(self, batch: int, context: int, device):
        super().__init__()
        self.register_buffer("ids", torch.zeros(batch, context, dtype=torch.long, device=device), persistent=False)

    def update(self, pos, idx):
        """Write idx (B, T) at positions pos (T,); return every position's id (B, context)."""
        self.ids.index_copy_(1, pos, idx)
        return self.ids
