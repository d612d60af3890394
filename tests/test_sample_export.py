import dataclasses
import io
import json

import pytest
import torch

import checkpoint as CK
import export as E
import fastpaths as FP
import generate as G
import measure as ME
import model as M
import sample as S
import train as TR
from conftest import tiny_model_cfg, tiny_run_config


@pytest.fixture(scope="module")
def run_dir(data_cfg, tmp_path_factory):
    """A checkpoint trained for a few steps, so its predictions are not uniform."""
    cfg = tiny_run_config(data_cfg, tiny_model_cfg(n_kv_heads=1, n_heads=2, d_model=128), steps=8, eval_every=8,
                          ckpt_every=8)
    folder = tmp_path_factory.mktemp("runs") / "tiny"
    TR.train(cfg, folder, log=lambda *a, **k: None)
    return folder


@pytest.fixture(scope="module")
def loaded(run_dir):
    ckpt = CK.load(run_dir, "cpu")
    tok, tok_path = CK.tokenizer_for(ckpt)
    return ckpt, tok, tok_path, ckpt.build_model().eval()


def greedy(model, ids, n, **kwargs):
    return G.generate_batch(model, ids, 1, n, 0.0, 0, 1.0, None, **kwargs)[0][0]


# --- sample.py -----------------------------------------------------------------------------

def test_greedy_with_cache_equals_without(loaded):
    ckpt, tok, _, model = loaded
    ids = tok.encode("# document 3\n").ids
    with_cache = greedy(model, ids, 40)
    assert with_cache == greedy(model, ids, 40, use_cache=False) and len(with_cache) == 40


@pytest.mark.slow
def test_greedy_step_compiled_as_the_graph_decoder_compiles_it_gives_the_same_tokens(loaded, monkeypatch):
    """GraphDecoder compiles greedy_step whole, reading the whole cache, and replays it: the step writes its
    token and position in place, and Inductor must keep every read of the position before the increment.
    Here the same compiled step runs eagerly on the CPU, each step as a replay would."""
    ckpt, tok, _, model = loaded
    ids = tok.encode("# document 3\n").ids
    eager = greedy(model, ids, 20)
    step = torch.compile(G.greedy_step, fullgraph=True, dynamic=False)
    monkeypatch.setattr(G, "greedy_step", lambda model, token, pos, window: step(model, token, pos, model.cfg.context))
    assert greedy(model, ids, 20) == eager


def test_the_graph_decoders_greedy_loop_feeds_itself(loaded, monkeypatch):
    """GraphDecoder.greedy's bookkeeping on a CPU, its capture replaced by a stand-in whose replay runs
    the step `steps` times on the captured buffers, as the CUDA graph does: the eager tokens, with 8 tokens a
    replay and the last 3 of 19 one a replay, and with one a replay; two graphs (greedy_step's of 8 steps and
    of one) for the batch, and the profile moving the larger one's position back before it replays. Random
    weights and an untied head, whose greedy tokens vary (a token yielded twice or out of order would show)."""
    torch.manual_seed(0)
    model = M.Llama(dataclasses.replace(loaded[3].cfg, tie_embeddings=False, zero_init=False)).eval()
    ids = [1, 2, 3, 4, 5]

    class Graph:
        def __init__(self, fn, token, pos, steps, recent):
            self.fn, self.token, self.pos, self.steps, self.recent = fn, token, pos, steps, recent

        def replay(self):
            for _ in range(self.steps):
                self.fn(model, self.token, self.pos, model.cfg.context, self.recent)

    def capture(decoder, token, pos, fn, steps):
        token_in, pos_in = token.clone(), pos.clone()
        recent = token.new_zeros(decoder.tokens_per_replay, *token.shape)
        return Graph(fn, token_in, pos_in, steps, recent), token_in, pos_in, recent
    monkeypatch.setattr(G.GraphDecoder, "capture", capture)
    assert greedy(model, [9, 8, 7], 20, decode=G.GraphDecoder(model, tokens_per_replay=1)) == greedy(model, [9, 8, 7], 20)
    decode = G.GraphDecoder(model)
    assert decode.tokens_per_replay == 8
    assert greedy(model, [9, 8, 7], 20, decode=decode) == greedy(model, [9, 8, 7], 20)
    assert greedy(model, ids, 20, decode=decode) == greedy(model, ids, 20)  # the same graphs, new inputs
    graphs = {key[3]: (key, graph) for key, graph in decode.graphs.items()}
    assert sorted(graphs) == [1, 8] and all(key[0] == 1 and key[2] is G.greedy_step for key, _ in graphs.values())
    (graph8, _, pos8, _), (_, _, pos1, _) = graphs[8][1], graphs[1][1]
    assert pos8.item() == len(ids) + 16 and pos1.item() == len(ids) + 19  # 2 replays of 8 after the first token, 3 of 1
    assert ME.decode_graph(decode, 1, 1) == (graph8, 8) and pos8.item() == len(ids) + 8


def test_dependent_launches_reach_every_decode_kernel_only_where_the_card_has_them(loaded, monkeypatch):
    """decode_pdl: generate.apply hands the card's answer (onegpu_kernels.dependent_launch) to each decode
    kernel's swap, and the graph decoder compiles its step with the mode's own options plus Inductor's PDL, once
    per mode and setting. The launches themselves are the GPU tests' (test_gpu.py) and the Hopper builds'."""
    cfg = dataclasses.replace(loaded[3].cfg, mlp="relu2", value_embeds=1)
    speed = FP.SpeedConfig(fused_decode=True, decode_mlp=True, decode_pdl=True)
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw["options"]) or fn)
    monkeypatch.setattr(G.K, "device_supported", lambda device: True)  # a GPU's answer, on this CPU
    for card, expected in ((False, False), (True, True)):
        monkeypatch.setattr(G.K, "dependent_launch", lambda device: card)
        model = M.Llama(cfg).eval()
        G.apply(model, speed, torch.device("cpu"))
        modules = [m for m in model.modules() if isinstance(m, (G.FusedDecodeAttention, G.DecodeReLU2))]
        assert len(modules) == 2 * cfg.n_layers and model.dependent_launches is expected
        assert type(model) is G.GatheredValues  # a decoded token's value rows gathered before the first layer
        assert all(m.pdl is expected for m in modules)
        G.GraphDecoder(model, "max-autotune-no-cudagraphs").step(1)
    assert compiled == [{"max_autotune": True, "coordinate_descent_tuning": True},
                        {"max_autotune": True, "coordinate_descent_tuning": True, "triton.enable_pdl": True}]
    model = M.Llama(cfg).eval()
    G.apply(model, dataclasses.replace(speed, decode_pdl=False), torch.device("cpu"))  # the card has them, the switch is off
    assert not model.dependent_launches and G.compile_options("default", False) == {}


def test_batch_of_n_equals_n_single_runs(loaded):
    ckpt, tok, _, model = loaded
    ids = tok.encode("the").ids
    batch, _ = G.generate_batch(model, ids, 3, 25, 0.0, 0, 1.0, None)
    assert batch == [greedy(model, ids, 25)] * 3


def test_sampling_with_a_seed_is_reproducible(loaded):
    ckpt, tok, _, model = loaded
    runs = [G.generate_batch(model, [5, 6], 2, 30, 0.9, 20, 0.9, torch.Generator().manual_seed(4))[0] for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]  # same seed, same text; the two samples differ


def test_streamed_text_is_the_decoded_tokens(loaded):
    ckpt, tok, _, model = loaded
    out = io.StringIO()
    printer = S.StreamPrinter(tok, out)
    new, _ = G.generate_batch(model, tok.encode("the").ids, 1, 30, 0.9, 20, 0.9, torch.Generator().manual_seed(1),
                              on_token=printer)
    printer.finish()
    assert out.getvalue() == tok.decode(new[0]) + "\n"
    # Characters of several bytes, split over byte-level tokens: shown only once whole.
    ids = tok.encode("naïve café — 😀 fin").ids
    out = io.StringIO()
    printer = S.StreamPrinter(tok, out)
    for i in ids:
        printer(0, torch.tensor([i]))
        assert "\ufffd" not in out.getvalue()
    printer.finish()
    assert out.getvalue() == tok.decode(ids) + "\n" and len(ids) > len("naïve café — 😀 fin".split())


def test_sampling_respects_top_k_and_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    draws = {G.sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {0, 1}
    # softmax is about [0.705, 0.259, 0.035, 0.0]: top_p 0.9 keeps the first two
    draws = {G.sample_next(logits, 1.0, top_p=0.9, generator=g).item() for _ in range(200)}
    assert draws == {0, 1}
    assert G.sample_next(logits, 0.0).item() == 0


@pytest.mark.parametrize("args, message", [
    (dict(temperature=-1.0), r"--temperature -1.0: must be >= 0"),
    (dict(top_p=0.0), r"--top-p 0.0: must be in \(0, 1\]"),
    (dict(top_p=1.5), r"--top-p 1.5: must be in \(0, 1\]"),
    (dict(top_k=-3), r"--top-k -3: must be >= 0"),
])
def test_invalid_settings_are_clear_errors(args, message):
    settings = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 10, "num_samples": 1, **args}
    with pytest.raises(ValueError, match=message):
        S.check_settings(**settings)


def test_long_prompt_is_cut_with_a_warning(loaded):
    ckpt, tok, _, model = loaded
    warnings = []
    ids = S.prompt_ids(tok, "word " * 500, model.cfg.context, warn=warnings.append)
    assert len(ids) == model.cfg.context - 1 and "keeping its last 63" in warnings[0]
    assert ids == tok.encode("word " * 500).ids[-63:]


def test_tokenizer_mismatch_is_refused(loaded, tmp_path):
    ckpt, tok, tok_path, _ = loaded
    other = tmp_path / "tokenizer.json"
    data = json.loads(tok_path.read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"has hash [0-9a-f]{16}, but the checkpoint was trained with tokenizer"):
        CK.tokenizer_for(ckpt, str(other))


def test_sample_command_runs(run_dir, capsys):
    S.main(["--ckpt", str(run_dir), "--prompt", "the", "--max-new-tokens", "12", "--num-samples", "2", "--seed", "3",
            "--device", "cpu"])
    captured = capsys.readouterr()
    assert captured.out.count("--- sample") == 2 and "[KV cache, cpu, batch 2: first token after" in captured.err
    assert "tok/s decoding 11 more per sample" in captured.err


def test_no_fused_decode_turns_off_every_decode_path(run_dir, monkeypatch, capsys):
    """--no-fused-decode loads the checkpoint with the fused decode step, its split, the decode matmuls, the
    decode MLP and the dependent launches off, so a GPU decodes with plain PyTorch, launched plainly (on a
    CPU all are plain already)."""
    loads = []
    load = S.CK.load
    monkeypatch.setattr(S.CK, "load", lambda *a, **k: loads.append(k) or load(*a, **k))
    cpu = ["--device", "cpu"]  # the report names the device: a GPU machine runs this test on its CPU too
    S.main(["--ckpt", str(run_dir), "--prompt", "the", "--max-new-tokens", "3", "--no-fused-decode", *cpu])
    S.main(["--ckpt", str(run_dir), "--prompt", "the", "--max-new-tokens", "3", *cpu])
    S.main(["--ckpt", str(run_dir), "--prompt", "the", "--max-new-tokens", "3", "--split-decode", "--no-decode-mlp", *cpu])
    off = {"speed__fused_decode": False, "speed__split_decode": False, "speed__decode_matmuls": False,
           "speed__decode_mlp": False, "speed__decode_pdl": False}
    # each of generation's other switches on its own, the rest as the checkpoint has them
    assert loads == [off, {}, {"speed__split_decode": True, "speed__decode_mlp": False}]
    assert capsys.readouterr().err.count("[KV cache, cpu, batch 1: first token after") == 3  # all generated


def test_cached_decoding_feeds_one_token_per_step(loaded):
    """What makes the cache fast: after the prompt, each forward pass reads one token, not the
    whole sequence (docs/PERFORMANCE.md, Generation, has the measured speed-up)."""
    ckpt, tok, _, model = loaded
    lengths = []
    hook = model.embed.register_forward_hook(lambda mod, args, out: lengths.append(args[0].shape[1]))
    try:
        greedy(model, [5, 6, 7], 10)
        assert lengths == [3] + [1] * 9
        lengths.clear()
        greedy(model, [5, 6, 7], 10, use_cache=False)
        assert lengths == list(range(3, 13))
    finally:
        hook.remove()


# --- export.py -----------------------------------------------------------------------------

def test_export_loads_in_transformers_with_equal_logits(loaded, tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt, tok, tok_path, model = loaded
    E.export(ckpt, tok_path, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "# document 7\nthe tokens, and <|endoftext|> as text"  # the literal stays text, as in training
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids and hf_tok.eos_token == "<|endoftext|>"
    idx = torch.randint(0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    prompt = torch.tensor([tok.encode("the").ids])
    greedy_ours = greedy(model, prompt[0].tolist(), 20)
    greedy_hf = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                            min_new_tokens=20)[0, prompt.shape[1]:].tolist()
    assert greedy_ours == greedy_hf


def test_a_full_disk_during_export_is_one_line_and_leaves_no_folder(run_dir, tmp_path, monkeypatch):
    """safetensors reports a full disk with its own SafetensorError: the export says so in one line and removes
    what it wrote, and the folder it made, where it once printed a traceback and left an empty folder."""
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" })")
    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(SystemExit) as e:
        E.main(["--ckpt", str(run_dir), "--out", str(tmp_path / "hf")])
    message = str(e.value.code)
    assert message.startswith(f"error: writing {tmp_path / 'hf'} failed (Error while serializing") and "\n" not in message
    assert "nothing was left there" in message and not (tmp_path / "hf").exists()


def test_export_command_writes_the_files(run_dir, tmp_path, capsys):
    E.main(["--ckpt", str(run_dir), "--out", str(tmp_path / "hf")])
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    modes = {p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len(modes) == 1  # model.safetensors is readable as the other files are
    assert names == set(E.STOCK_FILES)  # and the message names every one of them
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'hf'}: {', '.join(E.STOCK_FILES)} (load with")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] == 1 and config["rope_theta"] == 10000.0


@pytest.mark.parametrize("mlp, qk_norm, architecture", [("swiglu", True, "Qwen3ForCausalLM"),
                                                        ("relu2", False, "ArceeForCausalLM"),
                                                        ("relu2", True, "ApertusForCausalLM")])
def test_each_architecture_exports_to_the_class_that_computes_it(loaded, tmp_path, mlp, qk_norm, architecture):
    """The recipe's options map onto transformers classes (checkpoint.HF_CLASSES), untied head
    included; logits agree within 1e-4. Norm gains are randomised so that a q_norm or k_norm
    exported to the wrong place would show."""
    transformers = pytest.importorskip("transformers")
    ckpt, _, tok_path, _ = loaded
    cfg = dataclasses.replace(ckpt.config.model, mlp=mlp, ffn_hidden=96, qk_norm=qk_norm, tie_embeddings=False)
    torch.manual_seed(0)
    model = M.Llama(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    E.export(dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, model=cfg), model=model.state_dict()),
             tok_path, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(idx) - hf(idx).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("setting, value, gap", [
    ("logit_softcap", 15.0, "no transformers class combines a logit soft-cap"),
    *[(name, value, "no transformers class computes it") for name, value in [
        ("embed_norm", True), ("value_embeds", 1), ("value_scale", True), ("unet_skips", True), ("x0_mix", True),
        ("rope_truncate", True), ("attn_gate", True), ("attn_window", 16), ("bigram_rows", 100), ("backout", True),
        ("smear", True)]],
    ("skip_attn_layer", 1, "no transformers class has a layer without attention"),
    ("attn_scale", 0.12, "transformers' Llama-family classes scale attention by 1/sqrt")])
def test_a_setting_no_stock_class_computes_exports_our_own_model(loaded, tmp_path, setting, value, gap):
    """Each of the record's settings: no stock class (stock_gap names it), so the folder holds our own model
    (tests/test_export_own.py loads it); hf_architecture still refuses it in one line."""
    ckpt, _, tok_path, _ = loaded
    part = dataclasses.replace(ckpt, config=dataclasses.replace(
        ckpt.config, model=dataclasses.replace(ckpt.config.model, **{setting: value})))
    assert CK.stock_gap(part.config.model).startswith(f"model.{setting}={value!r}: {gap}")
    with pytest.raises(ValueError, match=rf"^model\.{setting}=.*: export.py writes onegpu's own modeling file"):
        CK.hf_architecture(part.config.model)
    E.export(part, tok_path, tmp_path / "hf")
    assert {p.name for p in (tmp_path / "hf").iterdir()} == set(E.OWN_FILES)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["OnegpuForCausalLM"]


def test_todays_recipe_decodes_the_same_with_and_without_the_cache():
    """ReLU², QK-norm (its norms run before the cache write) and an untied, soft-capped head: the KV
    cache's greedy tokens equal the full recomputation's, as for the article's model."""
    cfg = M.ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=300, context=64, mlp="relu2",
                        qk_norm=True, tie_embeddings=False, logit_softcap=15.0)
    torch.manual_seed(0)
    model = M.Llama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    ids = [5, 6, 7]
    assert greedy(model, ids, 30) == greedy(model, ids, 30, use_cache=False)
