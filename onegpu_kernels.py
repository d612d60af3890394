"""Fused GPU kernels, each the fast twin of plain PyTorch code in model.py that stays the
reference, the CPU path and the fallback.

decode_step: one new token's attention in one Triton kernel (QK-norm, RoPE, the value's mix, KV-cache
write, attention, the gate), each head's positions split over many programs with split_decode.
swiglu: silu(gate) * up from the stacked w13 output, forward and backward, one pass each.
relu2_matmul: the ReLU² MLP's up-projection with relu(h)^2 in its epilogue, so h is never stored.
relu2_fp8: the FP8 ReLU² MLP's activation and its derivative, each cast to e4m3 a row at a time in one pass.
transposed: a matrix of FP8 bytes transposed, the FP8 head's gradient for its weight gradient's matmul.
small_matmul: the decode step's matmuls of one to sixteen rows, spread over many programs.
decode_mlp: the ReLU² MLP of a decode step (both matmuls and the square) as one kernel of partial sums.
cross_entropy: the soft-capped training loss, forward and backward, one pass over the logits each; the
backward can also write the gradient's FP8 copy for the FP8 head (model.FP8HeadCrossEntropy).
qk_norm_rope_backward: QK-norm and RoPE's backward on the QKV projection's output, one pass.
gram: alpha x x^T + beta add, each symmetric tile once: two of the three products in Muon's
Newton-Schulz step (optim.orthogonalize with train.muon_kernel).

Why decode_step: on an H200 the 88m decode step is a chain of small kernels (132 of them, compiled by
Inductor) and took ~470 µs per token whether attention read 128 cached positions or 1,024
(docs/LOG.md, "Decode windows"): each kernel costs its microseconds of launch and ramp,
not its bytes. Between the QKV and output projections the plain compiled step runs about six
kernels per layer (RoPE on q, RoPE on k with its cache write, the v cache write, scores, softmax,
the weighted sum of values); this is one. It reads the position from a tensor, so a CUDA graph
replays it at every position, and it stops there instead of reading a masked window. Measured
(`python bench.py --generate`, batch 1): 132 kernels became 88, and with Inductor's max-autotune
decoding went from 2,861 to 3,342 tok/s. The recipes since norm q and k before RoPE, and the record's
mixes a value table into v and gates each head's output: in the kernel too, where the plain path runs
them as kernels of their own (the gate's 12-channel matmul alone is one per layer).

Why swiglu (on in the article's SwiGLU presets, since it measured +3.3-3.5% on an H200; today's ReLU²
presets do not run it): see the comment above its kernels.

Triton ships with PyTorch's CUDA builds. Without it (PyTorch's CPU wheels) AVAILABLE is False
and model.Attention keeps the plain path. TRITON_INTERPRET=1 runs the kernel on CPU tensors,
which is how tests/test_kernels.py checks it without a GPU.
"""

import contextlib
import os
from typing import Optional  # a custom op infers its schema: Optional[Tensor] reads as Tensor? on every torch since 2.4

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # PyTorch's CPU wheels come without Triton
    triton = None

AVAILABLE = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton runs kernels on CPU tensors (tests)
# decode_step's launch: cache positions per loop step, warps per program, pipelined loads. Timed
# alone on an H200 (18 settings, positions 16 to 1,000, docs/LOG.md, "The decode kernel's launch settings"), this
# was fastest at batch 1 over positions 16-512: 4.2 us at position 256, 6.7 at 512 (64 keys: 5.1, 8.7).
BLOCK_KEYS, DECODE_WARPS, DECODE_STAGES = 128, 4, 2
# decode_step with its positions split (model.split_decode): about this many programs in all, at most
# MAX_DECODE_SPLITS a head, and keys per loop step. A batch-1 step of the 88m default ran one program per
# kv head, 6 on the H200's 132 SMs, and took 13.2 us a layer where its cache's bytes need 0.3 us
# (docs/performance/generation.md): each program walks up to 516 positions alone. Timed alone on an H200
# at the 88m shapes (18 settings, batches 1 and 8, positions 16 to 1,000, docs/results/2026-12-03_decode-
# kernels-launch-sweep-88m_h200/), 64 keys and 256 programs summed 26.3 us over the four batch-1 positions
# and 32.4 over batch 8's, where 32 keys and 128 programs took 27.0 and 48.8 (one program a head: 38.9, 44.3).
DECODE_PROGRAMS, MAX_DECODE_SPLITS, SPLIT_BLOCK_KEYS = 256, 16, 64
SWIGLU_BLOCK = 1024  # hidden units per program in swiglu: half a row at the presets' 2,048
# relu2_matmul's candidate tiles (rows, columns, inner), warps and pipeline stages, which Triton's
# autotuner times once per shape on first use: the bf16 choices of Triton's matmul tutorial for Hopper
# and Ampere. The interpreter takes the first alone.
RELU2_TILES = ((128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
               (128, 64, 64, 4, 4), (64, 128, 64, 4, 4))
# qk_norm_rope_backward's candidate (tokens a tile, warps), autotuned once per shape; the interpreter takes
# the first. Compiled for sm_90 (Triton 3.9, the launch's specialization, 88m's heads of 128), 16 tokens at
# 4 warps take 96 registers, 32 at 8 and 64 at 16 take 100, none spilling. QK_BLOCKS tiles a program: it
# writes one partial gain gradient a program, 2 x 128
# float32 per QK_BLOCKS tiles of one head (18.9 MB at 16 tokens for 88m's micro-batch of 16 x 8,192
# tokens of 18 heads, against the 604 MB of qkv it reads).
QK_TILES, QK_BLOCKS = ((16, 4), (32, 8), (64, 16)), 8
# gram's candidate square tiles (side, inner), warps and stages, autotuned once per shape; the interpreter
# takes the first. Side 128 splits the presets' 768-wide Gram matrices into 6 x 6 tiles, of which 21 run.
GRAM_TILES = ((128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3))
# small_matmul's candidate tiles (output columns, inner), warps and stages, autotuned once per shape; the
# interpreter takes the first (the fewest programs: it runs them one by one). Few columns a program, so
# even a 768-wide output is split among 12 to 48 programs: Inductor's own templates for these one-row
# matmuls took 64 to 128 columns a program, 6 to 12 programs for the 768-wide outputs, and ran 7.6 to
# 20.7 us each at batch 8 on an H200 (the autotuning log of `python bench.py --generate --preset 88m`,
# docs/results/2026-12-02_generate-88m-default_h200/), where the weights' bytes need 0.3 to 10 us at
# the card's bandwidth.
SMALL_MATMUL_TILES = ((64, 128, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4), (16, 512, 4, 2), (32, 128, 4, 3),
                      (32, 256, 4, 3))
SMALL_MATMUL_ROWS = 16  # at most this many rows (tokens) a call: tl.dot's smallest tile side
# decode_mlp: hidden units a program (3,072: 96 programs; tl.dot's inner side at least 16), and its
# candidate tiles (inner columns of W1, output columns of W2), warps and stages, autotuned once per shape.
DECODE_MLP_HIDDEN = 32
# The wider ones, up to 1,024 columns a step (88m's whole 768-wide row), joined the list on 2026-12-03. Loading W2's tiles a
# step ahead was measured then too, and lost at every count and batch on an H200 (docs/LOG.md, 2026-12-03).
DECODE_MLP_TILES = ((128, 128, 4, 3), (256, 256, 4, 2), (64, 256, 4, 3), (128, 256, 8, 2), (256, 256, 4, 3),
                    (512, 512, 8, 2), (1024, 1024, 8, 1))
CE_BLOCK, CE_WARPS = 2048, 8  # logits per loop step and warps per row in cross_entropy (32,768: 16 steps)
# transposed's candidate tiles (rows, columns of the source, in bytes) and warps, autotuned once per shape; the
# interpreter takes the first. 128 bytes is one cache line: the widest tiles read and write whole lines.
TRANSPOSE_TILES = ((64, 64, 4), (128, 128, 8), (128, 128, 4), (64, 128, 4), (128, 64, 4), (256, 128, 8))


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched while the kernel before them still runs (CUDA's
    programmatic dependent launch, model.decode_pdl): an NVIDIA GPU of compute capability 9.0 (Hopper) or
    newer, with a Triton that has its wait (tl.extra.cuda.gdc_wait). Not in Triton's interpreter, which
    runs no device code. Called outside compiled code (model.Llama.setup_cache)."""
    return (AVAILABLE and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and hasattr(tl.extra.cuda, "gdc_wait"))


def _launch(pdl: bool) -> dict:
    """A launch's options: with pdl, launched as a programmatic dependent of the kernel before it."""
    return {"launch_pdl": True} if pdl else {}


if AVAILABLE:

    # Programmatic dependent launch (Hopper). A decode step is some 60 small kernels back to back, and each
    # one's launch and ramp-up used to wait for the one before it to end: replaying the 88m default's batch-1
    # step took 242 us, 38 us more than with Inductor's own kernels launched this way (204 us; one H200,
    # docs/LOG.md, 2026-12-04). A kernel launched so may start while the one before it runs, so it must
    # wait (griddepcontrol.wait) before it stores anything or loads what that kernel writes; the kernel after
    # it may then launch. What the kernel before does not write (weights, the KV cache's earlier positions)
    # it may load first, while that kernel finishes: every kernel before that one has already finished,
    # since each lets the next launch only after its own wait (Inductor's kernels too; cuBLAS's launch plainly).
    @triton.jit
    def _after_the_kernel_before(PDL: tl.constexpr):
        """With PDL (the launch's launch_pdl), wait until the kernel before this one has finished and its
        writes are visible, before this program stores anything or loads what that kernel writes; then let
        the next kernel launch (its own wait holds it until this one is done)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _decode_step_kernel(qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, out_ptr, pos_ptr, qg_ptr, kg_ptr, scale, eps,
                            window, vm_ptr, ve_ptr, gx_ptr, gw_ptr, part_ptr, count_ptr, s_qkv_b, s_qkv_h, s_c_b, s_c_h,
                            s_c_s, s_o_b, s_o_h, s_ve_b, s_gx_b, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                            G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, QK_NORM: tl.constexpr,
                            V_MIX: tl.constexpr, GATE: tl.constexpr, GC: tl.constexpr, GC_PAD: tl.constexpr,
                            SPLITS: tl.constexpr, PDL: tl.constexpr):
        """SPLITS programs per (sequence, kv head): with QK_NORM, RMSNorm with the gains at qg_ptr and kg_ptr
        on its G query heads and its new key; RoPE on them; the new value times vm_ptr[0] (V_MIX 1), plus
        vm_ptr[1] times its value embedding at ve_ptr (V_MIX 2); the new key and value written to the cache
        at pos, then attention over positions 0..pos (with a sliding window > 0, pos - window + 1..pos)
        with an online softmax in float32 (running max m, running sum l, rescaled accumulator); with GATE,
        each head's output times sigmoid(the first GC channels of the attention's input at gx_ptr dotted
        with the head's row of gw_ptr (H, GC)). The new token's own key and value come from registers, so
        nothing written here is read back.
        With SPLITS > 1 (flash-decoding) each program takes one of SPLITS equal runs of the cached
        positions, the first also the new token (and the cache write), and writes its (m, l, acc) to
        part_ptr (B, HKV, SPLITS, G, D + 2) in float32; the program that counts itself last at count_ptr
        (B, HKV) int32, zeros, combines them: acc_s scaled by exp(m_s - max m), summed, over the l_s summed
        the same way. It sets its count back to zero for the next call. PDL: see _after_the_kernel_before;
        launched so, a program reads the position and its first block of cached keys and values before it
        waits: the kernel before it (the QKV projection) writes neither, and every kernel before that one has
        finished once this one starts (each lets its dependent launch only after its own wait)."""
        b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        pos = tl.load(pos_ptr)
        g, d = tl.arange(0, G_PAD), tl.arange(0, D)
        cache = b * s_c_b + h * s_c_h
        first = tl.where(window > 0, tl.maximum(pos + 1 - window, 0), 0)  # the window's oldest key
        lo, hi = first, pos
        if SPLITS > 1:  # this program's run of the cached positions, whole blocks of keys each
            run = tl.cdiv(tl.cdiv(pos - first, SPLITS), BLOCK) * BLOCK
            lo = first + split * run
            hi = tl.minimum(lo + run, pos)
        s = lo + tl.arange(0, BLOCK)  # the run's first block of keys
        k, v = _cached_block(kc_ptr + cache, vc_ptr + cache, s, d, hi, s_c_s)
        _after_the_kernel_before(PDL)
        rows = g[:, None] < G  # G_PAD >= 16 rows for tl.dot; the padding rows are zeros
        q, k_new, v_new = _decode_token(qkv_ptr + b * s_qkv_b, cos_ptr, sin_ptr, qg_ptr, kg_ptr, eps, vm_ptr,
                                        ve_ptr + b * s_ve_b + h * D, h, g, d, rows, s_qkv_h, H, HKV, G, D, QK_NORM,
                                        V_MIX)
        k_new, v_new = k_new.to(kc_ptr.dtype.element_ty), v_new.to(vc_ptr.dtype.element_ty)
        own = split == 0  # the program that holds the new token: it writes it and counts it
        write = d + split * D < D  # all of d in split 0, none elsewhere
        tl.store(kc_ptr + cache + pos * s_c_s + d, k_new, mask=write)
        tl.store(vc_ptr + cache + pos * s_c_s + d, v_new, mask=write)
        # The new key's score, and the softmax's running max, sum and accumulator starting from it; a split
        # without it starts empty (a finite floor for m: exp(floor - m) is 0, never nan).
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        m = tl.where(own, m, -1e30)
        l = tl.where(own, tl.full([G_PAD], 1.0, tl.float32), 0.0)
        acc = tl.where(own, tl.zeros([G_PAD, D], tl.float32) + v_new.to(tl.float32)[None, :], 0.0)
        if lo < hi:  # the earlier positions, from the cache: the first block loaded above, then the rest
            m, l, acc = _attend_keys(q, k, v, s < hi, m, l, acc, scale)
        for start in range(lo + BLOCK, hi, BLOCK):
            s = start + tl.arange(0, BLOCK)
            k, v = _cached_block(kc_ptr + cache, vc_ptr + cache, s, d, hi, s_c_s)
            m, l, acc = _attend_keys(q, k, v, s < hi, m, l, acc, scale)
        out = b * s_o_b + (h * G + g)[:, None] * s_o_h + d[None, :]
        gate = gw_ptr + (h * G + g)[:, None] * GC  # this program's heads' rows of the gate
        if SPLITS > 1:
            _decode_combine(acc, m, l, part_ptr + (b * HKV + h) * SPLITS * G * (D + 2), count_ptr + b * HKV + h,
                            split, g, d, rows, out_ptr + out, gx_ptr + b * s_gx_b, gate, G, G_PAD, D, SPLITS, GATE,
                            GC, GC_PAD)
        else:
            _decode_finish(acc / l[:, None], rows, out_ptr + out, gx_ptr + b * s_gx_b, gate, GATE, GC, GC_PAD)

    @triton.jit
    def _cached_block(k_head, v_head, s, d, hi, s_c_s):
        """The cached keys and values (BLOCK, D) of one head at positions s, zeros from hi on."""
        at, valid = s[:, None] * s_c_s + d[None, :], (s < hi)[:, None]
        return tl.load(k_head + at, mask=valid, other=0.0), tl.load(v_head + at, mask=valid, other=0.0)

    @triton.jit
    def _attend_keys(q, k, v, valid, m, l, acc, scale):
        """One block of cached keys and values (BLOCK, D) into the online softmax of q (G_PAD, D): the running
        max m and sum l (G_PAD,) and accumulator acc (G_PAD, D), in float32; valid (BLOCK,): the keys to use."""
        scores = tl.dot(q, tl.trans(k)) * scale  # (G_PAD, BLOCK), float32 accumulation
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    @triton.jit
    def _decode_token(token, cos_ptr, sin_ptr, qg_ptr, kg_ptr, eps, vm_ptr, ve_row, h, g, d, rows, s_qkv_h,
                      H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                      V_MIX: tl.constexpr):
        """The new token's q (G_PAD, D) for kv head h's G query heads, in the input's dtype, and its key and
        value (D,) in float32: QK-norm, RoPE, the value's mix. token: its row of qkv (H + 2 HKV, D)."""
        # Rotate-half RoPE: x * cos + (-x2, x1) * sin, as model.apply_rope, in float32 then rounded.
        partner = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + d).to(tl.float32)
        sin = tl.load(sin_ptr + d).to(tl.float32) * sign
        heads = (h * G + g)[:, None] * s_qkv_h
        q_own = tl.load(token + heads + d[None, :], mask=rows, other=0.0).to(tl.float32)
        q_partner = tl.load(token + heads + partner[None, :], mask=rows, other=0.0).to(tl.float32)
        k_row = token + (H + h) * s_qkv_h
        k_own, k_partner = tl.load(k_row + d).to(tl.float32), tl.load(k_row + partner).to(tl.float32)
        if QK_NORM:  # x / rms(x) * gain, each head over its D channels, as model.RMSNorm in float32
            q_scale = 1.0 / tl.sqrt(tl.sum(q_own * q_own, axis=1) / D + eps)  # (G_PAD,)
            qg, qg_partner = tl.load(qg_ptr + d).to(tl.float32), tl.load(qg_ptr + partner).to(tl.float32)
            q_own = q_own * q_scale[:, None] * qg[None, :]
            q_partner = q_partner * q_scale[:, None] * qg_partner[None, :]
            k_scale = 1.0 / tl.sqrt(tl.sum(k_own * k_own, axis=0) / D + eps)
            k_own = k_own * k_scale * tl.load(kg_ptr + d).to(tl.float32)
            k_partner = k_partner * k_scale * tl.load(kg_ptr + partner).to(tl.float32)
        q = (q_own * cos[None, :] + q_partner * sin[None, :]).to(token.dtype.element_ty)
        v_new = tl.load(token + (H + HKV + h) * s_qkv_h + d).to(tl.float32)
        if V_MIX > 0:  # as model.Attention.mixed_values: a v (value_scale), a v + b ve (value embeddings)
            v_new = v_new * tl.load(vm_ptr).to(tl.float32)
            if V_MIX == 2:
                v_new += tl.load(vm_ptr + 1).to(tl.float32) * tl.load(ve_row + d).to(tl.float32)
        return q, k_own * cos + k_partner * sin, v_new

    @triton.jit
    def _decode_combine(acc, m, l, parts, count, split, g, d, rows, out, gate_x, gate_w, G: tl.constexpr,
                        G_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, GATE: tl.constexpr,
                        GC: tl.constexpr, GC_PAD: tl.constexpr):
        """split_decode's end: this split's (acc, m, l) for its G heads to parts (SPLITS, G, D + 2) in
        float32; the last split of the head to finish (by its count) combines them all, finishes the step
        and sets the count back to zero."""
        part = parts + split * G * (D + 2) + g[:, None] * (D + 2)
        tl.store(part + d[None, :], acc, mask=rows)
        tl.store(part + D + tl.zeros([G_PAD, 1], tl.int32), m[:, None], mask=rows)
        tl.store(part + D + 1 + tl.zeros([G_PAD, 1], tl.int32), l[:, None], mask=rows)
        tl.debug_barrier()  # every thread's stores before the count: the atomic's release covers them
        if tl.atomic_add(count, 1) == SPLITS - 1:  # acquire and release at the GPU's scope: the last of its head
            rows_of = parts + g[:, None] * (D + 2)  # L2 reads (.cg): the other programs wrote them
            top = tl.full([G_PAD, 1], -1e30, tl.float32)
            for i in tl.static_range(SPLITS):
                top = tl.maximum(top, tl.load(rows_of + i * G * (D + 2) + D, mask=rows, other=-1e30,
                                              cache_modifier=".cg"))
            total = tl.zeros([G_PAD, 1], tl.float32)
            summed = tl.zeros([G_PAD, D], tl.float32)
            for i in tl.static_range(SPLITS):
                part = rows_of + i * G * (D + 2)
                w = tl.exp(tl.load(part + D, mask=rows, other=-1e30, cache_modifier=".cg") - top)
                total += w * tl.load(part + D + 1, mask=rows, other=0.0, cache_modifier=".cg")
                summed += w * tl.load(part + d[None, :], mask=rows, other=0.0, cache_modifier=".cg")
            tl.store(count, 0)
            _decode_finish(summed / tl.where(rows, total, 1.0), rows, out, gate_x, gate_w, GATE, GC, GC_PAD)

    @triton.jit
    def _decode_finish(out, rows, out_ptr, gate_x, gate_w, GATE: tl.constexpr, GC: tl.constexpr, GC_PAD: tl.constexpr):
        """The decode step's last part: its G heads' outputs (G_PAD, D), each times sigmoid(its row of the
        gate (G_PAD rows of GC at gate_w) against the attention input's first GC channels at gate_x) with
        GATE, as model.Attention.gated, stored at out_ptr (G_PAD, D) pointers."""
        if GATE:
            c = tl.arange(0, GC_PAD)
            x_gate = tl.load(gate_x + c, mask=c < GC, other=0.0).to(tl.float32)
            w_gate = tl.load(gate_w + c[None, :], mask=rows & (c[None, :] < GC), other=0.0).to(tl.float32)
            out = out * tl.sigmoid(tl.sum(w_gate * x_gate[None, :], axis=1))[:, None]
        tl.store(out_ptr, out.to(out_ptr.dtype.element_ty), mask=rows)

    def decode_step(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, pos: torch.Tensor, scale: float, q_gain: Optional[torch.Tensor] = None,
                    k_gain: Optional[torch.Tensor] = None, eps: float = 0.0, window: int = 0,
                    v_mix: Optional[torch.Tensor] = None, ve: Optional[torch.Tensor] = None,
                    gate_x: Optional[torch.Tensor] = None, gate_w: Optional[torch.Tensor] = None,
                    counts: Optional[torch.Tensor] = None, pdl: bool = False) -> torch.Tensor:
        """One new token's attention, fused: QK-norm (given its gains q_gain and k_gain, (hd,) each,
        and eps), RoPE on q and k, the value mixed (v_mix: (a,) or (a, b): a v, or a v + b ve with ve
        (B, 1, Hkv * hd) the layer's value embedding), k and v written into the caches at pos,
        softmax(q k^T * scale) v over positions 0..pos, or the last `window` of them (scale: 1/sqrt(hd)
        for Llama's), and each head gated (gate_w (H, C) against the first C channels of gate_x
        (B, 1, d), the attention's input). qkv: (B, 1, H + 2 Hkv, hd), the QKV projection's output;
        cos, sin: (hd,) for position pos; k_cache, v_cache: (B, Hkv, S, hd); pos: (1,) int64. Returns
        (B, 1, H, hd). A custom op: torch.compile calls it as one opaque step of the compiled decode, and
        the CUDA graph captures its launch; what it folds in would otherwise be kernels of their own
        around it (the gate's one-row matmul was one, docs/LOG.md, 2026-12-02). With counts ((B, Hkv)
        int32 zeros, left zero: attention.KVCache's), each head's cached positions are split over
        decode_splits(B, Hkv) programs (model.split_decode). pdl: launched behind the kernel before it
        (dependent_launch; model.decode_pdl)."""
        # Every argument by position: torch 2.11's custom ops bump a mutated argument's version by its
        # index among the arguments passed, so counts given by keyword, or left to its default, raised
        # IndexError there (torch 2.13 fills the defaults in first).
        return _decode_step(qkv, cos, sin, k_cache, v_cache, pos, scale, q_gain, k_gain, eps, window, v_mix, ve,
                            gate_x, gate_w, counts, pdl)

    @torch.library.custom_op("onegpu::decode_step", mutates_args=("k_cache", "v_cache", "counts"))
    def _decode_step(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: torch.Tensor, scale: float, q_gain: Optional[torch.Tensor],
                     k_gain: Optional[torch.Tensor], eps: float, window: int, v_mix: Optional[torch.Tensor],
                     ve: Optional[torch.Tensor], gate_x: Optional[torch.Tensor], gate_w: Optional[torch.Tensor],
                     counts: Optional[torch.Tensor], pdl: bool) -> torch.Tensor:
        """decode_step's work, as one opaque op for torch.compile."""
        B, _, n, D = qkv.shape
        Hkv = k_cache.shape[1]
        H = n - 2 * Hkv
        out = qkv.new_empty(B, 1, H, D)
        splits = 1 if counts is None else decode_splits(B, Hkv)
        parts = qkv.new_empty(B, Hkv, splits, H // Hkv, D + 2, dtype=torch.float32) if splits > 1 else qkv
        norm, gated = q_gain is not None, gate_w is not None
        mix = 0 if v_mix is None else 1 if ve is None else 2
        ve_rows = ve.reshape(B, -1).contiguous() if ve is not None else qkv  # rows of unit-stride channels
        gate_rows = gate_x.reshape(B, -1).contiguous() if gated else qkv
        channels = gate_w.shape[1] if gated else 1
        _decode_step_kernel[(B, Hkv, splits)](
            qkv, cos, sin, k_cache, v_cache, out, pos, q_gain if norm else qkv, k_gain if norm else qkv, scale, eps,
            window, v_mix if mix else qkv, ve_rows, gate_rows, gate_w.contiguous() if gated else qkv, parts,
            counts if splits > 1 else pos, qkv.stride(0), qkv.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(2), ve_rows.stride(0), gate_rows.stride(0),
            H=H, HKV=Hkv, G=H // Hkv, G_PAD=max(16, triton.next_power_of_2(H // Hkv)), D=D,
            BLOCK=BLOCK_KEYS if splits == 1 else SPLIT_BLOCK_KEYS, QK_NORM=norm, V_MIX=mix, GATE=gated,
            GC=channels, GC_PAD=max(16, triton.next_power_of_2(channels)), SPLITS=splits, PDL=pdl,
            num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, **_launch(pdl))
        return out

    @_decode_step.register_fake
    def _(qkv, cos, sin, k_cache, v_cache, pos, scale, q_gain, k_gain, eps, window, v_mix, ve, gate_x, gate_w,
          counts, pdl):  # shapes for tracing
        B, _, n, D = qkv.shape
        return qkv.new_empty(B, 1, n - 2 * k_cache.shape[1], D)

    # SwiGLU between the w13 and w2 matmuls. Compiled by Inductor, its backward took 12 ms per 88m
    # step on an H200 where its reads and writes need 5.6 ms at full bandwidth (docs/performance/training-speed.md, where the time goes):
    # one pointwise kernel over the concatenated (tokens, 2 x hidden) gradient, each half loading its
    # own inputs. Here each program reads a row's gate, up and gradient once and writes both halves.
    @triton.jit
    def _swiglu_forward_kernel(h_ptr, out_ptr, hidden, BLOCK: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < hidden
        gate = tl.load(h_ptr + row * 2 * hidden + cols, mask=keep).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * hidden + hidden + cols, mask=keep).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _swiglu_backward_kernel(h_ptr, grad_ptr, dh_ptr, hidden, BLOCK: tl.constexpr):
        """d(silu(g) u)/du = silu(g); d/dg = u sigmoid(g) (1 + g (1 - sigmoid(g)))."""
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < hidden
        gate = tl.load(h_ptr + row * 2 * hidden + cols, mask=keep).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * hidden + hidden + cols, mask=keep).to(tl.float32)
        grad = tl.load(grad_ptr + row * hidden + cols, mask=keep).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = grad * gate * sig
        tl.store(dh_ptr + row * 2 * hidden + cols, d_gate.to(dh_ptr.dtype.element_ty), mask=keep)
        tl.store(dh_ptr + row * 2 * hidden + hidden + cols, d_up.to(dh_ptr.dtype.element_ty), mask=keep)

    def _swiglu_grid(h13: torch.Tensor):
        hidden = h13.shape[-1] // 2
        return (h13.numel() // (2 * hidden), triton.cdiv(hidden, SWIGLU_BLOCK)), hidden

    @torch.library.custom_op("onegpu::swiglu", mutates_args=())
    def swiglu(h13: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for h13 = [gate | up] (..., 2 x hidden), contiguous; returns (..., hidden),
        computed in float32 and rounded once. A custom op with its own backward (below): under
        torch.compile both stay single kernels."""
        grid, hidden = _swiglu_grid(h13)
        out = h13.new_empty(*h13.shape[:-1], hidden)
        _swiglu_forward_kernel[grid](h13, out, hidden, BLOCK=SWIGLU_BLOCK)
        return out

    @swiglu.register_fake
    def _(h13):
        return h13.new_empty(*h13.shape[:-1], h13.shape[-1] // 2)

    @torch.library.custom_op("onegpu::swiglu_backward", mutates_args=())
    def swiglu_backward(grad: torch.Tensor, h13: torch.Tensor) -> torch.Tensor:
        """The gradient with respect to h13 (..., 2 x hidden) of swiglu, given grad (..., hidden)."""
        grid, hidden = _swiglu_grid(h13)
        dh = torch.empty_like(h13)
        _swiglu_backward_kernel[grid](h13, grad.contiguous(), dh, hidden, BLOCK=SWIGLU_BLOCK)
        return dh

    @swiglu_backward.register_fake
    def _(grad, h13):
        return torch.empty_like(h13)

    def _swiglu_save(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def _swiglu_grad(ctx, grad):
        return swiglu_backward(grad, ctx.saved_tensors[0])

    swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_save)


    # Cross-entropy of soft-capped logits, the last op of training. Compiled by Inductor, forward and
    # backward took 5.18 ms per 32,768 x 32,768 bf16 micro-batch on an H200 (docs/performance/training-speed.md, against
    # the record holder), where reading the logits twice and writing their gradient once needs about 1.4
    # ms at 4.8 TB/s; the first version of these kernels took 4.00, bound by its exponentials. One program
    # per row: the forward reads the row once (a logsumexp against a fixed shift for capped logits, else
    # online, as FlashAttention's softmax) and keeps only its logsumexp; the backward reads it once more
    # and writes the gradient in the logits' dtype. The forward was bound by the GPU's special-function
    # units, not by its memory: 16 results a clock an SM on Hopper (the CUDA C++ Programming Guide's
    # arithmetic-instruction throughput table, compute capability 9.0), about 3.8 T a second on an H200.
    # With the cap as 2c * sigmoid(2z / c) - c, the sm_90 build took 17 exponentials and 10 reciprocals per
    # 8 logits: 7.9 ms for the forward of a 262,144 x 32,768 step at 88m, against 3.6 to read the logits
    # once and the 9.0 measured (docs/performance/training-speed.md, where the time goes). So the cap is c * tanh(z / c)
    # from the hardware's tanh (PTX tanh.approx.f32, relative error under 2^-10.987 by the PTX ISA: 0.008 at
    # the cap of 15, where bf16 logits near it are 0.06 apart), and its slope 1 - tanh^2 from the same
    # value: 2.25 results a logit. The interpreter has no PTX: there the cap keeps the sigmoid form.
    _PTX = tl.constexpr(not INTERPRET)  # a kernel reads a module's global only as a constexpr

    # A shift and a temperature (model.softcap) are the cap of the logit alpha z + beta, alpha = cap / temperature
    # and beta = shift * alpha (cap_terms): one multiply-add a logit, and the slope times alpha.
    @triton.jit
    def _capped(z, cap, alpha, beta, CAPPED: tl.constexpr):
        if CAPPED:
            u = z * alpha + beta
            if not _PTX:
                t = 2.0 * tl.sigmoid(u * (2.0 / cap)) - 1.0
            else:
                t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u * (1.0 / cap)],
                                              dtype=tl.float32, is_pure=True, pack=1)
            return cap * t, alpha * (1.0 - t * t)
        return z, z * 0.0 + 1.0

    @triton.jit
    def _row_logsumexp(z_row, vocab, cap, alpha, beta, BLOCK: tl.constexpr, CAPPED: tl.constexpr,
                       FIXED_SHIFT: tl.constexpr):
        """The logsumexp of softcap(z) over one row of vocab logits, read once."""
        # A capped logit lies within (-cap, cap), so exp(y - cap) lies within (exp(-2 cap), 1]: for a cap of
        # at most 40 (FIXED_SHIFT) it neither overflows nor leaves float32's normal range, and the sum runs
        # against that fixed shift, one exponential a logit besides the cap's. Otherwise a running max, one
        # per block (it starts finite, so the first rescale is exp(-huge) = 0).
        if FIXED_SHIFT:
            m = cap
        else:
            m = -1e30
        # With the fixed shift each lane keeps its own sum, added up once after the loop: a sum across the
        # block every step cost two barriers, so no warp could run ahead of the others to its next load. The
        # loss and its gradient from one launch took 7.05 ms a micro-batch of 131,072 x 32,768 logits this
        # way, 7.38 before (two H200s the same hour); loading blocks ahead through tl.range's stages gave
        # 6.95 to 7.57 (docs/LOG.md, 2026-12-04).
        sums = tl.zeros([BLOCK], dtype=tl.float32)
        total = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < vocab
            y, _ = _capped(tl.load(z_row + cols, mask=keep, other=0.0).to(tl.float32), cap, alpha, beta, CAPPED)
            y = tl.where(keep, y, float("-inf"))  # exp(-inf - m) = 0 past the row's end
            if FIXED_SHIFT:
                sums += tl.exp(y - m)
            else:
                new = tl.maximum(m, tl.max(y, 0))
                total = total * tl.exp(m - new) + tl.sum(tl.exp(y - new), 0)
                m = new
        if FIXED_SHIFT:
            total = tl.sum(sums, 0)
        return m + tl.log(total)

    @triton.jit
    def _block_cols(step, steps, BLOCK: tl.constexpr, BACKWARDS: tl.constexpr):
        """The columns of a row's block `step` of `steps`; BACKWARDS: the row's blocks last to first."""
        block = step
        if BACKWARDS:
            block = steps - 1 - step
        return block * BLOCK + tl.arange(0, BLOCK)

    @triton.jit
    def _store_gradient(d, dz_row, dz8_row, cols, keep, fp8_scale, fp8_max, FP8: tl.constexpr, DZ: tl.constexpr):
        """A block's gradient d in dz's dtype (DZ: else not written); with FP8 also times fp8_scale, clamped to
        +-fp8_max, in dz8's FP8 dtype."""
        if DZ:
            tl.store(dz_row + cols, d.to(dz_row.dtype.element_ty), mask=keep)
        if FP8:
            d8 = tl.minimum(tl.maximum(d * fp8_scale, -fp8_max), fp8_max)
            tl.store(dz8_row + cols, d8.to(dz8_row.dtype.element_ty), mask=keep)

    @triton.jit
    def _row_gradient(z_row, dz_row, dz8_row, vocab, target, lse, g, cap, alpha, beta, fp8_scale, fp8_max,
                      BLOCK: tl.constexpr, CAPPED: tl.constexpr, FP8: tl.constexpr, BACKWARDS: tl.constexpr,
                      DZ: tl.constexpr = True):
        """d loss_row / d z = (softmax(y) - onehot(target)) * dy/dz, times g, stored by _store_gradient; BACKWARDS:
        the row's blocks last to first."""
        steps = tl.cdiv(vocab, BLOCK)
        for step in range(0, steps):
            cols = _block_cols(step, steps, BLOCK, BACKWARDS)
            keep = cols < vocab
            z = tl.load(z_row + cols, mask=keep, other=0.0).to(tl.float32)
            y, slope = _capped(z, cap, alpha, beta, CAPPED)
            p = tl.exp(y - lse)
            d = (p - tl.where(cols == target, 1.0, 0.0)) * slope * g
            _store_gradient(d, dz_row, dz8_row, cols, keep, fp8_scale, fp8_max, FP8, DZ)

    @triton.jit
    def _cross_entropy_forward_kernel(z_ptr, t_ptr, loss_ptr, lse_ptr, vocab, cap, alpha, beta, BLOCK: tl.constexpr,
                                      CAPPED: tl.constexpr, FIXED_SHIFT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * vocab
        lse = _row_logsumexp(z_row, vocab, cap, alpha, beta, BLOCK, CAPPED, FIXED_SHIFT)
        y_t, _ = _capped(tl.load(z_row + tl.load(t_ptr + row)).to(tl.float32), cap, alpha, beta, CAPPED)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, lse - y_t)

    @triton.jit
    def _cross_entropy_backward_kernel(z_ptr, t_ptr, lse_ptr, g_ptr, dz_ptr, dz8_ptr, vocab, cap, alpha, beta,
                                       fp8_scale, fp8_max, BLOCK: tl.constexpr, CAPPED: tl.constexpr,
                                       FP8: tl.constexpr):
        """The gradient of sum(g * loss) for the per-row g at g_ptr (_row_gradient)."""
        row = tl.program_id(0).to(tl.int64)
        _row_gradient(z_ptr + row * vocab, dz_ptr + row * vocab, dz8_ptr + row * vocab, vocab, tl.load(t_ptr + row),
                      tl.load(lse_ptr + row), tl.load(g_ptr + row), cap, alpha, beta, fp8_scale, fp8_max, BLOCK, CAPPED,
                      FP8, False)

    # The loss and its gradient in one launch, for the FP8 head (model.FP8HeadCrossEntropy), whose backward
    # can scale the products by the incoming gradient where the loss kernel's backward had to scale every
    # logit's. Apart, the two kernels read each row twice from memory and write its gradient: 6 bytes a
    # logit, 7 with the FP8 copy, 5.95 and 10.79 ms for 262,144 x 32,768 logits at 88m on an H200 (the
    # defaults' profile, docs/PERFORMANCE.md). Here the second read of a row (64 KB at 32,768) follows the
    # first within one program and starts from the block read last, the likeliest still in the L2 cache: 5
    # bytes a logit from memory. Measured on an H200, 7.05 ms a micro-batch of 131,072 x 32,768 logits
    # against 7.80 for the two kernels (docs/LOG.md, 2026-12-04): 3.0 TB/s, with the tanh and exponentials
    # (4.25 special-function results a logit) at about two thirds of those units' rate, so neither bounds it.
    @triton.jit
    def _cross_entropy_and_gradient_kernel(z_ptr, t_ptr, loss_ptr, dz_ptr, dz8_ptr, vocab, cap, alpha, beta, row_grad,
                                           fp8_scale, fp8_max, BLOCK: tl.constexpr, CAPPED: tl.constexpr,
                                           FIXED_SHIFT: tl.constexpr, FP8: tl.constexpr, DZ: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * vocab
        lse, target = _row_logsumexp(z_row, vocab, cap, alpha, beta, BLOCK, CAPPED, FIXED_SHIFT), tl.load(t_ptr + row)
        y_t, _ = _capped(tl.load(z_row + target).to(tl.float32), cap, alpha, beta, CAPPED)
        tl.store(loss_ptr + row, lse - y_t)
        _row_gradient(z_row, dz_ptr + row * vocab, dz8_ptr + row * vocab, vocab, target, lse, row_grad, cap, alpha,
                      beta, fp8_scale, fp8_max, BLOCK, CAPPED, FP8, True, DZ)

    def cap_terms(cap: float, shift: float, temperature: float) -> tuple[float, float, float]:
        """The kernels' (cap, alpha, beta): model.softcap(z, cap, shift, temperature) is cap * tanh(u / cap) of
        u = alpha z + beta, alpha = cap / temperature (1 where temperature is 0: the cap) and beta = shift * alpha."""
        alpha = cap / temperature if cap and temperature else 1.0
        return float(cap), float(alpha), float(shift * alpha)

    @torch.library.custom_op("onegpu::cross_entropy", mutates_args=())
    def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, cap: float, shift: float = 0.0,
                      temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row cross-entropy of softcap(logits, cap, shift, temperature) (model.softcap; cap 0: none) against
        targets, in float32, and each row's logsumexp (kept for the backward). logits: (N, vocab), contiguous;
        targets: (N,) integers. Returns (loss (N,), lse (N,)), both float32."""
        n, vocab = logits.shape
        loss, lse = (logits.new_empty(n, dtype=torch.float32) for _ in range(2))
        _cross_entropy_forward_kernel[(n,)](logits, targets, loss, lse, vocab, *cap_terms(cap, shift, temperature),
                                            BLOCK=CE_BLOCK, CAPPED=cap > 0, FIXED_SHIFT=0 < cap <= 40,
                                            num_warps=CE_WARPS)
        return loss, lse

    @cross_entropy.register_fake
    def _(logits, targets, cap, shift=0.0, temperature=0.0):
        return logits.new_empty(logits.shape[0], dtype=torch.float32), logits.new_empty(logits.shape[0], dtype=torch.float32)

    def _logit_gradients(logits, fp8_scale: float, fp8_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for the logits' gradient (empty with fp8_only and fp8_scale), and for its e5m2 copy where
        fp8_scale is set (else empty)."""
        return (logits.new_empty((0,)) if fp8_only and fp8_scale else torch.empty_like(logits),
                logits.new_empty(logits.shape if fp8_scale else (0,), dtype=torch.float8_e5m2))

    @torch.library.custom_op("onegpu::cross_entropy_backward", mutates_args=())
    def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                               cap: float, fp8_scale: float = 0.0, shift: float = 0.0,
                               temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient with respect to logits (N, vocab), in their dtype, of sum(grad * cross_entropy's
        loss), and with fp8_scale > 0 the same gradient times fp8_scale in float8_e5m2, written in the
        same pass (the FP8 head's input gradient reads it; model.FP8HeadCrossEntropy). Without, the
        second tensor is empty."""
        n, vocab = logits.shape
        dz, dz8 = _logit_gradients(logits, fp8_scale)
        # Without the FP8 copy its pointer is dz's, never written: no FP8 type reaches a GPU without it.
        _cross_entropy_backward_kernel[(n,)](logits, targets, lse, grad.float().contiguous(), dz,
                                             dz8 if fp8_scale else dz, vocab, *cap_terms(cap, shift, temperature),
                                             float(fp8_scale), torch.finfo(torch.float8_e5m2).max, BLOCK=CE_BLOCK,
                                             CAPPED=cap > 0, FP8=fp8_scale > 0, num_warps=CE_WARPS)
        return dz, dz8

    @cross_entropy_backward.register_fake
    def _(logits, targets, lse, grad, cap, fp8_scale=0.0, shift=0.0, temperature=0.0):
        return _logit_gradients(logits, fp8_scale)

    @torch.library.custom_op("onegpu::cross_entropy_and_gradient", mutates_args=())
    def cross_entropy_and_gradient(logits: torch.Tensor, targets: torch.Tensor, cap: float, fp8_scale: float = 0.0,
                                   fp8_only: bool = False, shift: float = 0.0,
                                   temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cross_entropy's per-row loss and, from the same launch, cross_entropy_backward's two gradients
        of the mean loss (each row's incoming gradient 1 / N); fp8_only (with fp8_scale): the e5m2 one alone,
        dz empty. Returns (loss (N,), dz, dz8)."""
        n, vocab = logits.shape
        loss, (dz, dz8) = logits.new_empty(n, dtype=torch.float32), _logit_gradients(logits, fp8_scale, fp8_only)
        _cross_entropy_and_gradient_kernel[(n,)](logits, targets, loss, dz, dz8 if fp8_scale else dz, vocab,
                                                 *cap_terms(cap, shift, temperature), 1.0 / n, float(fp8_scale),
                                                 torch.finfo(torch.float8_e5m2).max, BLOCK=CE_BLOCK, CAPPED=cap > 0,
                                                 FIXED_SHIFT=0 < cap <= 40, FP8=fp8_scale > 0,
                                                 DZ=not (fp8_only and fp8_scale),
                                                 num_warps=CE_WARPS)
        return loss, dz, dz8

    @cross_entropy_and_gradient.register_fake
    def _(logits, targets, cap, fp8_scale=0.0, fp8_only=False, shift=0.0, temperature=0.0):
        return logits.new_empty(logits.shape[0], dtype=torch.float32), *_logit_gradients(logits, fp8_scale, fp8_only)

    def _cross_entropy_save(ctx, inputs, output):
        logits, targets, *ctx.cap = inputs  # cap, shift, temperature
        ctx.save_for_backward(logits, targets, output[1])

    def _cross_entropy_grad(ctx, grad_loss, grad_lse):
        logits, targets, lse = ctx.saved_tensors
        cap, shift, temperature = ctx.cap
        dz = cross_entropy_backward(logits, targets, lse, grad_loss, cap, shift=shift, temperature=temperature)[0]
        return dz, None, None, None, None

    cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_save)

    # The multi-token loss (model.MultiTargets): a row's logits against K targets, each weighted. The row's
    # logsumexp is one read of it, as above; the K targets' logits are K loads; the gradient one more read,
    # (softmax(y) * sum of the row's weights - the weights where a column is a target) * dy/dz.
    @triton.jit
    def _multi_row_loss(z_row, t_row, w_ptr, lse, cap, alpha, beta, K: tl.constexpr, CAPPED: tl.constexpr):
        """sum_k w_k (lse - y_k) over the row's K targets at t_row, those past the sequence's end (-1) left out."""
        loss = 0.0
        for k in tl.static_range(K):
            target = tl.load(t_row + k)
            y_t, _ = _capped(tl.load(z_row + tl.maximum(target, 0)).to(tl.float32), cap, alpha, beta, CAPPED)
            loss += tl.where(target >= 0, tl.load(w_ptr + k) * (lse - y_t), 0.0)
        return loss

    @triton.jit
    def _multi_row_gradient(z_row, dz_row, dz8_row, t_row, w_ptr, vocab, lse, g, cap, alpha, beta, fp8_scale, fp8_max,
                            K: tl.constexpr, BLOCK: tl.constexpr, CAPPED: tl.constexpr, FP8: tl.constexpr,
                            BACKWARDS: tl.constexpr, DZ: tl.constexpr):
        """_row_gradient for K weighted targets: (softmax(y) * the row's weights' sum - the weights where a column is
        a target) * dy/dz, times g."""
        weight = 0.0  # the row's targets' weights, those past the sequence's end (-1) left out
        for k in tl.static_range(K):
            weight += tl.where(tl.load(t_row + k) >= 0, tl.load(w_ptr + k), 0.0)
        steps = tl.cdiv(vocab, BLOCK)
        for step in range(0, steps):
            cols = _block_cols(step, steps, BLOCK, BACKWARDS)
            keep = cols < vocab
            y, slope = _capped(tl.load(z_row + cols, mask=keep, other=0.0).to(tl.float32), cap, alpha, beta, CAPPED)
            hit = tl.zeros([BLOCK], dtype=tl.float32)
            for k in tl.static_range(K):
                hit += tl.where(cols == tl.load(t_row + k), tl.load(w_ptr + k), 0.0)
            d = (tl.exp(y - lse) * weight - hit) * slope * g
            _store_gradient(d, dz_row, dz8_row, cols, keep, fp8_scale, fp8_max, FP8, DZ)

    @triton.jit
    def _multi_cross_entropy_forward_kernel(z_ptr, t_ptr, w_ptr, loss_ptr, lse_ptr, vocab, cap, alpha, beta,
                                            K: tl.constexpr,
                                            BLOCK: tl.constexpr, CAPPED: tl.constexpr, FIXED_SHIFT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * vocab
        lse = _row_logsumexp(z_row, vocab, cap, alpha, beta, BLOCK, CAPPED, FIXED_SHIFT)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, _multi_row_loss(z_row, t_ptr + row * K, w_ptr, lse, cap, alpha, beta, K, CAPPED))

    @triton.jit
    def _multi_cross_entropy_backward_kernel(z_ptr, t_ptr, w_ptr, lse_ptr, g_ptr, dz_ptr, vocab, cap, alpha, beta,
                                             K: tl.constexpr, BLOCK: tl.constexpr, CAPPED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        dz_row = dz_ptr + row * vocab  # no FP8 copy: its pointer is dz's, never written
        _multi_row_gradient(z_ptr + row * vocab, dz_row, dz_row, t_ptr + row * K, w_ptr, vocab, tl.load(lse_ptr + row),
                            tl.load(g_ptr + row), cap, alpha, beta, 0.0, 0.0, K, BLOCK, CAPPED, False, False, True)

    # The multi-token loss and its gradient in one launch, for the FP8 head (fp8.FP8HeadCrossEntropy), as
    # _cross_entropy_and_gradient_kernel for one target: the row's second read starts from the block read last.
    @triton.jit
    def _multi_cross_entropy_and_gradient_kernel(z_ptr, t_ptr, w_ptr, loss_ptr, dz_ptr, dz8_ptr, vocab, cap, alpha,
                                                 beta, row_grad, fp8_scale, fp8_max, K: tl.constexpr,
                                                 BLOCK: tl.constexpr, CAPPED: tl.constexpr, FIXED_SHIFT: tl.constexpr,
                                                 FP8: tl.constexpr, DZ: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row, t_row = z_ptr + row * vocab, t_ptr + row * K
        lse = _row_logsumexp(z_row, vocab, cap, alpha, beta, BLOCK, CAPPED, FIXED_SHIFT)
        tl.store(loss_ptr + row, _multi_row_loss(z_row, t_row, w_ptr, lse, cap, alpha, beta, K, CAPPED))
        _multi_row_gradient(z_row, dz_ptr + row * vocab, dz8_ptr + row * vocab, t_row, w_ptr, vocab, lse, row_grad, cap,
                            alpha, beta, fp8_scale, fp8_max, K, BLOCK, CAPPED, FP8, True, DZ)

    @torch.library.custom_op("onegpu::multi_cross_entropy", mutates_args=())
    def multi_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, cap: float,
                            shift: float = 0.0, temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, sum_k weights[k] * the cross-entropy of softcap(logits, cap, shift, temperature) against
        targets[:, k] (-1: none, counting 0), in float32, and the row's logsumexp. logits: (N, vocab), contiguous;
        targets: (N, K) int64; weights: (K,) float32. Returns (loss (N,), lse (N,))."""
        n, vocab = logits.shape
        loss, lse = (logits.new_empty(n, dtype=torch.float32) for _ in range(2))
        _multi_cross_entropy_forward_kernel[(n,)](logits, targets.contiguous(), weights.float().contiguous(), loss,
                                                  lse, vocab, *cap_terms(cap, shift, temperature), K=targets.shape[1],
                                                  BLOCK=CE_BLOCK,
                                                  CAPPED=cap > 0, FIXED_SHIFT=0 < cap <= 40, num_warps=CE_WARPS)
        return loss, lse

    @multi_cross_entropy.register_fake
    def _(logits, targets, weights, cap, shift=0.0, temperature=0.0):
        return logits.new_empty(logits.shape[0], dtype=torch.float32), logits.new_empty(logits.shape[0], dtype=torch.float32)

    @torch.library.custom_op("onegpu::multi_cross_entropy_backward", mutates_args=())
    def multi_cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                                     lse: torch.Tensor, grad: torch.Tensor, cap: float, shift: float = 0.0,
                                     temperature: float = 0.0) -> torch.Tensor:
        """The gradient with respect to logits (N, vocab), in their dtype, of sum(grad * multi_cross_entropy's loss)."""
        n, vocab = logits.shape
        dz = torch.empty_like(logits)
        _multi_cross_entropy_backward_kernel[(n,)](logits, targets.contiguous(), weights.float().contiguous(), lse,
                                                   grad.float().contiguous(), dz, vocab,
                                                   *cap_terms(cap, shift, temperature), K=targets.shape[1],
                                                   BLOCK=CE_BLOCK, CAPPED=cap > 0, num_warps=CE_WARPS)
        return dz

    @multi_cross_entropy_backward.register_fake
    def _(logits, targets, weights, lse, grad, cap, shift=0.0, temperature=0.0):
        return torch.empty_like(logits)

    def _multi_cross_entropy_save(ctx, inputs, output):
        logits, targets, weights, *ctx.cap = inputs  # cap, shift, temperature
        ctx.save_for_backward(logits, targets, weights, output[1])

    def _multi_cross_entropy_grad(ctx, grad_loss, grad_lse):
        logits, targets, weights, lse = ctx.saved_tensors
        dz = multi_cross_entropy_backward(logits, targets, weights, lse, grad_loss, *ctx.cap)
        return dz, None, None, None, None, None

    multi_cross_entropy.register_autograd(_multi_cross_entropy_grad, setup_context=_multi_cross_entropy_save)

    @torch.library.custom_op("onegpu::multi_cross_entropy_and_gradient", mutates_args=())
    def multi_cross_entropy_and_gradient(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, cap: float,
                                         fp8_scale: float = 0.0, fp8_only: bool = False, shift: float = 0.0,
                                         temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """multi_cross_entropy's per-row loss and, from the same launch, the gradients of the mean loss (each row's
        incoming gradient 1 / N) as cross_entropy_and_gradient gives them for one target. Returns (loss (N,), dz, dz8)."""
        n, vocab = logits.shape
        loss, (dz, dz8) = logits.new_empty(n, dtype=torch.float32), _logit_gradients(logits, fp8_scale, fp8_only)
        _multi_cross_entropy_and_gradient_kernel[(n,)](logits, targets.contiguous(), weights.float().contiguous(), loss,
                                                       dz, dz8 if fp8_scale else dz, vocab,
                                                       *cap_terms(cap, shift, temperature), 1.0 / n, float(fp8_scale),
                                                       torch.finfo(torch.float8_e5m2).max, K=targets.shape[1],
                                                       BLOCK=CE_BLOCK, CAPPED=cap > 0, FIXED_SHIFT=0 < cap <= 40,
                                                       FP8=fp8_scale > 0, DZ=not (fp8_only and fp8_scale),
                                                       num_warps=CE_WARPS)
        return loss, dz, dz8

    @multi_cross_entropy_and_gradient.register_fake
    def _(logits, targets, weights, cap, fp8_scale=0.0, fp8_only=False, shift=0.0, temperature=0.0):
        return logits.new_empty(logits.shape[0], dtype=torch.float32), *_logit_gradients(logits, fp8_scale, fp8_only)


    # The ReLU² MLP's activation in its matmuls' epilogues. Compiled, relu(h)^2 is one elementwise
    # kernel after the up-projection (it reads h and writes a, 2 x 2 bytes per hidden unit) and its
    # derivative one after the down-projection's input gradient (3 x 2 bytes); on the record preset
    # on an H200 the two took 2.3 and 3.3 ms per two micro-batches of 32,768 tokens (the real-data profile
    # in docs/results/2026-12-01_attention-free-layer-fp8-head-pinned-126m-python_h200/). Here the
    # up-projection's tiles are squared before they are stored: h is never written or read. A version
    # that also multiplied the down-projection's input gradient by 2 sqrt(a) in its epilogue was slower
    # than cuBLAS's matmul and Inductor's elementwise pass (1.72 against 1.17 ms for the MLP's backward at
    # 88m on an H200, docs/LOG.md 2026-12-02), so the backward is theirs (model.FusedReLU2MLP).
    # A plain tiled matmul (grouped tile order for L2 reuse), its tiles autotuned (RELU2_TILES).
    @triton.autotune([triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                      for m, n, k, w, st in (RELU2_TILES[:1] if INTERPRET else RELU2_TILES)],
                     key=["M", "N", "K"])
    @triton.jit
    def _relu2_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
        """c = relu(a @ b)^2; a (M, K), b (K, N), c (M, N)."""
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
        tile_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
        rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_ptr + rm[:, None].to(tl.int64) * s_am + (k + rk)[None, :] * s_ak,
                        mask=(rm[:, None] < M) & (k + rk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + (k + rk)[:, None] * s_bk + rn[None, :] * s_bn,
                        mask=(k + rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
        keep = (rm[:, None] < M) & (rn[None, :] < N)
        out = rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c_ptr + out, acc.to(c_ptr.dtype.element_ty), mask=keep)

    @torch.library.custom_op("onegpu::relu2_matmul", mutates_args=())
    def relu2_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """relu(a @ b)^2 in a's dtype, the product accumulated in float32. a: (M, K); b: (K, N), any
        strides (a weight's transpose is read as it lies)."""
        (M, K), N = a.shape, b.shape[1]
        out = a.new_empty(M, N)
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        _relu2_matmul_kernel[grid](a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                   out.stride(0), out.stride(1), GROUP_M=8)
        return out

    @relu2_matmul.register_fake
    def _(a, b):
        return a.new_empty(a.shape[0], b.shape[1])


    # The ReLU² MLP with its matmuls in FP8 (model.FP8ReLU2MLP): each matmul's row-major operand is cast to
    # e4m3 with one scale a row, the row's largest magnitude mapped to e4m3's largest value, so the kernel that
    # writes a row finds its maximum and casts it in one read. Compiled, Inductor split these rows of 3,072
    # into a pass for the maximum and a pass for the cast, each reading the row from memory: the activation
    # took 0.80 ms and its derivative 1.08 at 88m's 131,072 tokens on an H200, where the bf16 MLP's took 0.38
    # and 0.55 (docs/LOG.md, 2026-12-04). One program a row, the whole row in registers: in the 88m profile,
    # at 8 warps, these took 0.36 and 1.11 ms a pass (the derivative's 3.6 GB at 3.2 TB/s; docs/PERFORMANCE.md);
    # ROW_WARPS below gives the warps they run at now.
    @triton.jit
    def _row_to_e4m3(v, keep, out_ptr, scale_ptr, row, cols, top):
        """Store the row v (float32, zero where not keep) in e4m3 at out_ptr, scaled so its largest
        magnitude is top, and the inverse scale at scale_ptr[row]."""
        amax = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12)
        v8 = tl.minimum(tl.maximum(v * (top / amax), -top), top)
        tl.store(out_ptr + cols, v8.to(out_ptr.dtype.element_ty), mask=keep)
        tl.store(scale_ptr + row, amax / top)

    @triton.jit
    def _relu2_fp8_kernel(u_ptr, a8_ptr, scale_ptr, hidden, top, BLOCK: tl.constexpr):
        """a = relu(u)^2 for one row of u (N, hidden), rounded to u's dtype, then to e4m3 as _row_to_e4m3."""
        row, cols = tl.program_id(0).to(tl.int64), tl.arange(0, BLOCK)
        keep = cols < hidden
        u = tl.load(u_ptr + row * hidden + cols, mask=keep, other=0.0).to(tl.float32)
        r = tl.maximum(u, 0.0)
        a = (r * r).to(u_ptr.dtype.element_ty).to(tl.float32)
        _row_to_e4m3(a, keep, a8_ptr + row * hidden, scale_ptr, row, cols, top)

    @triton.jit
    def _relu2_fp8_backward_kernel(dh_ptr, u_ptr, a_ptr, du_ptr, du8_ptr, scale_ptr, hidden, top,
                                   BLOCK: tl.constexpr):
        """For one row: a = relu(u)^2 again (the down-projection's weight gradient reads it), du = dh 2 relu(u)
        in u's dtype, and du in e4m3 as _row_to_e4m3."""
        row, cols = tl.program_id(0).to(tl.int64), tl.arange(0, BLOCK)
        keep = cols < hidden
        at = row * hidden + cols
        u = tl.load(u_ptr + at, mask=keep, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + at, mask=keep, other=0.0).to(tl.float32)
        r = tl.maximum(u, 0.0)
        tl.store(a_ptr + at, (r * r).to(a_ptr.dtype.element_ty), mask=keep)
        du = (dh * 2.0 * r).to(du_ptr.dtype.element_ty)
        tl.store(du_ptr + at, du, mask=keep)
        _row_to_e4m3(du.to(tl.float32), keep, du8_ptr + row * hidden, scale_ptr, row, cols, top)

    def _rows_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for t (N, hidden) in e4m3 and its (N, 1) float32 inverse scales."""
        return (torch.empty(t.shape, device=t.device, dtype=torch.float8_e4m3fn),
                torch.empty(t.shape[0], 1, device=t.device, dtype=torch.float32))

    # Warps a program for each 1,024 of a row (rounded up to a power of two): the forward reads 2 bytes a unit
    # and writes 1, the backward reads 4 and writes 5. Timed alone at 88m's 131,072 x 3,072 on an H200
    # (docs/LOG.md, 2026-12-04): the forward took 0.295 ms at 4 warps, 0.328 at 8, 0.448 at 16; the backward
    # 0.940 at 4, 1.002 at 8, 0.866 at 16 (4.2 TB/s), 1.050 at 32.
    ROW_WARPS = {"forward": 1, "backward": 4}

    def _row_launch(t: torch.Tensor, kernel: str) -> dict:
        """One program a row: the row rounded up to a power of two, ROW_WARPS[kernel] warps a 1,024 of it."""
        block = triton.next_power_of_2(t.shape[1])
        return dict(hidden=t.shape[1], top=torch.finfo(torch.float8_e4m3fn).max, BLOCK=block,
                    num_warps=min(16, max(1, block // 1024 * ROW_WARPS[kernel])))

    @torch.library.custom_op("onegpu::relu2_fp8", mutates_args=())
    def relu2_fp8(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """relu(u)^2 for the up-projection's output u (N, hidden), contiguous, in e4m3 with one scale a row:
        (a8 (N, hidden), its inverse scales (N, 1) float32), as model.to_fp8_rows of the activation in u's dtype."""
        a8, scale = _rows_fp8(u)
        _relu2_fp8_kernel[(u.shape[0],)](u, a8, scale, **_row_launch(u, "forward"))
        return a8, scale

    @relu2_fp8.register_fake
    def _(u):
        return _rows_fp8(u)

    @torch.library.custom_op("onegpu::relu2_fp8_backward", mutates_args=())
    def relu2_fp8_backward(dh: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
        """Given u (N, hidden) and the activation's gradient dh, both contiguous: (relu(u)^2, du, du in e4m3,
        its (N, 1) inverse scales), du = dh 2 relu(u) in u's dtype."""
        du8, scale = _rows_fp8(u)
        a, du = torch.empty_like(u), torch.empty_like(u)
        _relu2_fp8_backward_kernel[(u.shape[0],)](dh, u, a, du, du8, scale, **_row_launch(u, "backward"))
        return a, du, du8, scale

    @relu2_fp8_backward.register_fake
    def _(dh, u):
        return torch.empty_like(u), torch.empty_like(u), *_rows_fp8(u)

    # The FP8 head's e5m2 gradient transposed (model.FP8HeadCrossEntropy): the weight gradient's matmul wants the
    # tokens contiguous, the loss kernel writes the vocabulary contiguous, so the (tokens, vocab) gradient, the
    # largest tensor of a step, is copied once transposed: 4.3 GB read and 4.3 written for a micro-batch of
    # 131,072 tokens and a 32,768 vocabulary. Inductor's compiled copy took 3.7 ms of it on an H200 (2.3 TB/s; the
    # 88m profile, docs/performance/training-speed.md, where the time goes), where the card's 4.8 TB/s would take 1.8. A tile
    # transposed through shared memory a byte at a time uses a quarter of each 4-byte bank access (built for
    # sm_90 at 128 x 128: 64 one-byte shared loads a thread); this kernel moves 32-bit words: it reads four source
    # rows' words, transposes each 4 x 4 block of bytes inside them with shifts and masks, and transposes the
    # words, so shared memory moves whole words (16 loads a thread) and both global sides 16-byte vectors.
    @triton.autotune([triton.Config({"ROWS": r, "COLS": c}, num_warps=w)
                      for r, c, w in (TRANSPOSE_TILES[:1] if INTERPRET else TRANSPOSE_TILES)], key=["R4", "C4"])
    @triton.jit
    def _transpose_kernel(src_ptr, dst_ptr, R4, C4, ROWS: tl.constexpr, COLS: tl.constexpr):
        """dst (C, R) = src (R, C) transposed, both given as 32-bit words (R4 = R / 4 words a row of dst, C4 = C / 4
        of src), for one ROWS x COLS tile of src's bytes."""
        i = tl.program_id(0).to(tl.int64) * (ROWS // 4) + tl.arange(0, ROWS // 4)  # src rows 4i..4i+3: dst word i
        j = tl.program_id(1).to(tl.int64) * (COLS // 4) + tl.arange(0, COLS // 4)  # src word j: dst rows 4j..4j+3
        keep = (i[:, None] < R4) & (j[None, :] < C4)
        rows = src_ptr + 4 * i[:, None] * C4 + j[None, :]
        w0 = tl.load(rows, mask=keep, other=0).to(tl.uint32, bitcast=True)
        w1 = tl.load(rows + C4, mask=keep, other=0).to(tl.uint32, bitcast=True)
        w2 = tl.load(rows + 2 * C4, mask=keep, other=0).to(tl.uint32, bitcast=True)
        w3 = tl.load(rows + 3 * C4, mask=keep, other=0).to(tl.uint32, bitcast=True)
        for k in tl.static_range(4):  # byte k of src word j (column 4j + k) is dst row 4j + k; src row 4i + q its byte q
            out = (((w0 >> (8 * k)) & 255) | (((w1 >> (8 * k)) & 255) << 8) | (((w2 >> (8 * k)) & 255) << 16)
                   | (((w3 >> (8 * k)) & 255) << 24))
            tl.store(dst_ptr + (4 * j[:, None] + k) * R4 + i[None, :], tl.trans(out.to(tl.int32, bitcast=True)),
                     mask=tl.trans(keep))

    @torch.library.custom_op("onegpu::transposed", mutates_args=())
    def transposed(t: torch.Tensor) -> torch.Tensor:
        """t (R, C) of one-byte elements (FP8), contiguous, R and C multiples of 4 (transposed_supported),
        transposed: (C, R), contiguous; t.t().contiguous()."""
        # The kernel moves 32-bit words, so a view that starts inside a word takes the plain copy. That is asked
        # here, inside the op: Dynamo cannot trace a tensor's storage_offset(), and asked in transposed_supported,
        # from the FP8 head's backward, it broke the compiled graph and ran the head's whole autograd function
        # eagerly, its casts unfused (since e245419; 0.887x of compiled BF16 for the FP8 head alone on an H200).
        if t.storage_offset() % 4:
            return t.t().contiguous()
        R, C = t.shape
        out = t.new_empty(C, R)
        grid = lambda meta: (triton.cdiv(R, meta["ROWS"]), triton.cdiv(C, meta["COLS"]))  # noqa: E731
        _transpose_kernel[grid](t.view(torch.int32), out.view(torch.int32), R // 4, C // 4)
        return out

    @transposed.register_fake
    def _(t):
        return t.new_empty(t.shape[1], t.shape[0])


    # QK-norm and RoPE between the QKV projection and attention, backward (model.QKNormRope: the forward is
    # the plain lines, which Inductor fuses into one kernel that ran 0.95 ms a layer at 88m on an H200, where a
    # forward kernel of ours took 1.28; docs/LOG.md 2026-12-04). Compiled, the backward took three kernels
    # (3.1 + 3.6 + 0.9 ms per two micro-batches of 49,152 tokens of the record preset on an H200;
    # docs/results/2026-12-01_attention-free-layer-fp8-head-pinned-126m-python_h200/, profile-real-data), where
    # reading and writing q and k once needs about 2 ms at 4.8 TB/s. This one took 0.71 ms a layer at 88m
    # against Inductor's 0.90. qkv (B, T, H + 2 Hkv, D) is taken as rows of D, each (token, head) row normed on
    # its own. A program takes one head and QK_BLOCKS tiles of ROWS consecutive tokens (QK_TILES), so that a
    # tile is all q, all k or all v: its gain is one (D,) vector, and its gain gradient a sum down the tile's
    # rows that each lane keeps for itself and adds up once, after the last tile. Each row is loaded as its
    # two contiguous halves, the halves that rotate-half RoPE pairs. The gradients of q, k and v come in apart,
    # each read where attention and the value mix left it (given one gradient of a qkv-shaped output, as an
    # earlier version was, Inductor copied them into it first, 4.0 ms a step at 88m on an H200), and qkv's
    # whole gradient goes out, v's rows copied through. All in float32, rounded once; the norm is recomputed
    # from qkv. (Two versions before this one lost to Inductor: one token's heads a tile with the partner
    # half gathered, 33 ms a step at 88m on an H200 against Inductor's 15.8; then tiles of any rows, whose
    # backward summed the gain products down each tile across the warps, two barriers a sum, four sums a
    # tile, at up to 194 registers a thread in the sm_90 build: twice Inductor's time, docs/LOG.md 2026-12-04.)
    @triton.autotune([triton.Config({"ROWS": rows}, num_warps=w) for rows, w in (QK_TILES[:1] if INTERPRET else QK_TILES)],
                     key=["BT", "T", "H", "HKV", "D"], reset_to_zero=["dg_ptr"])  # see qk_norm_rope_backward
    @triton.jit
    def _qk_norm_rope_backward_kernel(x_ptr, dq_ptr, dk_ptr, dv_ptr, out_ptr, cos_ptr, sin_ptr, qg_ptr, kg_ptr,
                                      dg_ptr, BT, T, eps, s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                                      H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                                      BLOCKS: tl.constexpr):
        """The gradients of q, k and v at dq_ptr, dk_ptr, dv_ptr, each (B, T, heads, D) at its strides (s_*b,
        s_*t, s_*h; D contiguous), to qkv's at out_ptr (BT tokens of H + 2 HKV rows of D, contiguous, as qkv
        at x_ptr), and the partial gain gradients at dg_ptr."""
        HALF: tl.constexpr = D // 2
        N: tl.constexpr = H + 2 * HKV  # heads a token
        head = tl.program_id(1)
        is_q, is_v = head < H, head >= H + HKV
        # This head's gradient among q's, k's and v's, its index there and its strides
        if is_q:
            grad_ptr, index, s_b, s_t, s_h = dq_ptr, head, s_qb, s_qt, s_qh
        elif is_v:
            grad_ptr, index, s_b, s_t, s_h = dv_ptr, head - H - HKV, s_vb, s_vt, s_vh
        else:
            grad_ptr, index, s_b, s_t, s_h = dk_ptr, head - H, s_kb, s_kt, s_kh
        c = tl.arange(0, HALF)
        # (1, D/2) the gain's halves, this head's: q's or k's
        g1 = tl.where(is_q, tl.load(qg_ptr + c), tl.load(kg_ptr + c)).to(tl.float32)[None, :]
        g2 = tl.where(is_q, tl.load(qg_ptr + HALF + c), tl.load(kg_ptr + HALF + c)).to(tl.float32)[None, :]
        dg1, dg2 = tl.zeros([ROWS, HALF], tl.float32), tl.zeros([ROWS, HALF], tl.float32)
        for b in range(BLOCKS):
            tok = (tl.program_id(0).to(tl.int64) * BLOCKS + b) * ROWS + tl.arange(0, ROWS)  # (ROWS,) tokens
            live = (tok < BT)[:, None]
            t = tok % T
            # (ROWS, D/2) offsets of each row's first half: in qkv, and in this head's gradient
            first = (tok * N + head)[:, None] * D + c[None, :]
            part = ((tok // T) * s_b + t * s_t + index * s_h)[:, None] + c[None, :]
            if is_v:  # copied through
                tl.store(out_ptr + first, tl.load(grad_ptr + part, mask=live), mask=live)
                tl.store(out_ptr + first + HALF, tl.load(grad_ptr + part + HALF, mask=live), mask=live)
            else:
                # rope_tables repeats its angles in both halves, so the first half's cos and sin serve both.
                cos = tl.load(cos_ptr + t[:, None] * D + c[None, :], mask=live, other=0.0).to(tl.float32)
                sin = tl.load(sin_ptr + t[:, None] * D + c[None, :], mask=live, other=0.0).to(tl.float32)
                x1 = tl.load(x_ptr + first, mask=live, other=0.0).to(tl.float32)
                x2 = tl.load(x_ptr + first + HALF, mask=live, other=0.0).to(tl.float32)
                inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
                n1, n2 = x1 * inv, x2 * inv
                # y1 = u1 cos - u2 sin, y2 = u2 cos + u1 sin, u = n g  =>  du1 = dy1 cos + dy2 sin, ...
                dy1 = tl.load(grad_ptr + part, mask=live, other=0.0).to(tl.float32)
                dy2 = tl.load(grad_ptr + part + HALF, mask=live, other=0.0).to(tl.float32)
                du1, du2 = dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin
                dg1 += du1 * n1  # dead rows loaded zeros: they add nothing
                dg2 += du2 * n2
                dn1, dn2 = du1 * g1, du2 * g2
                mean = ((tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1)) / D)[:, None]
                tl.store(out_ptr + first, (inv * (dn1 - n1 * mean)).to(out_ptr.dtype.element_ty), mask=live)
                tl.store(out_ptr + first + HALF, (inv * (dn2 - n2 * mean)).to(out_ptr.dtype.element_ty), mask=live)
        if head < H + HKV:  # this program's row of the partial gain gradients: q's at 0, k's at D
            row = dg_ptr + (tl.program_id(0) * N + head) * 2 * D + tl.where(is_q, 0, D)
            tl.store(row + c, tl.sum(dg1, axis=0))
            tl.store(row + HALF + c, tl.sum(dg2, axis=0))

    def _qk_norm_rope_tiles(qkv, rows: int) -> int:
        """Token tiles of the grid's first axis (its second is the heads)."""
        return triton.cdiv(qkv.numel() // (qkv.shape[-2] * qkv.shape[-1]), rows * QK_BLOCKS)

    @torch.library.custom_op("onegpu::qk_norm_rope_backward", mutates_args=())
    def qk_norm_rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, q_gain: torch.Tensor, k_gain: torch.Tensor,
                              n_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """QK-norm and RoPE's backward (model.QKNormRope): given the gradients of q (B, T, H, D), k and v (B, T,
        Hkv, D), any strides along their first three dimensions, those of qkv (B, T, H + 2 Hkv, D), contiguous,
        H = n_heads, and of q_gain and k_gain (D,), where the forward took each q head times rsqrt(mean(q^2) +
        eps) * q_gain, each k head the same with k_gain, both rotated by cos, sin (T, D) (model.rope_tables'
        layout), and v as it is."""
        # One row a program (a token tile of one head) at the fewest rows a tile. A tile of more rows fills
        # fewer, and v's programs none, and the rest must read zero: here, and after the autotuner's trial
        # runs of each tile (its reset_to_zero).
        partial = qkv.new_zeros(_qk_norm_rope_tiles(qkv, min(rows for rows, _ in QK_TILES)) * qkv.shape[-2], 2,
                                qkv.shape[-1], dtype=torch.float32)
        grads = [g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv)]
        dqkv = torch.empty_like(qkv)
        B, T, n, D = qkv.shape
        strides = [s for g in grads for s in g.stride()[:3]]
        _qk_norm_rope_backward_kernel[lambda meta: (_qk_norm_rope_tiles(qkv, meta["ROWS"]), n)](
            qkv, *grads, dqkv, cos, sin, q_gain, k_gain, partial, B * T, T, eps, *strides, H=n_heads,
            HKV=(n - n_heads) // 2, D=D, BLOCKS=QK_BLOCKS)
        return dqkv, partial[:, 0].sum(0).to(q_gain.dtype), partial[:, 1].sum(0).to(k_gain.dtype)

    @qk_norm_rope_backward.register_fake
    def _(dq, dk, dv, qkv, cos, sin, q_gain, k_gain, n_heads, eps):
        return torch.empty_like(qkv), torch.empty_like(q_gain), torch.empty_like(k_gain)

    # Muon's Newton-Schulz step on a stack of wide matrices x (n, m, k), m <= k (optim.orthogonalize):
    #   G = x x^T (m x m x k),  B = b G + c G G (m x m x m),  x <- a x + B x (m x m x k).
    # G is symmetric, and so is G G (= G G^T), so each of the first two products needs only the tiles on
    # and above the diagonal: a program computes tile (i, j), i <= j, and stores it at (i, j) and, off the
    # diagonal, its transpose at (j, i). At an 88m MLP part (768 x 3,072) that drops 28% of an iteration's
    # FLOPs, at a square part a third (modded-nanogpt's Muon does the same, in its triton_kernels.py). The
    # last product is not symmetric and stays cuBLAS's baddbmm.
    @triton.autotune([triton.Config({"BLOCK": m, "BLOCK_K": k}, num_warps=w, num_stages=st)
                      for m, k, w, st in (GRAM_TILES[:1] if INTERPRET else GRAM_TILES)], key=["M", "K", "ADD"])
    @triton.jit
    def _gram_kernel(x_ptr, add_ptr, out_ptr, M, K, s_xb, s_xm, s_xk, s_ob, s_om, alpha, beta,
                     BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr):
        """out = alpha x x^T (+ beta add) for one matrix of the stack; add (M, M) is symmetric too."""
        i, j, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        if j < i:  # below the diagonal: the transpose of a tile that program (j, i) stores
            return
        ri, rj, rk = i * BLOCK + tl.arange(0, BLOCK), j * BLOCK + tl.arange(0, BLOCK), tl.arange(0, BLOCK_K)
        x = x_ptr + b * s_xb
        acc = tl.zeros((BLOCK, BLOCK), tl.float32)
        for k in range(0, K, BLOCK_K):
            rows = tl.load(x + ri[:, None] * s_xm + (k + rk)[None, :] * s_xk,
                           mask=(ri[:, None] < M) & (k + rk[None, :] < K), other=0.0)  # x[ri, k:k+BLOCK_K]
            cols = tl.load(x + (k + rk)[:, None] * s_xk + rj[None, :] * s_xm,
                           mask=(k + rk[:, None] < K) & (rj[None, :] < M), other=0.0)  # x[rj, k:k+BLOCK_K]^T
            acc = tl.dot(rows, cols, acc)
        acc = acc * alpha
        keep = (ri[:, None] < M) & (rj[None, :] < M)
        if ADD:
            acc += beta * tl.load(add_ptr + b * s_ob + ri[:, None] * s_om + rj[None, :], mask=keep, other=0.0).to(tl.float32)
        out = out_ptr + b * s_ob
        tile = acc.to(out_ptr.dtype.element_ty)
        tl.store(out + ri[:, None] * s_om + rj[None, :], tile, mask=keep)
        if j > i:
            tl.store(out + rj[:, None] * s_om + ri[None, :], tl.trans(tile), mask=(rj[:, None] < M) & (ri[None, :] < M))

    @torch.library.custom_op("onegpu::gram", mutates_args=())
    def gram(x: torch.Tensor, add: Optional[torch.Tensor] = None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
        """alpha x x^T + beta add for a stack x (n, m, k), in x's dtype, accumulated in float32: each
        symmetric tile computed once. add: None or (n, m, m), symmetric and contiguous (Newton-Schulz's
        b G + c G G is gram(G, G, c, b)). Returns (n, m, m), contiguous."""
        n, M, K = x.shape
        out = x.new_empty(n, M, M)
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK"]), triton.cdiv(M, meta["BLOCK"]), n)  # noqa: E731
        _gram_kernel[grid](x, out if add is None else add, out, M, K, x.stride(0), x.stride(1), x.stride(2),
                           out.stride(0), out.stride(1), float(alpha), float(beta), ADD=add is not None)
        return out

    @gram.register_fake
    def _(x, add=None, alpha=1.0, beta=0.0):
        return x.new_empty(x.shape[0], x.shape[1], x.shape[1])

    # The decode step's matmuls: at batch 1 to 16 a token's step reads every weight once for a product of
    # one to sixteen rows, so each matmul is bound by its weight's bytes, and those reach the card's
    # bandwidth only when spread over many programs (SMALL_MATMUL_TILES' comment).
    @triton.jit
    def _rows_by_weight_rows(x_ptr, w_ptr, m, n, M, N, K, s_xm, s_wn, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, acc):
        """acc + x[m] @ w[n]^T (ROWS, BLOCK_N) in float32, for x (M, K) and w (N, K) as nn.Linear keeps it:
        the rows m past M are zeros (tl.dot needs 16 rows at least), as are the columns n past N."""
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * s_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                        other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        return acc

    @triton.autotune([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                      for n, k, w, st in (SMALL_MATMUL_TILES[:1] if INTERPRET else SMALL_MATMUL_TILES)],
                     key=["M", "N", "K"])
    @triton.jit
    def _small_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym, ROWS: tl.constexpr,
                             RELU2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y = x @ w^T (with RELU2, relu(x @ w^T)^2) for x (M, K) with M <= ROWS, w (N, K) as nn.Linear keeps
        it: one program per BLOCK_N output columns, reading those rows of w once; accumulation in float32."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, ROWS)
        acc = _rows_by_weight_rows(x_ptr, w_ptr, m, n, M, N, K, s_xm, s_wn, ROWS, BLOCK_N, BLOCK_K,
                                   tl.zeros((ROWS, BLOCK_N), tl.float32))
        if RELU2:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(m[:, None] < M) & (n[None, :] < N))

    @torch.library.custom_op("onegpu::small_matmul", mutates_args=())
    def small_matmul(x: torch.Tensor, w: torch.Tensor, relu2: bool = False) -> torch.Tensor:
        """x @ w^T in x's dtype for at most SMALL_MATMUL_ROWS rows: x (..., K), w (N, K); with relu2,
        relu(x @ w^T)^2 (the ReLU² MLP's up-projection, its square in the epilogue). A custom op, so the
        compiled decode step calls it as one opaque step and its CUDA graph captures the launch."""
        rows = x.reshape(-1, x.shape[-1])
        M, K = rows.shape
        N = w.shape[0]
        y = x.new_empty(*x.shape[:-1], N)  # contiguous: its rows lie N apart
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        _small_matmul_kernel[grid](rows, w, y, M, N, K, rows.stride(0), w.stride(0), N,
                                   ROWS=SMALL_MATMUL_ROWS, RELU2=relu2)
        return y

    @small_matmul.register_fake
    def _(x, w, relu2=False):
        return x.new_empty(*x.shape[:-1], w.shape[0])


    # The ReLU² MLP of a decode step in one kernel (model.decode_mlp). Compiled, a batch-1 step of the 88m
    # default ran it as four launches a layer on an H200: the up-projection (about 4.0 us), the square (1.0),
    # the down-projection split over its 3,072 inputs (4.75) and cuBLAS's reduction of that split (1.5),
    # where the two weights' 9.4 MB need 2 us at the card's bandwidth (docs/performance/generation.md).
    # Here each program takes DECODE_MLP_HIDDEN hidden units: their rows of W1, the square, and their
    # columns of W2, whose product it writes as a partial sum of the output in float32; the model sums the
    # partials, which Inductor fuses with the residual add after the MLP.
    @triton.autotune([triton.Config({"BLOCK_K": k, "BLOCK_D": n}, num_warps=w, num_stages=st)
                      for k, n, w, st in DECODE_MLP_TILES[:1 if INTERPRET else None]],
                     key=["M", "D", "HID", "BLOCK_H"])
    @triton.jit
    def _decode_mlp_kernel(x_ptr, w1_ptr, w2_ptr, part_ptr, M, D, HID, s_xm, s_w1, s_w2, ROWS: tl.constexpr,
                           BLOCK_H: tl.constexpr, PDL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
        """part[p] = relu(x @ w1[h]^T)^2 @ w2[:, h]^T for the hidden units h of program p (BLOCK_H of them):
        x (M, D) with M <= ROWS, w1 (HID, D) and w2 (D, HID) as nn.Linear keeps them, part (P, M, D) float32.
        The square is rounded to x's dtype, as the plain path's activation is. Each program reads its
        columns of w2 as D pieces of BLOCK_H elements; a (HID, D) copy, where they are one block, measured
        slower (docs/LOG.md, 2026-12-03). PDL: see _after_the_kernel_before; launched so, a program loads its
        first block of w1, which no kernel writes, before it waits, while the kernel before it still runs."""
        p = tl.program_id(0)
        h = p * BLOCK_H + tl.arange(0, BLOCK_H)
        m = tl.arange(0, ROWS)
        k = tl.arange(0, BLOCK_K)
        w1_first = tl.load(w1_ptr + h[:, None].to(tl.int64) * s_w1 + k[None, :],
                           mask=(h[:, None] < HID) & (k[None, :] < D), other=0.0)  # (BLOCK_H, BLOCK_K)
        _after_the_kernel_before(PDL)
        x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < D), other=0.0)
        acc = tl.dot(x, tl.trans(w1_first))  # then the rest of x @ w1[h]^T, from the second block on
        acc = _rows_by_weight_rows(x_ptr + BLOCK_K, w1_ptr + BLOCK_K, m, h, M, HID, D - BLOCK_K, s_xm, s_w1, ROWS,
                                   BLOCK_H, BLOCK_K, acc)
        acc = tl.maximum(acc, 0.0)
        a = (acc * acc).to(x_ptr.dtype.element_ty)  # (ROWS, BLOCK_H)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            w = tl.load(w2_ptr + d[:, None].to(tl.int64) * s_w2 + h[None, :], mask=(d[:, None] < D) & (h[None, :] < HID),
                        other=0.0)  # (BLOCK_D, BLOCK_H)
            tl.store(part_ptr + (p * M + m[:, None]) * D + d[None, :], tl.dot(a, tl.trans(w)),
                     mask=(m[:, None] < M) & (d[None, :] < D))

    @torch.library.custom_op("onegpu::decode_mlp", mutates_args=())
    def decode_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """The ReLU² MLP's partial sums for at most SMALL_MATMUL_ROWS rows: x (..., D), w1 (HID, D), w2
        (D, HID); returns (P, ..., D) float32, P = HID / DECODE_MLP_HIDDEN, whose sum over its first dimension
        is relu(x w1^T)^2 w2^T. A custom op: the compiled decode step calls it as one opaque step. pdl: launched
        behind the kernel before it (dependent_launch; model.decode_pdl)."""
        rows = x.reshape(-1, x.shape[-1])
        (M, D), HID = rows.shape, w1.shape[0]
        P = triton.cdiv(HID, DECODE_MLP_HIDDEN)
        part = rows.new_empty(P, *x.shape[:-1], D, dtype=torch.float32)
        _decode_mlp_kernel[(P,)](rows, w1, w2, part, M, D, HID, rows.stride(0), w1.stride(0), w2.stride(0),
                                 ROWS=SMALL_MATMUL_ROWS, BLOCK_H=DECODE_MLP_HIDDEN, PDL=pdl, **_launch(pdl))
        return part

    @decode_mlp.register_fake
    def _(x, w1, w2, pdl=False):
        return x.new_empty(triton.cdiv(w1.shape[0], DECODE_MLP_HIDDEN), *x.shape, dtype=torch.float32)


@contextlib.contextmanager
def launch_settings(**settings):
    """Within it, this module's launch constants named in settings (DECODE_MLP_HIDDEN=16, ...) take their
    values, a None leaving one as it is; all are put back on leaving. For studies that compare settings."""
    settings = {name: value for name, value in settings.items() if value is not None}
    saved = {name: globals()[name] for name in settings}
    globals().update(settings)
    try:
        yield
    finally:
        globals().update(saved)


def chosen_tiles(kernel) -> str:
    """The launch config an autotuned kernel of this module (_decode_mlp_kernel, ...) picked for its last
    call, as "BLOCK_K=128 BLOCK_D=128 warps=4 stages=3". Its picks can differ from run to run (the decode
    MLP at 32 hidden units a program took 6.88 us in one run and 8.35 in another, docs/LOG.md
    2026-12-03), so a study that times one says which tiles it timed."""
    config = kernel.best_config
    return " ".join([*(f"{k}={v}" for k, v in config.kwargs.items()), f"warps={config.num_warps}",
                     f"stages={config.num_stages}"])


def device_supported(device: torch.device) -> bool:
    """Whether these kernels run on `device`: an NVIDIA GPU of compute capability 8.0 (Ampere) or
    newer, the oldest Triton supports and the first with bfloat16 arithmetic; on CPU, Triton's
    interpreter. Called outside compiled code (attention.KVCache, train.setup)."""
    if device.type == "cuda":
        return AVAILABLE and torch.cuda.get_device_capability(device) >= (8, 0)
    return AVAILABLE and INTERPRET


def decode_splits(batch: int, kv_heads: int) -> int:
    """How many programs decode_step splits each (sequence, kv head)'s positions over: enough for about
    DECODE_PROGRAMS programs, at least 1, at most MAX_DECODE_SPLITS (88m, 6 kv heads: 16 at batch 1, 5
    at batch 8)."""
    return max(1, min(MAX_DECODE_SPLITS, DECODE_PROGRAMS // (batch * kv_heads)))


def decode_step_supported(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode_step handles these inputs, on a device that device_supported allows (the
    caller asks that once, generate.apply): one new token per sequence (qkv: (B, 1, heads,
    hd)), 16-bit floats (tl.dot would round float32 to TF32) in the cache too, a power-of-two head
    size of at least 16, rows contiguous."""
    hd = qkv.shape[-1]
    return (qkv.shape[1] == 1
            and qkv.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == qkv.dtype
            and hd >= 16 and hd & (hd - 1) == 0 and qkv.stride(-1) == 1 and k_cache.stride(-1) == 1)


def decode_mlp_supported(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether decode_mlp handles x (..., D) through w1 (HID, D) and w2 (D, HID), on a device that
    device_supported allows (model.Llama.setup_cache asks that once): as small_matmul for each weight."""
    return small_matmul_supported(x, w1) and w2.shape == w1.shape[::-1] and w2.dtype == x.dtype and w2.stride(1) == 1


def small_matmul_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether small_matmul handles x (..., K) @ w (N, K)^T, on a device that device_supported allows (the
    caller asks that once, model.Llama.setup_cache): at most SMALL_MATMUL_ROWS rows, both in the same
    16-bit float (tl.dot would round float32 to TF32), unit-stride rows."""
    K = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and w.dim() == 2 and w.shape[1] == K
            and x.numel() <= SMALL_MATMUL_ROWS * K and x.stride(-1) == 1 and w.stride(1) == 1
            and (x.dim() == 2 or x.is_contiguous()))


def runs_on(t: torch.Tensor) -> bool:
    """Whether Triton runs kernels on t's device: CUDA, or a CPU under Triton's interpreter (the
    caller has asked device_supported once for the GPU's generation: model.for_device)."""
    return AVAILABLE and (t.is_cuda or INTERPRET)


def cross_entropy_supported(logits: torch.Tensor) -> bool:
    """Whether cross_entropy handles these (N, vocab) logits: where runs_on, contiguous rows."""
    return runs_on(logits) and logits.dim() == 2 and logits.is_contiguous()


def qk_norm_rope_supported(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether qk_norm_rope_backward handles qkv (B, T, heads, D) with tables cos (T, D): where runs_on, both
    contiguous, a power-of-two head size of at least 16 (RoPE pairs its two halves)."""
    D = qkv.shape[-1]
    return (runs_on(qkv) and qkv.dim() == 4 and qkv.is_contiguous() and cos.is_contiguous()
            and D >= 16 and D & (D - 1) == 0)


def transposed_supported(t: torch.Tensor) -> bool:
    """Whether transposed handles t: where runs_on, a contiguous matrix of one-byte elements, both sides a
    multiple of 4 (it moves 32-bit words; a start inside a word transposed itself copies plainly), whose column
    tiles fit the grid's second axis (65,535 programs). Traceable by Dynamo: shapes and flags only."""
    narrowest = min(cols for _, cols, _ in TRANSPOSE_TILES)
    return (runs_on(t) and t.dim() == 2 and t.is_contiguous() and t.element_size() == 1
            and t.shape[0] % 4 == 0 and t.shape[1] % 4 == 0 and -(-t.shape[1] // narrowest) <= 65_535)


def gram_supported(x: torch.Tensor) -> bool:
    """Whether gram handles the stack x (n, m, k): where runs_on, in a 16-bit float (tl.dot would
    round float32 to TF32, where the plain bmm keeps it)."""
    return runs_on(x) and x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16)


def swiglu_supported(h13: torch.Tensor) -> bool:
    """Whether swiglu handles h13: on CUDA (or on CPU under Triton's interpreter), contiguous.
    (model.for_device turns fused_swiglu off on a GPU older than device_supported allows.)"""
    return runs_on(h13) and h13.is_contiguous()
