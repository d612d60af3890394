import math
import time

import numpy as np
import pytest
import torch

import model as M

SMALL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, context=32)


def small_model(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    return M.Llama(M.ModelConfig(**{**SMALL, **overrides})).to(dtype).eval()


# --- Exact parameter and FLOP counts (seed 002's table, LLaMA-2 7B) -------------------------

@pytest.mark.parametrize("name, params", [("22m", 22_025_088), ("47m", 47_195_712),
                                          ("88m", 88_096_512), ("126m", 125_854_464)])
def test_preset_parameter_counts(name, params):
    cfg = M.preset(name)
    assert cfg.head_dim == 64 and cfg.vocab_size == 32768 and cfg.context == 1024
    assert cfg.ffn_hidden == M.swiglu_hidden(cfg.d_model)
    with torch.device("meta"):
        model = M.Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    assert M.param_count(cfg) == params


def test_llama2_7b_on_meta_device_is_exact_and_fast():
    cfg = M.ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                        ffn_hidden=11008, tie_embeddings=False, context=4096)
    assert M.swiglu_hidden(4096) == 11008  # Llama's rounding gives its published width
    start = time.perf_counter()
    with torch.device("meta"):
        model = M.Llama(cfg)
    elapsed = time.perf_counter() - start
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616
    assert M.param_count(cfg) == 6_738_415_616
    assert elapsed < 1.0, f"building 7B shapes on meta took {elapsed:.2f} s"


def test_flops_per_token_88m():
    assert M.flops_per_token(M.preset("88m")) == 622_950_912  # seed 000: 6N + 12*L*H*Q*T
    assert M.mfu(29_408, 622_950_912, 25.3e12) == pytest.approx(0.724, abs=1e-3)  # seed 000's 72.4%


def test_budget_matches_seed_002():
    b = M.budget("88m", 88_096_512, 29_508)
    assert b.tokens == 1_761_930_240 and f"{b.flops:.1e}" == "9.3e+17"
    assert round(b.hours, 1) == 16.6 and round(b.tokens_per_param_8h) == 10 and round(b.tokens_per_param_48h) == 58


def test_memory_estimate():
    # 16 bytes per parameter for 88m is 1.31 GiB; plus 16 sequences at 0.33 GiB each.
    assert M.memory_estimate_gib(M.preset("88m"), 16, 0.33) == pytest.approx(1.3127 + 5.28, abs=1e-3)


# --- One block against an independent NumPy float64 reference --------------------------------

def numpy_block(x, w, n_heads, n_kv_heads, theta, eps):
    """Llama block written from the papers, in NumPy float64. x: (T, d)."""
    T, d = x.shape
    hd = d // n_heads

    def rmsnorm(v, g):
        return v / np.sqrt((v ** 2).mean(-1, keepdims=True) + eps) * g

    def rope(v):  # v: (heads, T, hd); rotate dimension i with i + hd/2 by angle pos * theta^(-2i/hd)
        freqs = theta ** (-np.arange(0, hd, 2) / hd)
        ang = np.arange(T)[:, None] * freqs[None, :]
        c, s = np.cos(ang), np.sin(ang)
        a, b = v[..., :hd // 2], v[..., hd // 2:]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    h = rmsnorm(x, w["attn_norm"])
    q = (h @ w["wq"].T).reshape(T, n_heads, hd).transpose(1, 0, 2)
    k = (h @ w["wk"].T).reshape(T, n_kv_heads, hd).transpose(1, 0, 2)
    v = (h @ w["wv"].T).reshape(T, n_kv_heads, hd).transpose(1, 0, 2)
    q, k = rope(q), rope(k)
    group = n_heads // n_kv_heads
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = (p @ v).transpose(1, 0, 2).reshape(T, d)
    x = x + attn @ w["wo"].T
    h = rmsnorm(x, w["mlp_norm"])
    g, u = h @ w["w1"].T, h @ w["w3"].T
    return x + ((g / (1 + np.exp(-g))) * u) @ w["w2"].T


def test_block_matches_numpy_float64():
    cfg = M.ModelConfig(**SMALL)
    model = small_model()
    block = model.blocks[0]
    with torch.no_grad():  # non-trivial norm gains, so the test sees them
        block.attn_norm.weight.uniform_(0.5, 1.5)
        block.mlp_norm.weight.uniform_(0.5, 1.5)
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    wqkv = block.attn.wqkv.weight.detach().numpy()
    w13 = block.mlp.w13.weight.detach().numpy()
    w = {"wq": wqkv[:d], "wk": wqkv[d:d + kv], "wv": wqkv[d + kv:], "wo": block.attn.wo.weight.detach().numpy(),
         "w1": w13[:cfg.ffn_hidden], "w3": w13[cfg.ffn_hidden:], "w2": block.mlp.w2.weight.detach().numpy(),
         "attn_norm": block.attn_norm.weight.detach().numpy(), "mlp_norm": block.mlp_norm.weight.detach().numpy()}
    x = np.random.default_rng(0).standard_normal((20, d))
    ref = numpy_block(x, w, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps)
    T = x.shape[0]
    with torch.no_grad():
        out = block(torch.from_numpy(x)[None], model.cos[:T], model.sin[:T])[0].numpy()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-10


# --- Properties ----------------------------------------------------------------------------

def test_rope_scores_depend_only_on_offset():
    cos, sin = M.rope_tables(64, 32, 10000.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64)

    def score(qpos, kpos):
        return (M.apply_rope(q, cos[qpos], sin[qpos]) * M.apply_rope(k, cos[kpos], sin[kpos])).sum().item()

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
    native = M.attention(q, k, v)
    copied = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True)
    torch.testing.assert_close(native, copied, rtol=1e-12, atol=1e-12)


def test_kv_cache_decode_equals_full_forward():
    model = small_model()
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(idx)
        cache = M.KVCache(model.cfg, batch=2, device="cpu", dtype=torch.float64)
        steps = [model(idx[:, :7], cache=cache)]  # a prompt,
        steps += [model(idx[:, 7:12], cache=cache)]  # a chunk after cached tokens (offset mask),
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(12, 20)]  # then one at a time
    assert cache.k[0].shape == (2, 2, 32, 16)  # sized for the 2 kv heads, not the 4 query heads
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-9


def test_loss_at_init_is_near_ln_vocab():
    torch.manual_seed(0)
    model = M.Llama(M.preset("tiny"))
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


def test_config_file_unknown_key_and_wrong_type(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nd_model = 64\nn_layer = 2\n")
    with pytest.raises(ValueError, match=r"bad\.toml: unknown key\(s\) model\.n_layer; valid keys .* n_layers"):
        M.from_dict(M.ModelConfig, M.read_toml(path, ("model",))["model"], str(path), "model")
    path.write_text("[model]\nd_model = \"wide\"\n")
    with pytest.raises(ValueError, match=r"model\.d_model must be int, got str 'wide'"):
        M.from_dict(M.ModelConfig, M.read_toml(path, ("model",))["model"], str(path), "model")
    path.write_text("[modle]\nd_model = 64\n")
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['modle'\]"):
        M.read_toml(path, ("model",))


def test_budget_command_prints_table(capsys):
    M.main(["--budget", "--tok-s", "88m=29408"])
    out = capsys.readouterr().out
    assert "| 88m | 88,096,512 | 29,408 | 1.76B | 9.3e+17 | 16.6 |" in out
    with pytest.raises(SystemExit, match="expected PRESET=TOKENS_PER_S"):
        M.main(["--budget", "--tok-s", "99m=5"])
