"""Fused GPU kernels, each the fast twin of a plain PyTorch function in model.py that stays the
reference, the CPU path and the fallback (model.cached_attention picks between them).

decode_attention: attention of one new token over the KV cache, in one Triton kernel.

Why: on an H200 the 88m decode step is a chain of about 120 small kernels and takes ~470 µs
per token whether attention reads 128 cached positions or 1,024 (docs/BENCHMARKS.md, "Decode
windows"): each kernel costs its few microseconds of launch and ramp, not its bytes. The plain
path spends three or four kernels per layer on attention (scores, mask and softmax, the weighted
sum of values, a copy); this is one. It reads the current length from a tensor, so a CUDA graph
replays it at every position, and it stops at that length instead of reading a masked window.

Triton ships with PyTorch's CUDA builds. Without it (PyTorch's CPU wheels) AVAILABLE is False
and model.py keeps the plain path. TRITON_INTERPRET=1 runs the kernel on CPU tensors, which is
how tests/test_kernels.py checks it without a GPU.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # PyTorch's CPU wheels come without Triton
    triton = None

AVAILABLE = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton runs kernels on CPU tensors (tests)
BLOCK_KEYS = 64  # cache positions per loop step: a 64 x 64 bf16 tile of K and of V, 8 KiB each

if AVAILABLE:

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, scale,
                                 sqb, sqh, sqg, skb, skh, sks, svb, svh, svs, sob, soh, sog,
                                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                                 BLOCK: tl.constexpr):
        """One program per (sequence, kv head): its G query heads against keys 0..pos, with an
        online softmax in float32 (running max m, running sum l, rescaled accumulator)."""
        b, h = tl.program_id(0), tl.program_id(1)
        length = tl.load(pos_ptr) + 1  # the new token sits at pos and sees positions 0..pos
        g, d = tl.arange(0, G_PAD), tl.arange(0, D)
        rows = g[:, None] < G  # G_PAD >= 16 rows for tl.dot; the padding rows are zeros
        q = tl.load(q_ptr + b * sqb + h * sqh + g[:, None] * sqg + d[None, :], mask=rows, other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(0, length, BLOCK):
            s = start + tl.arange(0, BLOCK)
            valid = s < length
            k = tl.load(k_ptr + b * skb + h * skh + s[:, None] * sks + d[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # (G_PAD, BLOCK), float32 accumulation
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + b * svb + h * svh + s[:, None] * svs + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + b * sob + h * soh + g[:, None] * sog + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rows)

    @torch.library.custom_op("onegpu::decode_attention", mutates_args=())
    def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v over cache positions 0..pos. q: (B, Hkv, G, hd), the G query
        heads of each kv head; k, v: (B, Hkv, S, hd) caches (S >= pos + 1); pos: (1,) int64.
        Returns (B, Hkv, G, hd) in q's dtype. A custom op: torch.compile calls it as one opaque
        step of the compiled decode, and the CUDA graph captures the launch."""
        B, Hkv, G, D = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        _decode_attention_kernel[(B, Hkv)](
            q, k, v, out, pos, D ** -0.5, q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK=BLOCK_KEYS)
        return out

    @decode_attention.register_fake
    def _(q, k, v, pos):  # shapes for tracing: the output is laid out like a contiguous q
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether decode_attention handles these inputs: one new token per sequence (q: (B, Hkv, G,
    hd)) on CUDA (or on CPU under Triton's interpreter), 16-bit floats (tl.dot would round
    float32 to TF32), a power-of-two head size of at least 16, rows of K contiguous."""
    hd = q.shape[-1]
    return (AVAILABLE and (q.is_cuda or INTERPRET) and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype and hd >= 16 and hd & (hd - 1) == 0 and k.stride(-1) == 1)
