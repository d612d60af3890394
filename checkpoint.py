"""Checkpoints: the one module that writes and reads them.

A checkpoint is one file, runs/<name>/ckpt.pt, holding everything a bit-exact resume needs:
weights, optimizer state, step and token counters, every rank's loader cursor and RNG state,
the resolved config and the tokenizer's hash.

Safety: a checkpoint is loaded with `torch.load(..., weights_only=True)`, which unpickles only
tensors and plain data (dicts, lists, numbers, strings). A file that asks for anything else,
as a crafted pickle that would run a command does, is refused with a clear error. So that our
own checkpoints pass that check, everything in them is stored as plain types, RNG states too.

Writing is atomic: a temporary file, fsync, rename. A crash or a full disk mid-write leaves
the previous checkpoint as it was and no temporary file behind. The checkpoint before the
latest is kept as ckpt.prev.pt, so that after a divergence (a NaN loss) a checkpoint from
before it still exists: the latest one may already hold the diverging weights.
"""

import dataclasses
import hashlib
import json
import os
import pickle
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import config as C
import data as D
import model as M
import tokenizer as tk

FORMAT = 2  # bump when the layout below changes; load() refuses other versions with advice
class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file, what is wrong and what to do."""


@dataclass
class Checkpoint:
    path: Path
    config: C.Config
    model: dict  # state_dict of the raw (uncompiled) model
    optimizer: dict | None
    step: int
    tokens: int
    skipped: int
    loaders: list  # one ShardLoader.state_dict() per rank
    rngs: list  # one rng_state() per rank
    tokenizer_hash: str
    train_seconds: float = 0.0  # training time so far (train.Progress); 0 in checkpoints from before it
    scaler: dict | None = None  # the fp16 gradient scaler's state (train.fp16), None without it

    def build_model(self) -> M.Llama:
        model = M.Llama(self.config.model)
        try:
            model.load_state_dict(self.model, strict=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0]
            raise CheckpointError(f"{self.path}: its weights do not match its own config ({first}): "
                                  f"the file is damaged or was not written by onegpu") from None
        return model


# --- RNG state as plain types --------------------------------------------------------------

def rng_state() -> dict:
    """Python, NumPy, torch (and CUDA) generators, in types weights_only loading accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- Save ----------------------------------------------------------------------------------

def save(path: Path, *, model: dict, optimizer: dict, step: int, tokens: int, skipped: int, loaders: list,
         rngs: list, config: C.Config, tokenizer_hash: str, train_seconds: float = 0.0, scaler: dict | None = None):
    """Write atomically: a crash or a full disk mid-write leaves the previous checkpoint intact."""
    state = {"format": FORMAT, "model": model, "optimizer": optimizer, "step": step, "tokens": tokens,
             "skipped": skipped, "loaders": list(loaders), "rngs": list(rngs), "config": config.to_dict(),
             "tokenizer_hash": tokenizer_hash, "train_seconds": float(train_seconds), "scaler": scaler}
    tmp = path.with_name(path.name + ".tmp")
    prev, prev_tmp = path.with_name("ckpt.prev.pt"), path.with_name("ckpt.prev.pt.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # keep the one before as ckpt.prev.pt (a hard link: no copy, no gap)
            prev_tmp.unlink(missing_ok=True)
            os.link(path, prev_tmp)
            prev_tmp.replace(prev)
        tmp.replace(path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        tmp.unlink(missing_ok=True)
        prev_tmp.unlink(missing_ok=True)
        reason = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e).splitlines()[0][:120]
        kept = "the previous checkpoint is kept" if path.exists() else "no checkpoint exists yet"
        raise CheckpointError(f"could not write checkpoint {path} ({reason}); {kept}: free disk space or "
                              f"check that the folder is writable") from None


# --- Load ----------------------------------------------------------------------------------

def keep_before(ckpt_path: Path, step: int) -> str:
    """After a NaN at `step`, make ckpt.pt a checkpoint from before it. The latest checkpoint may
    be this very step's (saved just before the step ran), whose weights already diverge; then
    the one before it (ckpt.prev.pt, kept by CK.save) takes its place."""
    if not ckpt_path.exists():
        return "no checkpoint was written"
    prev = ckpt_path.with_name("ckpt.prev.pt")
    latest = load(ckpt_path).step
    if latest == step and prev.exists():
        ckpt_path.replace(ckpt_path.with_name("ckpt.diverged.pt"))
        prev.replace(ckpt_path)
        latest = load(ckpt_path).step
    return f"the last good checkpoint {ckpt_path} (step {latest}) is kept"


def resolve_path(path: str | Path) -> Path:
    """A run folder (runs/NAME) or a ckpt.pt file -> the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: pass a run folder (runs/NAME) or its ckpt.pt")
    return path


def load(path: str | Path, device="cpu", **overrides) -> Checkpoint:
    """Read a checkpoint safely (tensors and plain data only) and check its config strictly.
    overrides (section__name=value) change the saved config, e.g. train__lr for a resumed run."""
    path = resolve_path(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head and not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip, or a bare pickle
        raise CheckpointError(f"{path}: not a checkpoint (it starts with {head!r}, where torch.save's files start "
                              f"with b'PK'): pass a run folder or the ckpt.pt train.py wrote")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:120]
        raise CheckpointError(f"{path}: refused, it holds Python objects other than tensors and plain data "
                              f"({detail}); loading it could run code. Only a checkpoint written by onegpu's "
                              f"train.py loads") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise CheckpointError(f"{path}: not a readable checkpoint ({first}): it is truncated or corrupt; "
                              f"use another checkpoint or retrain") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format", "none") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: checkpoint format {found}, this version of onegpu reads format {FORMAT}: "
                              f"load it with the onegpu version that wrote it, or retrain")
    try:
        saved = state["config"]
        config = C.load_config(values=saved, source=f"{path} (saved config)", **overrides)
        check_weights(path, state["model"], config.model)
        return Checkpoint(path=path, config=config, model=state["model"], optimizer=state["optimizer"],
                          step=int(state["step"]), tokens=int(state["tokens"]), skipped=int(state["skipped"]),
                          loaders=list(state["loaders"]), rngs=list(state["rngs"]),
                          tokenizer_hash=str(state["tokenizer_hash"]),
                          train_seconds=float(state.get("train_seconds", 0.0)), scaler=state.get("scaler"))
    except KeyError as e:
        raise CheckpointError(f"{path}: checkpoint lacks {e.args[0]!r}: it was not written by onegpu's "
                              f"train.py or is damaged") from None
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def check_weights(path: Path, weights: dict, cfg: M.ModelConfig):
    """Refuse, in one line, weights whose names or shapes contradict the checkpoint's own config: every entry
    point (resume, evaluate, sample, export, --init-from) loads through here, so none reaches load_state_dict's
    traceback, and export never writes a folder whose weights contradict its config.json. The model is built
    on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in M.Llama(cfg).state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.items()} if isinstance(weights, dict) else {}
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    wrong = [f"{n} is {found[n]}, its config makes {expected[n]}" for n in sorted(expected.keys() & found.keys())
             if found[n] != expected[n]]
    if missing or extra or wrong:
        what = (f"{wrong[0]}" if wrong else f"missing {missing[0]}" if missing else f"an unexpected {extra[0]}")
        count = len(missing) + len(extra) + len(wrong)
        raise CheckpointError(f"{path}: its weights contradict its own config ({what}; {count} tensor(s) in all): "
                              f"the file is damaged or was edited; use another checkpoint or retrain")


def check_compatible(ckpt: Checkpoint, cfg: C.Config, tok_hash: str):
    """Refuse a checkpoint from another model shape or tokenizer, naming what differs."""
    saved, now = dataclasses.asdict(ckpt.config.model), dataclasses.asdict(cfg.model)
    diff = [f"{k}: checkpoint {saved[k]!r}, config {now[k]!r}" for k in M.SHAPE_FIELDS if saved[k] != now[k]]
    if diff:
        raise CheckpointError(f"{ckpt.path} is from another model shape ({'; '.join(diff)}): use the run's own "
                              f"config or start a new run with --name NAME")
    if ckpt.tokenizer_hash != tok_hash:
        raise CheckpointError(f"{ckpt.path} was trained with tokenizer {ckpt.tokenizer_hash}, but the data now "
                              f"uses tokenizer {tok_hash}: point the run at its original tokenizer and shards")


def tokenizer_for(ckpt: Checkpoint, override: str | Path | None = None):
    """(tokenizer, path): the one the checkpoint was trained with, from its data folder or from
    `override`. Refuses a tokenizer whose hash differs from the checkpoint's."""
    if override:
        path = Path(override)
    else:
        path = D.data_dir(ckpt.config.data, ckpt.config.model.vocab_size) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"tokenizer {path} not found: pass --tokenizer PATH to the tokenizer.json "
                              f"the checkpoint was trained with (hash {ckpt.tokenizer_hash})")
    found = tk.tokenizer_hash(path)
    if found != ckpt.tokenizer_hash:
        raise CheckpointError(f"tokenizer {path} has hash {found}, but the checkpoint was trained with tokenizer "
                              f"{ckpt.tokenizer_hash}: pass --tokenizer with the original tokenizer.json")
    return tk.load_tokenizer(path), path


def data_for(ckpt: Checkpoint, data: C.DataConfig) -> C.DataConfig:
    """`data` tokenized with the checkpoint's tokenizer (evaluating it, or a run that starts from its
    weights): as it is where it names the checkpoint's own data folder; otherwise with
    data.tokenizer_file set to the checkpoint's tokenizer, so that its shards are written once, in a
    folder of their own. A tokenizer_file given that is not the checkpoint's is refused."""
    vocab = ckpt.config.model.vocab_size
    if D.data_dir(data, vocab) == D.data_dir(ckpt.config.data, vocab):
        return data
    if data.tokenizer_file:
        found = tk.tokenizer_hash(D.given_tokenizer(data))
        if found != ckpt.tokenizer_hash:
            raise CheckpointError(f"data.tokenizer_file={data.tokenizer_file!r} has hash {found}, but {ckpt.path} was "
                                  f"trained with tokenizer {ckpt.tokenizer_hash}: leave data.tokenizer_file out, and "
                                  f"the corpus is tokenized with the checkpoint's")
        return data
    _, path = tokenizer_for(ckpt)
    return dataclasses.replace(data, tokenizer_file=str(path))


# --- The HuggingFace format (export.py writes it; bench compares generation on it) ------------
# Our model is a Llama with optional parts. Each combination maps onto the transformers class that
# computes exactly it: RMSNorm, rotary embeddings in HF's "rotate half" layout (so q and k need no
# permutation), grouped-query attention, no biases. Only the fused matrices are split back: wqkv
# into q_proj, k_proj, v_proj and w13 into gate_proj, up_proj.
#   SwiGLU             -> LlamaForCausalLM
#   SwiGLU + QK-norm   -> Qwen3ForCausalLM (per-head q_norm and k_norm, before RoPE, as ours)
#   ReLU²              -> ArceeForCausalLM (a non-gated MLP with hidden_act "relu2")
#   ReLU² + QK-norm    -> ApertusForCausalLM (the same, with per-head q_norm and k_norm)
# No class has a logit soft-cap with these layers, nor the record's parts (stock_gap): export.py ships our own model.

HF_CLASSES = {("swiglu", False): ("LlamaForCausalLM", "llama"), ("swiglu", True): ("Qwen3ForCausalLM", "qwen3"),
              ("relu2", False): ("ArceeForCausalLM", "arcee"), ("relu2", True): ("ApertusForCausalLM", "apertus")}


RECORD_PARTS = ("embed_norm", "value_embeds", "value_scale", "unet_skips", "x0_mix", "rope_truncate", "attn_gate",
                "attn_window", "bigram_rows", "bigram_signs", "backout", "smear", "key_offset", "value_gate",
                "paired_heads", "rope_yarn", "xsa", "saved_attn_input",
                "dense_last")  # modded-nanogpt's parts: each changes what the network computes


def stock_gap(cfg: M.ModelConfig) -> str | None:
    """The first setting of cfg that no transformers class computes (one line naming it), or None when
    hf_architecture's class computes the model exactly."""
    if cfg.logit_softcap:
        return f"model.logit_softcap={cfg.logit_softcap}: no transformers class combines a logit soft-cap with this architecture"
    for name in RECORD_PARTS:
        if getattr(cfg, name):
            return f"model.{name}={getattr(cfg, name)!r}: no transformers class computes it with this architecture"
    if cfg.attn_scale:
        return (f"model.attn_scale={cfg.attn_scale}: transformers' Llama-family classes scale attention by "
                f"1/sqrt(head size)")
    if cfg.skip_attn_layer != -1:
        return f"model.skip_attn_layer={cfg.skip_attn_layer}: no transformers class has a layer without attention"
    return None


def hf_architecture(cfg: M.ModelConfig) -> tuple[str, str]:
    """(transformers class, model_type) that computes what cfg does, or ValueError naming the setting."""
    gap = stock_gap(cfg)
    if gap:
        raise ValueError(f"{gap}: export.py writes onegpu's own modeling file for it instead")
    return HF_CLASSES[(cfg.mlp, cfg.qk_norm)]


def hf_config(cfg: M.ModelConfig, eot_id: int) -> dict:
    architecture, model_type = hf_architecture(cfg)
    config = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu" if cfg.mlp == "swiglu" else "relu2",
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "torch_dtype": "float32",
        "bos_token_id": eot_id, "eos_token_id": eot_id,
    }
    if model_type == "qwen3":  # no sliding window: every layer attends over the whole context
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers})
    return config


def hf_state_dict(state: dict, cfg: M.ModelConfig) -> dict:
    """Our parameter names and fused matrices -> those of the class hf_architecture picks."""
    d, kv, f = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    apertus = hf_architecture(cfg)[1] == "apertus"
    norms = ("attention_layernorm", "feedforward_layernorm") if apertus else ("input_layernorm",
                                                                              "post_attention_layernorm")
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.wqkv.weight"].split([d, kv, kv])
        out.update({
            theirs + norms[0] + ".weight": state[ours + "attn_norm.weight"],
            theirs + "self_attn.q_proj.weight": q, theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v, theirs + "self_attn.o_proj.weight": state[ours + "attn.wo.weight"],
            theirs + norms[1] + ".weight": state[ours + "mlp_norm.weight"],
            theirs + "mlp.down_proj.weight": state[ours + "mlp.w2.weight"],
        })
        if cfg.qk_norm:
            out[theirs + "self_attn.q_norm.weight"] = state[ours + "attn.q_norm.weight"]
            out[theirs + "self_attn.k_norm.weight"] = state[ours + "attn.k_norm.weight"]
        if cfg.mlp == "relu2":
            out[theirs + "mlp.up_proj.weight"] = state[ours + "mlp.w1.weight"]
        else:
            gate, up = state[ours + "mlp.w13.weight"].split([f, f])
            out.update({theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up})
    if not cfg.tie_embeddings:  # a tied head is the embedding; safetensors stores it once
        out["lm_head.weight"] = state["head.weight"]
    return out


def save_safetensors(tensors: dict, path: Path):
    """tensors as float32 on the CPU, in safetensors' file format."""
    from safetensors.torch import save_file
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600); give it the mode of the files beside it
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_hf_model(state: dict, cfg: M.ModelConfig, out: Path, eot_id: int):
    """config.json and model.safetensors of the stock class."""
    save_safetensors(hf_state_dict(state, cfg), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf_config(cfg, eot_id), indent=2))


# Our own model as transformers remote code (write_own_model), for what no stock class computes: these files ship
# beside the weights, in this order. model.py reads attention.py and model_checks.py as flat modules here, and as
# files of the same package in the export folder: PACKAGE_IMPORTS, each flat import line with its package twin.
ROOT = Path(__file__).resolve().parent
OWN_SOURCES = ("modeling_onegpu.py", "model.py", "attention.py", "model_checks.py")
PACKAGE_IMPORTS = {"import attention as A\n": "from . import attention as A\n",
                   "from model_checks import check_config\n": "from .model_checks import check_config\n"}
AUTO_MAP = {"AutoConfig": "modeling_onegpu.OnegpuConfig", "AutoModel": "modeling_onegpu.OnegpuForCausalLM",
            "AutoModelForCausalLM": "modeling_onegpu.OnegpuForCausalLM"}


def write_transformers_model(state: dict, cfg: M.ModelConfig, out: Path, eot_id: int):
    """The model files of a transformers folder, enough for from_pretrained: the stock class's where one computes
    cfg, else our own; and the generation config, <|endoftext|> as both ends."""
    if stock_gap(cfg) is None:
        write_hf_model(state, cfg, out, eot_id)
    else:
        write_own_model(state, cfg, out, eot_id)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot_id, "eos_token_id": eot_id}, indent=2))


def packaged(model_source: str) -> str:
    """model.py as a file of the export folder's package: its imports of our modules made relative."""
    for flat, relative in PACKAGE_IMPORTS.items():
        assert model_source.count(flat) == 1, f"model.py imports {flat.strip()!r} once"
        model_source = model_source.replace(flat, relative)
    return model_source


def write_own_model(state: dict, cfg: M.ModelConfig, out: Path, eot_id: int):
    """Our model as transformers remote code: the weights under our own names (the Llama is the wrapper's
    `model`), config.json with the ModelConfig and auto_map, and the three source files. config.json records
    each source file's SHA-256 as this checkout has it, so a folder names the code it was written by."""
    save_safetensors({"model." + k: v for k, v in state.items()}, out / "model.safetensors")
    sources = {name: (ROOT / name).read_text() for name in OWN_SOURCES}
    for name, text in sources.items():
        (out / name).write_text(packaged(text) if name == "model.py" else text)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["OnegpuForCausalLM"], "model_type": "onegpu", "auto_map": AUTO_MAP,
        "onegpu": dataclasses.asdict(cfg), "bos_token_id": eot_id, "eos_token_id": eot_id, "torch_dtype": "float32",
        "onegpu_source_sha256": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sources.items()},
    }, indent=2))
