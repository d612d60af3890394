"""Checks of onegpu_kernels.py's Triton kernels that run under Triton's CPU interpreter. TRITON_INTERPRET=1
must be set before Triton is imported, so tests/test_kernels.py runs them all in one fresh process
with it set (one start of torch and Triton, not one a check); the file is not named test_*.py, so pytest does not collect it itself.
float16 throughout: the interpreter computes with NumPy, which has no bfloat16."""

import contextlib
from unittest import mock

import torch

import attention as A
import fastpaths as FP
import fp8 as F8
import generate as G
import model as M
import onegpu_kernels as K


@contextlib.contextmanager
def counted(module, name: str):
    """module.name wrapped to count its calls (the list it yields), put back afterwards."""
    calls, inner = [], getattr(module, name)
    setattr(module, name, lambda *a, **k: calls.append(1) or inner(*a, **k))
    try:
        yield calls
    finally:
        setattr(module, name, inner)


# The record recipe's attention at the size of these checks: long and short sliding windows (8 and 4 keys)
# shorter than the 13 positions decoded, a value table, the gate, gainless QK-norm, half-truncated RoPE.
RECORD = {"mlp": "relu2", "qk_norm": True, "attn_window": 8, "short_windows": True, "value_embeds": 1,
          "attn_gate": True, "norm_gains": False, "rope_truncate": True, "tie_embeddings": False}
SMALL = dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, context=64)


def built(cfg: dict, **speed) -> M.Llama:
    """The plain model of cfg with the fast paths `speed` names swapped in: training's (fastpaths) and
    decoding's (generate), as a run and sample.py swap them."""
    model = M.Llama(M.ModelConfig(**cfg))
    FP.swap_in(model, FP.SpeedConfig(**speed))
    G.apply(model, FP.SpeedConfig(**speed), torch.device("cpu"))  # the interpreter runs the kernels on CPU
    return model


def decoded(model, idx, step=None):
    """Logits (1 + 3, B, vocab): a prefill of idx's first 10 tokens (B = 2), then one decode step for each of
    tokens 10-12 through the cache, eagerly or through `step` (decode_one compiled), which reads the whole
    cache as GraphDecoder's does."""
    with torch.no_grad():
        model.setup_cache(2)
        windows = model.cfg.windows()
        steps = [model(idx[:, :10], masks=A.cache_masks(torch.arange(10), 10, windows))[:, -1]]
        for t in range(10, 13):
            token, pos = idx[:, t:t + 1], torch.tensor([t])
            if step:
                steps.append(step(model, token, pos, model.cfg.context))
            else:
                steps.append(model(token, masks=A.cache_masks(pos, t + 1, windows))[:, -1])
    return torch.stack(steps).float()


def record_pair(g, **switches):
    """(the record recipe's model with the fused decode, the same weights with `switches` on, token ids
    (2, 16)), float16; the zero-initialised output projections and head given values first."""
    cfg = dict(**SMALL, **RECORD)
    plain = built(cfg, fused_decode=True).eval().half()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.endswith(("wo.weight", "w2.weight", "head.weight")):
                p.normal_(0.0, 0.05, generator=g)
    fast = built(cfg, fused_decode=True, **switches).eval().half()
    fast.load_state_dict(plain.state_dict())
    return plain, fast, torch.randint(0, 512, (2, 16), generator=g)


def traced_decode():
    """(decode_one compiled whole as GraphDecoder compiles it, the targets of its graph's nodes), the
    second filled as the first traces."""
    traced = []
    def record(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm
    return torch.compile(G.decode_one, backend=record, fullgraph=True), traced


def decode_check():
    """The fused decode step against QK-norm, RoPE, the value's mix, the cache write, two matmuls and the
    gate, float16; one case at modded-nanogpt's attention scale 0.12 (model.attn_scale), the others at
    1/sqrt(64); three with QK-norm; three with a sliding window (keys pos - window + 1..pos: one starting
    mid-block, one of a single key, one longer than the positions so far); one with the value scaled (mix 1)
    and two with a value embedding mixed in (mix 2), two of them gated (the record's attention)."""
    g = torch.Generator().manual_seed(0)
    llama = 64 ** -0.5
    for B, H, Hkv, S, pos, scale, qk_norm, window, mix, gate in [
            (1, 12, 4, 1024, 17, llama, True, 0, 0, False), (2, 2, 1, 512, 300, 0.12, False, 0, 0, False),
            (1, 6, 2, 256, 255, llama, True, 0, 0, False), (1, 1, 1, 128, 0, llama, False, 0, 0, False),
            (2, 6, 2, 512, 300, 0.12, True, 100, 2, True), (1, 2, 1, 128, 40, llama, False, 1, 1, False),
            (1, 2, 1, 128, 40, llama, False, 64, 0, False), (2, 3, 3, 128, 70, llama, False, 0, 2, True)]:
        qkv = torch.randn(B, 1, H + 2 * Hkv, 64, generator=g).half()
        cos, sin = (t[pos:pos + 1].half() for t in M.rope_tables(64, S, 10000.0))
        k_cache, v_cache = (torch.randn(B, Hkv, S, 64, generator=g).half() for _ in range(2))
        gains = [torch.rand(64, generator=g).half() + 0.5 for _ in range(2)] if qk_norm else [None, None]
        v_mix = (torch.rand(mix, generator=g) + 0.5).half() if mix else None
        ve = torch.randn(B, 1, Hkv * 64, generator=g).half() if mix == 2 else None
        gate_x, gate_w = torch.randn(B, 1, 40, generator=g).half(), torch.randn(H, M.GATE_CHANNELS, generator=g).half()
        parts = dict(v_mix=v_mix, ve=ve, **(dict(gate_x=gate_x, gate_w=gate_w) if gate else {}))
        # The plain path: QK-norm, RoPE, the value's mix, the cache write, then two matmuls and a softmax
        # over positions 0..pos, then the gate.
        q, k, v = qkv.float().split([H, Hkv, Hkv], dim=2)
        if qk_norm:
            q, k = M.rms_norm(q, 1e-5) * gains[0].float(), M.rms_norm(k, 1e-5) * gains[1].float()
        if mix:
            v = v * v_mix[0].float() + (v_mix[1].float() * ve.float().view_as(v) if mix == 2 else 0)
        q, k = M.apply_rope(q, cos.float(), sin.float()).half(), M.apply_rope(k, cos.float(), sin.float()).half()
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        k_ref[:, :, pos], v_ref[:, :, pos] = k[:, 0], v[:, 0].half()
        keys = torch.arange(S)
        mask = ((keys <= pos) & ((pos - keys < window) if window else True))[None, :]
        reference = A.decode_attention_matmuls(q.float().reshape(B, Hkv, H // Hkv, 64), k_ref.float(), v_ref.float(), mask,
                                               scale)
        if gate:
            reference = reference * torch.sigmoid(gate_x[:, 0, :M.GATE_CHANNELS].float() @ gate_w.float().t()).view(
                B, Hkv, H // Hkv, 1)
        first = max(0, pos + 1 - window) if window else 0  # the window's oldest key
        k_cache[:, :, pos:] = v_cache[:, :, pos:] = float("nan")  # stale cache from the token on: never read
        k_cache[:, :, :first] = v_cache[:, :, :first] = float("nan")  # nor before the window
        # One program per head, then the positions split over decode_splits(B, Hkv) programs (16 in every
        # case here), of which those past the positions so far hold no key (pos 17: 15 of 16).
        for counts in (None, torch.zeros(B, Hkv, dtype=torch.int32)):
            kc, vc = k_cache.clone(), v_cache.clone()
            out = K.decode_step(qkv, cos[0], sin[0], kc, vc, torch.tensor([pos]), scale, *gains, 1e-5, window,
                                **parts, counts=counts)
            err = (out.float().reshape(reference.shape) - reference).abs().max().item()
            case = (B, H, Hkv, S, pos, window, mix, counts is not None, err)
            assert out.shape == (B, 1, H, 64) and out.dtype == qkv.dtype and err < 2e-3, case
            assert torch.equal(kc[:, :, pos], k_ref[:, :, pos]) and torch.equal(vc[:, :, pos], v_ref[:, :, pos]), case
            assert torch.equal(kc[:, :, first:pos], k_ref[:, :, first:pos])  # the rest of the cache is left alone
            assert counts is None or not counts.any(), counts  # set back to zero for the next step

    # Traced as one opaque op (its fake implementation gives the shapes), as in the compiled decode step.
    step = torch.compile(K.decode_step, backend="aot_eager", fullgraph=True)
    qkv, caches = torch.randn(2, 1, 4, 64, generator=g).half(), torch.randn(2, 2, 1, 256, 64, generator=g).half()
    caches = torch.cat([caches, caches.clone()])  # two copies of the same k and v caches
    cos, sin = torch.randn(64, generator=g).half(), torch.randn(64, generator=g).half()
    out = step(qkv, cos, sin, caches[0], caches[1], torch.tensor([150]), 64 ** -0.5)
    assert torch.equal(out, K.decode_step(qkv, cos, sin, caches[2], caches[3], torch.tensor([150]), 64 ** -0.5))
    assert torch.equal(caches[0][:, :, 150], caches[2][:, :, 150])  # the cache write survives tracing


def decode_model_check():
    """Inside the model (fused_decode): the same logits as the plain path, prefill then 3 decode steps,
    for the article's Llama, for the Muon recipe, whose QK-norm the kernel computes (its gains off
    their init, so a kernel that skipped them would differ), and for the record recipe's attention:
    long and short sliding windows (8 and 4 keys) shorter than the 13 positions, value tables and the
    gate (both off their init too: the gate starts at zero, where every head's factor is 1/2), gainless
    QK-norm and half-truncated RoPE, all of which the kernel computes, its positions split (split_decode); then the
    decode step compiled whole (an Inductor compile for the CPU: the slow tier's)."""
    g = torch.Generator().manual_seed(1)
    kernel = K.decode_step
    for recipe in ({}, RECORD, {"mlp": "relu2", "qk_norm": True}):  # the Muon one last: it is compiled below
        cfg = dict(**SMALL, **recipe)
        plain = built(cfg).eval().half()
        with torch.no_grad():
            for name, p in plain.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight", "v_mix")):
                    p.uniform_(0.5, 1.5, generator=g)
                elif name.endswith("gate.weight"):
                    p.normal_(0.0, 1.0, generator=g)
        fused = built(cfg, fused_decode=True, split_decode=recipe is RECORD).eval().half()
        fused.load_state_dict(plain.state_dict())
        calls = []
        K.decode_step = lambda *a, **k: calls.append(sorted(k)) or kernel(*a, **k)
        idx = torch.randint(0, 512, (2, 16), generator=g)
        logits = [decoded(m, idx) for m in (plain, fused)]
        assert len(calls) == 2 * 3 and (logits[0] - logits[1]).abs().max() < 1e-2, (recipe, len(calls))
        norm = ["eps", "k_gain", "q_gain"] if recipe.get("qk_norm") else []
        record_parts = ["counts", "gate_w", "gate_x", "v_mix", "ve"] if recipe is RECORD else []
        assert calls[0] == sorted(norm + record_parts + ["window"]), calls[0]  # everything went into the kernel

    # The decode step compiled whole, as GraphDecoder compiles it: the graph calls the fused op (the
    # model's checks, the cache's `fusable` flag among them, trace as constants) and gives the same logits.
    K.decode_step = kernel  # (the compiled step of the Muon recipe, the last model above)
    step, traced = traced_decode()
    again = decoded(fused, idx, step)
    assert any("decode_step" in target for target in traced), traced
    assert (again - logits[1]).abs().max() < 1e-3


def small_matmul_check():
    """The decode step's small matmuls against F.linear in float64 (two with ReLU²'s square in the epilogue):
    one row, rows and columns that leave a program partly masked, 16 rows (the most it takes), a (B, 1, K)
    input as a decode step hands it; then
    inside a model of the record recipe, whose every matmul of a decode step it takes, the same logits as
    the plain model's, eagerly and traced as the compiled decode step traces it."""
    g = torch.Generator().manual_seed(0)
    for shape, N, relu2 in [((1, 96), 48, False), ((5, 200), 100, True), ((16, 256), 768, False), ((2, 1, 64), 40, True)]:
        x, w = torch.randn(*shape, generator=g).half(), torch.randn(N, shape[-1], generator=g).half()
        assert K.small_matmul_supported(x, w)
        out = K.small_matmul(x, w, relu2)
        exact = x.double() @ w.double().t()
        exact = exact.relu().square() if relu2 else exact
        assert out.shape == exact.shape and out.dtype == x.dtype, shape
        assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 2e-3, shape
    assert not K.small_matmul_supported(torch.randn(17, 96).half(), torch.randn(48, 96).half())  # too many rows
    assert not K.small_matmul_supported(torch.randn(1, 96), torch.randn(48, 96))  # float32: F.linear keeps it

    plain, small, idx = record_pair(g, decode_matmuls=True)
    with counted(K, "small_matmul") as calls:
        logits = [decoded(m, idx) for m in (plain, small)]  # the prefill's 20 tokens: F.linear
    # 3 steps x (2 layers x 4 matmuls + the head), the plain model none
    assert len(calls) == 3 * 9, len(calls)
    assert (logits[0] - logits[1]).abs().max() < 1e-2 * logits[0].abs().max()

    step, traced = traced_decode()
    again = decoded(small, idx, step)
    assert sum("small_matmul" in target for target in traced) == 9, traced
    assert (again - logits[1]).abs().max() < 1e-3


def swiglu_check():
    """The fused SwiGLU against the plain line, forward and backward, eager and compiled."""
    g = torch.Generator().manual_seed(0)
    # Against silu(gate) * up in float64, forward and backward: a hidden size of two full programs
    # (2,048) and one that leaves most of a program masked (96).
    for shape, dtype, tol in [((3, 5, 2 * 2048), torch.float32, 1e-5), ((2, 7, 2 * 96), torch.float16, 3e-3)]:
        h13 = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
        grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
        exact = h13.detach().double().requires_grad_()
        gate, up = exact.chunk(2, dim=-1)
        reference = torch.nn.functional.silu(gate) * up
        reference.backward(grad.double())
        out = K.swiglu(h13)
        out.backward(grad)
        assert out.shape == reference.shape and out.dtype == dtype
        assert (out.double() - reference).abs().max() < tol * reference.abs().max(), shape
        assert (h13.grad.double() - exact.grad).abs().max() < tol * exact.grad.abs().max(), shape

    # Inside the model (fused_swiglu): the loss and every gradient of the plain model, eagerly (one
    # call per layer) and traced by torch.compile, which keeps the op and its backward.
    cfg = dict(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=128, context=32)
    idx, targets = torch.randint(0, 128, (2, 2, 32), generator=g)
    calls, kernel = [], K.swiglu
    runs = []
    for fused, compiled in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = built(cfg, fused_swiglu=fused)
        K.swiglu = (lambda h: calls.append(1) or kernel(h)) if not compiled else kernel
        loss = (torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model)(idx, targets)
        loss.backward()
        runs.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    K.swiglu = lambda h: calls.append(1) or kernel(h)
    try:
        with torch.no_grad():  # evaluation and decoding keep the plain activation (Inductor fuses it there)
            model(idx)
    finally:
        K.swiglu = kernel  # the checks after this one, in the same process, see the kernel itself
    assert len(calls) == 2, len(calls)
    for loss, grads in runs[1:]:
        assert abs(loss - runs[0][0]) < 1e-5
        for name, grad in grads.items():
            assert (grad - runs[0][1][name]).abs().max() <= 1e-4 * runs[0][1][name].abs().max() + 1e-7, name


def cross_entropy_check():
    """The cross-entropy kernels against model.softcap and F.cross_entropy in float64, forward and
    backward, float16 logits: with the soft-cap and without, a vocabulary that the kernel's block does
    not divide (and a cap above 40, which takes the running max), record #54's shifted cap, and a per-row
    gradient (its mean) as the loss's backward hands it in."""
    g = torch.Generator().manual_seed(0)
    for n, vocab, cap, *shaped in [(5, 4096, 15.0), (3, 2500, 0.0), (4, 300, 2.0), (2, 1000, 50.0),  # 50: running max
                                   (4, 2500, 11.5, 5.0, 15.0)]:  # shift 5, temperature 15
        # rising along the row, so that a later block holds a larger max than the blocks before it
        logits = (torch.randn(n, vocab, generator=g) * 6 + torch.linspace(-10, 10, vocab)).half().requires_grad_()
        targets = torch.randint(0, vocab, (n,), generator=g)
        loss, lse = K.cross_entropy(logits, targets, cap, *shaped)
        loss.mean().backward()
        z = logits.detach().double().requires_grad_()
        reference = torch.nn.functional.cross_entropy(M.softcap(z, cap, *shaped), targets, reduction="none")
        reference.mean().backward()
        assert loss.dtype == torch.float32 and lse.shape == (n,)
        assert (loss.double() - reference.detach()).abs().max() < 1e-5, (n, vocab, cap)
        err = (logits.grad.double() - z.grad).abs().max() / z.grad.abs().max()
        assert err < 1e-3, (n, vocab, cap, err)  # float16 rounds to 2^-11 of the largest
        assert logits.grad.dtype == logits.dtype


def multi_cross_entropy_check():
    """The multi-token loss kernels against model.cross_entropy with weights in float64, forward and backward,
    float16 logits: three targets weighted 1, 0.5, 0.25, some past the sequence's end (-1), with the soft-cap and
    without, and a vocabulary the kernel's block does not divide, there with a fourth, the prefix token
    (train.prefix_weight), which may be another column's target too (both weights land on that logit) or none (-1)."""
    g = torch.Generator().manual_seed(3)
    for n, vocab, cap, weights, *shaped in [(6, 4096, 15.0, [1.0, 0.5, 0.25]), (4, 2500, 0.0, [1.0, 0.5, 0.25, 0.25]),
                                            (3, 1000, 11.5, [1.0, 0.5, 0.25], 5.0, 15.0)]:  # record #54's cap
        logits = (torch.randn(n, vocab, generator=g) * 6).half().requires_grad_()
        targets = torch.randint(0, vocab, (n, len(weights)), generator=g)
        targets[-1, 1:3] = targets[-2, 2] = -1  # the last rows' later targets lie past the sequence
        if len(weights) == 4:
            targets[:2, 3], targets[2, 3] = targets[:2, 1], -1  # the prefix token is the 2nd token ahead, or none
        weights = torch.tensor(weights)
        loss, lse = K.multi_cross_entropy(logits, targets, weights, cap, *shaped)
        loss.mean().backward()
        z = logits.detach().double().requires_grad_()
        reference = M.cross_entropy(z, targets, cap, weights.double(), *shaped)
        reference.backward()
        assert loss.dtype == torch.float32 and lse.shape == (n,)
        assert abs(loss.double().mean() - reference.detach()) < 1e-5, (n, vocab, cap)
        err = (logits.grad.double() - z.grad).abs().max() / z.grad.abs().max()
        assert err < 1e-3, (n, vocab, cap, err)
        # the loss and its gradients from one launch (the FP8 head's): the two kernels' to the bit, the e5m2 copy
        # within its rounding of the float64 gradient (or, the interpreter dropping a carry, at half: fp8_head_loss_check)
        caps, scale = dict(zip(("shift", "temperature"), shaped)), torch.finfo(torch.float8_e5m2).max * n / len(weights)
        one, dz1, dz81 = K.multi_cross_entropy_and_gradient(logits.detach(), targets, weights, cap, scale, **caps)
        dz = K.multi_cross_entropy_backward(logits.detach(), targets, weights, lse, torch.full((n,), 1.0 / n), cap,
                                            *shaped)
        assert torch.equal(one, loss.detach()) and torch.equal(dz1, dz), (n, vocab, cap)
        err = (dz81.double() / scale - z.grad).abs()
        assert ((err <= 0.25 * z.grad.abs() + 2 ** -16 / scale) | (err <= 0.5 * z.grad.abs())).all()
        only = K.multi_cross_entropy_and_gradient(logits.detach(), targets, weights, cap, scale, True, **caps)
        assert only[1].numel() == 0 and torch.equal(only[2].float(), dz81.float())
    # and as the training loss runs it: the loss kernel's output swap, given MultiTargets, against the plain output
    cfg = M.ModelConfig(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=512, context=32,
                        tie_embeddings=False, logit_softcap=15.0)
    torch.manual_seed(0)
    model = M.Llama(cfg).train()
    torch.nn.init.normal_(model.head.weight, 0, 0.2)
    idx = torch.randint(0, 512, (2, 32), generator=g)
    targets = M.MultiTargets(torch.randint(0, 512, (2, 32, 3), generator=g), torch.tensor([1.0, 0.5, 0.25]))
    plain = model(idx, targets)
    FP.swap_in(model, FP.SpeedConfig(loss_kernel=True))
    assert type(model.output) is FP.TrainingLoss and abs(model(idx, targets).item() - plain.item()) < 1e-5


def fp8_head_loss_check():
    """model.fp8_head_cross_entropy (the FP8 head and the loss kernel as one function, whose backward
    writes the gradient's FP8 copy in the loss kernel) against the two apart, fp8_linear then the loss
    kernel: the same loss; the same weight gradient with the bf16 one, within FP8's rounding of it with
    FP8's (its product alone a tenth as close: a weight gradient in bf16 there fails); an input gradient
    within FP8's rounding of theirs; and the kernel's FP8 copy within one e5m2 step (a quarter) of the
    gradient it scales; the paths agree to the bit."""
    g = torch.Generator().manual_seed(1)
    n, d, vocab, cap = 48, 64, 2500, 15.0
    x0, w0 = torch.randn(n, d, generator=g).half(), (torch.randn(vocab, d, generator=g) * 0.5).half()
    targets = torch.randint(0, vocab, (n,), generator=g)
    out = []
    for fused, fp8_weight_grad in ((True, False), (True, True), (False, False)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = (F8.fp8_head_cross_entropy(x, w, targets, cap, fp8_weight_grad) if fused else
                K.cross_entropy(F8.fp8_linear(x, w, grad_bound=1.0 / n), targets, cap)[0].mean())
        (loss / 4).backward()  # as with four micro-batches: the fused backward scales its products by 1/4
        out.append((loss.detach(), x.grad, w.grad))
    (l1, gx1, gw1), (l8, gx8, gw8), (l2, gx2, gw2) = out

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert torch.equal(l1, l2) and torch.equal(l8, l2)
    assert rel(gw1, gw2) < 1e-3 and 1e-3 < rel(gw8, gw2) < 0.05 and torch.equal(gx8, gx1)
    assert rel(gx1, gx2) < 0.05
    logits = (x0.float() @ w0.float().t()).half()
    _, lse = K.cross_entropy(logits, targets, cap)
    scale = torch.finfo(torch.float8_e5m2).max * n
    dz, dz8 = K.cross_entropy_backward(logits, targets, lse, torch.full((n,), 1.0 / n), cap, scale)
    z = logits.double().requires_grad_()
    torch.nn.functional.cross_entropy(M.softcap(z, cap), targets).backward()
    assert dz8.dtype == torch.float8_e5m2 and dz8.shape == dz.shape
    # Within e5m2's rounding of the float64 gradient, a quarter of it, or below e5m2's smallest step
    # (2^-16 once scaled); but Triton 3.6's interpreter drops the carry when rounding up crosses a power of
    # two (7.6 becomes 4, not 8), so here a value may also come out at half: a wrong scale still fails.
    err = (dz8.double() / scale - z.grad).abs()
    assert ((err <= 0.25 * z.grad.abs() + 2 ** -16 / scale) | (err <= 0.5 * z.grad.abs())).all()
    assert (dz8.double() * z.grad >= 0).all()
    assert K.cross_entropy_backward(logits, targets, lse, torch.full((n,), 1.0 / n), cap)[1].numel() == 0
    # The loss and both gradients from one launch equal the two kernels' (the gradient read backwards)
    loss, dz1, dz81 = K.cross_entropy_and_gradient(logits, targets, cap, scale)
    assert torch.equal(loss, K.cross_entropy(logits, targets, cap)[0])
    assert torch.equal(dz1, dz) and torch.equal(dz81.float(), dz8.float())
    assert K.cross_entropy_and_gradient(logits, targets, cap)[2].numel() == 0
    only = K.cross_entropy_and_gradient(logits, targets, cap, scale, fp8_only=True)  # the e5m2 gradient alone
    assert only[1].numel() == 0 and torch.equal(only[0], loss) and torch.equal(only[2].float(), dz8.float())
    # ... and with record #54's shifted cap, the one launch as the two kernels, which agree with the plain path above
    shaped = dict(shift=5.0, temperature=15.0)
    loss, dz1, dz81 = K.cross_entropy_and_gradient(logits, targets, 11.5, scale, **shaped)
    first, lse = K.cross_entropy(logits, targets, 11.5, **shaped)
    dz, dz8 = K.cross_entropy_backward(logits, targets, lse, torch.full((n,), 1.0 / n), 11.5, scale, **shaped)
    assert torch.equal(loss, first) and torch.equal(dz1, dz) and torch.equal(dz81.float(), dz8.float())
    assert not torch.equal(first, K.cross_entropy(logits, targets, 11.5)[0])
    # The model takes the one function where fp8_head and loss_kernel are both on: its loss and head gradient
    # as the FP8 head with the plain loss, within FP8's rounding (a wrong target or cap there fails).
    cfg = dict(d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=300, context=16, tie_embeddings=False,
               logit_softcap=cap)
    idx, targets = torch.randint(0, 300, (2, 2, 16), generator=g)
    # ... and so with the multi-token loss's targets (the last position's later ones none): its K targets' kernel
    multi = M.MultiTargets(torch.randint(0, 300, (2, 16, 3), generator=g), torch.tensor([1.0, 0.5, 0.25]))
    multi.ids[:, -1, 1:] = -1
    for aims in (targets, multi):
        grads = []
        with counted(FP, "fp8_head_cross_entropy") as calls:
            for kernel in (True, False):
                torch.manual_seed(0)
                model = built(cfg, fp8_head=True, loss_kernel=kernel).train()
                torch.nn.init.normal_(model.head.weight, std=0.2)
                loss = model(idx, aims)
                loss.backward()
                grads.append((loss.detach(), model.head.weight.grad))
        (l1, h1), (l2, h2) = grads
        assert calls == [1] and abs(l1 - l2) < 1e-4 and ((h1 - h2).norm() / h2.norm()) < 0.05, (l1, l2)


def relu2_check():
    """The fused ReLU² MLP against the plain ReLU2 module: relu2_matmul against a float32 matmul, then
    model.FusedReLU2MLP's output and gradients (its backward from the kept activation alone) against
    autograd through the plain line, float16, shapes that the kernel's tiles do not divide."""
    g = torch.Generator().manual_seed(2)
    n, d, hidden = 150, 96, 200
    x = torch.randn(n, d, generator=g).half()
    w1, w2 = (torch.randn(hidden, d, generator=g) * 0.1).half(), (torch.randn(d, hidden, generator=g) * 0.1).half()
    act = K.relu2_matmul(x, w1.t())
    ref = torch.relu(x.float() @ w1.float().t()).square()
    assert act.dtype == x.dtype and ((act.float() - ref).abs().max() / ref.abs().max()) < 2e-3
    gy = torch.randn(n, d, generator=g).half()
    cfg = M.ModelConfig(d_model=d, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, context=8, mlp="relu2",
                        ffn_hidden=hidden)
    out = []
    for fused in (True, False):
        mlp = M.ReLU2(cfg).half()
        if fused:
            FP.swap(mlp, FP.FusedReLU2)
        with torch.no_grad():
            mlp.w1.weight.copy_(w1)
            mlp.w2.weight.copy_(w2)
        xi = x.clone().requires_grad_()
        y = mlp(xi)
        (y.float() * gy.float()).sum().backward()
        out.append((y, xi.grad, mlp.w1.weight.grad, mlp.w2.weight.grad))
    for fused_t, plain_t in zip(*out):
        assert fused_t.dtype == plain_t.dtype
        assert ((fused_t.float() - plain_t.float()).norm() / plain_t.float().norm()) < 5e-3


def relu2_fp8_check():
    """The FP8 ReLU² MLP's two row kernels against their plain twins (model.relu2_fp8_plain and
    relu2_fp8_backward_plain), float16, rows of 200 (not a power of two) and a row whose activation is all zero."""
    g = torch.Generator().manual_seed(4)
    u = torch.randn(150, 200, generator=g).half()
    u[3] = -1.0  # relu(u)^2 = 0: its scale must stay finite
    dh = torch.randn(150, 200, generator=g).half()

    def same_fp8(got, want):  # the same e4m3 casts, as values and as inverse scales
        (g8, gs), (w8, ws) = got, want
        assert g8.dtype == w8.dtype == F8.E4M3 and gs.shape == ws.shape == (150, 1)
        assert torch.allclose(gs, ws, rtol=1e-6, atol=0) and torch.isfinite(gs).all()
        # The interpreter's cast to e4m3 is not the GPU's: it may land one step off (20 for 22, 0 for the
        # smallest subnormal, 2^-9), and halves a value whose rounding carries into the next power of two (31.35
        # to 16, not 32). tests/test_gpu.py holds the GPU's casts to torch's.
        got, want = g8.float(), w8.float()
        step = (got - want).abs() <= torch.maximum(want.abs() / 8, torch.tensor(2.0 ** -9))
        power = (want != 0) & (want.abs() == 2.0 ** torch.log2(want.abs().clamp(min=2.0 ** -9)).round())
        assert (step | (power & (got == want / 2))).all() and (got != want).float().mean() < 0.05

    same_fp8(K.relu2_fp8(u), F8.relu2_fp8_plain(u))
    (a, du, *cast), (want_a, want_du, *want_cast) = K.relu2_fp8_backward(dh, u), F8.relu2_fp8_backward_plain(dh, u)
    assert torch.equal(a, want_a) and torch.equal(du, want_du)
    same_fp8(cast, want_cast)


def transposed_check():
    """onegpu_kernels.transposed against t.t().contiguous(): the same bytes for e5m2 and e4m3 matrices whose sides
    the tile (64 x 64 under the interpreter) does not divide, or exceeds; sides it cannot take go to the plain
    copy; then the FP8 head's one function, and the FP8 head alone, take the same gradients with the kernel as
    with the plain copy, and ran it."""
    g = torch.Generator().manual_seed(7)
    for shape, dtype in (((100, 300), torch.float8_e5m2), ((132, 64), torch.float8_e4m3fn), ((4, 72), torch.float8_e5m2)):
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
        assert K.transposed_supported(t)
        got = K.transposed(t)
        assert got.dtype == dtype and got.shape == shape[::-1] and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), t.t().contiguous().view(torch.uint8))
    odd = torch.randn(6, 70, generator=g).to(torch.float8_e5m2)  # sides not multiples of 4: the plain copy
    assert not K.transposed_supported(odd)
    shifted = torch.randn(4 * 72 + 1, generator=g).to(torch.float8_e5m2)[1:].view(4, 72)  # starts off a word:
    with mock.patch.object(K, "_transpose_kernel", None):  # the op copies it plainly, never reaching the kernel
        for t in (odd, shifted):
            assert torch.equal(F8.transposed(t, True).view(torch.uint8), t.t().contiguous().view(torch.uint8))
    n, d, vocab, cap = 16, 32, 300, 15.0
    x0, w0 = torch.randn(n, d, generator=g).half(), (torch.randn(vocab, d, generator=g) * 0.5).half()
    targets = torch.randint(0, vocab, (n,), generator=g)
    grads = []
    with counted(K, "transposed") as calls:
        for kernel in (True, False):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            F8.fp8_head_cross_entropy(x, w, targets, cap, fp8_weight_grad=True, transpose_kernel=kernel).backward()
            grads.append((x.grad, w.grad))
    assert calls == [1, 1, 1]  # with the kernel only: the gradient transposed, and w8 and x8 column-major
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    # The FP8 head without the loss kernel (model.FP8Matmul) makes w8 column-major the same way.
    grads = []
    with counted(K, "transposed") as calls:
        for kernel in (True, False):
            x = x0.clone().requires_grad_()
            with mock.patch.object(K, "transposed_supported", K.transposed_supported if kernel else lambda t: False):
                F8.fp8_linear(x, w0, grad_bound=1.0 / n).float().mean().backward()
            grads.append(x.grad)
    assert calls == [1] and torch.equal(grads[0], grads[1])


def gram_check():
    """onegpu_kernels.gram against float32 matmuls (x x^T, and b G + c G G), on sides the tiles do not divide and on
    a transposed view; then Muon's step with the kernel against Muon without, float16, and that it ran."""
    import optim as O
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 150, 200, generator=g).half()
    for stack in (x, torch.randn(2, 200, 150, generator=g).half().mT):  # contiguous, and a tall matrix's view
        reference = stack.float() @ stack.float().mT
        out = K.gram(stack)
        assert out.shape == (2, 150, 150) and out.dtype == stack.dtype
        assert (out.float() - reference).abs().max() < 1e-3 * reference.abs().max()
        # Each tile off the diagonal is stored with its mirror, bit for bit. A diagonal tile is one dot of
        # its own, whose (a, b) and (b, a) sums may round apart (numpy's matmul under the interpreter).
        tile = torch.arange(150) // K.GRAM_TILES[0][0]
        off = tile[:, None] != tile[None, :]
        assert torch.equal(out[:, off], out.mT[:, off])
    gram = (x.float() @ x.float().mT / 200).half()
    b, c = O.NS_COEFFICIENTS[1:]
    reference = b * gram.float() + c * gram.float() @ gram.float()
    mix = K.gram(gram, gram, alpha=c, beta=b)
    assert (mix.float() - reference).abs().max() < 2e-3 * reference.abs().max()
    steps = []
    with counted(K, "gram") as calls:
        for kernel in (True, False):
            w = torch.nn.Parameter(torch.randn(96, 160, generator=torch.Generator().manual_seed(4)))
            w.grad = torch.randn(96, 160, generator=torch.Generator().manual_seed(5))
            O.Muon([w], lr=0.1, ns_dtype=torch.float16, kernel=kernel).step()
            steps.append(w.detach().clone())
    assert len(calls) == 2 * O.NS_STEPS  # two symmetric products a Newton-Schulz step
    assert ((steps[0] - steps[1]).norm() / steps[1].norm()) < 1e-3


def qk_norm_rope_check():
    """model.QKNormRope (the plain lines forward, onegpu_kernels.qk_norm_rope_backward) against the plain lines
    (RMSNorm with q's and k's gains, then model.apply_rope) in float32: forward and the gradients of qkv and
    both gains, float16, for full and half-truncated RoPE (the latter YaRN's, its tables scaled), at 10 tokens (fewer than a program's 16 x
    QK_BLOCKS = 128 in the interpreter) and at 135 (two token tiles of each head, the second partly masked;
    the partial gain gradients of all q and all k programs are summed), and with the outputs' gradients in
    attention's layout; then the model takes it in training with fused_qk_norm_rope."""
    g = torch.Generator().manual_seed(6)
    H, Hkv, D = 4, 2, 16
    for truncate, B, T, yarn in ((False, 2, 5, None), (True, 3, 45, (8, 32))):  # yarn: tables scaled too
        cos, sin = (t.half() for t in M.rope_tables(D, T, 10000.0, truncate, yarn))
        qkv0 = torch.randn(B, T, H + 2 * Hkv, D, generator=g).half()
        gains0 = [torch.rand(D, generator=g) + 0.5 for _ in range(2)]
        dout = torch.randn(B, T, H + 2 * Hkv, D, generator=g).half()
        results = []
        for fused in (True, False):
            qkv = qkv0.clone().float().requires_grad_() if not fused else qkv0.clone().requires_grad_()
            gains = [x.clone().requires_grad_() for x in gains0]
            if fused:
                out = torch.cat(FP.QKNormRope.apply(qkv, cos, sin, gains[0], gains[1], H, 1e-5), 2)  # its gradients: views
            else:  # in float32, the reference
                q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
                q, k = M.rms_norm(q, 1e-5) * gains[0], M.rms_norm(k, 1e-5) * gains[1]
                out = torch.cat([M.apply_rope(q, cos.float(), sin.float()), M.apply_rope(k, cos.float(), sin.float()), v], 2)
            out.backward(dout.float() if not fused else dout)
            results.append((out.detach().float(), qkv.grad.float(), gains[0].grad, gains[1].grad))
        for got, want in zip(*results):
            assert (got - want).abs().max() < 4e-3 * want.abs().max(), (truncate, (got - want).abs().max())
        assert results[0][0].dtype == torch.float32 and torch.equal(results[0][0][:, :, H + Hkv:], qkv0[:, :, H + Hkv:].float())
        # The backward reads each gradient where it lies: as attention leaves dq, dk and dv, (B, heads, T, D)
        # in memory, the same as contiguous
        grads = dout.split([H, Hkv, Hkv], dim=2)
        apart = [K.qk_norm_rope_backward(*(f(x) for x in grads), qkv0, cos, sin, gains0[0], gains0[1], H, 1e-5)
                 for f in (torch.Tensor.contiguous, lambda x: x.transpose(1, 2).contiguous().transpose(1, 2))]
        assert all(torch.equal(x, y) for x, y in zip(*apart))
    cfg = dict(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97, context=16, qk_norm=True)
    losses = []
    with counted(K, "qk_norm_rope_backward") as calls:
        for on in (True, False):
            torch.manual_seed(0)
            model = built(cfg, fused_qk_norm_rope=on).train()
            for gain in (model.blocks[0].attn.q_norm.weight, model.blocks[0].attn.k_norm.weight):
                torch.nn.init.uniform_(gain, 0.5, 1.5)  # off one, so that a gain gradient left out would show
            idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(7))
            loss = model(idx, idx)
            loss.backward()
            losses.append((loss.detach(), model.blocks[0].attn.q_norm.weight.grad))
    assert calls == [1] and abs(losses[0][0] - losses[1][0]) < 1e-4
    assert ((losses[0][1] - losses[1][1]).norm() / losses[1][1].norm()) < 1e-3


def decode_mlp_check():
    """The decode MLP's partial sums against the plain MLP in float64: one row, rows that leave a tl.dot
    tile partly masked, 16 rows (the most it takes), hidden units that leave its last program partly
    masked, a (B, 1, d) input as a decode step hands it, at onegpu_kernels.py's hidden units a program and at 16
    (200 columns: two tiles of W2); then inside a model of the record recipe, the same logits as the plain
    model's, eagerly and traced as the compiled decode step traces it."""
    g = torch.Generator().manual_seed(0)
    cases = [((1, 64), 96, None), ((5, 200), 100, None), ((16, 128), 512, None), ((2, 1, 64), 256, None),
             ((3, 64), 100, 16), ((5, 200), 100, 16)]
    for shape, hidden, units in cases:
        x = torch.randn(*shape, generator=g).half()
        w1 = torch.randn(hidden, shape[-1], generator=g).half()
        w2 = (torch.randn(shape[-1], hidden, generator=g) * hidden ** -0.5).half()
        assert K.decode_mlp_supported(x, w1, w2)
        with K.launch_settings(DECODE_MLP_HIDDEN=units):
            parts = K.decode_mlp(x, w1, w2)
            assert parts.shape[0] == -(-hidden // K.DECODE_MLP_HIDDEN) and parts.dtype == torch.float32
        exact = (x.double() @ w1.double().t()).relu().square() @ w2.double().t()
        assert parts.shape[1:] == exact.shape
        assert ((parts.sum(0).double() - exact).abs().max() / exact.abs().max()).item() < 2e-3, shape
        assert K.chosen_tiles(K._decode_mlp_kernel).startswith("BLOCK_K="), K.chosen_tiles(K._decode_mlp_kernel)
    assert not K.decode_mlp_supported(x, w1, w2.t().contiguous().t())  # W2 stored as (hidden, d)
    x, w1 = torch.randn(17, 64).half(), torch.randn(96, 64).half()
    assert not K.decode_mlp_supported(x, w1, w1.t().contiguous())  # too many rows: the plain MLP keeps them
    assert not K.decode_mlp_supported(x[:1], w1, w1)  # w2 of the wrong shape

    plain, fused, idx = record_pair(g, decode_mlp=True)
    with counted(K, "decode_mlp") as calls:
        logits = [decoded(m, idx) for m in (plain, fused)]  # the prefill's 20 tokens: the plain MLP
    assert len(calls) == 3 * 2, len(calls)  # 3 steps x 2 layers, the plain model none
    assert (logits[0] - logits[1]).abs().max() < 1e-2 * logits[0].abs().max()

    step, traced = traced_decode()
    again = decoded(fused, idx, step)
    assert sum("decode_mlp" in target for target in traced) == 2, traced
    assert (again - logits[1]).abs().max() < 1e-3


def compiled_against_eager(cfg: dict, speed: dict, ops: tuple[str, ...], rel: float, mtp: bool = False):
    """cfg's model with speed's paths in training, compiled by Inductor for the CPU, against the same model eager, with an incoming
    gradient of 1/4, as under gradient accumulation: the loss and every gradient within rel of the eager one's
    largest magnitude. Each of ops (onegpu_kernels' custom ops) must have run in the eager pass; counted eagerly
    only, since a counting wrapper's side effect inside an autograd.Function stops Dynamo. mtp: the multi-token
    loss's targets (three, weighted 1, 0.5, 0.25)."""
    idx = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7))
    targets = (M.MultiTargets(torch.stack([idx, idx.roll(1, 1), idx.roll(2, 1)], -1), torch.tensor([1.0, 0.5, 0.25]))
               if mtp else idx)
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = built(cfg, **speed).train()
        with contextlib.ExitStack() as stack:
            calls = [stack.enter_context(counted(K, op)) for op in ([] if compiled else ops)]
            # fullgraph: a graph break around a fast path runs it eagerly, where this check still agreed
            loss = (torch.compile(model, fullgraph=True) if compiled else model)(idx, targets)
            (loss / 4).backward()
        assert all(calls), dict(zip(ops, calls))
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
    for got, want in zip(*runs):
        assert (got - want).abs().max() <= rel * want.abs().max() + 1e-8


def compiled_custom_ops_check():
    """The training fast paths that are custom ops (the FP8 head with the loss and its gradient from one
    launch and its gradient's transposed copy, QK-norm + RoPE's backward taking the gradients of q, k and v
    apart, the multi-token loss's kernels), compiled against eager:
    their fake implementations and autograd registrations are what compiling exercises, which the eager
    checks above do not."""
    cfg = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, context=16, qk_norm=True,
               value_embeds=1, tie_embeddings=False, logit_softcap=15.0)  # 100 words, 32 tokens: the transpose's sides
    speed = dict(fp8_head=True, loss_kernel=True, fused_qk_norm_rope=True)
    compiled_against_eager(cfg, speed, ("qk_norm_rope_backward", "cross_entropy_and_gradient", "transposed"), 1e-5)
    # the FP8 head without the loss kernel (fp8.FP8Matmul), its w8 made column-major by the same kernel
    compiled_against_eager(cfg, {**speed, "loss_kernel": False}, ("transposed",), 1e-5)
    # the multi-token loss's kernel after the head
    compiled_against_eager(cfg, {"loss_kernel": True}, ("multi_cross_entropy", "multi_cross_entropy_backward"), 1e-5,
                           mtp=True)


def one_graph_check():
    """Every training fast path that runs here, with the FP8 head alone and in one function with the loss kernel,
    traced by Dynamo as one graph (its eager backend: the tracing without Inductor's compile, a few seconds). A
    graph break inside an autograd function runs the whole function eagerly (the FP8 head's did: docs/LOG.md,
    2026-12-05)."""
    base = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, context=16, qk_norm=True,
                mlp="relu2", ffn_hidden=128, value_embeds=1, tie_embeddings=False, logit_softcap=15.0)
    idx = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    for loss_kernel in (True, False):
        model = built(base, fp8=True, fp8_head=True, fused_qk_norm_rope=True, loss_kernel=loss_kernel).train()
        torch.compile(model, backend="eager", fullgraph=True)(idx, idx).backward()


def compiled_fp8_mlp_check():
    """model.FP8ReLU2MLP with its two row kernels (custom ops) compiled against eager. Inductor fuses the casts
    around them into other kernels, where a value is rounded to bf16 at other points than eagerly, and e4m3's
    steps are 1/8: the two agree within a few percent, not to the last bit."""
    cfg = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, context=16, qk_norm=True,
               mlp="relu2", ffn_hidden=128, tie_embeddings=False)
    compiled_against_eager(cfg, {"fp8": True}, ("relu2_fp8", "relu2_fp8_backward"), 0.06)
