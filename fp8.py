"""FP8 matmuls for training (fastpaths.py swaps them in where a card has FP8 units): Hopper's and Ada's tensor
cores multiply FP8 at twice the BF16 rate. Each operand is scaled so its largest magnitude lands at the top of the
FP8 range, cast, multiplied with torch._scaled_mm, and the product unscaled. Master weights, optimizer state and
everything outside these matmuls stay as they were. What each saves is docs/performance/training-speed.md's.

The MLP's matmuls (speed.fp8) run two of their three products in FP8: the forward and the input gradient, whose
operands are both contiguous along the inner side as they lie (the weight's transpose is a copy of a small
matrix). The weight gradient multiplies over the tokens, which Hopper's FP8 matmul wants contiguous in both
operands: two transposed copies of (tokens, width) tensors, which cost about what FP8 saves there, so it stays in
bf16. Every operand, gradients included, is e4m3 with one scale a row (a token's, or a weight's output unit), so
the kernel that writes a row can find its maximum and cast it in the same pass; whole-tensor scales need a
reduction over the tensor first, which measured slower than bf16 (docs/LOG.md, 2026-11-30).

The output head (speed.fp8_head) is the largest matmul of a small model, and its gradient the largest tensor:
(tokens, vocab). It scales x and w by their whole maxima (e4m3) and its gradient by a bound known in advance
(e5m2), as modded-nanogpt's FP8 head does with its fixed grad_s: the gradient of a mean cross-entropy over n
tokens with respect to one logit, (softmax - one-hot) / n (a soft-cap's slope is at most 1), lies within 1/n,
so it is never read for its maximum. fp8_linear's head runs its forward and input gradient in FP8 and its weight
gradient in the output dtype; the head with the loss kernel (FP8HeadCrossEntropy) runs its weight gradient in
FP8 too.

With fast_accum (speed.fp8_fast_accum) the forward products (the MLP's two and the head's) use cuBLAS's fast
accumulation: the tensor cores' partial sums stay in their own precision along K, where by default cuBLAS
promotes them to float32 at intervals. modded-nanogpt's FP8 head and torchao's float8 training accumulate their
forward products so; the gradients keep the promotion here as there.
"""

import torch
import torch.nn.functional as F

import onegpu_kernels as K

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


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
    fast_accum: cuBLAS's fast accumulation (speed.fp8_fast_accum, for forward products)."""
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
        # w8 (vocab, d) column-major, as FP8HeadCrossEntropy's backward makes it (onegpu_kernels.transposed)
        grad_x = torch._scaled_mm(g8, transposed(w8, True).t(), scale_a=sg, scale_b=sw, out_dtype=x_dtype)
        # The weight gradient multiplies over the tokens, and Hopper's FP8 matmul wants that axis contiguous
        # in both operands: the (tokens, vocab) gradient transposed, a copy of the largest tensor, which
        # Inductor fused into the loss kernel at three times its time (one H200, docs/LOG.md). In the output
        # dtype the gradient is read as it lies.
        return grad_x, (grad.t() @ x_saved).to(w_dtype), None, None, None


class FP8Rows(torch.autograd.Function):
    """x @ weight.T for fp8's matmuls outside FP8ReLU2MLP (the SwiGLU MLP's):
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
    the forward product with fast accumulation (speed.fp8_fast_accum)."""
    dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        flat = x.reshape(-1, x.shape[-1])
        y = FP8Rows.apply(flat.to(torch.bfloat16), weight, fast_accum) if grad_bound is None else \
            FP8Matmul.apply(flat, weight, dtype, grad_bound, fast_accum)
    return y.view(*x.shape[:-1], weight.shape[0])


def transposed(t, kernel: bool):
    """t (R, C) transposed and contiguous, (C, R): by onegpu_kernels.transposed where kernel and it handles t
    (one-byte elements where Triton runs), otherwise t.t().contiguous(), its plain twin."""
    return K.transposed(t) if kernel and K.transposed_supported(t) else t.t().contiguous()


class FP8HeadCrossEntropy(torch.autograd.Function):
    """The FP8 head and the loss kernel as one function: FP8Matmul's forward, then
    onegpu_kernels.cross_entropy_and_gradient (multi_cross_entropy_and_gradient for the multi-token loss), which
    writes the logits' gradient in the forward, in the same
    launch as the loss: in e5m2, scaled by the bound 1/n, for the input gradient and, with fp8_weight_grad, the
    weight gradient; without, also in the logits' dtype for a weight gradient in that dtype. The backward is
    two matmuls, whose products it scales by the incoming gradient (a scalar: the step's 1 / accumulation),
    where a loss kernel of its own would have read the logits again. The model runs it where fp8_head and
    loss_kernel are both on."""

    @staticmethod
    def forward(ctx, x, weight, targets, weights, cap, out_dtype, fp8_weight_grad, transpose_kernel, fast_accum, shift,
                temperature):
        logits, x8, sx, w8, sw = fp8_matmul(x, weight, out_dtype, fast_accum)  # x: (N, d); weight: (vocab, d)
        # Each logit's gradient of the mean loss lies within 1 / n (K / n with K targets a row, each weighted at most
        # 1), so e5m2 holds it scaled by top * n / K, never read for its maximum (as FP8Matmul's head).
        n, top = targets.shape[0], torch.finfo(E5M2).max
        scale = top * n / (1 if weights is None else targets.shape[1])
        caps = dict(fp8_only=fp8_weight_grad, shift=shift, temperature=temperature)
        loss, dz, dz8 = (K.cross_entropy_and_gradient(logits, targets, cap, scale, **caps) if weights is None else
                         K.multi_cross_entropy_and_gradient(logits, targets, weights, cap, scale, **caps))
        ctx.save_for_backward(x8 if fp8_weight_grad else x.to(out_dtype), sx, w8, sw, dz, dz8)
        ctx.scale, ctx.dtypes, ctx.fp8_weight_grad = scale, (x.dtype, weight.dtype), fp8_weight_grad
        ctx.transpose_kernel = transpose_kernel
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        x_saved, sx, w8, sw, dz, dz8 = ctx.saved_tensors
        sg = grad.float() / ctx.scale  # dz8's inverse scale, times the incoming gradient
        # w8 (vocab, d) and x8 (N, d) column-major: views of their transposed copies, made by the same kernel
        # (where transpose_kernel). As strided copies, t.t().contiguous().t(), they ran as PyTorch's
        # element-at-a-time FP8 copy, a large share of the 88m step (docs/performance/training-speed.md, where the time
        # goes).
        kernel = ctx.transpose_kernel
        grad_x = torch._scaled_mm(dz8, transposed(w8, kernel).t(), scale_a=sg, scale_b=sw, out_dtype=ctx.dtypes[0])
        if ctx.fp8_weight_grad:  # dz8.T: (vocab, N) row-major; x8: (N, d) column-major
            grad_w = torch._scaled_mm(transposed(dz8, kernel), transposed(x_saved, kernel).t(), scale_a=sg,
                                      scale_b=sx, out_dtype=ctx.dtypes[1])
        else:
            grad_w = (dz.t() @ x_saved).to(ctx.dtypes[1]) * grad
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


def fp8_head_cross_entropy(x, weight, targets, cap: float, fp8_weight_grad: bool = True,
                           transpose_kernel: bool = True, fast_accum: bool = False, shift: float = 0.0,
                           temperature: float = 0.0, weights=None):
    """cross_entropy(fp8_linear(x, weight, 1 / n), targets, cap, kernel=True) (shift, temperature: the cap's,
    model.softcap), its gradient written in the forward (FP8HeadCrossEntropy): for training, where a backward
    follows. x: (N, d); weight: (vocab, d); targets: (N,), or (N, K) with weights (K,) for the multi-token loss
    (model.MultiTargets). fp8_weight_grad: the weight gradient's matmul in FP8 too, its operand transposed by
    `transposed` (transpose_kernel: our kernel, or the plain copy, its twin). fast_accum: the forward
    product with fast accumulation (speed.fp8_fast_accum). Where K.runs_on(x)."""
    dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return FP8HeadCrossEntropy.apply(x, weight, targets, weights, cap, dtype, fp8_weight_grad, transpose_kernel,
                                         fast_accum, shift, temperature)


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
    fast accumulation (speed.fp8_fast_accum). x: (..., d)."""
    with torch.autocast(x.device.type, enabled=False):
        y = FP8ReLU2MLP.apply(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), w1, w2, fast_accum)
    return y.view(*x.shape[:-1], w2.shape[0])
