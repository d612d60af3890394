"""onegpu's model inside transformers: what `export.py` ships beside the weights when no stock class computes them.

    model = AutoModelForCausalLM.from_pretrained("exported/run", trust_remote_code=True)

The folder holds this file, and model.py, attention.py and model_checks.py exactly as onegpu trains with them but
for two lines (model.py reads the other two as files of the same package: `from . import attention as A`, `from
.model_checks import check_config`). So the model
transformers runs is onegpu's own `model.Llama`, every recipe setting included; this file only adapts it:
  - OnegpuConfig carries the checkpoint's ModelConfig (`onegpu` in config.json) and the few names transformers'
    tools read (hidden_size, num_hidden_layers, ...), derived from it;
  - OnegpuForCausalLM holds the Llama as `model` and, while `generate()` runs, lends each attention layer one
    layer of transformers' own cache (CacheLayer), where onegpu's sampler gives it a preallocated KVCache (and,
    with the bigram table, the tokens that cache holds: TokenHistory).
This file is never imported by onegpu itself: as a file of a package (the export folder) it imports its
neighbours relatively.
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention import cache_masks
from .model import Llama, ModelConfig


class OnegpuConfig(PretrainedConfig):
    model_type = "onegpu"

    def __init__(self, onegpu: dict | None = None, **kwargs):
        self.onegpu = dict(onegpu or {})  # ModelConfig's fields as the checkpoint saved them
        cfg = ModelConfig(**self.onegpu)
        # Read by transformers' cache and by tools (lm-evaluation-harness reads the context from
        # max_position_embeddings); the model itself reads only `onegpu`.
        self.vocab_size, self.hidden_size, self.num_hidden_layers = cfg.vocab_size, cfg.d_model, cfg.n_layers
        self.num_attention_heads, self.num_key_value_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim, self.max_position_embeddings = cfg.head_dim, cfg.context
        kwargs["tie_word_embeddings"] = False  # a tied head is the embedding itself inside Llama: nothing to tie
        super().__init__(**kwargs)


class CacheLayer:
    """Stands where attention.KVCache stands while transformers generates: update(pos, k, v) appends the new keys
    and values (B, Hkv, T, hd) to one layer of transformers' cache and returns that layer's keys and values so
    far, (B, Hkv, S, hd), which the model's attention reads through cache_masks' (T, S) mask."""

    def __init__(self, cache, layer: int):
        self.cache, self.layer = cache, layer

    def update(self, pos, k, v):
        return self.cache.update(k, v, self.layer)


class TokenHistory:
    """Stands where attention.TokenCache stands while transformers generates (a model whose bigram table or smear reads
    each token's predecessor): every token so far, (B, S). generate() hands them over as seen_ids, in the order of its
    sequences (a beam search reorders them); a caller of forward() with a cache of its own has them kept with it,
    update(pos, idx) appending idx (B, T)."""

    def __init__(self, seen=None):
        self.ids, self.given = seen, seen is not None

    def update(self, pos, idx):
        if not self.given:
            self.ids = idx if self.ids is None else torch.cat([self.ids, idx], dim=1)
        return self.ids


class OnegpuForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = OnegpuConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def __init__(self, config: OnegpuConfig):
        super().__init__(config)
        self.model = Llama(ModelConfig(**config.onegpu))
        self.post_init()

    def _init_weights(self, module):
        """The weights come from the checkpoint; the RoPE tables and the bigram signs are buffers that follow from the
        config, so they are computed again here wherever transformers built the model without values (on "meta")."""
        if isinstance(module, Llama):
            module.set_tables()

    def get_input_embeddings(self):
        return self.model.embed

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        """transformers' own inputs, and every token so far as seen_ids (TokenHistory)."""
        return {**super().prepare_inputs_for_generation(input_ids, **kwargs), "seen_ids": input_ids}

    def forward(self, input_ids, attention_mask=None, cache=None, past_key_values=None, labels=None,
                use_cache=None, seen_ids=None, **kwargs):
        """input_ids (B, T) -> logits (B, T, vocab), as model.Llama computes them. With a cache (transformers
        names it `cache` from 5.x's later releases, `past_key_values` before) the tokens follow the ones it
        holds; labels (B, T) add the mean cross-entropy of each token's prediction of the next."""
        cache = cache if cache is not None else past_key_values
        check_padding(attention_mask)
        if cache is None and use_cache and not self.training:
            cache = DynamicCache(config=self.config)
        logits = self.model(input_ids) if cache is None else self.cached_logits(input_ids, cache, seen_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        names = CausalLMOutputWithPast.__dataclass_fields__
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      **{"cache" if "cache" in names else "past_key_values": cache})

    def cached_logits(self, input_ids, cache, seen_ids=None):
        """The model's cached forward: new tokens at positions past..past+T-1 read the cache's keys and values
        (CacheLayer lent to each attention layer for this call)."""
        cfg, T = self.model.cfg, input_ids.shape[1]
        past = cache.get_seq_length(0)
        if past + T > cfg.context:
            raise ValueError(f"{past + T} tokens is longer than this model's context of {cfg.context}: "
                             f"generate at most {cfg.context - past} more (max_new_tokens)")
        attentions = self.model.attentions()
        for layer, attn in enumerate(attentions):
            attn.cache = CacheLayer(cache, layer)
        if self.model.reads_previous:  # the tokens so far, for each new token's predecessor
            self.model.history = (TokenHistory(seen_ids) if seen_ids is not None
                                  else cache.__dict__.setdefault("onegpu_tokens", TokenHistory()))
        try:
            pos = torch.arange(past, past + T, device=input_ids.device)
            return self.model(input_ids, masks=cache_masks(pos, past + T, cfg.windows()))
        finally:
            for attn in attentions:
                attn.cache = None
            self.model.history = None


def check_padding(attention_mask):
    """Refuse left padding: the model attends to every earlier position, so a pad before a token would be
    read. Padding after the tokens (a 0 after the last 1 of a row) changes no real token's logits."""
    if attention_mask is None:
        return
    ones_after = attention_mask.long().flip(-1).cumsum(-1).flip(-1)  # (B, T): real tokens at or after each position
    if bool(((attention_mask == 0) & (ones_after > 0)).any()):
        raise ValueError("attention_mask pads a row before or between its tokens: this model has no padding mask; "
                         "pad on the right (tokenizer.padding_side = 'right') or pass one sequence at a time")
