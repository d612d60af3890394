"""ModelConfig's checks: each value in range and the fields consistent with one another, every refusal one line
naming the field, what is wrong and how to fix it. model.py's ModelConfig runs them when it is built (from a
config file, a checkpoint or by hand), so a model never starts from a config these refuse; they live here, apart
from the model, because a reader of what the model computes does not need them."""

import math

# The parts that act on another setting, refused without it: (part, what it needs, why).
PART_NEEDS = (("key_offset", "rope_truncate", "it moves the dims truncated RoPE leaves unrotated"),
              ("value_gate", "value_embeds", "it gates the value embeddings"),
              ("bigram_signs", "bigram_rows", "it signs the bigram table's rows"),
              ("paired_heads", "short_windows", "it pairs the heads of every other short layer"),
              ("rope_yarn", "attn_window", "it stretches RoPE as the window grows"),
              ("logit_shift", "logit_softcap", "it shifts the logits inside the soft-cap"),
              ("logit_temperature", "logit_softcap", "it widens the soft-cap"))
# The fields where 0 means something other than a size, with what it means.
ZERO_MEANS = (("ffn_hidden", "0: automatic"), ("logit_softcap", "0: off"), ("attn_scale", "0: 1/sqrt(head size)"),
              ("logit_temperature", "0: the cap"), ("mimetic_init", "0: off"),
              ("attn_window", "0: attend over the whole context"), ("rope_yarn", "0: off"))


def check_config(cfg, gate_channels: int):
    """Raise ValueError for the first thing wrong with `cfg` (a model.ModelConfig); `gate_channels` is how many
    channels of the input the gates read."""
    check_numbers(cfg)
    check_heads(cfg)
    check_parts(cfg, gate_channels)
    for part, needs, why in PART_NEEDS:
        if getattr(cfg, part) and not getattr(cfg, needs):
            off = f"--no-{part}" if getattr(cfg, part) is True else f"--{part} 0"
            raise ValueError(f"model.{part} needs model.{needs}: {why}; set it or use {off.replace('_', '-')}")
    if cfg.mlp not in ("swiglu", "relu2"):
        raise ValueError(f"model.mlp={cfg.mlp!r}: choose swiglu or relu2")


def check_numbers(cfg):
    """Each number finite and in its range (NaN and inf pass a "< 0" test, so they are refused first)."""
    for name in ("rope_theta", "norm_eps", "logit_softcap", "logit_shift", "logit_temperature", "attn_scale",
                 "mimetic_init"):
        if not math.isfinite(getattr(cfg, name)):
            raise ValueError(f"model.{name}={getattr(cfg, name)!r} is not a finite number: give a real number")
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "context", "rope_theta", "norm_eps"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"model.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.vocab_size > 2**16:  # onegpu's corpora are uint16 shards (data.py): a larger id would wrap
        raise ValueError(f"model.vocab_size={cfg.vocab_size} is more than 65,536, the most a uint16 token shard "
                         f"holds: pick a vocabulary of at most 65,536 (2**15 = 32,768 is the presets')")
    for name, zero in ZERO_MEANS:
        if getattr(cfg, name) < 0:
            raise ValueError(f"model.{name} must be >= 0 ({zero}), got {getattr(cfg, name)}")
    if cfg.bigram_rows == 1 or cfg.bigram_rows < 0:
        raise ValueError(f"model.bigram_rows={cfg.bigram_rows}: give 0 (no bigram table) or at least 2 rows")


def check_heads(cfg):
    """The heads divide the width and one another, and the parts that need a kv head per query head have one."""
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}: "
                         f"pick n_heads that divides d_model (head size 64 means n_heads = d_model / 64)")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"model.n_heads={cfg.n_heads} is not a multiple of model.n_kv_heads={cfg.n_kv_heads}: "
                         f"each kv head serves a whole group of query heads, so pick a divisor of n_heads")
    if cfg.head_dim % 2:
        raise ValueError(f"head size d_model/n_heads = {cfg.head_dim} is odd, but RoPE rotates pairs of "
                         f"dimensions: change model.d_model or model.n_heads so that the head size is even")
    # a value map per head; a pair of heads reads its own keys; dense_last adds a (B, T, d) mix to the values
    for part in ("mimetic_init", "paired_heads", "dense_last"):
        if getattr(cfg, part) and cfg.n_kv_heads != cfg.n_heads:
            raise ValueError(f"model.{part} needs a kv head per query head: set n_kv_heads = n_heads = {cfg.n_heads}")
    if cfg.paired_heads and cfg.n_heads % 2:
        raise ValueError(f"model.paired_heads pairs the heads, but model.n_heads={cfg.n_heads} is odd: make it even")


def check_parts(cfg, gate_channels: int):
    """The layers a part names exist and can take it."""
    if not 0 <= cfg.value_embeds <= cfg.n_layers // 2:
        raise ValueError(f"model.value_embeds={cfg.value_embeds}: the first and the last value_embeds layers each "
                         f"take one table, so it must be in [0, n_layers/2 = {cfg.n_layers // 2}]")
    if (cfg.attn_gate or cfg.smear or cfg.value_gate) and cfg.d_model < gate_channels:
        raise ValueError(f"model.attn_gate, smear and value_gate read {gate_channels} channels, more than d_model="
                         f"{cfg.d_model}: turn them off or use a wider model")
    if cfg.short_windows and not cfg.windowed:
        raise ValueError(f"model.short_windows halves model.attn_window on most layers, but attn_window="
                         f"{cfg.attn_window} hides nothing in a context of {cfg.context}: set attn_window "
                         f"below the context, or --no-short-windows")
    if cfg.skip_attn_layer != -1 and not 0 < cfg.skip_attn_layer < cfg.n_layers:
        raise ValueError(f"model.skip_attn_layer={cfg.skip_attn_layer} is not a layer after the first of "
                         f"{cfg.n_layers}: pick one in [1, {cfg.n_layers - 1}] (modded-nanogpt: 7 of 12), or -1 for none")
    if cfg.dense_last and cfg.backout_layer >= cfg.n_layers - 2:
        raise ValueError(f"model.dense_last mixes block {cfg.backout_layer}'s output (2/3 depth) into the last two "
                         f"blocks', so it needs at least 4 layers; model.n_layers={cfg.n_layers}: add layers or turn it off")
    if cfg.dense_last and not cfg.attends(cfg.n_layers - 1):
        raise ValueError(f"model.dense_last adds to the last block's values, but model.skip_attn_layer="
                         f"{cfg.skip_attn_layer} is that block: pick another layer to skip, or turn dense_last off")
    if cfg.skip_attn_layer != -1 and cfg.value_table(cfg.skip_attn_layer) is not None:
        raise ValueError(f"model.skip_attn_layer={cfg.skip_attn_layer} is a layer that mixes a value embedding "
                         f"into its attention (model.value_embeds={cfg.value_embeds}): pick a middle layer")
