"""Write a checkpoint as a HuggingFace model directory, so the tools users already have read it.

Where a stock transformers class computes the model exactly (checkpoint.HF_CLASSES: Llama, Qwen3 for
QK-norm, Arcee for ReLU², Apertus for both), the folder is that class's. Otherwise (a logit soft-cap or
any of the record's parts: every default GPU preset) it holds onegpu's own model: model.py,
attention.py and model_checks.py beside modeling_onegpu.py, named in config.json's auto_map, loaded with trust_remote_code.

    python export.py --ckpt runs/tiny --out exported/tiny

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/tiny", trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained("exported/tiny")

The stock weights' conversion lives in checkpoint.py (write_hf_model); this script adds our own model's
files and the tokenizer's, and refuses to write into a run folder, or a non-empty one without --force.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path


import checkpoint as CK
import tokenizer as tk


def check_out_folder(out: Path, force: bool):
    """Refuse to write into a run folder ever, and into a non-empty folder unless forced."""
    if (out / "ckpt.pt").exists() or (out / "log.jsonl").exists():
        raise ValueError(f"--out {out} is a training run's folder: exporting there would replace its config.json; "
                         f"choose another folder, e.g. exported/{out.name}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: pass a folder to write")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty: choose an empty or new folder, or pass --force to overwrite "
                         f"the files an export writes there")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What export writes into its folder: a stock class's model (checkpoint.write_hf_model) or our own
# (checkpoint.write_own_model), and the tokenizer's files.
STOCK_FILES = ("config.json", "generation_config.json", "model.safetensors") + TOKENIZER_FILES
OWN_FILES = ("config.json", "generation_config.json", "model.safetensors") + CK.OWN_SOURCES + TOKENIZER_FILES


def files_for(cfg) -> tuple[str, ...]:
    return STOCK_FILES if CK.stock_gap(cfg) is None else OWN_FILES


def export(ckpt: CK.Checkpoint, tokenizer_path: Path, out: Path):
    """Write the folder whole or not at all: a failure part-way (a full disk) removes what this export wrote,
    and a folder it made, and says so in one line."""
    tok = tk.load_tokenizer(tokenizer_path)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        write_files(ckpt, tok, tokenizer_path, out)
    except Exception as e:  # safetensors raises its own SafetensorError for a full disk
        for name in files_for(ckpt.config.model):
            (out / name).unlink(missing_ok=True)
        if made:
            shutil.rmtree(out, ignore_errors=True)
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise OSError(f"writing {out} failed ({detail}); nothing was left there: free some space or choose "
                      f"another --out") from None


def write_files(ckpt: CK.Checkpoint, tok, tokenizer_path: Path, out: Path):
    cfg = ckpt.config.model
    eot_id = tok.token_to_id(tk.EOT)
    for name in set(OWN_FILES) - set(files_for(cfg)):  # --force over our own model's folder: its sources go too
        (out / name).unlink(missing_ok=True)
    CK.write_transformers_model(ckpt.model, cfg, out, eot_id)
    shutil.copyfile(tokenizer_path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tk.EOT, "bos_token": tk.EOT,
        "unk_token": None, "model_max_length": cfg.context, "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False,
        "split_special_tokens": True}, indent=2))  # "<|endoftext|>" in a text is text, as in training
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": tk.EOT, "bos_token": tk.EOT}, indent=2))


def main(argv=None):
    p = argparse.ArgumentParser(description="Export a checkpoint as a HuggingFace model directory.")
    p.add_argument("--ckpt", required=True, help="run folder (runs/NAME) or a ckpt.pt file")
    p.add_argument("--out", required=True, help="folder to write (new or empty; never a run folder)")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing the export's files")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one the run trained with)")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        check_out_folder(out, args.force)
        ckpt = CK.load(args.ckpt, "cpu")
        _, tok_path = CK.tokenizer_for(ckpt, args.tokenizer)
        export(ckpt, tok_path, out)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: {e}" if str(e).startswith("writing ") else
                 f"error: cannot write {out} ({e.strerror or e}): choose a folder you can write to")
    cfg = ckpt.config.model
    gap = CK.stock_gap(cfg)
    own = "" if gap is None else f": onegpu's own model, as {gap.split(':')[0]} and the like have no stock class"
    print(f"wrote {args.out}: {', '.join(files_for(cfg))}{own} (load with transformers.AutoModelForCausalLM."
          f"from_pretrained({args.out!r}{'' if gap is None else ', trust_remote_code=True'}))")


if __name__ == "__main__":
    main()
