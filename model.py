"""A Llama-style decoder and the arithmetic around it: parameters, FLOPs, memory, budget.

Read top to bottom: ModelConfig, the strict config-file loader every script shares,
the layers (RMSNorm, RoPE, attention, SwiGLU, block), the model with its KV cache,
then the closed-form arithmetic and a small command that prints a training budget:

    python model.py --budget --tok-s 88m=29408

This file imports nothing else of the project.
"""

import argparse
import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    d_model: int = 768  # width of the residual stream
    n_layers: int = 10  # transformer blocks
    n_heads: int = 12  # query heads
    n_kv_heads: int = 4  # key/value heads, shared by n_heads // n_kv_heads query heads (GQA)
    ffn_hidden: int = 0  # SwiGLU width; 0 means 8/3 * d_model rounded up to a multiple of 256
    vocab_size: int = 32768  # 2**15: every token id fits a uint16 shard
    context: int = 1024  # longest sequence the model attends over
    tie_embeddings: bool = True  # output head shares the token-embedding matrix
    rope_theta: float = 10000.0  # RoPE base (Su et al. 2021; Llama 2 uses 10,000)
    norm_eps: float = 1e-5  # RMSNorm epsilon (Llama 2's value)

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                f"pick n_heads that divides d_model (head size 64 means n_heads = d_model / 64)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}: "
                f"each kv head serves a whole group of query heads, so pick a divisor of n_heads")
        if self.head_dim % 2:
            raise ValueError(
                f"head size d_model/n_heads = {self.head_dim} is odd, but RoPE rotates pairs of "
                f"dimensions: change model.d_model or model.n_heads so that the head size is even")
        if self.ffn_hidden < 0:
            raise ValueError(f"model.ffn_hidden must be >= 0 (0 means automatic), got {self.ffn_hidden}")
        if self.ffn_hidden == 0:
            self.ffn_hidden = swiglu_hidden(self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def swiglu_hidden(d: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4d (three matrices cost what two of width 4d do), rounded up."""
    hidden = int(8 * d / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


# --- Config files --------------------------------------------------------------------------
# Configs are TOML data loaded into dataclasses. A typo must never pass silently, so unknown
# keys and wrong types are errors naming the key, the file and what is allowed.

def field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _check_type(value, kind, where: str):
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # TOML writes 3 for 3.0; accept it
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        kind = next(t for t in options if t is not type(None))
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise ValueError(f"{where} must be {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls, values: dict, source: str, section: str):
    """Build dataclass `cls` from a dict, refusing unknown keys and wrong types."""
    types_ = field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ValueError(
            f"{source}: unknown key(s) {', '.join(section + '.' + k for k in unknown)}; "
            f"valid keys in [{section}] are: {', '.join(types_)}")
    checked = {k: _check_type(v, types_[k], f"{source}: {section}.{k}") for k, v in values.items()}
    return cls(**checked)


def read_toml(path: str | Path, sections: tuple[str, ...]) -> dict:
    """Read a config file; only the named [sections] may appear in it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist (presets live in configs/)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    extra = sorted(set(data) - set(sections))
    if extra:
        raise ValueError(f"{path}: unknown section(s) {extra}; valid sections are {list(sections)}")
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {name} must be a [{name}] table, got {table!r}")
    return data


PRESETS_DIR = Path(__file__).resolve().parent / "configs"


def preset(name: str) -> ModelConfig:
    """The [model] section of configs/<name>.toml."""
    path = PRESETS_DIR / f"{name}.toml"
    return from_dict(ModelConfig, read_toml(path, ("model", "data", "train")).get("model", {}),
                     str(path), "model")


# --- Layers --------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x / rms(x) * g (Zhang & Sennrich 2019): no mean, no bias. Computed in at least float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, length: int, theta: float):
    """cos and sin, each (length, head_dim), in the "rotate half" layout HuggingFace Llama uses,
    so exported q/k weights need no permutation. Frequencies from Su et al. (2021)."""
    # Computed on the CPU in float64 whatever the default device: exact, and cheap on "meta".
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), inv_freq)  # (length, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (B, heads, T, head_dim); cos, sin: (T, head_dim). Rotates pairs (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(q, k, v, *, doc_ids=None, block_mask=None, offset: int = 0):
    """Causal attention, the one place the kernel is chosen.

    q: (B, H, Tq, hd); k, v: (B, Hkv, Tk, hd) with H a multiple of Hkv (grouped-query heads are
    passed natively: no copies of K/V). doc_ids: (B, T) document index per token, to keep packed
    documents from attending into each other. block_mask: FlexAttention's mask for doc_ids,
    built once per micro-batch on CUDA. offset: position of q's first token when k holds a cache.
    """
    if block_mask is not None:
        return flex_attention_compiled()(q, k, v, block_mask=block_mask, enable_gqa=True)
    Tq, Tk = q.shape[2], k.shape[2]
    if doc_ids is not None:
        mask = doc_mask(doc_ids)[:, None]  # (B, 1, T, T): same document and not in the future
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if Tq == 1:  # one new token attends to everything cached
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    causal = torch.arange(Tk, device=q.device)[None, :] <= torch.arange(offset, offset + Tq, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)


def doc_mask(doc_ids):
    """(B, T) document ids -> (B, T, T) boolean: query i may see key j iff j <= i, same document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal


_flex = None


def flex_attention_compiled():
    # FlexAttention only becomes a fused kernel when compiled; compile it once per process.
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def flex_block_mask(doc_ids):
    """FlexAttention block mask for causal attention within documents. doc_ids: (B, T) on CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = doc_ids.shape

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(same_doc_causal, B, None, T, T, device=doc_ids.device)


class KVCache:
    """Keys and values of past tokens for generation, sized for the kv heads (not the query
    heads): (batch, n_kv_heads, context, head_dim) per layer."""

    def __init__(self, cfg: ModelConfig, batch: int, device, dtype):
        shape = (batch, cfg.n_kv_heads, cfg.context, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.length = 0  # tokens stored so far

    def update(self, layer: int, k, v):
        """Store k, v (B, Hkv, T, hd) at the current position; return everything cached so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one larger GEMM keeps the tensor cores busier than three.
        self.wqkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, doc_ids=None, block_mask=None, cache=None):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim,
                                      self.n_kv_heads * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin).type_as(v), apply_rope(k, cos, sin).type_as(v)
        offset = 0
        if cache is not None:
            offset = cache.length
            k, v = cache.update(self.layer, k, v)
        y = attention(q, k, v, doc_ids=doc_ids, block_mask=block_mask, offset=offset)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """(silu(x W1) * x W3) W2 (Shazeer 2020), with W1 and W3 stacked into one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, doc_ids=None, block_mask=None, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, doc_ids, block_mask, cache)
        return x + self.mlp(self.mlp_norm(x))


# --- The model -----------------------------------------------------------------------------

class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # An empty weight skips nn.Embedding's own init (reset_parameters below sets it), which on
        # the meta device would import torch.compile's machinery and cost a second.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_theta)
        # Buffers, not parameters; not saved in checkpoints (they follow from the config). Kept in
        # float64 and cast to the activations' dtype when used, so a float64 model is exact.
        device = self.embed.weight.device
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.activation_checkpointing = False
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2's init, as nanoGPT and llm.c use it: every matrix normal with std 0.02, and the
        two projections that write into the residual stream (wo, w2) scaled by 1/sqrt(2 * layers),
        so the stream's variance does not grow with depth. Norm gains start at one."""
        for name, p in self.named_parameters():
            if p.is_meta:  # shapes only (counting a 7B model): there are no values to set
                continue
            if p.dim() == 2:
                std = 0.02
                if name.endswith(("attn.wo.weight", "mlp.w2.weight")):
                    std /= math.sqrt(2 * self.cfg.n_layers)
                nn.init.normal_(p, mean=0.0, std=std)
            else:
                nn.init.ones_(p)

    def output_weight(self):
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, idx, targets=None, doc_ids=None, block_mask=None, cache=None):
        """idx: (B, T) token ids. Returns logits (B, T, vocab) or, given targets (B, T), the mean
        cross-entropy. doc_ids (B, T) restrict attention to each packed document. cache: a
        KVCache; idx is then the tokens after those already cached."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.context:
            raise ValueError(
                f"sequence of {start + T} tokens is longer than model.context={self.cfg.context}: "
                f"cut the input to the last {self.cfg.context} tokens or train with a longer context")
        x = self.embed(idx)
        cos, sin = self.cos[start:start + T].to(x.dtype), self.sin[start:start + T].to(x.dtype)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, doc_ids, block_mask,
                                                      use_reentrant=False)
            else:
                x = block(x, cos, sin, doc_ids, block_mask, cache)
        if cache is not None:
            cache.length += T
        x = self.norm(x)
        logits = F.linear(x, self.output_weight())
        if targets is None:
            return logits
        # Softmax in float32: bf16 logits lose about three digits of the loss.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def sample_next(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator=None):
    """One token per row from logits (B, vocab). temperature 0 is greedy; top_k keeps the k most
    likely tokens, top_p the smallest set whose probability reaches p (nucleus sampling)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keeps the token that crosses p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


@torch.no_grad()
def generate(model: "Llama", idx, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, generator=None, use_cache: bool = True):
    """Yield (B, 1) new tokens one at a time after the prompt idx (B, T). With the cache, the
    prompt is read once and each step feeds one token; without it, every step re-reads the
    whole sequence (the slow reference). Stops at the context length."""
    cfg = model.cfg
    max_new_tokens = min(max_new_tokens, cfg.context - idx.shape[1])
    if use_cache:
        dtype = model.embed.weight.dtype
        if torch.is_autocast_enabled(idx.device.type):  # keys and values come out of autocast's matmuls
            dtype = torch.get_autocast_dtype(idx.device.type)
        cache = KVCache(cfg, idx.shape[0], idx.device, dtype)
        logits = model(idx, cache=cache)[:, -1]
    for i in range(max_new_tokens):
        if not use_cache:
            logits = model(idx)[:, -1]
        token = sample_next(logits, temperature, top_k, top_p, generator)
        yield token
        if i + 1 == max_new_tokens:
            return
        if use_cache:
            logits = model(token, cache=cache)[:, -1]
        else:
            idx = torch.cat([idx, token], dim=1)


def from_checkpoint(ckpt: dict) -> "Llama":
    """The model saved in a training checkpoint (train.py writes "config" and "model")."""
    cfg = ModelConfig(**ckpt["config"]["model"])
    model = Llama(cfg)
    model.load_state_dict(ckpt["model"], strict=True)
    return model


# --- Arithmetic ----------------------------------------------------------------------------

def param_count(cfg: ModelConfig) -> int:
    """Parameters in closed form from the shapes (equals counting the module's tensors)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    attn = d * (d + 2 * kv) + d * d  # wqkv, wo
    mlp = 3 * d * cfg.ffn_hidden  # w1, w3, w2
    block = attn + mlp + 2 * d  # two RMSNorm gains
    embed = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return embed + cfg.n_layers * block + d + head


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token, PaLM appendix B: 6N for the weights (2 forward, 4 backward) plus
    12 * L * H * Q * T for attention's two weightless matmuls (the full T x T square, as PaLM
    counts it, masked half included)."""
    T = cfg.context if seq_len is None else seq_len
    return 6 * param_count(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilization: useful FLOP/s over the peak (a fraction, not a percent)."""
    return tokens_per_s * flops_per_tok / peak_flops


def memory_estimate_gib(cfg: ModelConfig, micro_batch: int, act_gib_per_seq: float) -> float:
    """GiB of GPU memory for training: 16 bytes per parameter (FP32 weights, gradients and the two
    AdamW moments) plus activations, which grow linearly with the sequences in a micro-batch.
    act_gib_per_seq is a measured slope (bench.py --micro-batch prints it; seed 002 measured
    about 0.33 GiB per 1,024-token sequence for 88m with BF16 and torch.compile)."""
    return 16 * param_count(cfg) / 2**30 + micro_batch * act_gib_per_seq


@dataclass
class Budget:
    name: str
    params: int
    tokens: int  # D = 20 N (Chinchilla, Hoffmann et al. 2022, Table 3)
    flops: float  # C = 6 N D
    hours: float
    tokens_per_param_8h: float
    tokens_per_param_48h: float


def budget(name: str, params: int, tokens_per_s: float) -> Budget:
    D = 20 * params
    return Budget(name, params, D, 6.0 * params * D, D / tokens_per_s / 3600,
                  tokens_per_s * 8 * 3600 / params, tokens_per_s * 48 * 3600 / params)


def budget_table(rates: dict[str, float]) -> str:
    lines = ["| preset | params | tok/s | D = 20N | C = 6ND | hours | tok/param in 8 h | in 48 h |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, tok_s in rates.items():
        b = budget(name, param_count(preset(name)), tok_s)
        lines.append(f"| {name} | {b.params:,} | {tok_s:,.0f} | {b.tokens / 1e9:.2f}B | {b.flops:.1e} "
                     f"| {b.hours:.1f} | {b.tokens_per_param_8h:.0f} | {b.tokens_per_param_48h:.0f} |")
    return "\n".join(lines)


# Seed 002's measured short-run rates on an 8 GB RTX 4060 Laptop GPU (tokens/s).
LAPTOP_TOK_S = {"22m": 103_618, "47m": 49_459, "88m": 29_508, "126m": 19_096}


def parse_rates(items: list[str]) -> dict[str, float]:
    rates = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not (PRESETS_DIR / f"{name}.toml").is_file():
            raise SystemExit(f"--tok-s {item!r}: expected PRESET=TOKENS_PER_S with a preset from configs/, "
                             f"e.g. 88m=29408")
        try:
            rates[name] = float(value)
        except ValueError:
            raise SystemExit(f"--tok-s {item!r}: {value!r} is not a number of tokens per second") from None
    return rates


def main(argv=None):
    parser = argparse.ArgumentParser(description="Model arithmetic: parameters, FLOPs and the Chinchilla budget.")
    parser.add_argument("--budget", action="store_true", help="print the training budget table")
    parser.add_argument("--tok-s", nargs="+", default=[], metavar="PRESET=TOK_S",
                        help="measured tokens/s per preset (default: seed 002's RTX 4060 Laptop rates)")
    args = parser.parse_args(argv)
    print("| preset | d | layers | heads | kv heads | SwiGLU | params | FLOPs/token (T=context) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("tiny", "22m", "47m", "88m", "126m"):
        c = preset(name)
        print(f"| {name} | {c.d_model} | {c.n_layers} | {c.n_heads} | {c.n_kv_heads} | {c.ffn_hidden} "
              f"| {param_count(c):,} | {flops_per_token(c):,} |")
    if args.budget:
        print()
        print(budget_table(parse_rates(args.tok_s) if args.tok_s else LAPTOP_TOK_S))


if __name__ == "__main__":
    main()
