"""The model's arithmetic: its parameters in closed form, its training FLOPs per token, and MFU. Pure functions of a
model.ModelConfig; train.py's meter, bench.py and the recipes read them (tests/test_model.py checks them against the
built module)."""

import model as M


def param_count(cfg: M.ModelConfig) -> int:
    """Parameters in closed form from the shapes (equals counting the module's tensors)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    gain = 1 if cfg.norm_gains else 0  # norm gains are parameters, or ones that no optimizer steps
    attn = d * (d + 2 * kv) + d * d + (2 * cfg.head_dim * gain if cfg.qk_norm else 0)  # wqkv, wo, q/k norm gains
    mlp = (2 if cfg.mlp == "relu2" else 3) * d * cfg.ffn_hidden  # w1, (w3,) w2
    attn += cfg.n_heads * M.GATE_CHANNELS if cfg.attn_gate else 0
    block = attn + mlp + 2 * d * gain + (2 if cfg.x0_mix else 0)  # two RMSNorm gains (and the x0 mix)
    attention_free = (attn + d * gain) * (cfg.skip_attn_layer != -1)  # skip_attn_layer's attention and its norm
    embed = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    value = cfg.value_embeds * (cfg.vocab_size * kv + 2 * 2)  # a table and two layers' (a, b) each
    value += cfg.value_embeds * 2 * M.GATE_CHANNELS * cfg.n_kv_heads if cfg.value_gate else 0  # and their gates
    if cfg.value_scale:  # every other layer with attention: its a
        value += sum(cfg.value_table(i) is None and cfg.attends(i) for i in range(cfg.n_layers))
    skips = cfg.n_layers // 2 if cfg.unet_skips else 0
    bigram = cfg.bigram_rows * d + cfg.n_layers if cfg.bigram_rows else 0  # the table and a layer's mix each
    smear = M.GATE_CHANNELS + 1 if cfg.smear else 0
    # dense_last: two DenseMix of 64 hidden, (3 sources, 2 ways) and (2, 1): W1, W2 and its bias each
    dense = sum(64 * d + (64 + 1) * n for n in (3 * 2, 2 * 1)) if cfg.dense_last else 0
    # xsa: a gate a head in each layer that attends unpaired
    xsa = cfg.n_heads * sum(cfg.attends(i) and not cfg.paired_layer(i) for i in range(cfg.n_layers)) if cfg.xsa else 0
    return (embed + cfg.n_layers * block - attention_free + d * gain + head + value + skips + bigram + cfg.backout + smear
            + dense + xsa)


def multiplied_params(cfg: M.ModelConfig) -> int:
    """The parameters that multiply the activations: all but the lookup tables (an untied input
    embedding, the value embeddings and the bigram table), which a token only indexes."""
    lookups = (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    lookups += cfg.value_embeds * cfg.vocab_size * cfg.n_kv_heads * cfg.head_dim + cfg.bigram_rows * cfg.d_model
    return param_count(cfg) - lookups


def flops_per_token(cfg: M.ModelConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token, PaLM appendix B: 6N for the weights that multiply (2 forward, 4 backward) plus
    12 * L * H * Q * T for attention's two weightless matmuls (the full T x T square, as PaLM counts it, masked half
    included). The lookup tables are not matmuls: they are left out of N (multiplied_params). A layer's sliding
    window of w keys counts as T = min(T, 2w); what a document mask hides is not known in advance and still counts.
    A paired layer (paired_heads) counts as the short layer it is: twice the queries at half the heads, each over the
    short window's count of keys."""
    T = cfg.context if seq_len is None else seq_len
    long, short = cfg.windows()[:2]
    reach = sum(min(T, 2 * w) if w else T
                for w in (short if cfg.short_layer(i) else long for i in range(cfg.n_layers) if cfg.attends(i)))
    return 6 * multiplied_params(cfg) + 12 * cfg.n_heads * cfg.head_dim * reach


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilization: useful FLOP/s over the peak (a fraction, not a percent)."""
    return tokens_per_s * flops_per_tok / peak_flops
