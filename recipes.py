"""Time to a good model: the recipe ladder that `python bench.py --recipes` runs.

A rung is a recipe: a config file from configs/ plus overrides that the config loader checks
(a misspelled setting fails before any process starts). Every rung trains with train.py in its
own process, on the same shards in the same order (the same seed orders the data), and is
evaluated on the same validation tokens at the same token counts. What is compared is the
validation loss against tokens and against training seconds: train.py's `train_seconds`,
which leaves out evaluation, checkpoints and the one-time compile (the first step of a run
counts at the second step's time).

The rungs, in the order they run:
  article  configs/<preset>-gpt3.toml: the recipe of the article this project started from
           (GPT-3's of 2020: AdamW, cosine to 10%, SwiGLU, tied head, clipping at 1.0), run once
           per seed. Its mean final loss is the target every other rung is timed to.
  sweep    the article's recipe at other AdamW learning rates and weight decays: the honest
           baseline, since a tuned AdamW closes part of any optimizer's gap (Wen et al. 2025).
  chain    one change at a time, each on top of the rung before it: warmup-stable-decay, Muon,
           ReLU², QK-norm with zero-initialised projections, an untied head, a logit soft-cap,
           no gradient clipping, a 262K-token batch.
  final    the article's recipe with every chain change that helped (below), once per seed.
           A chain rung "helped" when its final loss beat the rung before it, or matched it in
           less time (see helped). The spread between the article's seeds says which single-seed
           differences are claims; the final recipe against the article, once per seed each, is.

--versus skips the search: it runs the article and configs/<preset>.toml (the default
recipe), each once per seed. That is how a result is confirmed on a larger preset. With
--fractions it runs the default on shorter schedules instead, or as well (see versus_plan).
With --muon the other side is configs/<preset>-muon.toml, the default until 2026-12-02. A rung
that trains on something else than the article's 1,024-token windows (longer document-masked
sequences) holds as many tokens per micro-batch, and is timed to the target on plain
1,024-token windows: equal context.

--seconds S is the record ladder (record_plan): every rung trains for the same S training seconds,
its steps sized from its own measured speed (train.seconds), so a change that slows the step must
pay for it in loss. From configs/<preset>-muon.toml one record-holder idea is added per rung
(RECORD_CHAIN), ending at configs/<preset>.toml's recipe without the newest records' ideas (newest_off), which
then runs once per seed. Rows compare final losses at equal seconds, as each rung trains and on plain 1,024-token
windows.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

import config as C
import data as D
import fastpaths as FP
import flops as FL
import model as M
import plots as PL
import train as TR

ROOT = Path(__file__).resolve().parent
SEED = 1337  # TrainConfig's default: the first seed; further seeds count up from it
EVALS_PER_RUN = 20  # validation passes per rung: the resolution of the time-to-loss curves

# AdamW learning rates and weight decays around the article's (multiples of its lr; absolute decays)
SWEEP_LR = (0.5, 2.0, 4.0)
SWEEP_WD = (0.0,)
# (name, overrides), each applied on top of the rung before it. The values are the published ones:
# modded-nanogpt's and nanochat's Muon lr 0.02 and momentum 0.95, a soft-cap of 15 (nanochat), a
# warm-down over the last 40% to zero. ffn_hidden 0 lets ReLU² take SwiGLU's parameter count. The
# last rung halves the article's batch (524K -> 262K for 22m to 126m): chain(), below.
CHAIN = (
    ("+ warmup-stable-decay", {"train__schedule": "wsd", "train__warmdown_fraction": 0.4, "train__min_lr_ratio": 0.0}),
    ("+ Muon", {"train__muon": True, "train__muon_lr": 0.02, "train__muon_momentum": 0.95}),
    ("+ ReLU²", {"model__mlp": "relu2", "model__ffn_hidden": 0}),
    ("+ QK-norm, zero-init", {"model__qk_norm": True, "model__zero_init": True}),
    ("+ untied head", {"model__tie_embeddings": False}),
    ("+ soft-cap 15", {"model__logit_softcap": 15.0}),
    ("- gradient clipping", {"train__grad_clip": 0.0}),
)


def chain(article: C.Config) -> list[tuple[str, dict]]:
    """CHAIN, then half the article's batch: twice the optimizer steps for the same tokens."""
    half = article.train.batch_tokens // 2
    return [*CHAIN, (f"{half / 1000:.0f}K batch", {"train__batch_tokens": half})]


# The record ladder (--seconds): modded-nanogpt's ideas one at a time from the Muon recipe, each on top of
# the rungs before it; after the last, the rung is configs/<preset>.toml with newest_off (a test checks). The values
# are modded's (its train_gpt.py at commit 9d9dc969). A change that depends on the preset is a function of
# (preset config, micro-batch): three value tables, or fewer where the preset has fewer than six layers;
# 1.5x the batch; sequences 8x the context, documents masked apart, with the micro-batch shrunk to hold as
# many tokens; a window growing from 1/8 of the context to 1.75x (126m: 393,216; 8,192; 128 to 1,792);
# the record's shape, which at another width keeps its proportions (_record_shape).


def _value_tables(base: C.Config, micro_batch: int) -> dict:
    return {"model__value_embeds": min(3, base.model.n_layers // 2)}


def _larger_batch(base: C.Config, micro_batch: int) -> dict:  # in whole micro-batches
    per_pass = micro_batch * base.model.context
    return {"train__batch_tokens": max(per_pass, round(1.5 * base.train.batch_tokens / per_pass) * per_pass)}


def as_many_tokens(micro_batch: int, context: int, longer: int) -> int:
    """Sequences of `longer` tokens a micro-batch holds for `micro_batch` sequences of `context` tokens."""
    return max(1, micro_batch * context // longer)


def _long_sequences(base: C.Config, micro_batch: int) -> dict:
    T = base.model.context
    return {"model__context": 8 * T, "train__doc_mask": True,
            "train__micro_batch": as_many_tokens(micro_batch, T, 8 * T)}


def _growing_window(base: C.Config, micro_batch: int) -> dict:
    T = base.model.context
    return {"model__attn_window": 7 * T // 4, "train__window_start": max(1, T // 8)}


def _record_shape(base: C.Config, micro_batch: int) -> dict:
    """modded's 12 layers of 6 heads of 128 at the 126m width, where the preset has 16 layers of 12 heads
    of 64 sharing 4 kv heads: elsewhere 3/4 of the layers and no grouped kv heads, with the largest head
    of at most 128 whose size is a power of two (47m's 576: 9 heads of 64, not 4 of 144). FlexAttention's
    kernels pad a head to the next power of two, so 144 would do the attention work of 256."""
    layers = max(2, round(3 * base.model.n_layers / 4))
    size = 128
    while size > 2 and base.model.d_model % size:
        size //= 2
    heads = base.model.d_model // size
    return {"model__n_layers": layers, "model__n_heads": heads, "model__n_kv_heads": heads,
            "model__value_embeds": min(3, layers // 2)}


def _attention_free_layer(base: C.Config, micro_batch: int) -> dict:
    """modded's layer 7 of 12 without attention: at the record shape's depth the layer 7/12 of the way
    down, kept off the first and last layers that take value tables (none where no middle layer is left)."""
    shape = _record_shape(base, micro_batch)
    layers, tables = shape["model__n_layers"], shape["model__value_embeds"]
    layer = min(layers - tables - 1, max(tables, 1, round(7 * layers / 12)))
    return {"model__skip_attn_layer": layer} if layer >= max(tables, 1) else {}


RECORD_CHAIN = (
    ("+ untied zero head, embed-norm, soft-cap 15", {"model__tie_embeddings": False, "model__embed_norm": True,
                                                     "model__logit_softcap": 15.0}),
    ("+ AdamW rates per group, betas (0.8, 0.95), eps 1e-10", {"train__lr": 0.008, "train__embed_lr": 0.6,
                                                               "train__head_lr": 0.008, "train__scalar_lr": 0.04,
                                                               "train__beta1": 0.8, "train__adam_eps": 1e-10}),
    ("+ Muon lr 0.05, momentum warm-up", {"train__muon_lr": 0.05, "train__muon_momentum_warmup": 300}),
    ("+ no warm-up, 45% cool-down to 0.1x", {"train__warmup_steps": 0, "train__warmdown_fraction": 0.45,
                                             "train__min_lr_ratio": 0.1}),
    ("+ value embeddings", _value_tables),
    ("+ U-net skips, x0 mix", {"model__unet_skips": True, "model__x0_mix": True}),
    ("+ half-truncated RoPE", {"model__rope_truncate": True}),
    ("+ attention gate", {"model__attn_gate": True}),
    ("+ 1.5x batch (126m: modded's 393K)", _larger_batch),
    ("+ long documents-masked sequences", _long_sequences),
    ("+ sliding window, growing", _growing_window),
    ("+ long-short windows", {"model__short_windows": True}),
    ("+ the record's shape (126m: 12 layers, 6 heads of 128)", _record_shape),
    ("+ no attention in one middle layer (126m: layer 7)", _attention_free_layer),
    # Three changes to the step's time alone (the FP8 head, its forward product with fast accumulation, rounds
    # the head's matmul coarser, the others compute the same numbers): one rung, so the ladder's 150-s runs go
    # to changes in what is learned. Generation's split decode, decode MLP and dependent launches ride along:
    # training never runs them, and the rung then is the preset whole.
    ("+ FP8 head, loss kernel, pinned copies (speed alone)", {"speed__fp8_head": True, "speed__fp8_fast_accum": True,
                                                              "speed__loss_kernel": True,
                                                              "train__pin": True, "speed__split_decode": True,
                                                              "speed__decode_mlp": True, "speed__decode_pdl": True}),
    # modded's: it clips nothing, steps its up-projection (stored wide, 768 x 3,072) at Muon's lr where
    # the tall-matrix scale doubles ours, and scales attention logits by 0.12, not 1/sqrt(128)
    ("+ no clipping, no tall-matrix scale, attention scale 0.12", {"train__grad_clip": 0.0,
                                                                  "train__muon_tall_scale": False,
                                                                  "model__attn_scale": 0.12}),
    # modded's too: every attention layer scales its values by a learned scalar (sa_lambdas[0]), and its loss
    # is a sum over the step's tokens where ours is a mean, so its Adam epsilon 1e-10 is ours over 393,216.
    ("+ values scaled on every layer, Adam's epsilon at modded's gradient scale", {"model__value_scale": True,
                                                                                 "train__adam_eps": 2.5e-16}),
    ("+ norms without gains (modded's norm(x))", {"model__norm_gains": False}),
)
def _growing_batch(base: C.Config, micro_batch: int) -> dict:
    """Three stages of the batch, each in whole micro-batches: the largest micro-batch up to the study's that divides
    a step into a multiple of 3 (126m at 12: 8, six micro-batches a step)."""
    return {"train__batch_stages": 3, **_fitting_micro_batch(base, base.train.batch_tokens, micro_batch, 3)}


def _fitting_micro_batch(base: C.Config, tokens: int, micro_batch: int, stages: int) -> dict:
    """The override of the largest micro-batch up to micro_batch whose steps of `tokens` divide into `stages` stages
    of whole micro-batches (none where micro_batch does, or none does)."""
    fits = TR.staged_micro_batch(tokens, micro_batch, base.model.context, 1, stages)
    return {"train__micro_batch": fits} if fits and fits != micro_batch else {}


def _paired_heads(base: C.Config, micro_batch: int) -> dict:
    """Paired heads (#58) in every other short layer, each head with its own kv head; a preset without short windows
    (tiny) gets them, at half its context."""
    change = {"model__paired_heads": True, "model__n_kv_heads": base.model.n_heads}
    if not base.model.short_windows:
        change.update(model__short_windows=True, model__attn_window=base.model.attn_window or base.model.context // 2)
    return change


def _yarn(base: C.Config, micro_batch: int) -> dict:
    """YaRN (#31) from the window the run starts at, with the record's first attention scale, 0.1 (it grows with the
    window); a preset without a window schedule (tiny) gets one, from an eighth of its context to half of it."""
    window = base.model.attn_window or base.model.context // 2
    start = base.train.window_start or base.model.context // 8
    return {"model__rope_yarn": start, "model__attn_scale": 0.1, "model__attn_window": window,
            "train__window_start": start}


def _quarter_batch(base: C.Config, micro_batch: int) -> dict:
    """A quarter of base's batch (newest_plan's base: the preset as record #28's recipe), at the largest micro-batch
    up to the study's that divides it (126m at 12: 98,304 tokens, one micro-batch a step)."""
    tokens = base.train.batch_tokens // 4
    return {"train__batch_tokens": tokens, **_fitting_micro_batch(base, tokens, micro_batch, 1)}


def _first_block_dropped(base: C.Config, micro_batch: int) -> dict:
    """One block fewer, as records #30 and #35 dropped their first block's MLP and attention (the record has 11 since):
    the attention-free block keeps its place behind the one dropped; the long and paired layers, the value tables and
    the 2/3-depth block follow model.ModelConfig's rules at the new depth, which place them as the record's do only
    in part (126m at 11: long 0, 4, 10 where the record's are 3, 10)."""
    m = base.model
    change = {"model__n_layers": m.n_layers - 1}
    if m.skip_attn_layer > 0:
        change["model__skip_attn_layer"] = m.skip_attn_layer - 1
    return change


def _stack(base: C.Config, micro_batch: int) -> dict:
    """Every idea the 126m default adopted, each sized on base with the ones before it; an idea base's shape cannot
    take (paired heads on 22m's three heads) is left out, as the rung's name says."""
    values = {section: asdict(getattr(base, section)) for section in C.SECTIONS}
    change = {}
    for key in adopted():
        step = sized(key, C.load_config(values=values, **change), micro_batch)
        try:
            C.load_config(values=values, **{**change, **step})
        except ValueError:
            continue
        change.update(step)
    return change


# The newest records' ideas (modded-nanogpt's records since #28, each README under records/track_1_short/): with
# --newest, each on top of record #28's recipe (newest_off) alone, once per seed. One seed draws the same data and
# the same first weights for every rung, so an idea's loss minus record #28's at the same seed (paired) shows its
# effect with the seed's share taken out, which at 126m is larger than most ideas' (docs/performance/time-to-loss.md).
NEWEST = {
    "bigram": ("+ bigram hash table, 5x the vocabulary (#62)",
               lambda base, micro_batch: {"model__bigram_rows": 5 * base.model.vocab_size}),
    # the sign trick signs the table's rows: the rung brings the table too, as the "bigram" rung sizes it
    "bigram-signs": ("+ the bigram table's rows signed by pair (#83)",
                     lambda base, micro_batch: {"model__bigram_signs": True,
                                                "model__bigram_rows": 5 * base.model.vocab_size}),
    "backout": ("+ backout (#40)", {"model__backout": True}),
    "smear": ("+ smear (#34)", {"model__smear": True}),
    # each needs a part the GPU presets have, and tiny has not: there the rung brings it too
    "key-offset": ("+ partial key offset on the long layers (#49)",
                   lambda base, micro_batch: {"model__key_offset": True, "model__rope_truncate": True}),
    "value-gate": ("+ gates on the value embeddings (#55)",
                   lambda base, micro_batch: {"model__value_gate": True,
                                              "model__value_embeds": base.model.value_embeds or 1}),
    "mtp": ("+ multi-token loss over 3 tokens (#53)", {"train__mtp_tokens": 3}),
    "normuon": ("+ Polar Express and NorMuon (#38, #41)", {"train__muon_iteration": "polar-express",
                                                          "train__muon_beta2": 0.95}),
    # The record decays p by wd * lr * lr_eff a step (1.2 * 0.023 * 0.023 at its peak, 6.3e-4); ours by
    # muon_lr * muon_weight_decay: 0.013 at our 0.05 is the same step.
    "cautious-wd": ("+ cautious weight decay on Muon (#43, #50)", {"train__muon_weight_decay": 0.013,
                                                                  "train__muon_cautious": True}),
    # ...and on Adam's embeddings and head (#50), by the rate squared and the record's multipliers (optim.ADAM_DECAY)
    "adam-wd": ("+ cautious weight decay on Adam's embeddings and head (#50)", {"train__adam_weight_decay": 0.005}),
    "batch-stages": ("+ the batch grown in three stages, rates by sqrt(stage) (#46)", _growing_batch),
    "quarter-batch": ("+ a quarter of the batch, four times the steps (after #39's smaller batch)", _quarter_batch),
    # the optimizer ties them (optim.tie_grads): the model stays untied, its FP8 head with it (tiny's rung unties it)
    "tied-head": ("+ the head and the embedding one matrix again (#51)",
                  {"train__untie_at": 1.0, "model__tie_embeddings": False}),
    "untie": ("+ the head and the embedding one matrix until 2/3 of the run (#51, #53)",
              {"train__untie_at": 0.6667, "model__tie_embeddings": False}),
    # v and wo start as +-sqrt(0.05) I (#64), which needs a kv head per query head: tiny's rung brings that too
    "mimetic": ("+ mimetic value and output init, b = 0.05 (#64)",
                lambda base, micro_batch: {"model__mimetic_init": 0.05, "model__n_kv_heads": base.model.n_heads}),
    "prefix": ("+ prefix-token loss at 0.25, out by 2/3 of the run (#88)", {"train__prefix_weight": 0.25}),
    "paired-heads": ("+ paired-head attention in every other short layer (#58)", _paired_heads),
    "yarn": ("+ YaRN as the window grows, attention scale from 0.1 (#31)", _yarn),
    # the record's betas by group (#52, #57): each AdamW group's own, where record #28's were one pair for all
    "adam-betas": ("+ AdamW's betas by group: head 0.5, tables 0.75, scalars (0.9, 0.99) (#52, #57)",
                   {"train__head_beta1": 0.5, "train__embed_beta1": 0.75, "train__scalar_beta1": 0.9,
                    "train__scalar_beta2": 0.99}),
    # the head's logits capped as 23 sigmoid((z + 5) / 7.5), not 30 sigmoid(z / 7.5) (#54; model.softcap)
    "logit-rescale": ("+ the asymmetric logit soft-cap, 23 sigmoid((z + 5) / 7.5) (#54)",
                      {"model__logit_softcap": 11.5, "model__logit_shift": 5.0, "model__logit_temperature": 15.0}),
    # each unpaired head's output less a learned share of its part along its own value, from 0 (#82)
    "xsa": ("+ gated XSA on the unpaired attention layers (#82)", {"model__xsa": True}),
    # the blocks after the 2/3-depth one attend over its output, never over the last MLPs' (#77)
    "saved-attn-input": ("+ the last blocks' attention over the 2/3-depth block's output (#77)",
                         {"model__saved_attn_input": True}),
    # MUDD's trimmed connections into the last two blocks (#81); their value addend needs a kv head per query head
    "dense": ("+ dense connections into the last two blocks (#81)",
              lambda base, micro_batch: {"model__dense_last": True, "model__n_kv_heads": base.model.n_heads}),
    "warmdown": ("+ the warm-down over the last 60% of the run, down to 0.15 of the peak rate (#72, #73)",
                 {"train__warmdown_fraction": 0.6, "train__min_lr_ratio": 0.15}),
    # at the quarter batch a 70-s run takes about 350 steps: the record's 300-step warm-up is most of it
    "momentum-cooldown": ("+ Muon's momentum back down over the last 50 steps (#39)",
                          {"train__muon_momentum_cooldown": 50}),
    # a block fewer: less work a step (a twelfth at 126m) for whatever the block learned (#30, #35)
    "first-block": ("+ one block fewer, the first dropped (#30, #35)", _first_block_dropped),
    # the 22m and 88m defaults keep record #28's recipe until this rung is measured there
    "stack": ("+ every idea the 126m default adopted that this shape can take", _stack),
}


def sized(key: str, base: C.Config, micro_batch: int) -> dict:
    """NEWEST[key]'s overrides for `base` (an idea that depends on the config is sized on it)."""
    change = NEWEST[key][1]
    return change(base, micro_batch) if callable(change) else dict(change)


def adopted(preset: str = "126m", micro_batch: int = 12) -> list[str]:
    """The NEWEST ideas configs/<preset>.toml has taken (configs/recipes/newest.toml), in NEWEST's order: each whose
    overrides, sized on the preset without the newest ideas, leave the preset as it is."""
    base = C.preset(preset)
    without = C.preset(preset, **newest_off(preset))
    keys = []
    for key in NEWEST:
        if key == "stack":
            continue
        try:
            if has_already(preset, sized(key, without, micro_batch), base):
                keys.append(key)
        except ValueError:  # an idea this preset's shape cannot take
            continue
    return keys


def has_already(preset: str, change: dict, base: C.Config) -> bool:
    """Whether configs/<preset>.toml (base) is as it is with `change` applied: it has taken that idea."""
    has = C.preset(preset, **change)
    return (has.model, has.train) == (base.model, base.train)


# The Muon rung's warm-up under --seconds: about 10% of the 288 steps configs/126m-muon.toml takes in 150 s on
# an H200 (its preset's 200 steps would be most of such a run).
SECONDS_WARMUP = 30
SECONDS_EVAL_EVERY = 25  # steps between evaluations: about a dozen per 150-s run at 126m


TIME_GAIN = 0.02  # "in less time": at least 2% fewer training seconds
SAME_LOSS = 0.005  # nats: final losses this close count as equal (one seed of a bf16 run moves by about this)
# The python corpus' BPE trains on its first 10,000 documents (in content-hash order, so a sample of
# every package): about 90 MB, a minute of a 16-core machine, where all 500 MB take several.
PYTHON_TOKENIZER_DOCUMENTS = 10_000


@dataclass
class Recipe:
    """One rung: a config file, overrides as load_config takes them, and a seed."""
    name: str
    config: str  # a preset name in configs/
    group: str  # article | sweep | chain | final | default
    overrides: dict = field(default_factory=dict)
    seed: int = SEED

    @property
    def folder(self) -> str:
        name = self.name.lower().replace("²", "2")  # folder names in ASCII: "+ ReLU²" runs in "relu2-..."
        slug = "".join(c if c.isascii() and c.isalnum() else "-" for c in name).strip("-")
        return f"{'-'.join(s for s in slug.split('-') if s)}-s{self.seed}"


# --- The plan (pure functions) --------------------------------------------------------------

def fixed_settings(base: C.Config, tokens: int, corpus: str, micro_batch: int | None) -> dict:
    """What every rung shares: the corpus, the token budget and the measuring cadence."""
    # Validation passes of at most two article batches: 1,048,576 tokens for 22m to 126m (what their
    # ladders were measured with), 32,768 for the tiny smoke test, whose default would cost more than its steps.
    return {**corpus_settings(base, corpus), "train__tokens": tokens, "train__steps": 0, "train__sample_tokens": 0,
            "train__micro_batch": micro_batch or base.train.micro_batch,
            "train__eval_tokens": min(base.train.eval_tokens, 2 * base.train.batch_tokens)}


def corpus_settings(base: C.Config, corpus: str) -> dict:
    """The [data] overrides that put a preset on `corpus`: the preset's document limits were sized
    for its own corpus, so another one is read whole (the python corpus's BPE from a sample)."""
    if corpus == base.data.corpus:
        return {"data__corpus": corpus}
    return {"data__corpus": corpus, "data__max_documents": 0,
            "data__tokenizer_documents": PYTHON_TOKENIZER_DOCUMENTS if corpus == "python" else 0}


def run_settings(cfg: C.Config, own: C.Config) -> dict:
    """Per rung, from its batch: the warm-up, EVALS_PER_RUN validation passes at the same token
    counts whatever the batch, and four checkpoints, so a cut run resumes.

    cfg is the rung as it runs; own is the same rung at its preset's budget. The warm-up is the
    preset's own share of the run, so a full-budget rung warms up exactly as `train.py --config`
    does, but never under 10% of the steps (a shortened run would otherwise start at full lr
    after a handful of steps: one article seed spiked to loss 11 that way) and never longer
    than the preset's own warm-up."""
    steps = max(1, cfg.train.tokens // cfg.train.batch_tokens)
    own_steps = max(1, own.train.tokens // own.train.batch_tokens) if own.train.tokens else own.train.steps
    share = round(own.train.warmup_steps * steps / own_steps)
    every = max(1, steps // EVALS_PER_RUN)
    return {"train__warmup_steps": max(1, min(own.train.warmup_steps, max(share, steps // 10))),
            "train__eval_every": every, "train__ckpt_every": max(every, steps // 4)}


def ladder_plan(preset: str, seeds: int) -> list[Recipe]:
    """The article once per seed, the sweep, then the chain, each chain rung carrying the changes
    of the rungs before it."""
    article, base = f"{preset}-gpt3", C.preset(f"{preset}-gpt3")
    plan = [Recipe("article (GPT-3 2020)", article, "article", seed=SEED + i) for i in range(seeds)]
    plan += [Recipe(f"AdamW lr x{m:g}", article, "sweep", {"train__lr": base.train.lr * m}) for m in SWEEP_LR]
    plan += [Recipe(f"AdamW wd {wd:g}", article, "sweep", {"train__weight_decay": wd}) for wd in SWEEP_WD]
    carried = {}
    for name, change in chain(base):
        carried = {**carried, **change}
        plan.append(Recipe(name, article, "chain", dict(carried)))
    return plan


WHOLE_BUDGET = (1.0,)  # --fractions' default: the default recipe on all of the tokens


def muon_preset(preset: str) -> str:
    """The preset's Muon recipe, the default until 2026-12-02, where the record ladder starts."""
    return f"{preset}-muon"


def same_tokens(config: str, article: str, micro_batch: int) -> dict:
    """The micro-batch of `config` that holds the tokens of `micro_batch` sequences of `article`'s context,
    where its sequences are longer ({} where they are not): one --micro-batch-size fits either side."""
    own, theirs = C.preset(config).model.context, C.preset(article).model.context
    return {} if own == theirs else {"train__micro_batch": as_many_tokens(micro_batch, theirs, own)}


def versus_plan(preset: str, seeds: int, tokens: int = 0, fractions: tuple[float, ...] = WHOLE_BUDGET,
                micro_batch: int = 1, muon: bool = False, newest: tuple[str, ...] = ()) -> list[Recipe]:
    """Per seed, the article against the default recipe on each fraction of the budget (1: all of it).
    A warm-down recipe reaches its lowest loss only at the end of its own schedule, so where its
    full-budget curve crosses the target is not the fastest it gets there: the shortest schedule
    whose final loss reaches the target is. Leaving 1 out saves the longest run of the default.
    With muon the other side is configs/<preset>-muon.toml. micro_batch: sequences of the article's
    context per micro-batch; the other side takes as many tokens (same_tokens). newest: NEWEST ideas, each
    also on top of the default on each fraction (`stack` asks whether the 126m default's ideas pay here, and
    how much sooner they reach the article's loss, in one study)."""
    config = muon_preset(preset) if muon else preset
    name = "Muon recipe" if muon else "default recipe"
    own = same_tokens(config, f"{preset}-gpt3", micro_batch)
    base = C.preset(config, **own)
    ideas = {key: sized(key, base, base.train.micro_batch) for key in newest}
    for key, change in ideas.items():
        check_applies(config, key, {**own, **change})

    def rungs(f, seed):
        budget = {} if f == 1 else {"train__tokens": int(tokens * f)}
        share = "" if f == 1 else f", {f:.0%} of the tokens"
        return [Recipe(f"{name}{share}", config, "default", {**own, **budget}, seed),
                *(Recipe(f"{name} {NEWEST[key][0]}{share}", config, "newest", {**own, **change, **budget}, seed)
                  for key, change in ideas.items())]
    return [r for i in range(seeds)
            for r in (Recipe("article (GPT-3 2020)", f"{preset}-gpt3", "article", seed=SEED + i),
                      *(r for f in fractions for r in rungs(f, SEED + i)))]


def helped(rows: list[dict]) -> list[str]:
    """The chain rungs that helped: a final loss lower than the rung before by more than
    SAME_LOSS, or within SAME_LOSS of it and at least TIME_GAIN faster. rows: the chain's rows in
    order, after the article's row (the first chain rung is compared with the article).
    One seed each: a single rung's gain is a direction, not a claim; the final recipe, run
    against the article once per seed, is the claim."""
    kept = []
    for before, row in zip(rows, rows[1:]):
        if row.get("val_loss") is None or before.get("val_loss") is None:
            continue
        gain = before["val_loss"] - row["val_loss"]
        faster = row["train_seconds"] < (1 - TIME_GAIN) * before["train_seconds"]
        if gain > SAME_LOSS or (abs(gain) <= SAME_LOSS and faster):
            kept.append(row["rung"])
    return kept


def final_recipes(preset: str, kept: list[str], seeds: int) -> list[Recipe]:
    """The article with the kept chain changes, once per seed."""
    changes = {}
    for name, change in chain(C.preset(f"{preset}-gpt3")):
        if name in kept:
            changes.update(change)
    return [Recipe("final: " + (", ".join(kept) or "no change"), f"{preset}-gpt3", "final", changes, SEED + i)
            for i in range(seeds)]


def record_chain(preset: str, micro_batch: int, carried: dict) -> list[tuple[str, dict]]:
    """(name, overrides) per RECORD_CHAIN rung at the preset, each carrying the rungs before it."""
    base, rungs = C.preset(muon_preset(preset)), []
    for name, change in RECORD_CHAIN:
        carried = {**carried, **(change(base, micro_batch) if callable(change) else change)}
        rungs.append((name, carried))
    return rungs


def record_recipe(preset: str, micro_batch: int) -> dict:
    """The overrides that make configs/<preset>-muon.toml the record recipe: the whole RECORD_CHAIN."""
    return record_chain(preset, micro_batch, {})[-1][1]


def record_plan(preset: str, seeds: int, micro_batch: int) -> list[Recipe]:
    """The Muon recipe (its warm-up at SECONDS_WARMUP), then each RECORD_CHAIN change on top of the rungs
    before it, one seed each; then the whole chain once more per further seed."""
    carried, muon = {"train__warmup_steps": SECONDS_WARMUP}, muon_preset(preset)
    rungs = record_chain(preset, micro_batch, carried)
    plan = [Recipe("Muon recipe", muon, "default", dict(carried))]
    plan += [Recipe(name, muon, "chain", dict(overrides)) for name, overrides in rungs]
    plan += [Recipe(rungs[-1][0], muon, "chain", dict(rungs[-1][1]), SEED + i) for i in range(1, seeds)]
    return plan


# Every NEWEST idea off: what the defaults are without them (record #28's recipe), where the newest rungs start;
# with them off, generation's fused decode (which has no key offset, value gates or paired heads) is back on.
NEWEST_OFF = {"model__bigram_rows": 0, "model__bigram_signs": False, "model__backout": False, "model__smear": False,
              "model__key_offset": False, "model__value_gate": False, "model__mimetic_init": 0.0,
              "model__paired_heads": False, "model__rope_yarn": 0, "model__logit_shift": 0.0,
              "model__logit_temperature": 0.0, "model__xsa": False, "model__saved_attn_input": False,
              "model__dense_last": False,
              "train__mtp_tokens": 1, "train__muon_iteration": "newton-schulz", "train__muon_beta2": 0.0,
              "train__muon_weight_decay": 0.0, "train__muon_cautious": False, "train__batch_stages": 1,
              "train__prefix_weight": 0.0, "train__untie_at": 0.0, "train__adam_weight_decay": 0.0,
              "train__head_beta1": 0.0, "train__embed_beta1": 0.0, "train__scalar_beta1": 0.0, "train__scalar_beta2": 0.0,
              "speed__fused_decode": True, "speed__split_decode": True}
# Taking a part out takes out what needs it: the signs sign the bigram table's rows.
NEEDS_IT = {"model__bigram_rows": {"model__bigram_signs": False}}
WITHOUT_NEWEST = "the newest ideas off (22m to 126m: record #28's recipe)"
ADOPTED = "the default (its adopted ideas together)"


def newest_off(preset: str) -> dict:
    """Every NEWEST idea off in `preset`: NEWEST_OFF, and what else configs/recipes/newest.toml changes in it (126m's
    quarter batch, its evaluations and checkpoints as many tokens apart, its warm-down) as the preset has it without
    that file."""
    bare = C.load_config(values=C.read_toml(C.PRESETS_DIR / f"{preset}.toml", without=("recipes/newest.toml",)))
    base, newest = C.preset(preset), C.read_toml(C.PRESETS_DIR / "recipes" / "newest.toml")
    keys = [(section, key) for section, table in newest.items() for key in table if f"{section}__{key}" not in NEWEST_OFF]
    return {**NEWEST_OFF, **{f"{s}__{k}": getattr(getattr(bare, s), k) for s, k in keys
                             if getattr(getattr(bare, s), k) != getattr(getattr(base, s), k)}}


def check_applies(preset: str, key: str, overrides: dict):
    """An idea this preset cannot take (paired heads on 22m's three heads) is named in one line, before anything runs,
    where the config's own error would list every flag of the rung."""
    try:
        C.preset(preset, **overrides)
    except ValueError as e:
        reason = str(e).split("): ", 1)[-1]
        raise ValueError(f"--newest {key} does not apply to {preset}: {reason}; leave it out of --newest's list") from None


def newest_plan(preset: str, seeds: int, keys: tuple[str, ...], micro_batch: int, inside: bool = False) -> list[Recipe]:
    """configs/<preset>.toml with every NEWEST idea off, then each idea named in keys on top of that alone, then the
    preset as it is where it has adopted some (configs/recipes/newest.toml); each once per seed. inside: the preset
    as it is first, then each idea inside it: taken out where the preset has it, added where it has not."""
    base, off = C.preset(preset), newest_off(preset)
    rungs = lambda name, group, overrides: [Recipe(name, preset, group, dict(overrides), SEED + i) for i in range(seeds)]
    without = C.preset(preset, **off)
    changes = {key: sized(key, without, micro_batch) for key in keys}  # each idea on record #28's recipe
    for key, change in changes.items():
        check_applies(preset, key, {**off, **change})
    if inside:
        plan = rungs(ADOPTED, "default", {})
        for key, change in changes.items():
            if has_already(preset, change, base):  # adopted: the rung leaves it out
                out = {k: off[k] for k in change if k in off}
                out.update({k: v for part in list(out) for k, v in NEEDS_IT.get(part, {}).items()})
                plan += rungs(f"- {NEWEST[key][0][2:]}", "newest", out)
            else:  # sized on the preset as it is (its batch may be smaller than record #28's)
                plan += rungs(NEWEST[key][0], "newest", sized(key, base, micro_batch))
        return plan
    plan = rungs(WITHOUT_NEWEST, "default", off)
    for key, change in changes.items():
        plan += rungs(NEWEST[key][0], "newest", {**off, **change})
    if (without.model, without.train) != (base.model, base.train):  # the preset adopted some (speed switches do not count)
        plan += rungs(ADOPTED, "newest", {})
    return plan


def paired(plan: list[Recipe], results: dict, name: str) -> list[float]:
    """Rung `name`'s final loss minus the plan's first rung's at each seed both finished (the seed's share taken out),
    with whole windows where the runs measured that (a sliding-window model's), else as trained."""
    last = {(r.name, r.seed): results[r.folder]["curve"][-1] for r in plan if results.get(r.folder, {}).get("curve")}
    final = {key: point.get("val_loss_whole", point["val_loss"]) for key, point in last.items()}
    first = plan[0].name
    return [final[(name, r.seed)] - final[(first, r.seed)] for r in plan
            if r.name == name and (name, r.seed) in final and (first, r.seed) in final]


# --- Reading the runs (pure functions) --------------------------------------------------------

def eval_curve(log_rows: list[dict]) -> list[dict]:
    """A run's validation passes: tokens, training seconds, loss and bits per byte (and the loss on
    plain 1,024-token windows where the run trains on something else)."""
    keys = ("step", "tokens", "train_seconds", "val_loss", "val_bpb", "val_loss_1024", "val_bpb_1024", "val_loss_whole")
    return [{k: r[k] for k in keys if k in r} for r in log_rows if "val_loss" in r and "train_seconds" in r]


def equal_context(point: dict, key: str = "val_loss") -> float:
    """A validation pass's loss (or val_bpb) at equal context: on plain 1,024-token windows where the run
    trains on something else (longer document-masked sequences), else its own, which are those windows."""
    return point.get(f"{key}_1024", point[key])


def time_to(curve: list[dict], target: float) -> tuple[float, float] | None:
    """(tokens, seconds) at which the validation loss at equal context (on plain 1,024-token windows
    where the run trains on something else, the target's own windows) first reaches `target`, linearly
    interpolated between the passes either side; None when it never does."""
    losses = [equal_context(p) for p in curve]
    at = [PL.first_crossing([float(p[key]) for p in curve], losses, target) for key in ("tokens", "train_seconds")]
    return None if at[0] is None else (at[0][0], at[1][0])


def summarize(name: str, runs: list[dict], target: float | None, article_tok_s: float | None) -> dict:
    """One table row from a rung's runs (one per seed): means over the seeds, and the spread
    (max - min) of the final loss."""
    finals = [r["curve"][-1] for r in runs if r.get("curve")]
    if not finals:
        return {"rung": name, "skipped": runs[0].get("error", "no validation pass") if runs else "not run"}
    row = {"rung": name, "seeds": len(finals), "val_loss": float(np.mean([f["val_loss"] for f in finals])),
           "val_bpb": float(np.mean([f["val_bpb"] for f in finals])),
           "spread": float(np.ptp([f["val_loss"] for f in finals])),
           "tokens": int(np.mean([f["tokens"] for f in finals])),
           "train_seconds": float(np.mean([f["train_seconds"] for f in finals])),
           "tok_s": float(np.mean([r["tok_s"] for r in runs if r.get("tok_s")] or [np.nan])),
           "steps": int(np.mean([f["step"] for f in finals])),
           "val_loss_1024": float(np.mean([equal_context(f) for f in finals])),
           "val_bpb_1024": float(np.mean([equal_context(f, "val_bpb") for f in finals])),
           "spread_1024": float(np.ptp([equal_context(f) for f in finals]))}
    if all("val_loss_whole" in f for f in finals):  # a sliding-window run's loss with each token's whole window
        row["val_loss_whole"] = float(np.mean([f["val_loss_whole"] for f in finals]))
    if target is not None:
        reached = [time_to(r["curve"], target) for r in runs if r.get("curve")]
        if all(reached):
            row["tokens_to_target"] = float(np.mean([t for t, _ in reached]))
            row["seconds_to_target"] = float(np.mean([s for _, s in reached]))
    if article_tok_s and row["tok_s"] == row["tok_s"]:
        row["step_overhead"] = article_tok_s / row["tok_s"] - 1  # > 0: slower per token than the article
    return row


def tokens_text(n: float) -> str:
    """Tokens in a unit that fits: 440M, 21.0M, 328K, 512."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.{0 if n >= 100 * size else 1}f}{unit}"
    return f"{n:,.0f}"


def spread_text(row: dict, key: str = "spread") -> str:
    """The spread of the seeds' final losses (key: spread_1024 at equal context); blank for one seed."""
    return f"{row[key]:.4f}" if row["seeds"] > 1 else ""


def table(rows: list[dict]) -> str:
    """The ladder as markdown; "x article's time" is the seconds to the target over the article's. Losses
    at equal context, as the target is timed (time_to), with the loss as trained beside where it differs."""
    article_seconds = rows[0].get("train_seconds") if rows else None
    head = ("| rung | seeds | final val loss | spread | bits/byte | tokens to target | seconds to target | "
            "x article's time | tok/s | step overhead |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['rung']} | skipped: {r['skipped']} |||||||||")
            continue
        to_t, to_s = r.get("tokens_to_target"), r.get("seconds_to_target")
        ratio = f"{to_s / article_seconds:.2f}" if to_s is not None and article_seconds else "not reached"
        trained = f" ({r['val_loss']:.4f} as trained)" if f"{r['val_loss']:.4f}" != f"{r['val_loss_1024']:.4f}" else ""
        lines.append(f"| {r['rung']} | {r['seeds']} | {r['val_loss_1024']:.4f}{trained} | {spread_text(r, 'spread_1024')} | "
                     f"{r['val_bpb_1024']:.4f} | "
                     f"{'not reached' if to_t is None else tokens_text(to_t)} | "
                     f"{'' if to_s is None else f'{to_s:,.1f}'} | {ratio} | {r['tok_s']:,.0f} | "
                     f"{r.get('step_overhead', 0):+.1%} |")
    return "\n".join(lines)


def seconds_table(rows: list[dict]) -> str:
    """The record ladder as markdown: every rung had the same training seconds. Rows with paired differences
    (the newest ideas) add them, each seed's loss minus the first rung's."""
    pairs = any("paired" in r for r in rows)
    lines = ["| rung | seeds | val loss as trained | with whole windows | on plain 1,024-token windows | spread | steps | "
             "tokens | training s | tok/s |" + (" minus the first rung, per seed |" if pairs else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if pairs else "")]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['rung']} | skipped: {r['skipped']} |||||||||" + ("|" if pairs else ""))
            continue
        whole = f"{r['val_loss_whole']:.4f}" if "val_loss_whole" in r else "-"
        diffs = " " + " ".join(f"{d:+.4f}" for d in r.get("paired", [])) + " |" if pairs else ""
        lines.append(f"| {r['rung']} | {r['seeds']} | {r['val_loss']:.4f} | {whole} | {r['val_loss_1024']:.4f} | "
                     f"{spread_text(r)} | {r['steps']:,} | {tokens_text(r['tokens'])} | {r['train_seconds']:,.1f} | "
                     f"{r['tok_s']:,.0f} |{diffs}")
    return "\n".join(lines)


# --- Running ----------------------------------------------------------------------------------

def to_flags(overrides: dict) -> list[str]:
    """train.py's flags for load_config overrides: {"train__lr": 0.003} -> ["--lr", "0.003"]."""
    flags = []
    for key, value in overrides.items():
        name = key.split("__", 1)[1].replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{'' if value else 'no-'}{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags


def resolved(recipe: Recipe, fixed: dict, sized: bool = True) -> tuple[C.Config, dict]:
    """The rung's config through the strict loader, and all of its overrides. sized: the warm-up and
    the evaluation cadence follow from the rung's token budget (run_settings); a --seconds rung has
    no budget in tokens, and fixed gives them."""
    overrides = {**fixed, **recipe.overrides, "train__seed": recipe.seed}
    cfg = C.preset(recipe.config, **overrides)
    TR.accumulation_steps(cfg.train.batch_tokens, cfg.train.micro_batch, cfg.model.context, 1)  # divides, or says why
    if not sized:
        return cfg, overrides
    own = C.preset(recipe.config, **{k: v for k, v in recipe.overrides.items() if k != "train__tokens"})
    overrides.update(run_settings(cfg, own))
    return C.preset(recipe.config, **overrides), overrides


def command(recipe: Recipe, overrides: dict, runs_dir: Path, resume: bool) -> list[str]:
    folder = runs_dir / recipe.folder
    again = ["--resume"] if resume and (folder / "ckpt.pt").exists() else ["--overwrite"]
    return [sys.executable, str(ROOT / "train.py"), "--config", str(C.PRESETS_DIR / f"{recipe.config}.toml"),
            "--runs-dir", str(runs_dir), "--name", recipe.folder, *again, *to_flags(overrides)]


def run_all(recipes: list[Recipe], fixed: dict, runs_dir: Path, devices: list[str | None], timeout: int,
            resume: bool, sized: bool = True) -> dict[str, dict]:
    """Train every recipe not already finished, as many at once as there are devices (one GPU
    each through CUDA_VISIBLE_DEVICES). Returns {folder: run} with each run's curve and speed."""
    todo, results = [], {}
    for r in recipes:
        _, overrides = resolved(r, fixed, sized)  # every config is checked before the first run starts
        done = runs_dir / r.folder / "summary.json"
        if not (resume and done.exists()) and r.folder not in {t[0].folder for t in todo}:
            todo.append((r, command(r, overrides, runs_dir, resume)))
    running, free = {}, list(devices)
    previous = signal.signal(signal.SIGTERM, _terminated)  # `kill` or `timeout` stops the rungs as Ctrl-C does
    try:
        _run_queue(todo, running, free, results, runs_dir, timeout)
    except KeyboardInterrupt:
        stop_children(running, runs_dir)
    except Terminated:
        stop_children(running, runs_dir, "SIGTERM")
    finally:
        signal.signal(signal.SIGTERM, previous)
    for r in recipes:
        results.setdefault(r.folder, read_run(runs_dir / r.folder))
    return results


STOP_GRACE = 120  # seconds a stopped rung may take to save its checkpoint (train.py saves on SIGINT)


class Terminated(Exception):
    """SIGTERM reached bench during the ladder."""


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends bench at once; the rungs have theirs
    raise Terminated


def stop_children(running: dict, runs_dir: Path, name: str = "SIGINT"):
    """Ctrl-C (SIGINT) or SIGTERM during the ladder: pass SIGINT on to every rung still training, so each saves
    a checkpoint as train.py does, wait for them, then leave in one line with train.py's exit code for a stop.
    Each rung runs in a session of its own, so without this it would train on alone after bench had gone,
    holding its card and its folder."""
    for proc, *_ in running.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE
    for folder, (proc, _, _, out) in running.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
    saved = sorted(f for f in running if (runs_dir / f / "ckpt.pt").exists())
    done = sorted(p.parent.name for p in runs_dir.glob("*/summary.json"))
    print(f"{name}: stopped; {len(done)} finished rung(s) and {len(saved)} interrupted one(s) with a checkpoint "
          f"({', '.join(saved) or 'none'}) are kept in {runs_dir}: run the same command with --resume to go on",
          file=sys.stderr)
    raise SystemExit(130)


def progress_line(folder: str, taken: list[float], left: int, at_once: int) -> str:
    """What a finished rung prints: its time (the last of taken, every finished rung's seconds), and what
    is left at the mean rung's time so far with `at_once` rungs running side by side."""
    mean = sum(taken) / len(taken)
    rest = f"{left} rung(s) left, about {mean * math.ceil(left / at_once) / 60:.0f} min at {mean:.0f} s a rung" \
        if left else "none left"
    return f"finished: {folder} in {taken[-1]:.0f} s; {rest}"


def _run_queue(todo: list, running: dict, free: list, results: dict, runs_dir: Path, timeout: int):
    """run_all's loop: start rungs on free devices, collect the finished and the late."""
    taken, at_once = [], len(free)
    while todo or running:
        while todo and free:
            recipe, cmd = todo.pop(0)
            device = free.pop(0)
            (runs_dir / recipe.folder).mkdir(parents=True, exist_ok=True)
            out = open(runs_dir / recipe.folder / "stdout.log", "w")
            env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": device} if device is not None else {})}
            print(f"run: {recipe.name} (seed {recipe.seed}){f' on GPU {device}' if device is not None else ''} ...",
                  flush=True)
            # A session of its own: a Ctrl-C at the terminal reaches bench alone, which passes one SIGINT on
            # (stop_children); a second SIGINT would make the rung quit before it saves.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
            running[recipe.folder] = (proc, device, time.monotonic(), out)
        time.sleep(0.5)
        for folder, (proc, device, started, out) in list(running.items()):
            late = time.monotonic() - started > timeout
            if proc.poll() is None and not late:
                continue
            if late and proc.poll() is None:
                proc.kill()
                proc.wait()
                results[folder] = {"error": f"timed out after {timeout} s"}
            elif proc.returncode:
                tail = (runs_dir / folder / "stdout.log").read_text(errors="replace").strip().splitlines()
                results[folder] = {"error": (tail[-1] if tail else f"exit {proc.returncode}")[:160]}
            out.close()
            free.append(device)
            del running[folder]
            taken.append(time.monotonic() - started)
            print(progress_line(folder, taken, len(todo) + len(running), at_once), flush=True)


def read_run(folder: Path) -> dict:
    if not (folder / "summary.json").exists():
        return {"error": "did not finish"}
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'summary.json'} is not JSON ({e}): the file was cut off; delete it and "
                         f"run with --resume again to train that rung once more") from None
    for checkpoint in folder.glob("ckpt*.pt"):  # the curves are the result; the weights are not kept
        checkpoint.unlink()
    curve = eval_curve(PL.read_log(folder / "log.jsonl"))
    # The whole run's rate, its tokens over its training seconds: after --resume, the summary's mean_tok_s
    # is the last session's alone.
    last = curve[-1] if curve else {}
    tok_s = last["tokens"] / last["train_seconds"] if last.get("train_seconds") else summary.get("mean_tok_s")
    return {"curve": curve, "tok_s": tok_s}


def check_and_prepare(plan: list[Recipe], fixed: dict, sized: bool = True) -> C.Config:
    """Check every rung's config before anything runs, the data included, then prepare the data once,
    here: rungs running at once must not race to write it. Returns the first rung's config."""
    first = [resolved(r, fixed, sized)[0] for r in plan][0]
    D.prepare(first.data, first.model.vocab_size)
    return first


def seconds_study(preset: str, seconds: float, seeds: int, corpus: str, micro_batch: int | None, out: Path,
                  timeout: int, resume: bool, devices: list[str | None]) -> dict:
    """Run the record ladder: every rung for `seconds` training seconds. Returns rows and curves."""
    base = C.preset(muon_preset(preset))
    micro_batch = micro_batch or base.train.micro_batch
    plan = record_plan(preset, seeds, micro_batch)
    found, _ = budget_study(plan, base, preset, corpus, micro_batch, out / "recipes" / f"{preset}_{corpus}_{seconds:g}s",
                            timeout, resume, devices, seconds=seconds)
    return found


def newest_study(preset: str, keys: tuple[str, ...], seeds: int, corpus: str, micro_batch: int | None, out: Path,
                 timeout: int, resume: bool, devices: list[str | None], seconds: float = 0.0, tokens: int = 0,
                 inside: bool = False) -> dict:
    """Record #28's recipe and each NEWEST idea in keys on top of it alone (or, inside, the default and each idea
    taken out of it or added to it), once per seed, at equal training seconds (each run's steps sized from its own
    speed) or at equal tokens; each idea's row carries its paired differences."""
    base = C.preset(preset, **newest_off(preset))  # record #28's recipe: its batch sizes the evaluations, as before
    micro_batch = micro_batch or base.train.micro_batch
    plan = newest_plan(preset, seeds, keys, micro_batch, inside)
    folder = f"{preset}_{corpus}_newest{'_inside' if inside else ''}_{f'{seconds:g}s' if seconds else f'{tokens}-tokens'}"
    found, results = budget_study(plan, base, preset, corpus, micro_batch, out / "recipes" / folder, timeout, resume,
                                  devices, seconds=seconds, tokens=tokens)
    for row in found["rows"][1:]:
        row["paired"] = paired(plan, results, row["rung"])
    return {**found, "newest": True, "inside": inside}


def budget_study(plan: list[Recipe], base: C.Config, preset: str, corpus: str, micro_batch: int, runs_dir: Path,
                 timeout: int, resume: bool, devices: list[str | None], seconds: float = 0.0,
                 tokens: int = 0) -> tuple[dict, dict]:
    """Run `plan`, every rung for `seconds` training seconds or else `tokens` tokens, evaluated every
    SECONDS_EVAL_EVERY steps of base's batch (a rung of a quarter of it: every 4 x as many steps, the same tokens
    apart, and a quarter of the evaluations' time). Returns (rows and curves, the runs by folder)."""
    fixed = {**fixed_settings(base, 0 if seconds else tokens, corpus, micro_batch), "train__seconds": seconds,
             "train__ckpt_every": 10**6}  # saved at the end and on a signal
    batch = lambda r: C.preset(r.config, **{**fixed, **r.overrides}).train.batch_tokens
    every = lambda r: max(1, SECONDS_EVAL_EVERY * base.train.batch_tokens // batch(r))
    plan = [replace(r, overrides={**r.overrides, "train__eval_every": every(r)}) for r in plan]
    cfg = check_and_prepare(plan, fixed, sized=False)
    budget = f"{seconds:g} training seconds" if seconds else f"{tokens:,} tokens"
    print(f"recipes: {preset} on {corpus}, {budget} per rung, {len(plan)} runs, {len(devices)} at a time", flush=True)
    results = run_all(plan, fixed, runs_dir, devices, timeout, resume, sized=False)
    names = list(dict.fromkeys(r.name for r in plan))
    rows = [summarize(n, [results[r.folder] for r in plan if r.name == n], None, None) for n in names]
    curves = {f"{r.name} s{r.seed}": results[r.folder].get("curve") for r in plan}
    return {"rows": rows, "curves": curves, "seconds": seconds, "tokens": tokens, "corpus": corpus,
            "params": FL.param_count(cfg.model)}, results


def study(preset: str, tokens: int | None, seeds: int, corpus: str, micro_batch: int | None, out: Path,
          timeout: int, resume: bool, versus: bool, devices: list[str | None], fractions: tuple[float, ...],
          muon: bool = False, newest: tuple[str, ...] = ()) -> dict:
    """Run the ladder (or --versus, against the Muon recipe with muon, with the newest ideas on the default too)
    and return its rows, curves, target and kept changes."""
    for name in (preset, f"{preset}-gpt3"):
        if not (C.PRESETS_DIR / f"{name}.toml").is_file():
            raise ValueError(f"--recipes --preset {preset}: configs/{name}.toml does not exist; the recipe ladder "
                             f"needs the preset and its article recipe, configs/{preset}-gpt3.toml")
    base = C.preset(f"{preset}-gpt3")
    tokens = tokens or base.train.tokens or base.train.steps * base.train.batch_tokens
    fixed = fixed_settings(base, tokens, corpus, micro_batch)
    runs_dir = out / "recipes" / f"{preset}_{corpus}_{tokens}"  # --resume never mixes budgets or corpora
    plan = (versus_plan(preset, seeds, tokens, fractions, fixed["train__micro_batch"], muon, newest) if versus
            else ladder_plan(preset, seeds))
    cfg = check_and_prepare(plan, fixed)
    print(f"recipes: {preset} ({FL.param_count(cfg.model):,} parameters) on {corpus}, {tokens:,} tokens per rung, "
          f"{len(devices)} at a time", flush=True)
    results = run_all(plan, fixed, runs_dir, devices, timeout, resume)
    rows, kept = rows_for(plan, results), []
    if not versus:
        article = rows[0]
        names = {r.name for r in plan if r.group == "chain"}
        kept = helped([article] + [r for r in rows if r["rung"] in names])
        final = final_recipes(preset, kept, seeds)
        results.update(run_all(final, fixed, runs_dir, devices, timeout, resume))
        plan += final
        rows = rows_for(plan, results)
    curves = {f"{r.name} s{r.seed}": results[r.folder].get("curve") for r in plan}
    return {"rows": rows, "curves": curves, "kept": kept, "tokens": tokens, "corpus": corpus, "muon": muon,
            "params": FL.param_count(cfg.model), "target": rows[0].get("val_loss")}


def rows_for(plan: list[Recipe], results: dict) -> list[dict]:
    """One row per rung name (its seeds together), in plan order, timed to the article's mean loss."""
    names = list(dict.fromkeys(r.name for r in plan))
    runs = {n: [results[r.folder] for r in plan if r.name == n] for n in names}
    article = summarize(names[0], runs[names[0]], None, None)
    target, tok_s = article.get("val_loss"), article.get("tok_s")
    if target is not None:  # the target is the article's own mean loss, which it reaches at its end
        article.update(tokens_to_target=article["tokens"], seconds_to_target=article["train_seconds"], step_overhead=0.0)
    return [article] + [summarize(n, runs[n], target, tok_s) for n in names[1:]]


def plot(curves: dict, title: str, path: Path, target: float | None = None):
    """Validation loss against training seconds, one line per run; with a target (the article's loss),
    its line and where each run crosses it, at equal context as time_to reads it."""
    loss = equal_context if target is not None else (lambda p: p["val_loss"])
    series = {name: ([p["train_seconds"] for p in c], [loss(p) for p in c], "-")
              for name, c in curves.items() if c}
    if series:
        PL.plot_lines(series, "training seconds (compile, evaluation and saving left out)",
                      "validation loss (nats" + (", 1,024-token windows)" if target is not None else ")"),
                      title, path, target)


# --- Loss curves: the same run with each fast path and without (bench.py --loss-curves) -----

def curves_plan(preset: str) -> list[Recipe]:
    """The plain model (every training fast path off), each fast path that applies to the preset's model
    alone on it (with the one it refines: model.fast_path_alone), then the preset as its file has it: a fast
    path may change speed, not what the model learns beyond bfloat16 noise."""
    plain = {f"speed__{s}": False for s in FP.TRAINING_FAST_PATHS}
    return [Recipe("plain", preset, "curves", plain),
            *[Recipe(FP.TRAINING_FAST_PATHS[s], preset, "curves",
                     {**plain, **{f"speed__{k}": on for k, on in FP.fast_path_alone(s).items()}})
              for s in FP.runnable_fast_paths(C.preset(preset).model)],
            Recipe("defaults", preset, "curves")]


def curves_study(preset: str, steps: int, micro_batch: int, out: Path, timeout: int, resume: bool,
                 devices: list[str | None], batch_tokens: int | None = None) -> tuple[list[dict], dict]:
    """Train curves_plan for `steps` steps each on the stdlib corpus (offline everywhere), through
    run_all like every ladder. Returns a row per run and each run's training loss step by step."""
    fixed = {"data__corpus": "stdlib", "train__steps": steps, "train__tokens": 0, "train__micro_batch": micro_batch,
             "train__warmup_steps": max(1, steps // 10), "train__eval_every": steps, "train__ckpt_every": steps,
             "train__sample_tokens": 0}
    if batch_tokens:  # also the validation pass's size
        fixed |= {"train__batch_tokens": batch_tokens, "train__eval_tokens": batch_tokens}
    plan, runs_dir = curves_plan(preset), out / "curves"
    check_and_prepare(plan, fixed, sized=False)
    results = run_all(plan, fixed, runs_dir, devices, timeout, resume, sized=False)
    rows, curves = [], {}
    for r in plan:
        if "error" in results[r.folder]:
            rows.append({"rung": r.name, "skipped": results[r.folder]["error"]})
            continue
        folder = runs_dir / r.folder
        curves[r.name] = [row["loss"] for row in PL.read_log(folder / "log.jsonl") if "loss" in row]
        summary = json.loads((folder / "summary.json").read_text())
        row = {"rung": r.name, "final_loss": float(np.mean(curves[r.name][-10:])), "val_loss": summary.get("val_loss"),
               "tok_s": results[r.folder]["tok_s"], "peak_gib": summary.get("peak_mem_gib")}
        if r.name != "plain" and "plain" in curves:
            row["max_loss_diff"] = max(abs(a - b) for a, b in zip(curves[r.name], curves["plain"]))
        rows.append(row)
    return rows, curves


# --- Reports ---------------------------------------------------------------------------------

def save(found: dict, name: str, title: str, preset: str, out: Path, device_name: str, devices: list,
         command: str) -> str:
    """A study's plot and JSON (with the command that made them) in out; returns the date."""
    date = time.strftime("%Y-%m-%d")
    out.mkdir(parents=True, exist_ok=True)
    plot(found["curves"], f"{title} | {device_name} | {date}", out / f"{name}.png", found.get("target"))
    (out / f"{name}.json").write_text(json.dumps({"device": device_name, "devices": len(devices), "date": date,
                                                   "torch": torch.__version__, "preset": preset, "command": command,
                                                   **found}, indent=2))
    return date


def report_ladder(found: dict, preset: str, versus: bool, out: Path, device_name: str, devices: list,
                  command: str) -> str:
    """Save a --recipes study (study()) and return its table."""
    name = f"recipes-{preset}{'-versus' if versus else ''}{'-muon' if found.get('muon') else ''}"
    date = save(found, name, f"validation loss | {preset} | {found['corpus']} | {tokens_text(found['tokens'])} tokens",
                preset, out, device_name, devices, command)
    return (f"## recipes | {preset} ({found['params']:,} parameters) | {found['corpus']} corpus | "
            f"{found['tokens']:,} tokens per rung | {device_name} x {len(devices)} | {date}\n\n"
            f"target: the article recipe's mean final validation loss, {found['target']}; seconds are training "
            f"seconds (the one-time compile, evaluation and saving left out)\n\n{table(found['rows'])}"
            + (f"\n\nkept: {', '.join(found['kept']) or 'nothing'}" if not versus else "")
            + f"\n\n{out / name}.json, {out / name}.png")


def report_record(found: dict, preset: str, out: Path, device_name: str, devices: list, command: str) -> str:
    """Save a --recipes --seconds study (seconds_study(), or newest_study() at seconds or tokens) and return its
    table."""
    seconds, tokens = found["seconds"], found.get("tokens")
    inside = found.get("inside", False)
    name = f"newest{'-inside' if inside else ''}-{preset}{'' if seconds else '-tokens'}" if found.get("newest") else f"record-{preset}"
    budget = f"{seconds:g} training seconds" if seconds else f"{tokens:,} tokens"
    date = save(found, name, f"validation loss as trained | {preset} | {found['corpus']} | {budget}",
                preset, out, device_name, devices, command)
    newest = ("the newest records' ideas, each taken out of the default or added to it" if inside else
              "the newest records' ideas, each alone on the preset without them")
    title = newest if found.get("newest") else "record ladder"
    how = ("each rung's steps were sized from its own first steps" if seconds else
           f"equal tokens; {len(devices)} rung(s) at a time, so tok/s is each rung's share of its card, not its speed")
    if found.get("newest"):
        how += "; minus the first rung: each seed's loss with whole windows (as trained without a window) less its"
    return (f"## {title} | {preset} | {found['corpus']} corpus | {budget} per rung | {device_name} | {date}\n\n"
            f"seconds are training seconds (compile, evaluation and saving left out); {how}\n\n"
            f"{seconds_table(found['rows'])}\n\n{out / name}.json, {out / name}.png")
