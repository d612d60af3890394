import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attention as A
import config as C
import fastpaths as FP
import flops as FL
import fp8 as F8
import model as M

SMALL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, context=32)


def cached(model, idx, pos, window=None):
    """model's logits for idx (B, T) at cache positions pos (T,), reading its first `window` positions (all)."""
    return model(idx, masks=A.cache_masks(pos, window or model.cfg.context, model.cfg.windows()))


def small_model(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    return M.Llama(M.ModelConfig(**{**SMALL, **overrides})).to(dtype).eval()


# --- Exact parameter and FLOP counts (the presets of "What a Laptop Can Train", LLaMA-2 7B) -------

@pytest.mark.parametrize("name, params", [("22m", 22_025_088), ("47m", 47_195_712),
                                          ("88m", 88_096_512), ("126m", 125_854_464)])
def test_preset_parameter_counts(name, params):
    """The article's presets (configs/<name>-gpt3.toml) have the article's counts; the Muon presets
    (ReLU² at 1.5x SwiGLU's width, QK-norm) have the same matrices plus two head_dim gains a layer."""
    article, today = C.preset(f"{name}-gpt3").model, C.preset(f"{name}-muon").model
    assert article.head_dim == 64 and article.vocab_size == 32768 and article.context == 1024
    assert article.ffn_hidden == M.swiglu_hidden(article.d_model) and today.ffn_hidden == article.ffn_hidden * 3 // 2
    for cfg, expected in ((article, params), (today, params + 2 * today.head_dim * today.n_layers)):
        with torch.device("meta"):
            model = M.Llama(cfg)
        assert sum(p.numel() for p in model.parameters()) == FL.param_count(cfg) == expected


def test_llama2_7b_on_meta_device_is_exact_and_fast():
    cfg = M.ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                        ffn_hidden=11008, tie_embeddings=False, context=4096)
    assert M.swiglu_hidden(4096) == 11008  # Llama's rounding gives its published width
    start = time.perf_counter()
    with torch.device("meta"):
        model = M.Llama(cfg)
    elapsed = time.perf_counter() - start
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616
    assert FL.param_count(cfg) == 6_738_415_616
    assert elapsed < 1.0, f"building 7B shapes on meta took {elapsed:.2f} s"


def test_flops_per_token_88m():
    assert FL.flops_per_token(C.preset("88m-gpt3").model) == 622_950_912  # "Making Training Fast on One GPU": 6N + 12*L*H*Q*T
    assert FL.mfu(29_408, 622_950_912, 25.3e12) == pytest.approx(0.724, abs=1e-3)  # that article's 72.4%


# --- One block against an independent NumPy float64 reference --------------------------------

def numpy_block(x, w, n_heads, n_kv_heads, theta, eps):
    """Llama block written from the papers, in NumPy float64. x: (T, d)."""
    T, d = x.shape
    hd = d // n_heads

    def rmsnorm(v, g):
        return v / np.sqrt((v ** 2).mean(-1, keepdims=True) + eps) * g

    def rope(v):  # v: (heads, T, hd); rotate dimension i with i + hd/2 by angle pos * theta^(-2i/hd)
        freqs = w.get("freqs", theta ** (-np.arange(0, hd, 2) / hd))
        ang = np.arange(T)[:, None] * freqs[None, :]
        c, s = np.cos(ang), np.sin(ang)
        a, b = v[..., :hd // 2], v[..., hd // 2:]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    if "x0_mix" in w:  # the block's input: a * x + b * x0
        x = w["x0_mix"][0] * x + w["x0_mix"][1] * w["x0"]
    h = rmsnorm(x, w["attn_norm"])
    q = (h @ w["wq"].T).reshape(T, n_heads, hd).transpose(1, 0, 2)
    k = (h @ w["wk"].T).reshape(T, n_kv_heads, hd).transpose(1, 0, 2)
    v_flat = h @ w["wv"].T
    if "ve" in w:  # the value embedding of each token, mixed in: a * v + b * ve
        v_flat = w["v_mix"][0] * v_flat + w["v_mix"][1] * w["ve"]
    v = v_flat.reshape(T, n_kv_heads, hd).transpose(1, 0, 2)
    if "q_norm" in w:  # QK-norm: each head's query and key vectors RMS-normed before RoPE
        q, k = rmsnorm(q, w["q_norm"]), rmsnorm(k, w["k_norm"])
    q, k = rope(q), rope(k)
    group = n_heads // n_kv_heads
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    scores = np.where(w.get("mask", np.tril(np.ones((T, T), bool))), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    heads = (p @ v).transpose(1, 0, 2)  # (T, heads, hd)
    if "gate" in w:  # each head times sigmoid(its gate row . the first 12 channels of h)
        heads = heads / (1 + np.exp(-(h[:, :12] @ w["gate"].T)))[..., None]
    attn = heads.reshape(T, d)
    x = x + attn @ w["wo"].T
    h = rmsnorm(x, w["mlp_norm"])
    if "w3" not in w:  # ReLU²: relu(h W1)^2 W2
        return x + np.maximum(h @ w["w1"].T, 0) ** 2 @ w["w2"].T
    g, u = h @ w["w1"].T, h @ w["w3"].T
    return x + ((g / (1 + np.exp(-g))) * u) @ w["w2"].T


@pytest.mark.parametrize("recipe", [{}, {"mlp": "relu2", "qk_norm": True}])
def test_block_matches_numpy_float64(recipe):
    cfg = M.ModelConfig(**SMALL, **recipe)
    model = small_model(**recipe)
    block = model.blocks[0]
    with torch.no_grad():  # non-trivial norm gains, so the test sees them
        for p in block.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    d, kv, f = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    wqkv = block.attn.wqkv.weight.detach().numpy()
    w = {"wq": wqkv[:d], "wk": wqkv[d:d + kv], "wv": wqkv[d + kv:], "wo": block.attn.wo.weight.detach().numpy(),
         "w2": block.mlp.w2.weight.detach().numpy(),
         "attn_norm": block.attn_norm.weight.detach().numpy(), "mlp_norm": block.mlp_norm.weight.detach().numpy()}
    if cfg.mlp == "relu2":
        w["w1"] = block.mlp.w1.weight.detach().numpy()
    else:
        w13 = block.mlp.w13.weight.detach().numpy()
        w.update({"w1": w13[:f], "w3": w13[f:]})
    if cfg.qk_norm:
        w.update({"q_norm": block.attn.q_norm.weight.detach().numpy(), "k_norm": block.attn.k_norm.weight.detach().numpy()})
    x = np.random.default_rng(0).standard_normal((20, d))
    ref = numpy_block(x, w, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps)
    T = x.shape[0]
    with torch.no_grad():
        out = block(torch.from_numpy(x)[None], None, (model.cos[:T], model.sin[:T]), A.Masks())[0].numpy()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-10


def test_record_block_matches_numpy_float64():
    """modded-nanogpt's block parts against NumPy: the x0 mix, a value embedding mixed into v, the
    half-truncated RoPE, the attention gate, and attention within documents and a sliding window."""
    recipe = dict(mlp="relu2", qk_norm=True, value_embeds=1, x0_mix=True, rope_truncate=True, attn_gate=True,
                  attn_window=6, n_heads=2, n_kv_heads=1)
    cfg = M.ModelConfig(**{**SMALL, **recipe})
    model = small_model(**recipe)
    block = model.blocks[0]
    with torch.no_grad():  # every part off its init, so the test sees each one
        for p in block.parameters():
            if p.numel() < 64:  # the two mixes, the gate and the q/k norm gains
                p.copy_(torch.randn_like(p))
            elif p.dim() == 1:  # the block's norm gains
                p.uniform_(0.5, 1.5)
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    rng = np.random.default_rng(1)
    T = 20
    x, x0, ve = rng.standard_normal((T, d)), rng.standard_normal((T, d)), rng.standard_normal((T, kv))
    doc = np.repeat([0, 1, 2], [5, 11, 4])
    i = np.arange(T)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 6) & (doc[:, None] == doc[None, :])
    hd = cfg.head_dim
    freqs = np.concatenate([(1 / 1024) ** np.linspace(0, 1, hd // 4), np.zeros(hd // 4)])
    wqkv, a = block.attn.wqkv.weight.detach().numpy(), block.attn
    w = {"wq": wqkv[:d], "wk": wqkv[d:d + kv], "wv": wqkv[d + kv:], "wo": a.wo.weight.detach().numpy(),
         "w1": block.mlp.w1.weight.detach().numpy(), "w2": block.mlp.w2.weight.detach().numpy(),
         "attn_norm": block.attn_norm.weight.detach().numpy(), "mlp_norm": block.mlp_norm.weight.detach().numpy(),
         "q_norm": a.q_norm.weight.detach().numpy(), "k_norm": a.k_norm.weight.detach().numpy(),
         "x0_mix": block.x0_mix.detach().numpy(), "x0": x0, "ve": ve, "v_mix": a.v_mix.detach().numpy(),
         "gate": a.gate.weight.detach().numpy(), "mask": mask, "freqs": freqs}
    ref = numpy_block(x, w, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps)
    with torch.no_grad():
        masks = A.Masks(A.Mask(torch.from_numpy(doc)[None], 6))
        out = block(torch.from_numpy(x)[None], torch.from_numpy(x0)[None], (model.cos[:T], model.sin[:T]), masks,
                    torch.from_numpy(ve)[None])[0].numpy()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-10


def test_short_windows_halve_the_window_on_all_but_every_fourth_layer_from_either_end():
    """modded-nanogpt's long-short pattern, generalised as every fourth layer counted from either end: 12
    layers give its long layers 0, 4, 7 and 11 exactly, 16 mirror as 0, 4, 11, 15; a short layer sees half
    the long window."""
    cfg = M.ModelConfig(**{**SMALL, "n_layers": 12, "attn_window": 6, "short_windows": True})
    assert [i for i in range(12) if not cfg.short_layer(i)] == [0, 4, 7, 11]
    assert [i for i in range(16) if not replace(cfg, n_layers=16).short_layer(i)] == [0, 4, 11, 15]
    assert cfg.windows() == (6, 3) and cfg.windows(256) == (256, 128) and cfg.windows(1) == (1, 1)
    assert M.ModelConfig(**{**SMALL, "attn_window": 6}).windows() == (6, 0)
    with pytest.raises(ValueError, match="model.short_windows halves model.attn_window"):
        M.ModelConfig(**{**SMALL, "short_windows": True})
    model = small_model(n_layers=3, attn_window=6, short_windows=True)  # layer 1 is short
    assert [b.attn.short for b in model.blocks] == [False, True, False]
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = model(idx)
        assert torch.equal(out, model(idx, masks=A.window_masks(20, (6, 3))))  # the short layer's window is half of 6
        assert not torch.allclose(out, model(idx, masks=A.window_masks(20, (6, 6))))
        # and it is the short layer alone that sees 3 keys: the same model, its layer 1 told so directly
        seen = []
        model.blocks[1].attn.register_forward_pre_hook(lambda m, args: seen.append(args[2].short.window))
        model(idx)
    assert seen == [3]


def test_the_attention_scale_multiplies_the_scores_in_every_attention_path():
    """attn_scale: 1/sqrt(head size) is the plain model exactly; another scale changes the output, the
    same in the textbook scores, SDPA with and without a mask, and the cache's matmuls (modded: 0.12)."""
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    plain, same, other = (small_model(attn_scale=s) for s in (0.0, 16 ** -0.5, 0.4))
    with torch.no_grad():
        assert torch.equal(plain(idx), same(idx)) and not torch.allclose(plain(idx), other(idx))
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    written = A.textbook_attention(q, k, v, scale=0.4)  # its softmax in float32: agreement to float32's digits
    close = dict(rtol=1e-5, atol=1e-6)
    for kind in ("sdpa", "textbook"):
        torch.testing.assert_close(A.attend(q, k, v, A.Mask(), 0.4, kind), written, **close)
    one_document = torch.zeros(2, 9, dtype=torch.long)  # the boolean-mask path
    torch.testing.assert_close(A.attend(q, k, v, A.Mask(one_document), 0.4), written, **close)
    torch.testing.assert_close(A.decode_attention_matmuls(q, k, v, mask, 0.4), written, **close)
    torch.testing.assert_close(A.cached_attention(q, k, v, mask, 0.4), written, **close)
    assert not torch.allclose(A.textbook_attention(q, k, v), written)


def test_an_attention_free_layer_is_its_mlp_alone_and_is_counted():
    """skip_attn_layer: that block adds only its MLP branch (after its x0 mix); the others keep attention;
    the parameters and FLOPs drop by that layer's attention; a value-table layer or the first is refused."""
    parts = dict(qk_norm=True, value_embeds=1, x0_mix=True, attn_gate=True, n_layers=4, skip_attn_layer=2)
    cfg = M.ModelConfig(**{**SMALL, **parts})
    model = small_model(**parts)
    assert [b.attn is None for b in model.blocks] == [False, False, True, False] and model.blocks[2].attn_norm is None
    assert sum(p.numel() for p in model.parameters()) == FL.param_count(cfg) < FL.param_count(
        M.ModelConfig(**{**SMALL, **parts, "skip_attn_layer": -1}))
    block = model.blocks[2]
    with torch.no_grad():
        block.x0_mix.copy_(torch.tensor([0.75, 0.5]))
        x, x0 = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 5, 64, dtype=torch.float64)
        mixed = 0.75 * x + 0.5 * x0
        torch.testing.assert_close(block(x, x0, None, A.Masks()), mixed + block.mlp_branch(mixed), rtol=0, atol=0)
    full = FL.flops_per_token(M.ModelConfig(**{**SMALL, **parts, "skip_attn_layer": -1}))
    # wqkv, wo, the gate, the q/k norm and attention norm gains, then the keys: 6N + 12 H hd T
    per_layer_attention = 6 * (64 * (64 + 2 * 32) + 64 * 64 + 4 * 12 + 2 * 16 + 64) + 12 * 4 * 16 * 32
    assert full - FL.flops_per_token(cfg) == per_layer_attention
    for layer, message in ((0, "is not a layer after the first"), (4, "is not a layer after the first"),
                           (3, "mixes a value embedding")):
        with pytest.raises(ValueError, match=message):
            M.ModelConfig(**{**SMALL, **parts, "skip_attn_layer": layer})


def bigram_row_reference(prev: int, token: int, rows: int) -> int:
    """modded-nanogpt's get_bigram_hash (record #62) for one pair, in Python's unbounded integers."""
    return rows - 1 if prev < 0 else ((36313 * token) ^ (27191 * prev)) % (rows - 1)


def test_the_bigram_tables_row_for_each_pair_enters_every_blocks_input():
    """bigram_rows: block i's input gains bigram_mix[i] times the table's row of (previous, current) token, the first
    position's from the "no previous" row; the table starts at zero and each mix at 0.1; it is counted, a lookup."""
    parts = dict(bigram_rows=11, x0_mix=True)
    cfg, plain = M.ModelConfig(**{**SMALL, **parts}), M.ModelConfig(**SMALL, x0_mix=True)
    model = small_model(**parts)
    assert model.bigram.weight.abs().sum() == 0 and model.bigram_mix.tolist() == pytest.approx([0.1, 0.1])
    assert sum(p.numel() for p in model.parameters()) == FL.param_count(cfg) == FL.param_count(plain) + 11 * 64 + 2
    assert FL.multiplied_params(cfg) == FL.multiplied_params(plain) + 2
    idx = torch.tensor([[5, 96, 5, 96, 0, 7]])
    rows = [bigram_row_reference(p, t, 11) for p, t in zip([-1] + idx[0, :-1].tolist(), idx[0].tolist())]
    assert rows[0] == 10 and rows[1] == rows[3] and max(rows[1:]) < 10
    inputs, outputs = [], [model.embed(idx)]  # the stream before block 0 is the embedding (no embed_norm here)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
        block.register_forward_hook(lambda module, args, out: outputs.append(out))
    table = torch.randn(11, 64, dtype=torch.float64)
    with torch.no_grad():
        model.bigram_mix.copy_(torch.tensor([0.3, -2.0], dtype=torch.float64))
        model.bigram.weight.copy_(table)
        model(idx)
    for i, mix in enumerate((0.3, -2.0)):
        torch.testing.assert_close(inputs[i] - outputs[i], mix * table[rows][None], rtol=0, atol=1e-12)


def test_bigram_signs_multiply_each_pairs_row_by_its_fixed_sign_pattern():
    """bigram_signs (record #83): block i's input gains bigram_mix[i] times the pair's row times the sign pattern of
    (previous xor current) mod 8,192, the first position's pattern 0; the patterns are +-1, the same in every model
    built, and not saved."""
    model = small_model(bigram_rows=11, bigram_signs=True)
    signs = M.sign_patterns(64)
    assert torch.equal(model.signs, signs) and set(signs.unique().tolist()) == {-1, 1} and abs(signs.double().mean()) < 0.01
    assert "signs" not in model.state_dict() and signs.shape == (8192, 64)
    with pytest.raises(ValueError, match="^model.bigram_signs needs model.bigram_rows: it signs the bigram table's rows; "
                                         "set it or use --no-bigram-signs"):
        M.ModelConfig(**SMALL, bigram_signs=True)
    idx = torch.tensor([[5, 96, 5, 96, 0, 7]])
    prev = [-1] + idx[0, :-1].tolist()
    rows = [bigram_row_reference(p, t, 11) for p, t in zip(prev, idx[0].tolist())]
    patterns = [0 if p < 0 else (p ^ t) % 8192 for p, t in zip(prev, idx[0].tolist())]
    inputs = []
    model.blocks[1].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    before = []
    model.blocks[0].register_forward_hook(lambda module, args, out: before.append(out))
    table = torch.randn(11, 64, dtype=torch.float64)
    with torch.no_grad():
        model.bigram_mix.copy_(torch.tensor([0.3, -2.0], dtype=torch.float64))
        model.bigram.weight.copy_(table)
        model(idx)
    expected = -2.0 * table[rows] * signs[patterns].double()
    torch.testing.assert_close(inputs[0] - before[0], expected[None], rtol=0, atol=1e-12)


def test_smear_adds_a_gated_multiple_of_the_predecessors_embedding():
    """smear: the stream starts from e[t] + m * sigmoid(e[t, :12] . g) * e[t-1] (e the embedding), e[0] alone; m and g
    start at zero, so the model starts without it; 13 parameters."""
    model = small_model(smear=True)
    assert model.smear.mix.item() == 0 and model.smear.gate.weight.abs().sum() == 0
    assert sum(p.numel() for p in model.parameters()) == FL.param_count(model.cfg) == FL.param_count(M.ModelConfig(**SMALL)) + 13
    seen = []
    model.stream.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    idx = torch.tensor([[3, 40, 40, 7, 96]])
    g = torch.randn(12, dtype=torch.float64)
    with torch.no_grad():
        model.smear.gate.weight.copy_(g[None])
        model.smear.mix.fill_(1.5)
        model(idx)
    e = model.embed.weight[idx[0]].detach()
    expected = torch.stack([e[0]] + [e[t] + 1.5 * torch.sigmoid(e[t, :12] @ g) * e[t - 1] for t in range(1, 5)])
    torch.testing.assert_close(seen[0][0], expected, rtol=0, atol=1e-12)


def test_the_key_offset_gives_the_long_layers_keys_their_predecessors_unrotated_dims():
    """key_offset: on the long layers (not the short), each key's dims hd/4..hd/2 and 3hd/4..hd, those truncated RoPE
    leaves unrotated, are the key's one position before (the first keeps its own); it needs truncated RoPE."""
    parts = dict(n_layers=4, rope_truncate=True, attn_window=6, short_windows=True, key_offset=True)
    model = small_model(**parts)
    assert [b.attn.key_offset for b in model.blocks] == [True, False, False, True]
    k = torch.randn(2, 2, 5, 16, dtype=torch.float64)
    moved = model.blocks[0].attn.offset(k)
    still = torch.zeros(16, dtype=torch.bool)
    still[4:8] = still[12:] = True
    assert torch.equal(moved[:, :, 1:, still], k[:, :, :-1, still]) and torch.equal(moved[..., ~still], k[..., ~still])
    assert torch.equal(moved[:, :, 0], k[:, :, 0]) and model.blocks[1].attn.offset(k) is k
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    plain = small_model(**{**parts, "key_offset": False})
    with torch.no_grad():
        plain.load_state_dict(model.state_dict())
        assert (model(idx) - plain(idx)).abs().max() > 1e-6
    with pytest.raises(ValueError, match="^model.key_offset needs model.rope_truncate: it moves the dims truncated RoPE "
                                         "leaves unrotated; set it or use --no-key-offset$"):
        M.ModelConfig(**SMALL, key_offset=True)


def test_paired_heads_see_both_heads_keys_in_one_softmax():
    """paired_heads (record #58), float64 against a loop: in every other short layer, head j and head j + H/2 of token
    t are one head over a sequence of two keys a token, t's at 2t (head j) and 2t + 1 (head j + H/2): a query sees the
    keys before its own place in that sequence, of its document, within the window counted in those keys, each
    rotated by its place. The layers, the config's checks and the model's use of it are checked too."""
    parts = dict(n_layers=6, n_kv_heads=4, attn_window=5, short_windows=True, paired_heads=True)
    model = small_model(**parts)
    assert [b.attn.paired for b in model.blocks] == [False, True, False, True, False, False]
    attn, (B, T, H, hd), w = model.blocks[1].attn, (2, 9, 4, 16), model.cfg.windows()[2]
    x = torch.randn(B, T, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    doc = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    qkv = attn.wqkv(x).view(B, T, 3 * H, hd)
    with torch.no_grad():
        y = attn.attend(qkv, model.rope(T, None, torch.float64)[1], A.masks(T, x.device, doc, model.cfg.windows()))
    cos, sin = M.rope_tables(hd, 2 * T, model.cfg.rope_theta)

    def rotated(u, at):  # u (hd,) at its place `at` in the paired sequence
        return u * cos[at] + torch.cat([-u[hd // 2:], u[:hd // 2]]) * sin[at]

    ref = torch.zeros(B, T, H, hd, dtype=torch.float64)
    for b, t, h in np.ndindex(B, T, H):
        j, at = h % (H // 2), 2 * t + h // (H // 2)
        keys = [(s, j + r * H // 2) for s in range(T) for r in (0, 1)
                if 2 * s + r <= at and at - (2 * s + r) < w and doc[b, s] == doc[b, t]]
        q = rotated(qkv[b, t, h], at)
        scores = torch.stack([q @ rotated(qkv[b, s, H + g], 2 * s + g // (H // 2)) for s, g in keys]) / hd ** 0.5
        ref[b, t, h] = torch.softmax(scores, 0) @ torch.stack([qkv[b, s, 2 * H + g] for s, g in keys])
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    plain = small_model(**{**parts, "paired_heads": False})
    with torch.no_grad():
        plain.load_state_dict(model.state_dict())
        assert (model(idx) - plain(idx)).abs().max() > 1e-6
    with pytest.raises(ValueError, match="^model.paired_heads needs model.short_windows: it pairs the heads of every other "
                                         "short layer; set it or use --no-paired-heads$"):
        M.ModelConfig(**{**SMALL, "n_kv_heads": 4}, paired_heads=True)
    with pytest.raises(ValueError, match="^model.paired_heads needs a kv head per query head: set n_kv_heads = n_heads = 4$"):
        M.ModelConfig(**{**SMALL, **parts, "n_kv_heads": 2})
    with pytest.raises(ValueError, match="^model.paired_heads pairs the heads, but model.n_heads=3 is odd: make it even$"):
        M.ModelConfig(**{**SMALL, **parts, "d_model": 48, "n_heads": 3, "n_kv_heads": 3})


def test_yarn_slows_the_slow_frequencies_and_sharpens_the_scores_as_the_window_grows():
    """rope_yarn (record #31): from the window RoPE was trained over to the one attended over, a frequency that turned
    less than once over the first is slowed by their ratio, one that turned over 32 times is kept, those between
    blend linearly; q . k is sharpened by 0.2 ln(window / trained) + 1, folded into both tables."""
    turns = torch.tensor([0.5, 1.0, 16.5, 32.0, 40.0], dtype=torch.float64)  # over 128 keys
    freqs, factor = M.yarn_stretch(turns * 2 * math.pi / 128, 128, 512)
    assert torch.allclose(freqs / (turns * 2 * math.pi / 128), torch.tensor([0.25, 0.25, 0.625, 1.0, 1.0],
                                                                             dtype=torch.float64))
    assert factor == pytest.approx(0.2 * math.log(4) + 1)
    cos, sin = M.rope_tables(16, 8, 10000.0, True, yarn=(128, 512))
    plain_cos, plain_sin = M.rope_tables(16, 8, 10000.0, True)
    assert torch.allclose(cos ** 2 + sin ** 2, torch.full_like(cos, factor))  # each pair's norm times sqrt(factor)
    assert torch.equal(cos[:, 4:8], plain_cos[:, 4:8] * factor ** 0.5)  # the unrotated dims: scaled alone
    assert not torch.allclose(cos / factor ** 0.5, plain_cos)  # the slowest rotated frequencies were slowed
    model = small_model(attn_window=24, rope_yarn=8)
    assert model.tables_window == 24 and torch.allclose(model.cos, M.rope_tables(16, 32, 10000.0, yarn=(8, 24))[0])
    model.set_tables(16)
    assert model.tables_window == 16 and torch.allclose(model.cos, M.rope_tables(16, 32, 10000.0, yarn=(8, 16))[0])
    with pytest.raises(ValueError, match="^model.rope_yarn needs model.attn_window: it stretches RoPE as the window "
                                         "grows; set it or use --rope-yarn 0$"):
        M.ModelConfig(**SMALL, rope_yarn=8)


def test_mimetic_init_starts_each_attention_as_minus_b_times_what_it_attends_to():
    """mimetic_init (record #64): each attention's v and wo start at +-sqrt(b) I plus N(0, 0.01^2), so wo v = -b I
    (zero_init's zero wo replaced); q and k keep their init; a lone token, which attends to itself alone, gets -b x
    from its attention; it needs a kv head per query head."""
    b, d = 0.05, 64
    model = small_model(n_kv_heads=4, zero_init=True, mimetic_init=b)
    eye = torch.eye(d, dtype=torch.float64)
    for attn in model.attentions():
        v, wo, qk = attn.wqkv.weight[-d:], attn.wo.weight, attn.wqkv.weight[:-d]
        assert (v - b ** 0.5 * eye).std().item() == pytest.approx(0.01, rel=0.1)
        assert (wo + b ** 0.5 * eye).std().item() == pytest.approx(0.01, rel=0.1)
        assert torch.diagonal(wo @ v).mean().item() == pytest.approx(-b, abs=2e-3)
        assert qk.std().item() == pytest.approx(0.02, rel=0.1)
    model.mimetic_value_output(b, noise=0.0)
    attn, x = model.blocks[0].attn, torch.randn(3, 1, d, dtype=torch.float64)
    with torch.no_grad():
        y = attn(x, (model.cos[:1], model.sin[:1]), A.window_masks(1, model.cfg.windows()))
    assert torch.allclose(y, -b * x)
    with pytest.raises(ValueError, match="^model.mimetic_init needs a kv head per query head: set n_kv_heads = n_heads = 4$"):
        M.ModelConfig(**SMALL, mimetic_init=b)


def test_the_value_gate_multiplies_each_value_embedding_by_twice_a_sigmoid_per_kv_head():
    """value_gate: a table's layers take ve * 2 sigmoid(x[..., :12] W^T) (W (Hkv, 12), zero at init: ve alone), the
    model without it given that product computes the same; counted; it needs value embeddings."""
    parts = dict(value_embeds=1, value_gate=True)
    model = small_model(**parts)
    attn, plain = model.blocks[0].attn, small_model(value_embeds=1).blocks[0].attn
    assert attn.ve_gate.weight.shape == (2, 12) and attn.ve_gate.weight.abs().sum() == 0
    assert model.blocks[1].attn.ve_gate is not None and sum(p.numel() for p in model.parameters()) == FL.param_count(
        model.cfg) == FL.param_count(M.ModelConfig(**SMALL, value_embeds=1)) + 2 * 2 * 12
    x, ve = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    rope = model.cos[:5], model.sin[:5]
    with torch.no_grad():
        attn.ve_gate.weight.normal_()
        plain.load_state_dict(attn.state_dict(), strict=False)
        gate = 2 * torch.sigmoid(x[..., :12] @ attn.ve_gate.weight.T)  # (2, 5, Hkv)
        gated = (ve.view(2, 5, 2, 16) * gate[..., None]).flatten(2)
        masks = A.window_masks(5, (0, 0))
        torch.testing.assert_close(attn(x, rope, masks, ve), plain(x, rope, masks, gated), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="^model.value_gate needs model.value_embeds: it gates the value embeddings"):
        M.ModelConfig(**SMALL, value_gate=True)


def test_backout_subtracts_a_multiple_of_the_two_thirds_stream_before_the_head():
    """backout: the head reads norm(x - b * h), h block backout_layer's output (2/3 deep), b from 0.5."""
    parts = dict(n_layers=6, backout=True)
    model = small_model(**parts)
    assert model.cfg.backout_layer == 3 and M.ModelConfig(**{**SMALL, "n_layers": 12}).backout_layer == 7
    assert model.backout_mix.tolist() == [0.5]
    outputs = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: outputs.append(out))
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.backout_mix.fill_(0.7)
        logits = model(idx)
        expected = model.output.logits(model.norm(outputs[-1] - 0.7 * outputs[3]), model.output_weight())
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    assert sum(p.numel() for p in model.parameters()) == FL.param_count(model.cfg)


def test_the_126m_presets_have_the_record_holders_parameter_counts_and_the_newest_parts():
    """Counted on the meta device (no memory). configs/126m-record.toml: modded-nanogpt's 208.4M at record #28, its
    attention-free layer 7 and untied head included (modded's scalars are 64 whether used or not; ours are the used
    ones: 5 value scales among them, and like modded's its norms have no gains). configs/126m.toml: that less a
    block with attention (its matrices and its gate's 12 x 6) and its 4 scalars (two x0 mixes, a skip, a value
    scale), plus the newest parts: the bigram table (5 x 32,768 rows of 768), 457 mixes and gates and XSA's 36 (6
    heads in 6 unpaired layers). The modules' tensors agree with param_count."""
    def count(preset: str) -> tuple[M.Llama, int]:
        cfg = C.preset(preset).model
        with torch.device("meta"):
            model = M.Llama(cfg)
        assert sum(p.numel() for p in model.parameters()) == FL.param_count(cfg)
        return model, FL.param_count(cfg)
    record, n = count("126m-record")
    assert n == 208_405_319 and record.blocks[7].attn is None
    block = 4 * 768 * 768 + 2 * 768 * 3072 + 12 * 6
    model, n = count("126m")
    assert n == 208_405_319 - block - 4 + 163_840 * 768 + 457 + 36
    assert model.blocks[6].attn is None and len(model.attentions()) == 10


def test_flops_per_token_count_matmuls_and_the_windows_keys():
    """6N over the weights that multiply (no lookup tables) plus 12*H*Q per layer times the keys it
    may see, min(T, 2w) with a window w: configs/126m.toml at 8,192 tokens, written out."""
    cfg = C.preset("126m").model
    d, L, H, hd, V, f = 768, 11, 6, 128, 32768, 3072
    # blocks (q, k, v, o, the MLP, the gate) and the head; layer 6 has no attention (its q, k, v, o and gate)
    matmuls = L * (4 * d * d + 2 * d * f + 12 * H) - (4 * d * d + 12 * H) + V * d
    # x0 mixes, skips, v mixes, value scales (layers 3-5 and 7); the norms have no gains (norm_gains false)
    scalars = L * 2 + L // 2 + 3 * 2 * 2 + 4
    # the newest parts: a bigram mix a layer, backout's mix, smear's gate (12 channels) and mix, and a value gate
    # (12 channels to each of the 6 kv heads) on each of the 6 layers with a value table, and XSA's gate a head in
    # the 6 unpaired layers with attention (paired: 1, 3, 7, 9); the table is a lookup
    newest = L + 1 + 12 + 1 + 6 * 12 * H + 6 * H
    long_layers = 3  # 0, 4 and 10
    attention = 12 * H * hd * (long_layers * 2 * 1792 + (L - long_layers - 1) * 2 * 896)
    assert FL.flops_per_token(cfg) == 6 * (matmuls + scalars + newest) + attention
    assert FL.flops_per_token(replace(cfg, paired_heads=True)) == FL.flops_per_token(cfg)  # 2T queries, H/2 heads


def test_unet_skips_add_each_mirrored_output_with_its_weight():
    """Written out for four blocks: block 2 adds block 1's output times skip_weights[0], block 3
    block 0's times skip_weights[1] (modded-nanogpt's stack order); the stream starts from the
    normed embedding, which is also every block's x0."""
    model = small_model(n_layers=4, unet_skips=True, x0_mix=True, embed_norm=True, tie_embeddings=False)
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.7, -1.3]))
        for b in model.blocks:
            b.x0_mix.copy_(torch.tensor([0.9, 0.4]))
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    cos, sin = model.cos[:12], model.sin[:12]
    with torch.no_grad():
        x0 = M.rms_norm(model.embed(idx), model.cfg.norm_eps)
        b = [lambda x, blk=blk: blk(x, x0, (cos, sin), A.Masks()) for blk in model.blocks]
        out0 = b[0](x0)
        out1 = b[1](out0)
        out2 = b[2](out1 + 0.7 * out1)
        out3 = b[3](out2 - 1.3 * out0)
        ref = F.linear(model.norm(out3), model.head.weight)
        assert torch.allclose(model(idx), ref, rtol=0, atol=1e-9)


def test_embed_norm_makes_the_embeddings_scale_irrelevant():
    model = small_model(embed_norm=True, tie_embeddings=False)
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(idx)
        model.embed.weight.mul_(7.0)
        assert torch.allclose(model(idx), before, atol=1e-5)  # norm_eps apart
        model.stream.norm = False
        assert not torch.allclose(model(idx), before, atol=1e-3)


def test_the_record_parts_start_where_modded_nanogpt_starts_them():
    cfg = M.ModelConfig(**{**SMALL, "n_layers": 4}, zero_init=True, tie_embeddings=False, embed_norm=True, value_embeds=2,
                        unet_skips=True, x0_mix=True, attn_gate=True)
    model = M.Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == FL.param_count(cfg)
    assert [cfg.value_table(i) for i in range(4)] == [0, 1, 0, 1]
    assert [M.ModelConfig(**{**SMALL, "n_layers": 6}, value_embeds=2).value_table(i) for i in range(6)] == \
        [0, 1, None, None, 0, 1]
    assert torch.equal(model.head.weight, torch.zeros_like(model.head.weight))  # uniform first logits
    assert torch.equal(model.blocks[0].attn.gate.weight, torch.zeros(4, 12))  # every head at half its output
    assert model.blocks[1].x0_mix.tolist() == [1.0, 0.0] and model.blocks[0].attn.v_mix.tolist() == [0.5, 0.5]
    assert model.skip_weights.tolist() == [1.0, 1.0]
    assert 0.9 < model.embed.weight.std().item() < 1.1 and 0.9 < model.value_embeds[0].weight.std().item() < 1.1
    idx = torch.randint(0, 97, (2, 12))
    assert model(idx, idx).item() == pytest.approx(math.log(97), abs=1e-6)


def test_value_scale_multiplies_the_values_of_the_layers_without_a_table():
    """value_scale: a layer that mixes no value embedding scales its values by its own learned a, from 0.5
    (modded-nanogpt's sa_lambdas[0]); attention and the output projection are linear in v, so that layer's
    attention output is a times the plain one; the layers with a table keep their (a, b)."""
    parts = dict(n_layers=4, value_embeds=1, attn_gate=True, qk_norm=True)
    plain, scaled = small_model(**parts), small_model(**parts, value_scale=True)
    assert scaled.blocks[1].attn.v_mix.tolist() == [0.5] and scaled.blocks[0].attn.v_mix.tolist() == [0.5, 0.5]
    assert plain.blocks[1].attn.v_mix is None
    assert sum(p.numel() for p in scaled.parameters()) == FL.param_count(scaled.cfg) == FL.param_count(plain.cfg) + 2
    scaled.load_state_dict({**plain.state_dict(), **{n: p for n, p in scaled.state_dict().items() if "v_mix" in n}})
    with torch.no_grad():
        scaled.blocks[1].attn.v_mix.fill_(0.3)
        x = torch.randn(2, 12, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        at = (plain.cos[:12], plain.sin[:12]), A.Masks()
        assert torch.allclose(scaled.blocks[1].attn(x, *at), 0.3 * plain.blocks[1].attn(x, *at), atol=1e-12)
        ve = torch.randn(2, 12, 32, dtype=torch.float64)  # (B, T, Hkv * hd)
        assert torch.equal(scaled.blocks[0].attn(x, *at, ve=ve), plain.blocks[0].attn(x, *at, ve=ve))


def test_without_norm_gains_every_norm_is_x_over_its_rms_and_no_optimizer_sees_a_gain():
    """norm_gains False (modded-nanogpt's norm(x)): each RMSNorm's gain is a buffer of ones, so the model
    computes what the plain one does with its gains at one, and holds that many parameters fewer."""
    import optim as O
    parts = dict(qk_norm=True, tie_embeddings=False)
    plain, gainless = small_model(**parts), small_model(**parts, norm_gains=False)
    gains = [n for n, _ in plain.named_parameters() if n.endswith("norm.weight")]
    assert len(gains) == 2 * 4 + 1 and not [n for n, _ in gainless.named_parameters() if n.endswith("norm.weight")]
    assert sum(p.numel() for p in gainless.parameters()) == FL.param_count(gainless.cfg) == \
        FL.param_count(plain.cfg) - 2 * (64 + 64 + 16 + 16) - 64
    assert not [p for p in O.param_groups(gainless)["scalars"] if p.dim() == 1 and p.numel() in (16, 64)]
    gainless.load_state_dict(plain.state_dict())  # the same names: a buffer of ones where the gain was
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(gainless(idx), plain(idx))
        plain.norm.weight.fill_(2.0)
        assert not torch.equal(gainless(idx), plain(idx))


def test_a_window_as_long_as_the_sequence_is_plain_causal_attention():
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    cpu = torch.device("cpu")
    assert A.masks(8, cpu, None, (8, 0)) == A.Masks() == A.masks(8, cpu) == A.window_masks(8, (8, 8))
    assert A.masks(8, cpu, None, (3, 0)) == A.Masks(A.Mask(window=3)) == A.window_masks(8, (3, 0))
    i = np.arange(8)
    ref = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3) & (doc.numpy()[0][:, None] == doc.numpy()[0][None, :])
    assert np.array_equal(A.doc_mask(doc, 3)[0].numpy(), ref)
    assert np.array_equal(A.doc_mask(None, 3, 8)[0].numpy(), (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3))


def test_soft_cap_matches_numpy_and_bounds_the_logits():
    model = small_model(logit_softcap=2.0)
    with torch.no_grad():
        model.embed.weight.mul_(200)  # logits far beyond the cap
    idx = torch.randint(0, SMALL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        capped = model(idx)
        model.output.cap = 0.0
        raw = model(idx).numpy()
        model.output.cap = 2.0
        loss = model(idx, idx)
    assert np.abs(capped.numpy() - 2.0 * np.tanh(raw / 2.0)).max() < 1e-12 and np.abs(raw).max() > 10
    assert capped.abs().max() <= 2.0  # the loss is taken on the capped logits too
    ref = -np.log(np.exp(capped.numpy()) / np.exp(capped.numpy()).sum(-1, keepdims=True))
    assert abs(loss.item() - np.take_along_axis(ref, idx.numpy()[..., None], -1).mean()) < 1e-12


def test_relu2_matches_swiglus_parameters_and_zero_init_starts_as_identity():
    swiglu, relu2 = M.ModelConfig(**SMALL), M.ModelConfig(**SMALL, mlp="relu2")
    assert relu2.ffn_hidden == swiglu.ffn_hidden * 3 // 2 and FL.param_count(relu2) == FL.param_count(swiglu)
    model = small_model(zero_init=True)
    assert all(not b.attn.wo.weight.any() and not b.mlp.w2.weight.any() for b in model.blocks)
    x = torch.randn(1, 5, SMALL["d_model"], dtype=torch.float64)
    assert torch.equal(model.blocks[0](x, None, (model.cos[:5], model.sin[:5]), A.Masks()), x)


# --- Properties ----------------------------------------------------------------------------

def test_rope_scores_depend_only_on_offset():
    cos, sin = M.rope_tables(64, 32, 10000.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64)

    def score(qpos, kpos):
        return (M.apply_rope(q, cos[qpos:qpos + 1], sin[qpos:qpos + 1])
                * M.apply_rope(k, cos[kpos:kpos + 1], sin[kpos:kpos + 1])).sum().item()

    assert score(5, 2) == pytest.approx(score(15, 12), rel=1e-12)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-6)


def test_causality_future_tokens_never_change_earlier_logits():
    model = small_model()
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % 97
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_native_gqa_equals_repeated_kv():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 10, 16, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 10, 16, generator=g, dtype=torch.float64), torch.randn(2, 2, 10, 16, generator=g, dtype=torch.float64)
    native = A.attend(q, k, v, A.Mask())
    copied = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True)
    torch.testing.assert_close(native, copied, rtol=1e-12, atol=1e-12)


RECORD_PARTS = dict(mlp="relu2", qk_norm=True, tie_embeddings=False, embed_norm=True, logit_softcap=15.0, value_embeds=1,
                    value_scale=True, unet_skips=True, x0_mix=True, rope_truncate=True, attn_gate=True, attn_window=6)


@pytest.mark.parametrize("windowed, parts", [(False, {}), (True, {}), (True, RECORD_PARTS),
                                             (True, {**RECORD_PARTS, "n_layers": 3, "short_windows": True}),
                                             (True, {**RECORD_PARTS, "n_layers": 3, "skip_attn_layer": 1}),
                                             (True, {"attn_scale": 0.4, "attn_window": 6}),
                                             (True, {**RECORD_PARTS, "n_layers": 3, "bigram_rows": 13, "backout": True, "smear": True,
                                                     "key_offset": True, "value_gate": True, "saved_attn_input": True}),
                                             (True, {**RECORD_PARTS, "n_layers": 4, "short_windows": True, "paired_heads": True,
                                                     "n_kv_heads": 4, "xsa": True, "dense_last": True})],
                         ids=["whole-cache", "written-so-far", "record-parts", "short-windows", "attention-free",
                              "attention-scale", "bigram-backout-smear", "paired-heads-xsa"])
def test_kv_cache_decode_equals_full_forward(windowed, parts):
    """Through the cache, a prompt, a chunk and single tokens give the full forward's logits,
    reading the whole cache through its mask or, as eager decoding does, only the positions
    written so far (window); with modded-nanogpt's parts the value embeddings and the gate go
    through the cache path too, and the sliding window of 6 keys hides what lies further back."""
    model = small_model(**parts)
    with torch.no_grad():  # a gate and a mix off their init, so a decode path that skips them fails
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "v_mix", "x0_mix", "bigram.weight", "bigram_mix", "backout_mix", "smear.mix",
                              "xsa")) or name.startswith("dense."):
                p.copy_(torch.randn_like(p))
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(4))
    window = (lambda end: end) if windowed else (lambda end: None)
    with torch.no_grad():
        full = model(idx)  # a windowed model attends through its own window unless told otherwise
        if parts:
            assert not torch.allclose(full, model(idx, masks=A.window_masks(idx.shape[1], (0, 0))))
        model.setup_cache(2)
        steps = [cached(model, idx[:, :7], torch.arange(7), window(7))]  # a prompt,
        steps += [cached(model, idx[:, 7:12], torch.arange(7, 12), window(12))]  # a chunk after cached tokens,
        steps += [cached(model, idx[:, t:t + 1], torch.tensor([t]), window(t + 1))
                  for t in range(12, 20)]  # then one at a time
    assert model.blocks[0].attn.cache.k.shape == (2, model.cfg.n_kv_heads, 32, 16)  # the kv heads, not the 4 query heads
    if parts.get("paired_heads"):  # a paired layer's: half the heads, two keys a token
        assert model.blocks[1].attn.cache.k.shape == (2, 2, 64, 16)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-9


def test_cache_is_never_read_past_the_current_length():
    """Positions after the tokens written so far hold garbage (stale keys of a longer earlier
    generation); the mask must keep every one of them out of the result."""
    model = small_model()
    idx = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.setup_cache(1)
        clean = cached(model, idx, torch.arange(12))
        for block in model.blocks:
            block.attn.cache.k[:, :, 12:] = 1e4 * torch.randn_like(block.attn.cache.k[:, :, 12:])
            block.attn.cache.v[:, :, 12:] = 1e4 * torch.randn_like(block.attn.cache.v[:, :, 12:])
        dirty = cached(model, idx, torch.arange(12))
        next_clean = cached(model, idx[:, -1:], torch.tensor([12]))
    torch.testing.assert_close(dirty, clean, rtol=0, atol=1e-12)
    assert torch.isfinite(next_clean).all()


def test_cached_attention_folds_query_groups_like_native_gqa():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 6, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[:, 0] = True  # every query sees at least one key
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(A.cached_attention(q, k, v, mask), expected)
    folded = q.reshape(2, 2, 15, 8)  # the CUDA path, run here on the CPU
    torch.testing.assert_close(A.decode_attention_matmuls(folded, k, v, mask.repeat(3, 1)).reshape(2, 6, 5, 8), expected)


def test_sdpa_agrees_with_the_written_out_attention_on_cpu():
    """On CPU the SDPA backends cannot be pinned (they are CUDA kernels) and fall back to PyTorch's
    choice, so the one comparison that means something here is SDPA against the textbook formula,
    with grouped-query heads; tests/test_gpu.py compares each pinned backend on CUDA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(2))
    written_out = A.textbook_attention(q, k, v)
    torch.testing.assert_close(A.attend(q, k, v, A.Mask()), written_out)
    torch.testing.assert_close(A.attend(q, k, v, A.Mask(), backend="textbook"), written_out)
    future = v.clone()
    future[:, :, -1] += 1.0  # causal: changing the last value changes only the last position's output
    changed = (A.attend(q, k, future, A.Mask()) - written_out).abs().amax(dim=(0, 1, 3)) > 1e-3  # the textbook softmax runs in float32
    assert changed.tolist() == [False] * 15 + [True]


def test_loss_at_init_is_near_ln_vocab():
    torch.manual_seed(0)
    model = M.Llama(C.preset("tiny").model)
    idx, targets = torch.randint(0, 4096, (2, 64)), torch.randint(0, 4096, (2, 64))
    with torch.no_grad():
        loss = model(idx, targets=targets).item()
    assert abs(loss - math.log(4096)) < 0.1


# --- Bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(d_model=100, n_heads=3), r"d_model=100 is not divisible by model\.n_heads=3"),
    (dict(n_heads=4, n_kv_heads=3), r"n_heads=4 is not a multiple of model\.n_kv_heads=3"),
    (dict(d_model=36, n_heads=4, n_kv_heads=2), r"head size .* = 9 is odd"),
    (dict(n_layers=0), r"model\.n_layers must be positive"),
])
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        M.ModelConfig(**{**SMALL, **overrides})


def test_sequence_longer_than_context_is_refused():
    model = small_model()
    with pytest.raises(ValueError, match=r"33 tokens is longer than model\.context=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("with_docs", [True, False])
def test_the_block_mask_from_document_boundaries_is_create_block_masks(with_docs):
    """model.block_mask_from_documents against create_block_mask, which evaluates the mask at every pair:
    the same partial and full blocks, each row's indices in the same order, on both the key side and the
    query side (the backward's), for windows under, at, just past, across and over the 128-token block."""
    from torch.nn.attention.flex_attention import create_block_mask
    g = torch.Generator().manual_seed(0)
    B, T = 3, 640
    docs = None
    if with_docs:
        docs = torch.cumsum(torch.rand(B, T, generator=g) < 0.01, dim=1).int()
        docs[0, 100:400] = docs[0, 100]  # one document over whole blocks: full blocks off the diagonal
        docs[0, 400:] += 1
    for window in (0, 100, 128, 129, 200, 257, 300):  # 129 and 257: one past a block's nearest pairs
        reach = window or T

        def allowed(b, h, q, k):
            ok = (q >= k) & (q - k < reach)
            return ok & (docs[b, q] == docs[b, k]) if with_docs else ok
        want = create_block_mask(allowed, B if with_docs else None, None, T, T, device="cpu")
        got = A.flex_block_mask(docs, window, T, torch.device("cpu"))
        assert int(want.full_kv_num_blocks.sum()) > 0 or window < 2 * A.FLEX_BLOCK  # full blocks are tested
        for count, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                               ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
            n = getattr(want, count)
            assert torch.equal(getattr(got, count), n), (window, count)
            keep = torch.arange(n.shape[-1])[None, None, None, :] < n[..., None]  # each row's first n indices
            assert torch.equal(getattr(got, indices)[keep], getattr(want, indices)[keep]), (window, indices)


def test_flex_attention_gets_the_kernel_options(monkeypatch):
    """A block mask goes to FlexAttention with the call's kernel options (none: Inductor's own tiles), which is
    how `bench.py --attention-rate` times each of bench.FLEX_CANDIDATES."""
    seen = []
    monkeypatch.setattr(A, "flex_attention_compiled", lambda: lambda q, k, v, **kw: seen.append(kw["kernel_options"]) or q)
    q = torch.zeros(1, 2, 4, 8)
    A.attend(q, q, q, A.Mask(block_mask="mask"))
    A.attend(q, q, q, A.Mask(block_mask="mask"), flex_options={"USE_TMA": True})
    assert seen == [None, {"USE_TMA": True}]


@pytest.mark.slow
def test_compiled_flex_attention_with_the_document_block_mask_is_the_boolean_mask():
    """FlexAttention compiled for the CPU skips the blocks a BlockMask leaves out (its eager form only reads
    the mask function), so this is block_mask_from_documents end to end: the same output as SDPA with the
    boolean mask, at windows under, across and past the 128-token block (about 10 s: one compile)."""
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 384, 16, generator=g)
    k, v = (torch.randn(2, 2, 384, 16, generator=g) for _ in range(2))
    doc = torch.cumsum(torch.rand(2, 384, generator=g) < 0.01, dim=1).int()
    for window in (0, 100, 200):
        mask = A.flex_block_mask(doc, window, 384, torch.device("cpu"))
        out = flex(q, k, v, block_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out, A.attend(q, k, v, A.Mask(doc, window)), rtol=1e-5, atol=1e-5)


def test_the_shifted_soft_cap_is_record_54s_logit_rescale_to_a_softmax():
    """logit_shift and logit_temperature: 11.5 tanh((z + 5) / 15) is 23 sigmoid((z + 5) / 7.5) less a constant, so the
    same log-softmax in float64; without them, the symmetric cap; and the model's logits take the shaped cap."""
    z = torch.randn(4, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 20
    record = torch.log_softmax(23 * torch.sigmoid((z + 5) / 7.5), dim=-1)
    torch.testing.assert_close(torch.log_softmax(M.softcap(z, 11.5, 5.0, 15.0), dim=-1), record, rtol=0, atol=1e-12)
    assert torch.equal(M.softcap(z, 15.0, 0.0, 0.0), 15.0 * torch.tanh(z / 15.0))
    cfg = M.ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=50, context=8, logit_softcap=11.5,
                        logit_shift=5.0, logit_temperature=15.0, tie_embeddings=True)
    torch.manual_seed(0)
    model = M.Llama(cfg).double().eval()
    x = torch.randint(0, 50, (1, 8))
    shaped = model(x)
    model.output.shift = model.output.temperature = 0.0
    assert (shaped - model(x)).abs().max() > 1e-3 and shaped.max() < 11.5


@pytest.mark.parametrize("values, message", [
    (dict(logit_shift=5.0), r"model\.logit_shift needs model\.logit_softcap: it shifts the logits inside the soft-cap"),
    (dict(logit_temperature=15.0), r"model\.logit_temperature needs model\.logit_softcap: it widens the soft-cap; set "
                                   r"it or use --logit-temperature 0"),
    (dict(logit_softcap=15.0, logit_shift=float("nan")), r"model\.logit_shift=nan is not a finite number"),
])
def test_a_soft_cap_shape_without_a_cap_is_refused(values, message):
    with pytest.raises(ValueError, match=message):
        M.ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=50, context=8, **values)


def test_gated_xsa_takes_each_heads_share_along_its_own_value_as_a_float64_reference_does():
    """xsa (record #82): each unpaired layer's head output y less tanh(a) (y . v^) v^, v^ its token's own value normed
    (a kv head shared by the query heads of its group), a from 0 (the model as without it); a paired layer has none."""
    parts = dict(n_layers=4, attn_window=6, short_windows=True, paired_heads=True, n_kv_heads=4, xsa=True)
    model = small_model(**parts)
    assert [b.attn.xsa is not None for b in model.blocks] == [True, False, True, True]  # layer 1 is paired
    assert sum(p.numel() for p in model.parameters()) == FL.param_count(model.cfg) == FL.param_count(
        replace(model.cfg, xsa=False)) + 3 * 4
    idx = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), small_model(**{**parts, "xsa": False})(idx), rtol=0, atol=0)
    attn = small_model(n_kv_heads=2, xsa=True).blocks[0].attn  # 4 query heads, 2 kv heads
    with torch.no_grad():
        attn.xsa.copy_(torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64))
    g = torch.Generator().manual_seed(7)
    y, v = torch.randn(2, 5, 4, 16, generator=g, dtype=torch.float64), torch.randn(2, 5, 2, 16, generator=g, dtype=torch.float64)
    want = y.clone()
    for h in range(4):
        unit = v[:, :, h // 2] / v[:, :, h // 2].norm(dim=-1, keepdim=True)
        share = math.tanh(attn.xsa[h].item()) * (y[:, :, h] * unit).sum(-1, keepdim=True)
        want[:, :, h] = y[:, :, h] - share * unit
    torch.testing.assert_close(attn.less_own_value(y, v), want, rtol=1e-12, atol=1e-12)


def test_saved_attn_input_feeds_the_last_blocks_attention_the_two_thirds_blocks_output():
    """saved_attn_input (record #77): every block after backout_layer normalises the output of block backout_layer
    for its attention, where without it each normalises its own (x0-mixed) input; the blocks up to it are as
    without it."""
    parts = dict(n_layers=6, x0_mix=True, backout=True)
    with_it, without = small_model(**parts, saved_attn_input=True), small_model(**parts)
    with torch.no_grad():  # each block's x0 mix off its identity init, so its own input is not its predecessor's output
        for name, p in with_it.named_parameters():
            if name.endswith("x0_mix"):
                p.copy_(torch.randn_like(p))
    without.load_state_dict(with_it.state_dict())
    assert with_it.cfg.backout_layer == 3
    idx = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(8))
    for model in (with_it, without):
        model.seen, model.outputs = {}, {}
        for i, block in enumerate(model.blocks):
            block.attn_norm.register_forward_hook(lambda m, args, out, s=model.seen, i=i: s.__setitem__(i, args[0]))
            block.register_forward_hook(lambda m, args, out, s=model.outputs, i=i: s.__setitem__(i, out))
        with torch.no_grad():
            model.logits = model(idx)
    for i in range(4):
        torch.testing.assert_close(with_it.seen[i], without.seen[i], rtol=0, atol=0)
    for i in (4, 5):
        torch.testing.assert_close(with_it.seen[i], with_it.outputs[3], rtol=0, atol=0)
        assert (without.seen[i] - with_it.outputs[3]).abs().max() > 1e-3
    assert (with_it.logits - without.logits).abs().max() > 1e-3


def test_dense_mix_weights_its_sources_by_a_small_mlp_of_the_stream_as_a_float64_reference_does():
    """DenseMix (record #81): way c of the output is sum_k w[c, k] s_k, w = (gelu(x W1) W2 + b) 0.2 / sqrt(sources)
    per token."""
    torch.manual_seed(0)
    mix = M.DenseMix(8, sources=3, ways=2, hidden=5).double()
    g = torch.Generator().manual_seed(9)
    x, sources = torch.randn(2, 4, 8, generator=g, dtype=torch.float64), list(torch.randn(3, 2, 4, 8, generator=g,
                                                                                         dtype=torch.float64))
    with torch.no_grad():
        mix.w2.weight.normal_(generator=g)
        mix.w2.bias.normal_(generator=g)
    hidden = torch.nn.functional.gelu(x @ mix.w1.weight.t())
    w = (hidden @ mix.w2.weight.t() + mix.w2.bias).view(2, 4, 2, 3) * 0.2 / math.sqrt(3)
    for way, out in enumerate(mix(x, sources)):
        want = sum(w[..., way, k, None] * sources[k] for k in range(3))
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_dense_last_mixes_earlier_streams_into_the_last_two_blocks_and_the_last_values():
    """dense_last: after block L-2 (h), the stream is h + mix0 way 1 of (x0, block backout_layer's output, h) and the
    last block's attention adds 1.15 x way 0 to its values; after block L-1 (y), y + mix1 of (x0, h). From zero
    W2 and b the model is the one without it."""
    parts = dict(n_layers=5, n_kv_heads=4)
    model, without = small_model(**parts, dense_last=True), small_model(**parts)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        without.load_state_dict(model.state_dict(), strict=False)
        torch.testing.assert_close(model(idx), without(idx), rtol=0, atol=0)
        for name, p in model.named_parameters():
            if name.startswith("dense."):
                p.normal_(0.0, 0.5)
    seen = {}
    model.stream.register_forward_hook(lambda m, args, out: seen.__setitem__("x0", out))
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, out))
        block.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(f"in{i}", args[0]))
    model.blocks[4].attn.register_forward_pre_hook(lambda m, args: seen.__setitem__("v_add", args[4]))
    model.norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("final", args[0]))
    with torch.no_grad():
        model(idx)
        x0, back, h, y = seen["x0"], seen[model.cfg.backout_layer], seen[3], seen[4]
        v_add, into = model.dense[0](h, [x0, back, h])
        torch.testing.assert_close(seen["in4"], h + into, rtol=0, atol=1e-12)
        torch.testing.assert_close(seen["v_add"], 1.15 * v_add, rtol=0, atol=1e-12)
        torch.testing.assert_close(seen["final"], y + model.dense[1](y, [x0, h])[0], rtol=0, atol=1e-12)
    assert model.cfg.backout_layer == 2 and sum(p.numel() for p in model.parameters()) == FL.param_count(model.cfg)


@pytest.mark.parametrize("values, message", [
    (dict(n_layers=3), r"^model\.dense_last mixes block 1's output \(2/3 depth\) into the last two blocks', so it needs "
                       r"at least 4 layers; model\.n_layers=3: add layers or turn it off$"),
    (dict(n_layers=4, skip_attn_layer=3), r"^model\.dense_last adds to the last block's values, but model\.skip_attn_layer=3"),
    (dict(n_layers=4, n_kv_heads=2), r"^model\.dense_last needs a kv head per query head: set n_kv_heads = n_heads = 4$"),
])
def test_dense_last_is_refused_where_its_sources_or_its_values_are_missing(values, message):
    with pytest.raises(ValueError, match=message):
        M.ModelConfig(**{**SMALL, "n_kv_heads": 4, "dense_last": True, **values})
