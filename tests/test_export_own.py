"""export.py's own-model folder (no stock transformers class computes the default presets): each default preset's
recipe at CPU size exports, loads with AutoModelForCausalLM and trust_remote_code, gives model.Llama's logits and
generates sample.py's greedy text through transformers' own KV cache, across the long and short windows."""

import dataclasses
import functools
import json
import shutil

import pytest
import torch

import checkpoint as CK
import config as C
import data as D
import export as E
import model as M
import sample as S
import tokenizer as tk
import train as TR
from conftest import DEFAULT_PRESET_CASES, cpu_sized_preset

transformers = pytest.importorskip("transformers")

PROMPT = "def main():\n    "
NEW_TOKENS = 40  # with the prompt, past the 48-key window and the 24-key short one (cpu_sized_preset)


def random_weights(cfg: M.ModelConfig, seed: int = 0) -> dict:
    """Weights away from the presets' zero and unit starts, so that every scalar, gate and table shows."""
    torch.manual_seed(seed)
    model = M.Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.state_dict()


# The newest record's parts, off in the presets until measured to pay: exported with the default preset's recipe.
NEWEST_PARTS = {"126m+newest": "bigram_rows = 2560\nbigram_signs = true\nbackout = true\nsmear = true\nkey_offset = true\n"
                               "value_gate = true\npaired_heads = true\nrope_yarn = 32\nxsa = true\nsaved_attn_input = true\n"
                               "dense_last = true\n"
                               "logit_softcap = 11.5\n"
                               "logit_shift = 5.0\nlogit_temperature = 15.0\n",
                "126m+smear": "smear = true\n"}


@pytest.fixture(scope="module",
                params=(*DEFAULT_PRESET_CASES, *(pytest.param(k, marks=pytest.mark.slow) for k in NEWEST_PARTS)))
def run(request, data_cfg, tmp_path_factory):
    """A checkpoint of the preset's recipe at a CPU's size (random weights, the test corpus's tokenizer) and its
    export."""
    folder = tmp_path_factory.mktemp("runs") / request.param
    folder.mkdir()
    small = cpu_sized_preset(request.param.split("+")[0], data_cfg, folder / "small.toml",
                             NEWEST_PARTS.get(request.param, ""))
    cfg = C.load_config(small)
    tok_path = D.data_dir(data_cfg, cfg.model.vocab_size) / "tokenizer.json"
    CK.save(folder / "ckpt.pt", model=random_weights(cfg.model), optimizer={}, step=0, tokens=0, skipped=0,
            loaders=[], rngs=[], config=cfg, tokenizer_hash=tk.tokenizer_hash(tok_path))
    out = tmp_path_factory.mktemp("exported") / f"own_{request.param.replace('+', '_').replace('-', '_')}"  # each its own module name
    E.main(["--ckpt", str(folder), "--out", str(out)])
    return folder, out


@functools.cache
def load(out):
    """The folder through transformers' front door, once per folder (each test reads, none changes it)."""
    return transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()


def assert_equal_logits(folder, out):
    """The exported folder, loaded through transformers, gives the checkpoint's logits (fp32, 1e-5)."""
    ours = CK.load(folder, "cpu").build_model().eval()
    idx = torch.randint(0, ours.cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(idx) - load(out)(idx).logits).abs().max().item() < 1e-5


def assert_greedy_as_sample_py(folder, out, capsys):
    """transformers' greedy generate() through its own cache continues PROMPT as `sample.py --temperature 0` does,
    NEW_TOKENS tokens, past both windows."""
    capsys.readouterr()
    S.main(["--ckpt", str(folder), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS),
            "--device", "cpu"])
    ours = capsys.readouterr().out
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok(PROMPT, return_tensors="pt")["input_ids"]
    # sample.py goes on past <|endoftext|> (and prints no text for it): so does generate() without an eos token
    tokens = load(out).generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=tok.eos_token_id)
    assert tokens.shape[1] == prompt.shape[1] + NEW_TOKENS
    assert ours == PROMPT + tok.decode(tokens[0, prompt.shape[1]:], skip_special_tokens=True) + "\n"


def test_each_default_preset_exports_our_own_model_with_equal_logits(run):
    folder, out = run
    ckpt = CK.load(folder, "cpu")
    assert CK.stock_gap(ckpt.config.model) is not None  # no stock class: the folder carries our model
    assert {p.name for p in out.iterdir()} == set(E.OWN_FILES)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_onegpu.OnegpuForCausalLM"
    assert config["onegpu"] == dataclasses.asdict(ckpt.config.model)
    assert_equal_logits(folder, out)


def test_greedy_generate_equals_sample_py(run, capsys):
    assert_greedy_as_sample_py(*run, capsys)


@pytest.mark.parametrize("preset", DEFAULT_PRESET_CASES)
def test_a_cpu_run_of_each_default_preset_exports_and_generates_as_sample_py(preset, data_cfg, tmp_path, capsys):
    """A CPU-size run of the preset's recipe through train.py, exported by export.py: logits equal ours and greedy
    tokens equal sample.py's (the random weights above show every part; this is the path a user takes)."""
    small = cpu_sized_preset(preset, data_cfg, tmp_path / "small.toml")
    TR.main(["--config", str(small), "--runs-dir", str(tmp_path), "--name", "r"])
    out = tmp_path / f"trained_{preset}"  # each its own module name in transformers
    E.main(["--ckpt", str(tmp_path / "r"), "--out", str(out)])
    assert_equal_logits(tmp_path / "r", out)
    assert_greedy_as_sample_py(tmp_path / "r", out, capsys)


def test_beam_search_through_the_cache_finds_the_beams_it_finds_without(run):
    """generate()'s beam search reorders its sequences, and their cache, at every step: through the cache it finds the
    beams that recomputing the whole sequence each step finds, the newest parts' predecessors included."""
    folder, out = run
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok(PROMPT, return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=12, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        assert torch.equal(load(out).generate(prompt, **settings), load(out).generate(prompt, use_cache=False, **settings))


def test_the_test_fails_when_the_exported_model_drops_a_recipe_part(run, tmp_path):
    """The logits comparison above sees a recipe part the exported model.py leaves out: here the soft-cap."""
    folder, out = run
    broken = tmp_path / f"broken_{out.name}"
    shutil.copytree(out, broken)
    source = (broken / "model.py").read_text()
    line = "        return softcap(F.linear(x, weight), self.cap, self.shift, self.temperature)\n"
    assert source.count(line) == 1
    (broken / "model.py").write_text(source.replace(line, "        return F.linear(x, weight)\n"))
    ours = CK.load(folder, "cpu").build_model().eval()
    idx = torch.randint(0, ours.cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(idx) - load(broken)(idx).logits).abs().max().item() > 1e-2


def test_the_export_names_its_source_and_says_how_to_load_it(run, capsys, tmp_path):
    folder, _ = run
    E.main(["--ckpt", str(folder), "--out", str(tmp_path / "again")])
    said = capsys.readouterr().out
    assert "onegpu's own model, as model.logit_softcap" in said and "trust_remote_code=True" in said
    hashes = json.loads((tmp_path / "again" / "config.json").read_text())["onegpu_source_sha256"]
    assert set(hashes) == set(CK.OWN_SOURCES) and all(len(h) == 64 for h in hashes.values())
    shipped = (tmp_path / "again" / "model.py").read_text()
    flat = (CK.ROOT / "model.py").read_text()
    assert all(relative in shipped for relative in CK.PACKAGE_IMPORTS.values()) and shipped == CK.packaged(flat)
    assert shipped != flat and (tmp_path / "again" / "model_checks.py").read_text() == (CK.ROOT / "model_checks.py").read_text()


def test_left_padding_is_refused_in_one_line_and_right_padding_changes_nothing(run):
    _, out = run
    hf = load(out)
    idx = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = hf(idx).logits
        right = hf(idx, attention_mask=torch.tensor([[1] * 10 + [0] * 2])).logits
        assert torch.equal(plain, right)
        with pytest.raises(ValueError, match="^attention_mask pads a row before or between its tokens: .* pad on the right"):
            hf(idx, attention_mask=torch.tensor([[0] * 2 + [1] * 10]))


def test_labels_give_the_mean_next_token_loss(run):
    folder, out = run
    ours = CK.load(folder, "cpu").build_model().eval()
    idx = torch.randint(0, ours.cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loss = load(out)(idx, labels=idx).loss
        assert abs(loss.item() - ours(idx[:, :-1], idx[:, 1:]).item()) < 1e-5


def test_generation_past_the_context_is_refused_in_one_line(run):
    _, out = run
    hf = load(out)
    prompt = torch.zeros((1, 120), dtype=torch.long)
    with pytest.raises(ValueError, match="tokens is longer than this model's context of 128: generate at most"):
        hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)


def test_a_stock_export_forced_over_our_own_leaves_none_of_its_sources(run, tmp_path):
    """--force writes into a folder an earlier export filled: a stock class's export there removes our model's
    source files, which its config.json no longer names."""
    folder, out = run
    again = tmp_path / "again"
    shutil.copytree(out, again)
    ckpt = CK.load(folder, "cpu")
    stock = dataclasses.replace(C.preset("tiny").model, vocab_size=ckpt.config.model.vocab_size)
    tiny = dataclasses.replace(C.preset("tiny"), model=stock, data=ckpt.config.data)  # a stock class computes it
    plain = dataclasses.replace(ckpt, config=tiny, model=M.Llama(stock).state_dict())
    E.export(plain, CK.tokenizer_for(ckpt)[1], again)
    assert {p.name for p in again.iterdir()} == set(E.STOCK_FILES)
