"""The house move (model.py the plain model, speed paths swapped in from their own file) must change no arithmetic:
a few CPU steps of the tiny preset and of a small record-recipe config give bitwise the losses they gave at
commit 21c10ff, the last before it (both compared on torch 2.13.0's CPU build)."""

import dataclasses

import pytest
import torch

import config as C
import train
from conftest import VOCAB, tiny_run_config

# float.hex of each step's loss, then the validation loss, at 21c10ff (the code before the move), computed by this file's own steps().
BEFORE = {
    "tiny": ['0x1.91b7d20000000p+2', '0x1.8a90e80000000p+2', '0x1.7fc6d00000000p+2', '0x1.79002e0000000p+2', '0x1.6b35050000000p+2'],
    "record": ['0x1.8f40b80000000p+2', '0x1.8eb9b80000000p+2', '0x1.8e0df80000000p+2', '0x1.8d35f20000000p+2', '0x1.8c9fae0000000p+2'],
}


def record_model() -> dict:
    """Every setting of configs/recipes/record.toml's model at CPU size, with long and short windows, an
    attention-free layer and value embeddings."""
    return dict(d_model=64, n_layers=4, n_heads=2, n_kv_heads=2, vocab_size=VOCAB, context=64, mlp="relu2",
                qk_norm=True, zero_init=True, logit_softcap=15.0, embed_norm=True, value_embeds=1, value_scale=True,
                norm_gains=False, unet_skips=True, x0_mix=True, rope_truncate=True, attn_gate=True, attn_window=32,
                short_windows=True, skip_attn_layer=2, attn_scale=0.12, tie_embeddings=False)


def configs(data_cfg) -> dict:
    tiny = C.load_config(C.PRESETS_DIR / "tiny.toml")
    tiny = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, vocab_size=VOCAB, context=128),
                               data=data_cfg)
    tiny = dataclasses.replace(tiny, train=dataclasses.replace(tiny.train, batch_tokens=512, micro_batch=2, steps=4,
                                                                 device="cpu", pin=False))
    record = tiny_run_config(data_cfg, C.M.ModelConfig(**record_model()), muon=True, doc_mask=True,
                             window_start=16, steps=4, batch_tokens=256, micro_batch=2, grad_clip=0.0)
    return {"tiny": tiny, "record": record}


def steps(cfg) -> list[str]:
    r = train.setup(cfg, log=lambda *a, **k: None)
    losses = []
    for step in range(r.steps):
        loss, _ = train.train_step(r.model, r.optimizer, r.train_loader.next_batch, r.accum, r.cfg.train, r.device,
                                   lr=1e-3, windows=train.window_at(step, r.steps, r.cfg))
        losses.append(float(loss).hex())
    # and the evaluation's forward without gradients, on the windows the run ends with
    ones = torch.ones(r.cfg.model.vocab_size)
    val = train.evaluate(r.model, r.val_loader, 4, ones, r.cfg.train, r.device, train.window_at(r.steps, r.steps, r.cfg))
    return losses + [val["val_loss"].hex()]


@pytest.mark.parametrize("name", list(BEFORE))
def test_a_few_steps_give_bitwise_the_losses_of_the_code_before_the_move(data_cfg, name):
    torch.manual_seed(0)
    got = steps(configs(data_cfg)[name])
    print(name, got)
    assert got == BEFORE[name]
