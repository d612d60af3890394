"""fastpaths.py: each training fast path computes what its plain twin computes (within the rounding of its
precision), swaps in without changing a parameter's name, runs only where its rule says, and leaves evaluation
to the plain path. The Triton kernels' own agreement tests are tests/test_kernels.py (through Triton's
interpreter) and tests/test_gpu.py."""

from dataclasses import replace

import pytest
import torch

import attention as A
import fastpaths as FP
import fp8 as F8
import model as M
from conftest import needs_cpu_fp8

SMALL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, context=32)


def small_model(dtype=torch.float64, speed: FP.SpeedConfig | None = None, **overrides):
    """The plain model of SMALL's shape with overrides, and the fast paths of `speed` swapped in (on any device:
    FP8 is emulated on a CPU)."""
    torch.manual_seed(0)
    model = M.Llama(M.ModelConfig(**{**SMALL, **overrides})).to(dtype).eval()
    if speed is not None:
        FP.swap_in(model, speed)
    return model


def test_fp8_head_trains_close_to_the_plain_head_and_evaluates_plainly(monkeypatch):
    """fp8_head: the training loss and gradients stay within FP8 rounding of the plain head; the head's
    gradient is scaled by its bound 1/n, n the tokens of the mean, and a gradient far below e5m2's range
    survives that scaling where a bound of 1 would flush it; without gradients (evaluation) the plain
    head runs, bit for bit."""
    bounds = []
    fp8_linear = F8.fp8_linear
    monkeypatch.setattr(FP, "fp8_linear", lambda x, w, grad_bound=None, fast_accum=False:
                        bounds.append(grad_bound) or fp8_linear(x, w, grad_bound, fast_accum))
    parts = dict(tie_embeddings=False, logit_softcap=15.0)
    plain = small_model(torch.float32, **parts)
    fp8 = small_model(torch.float32, FP.SpeedConfig(fp8_head=True), **parts)
    with torch.no_grad():
        for model in (plain, fp8):
            model.head.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    idx, targets = torch.randint(0, 97, (2, 4, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(plain(idx, targets), fp8(idx, targets))
    grads = []
    for model in (plain, fp8):
        model.train()
        loss = model(idx, targets)
        loss.backward()
        grads.append((loss.detach(), model.head.weight.grad, model.embed.weight.grad))

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    (l0, h0, e0), (l1, h1, e1) = grads
    assert abs(l1 - l0) < 0.02 and rel(h1, h0) < 0.12 and rel(e1, e0) < 0.12
    assert l1 != l0 and bounds == [1 / 128]  # it really ran in FP8, its gradient bounded by 1 / (4 x 32 tokens)
    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(16, 32)
    tiny = 1e-11 * torch.randn(64, 16)  # far below e5m2's smallest subnormal, 1.5e-5, unless scaled up
    for bound, close in ((1e-10, True), (1.0, False)):
        x.grad = None
        fp8_linear(x, w, grad_bound=bound).backward(tiny)
        assert (rel(x.grad, tiny @ w) < 0.15) == close
    # the bound: each logit's gradient within 1/n, and the scaled e5m2 values use the top of the range
    g = torch.softmax(torch.randn(128, 97), -1) / 128
    g8, scale = F8.to_fp8_within(g, F8.E5M2, 1 / 128)
    assert g8.float().abs().max() <= torch.finfo(F8.E5M2).max and rel(g8.float() * scale, g) < 0.15
    with pytest.raises(ValueError, match="speed.fp8_head runs the untied head"):
        FP.check(M.ModelConfig(**SMALL), FP.SpeedConfig(fp8_head=True))
    # a soft-cap steeper than 1 would break that bound: refused with the FP8 head, built without it
    steep = M.ModelConfig(**{**SMALL, "tie_embeddings": False, "logit_softcap": 15.0, "logit_temperature": 10.0})
    with pytest.raises(ValueError, match=r"speed.fp8_head bounds the logits' gradient by a soft-cap slope of at most "
                                         r"1, but model.logit_temperature=10 below logit_softcap=15 is steeper"):
        FP.check(steep, FP.SpeedConfig(fp8_head=True))
    FP.check(steep, FP.SpeedConfig())
    FP.check(replace(steep, logit_temperature=15.0), FP.SpeedConfig(fp8_head=True))



def test_the_multi_token_loss_goes_through_each_training_loss(monkeypatch):
    """MultiTargets through the swapped outputs: the fused loss gives the plain multi-token loss (in its own chunks:
    float32's rounding apart); the FP8 head stays within FP8's rounding of it, its gradient bounded by the targets a
    row over the rows."""
    import train as TR
    bounds = []
    fp8_linear = F8.fp8_linear
    monkeypatch.setattr(FP, "fp8_linear", lambda x, w, grad_bound=None, fast_accum=False:
                        bounds.append(grad_bound) or fp8_linear(x, w, grad_bound, fast_accum))
    idx, y = torch.randint(0, 97, (2, 2, 30), generator=torch.Generator().manual_seed(7))
    targets = TR.multi_targets(y, (1.0, 0.5, 0.25))
    losses = {}
    for name, speed in (("plain", None), ("fused", FP.SpeedConfig(fused_loss=True)), ("fp8", FP.SpeedConfig(fp8_head=True))):
        model = small_model(torch.float32, speed, tie_embeddings=False, logit_softcap=15.0)
        with torch.no_grad():
            model.head.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
        model.train()
        losses[name] = model(idx, targets)
        losses[name].backward()
    assert losses["fused"].item() == pytest.approx(losses["plain"].item(), rel=1e-6) and bounds == [3 / 60]
    assert abs(losses["fp8"].item() - losses["plain"].item()) < 0.02 and losses["fp8"].item() != losses["plain"].item()


@pytest.mark.parametrize("rows", [7, 64])  # several chunks with a short last one; one chunk
# no soft-cap; one that bends most logits (they reach about +-1); record #54's form of it, shifted and wider
@pytest.mark.parametrize("cap", [0.0, 0.5, (0.5, 0.3, 0.8)])
@pytest.mark.parametrize("mtp", [False, True])  # one target a row; three, weighted, the last rows' later ones none
def test_fused_loss_equals_plain_loss_and_gradients(rows, cap, mtp, monkeypatch):
    import train as TR
    monkeypatch.setattr(FP, "LOSS_CHUNK_ROWS", rows)
    monkeypatch.setattr(FP, "LOSS_MAX_CHUNKS", 1000)
    idx, targets = torch.randint(0, 97, (2, 2, 30), generator=torch.Generator().manual_seed(7))
    targets = TR.multi_targets(targets, (1.0, 0.5, 0.25)) if mtp else targets
    results = []
    cap, shift, temperature = cap if isinstance(cap, tuple) else (cap, 0.0, 0.0)
    for fused in (False, True):
        model = small_model(speed=FP.SpeedConfig(fused_loss=fused), logit_softcap=cap, logit_shift=shift,
                            logit_temperature=temperature)
        assert (type(model.output) is FP.FusedLoss) == fused  # really swapped in, so the comparison means something
        model.train()
        loss = model(idx, targets)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@needs_cpu_fp8
def test_fp8_linear_is_close_to_the_plain_matmul_and_its_gradients():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 96, generator=g, requires_grad=True)
    w = (torch.randn(48, 96, generator=g) * 0.05).requires_grad_()
    grad_out = torch.randn(64, 48, generator=g)
    results = []
    for fn in (torch.nn.functional.linear, F8.fp8_linear):
        y = fn(x, w)
        y.backward(grad_out)
        results.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad, w.grad = None, None

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    (y0, gx0, gw0), (y1, gx1, gw1) = results
    assert rel(y1, y0) < 0.06 and rel(gx1, gx0) < 0.06  # e4m3 rounding, a scale a row
    assert rel(y1, y0) > 1e-3 and rel(gx1, gx0) > 1e-3  # both really ran in FP8
    assert rel(gw1, gw0) < 0.01  # the weight gradient in bf16


@needs_cpu_fp8
@pytest.mark.parametrize("mlp", ["swiglu", "relu2"])
@pytest.mark.parametrize("fast", [False, True])
def test_fp8_forward_products_alone_take_the_fast_accumulation_switch(monkeypatch, fast, mlp):
    """speed.fp8_fast_accum reaches each FP8 forward product of a training step (the MLP's, through
    FP8Rows or FP8ReLU2MLP, and the head's) and no gradient's: a CPU computes them alike either way, so the
    flag is read from the calls. The head with the loss kernel (fp8_head_cross_entropy) runs on CUDA alone,
    and takes it as a keyword here."""
    calls = []
    real = torch._scaled_mm

    def scaled_mm(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    model = small_model(torch.float32, FP.SpeedConfig(fp8=True, fp8_head=True, fp8_fast_accum=fast), mlp=mlp,
                        tie_embeddings=False)
    idx, targets = torch.randint(0, 97, (2, 2, 32), generator=torch.Generator().manual_seed(9))
    model.train()
    loss = model(idx, targets)
    forwards = calls[:]
    loss.backward()
    backwards = calls[len(forwards):]
    products = 2 * 2 + 1  # two layers' MLPs of two products each (SwiGLU's w13 and w2, ReLU²'s w1 and w2), the head
    assert forwards == [fast] * products
    assert len(backwards) == products and not any(backwards)  # each one's input gradient
    # The head with the loss kernel: the kernel (CUDA alone) stood in for by zero gradients of the right types.
    monkeypatch.setattr(F8.K, "cross_entropy_and_gradient", lambda logits, targets, cap, scale, fp8_only, **caps: (
        logits.new_zeros(len(logits), dtype=torch.float32), logits.new_empty(0),
        logits.new_zeros(logits.shape, dtype=F8.E5M2)))
    x, w = torch.randn(16, 32, requires_grad=True), torch.randn(97, 32, requires_grad=True)
    calls.clear()
    F8.fp8_head_cross_entropy(x, w, torch.zeros(16, dtype=torch.long), 15.0, fast_accum=fast).backward()
    assert calls == [fast, False, False]  # the forward product; the input's and the weight's gradients


@needs_cpu_fp8
def test_the_fp8_relu2_mlp_is_close_to_the_plain_one_and_evaluates_plainly():
    g = torch.Generator().manual_seed(8)
    cfg = M.ModelConfig(d_model=96, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, context=8, mlp="relu2",
                        ffn_hidden=256)
    x, grad_out = torch.randn(64, 96, generator=g), torch.randn(64, 96, generator=g)
    results = []
    for fp8 in (False, True):
        torch.manual_seed(0)
        mlp = M.ReLU2(cfg)
        if fp8:
            FP.swap(mlp, FP.FP8ReLU2)
        xi = x.clone().requires_grad_()
        y = mlp(xi)
        y.float().backward(grad_out)
        with torch.no_grad():
            results.append((y.detach().float(), xi.grad, mlp.w1.weight.grad, mlp.w2.weight.grad, mlp(x)))

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    plain, fp8 = results
    assert all(1e-3 < rel(a, b) < 0.08 for a, b in zip(fp8[:4], plain[:4]))  # e4m3 forward and input gradients
    assert torch.equal(fp8[4], plain[4])  # no gradients: the plain MLP


def test_with_fp8_and_the_fused_relu2_both_set_the_fp8_matmuls_run_and_fast_path_applies_says_so():
    """The MLP gives FP8 block matmuls the way over the fused ReLU²; the ladder, the kernels study and the
    plans read fast_path_applies to know which runs, so it must say the same."""
    cfg = M.ModelConfig(d_model=96, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, context=8, mlp="relu2",
                        ffn_hidden=256)
    speed = FP.SpeedConfig(fp8=True, fused_relu2=True)
    model = M.Llama(cfg)
    assert FP.swap_in(model, speed) == ["fp8"] and type(model.blocks[0].mlp) is FP.FP8ReLU2
    assert FP.fast_path_applies("fp8", cfg, speed) and not FP.fast_path_applies("fused_relu2", cfg, speed)


def test_fast_accumulation_runs_only_beside_an_fp8_path():
    """fp8_fast_accum changes how the FP8 products accumulate: without fp8 or fp8_head there is none, and a
    ladder or plan rung of it alone would time the bf16 model under its name."""
    cfg, base = M.ModelConfig(tie_embeddings=False), FP.SpeedConfig(fp8_fast_accum=True)
    assert not FP.fast_path_applies("fp8_fast_accum", cfg, base)
    assert FP.fast_path_applies("fp8_fast_accum", cfg, replace(base, fp8=True))
    assert FP.fast_path_applies("fp8_fast_accum", cfg, replace(base, fp8_head=True))
    assert FP.fast_path_alone("fp8_fast_accum") == {"fp8_fast_accum": True, "fp8": True}
    assert FP.fast_path_alone("fp8") == {"fp8": True}


def test_the_decode_kernel_stays_out_of_a_model_with_the_key_offset_value_gates_or_paired_heads():
    """The fused decode kernel computes none of the three."""
    speed = FP.SpeedConfig(fused_decode=True, split_decode=True, decode_mlp=True)
    cfg = M.ModelConfig(mlp="relu2", rope_truncate=True)
    assert FP.running(FP.GENERATION_FAST_PATHS, cfg, speed) == ["fused_decode", "split_decode", "decode_mlp"]
    assert FP.running(FP.GENERATION_FAST_PATHS, replace(cfg, key_offset=True), speed) == ["decode_mlp"]
    gated = replace(cfg, key_offset=False, value_embeds=1, value_gate=True)
    assert FP.running(FP.GENERATION_FAST_PATHS, gated, speed) == ["decode_mlp"]
    paired = M.ModelConfig(mlp="relu2", n_kv_heads=12, attn_window=512, short_windows=True, paired_heads=True)
    assert FP.running(FP.GENERATION_FAST_PATHS, paired, speed) == ["decode_mlp"]


SMALL_PAIRED = dict(d_model=64, n_layers=6, n_heads=4, n_kv_heads=4, vocab_size=97, context=32, qk_norm=True,
                    attn_window=8, short_windows=True, paired_heads=True)


def test_the_fused_qk_norm_rope_leaves_paired_layers_plain():
    """Its kernel reads the heads unpaired: the paired layers keep the plain attention, the others take it."""
    model = M.Llama(M.ModelConfig(**SMALL_PAIRED))
    FP.swap_in(model, FP.SpeedConfig(fused_qk_norm_rope=True))
    assert [type(b.attn) for b in model.blocks] == [FP.FusedQKAttention, M.Attention, FP.FusedQKAttention,
                                                    M.Attention, FP.FusedQKAttention, FP.FusedQKAttention]


@needs_cpu_fp8
def test_fp8_model_trains_and_shares_checkpoints_with_the_plain_one():
    torch.manual_seed(0)
    plain = M.Llama(M.ModelConfig(**SMALL))
    fp8 = M.Llama(M.ModelConfig(**SMALL))
    FP.swap_in(fp8, FP.SpeedConfig(fp8=True))
    assert fp8.state_dict().keys() == plain.state_dict().keys()  # same parameters, same names
    fp8.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 97, (2, 4, 32), generator=torch.Generator().manual_seed(9))
    opt = torch.optim.AdamW(fp8.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):  # FP8 matmuls are slow on a CPU (about 0.7 s a step here): few steps, a high rate
        loss = fp8(idx, targets)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(losses[0] - plain(idx, targets).item()) < 0.05 and losses[-1] < losses[0] - 1.0


def test_bf16_residual_stream_only_in_training_under_autocast_and_close_to_float32():
    torch.manual_seed(0)
    plain = M.Llama(M.ModelConfig(**SMALL))
    low = M.Llama(M.ModelConfig(**SMALL))
    FP.swap_in(low, FP.SpeedConfig(bf16_residual=True))
    low.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 97, (2, 4, 32), generator=torch.Generator().manual_seed(3))
    stream = []
    low.blocks[0].register_forward_hook(lambda module, args, out: stream.append(out.dtype))
    assert torch.equal(low(idx, targets), plain(idx, targets))  # no autocast: nothing changes
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # evaluation keeps float32's stream
        assert torch.equal(low(idx, targets), plain(idx, targets))
    losses, grads = [], []
    for model in (plain, low):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert stream == [torch.float32, torch.float32, torch.bfloat16]
    assert abs(losses[1] - losses[0]) < 1e-3 * losses[0]
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < 2e-2  # bf16 rounding: 0.5% here


def test_apply_swaps_what_the_device_runs_and_keeps_the_state_dict():
    """On a CPU the FP8 and Triton paths stay plain (for_device; swap_in is what the interpreter's checks use);
    every swap keeps the parameters' names; the recomputation settings swap the blocks."""
    cfg = M.ModelConfig(**SMALL, mlp="relu2", qk_norm=True, tie_embeddings=False)
    model = M.Llama(cfg)
    keys = list(model.state_dict())
    speed = FP.SpeedConfig(fp8=True, fp8_head=True, loss_kernel=True, fused_relu2=True, fused_qk_norm_rope=True,
                           bf16_residual=True, attention="math")
    assert FP.apply(model, speed, torch.device("cpu")) == ["bf16_residual"]
    assert type(model.blocks[0].mlp) is M.ReLU2 and type(model.output) is M.Output
    on = FP.swap_in(model, replace(speed, fp8=False, fp8_head=False))  # as the interpreter's checks swap them
    assert on == ["loss_kernel", "fused_relu2", "fused_qk_norm_rope", "bf16_residual"]
    assert type(model.blocks[0].mlp) is FP.FusedReLU2 and type(model.blocks[0].attn) is FP.FusedQKAttention
    assert type(model.output) is FP.TrainingLoss and not model.output.fp8_head and model.output.loss_kernel
    assert type(model.stream) is FP.BF16Stream and model.blocks[1].attn.backend == "math"
    assert list(model.state_dict()) == keys
    FP.apply_recompute(model, activation_checkpointing=False, recompute_mlp=True)
    assert all(type(b) is FP.RecomputedMLPBlock for b in model.blocks) and list(model.state_dict()) == keys
    assert FP.for_device(speed, torch.device("cpu"))[0] == replace(speed, fp8=False, fp8_head=False, loss_kernel=False,
                                                                   fused_relu2=False, fused_qk_norm_rope=False)


@pytest.mark.parametrize("setting", ["activation_checkpointing", "recompute_mlp"])
def test_recomputed_blocks_give_the_plain_loss_and_gradients(setting):
    """Recomputation in the backward pass changes memory, not arithmetic: bitwise the plain model's loss and
    gradients, and in evaluation the plain forward."""
    torch.manual_seed(0)
    plain = M.Llama(M.ModelConfig(**SMALL, mlp="relu2")).double()
    again = M.Llama(M.ModelConfig(**SMALL, mlp="relu2")).double()
    again.load_state_dict(plain.state_dict())
    FP.apply_recompute(again, setting == "activation_checkpointing", setting == "recompute_mlp")
    idx, targets = torch.randint(0, 97, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    for model in (plain, again):
        model(idx, targets).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), again.parameters()))
    with torch.no_grad():
        assert torch.equal(plain.eval()(idx), again.eval()(idx))
