"""Fast paths on CUDA against the plain PyTorch paths: fused loss, fused SwiGLU, attention kinds,
FP8 matmuls, compiled and fused decode.
Each skips on a machine without CUDA."""

import pytest
import torch
import torch.nn.functional as F

import attention as A
import data as D
import fastpaths as FP
import fp8 as F8
import generate as G
import measure as ME
import model as M
import onegpu_kernels as K

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CFG = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32768, context=256)
PLAIN = dict(fused_loss=False, fused_swiglu=False, bf16_residual=False)  # every training fast path off


def llama(**settings) -> M.Llama:
    """The model of the [model] settings among `settings` on the GPU, its [speed] ones swapped in as a run and
    sample.py swap them (fastpaths.apply, generate.apply)."""
    speed = FP.SpeedConfig(**{k: v for k, v in settings.items() if k in FP.SPEED_FIELDS})
    model = M.Llama(M.ModelConfig(**{k: v for k, v in settings.items() if k not in FP.SPEED_FIELDS})).cuda()
    FP.apply(model, speed, torch.device("cuda"))
    G.apply(model, speed, torch.device("cuda"))
    return model


def cached(model, idx, pos, read: int):
    """model's logits for idx at cache positions pos, reading its first `read` positions."""
    return model(idx, masks=A.cache_masks(pos, read, model.cfg.windows()))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def loss_and_grads(compiled: bool, seed: int, base: dict | None = None, **switches):
    """BF16 loss and gradients of one micro-batch, for the plain model and with `switches` on (both
    with the settings in base)."""
    idx, targets = torch.randint(0, 32768, (2, 4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    out = []
    for on in (False, True):
        torch.manual_seed(0)
        model = llama(**{**CFG, **PLAIN, **(base or {}), **{k: v and on for k, v in switches.items()}})
        run = torch.compile(model) if compiled else model
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, targets)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    return out


def assert_close(out, loss_rel: float, grad_rel: float):
    """loss_and_grads' two runs agree: the loss within loss_rel of the plain one's, every gradient within
    grad_rel (relative norm of the difference)."""
    (plain_loss, plain_grads), (loss, grads) = out
    assert abs(plain_loss.item() - loss.item()) < loss_rel * plain_loss.item()
    for name, grad in plain_grads.items():
        assert rel(grads[name], grad) < grad_rel, name


@pytest.mark.parametrize("switch", ["fused_loss", "fused_swiglu", "bf16_residual"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_kernels_match_plain_in_bf16(compiled, switch):
    out = loss_and_grads(compiled, seed=0, **{switch: True})
    assert_close(out, 2e-3, 2e-2)


def test_attention_kinds_agree_in_bf16():
    g = torch.Generator("cuda").manual_seed(1)
    q = torch.randn(2, 12, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    reference = A.textbook_attention(q.double(), k.double(), v.double())
    for kind in ("sdpa", "flash", "cudnn", "efficient", "math", "textbook"):
        assert rel(A.attend(q, k, v, A.Mask(), backend=kind), reference) < 1e-2, kind


def test_compiled_decode_gives_the_same_tokens_as_the_plain_paths():
    torch.manual_seed(0)
    model = llama(**CFG, fused_decode=True).eval()  # as sample.py runs it
    ids = torch.randint(0, 32768, (120,), generator=torch.Generator().manual_seed(2)).tolist()  # crosses 128
    torch.backends.cuda.matmul.allow_tf32 = False
    plain = G.generate_batch(model, ids, 2, 40, 0.0, 0, 1.0, None, use_cache=False)[0]
    eager = G.generate_batch(model, ids, 2, 40, 0.0, 0, 1.0, None)[0]
    graph = G.generate_batch(model, ids, 2, 40, 0.0, 0, 1.0, None, decode=G.decoder(model, torch.device("cuda")))[0]
    again = G.generate_batch(model, ids, 2, 40, 0.0, 0, 1.0, None, decode=G.decoder(model, torch.device("cuda")))[0]
    tuned = G.decoder(model, torch.device("cuda"), mode="max-autotune-no-cudagraphs")  # batch 1's mode, at batch 2
    autotuned = G.generate_batch(model, ids, 2, 40, 0.0, 0, 1.0, None, decode=tuned)[0]
    assert eager == plain and graph == plain and again == plain and autotuned == plain
    # Sampling replays decode_one's graph (greedy decoding, greedy_step's): the same draws as eager decoding.
    sampled = [G.generate_batch(model, ids, 2, 40, 1.0, 50, 1.0, torch.Generator("cuda").manual_seed(3),
                                decode=decode)[0] for decode in (G.decode_one, G.decoder(model, torch.device("cuda")))]
    assert sampled[0] == sampled[1] and sampled[0] != plain


def test_the_decode_profile_sees_each_kernel_of_the_replayed_graph():
    torch.manual_seed(0)
    model = llama(**CFG, fused_decode=True).to(torch.bfloat16).eval()  # as bench runs it
    decode = G.decoder(model, torch.device("cuda"), mode="default")
    # captures batch 1's graphs: of TOKENS_PER_REPLAY steps (2 replays) and of one (3), the profile's the first
    G.generate_batch(model, list(range(1, 20)), 1, 2 * G.TOKENS_PER_REPLAY + 4, 0.0, 0, 1.0, None, decode=decode)
    step = ME.decode_kernels(decode, 1, n=10)
    assert step["kernels"] >= CFG["n_layers"] + 1  # a fused decode kernel a layer, and the head
    assert 0 < step["busy_us"] <= 1.2 * ME.replay_us(decode, 1, n=50)
    assert any("decode" in name for name in step["top_kernels"]), step["top_kernels"]


def test_the_decode_parts_study_times_each_part_and_the_fused_ones_agree():
    units = ME.K.DECODE_MLP_HIDDEN
    other = next(n for n in ME.DECODE_MLP_UNITS if n != units)  # a second count, to see onegpu_kernels.py's put back
    rows = ME.decode_parts_study("88m", cuda=True, batches=(1,), units=(units, other))  # each autotunes its tiles
    attention = [r for r in rows if r["rung"].startswith("attention")]
    mlp = rows[len(attention):]  # plain, the kernel at each count, with its sum, each half
    assert len(attention) == 1 + len(ME.DECODE_LAUNCHES) and len(mlp) == 2 + 2 + 2
    assert all(r[f"us_at_{pos}"] > 0 for r in attention for pos in ME.DECODE_POSITIONS)
    # bf16 outputs of size ~1; the up-projection's squares reach ~16, where one bf16 step is 0.125
    assert all(r["max_abs_diff"] < (0.25 if "up-projection" in r["rung"] else 0.05)
               for r in rows if "max_abs_diff" in r), rows
    assert all(r["us"] > 0 for r in mlp) and all("max_abs_diff" in r and "tiles" in r for r in mlp[1:])
    assert (ME.K.SPLIT_BLOCK_KEYS, ME.K.DECODE_PROGRAMS) == ME.DECODE_LAUNCHES[0]  # the settings put back
    assert ME.K.DECODE_MLP_HIDDEN == units and units in ME.DECODE_MLP_UNITS


def test_the_split_decode_and_decode_mlp_launch_fewer_kernels_a_step():
    """What decode_mlp is for: each layer's MLP is its kernel and the sum of its partials (which Inductor
    may run apart from the next norm on a GPU; on a CPU it fuses them), where the plain step runs the up-
    and down-projections, the square and at times a split-K reduction: at least one launch fewer a layer."""
    counts = []
    for fast in ({}, {"split_decode": True, "decode_mlp": True}):
        torch.manual_seed(0)
        model = llama(**{**CFG, "n_layers": 4}, **RECORD_ATTENTION, fused_decode=True, **fast).to(torch.bfloat16).eval()
        decode = G.decoder(model, torch.device("cuda"), mode="default")
        G.generate_batch(model, list(range(1, 20)), 1, 8, 0.0, 0, 1.0, None, decode=decode)
        counts.append(ME.decode_kernels(decode, 1, n=10)["kernels"])
    assert counts[1] <= counts[0] - 4, counts


def test_fused_decode_step_matches_the_plain_path_in_bf16():
    g = torch.Generator("cuda").manual_seed(5)
    H, Hkv, S = 12, 4, 1024
    for pos in (0, 63, 64, 700, 1023):
        qkv = torch.randn(2, 1, H + 2 * Hkv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        cos, sin = (t[pos:pos + 1].float().cuda() for t in M.rope_tables(64, S, 10000.0))
        k_cache, v_cache = (torch.randn(2, Hkv, S, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        q, k, v = qkv.float().split([H, Hkv, Hkv], dim=2)
        q, k = M.apply_rope(q, cos, sin), M.apply_rope(k, cos, sin)
        k_ref, v_ref = k_cache.float(), v_cache.float()
        k_ref[:, :, pos], v_ref[:, :, pos] = k[:, 0], v[:, 0]
        reference = A.decode_attention_matmuls(q.reshape(2, Hkv, H // Hkv, 64), k_ref, v_ref,
                                               (torch.arange(S, device="cuda") <= pos)[None, :])
        # One program per head, then split over 16 (split_decode), 20 times: a program that combined the
        # parts before all were written would show as a difference between calls.
        counts = torch.zeros(2, Hkv, device="cuda", dtype=torch.int32)
        outs = [K.decode_step(qkv, cos[0].bfloat16(), sin[0].bfloat16(), k_cache, v_cache,
                              torch.tensor([pos], device="cuda"), 64 ** -0.5, counts=c) for c in [None] + [counts] * 20]
        for out in outs[:2]:
            assert rel(out.reshape(reference.shape), reference) < 1e-2, pos
        assert all(torch.equal(out, outs[1]) for out in outs[2:]) and not counts.any(), pos
        assert rel(k_cache[:, :, pos], k_ref[:, :, pos]) < 1e-2 and torch.equal(v_cache[:, :, pos].float(), v_ref[:, :, pos])


# The record recipe's attention at this size: windows of 16 and 8 keys, shorter than the 40 positions decoded.
RECORD_ATTENTION = {"mlp": "relu2", "qk_norm": True, "attn_window": 16, "short_windows": True, "value_embeds": 1,
                    "attn_gate": True, "norm_gains": False, "rope_truncate": True, "tie_embeddings": False}
# The newest records' parts, each reading the token before: through the cache (their model keeps the decode kernel out)
NEWEST_PARTS = {"bigram_rows": 5000, "bigram_signs": True, "smear": True, "key_offset": True, "backout": True,
                "value_gate": True, "rope_yarn": 8}


@pytest.mark.parametrize("recipe, fast", [({}, {}), ({"mlp": "relu2", "qk_norm": True}, {}), (RECORD_ATTENTION, {}),
                                          (RECORD_ATTENTION, {"decode_matmuls": True}),
                                          (RECORD_ATTENTION, {"split_decode": True, "decode_mlp": True}),
                                          (RECORD_ATTENTION, {"split_decode": True, "decode_mlp": True, "decode_pdl": True}),
                                          ({**RECORD_ATTENTION, **NEWEST_PARTS}, {"decode_mlp": True})],
                         ids=["article", "muon", "record", "record-decode-matmuls", "record-split-decode-mlp",
                              "record-split-decode-mlp-pdl", "newest-parts"])
def test_fused_decode_matches_the_plain_step_eager_and_captured(recipe, fast):
    """Teacher-forced: the same tokens go through the plain model, the fused model eagerly and the
    fused model's CUDA graph; their logits agree at every position (bf16 rounding apart). The Muon
    recipe norms q and k before the kernel applies RoPE; the record's slides its windows, mixes its values
    and gates its heads, its weights all off their initial values; then with the other generation fast
    paths: its decode matmuls; its positions split over many programs and its MLP as one kernel; and those
    with every kernel launched as a dependent of the one before it (decode_pdl, on Hopper)."""
    torch.manual_seed(0)
    plain = llama(**CFG, **recipe, fused_decode=False).eval().to(torch.bfloat16)
    fused = llama(**CFG, **recipe, fused_decode=True, **fast).eval()
    fused = fused.to(torch.bfloat16)
    with torch.no_grad():
        for p in plain.parameters():  # the zero-initialised projections, head and gate, the mixes at (0.5, 0.5)
            p.add_(torch.randn_like(p) * 0.02)
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 32768, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    graph = G.decoder(fused, torch.device("cuda"), mode="default")
    runs = []
    with torch.no_grad():
        for model, step in ((plain, G.decode_one), (fused, G.decode_one), (fused, graph)):
            model.setup_cache(2)
            cached(model, idx[:, :10], torch.arange(10, device="cuda"), 10)
            runs.append(torch.stack([step(model, idx[:, t:t + 1], torch.tensor([t], device="cuda"), t + 1).clone()
                                     for t in range(10, 40)]))
    assert rel(runs[1], runs[0]) < 2e-2 and rel(runs[2], runs[0]) < 2e-2
    assert isinstance(fused.output, G.SmallOutput) == fast.get("decode_matmuls", False)


def test_dependent_launches_give_the_same_greedy_tokens():
    """decode_pdl on an H100 or H200: the two decode kernels launched as programmatic dependents write what
    they write launched plainly, bit for bit, and the record model's CUDA-graph decoder, whose Inductor
    kernels then launch so too, gives the plain launches' 60 greedy tokens at batches 1 and 8."""
    if not K.dependent_launch(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (Hopper) or newer")
    g = torch.Generator("cuda").manual_seed(9)
    w1 = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16, generator=g) * 768 ** -0.5
    w2 = torch.randn(768, 3072, device="cuda", dtype=torch.bfloat16, generator=g) * 3072 ** -0.5
    x = torch.randn(8, 1, 768, device="cuda", dtype=torch.bfloat16, generator=g)
    assert torch.equal(K.decode_mlp(x, w1, w2, True), K.decode_mlp(x, w1, w2))
    qkv = torch.randn(2, 1, 20, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    cos, sin = (t[300].to("cuda", torch.bfloat16) for t in M.rope_tables(64, 512, 10000.0))
    outs = []
    for pdl in (False, True):
        caches = [torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
                  for _ in range(2)]
        counts = torch.zeros(2, 4, device="cuda", dtype=torch.int32)
        outs.append((K.decode_step(qkv, cos, sin, *caches, torch.tensor([300], device="cuda"), 0.125, counts=counts,
                                   pdl=pdl), *caches))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    torch.manual_seed(0)
    fast = {"split_decode": True, "decode_mlp": True}
    models = [llama(**CFG, **RECORD_ATTENTION, fused_decode=True, **fast, decode_pdl=pdl).eval()
              for pdl in (False, True)]
    with torch.no_grad():
        for p in models[0].parameters():
            p.add_(torch.randn_like(p) * 0.02)
    models[1].load_state_dict(models[0].state_dict())
    for batch in (1, 8):
        tokens = [G.generate_batch(m.to(torch.bfloat16), [5, 6, 7], batch, 60, 0.0, 0, 1.0, None,
                                   decode=G.decoder(m, torch.device("cuda"), mode="default"))[0] for m in models]
        assert models[1].dependent_launches and tokens[0] == tokens[1], batch


def test_the_small_matmul_matches_f_linear_in_bf16():
    """Against F.linear at the 88m preset's decode shapes, 1, 8 and 16 rows, with and without ReLU²'s square
    (teacher-forced decoding with it is test_fused_decode_matches_the_plain_step_eager_and_captured's)."""
    g = torch.Generator("cuda").manual_seed(7)
    for rows in (1, 8, 16):
        for N, Kd in ((2304, 768), (768, 768), (3072, 768), (768, 3072), (32768, 768)):
            x = torch.randn(rows, 1, Kd, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(N, Kd, device="cuda", dtype=torch.bfloat16, generator=g) * Kd ** -0.5
            exact = F.linear(x.float(), w.float())
            assert rel(K.small_matmul(x, w), exact) < 1e-2, (rows, N, Kd)
            assert rel(K.small_matmul(x, w, True), exact.relu().square()) < 1e-2, (rows, N, Kd)


def test_the_decode_mlp_matches_the_plain_mlp_in_bf16():
    """Against the plain ReLU² MLP at the 88m preset's decode shapes, 1, 8 and 16 rows (teacher-forced
    decoding with it is test_fused_decode_matches_the_plain_step_eager_and_captured's)."""
    g = torch.Generator("cuda").manual_seed(8)
    w1 = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16, generator=g) * 768 ** -0.5
    w2 = torch.randn(768, 3072, device="cuda", dtype=torch.bfloat16, generator=g) * 3072 ** -0.5
    for rows in (1, 8, 16):
        x = torch.randn(rows, 1, 768, device="cuda", dtype=torch.bfloat16, generator=g)
        exact = F.linear(F.linear(x.float(), w1.float()).relu().square(), w2.float())
        assert rel(K.decode_mlp(x, w1, w2).sum(0), exact) < 1e-2, rows


@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("mlp", ["swiglu", "relu2"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_block_matmuls_stay_close_to_bf16(compiled, mlp, fast_accum):
    """FP8Rows in every block matmul, and FP8ReLU2MLP with its row kernels for the ReLU² MLP, their forward
    products with cuBLAS's fast accumulation (fp8_fast_accum) and without."""
    out = loss_and_grads(compiled, seed=3, base=dict(mlp=mlp), fp8=True, fp8_fast_accum=fast_accum)
    assert_close(out, 1e-2, 0.15)


def test_the_fp8_relu2_row_kernels_cast_as_torch_does():
    """onegpu_kernels.relu2_fp8 and relu2_fp8_backward against their plain twins (model.relu2_fp8_plain and
    relu2_fp8_backward_plain) in bf16, at 88m's hidden width: the same activation and derivative, the same scales, and the same e4m3 values but
    where a value lies within rounding of the midpoint between two (the kernel and torch divide by the
    maximum differently: Triton's division is approximate, torch's CUDA division by a number multiplies by
    its reciprocal), and there one e4m3 step apart."""
    def same_casts(got8, got_s, want8, want_s):
        assert torch.allclose(got_s, want_s, rtol=1e-6, atol=0) and torch.isfinite(got_s).all()
        got, want = got8.float(), want8.float()
        step = torch.maximum(want.abs() / 8, torch.full_like(want, 2.0 ** -9))  # e4m3's step, at most
        assert ((got - want).abs() <= step).all() and (got != want).float().mean() < 1e-4

    g = torch.Generator("cuda").manual_seed(11)
    u = torch.randn(4096, 3072, device="cuda", generator=g).bfloat16()
    u[7] = -1.0  # an all-zero activation row
    dh = torch.randn(4096, 3072, device="cuda", generator=g).bfloat16()
    same_casts(*K.relu2_fp8(u), *F8.relu2_fp8_plain(u))
    (a, du, *cast), (want_a, want_du, *want_cast) = K.relu2_fp8_backward(dh, u), F8.relu2_fp8_backward_plain(dh, u)
    assert torch.equal(a, want_a) and torch.equal(du, want_du)
    same_casts(*cast, *want_cast)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_loss_with_a_soft_cap_matches_plain_in_bf16(compiled):
    out = loss_and_grads(compiled, seed=5, base=dict(tie_embeddings=False, logit_softcap=15.0), fused_loss=True)
    assert_close(out, 2e-3, 2e-2)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_relu2_mlp_matches_plain_in_bf16(compiled):
    out = loss_and_grads(compiled, seed=7, base=dict(mlp="relu2", ffn_hidden=768), fused_relu2=True)
    assert_close(out, 2e-3, 2e-2)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_qk_norm_and_rope_match_plain_in_bf16(compiled, truncate):
    """model.QKNormRope in the model (fused_qk_norm_rope: onegpu_kernels.qk_norm_rope_backward) against QK-norm
    and RoPE as plain lines, at the record preset's head size 128 and without grouped kv heads, full and
    half-truncated RoPE."""
    base = dict(qk_norm=True, n_heads=2, n_kv_heads=2, rope_truncate=truncate)
    out = loss_and_grads(compiled, seed=8, base=base, fused_qk_norm_rope=True)
    assert_close(out, 2e-3, 2e-2)


@pytest.mark.parametrize("cap", [0.0, 15.0])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_loss_kernel_matches_the_plain_loss_in_bf16(compiled, cap):
    out = loss_and_grads(compiled, seed=6, base=dict(tie_embeddings=False, logit_softcap=cap), loss_kernel=True)
    assert_close(out, 2e-3, 2e-2)


@pytest.mark.parametrize("switches, tolerances", [
    (dict(loss_kernel=True), (2e-3, 2e-2)), (dict(fused_loss=True), (2e-3, 2e-2)),
    (dict(fp8_head=True, loss_kernel=True), (1e-2, 0.15))])
def test_record_54s_shifted_soft_cap_through_each_loss_path_matches_plain(switches, tolerances):
    """logit_shift and logit_temperature (11.5 tanh((z + 5) / 15)) on the GPU, compiled: the loss kernel (hardware
    tanh), the fused loss, and the FP8 head with the loss kernel as one function, each against the plain loss."""
    base = dict(tie_embeddings=False, logit_softcap=11.5, logit_shift=5.0, logit_temperature=15.0)
    assert_close(loss_and_grads(True, seed=6, base=base, **switches), *tolerances)


@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("loss_kernel", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_head_stays_close_to_bf16(compiled, loss_kernel, fast_accum):
    """The FP8 head (its gradient at the fixed bound 1/n) against the bf16 head and the plain loss, with the
    soft-cap, its forward product with fast accumulation and without (fp8_fast_accum); with the loss kernel
    on, the model runs the two as one function (model.fp8_head_cross_entropy)."""
    out = loss_and_grads(compiled, seed=4, base=dict(tie_embeddings=False, logit_softcap=15.0), fp8_head=True,
                         loss_kernel=loss_kernel, fp8_fast_accum=fast_accum)
    assert_close(out, 1e-2, 0.15)


@pytest.mark.parametrize("compiled,fp8_weight_grad,transpose_kernel", [(False, True, True), (True, True, True),
                                                                       (True, True, False), (True, False, True)])
def test_the_fp8_head_and_loss_kernel_in_one_function_stay_close_to_bf16(compiled, fp8_weight_grad, transpose_kernel):
    """model.fp8_head_cross_entropy (its gradients written by the loss kernel in the forward) against the
    bf16 head and the plain loss, with the soft-cap, eager and compiled, its weight gradient in FP8 (its operand
    transposed by our kernel and by the plain copy) and in bf16."""
    g = torch.Generator("cuda").manual_seed(4)
    n, d, vocab = 2048, 256, 32768
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    out = []
    for fused in (True, False):
        x = torch.randn(n, d, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).requires_grad_()
        w = (0.05 * torch.randn(vocab, d, device="cuda", generator=torch.Generator("cuda").manual_seed(6))).requires_grad_()

        def loss_fn(x, w):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if fused:
                    return F8.fp8_head_cross_entropy(x, w, targets, 15.0, fp8_weight_grad, transpose_kernel)
                return M.cross_entropy(F.linear(x, w), targets, 15.0)
        loss = (torch.compile(loss_fn) if compiled else loss_fn)(x, w)
        (loss / 4).backward()  # as one of four micro-batches: the fused backward scales by the incoming 1/4
        out.append((loss.item(), x.grad, w.grad))
    assert abs(out[0][0] - out[1][0]) < 1e-2 * out[1][0]
    assert rel(out[0][1], out[1][1]) < 0.15 and rel(out[0][2], out[1][2]) < 0.15


def test_the_transpose_kernel_copies_the_bytes_of_the_plain_transpose():
    """onegpu_kernels.transposed on the GPU, at every tile the autotuner may pick: the bytes of t.t().contiguous(),
    for an e5m2 matrix the tiles do not divide (the FP8 head's gradient at 2,052 tokens and a 32,768 vocabulary),
    eager and inside a compiled function."""
    import triton  # on every CUDA build of torch
    g = torch.Generator("cuda").manual_seed(8)
    t = (torch.randn(2052, 32768, device="cuda", generator=g) * 1000).to(torch.float8_e5m2)
    want = t.t().contiguous().view(torch.uint8)
    for rows, cols, warps in K.TRANSPOSE_TILES:
        out = t.new_empty(32768, 2052)
        grid = (triton.cdiv(2052, rows), triton.cdiv(32768, cols))
        K._transpose_kernel.fn[grid](t.view(torch.int32), out.view(torch.int32), 2052 // 4, 32768 // 4, ROWS=rows,
                                     COLS=cols, num_warps=warps)
        assert torch.equal(out.view(torch.uint8), want), (rows, cols, warps)
    assert torch.equal(K.transposed(t).view(torch.uint8), want)
    assert torch.equal(torch.compile(lambda t: F8.transposed(t, True))(t).view(torch.uint8), want)


RECORD = dict(mlp="relu2", qk_norm=True, zero_init=True, tie_embeddings=False, embed_norm=True, logit_softcap=15.0,
              value_embeds=1, value_scale=True, unet_skips=True, x0_mix=True, rope_truncate=True, attn_gate=True, attn_window=384,
              short_windows=True, fp8_head=True, loss_kernel=True, attn_scale=0.12)


def test_flex_block_mask_matches_the_boolean_mask_with_documents_and_a_window():
    """FlexAttention's block mask (documents, sliding window) against SDPA with the same mask as
    booleans, in float32, at a length whose last block is partial and windows across blocks."""
    g = torch.Generator("cuda").manual_seed(7)
    q = torch.randn(2, 4, 640, 64, device="cuda", generator=g)
    k, v = (torch.randn(2, 2, 640, 64, device="cuda", generator=g) for _ in range(2))
    doc = torch.cumsum(torch.rand(2, 640, device="cuda", generator=g) < 0.004, dim=1).int()
    for window in (0, 200, 512):
        flex = A.attend(q, k, v, A.masks(640, q.device, doc, (window, 0)).long)
        assert rel(flex, A.attend(q, k, v, A.Mask(doc, window))) < 1e-4, window


def test_building_the_block_masks_never_waits_for_the_gpu():
    """Every micro-batch builds its two block masks: a host-device synchronization there (a blocking
    copy of the window) would idle the GPU once per mask. CUDA's sync debug mode turns one into an error."""
    doc = torch.cumsum(torch.rand(2, 1024, device="cuda") < 0.003, dim=1).int()
    A.masks(1024, doc.device, doc, (256, 128))  # the first call compiles the mask builder
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masks = A.masks(1024, doc.device, doc, (384, 192))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert masks.long.block_mask is not None and masks.short.block_mask is not None


def test_a_pinned_loader_copies_every_batch_tensor_from_pinned_memory(tmp_path):
    """`pin = true` promises copies that queue behind the GPU's work. A copy from pageable memory waits for that
    work instead (x, a strided slice, once went so). The profiler names each copy's host memory."""
    loader = D.ShardLoader(D.random_shards(tmp_path, 1000, 50_000), 4, 256, doc_ids=True, device="cuda", pin=True)
    loader.next_batch()
    copies = {name: n for name, (n, _) in ME.kernel_stats(loader.next_batch, torch.device("cuda")).items()
              if name.startswith("Memcpy HtoD")}
    assert copies == {"Memcpy HtoD (Pinned -> Device)": 3}, copies  # x, y and the document ids
    loader.prefetch()  # drawn ahead, its copies already queued: handing it out copies nothing
    assert not any(name.startswith("Memcpy") for name in ME.kernel_stats(loader.next_batch, torch.device("cuda")))


def assert_compiled_matches_eager_with_a_block_mask(parts: dict, mtp: bool = False):
    """parts' model, trained through a document and window block mask (with mtp, on the multi-token loss's targets):
    the compiled model's loss and gradients equal the eager model's (bf16 rounding apart)."""
    import train as TR
    torch.manual_seed(0)
    model = llama(**{**CFG, "context": 1024, **parts})
    for p in model.parameters():  # move every weight off its init, so zero-initialised parts carry gradients
        p.data.add_(0.02 * torch.randn_like(p))
    idx, y = torch.randint(0, 32768, (2, 2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    targets = TR.multi_targets(y, (1.0, 0.5, 0.25)) if mtp else y
    doc = torch.cumsum(torch.rand(2, 1024, device="cuda") < 0.003, dim=1).int()
    out = []
    for run in (model, torch.compile(model)):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, targets, A.masks(1024, idx.device, doc, model.cfg.windows(256)))
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert abs(out[0][0] - out[1][0]) < 2e-3 * out[0][0]
    for name, grad in out[0][1].items():  # plus a floor: a scalar's gradient summed from cancelling terms carries
        # the terms' bf16 rounding, not a share of its own size (the skip weights': 4e-6 apart with the newest parts,
        # 5.6e-6 of 5.4e-5 with XSA, the saved input and the dense connections)
        assert (out[1][1][name].float() - grad.float()).norm() < 3e-2 * grad.float().norm() + 1e-5, name


def test_the_record_parts_compile_and_match_eager_with_a_block_mask():
    """Every modded-nanogpt part on, trained through a document and window block mask."""
    assert_compiled_matches_eager_with_a_block_mask(RECORD)


@pytest.mark.parametrize("mtp", [False, True])
def test_the_newest_parts_compile_and_match_eager_with_a_block_mask(mtp):
    """The record's parts with the newest ones (bigram table, smear, key offset, backout, value gates), and the
    multi-token loss through the loss kernel after the FP8 head."""
    assert_compiled_matches_eager_with_a_block_mask({**RECORD, **NEWEST_PARTS}, mtp)


PAIRED = {"n_layers": 4, "n_kv_heads": 4, "paired_heads": True}  # 4 layers: layer 1 is paired (short layers 1, 2)


def test_paired_heads_compile_and_match_eager_with_a_block_mask():
    """Paired heads (record #58) with the record's parts: their block mask over two keys a token, compiled."""
    assert_compiled_matches_eager_with_a_block_mask({**RECORD, **PAIRED})


def test_the_screened_parts_compile_and_match_eager_with_a_block_mask():
    """The parts screened on 2026-12-07 with paired heads and the record's: gated XSA (#82), the saved attention input
    (#77), the dense connections (#81) and the shifted soft-cap (#54) through the FP8 head and the loss kernel."""
    assert_compiled_matches_eager_with_a_block_mask({**RECORD, **PAIRED, "xsa": True, "saved_attn_input": True,
                                                     "backout": True, "dense_last": True, "logit_softcap": 11.5,
                                                     "logit_shift": 5.0, "logit_temperature": 15.0}, mtp=True)


def test_paired_heads_block_mask_allows_what_their_boolean_mask_does():
    """The paired layers' FlexAttention block mask (documents and window over 2T keys) gives the logits of the boolean
    masks the CPU attends with."""
    torch.manual_seed(0)
    model = llama(**{**CFG, "context": 1024, **PAIRED, "attn_window": 384, "short_windows": True})
    idx = torch.randint(0, 32768, (2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    doc = torch.cumsum(torch.rand(2, 1024, device="cuda") < 0.003, dim=1).int()
    long, short, paired = model.cfg.windows(256)
    boolean = A.Masks(A.Mask(doc, long), A.Mask(doc, short), A.Mask(doc.repeat_interleave(2, dim=1), paired))
    with torch.no_grad():
        flex = A.masks(1024, idx.device, doc, model.cfg.windows(256))
        assert flex.paired.block_mask is not None
        got, want = model(idx, masks=flex), model(idx, masks=boolean)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_the_multi_token_loss_weights_cross_to_the_gpu_from_pinned_memory():
    """A copy from pageable memory waits for the GPU's queued work, then the GPU idles while the host launches the next
    kernels: the fading weights cross every micro-batch, so they go pinned (data.to_device)."""
    import train as TR
    from torch.profiler import ProfilerActivity, profile
    y = torch.randint(0, 100, (2, 64), device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        targets = TR.multi_targets(y, (1.0, 0.5, 0.25))
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if e.name.startswith("Memcpy HtoD")]
    assert copies and not [n for n in copies if "Pageable" in n], copies
    assert targets.weights.tolist() == [1.0, 0.5, 0.25]


@pytest.mark.parametrize("compiled,prefix,fp8_head", [(False, False, False), (True, False, False), (False, True, False),
                                                      (True, True, False), (True, True, True)])
def test_the_multi_token_loss_kernel_matches_the_plain_loss_in_bf16(compiled, prefix, fp8_head):
    """Three targets, and with prefix a fourth: a prefix token (train.prefix_weight), some the 2nd token's too; with
    fp8_head, the FP8 head and the loss as one function (fp8.FP8HeadCrossEntropy over the K targets)."""
    import train as TR
    g = torch.Generator("cuda").manual_seed(5)
    idx, y = torch.randint(0, 32768, (2, 4, 256), device="cuda", generator=g)
    table = torch.randint(-1, 32768, (32768,), device="cuda", generator=g)  # -1: a token without a prefix
    table[y[:, :-1]] = y[:, 1:]  # most tokens' prefix is the token after them: two weights land on one logit
    targets = TR.multi_targets(y, (1.0, 0.5, 0.25), (table, 0.25) if prefix else None)
    out = []
    for on in (False, True):
        torch.manual_seed(0)
        model = llama(**CFG, **PLAIN, tie_embeddings=False, logit_softcap=15.0, loss_kernel=on, fp8_head=on and fp8_head)
        assert isinstance(model.output, FP.TrainingLoss) == on
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (torch.compile(model) if compiled else model)(idx, targets)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert_close(out, *((1e-2, 0.15) if fp8_head else (2e-3, 2e-2)))  # the FP8 head's tolerance: test_fp8_head_stays_close


def test_the_88m_defaults_trace_as_one_graph_with_a_block_mask():
    """The 88m preset's model with every fast path it runs, at this file's width, traced by Dynamo on CUDA through
    FlexAttention's document and window block mask: one graph (fullgraph raises at a break). A break inside an
    autograd function runs the whole function eagerly; one ran the FP8 head so for a day (docs/LOG.md, 2026-12-05).
    The CPU's check (tests/interpreted_kernels.py, one_graph_check) traces SDPA, not this path."""
    import config as C
    from dataclasses import replace
    preset = C.preset("88m")
    cfg = replace(preset.model, **{**CFG, "context": 1024, "n_layers": 4, "n_kv_heads": 4}, value_embeds=1,
                  skip_attn_layer=2, attn_window=384)
    model = M.Llama(cfg).cuda().train()
    swapped = FP.apply(model, preset.speed, torch.device("cuda"))
    g = torch.Generator("cuda").manual_seed(9)
    idx, targets = torch.randint(0, 32768, (2, 2, 1024), device="cuda", generator=g)
    doc = torch.cumsum(torch.rand(2, 1024, device="cuda", generator=g) < 0.003, dim=1).int()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.compile(model, backend="eager", fullgraph=True)(
            idx, targets, A.masks(1024, idx.device, doc, cfg.windows(256)))
    loss.backward()
    assert torch.isfinite(loss) and {"fp8", "fp8_head", "loss_kernel", "fused_qk_norm_rope"} <= set(swapped)


def test_muons_symmetric_gram_kernel_matches_the_batched_matmuls_in_bf16():
    """onegpu_kernels.gram (train.muon_kernel) at the presets' shapes: x x^T of a stack of 768 x 3,072 parts as the
    bmm computes it, and the whole Newton-Schulz iteration with it as without, in bf16."""
    import optim as O
    g = torch.Generator("cuda").manual_seed(9)
    x = torch.randn(4, 768, 3072, device="cuda", generator=g).bfloat16() / 3072 ** 0.5
    assert rel(K.gram(x), x @ x.mT) < 1e-2
    for shape in ((4, 768, 3072), (3, 3072, 768), (6, 768, 768)):
        stack = torch.randn(*shape, device="cuda", generator=g)
        assert rel(O.orthogonalize(stack, torch.bfloat16, kernel=True), O.orthogonalize(stack, torch.bfloat16)) < 2e-2


def test_fp16_with_its_gradient_scaler_trains_on_cuda():
    """The path of GPUs without bf16 (train.fp16): float16 autocast and a GradScaler through train.py's
    own train_step, on one repeated batch: the loss falls and every step stays finite."""
    import config as C
    import optim as O
    import train as TR
    torch.manual_seed(0)
    model = llama(**CFG, **PLAIN, mlp="relu2", qk_norm=True, zero_init=True)
    cfg = C.TrainConfig(steps=20, fp16=True, muon=True, schedule="wsd", micro_batch=4, batch_tokens=1024)
    optimizer, scaler = O.configure_optimizer(model, cfg), torch.amp.GradScaler("cuda")
    g = torch.Generator("cuda").manual_seed(1)
    batch = tuple(torch.randint(0, 32768, (4, 256), device="cuda", generator=g) for _ in range(2))  # (x, y)
    found = [TR.train_step(model, optimizer, lambda: batch, 1, cfg, torch.device("cuda"), 3e-3, scaler=scaler)
             for _ in range(20)]
    curve = [loss.item() for loss, _ in found]
    assert all(torch.isfinite(loss) for loss, _ in found) and curve[-1] < curve[0] - 1.0
    assert scaler.get_scale() > 0
