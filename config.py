"""Reading configs: TOML files and command-line flags into checked dataclasses.

The one place settings are read. A config file has four sections a person edits by hand:

    [model]   ModelConfig (model.py): what the network computes, its shape and recipe
    [speed]   SpeedConfig (fastpaths.py): how fast: the fast paths swapped in and the attention kernel
    [data]    DataConfig (here): corpus, tokenizer and shard cache
    [train]   TrainConfig (here): batch, schedule, precision and compile flags

A key that moved between sections still loads from older files and checkpoints: the speed switches were
[model] keys until 2026-12-06 (MOVED).

Defaults come from the dataclasses, the file overrides them, flags override the file. One rule for
every default: the dataclass holds the plain path (the article's recipe, FP32, no compile, no fused
kernel), so a config or a checkpoint that does not name a setting runs it plainly, and the presets
in configs/ turn on what was measured to pay. A typo
must never pass silently: unknown keys and wrong types are errors naming the key, the file and
what is allowed, and every number has its range checked in the dataclass it belongs to.
Every field is also a flag (`--micro-batch 32`, `--no-compile`) whose help is the field's comment.

DataConfig and TrainConfig live here rather than in data.py and train.py so that every module
reads settings from one place, and imports run one way: config.py imports only model.py and fastpaths.py.
"""

import argparse
import dataclasses
import difflib
import inspect
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

import fastpaths as FP
import model as M

PRESETS_DIR = Path(__file__).resolve().parent / "configs"
# torch.compile's modes, and coordinate-descent: the default mode with Inductor's coordinate-descent
# tuning of the launch settings of the kernels it generates (the elementwise and reduction work),
# without max-autotune's matmul autotuning (max-autotune turns both on). Not the default: on an H200
# it gave +0.8% (88m) and -0.7% (126m) for about 2 minutes of tuning the first time a shape compiles
# (docs/performance/training-speed.md), which a run of under four hours does not earn back.
CompileMode = Literal["default", "coordinate-descent", "reduce-overhead", "max-autotune-no-cudagraphs",
                      "max-autotune"]
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
Schedule = Literal["cosine", "wsd"]
MuonIteration = Literal["newton-schulz", "polar-express"]
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # what train.device and the --device flags accept


@dataclass
class DataConfig:
    corpus: str = "stdlib"  # stdlib | python | tinystories | fineweb-edu | path or glob of text/.jsonl/.parquet files
    text_field: str = "text"  # field holding the text in .jsonl/.parquet records
    val_fraction: float = 0.05  # share of documents held out for validation
    max_documents: int = 0  # stop reading the corpus after this many documents (0: all of it)
    tokenizer_documents: int = 0  # documents the BPE trains on (0: the same as max_documents)
    shard_tokens: int = 100_000_000  # tokens per shard file (about 200 MB)
    cache_dir: str = ""  # tokenizers and shards; "" means $ONEGPU_CACHE or ./cache
    tokenizer_file: str = ""  # a tokenizer.json to tokenize with instead of training one ("": train the corpus' own)

    def __post_init__(self):
        check_finite(self, "data")
        if not 0 < self.val_fraction < 1:  # training evaluates on the held-out share: none leaves it nothing to score
            raise ValueError(f"data.val_fraction={self.val_fraction!r} is out of range: it must be in (0, 1), the "
                             f"share of documents held out for validation")
        for name, low in (("max_documents", 0), ("tokenizer_documents", 0), ("shard_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"data.{name}={getattr(self, name)!r} is out of range: it must be >= {low}")


@dataclass
class TrainConfig:
    batch_tokens: int = 524_288  # tokens per optimizer step, all ranks (GPT-3 125M's 0.5M)
    micro_batch: int = 16  # sequences per forward/backward; the rest is gradient accumulation
    lr: float = 6e-4  # peak AdamW learning rate (GPT-3's for 125M)
    schedule: Schedule = "cosine"  # cosine: decay all the way; wsd: stable, then a linear warm-down (optim.lr_at)
    min_lr_ratio: float = 0.1  # the schedule ends at this share of lr (Llama, GPT-3: 0.1)
    warmdown_fraction: float = 0.4  # wsd: share of the steps spent in the linear warm-down
    warmup_steps: int = 200  # linear warm-up steps
    steps: int = 0  # optimizer steps; 0 means tokens // batch_tokens
    tokens: int = 0  # training tokens, used when steps is 0
    seconds: float = 0.0  # or a budget of training seconds: the steps are sized from the first steps' speed (wsd)
    weight_decay: float = 0.1  # AdamW's, on block matrices only (see optim.param_groups)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    muon: bool = False  # Muon on the block matrices, AdamW (at lr) on the embedding, head and gains
    muon_lr: float = 0.02  # Muon's peak learning rate (modded-nanogpt, nanochat: 0.02-0.05)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_weight_decay: float = 0.0  # Muon's decoupled weight decay, times Muon's scheduled lr
    muon_cautious: bool = False  # decay only the entries the update moves toward zero too (cautious weight decay)
    # AdamW's embeddings and head decay too, cautiously, lr^2 x this x their role's multiplier (optim.ADAM_DECAY)
    adam_weight_decay: float = 0.0  # 0: off (records #50 on: 0.005)
    # onegpu's MLP up-projection (ffn x d) is tall: it steps at 2x muon_lr with this scale. modded-nanogpt's
    # record #28 stores that matrix transposed (d x ffn), so every update there is scaled by 1.
    muon_tall_scale: bool = True  # a tall (rows > cols) matrix's update times sqrt(rows / cols) (Jordan's)
    muon_shared: bool = True  # under torchrun each rank orthogonalises a share of the matrices (optim.Muon)
    muon_kernel: bool = False  # Newton-Schulz's symmetric products as onegpu_kernels.gram, half their tiles (CUDA)
    muon_iteration: MuonIteration = "newton-schulz"  # Muon's orthogonalisation: newton-schulz or polar-express (optim.py)
    muon_beta2: float = 0.0  # NorMuon: each neuron's update over its RMS's EMA with this decay; 0: off (record: 0.95)
    muon_momentum_warmup: int = 0  # steps over which Muon's momentum rises from muon_momentum_start (modded-nanogpt: 300)
    muon_momentum_start: float = 0.85  # Muon's momentum at step 0 when muon_momentum_warmup > 0 (modded-nanogpt's)
    muon_momentum_cooldown: int = 0  # last steps over which it falls back to muon_momentum_start (modded #39: 50)
    mtp_tokens: int = 1  # tokens each position's logits learn to predict, the later ones fading out (modded #53: 3)
    prefix_weight: float = 0.0  # the logits also learn the next token's longest prefix token at this weight (#88: 0.25)
    # the head and the token embedding step as one matrix until this share of the run, then apart (modded #51, #53: 2/3)
    untie_at: float = 0.0  # 0: apart from the first step; 1: one matrix all run (optim.tie_head)
    batch_stages: int = 1  # the batch grows over the run in this many equal steps to batch_tokens (modded #46: 3)
    embed_lr: float = 0.0  # AdamW lr of the token and value embeddings; 0: lr (modded-nanogpt: 0.6)
    head_lr: float = 0.0  # AdamW lr of an untied head; 0: lr (modded-nanogpt: 0.008)
    scalar_lr: float = 0.0  # AdamW lr of the norm gains and mixing scalars; 0: lr (modded-nanogpt: 0.04)
    # each AdamW group's own betas, 0: beta1 / beta2 (modded-nanogpt since #52 and #57: the head and the embedding
    # tied to it 0.5, the value and bigram tables 0.75, the scalars 0.9 and 0.99; beta2 0.95 elsewhere)
    head_beta1: float = 0.0  # AdamW beta1 of the head and of the embedding where it steps as the head
    embed_beta1: float = 0.0  # AdamW beta1 of the value and bigram tables and an untied token embedding
    scalar_beta1: float = 0.0  # AdamW beta1 of the norm gains and mixing scalars
    scalar_beta2: float = 0.0  # AdamW beta2 of the norm gains and mixing scalars
    adam_eps: float = 1e-8  # AdamW's epsilon (torch's default; modded-nanogpt: 1e-10 on a loss summed, not averaged)
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping (and the norm's cost) off
    eval_every: int = 250  # steps between validation passes (and at the end)
    eval_tokens: int = 1_048_576  # validation tokens per pass
    ckpt_every: int = 250  # steps between checkpoints (and at the end, and on Ctrl-C/SIGTERM)
    seed: int = 1337  # seeds the init, the data order and sampling
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    tf32: bool = False  # TF32 tensor-core matmuls for float32 (CUDA)
    bf16: bool = False  # bfloat16 autocast; float32 master weights and optimizer (CUDA)
    fp16: bool = False  # float16 autocast with a gradient scaler instead (GPUs without bf16; set for them by itself)
    compile: bool = False  # torch.compile the model
    # CUDA graphs ("reduce-overhead") ran 88m's defaults at 0.68x of the default mode on one H100, and compiled
    # BF16 at 1.003x (docs/LOG.md, 2026-12-05).
    compile_mode: CompileMode = "default"  # torch.compile mode, or coordinate-descent (default + kernel tuning)
    optimizer: Literal["fused", "foreach", "for-loop"] = "foreach"  # AdamW implementation
    pin: bool = False  # pinned host memory, non_blocking copies, each step's first micro-batch drawn ahead (CUDA)
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~30% more compute
    recompute_mlp: bool = False  # recompute each block's norm + MLP in backward: its wide activations, ~10% more compute
    doc_mask: bool = False  # attend only within each packed document
    window_start: int = 0  # sliding window at step 0, grown linearly to model.attn_window by the end (0: no schedule)
    overfit_batch: bool = False  # train on one fixed micro-batch: the loss must go to ~0
    skip_nonfinite: bool = False  # skip (and count) steps with a NaN/inf loss instead of stopping
    peak_tflops: float = 0.0  # dense BF16 peak for MFU; 0 looks the GPU up by name
    sample_tokens: int = 200  # tokens of text generated at the end of the run
    init_from: str = ""  # a run folder or ckpt.pt whose weights (and model config) a new run starts from
    tensorboard: bool = False  # also write the log's curves for TensorBoard, to <run>/tensorboard (pip install tensorboard)
    wandb: bool = False  # also log them to Weights & Biases (boards.py; pip install wandb; WANDB_MODE=offline works offline)
    wandb_project: str = "onegpu"  # the W&B project; the W&B run is named after the run folder
    sample_prompt: str = "def "  # the text the end-of-run sample starts from (presets on English text: "The")

    def __post_init__(self):
        check_finite(self, "train")
        check_ranges(self, "train", TRAIN_RANGES)
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"train.device={self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.steps <= 0 and self.tokens <= 0 and self.seconds <= 0:
            raise ValueError("set train.steps, train.tokens or train.seconds (how long to train)")
        if self.seconds and self.tokens and not self.steps:
            raise ValueError(f"train.seconds={self.seconds:g} and train.tokens={self.tokens:,} both say how long to "
                             f"train: set one of them to 0")
        if self.seconds and self.schedule != "wsd":
            raise ValueError("train.seconds sizes the run after its first steps, which a cosine schedule cannot "
                             "allow (its rate depends on the length from step 0): use schedule = \"wsd\"")


AT_LEAST_ONE, NOT_NEGATIVE = (lambda v: v >= 1, ">= 1"), (lambda v: v >= 0, ">= 0")
TRAIN_RANGES = {  # field: (test, the rule as the error message says it)
    **dict.fromkeys(("batch_tokens", "micro_batch", "eval_every", "eval_tokens", "ckpt_every"), AT_LEAST_ONE),
    **dict.fromkeys(("warmup_steps", "steps", "tokens", "seconds", "seed", "sample_tokens", "weight_decay",
                     "peak_tflops", "window_start"), NOT_NEGATIVE),
    "lr": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "grad_clip": (lambda v: v >= 0, ">= 0 (0 turns clipping off; a negative norm would flip the gradients)"),
    "warmdown_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "muon_lr": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "muon_momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "muon_weight_decay": NOT_NEGATIVE,
    "adam_weight_decay": (lambda v: 0 <= v <= 1, "in [0, 1] (0: off; the records: 0.005)"),
    "muon_momentum_warmup": NOT_NEGATIVE,
    "muon_momentum_cooldown": NOT_NEGATIVE,
    "mtp_tokens": (lambda v: 1 <= v <= 8, "in [1, 8] (1: the next token alone)"),
    "prefix_weight": (lambda v: 0 <= v <= 1, "in [0, 1] (0: no prefix-token loss)"),
    "untie_at": (lambda v: 0 <= v <= 1, "in [0, 1] (0: the head and the embedding apart from the start)"),
    "batch_stages": (lambda v: 1 <= v <= 8, "in [1, 8] (1: the whole batch from the first step)"),
    "muon_momentum_start": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "muon_beta2": (lambda v: 0 <= v < 1, "in [0, 1) (0 turns NorMuon off)"),
    **dict.fromkeys(("embed_lr", "head_lr", "scalar_lr"), (lambda v: 0 <= v <= 10, "in [0, 10] (0: train.lr)")),
    **dict.fromkeys(("head_beta1", "embed_beta1", "scalar_beta1"),
                    (lambda v: 0 <= v < 1, "in [0, 1) (0: train.beta1)")),
    "scalar_beta2": (lambda v: 0 <= v < 1, "in [0, 1) (0: train.beta2)"),
    "adam_eps": (lambda v: 0 < v <= 1e-3, "in (0, 1e-3]"),
}


def check_finite(obj, section: str):
    """Raise ValueError naming section.field for the first float field that is NaN or infinite: a range test
    written `v < 0` lets both through."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{f.name}={value!r} is not a finite number: give a real number")


def check_ranges(obj, section: str, ranges: dict):
    """Raise ValueError naming section.field for the first value outside its range."""
    for name, (ok, rule) in ranges.items():
        value = getattr(obj, name)
        if not ok(value):
            raise ValueError(f"{section}.{name}={value!r} is out of range: it must be {rule}")


@dataclass
class Config:
    model: M.ModelConfig
    data: DataConfig
    train: TrainConfig
    speed: FP.SpeedConfig = dataclasses.field(default_factory=FP.SpeedConfig)

    def __post_init__(self):
        FP.check(self.model, self.speed)
        start, end = self.train.window_start, self.model.attn_window
        if start and not 0 < start <= end:
            raise ValueError(f"train.window_start={start} grows the window to model.attn_window={end}, so it must "
                             f"be in (0, attn_window]: set model.attn_window, or train.window_start 0 for no schedule")
        if self.model.rope_yarn and self.model.rope_yarn != start:
            raise ValueError(f"model.rope_yarn={self.model.rope_yarn} is the window RoPE is first trained over, but "
                             f"train.window_start={start}: set them equal (the window the run starts at)")
        if self.train.untie_at and self.model.tie_embeddings:
            raise ValueError(f"train.untie_at={self.train.untie_at:g} ties an untied head to the embedding for a share "
                             f"of the run, but model.tie_embeddings makes them one matrix all along: set one of the two")
        if self.train.untie_at and self.train.init_from:
            raise ValueError(f"train.untie_at={self.train.untie_at:g} starts the head and the embedding as one matrix, "
                             f"but train.init_from starts them from trained weights: set train.untie_at 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"model": M.ModelConfig, "speed": FP.SpeedConfig, "data": DataConfig, "train": TrainConfig}
# Keys that moved: old section.key -> the section it lives in now. Files and checkpoints that name the old place
# load as if they named the new one.
MOVED = {("model", name): "speed" for name in FP.SPEED_FIELDS}


def moved_key(key: str) -> str:
    """An override's "section__name" with the section the name lives in now (MOVED)."""
    section, _, name = key.partition("__")
    return f"{MOVED.get((section, name), section)}__{name}"


def moved(values: dict) -> dict:
    """values (section -> {key: value}) with every MOVED key in its section of today; a key given in both
    places keeps the new section's value."""
    out = {section: dict(table) if isinstance(table, dict) else table for section, table in values.items()}
    for (old, key), new in MOVED.items():
        if isinstance(out.get(old), dict) and key in out[old]:
            value = out[old].pop(key)
            out.setdefault(new, {})
            if isinstance(out[new], dict):
                out[new].setdefault(key, value)
    return out


# --- The strict loader ---------------------------------------------------------------------

def field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _type_name(kind) -> str:
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(kind))
    return getattr(kind, "__name__", str(kind))


def _check_type(value, kind, where: str):
    if typing.get_origin(kind) is Literal:
        if value not in typing.get_args(kind):
            raise ValueError(f"{where}={value!r}: choose {_type_name(kind)}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # TOML writes 3 for 3.0; accept it
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        kind = next(t for t in options if t is not type(None))
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise ValueError(f"{where} must be {_type_name(kind)}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls, values: dict, source: str, section: str):
    """Build dataclass `cls` from a dict, refusing unknown keys and wrong types."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: [{section}] must be a table of settings, got {type(values).__name__}")
    types_ = field_types(cls)
    refuse_unknown(values, types_, source, section)
    checked = {k: _check_type(v, types_[k], f"{source}: {section}.{k}") for k, v in values.items()}
    try:
        return cls(**checked)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def read_toml(path: str | Path, _seen: tuple = (), without: tuple[str, ...] = ()) -> dict:
    """Read a config file; only [model], [data] and [train] may appear in it, and a top-level
    `extends = "126m"` (a preset's name, or a path relative to the file) or a list of them: their
    settings are read first, in order, and this file's replace them key by key, so a preset is its
    shape plus a shared recipe and holds only what it changes (as nanoGPT's override files and
    torchtitan's derived configs do). without: bases of this file's extends (as written there) left out."""
    path = Path(path)
    if not path.is_file():
        names = preset_names()
        close = difflib.get_close_matches(path.stem.lower(), names, n=1, cutoff=0.6)
        hint = f"did you mean {path.with_name(close[0] + '.toml')}? " if close else ""
        raise FileNotFoundError(f"config file {path} does not exist: {hint}the presets in {PRESETS_DIR} are "
                                f"{', '.join(names)}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid TOML ({e}): fix the file or start from a preset in configs/") from None
    check_keys(path, data)
    extra = sorted(set(data) - set(SECTIONS) - {"extends"})
    if extra:
        raise ValueError(f"{path}: unknown section(s) {extra}; valid sections are {list(SECTIONS)} (and a "
                         f"top-level extends = \"<preset>\")")
    bases = data.pop("extends", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ValueError(f"{path}: extends must be a preset name or a path, or a list of them, got {bases!r}")
    merged = {}
    for base in [b for b in bases if b not in without] + [None]:  # each base in turn, then this file's own settings
        if base is None:
            layer = data
        else:
            parent = PRESETS_DIR / f"{base}.toml" if (PRESETS_DIR / f"{base}.toml").is_file() else path.parent / base
            if parent.resolve() in _seen or parent.resolve() == path.resolve():
                raise ValueError(f"{path}: extends {base!r} leads back to itself: break the cycle")
            layer = read_toml(parent, _seen + (path.resolve(),))
        for section, table in layer.items():
            if not isinstance(table, dict):
                raise ValueError(f"{path}: [{section}] must be a table of settings, got {type(table).__name__}")
            merged[section] = {**merged.get(section, {}), **table}
    return merged


def refuse_unknown(table: dict, known: dict, source, section: str):
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(section + '.' + k for k in unknown)}; "
                         f"valid keys in [{section}] are: {', '.join(known)}")


def check_keys(path: Path, data: dict):
    """Refuse an unknown key where it is written: in this file, not in the one that extends it."""
    for section, table in moved({k: v for k, v in data.items() if k in SECTIONS}).items():
        if isinstance(table, dict):
            refuse_unknown(table, field_types(SECTIONS[section]), path, section)


def read_plan(path: str | Path) -> dict:
    """A bench plan file: TOML, read with the same errors as a config file."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"plan file {path} is a folder: give one of its .toml files (examples live in "
                                f"{PRESETS_DIR / 'plans'})")
    if not path.is_file():
        raise FileNotFoundError(f"plan file {path} does not exist (examples live in {PRESETS_DIR / 'plans'})")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid TOML ({e}): fix the file or start from one in configs/plans/") from None


def load_config(path: str | Path | None = None, *, values: dict | None = None, source: str | None = None,
                **overrides) -> Config:
    """Defaults, then the file at `path` (or `values`, a dict shaped like one, e.g. a checkpoint's
    saved config), then overrides given as section__name=value (`train__lr=1e-3`)."""
    if values is None:
        values = read_toml(path) if path is not None else {}
        source = source or (str(path) if path is not None else "defaults")
    source = source or "config"
    values = moved(values)
    merged = {s: dict(values.get(s) or {}) for s in SECTIONS}
    for key, value in overrides.items():
        section, _, name = moved_key(key).partition("__")
        if section not in SECTIONS or not name:
            raise ValueError(f"override {key!r}: write it as <section>__<name>, section one of {list(SECTIONS)}")
        merged[section][name] = value
    try:
        return built(merged, source)
    except ValueError:
        if not overrides:
            raise
    # The file alone may be fine: then the bad value came from a flag, and the error says which.
    built({s: dict(values.get(s) or {}) for s in SECTIONS}, source)
    flags = ", ".join("--" + k.split("__")[1].replace("_", "-") for k in overrides)
    return built(merged, f"flags ({flags})")


def built(sections: dict, source: str) -> Config:
    """The Config of checked sections; a check across sections (Config.__post_init__) names the source too."""
    checked = {s: from_dict(cls, sections[s], source, s) for s, cls in SECTIONS.items()}
    try:
        return Config(**checked)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def preset(name: str, **overrides) -> Config:
    """configs/<name>.toml, with overrides as in load_config."""
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"preset {name!r} does not exist: choose one of {preset_names()}")
    return load_config(path, **overrides)


def pick_device(name: str):
    """The one device picker (train, bench and sample call it): auto is CUDA when there is one."""
    if not DEVICE.fullmatch(name):
        raise ValueError(f"device {name!r}: use auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}, but CUDA is not available on this machine: use auto or cpu")
    return torch.device(name)


# --- Flags generated from the dataclasses --------------------------------------------------

def field_comments(cls) -> dict[str, str]:
    """Each field's trailing comment in the class source: the flag's help text."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):[^#]*#\s*(.+)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


def add_config_flags(parser: argparse.ArgumentParser, sections=tuple(SECTIONS), base: Path | None = None):
    """One flag per field of the named sections: --micro-batch, --lr, --compile/--no-compile.
    Values land in args as "<section>__<name>" and only when given, so the file's values stand.
    base: the config file that runs when no --config is given; the help shows its values."""
    shown = load_config(base) if base is not None else None
    for section in sections:
        cls = SECTIONS[section]
        group = parser.add_argument_group(f"[{section}] settings (override the config file)")
        comments = field_comments(cls)
        defaults = {f.name: getattr(getattr(shown, section), f.name) if shown else f.default
                    for f in dataclasses.fields(cls)}
        where = f" in {base.parent.name}/{base.name}" if base is not None else ""
        for name, kind in field_types(cls).items():
            flag = "--" + name.replace("_", "-")
            help_ = f"{comments.get(name, '')} (default{where}: {defaults[name]!r})".replace("%", "%%")
            dest = f"{section}__{name}"
            if kind is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_)
            elif typing.get_origin(kind) is Literal:
                group.add_argument(flag, dest=dest, choices=typing.get_args(kind), default=argparse.SUPPRESS,
                                   help=help_)
            else:
                group.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=help_,
                                   metavar=kind.__name__.upper())


def flag_overrides(args: argparse.Namespace) -> dict:
    """The config flags the user gave, as load_config overrides."""
    return {k: v for k, v in vars(args).items() if "__" in k and k.split("__")[0] in SECTIONS}
