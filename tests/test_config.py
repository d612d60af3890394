"""config.py: strict TOML loading, range checks, flags generated from the dataclasses."""

import dataclasses

import pytest

import config as C
import fastpaths as FP
import model as M
import train as TR


@pytest.mark.parametrize("text, message", [
    ("[model]\nd_model = 64\nn_layer = 2\n", r"bad\.toml: unknown key\(s\) model\.n_layer; valid keys .* n_layers"),
    ("[model]\nd_model = \"wide\"\n", r"model\.d_model must be int, got str 'wide'"),
    ("[modle]\nd_model = 64\n", r"unknown section\(s\) \['modle'\]"),
    ("[train]\ncompile_mode = \"fast\"\n", r"train\.compile_mode='fast': choose one of 'default', 'coordinate-descent'"),
], ids=["unknown-key", "wrong-type", "unknown-section", "bad-choice"])
def test_config_file_unknown_key_and_wrong_type(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        C.load_config(path)


@pytest.mark.parametrize("override, message", [
    (dict(train__grad_clip=-1.0), r"train\.grad_clip=-1\.0 is out of range: it must be >= 0 \(0 turns clipping off"),
    (dict(train__warmup_steps=-5), r"train\.warmup_steps=-5 is out of range: it must be >= 0"),
    (dict(train__lr=0.0), r"train\.lr=0\.0 is out of range: it must be in \(0, 1\]"),
    (dict(train__beta2=1.0), r"train\.beta2=1\.0 is out of range: it must be in \[0, 1\)"),
    (dict(train__min_lr_ratio=2.0), r"train\.min_lr_ratio=2\.0 is out of range"),
    (dict(train__device="gpu"), r"train\.device='gpu': use auto, cpu, cuda or cuda:N"),
    (dict(data__shard_tokens=0), r"data\.shard_tokens=0 is out of range: it must be >= 1"),
    (dict(data__max_documents=-1), r"data\.max_documents=-1 is out of range"),
    (dict(data__val_fraction=0.0), r"data\.val_fraction=0\.0 is out of range: it must be in \(0, 1\), the share of"),
    (dict(data__val_fraction=1.0), r"data\.val_fraction=1\.0 is out of range: it must be in \(0, 1\)"),
    (dict(model__norm_eps=0.0), r"model\.norm_eps must be positive, got 0\.0"),
    (dict(speed__attention="fast"), r"speed\.attention='fast': choose one of 'sdpa'"),
])
def test_every_number_is_range_checked(override, message):
    with pytest.raises(ValueError, match=message):
        C.preset("tiny", **override)


def test_the_defaults_are_the_plain_path_each_setting_turns_something_on():
    """Defaults, then the file, then flags: with nothing set a run is fp32, eager, the AdamW recipe, with no speed
    setting and no fast path, so a config names everything it turns on and `--no-X` means the plain path."""
    train, speed = C.TrainConfig(steps=1), FP.SpeedConfig()
    inert = {"muon_tall_scale", "muon_shared"}  # how Muon runs, where muon is on
    on = sorted(f.name for f in dataclasses.fields(train) if f.name not in inert and getattr(train, f.name) is True)
    assert on == [] and (train.optimizer, train.compile_mode, train.window_start) == ("foreach", "default", 0)
    assert not any(getattr(speed, s) for s in (*FP.TRAINING_FAST_PATHS, *FP.GENERATION_FAST_PATHS))
    assert speed.attention == "sdpa"


def test_misspelled_override_is_an_error():
    with pytest.raises(ValueError, match=r"unknown key\(s\) train\.micro_batchs"):
        C.preset("tiny", train__micro_batchs=4)
    with pytest.raises(ValueError, match=r"override 'micro_batch'"):
        C.preset("tiny", micro_batch=4)


def test_every_flag_has_help_from_the_field_comment(capsys):
    with pytest.raises(SystemExit):
        TR.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--micro-batch INT" in text and "sequences per forward/backward" in text
    assert "--fused-loss, --no-fused-loss" in text and "--attention {sdpa,flash,cudnn,efficient,math,textbook}" in text
    for cls in C.SECTIONS.values():
        comments = C.field_comments(cls)
        assert set(comments) == set(C.field_types(cls)), f"{cls.__name__} has fields without a comment"


def test_a_misspelled_config_file_suggests_the_preset_and_lists_them():
    with pytest.raises(FileNotFoundError, match=r"configs/88M.toml does not exist: did you mean configs/88m.toml\? "
                                                r"the presets in .* are 126m, 126m-gpt3, 126m-muon, 126m-record, 22m,"):
        C.load_config("configs/88M.toml")
    with pytest.raises(FileNotFoundError, match=r"nothing.toml does not exist: the presets in"):
        C.load_config("nothing.toml")


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"preset '99m' does not exist: choose one of \['126m', '126m-gpt3', '126m-muon', '126m-record', '22m'"):
        C.preset("99m")


# One value outside each train field's range, per field TRAIN_RANGES checks. The first test fails
# when a range is dropped from the table (or added without a value here), the second when a
# check stops refusing.
OUT_OF_RANGE = {
    "batch_tokens": 0, "micro_batch": 0, "eval_every": 0, "eval_tokens": 0, "ckpt_every": 0, "warmup_steps": -1,
    "steps": -1, "tokens": -1, "seconds": -1.0, "seed": -1, "sample_tokens": -1, "weight_decay": -0.1,
    "peak_tflops": -1.0, "window_start": -1, "lr": 1.5, "min_lr_ratio": -0.1, "beta1": 1.0, "beta2": -0.1,
    "grad_clip": -1.0, "warmdown_fraction": 0.0, "muon_lr": 0.0, "muon_momentum": 1.0, "muon_weight_decay": -1.0,
    "muon_momentum_warmup": -1, "mtp_tokens": 0, "prefix_weight": 1.5, "batch_stages": 0, "muon_momentum_start": 1.0, "embed_lr": 11.0, "head_lr": -1.0, "scalar_lr": 20.0,
    "adam_eps": 0.0, "muon_beta2": 1.0, "muon_momentum_cooldown": -1, "untie_at": 1.5,
    "head_beta1": 1.0, "embed_beta1": -0.5, "scalar_beta1": 1.5, "scalar_beta2": -0.1,
    "adam_weight_decay": 2.0,
}


def test_every_train_range_has_a_value_outside_it():
    assert set(OUT_OF_RANGE) == set(C.TRAIN_RANGES)


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_each_train_range_refuses_a_value_outside_it(name):
    with pytest.raises(ValueError, match=rf"train\.{name}=.* is out of range: it must be"):
        C.TrainConfig(**{"steps": 1, name: OUT_OF_RANGE[name]})


# The same for ModelConfig's checks: one value outside each numeric field's range, and the start of the
# message that refuses it. The first test fails when a numeric field is added without a check here.
MODEL_OUT_OF_RANGE = {
    **{name: (0, rf"model\.{name} must be positive") for name in
       ("d_model", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "context")},
    "vocab_size": (70000, r"model\.vocab_size=70000 is more than 65,536"),
    "ffn_hidden": (-1, r"model\.ffn_hidden must be >= 0"),
    "rope_theta": (0.0, r"model\.rope_theta must be positive, got 0\.0"),
    "norm_eps": (0.0, r"model\.norm_eps must be positive, got 0\.0"),
    "logit_softcap": (-1.0, r"model\.logit_softcap must be >= 0"),
    "logit_temperature": (-1.0, r"model\.logit_temperature must be >= 0 \(0: the cap\)"),
    "logit_shift": (float("inf"), r"model\.logit_shift=inf is not a finite number"),
    "value_embeds": (2, r"model\.value_embeds=2: the first and the last"),  # 2 layers hold one table each side
    "attn_window": (-1, r"model\.attn_window must be >= 0"),
    "rope_yarn": (-1, r"model\.rope_yarn must be >= 0 \(0: off\), got -1"),
    "attn_scale": (-0.1, r"model\.attn_scale must be >= 0"),
    "skip_attn_layer": (2, r"model\.skip_attn_layer=2 is not a layer after the first of 2"),
    "bigram_rows": (1, r"model\.bigram_rows=1: give 0 \(no bigram table\) or at least 2 rows"),
    "mimetic_init": (-0.05, r"model\.mimetic_init must be >= 0 \(0: off\)"),
}


def test_every_numeric_model_field_has_a_value_outside_its_range():
    numeric = {f.name for f in dataclasses.fields(M.ModelConfig) if f.type in (int, float, "int", "float")}
    assert set(MODEL_OUT_OF_RANGE) == numeric


@pytest.mark.parametrize("name", sorted(MODEL_OUT_OF_RANGE))
def test_each_model_range_refuses_a_value_outside_it(name):
    value, message = MODEL_OUT_OF_RANGE[name]
    with pytest.raises(ValueError, match=message):
        M.ModelConfig(**{"n_layers": 2, name: value})
    with pytest.raises(ValueError, match=r"^flags \(.*--" + name.replace("_", "-")):  # named as a flag's value
        C.load_config(C.PRESETS_DIR / "tiny.toml", **{"model__n_layers": 2, f"model__{name}": value})


@pytest.mark.parametrize("name", ["tiny", "22m", "47m", "88m", "126m"])
def test_each_muon_preset_is_its_article_preset_plus_the_one_shared_muon_recipe(name):
    """A change of the Muon recipe edits configs/recipes/muon.toml alone: no Muon preset restates it."""
    import tomllib
    raw = tomllib.loads((C.PRESETS_DIR / f"{name}-muon.toml").read_text())
    assert raw.pop("extends") == [f"{name}-gpt3", "recipes/muon.toml"]
    assert raw == ({} if name == "tiny" else {"train": {"batch_tokens": 262144}})  # half the article's batch
    assert_holds(C.preset(f"{name}-muon"), "muon.toml")


# What a default preset may say beside its Muon preset and the record recipe: the record's shape at its
# width and its micro-batch (tests/test_recipes.py checks their values against recipes.record_recipe), and
# the speed settings a preset turns on only where they were measured to pay (and, for FP8 block matmuls, to learn
# as well): configs/88m.toml.
OWN_SETTINGS = {"model": {"n_layers", "n_heads", "n_kv_heads", "value_embeds", "skip_attn_layer"},
                "speed": {"fp8", "fused_qk_norm_rope"}, "train": {"micro_batch"}}


@pytest.mark.parametrize("name", ["22m", "47m", "88m", "126m-record"])
def test_each_default_preset_is_its_muon_preset_plus_the_one_shared_record_recipe(name):
    """A change of the default recipe edits configs/recipes/record.toml alone; a preset adds only its shape."""
    import tomllib
    raw = tomllib.loads((C.PRESETS_DIR / f"{name}.toml").read_text())
    assert raw.pop("extends") == [f"{name.split('-')[0]}-muon", "recipes/record.toml"]
    assert set(raw) <= set(OWN_SETTINGS) and all(set(raw[s]) <= OWN_SETTINGS[s] for s in raw)
    assert_holds(C.preset(name), "record.toml")


def test_the_126m_default_is_record_28s_preset_plus_the_newest_ideas_and_nothing_of_its_own():
    """A change of the newest ideas 126m adopted edits configs/recipes/newest.toml alone: 126m.toml says nothing
    else, so record #28's recipe at 126m (126m-record.toml) is the default with that file left out."""
    import tomllib
    assert tomllib.loads((C.PRESETS_DIR / "126m.toml").read_text()) == {"extends": ["126m-record", "recipes/newest.toml"]}
    assert_holds(C.preset("126m"), "newest.toml")
    assert C.preset("126m").model.n_layers == C.preset("126m-record").model.n_layers - 1


def test_tiny_keeps_the_muon_recipe():
    """The CPU preset stays on the Muon recipe (configs/tiny.toml says why): it is tiny-muon, unchanged."""
    import tomllib
    assert tomllib.loads((C.PRESETS_DIR / "tiny.toml").read_text()) == {"extends": "tiny-muon"}
    assert C.preset("tiny") == C.preset("tiny-muon")


def assert_holds(cfg: C.Config, recipe: str, skip: set = frozenset()):
    """Every setting of configs/recipes/<recipe> but those in skip is the preset's (ffn_hidden 0: resolved to a
    width)."""
    for section, table in C.read_toml(C.PRESETS_DIR / "recipes" / recipe).items():
        for key, value in table.items():
            holds = getattr(getattr(cfg, section), key) == value or (key == "ffn_hidden" and value == 0)
            assert holds or (section, key) in skip, key



def test_a_speed_key_under_model_loads_from_old_files_and_checkpoints(tmp_path):
    """The speed switches were [model] keys until the [speed] section: a file or a saved config that names them
    there loads as if it named them under [speed], a flag in either spelling lands there, and [speed] wins."""
    old = tmp_path / "old.toml"
    old.write_text('extends = "tiny"\n[model]\nfp8 = true\nloss_kernel = true\n[speed]\nloss_kernel = false\n')
    cfg = C.load_config(old)
    assert (cfg.speed.fp8, cfg.speed.loss_kernel) == (True, False) and not hasattr(cfg.model, "fp8")
    assert C.load_config(old, model__bf16_residual=True).speed.bf16_residual
    saved = dataclasses.asdict(C.preset("tiny"))
    saved["model"]["fused_loss"] = True
    del saved["speed"]
    assert C.load_config(values=saved).speed.fused_loss


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("section", ["model", "data", "train"])
def test_every_float_setting_refuses_nan_and_inf(section, bad):
    """A NaN or an infinity in a file or a flag is one line naming the key and the file, for every float field
    (`--attn-scale inf` and `logit_softcap = nan` used to start a run that failed at step 0)."""
    cls = C.SECTIONS[section]
    floats = [f.name for f in dataclasses.fields(cls) if f.type in (float, "float")]
    assert floats
    for name in floats:
        with pytest.raises(ValueError, match=rf"^flags \(--{name.replace('_', '-')}\): {section}\.{name}=.* is not a finite"):
            C.preset("tiny", **{f"{section}__{name}": bad})


def test_a_config_error_names_the_file_that_holds_the_key(tmp_path):
    """A typo in a file that another extends is blamed on that file, not on the child; a check across sections
    (the window schedule against the window) names the file too."""
    (tmp_path / "parent.toml").write_text('extends = "tiny"\n[train]\nstepz = 3\n')
    (tmp_path / "child.toml").write_text('extends = "parent.toml"\n[train]\nsteps = 3\n')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'parent.toml'}: unknown key\(s\) train\.stepz"):
        C.load_config(tmp_path / "child.toml")
    (tmp_path / "w.toml").write_text('extends = "tiny"\n[model]\nattn_window = 64\n[train]\nwindow_start = 128\n')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'w.toml'}: train\.window_start=128 grows the window"):
        C.load_config(tmp_path / "w.toml")


def test_yarn_stretches_rope_from_the_window_the_run_starts_at():
    """model.rope_yarn is the window RoPE is first trained over: it must be train.window_start."""
    assert C.preset("126m", model__rope_yarn=128).model.rope_yarn == 128
    with pytest.raises(ValueError, match=r"model.rope_yarn=256 is the window RoPE is first trained over, but "
                                         r"train.window_start=128: set them equal \(the window the run starts at\)$"):
        C.preset("126m", model__rope_yarn=256)


def test_a_head_tied_for_part_of_the_run_needs_an_untied_model_started_fresh():
    """train.untie_at ties an untied head through the optimizer: refused with a tied model (one matrix all along)
    and with train.init_from (trained weights, head and embedding apart), each naming what to set."""
    with pytest.raises(ValueError, match=r"train.untie_at=0.5 ties an untied head .* model.tie_embeddings makes them"):
        C.preset("tiny", train__untie_at=0.5)
    with pytest.raises(ValueError, match=r"train.untie_at=0.5 starts .* train.init_from .* set train.untie_at 0"):
        C.preset("tiny", train__untie_at=0.5, model__tie_embeddings=False, train__init_from="runs/x")
    assert C.preset("tiny", train__untie_at=0.5, model__tie_embeddings=False).train.untie_at == 0.5
