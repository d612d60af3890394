"""Write a checkpoint as a HuggingFace Llama directory, so the tools users already have read it.

    python export.py --ckpt runs/tiny --out exported/tiny

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/tiny")
    tok = AutoTokenizer.from_pretrained("exported/tiny")

The model already is a Llama: RMSNorm, rotary embeddings in HF's "rotate half" layout (so q and k
need no permutation), grouped-query attention, SwiGLU, no biases. Only the fused matrices are
split back: wqkv into q_proj, k_proj, v_proj and w13 into gate_proj, up_proj.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path


import checkpoint as CK
import model as M
import tokenizer as tk


def hf_config(cfg: M.ModelConfig, eot_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "torch_dtype": "float32",
        "bos_token_id": eot_id, "eos_token_id": eot_id,
    }


def hf_state_dict(state: dict, cfg: M.ModelConfig) -> dict:
    """Our parameter names and fused matrices -> HF LlamaForCausalLM's."""
    d, kv, f = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.wqkv.weight"].split([d, kv, kv])
        gate, up = state[ours + "mlp.w13.weight"].split([f, f])
        out.update({
            theirs + "input_layernorm.weight": state[ours + "attn_norm.weight"],
            theirs + "self_attn.q_proj.weight": q, theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v, theirs + "self_attn.o_proj.weight": state[ours + "attn.wo.weight"],
            theirs + "post_attention_layernorm.weight": state[ours + "mlp_norm.weight"],
            theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": state[ours + "mlp.w2.weight"],
        })
    if not cfg.tie_embeddings:  # a tied head is the embedding; safetensors stores it once
        out["lm_head.weight"] = state["head.weight"]
    return {k: v.detach().float().contiguous().cpu() for k, v in out.items()}


def write_model(state: dict, cfg: M.ModelConfig, out: Path, eot_id: int):
    """config.json, generation_config.json and model.safetensors: enough for from_pretrained."""
    from safetensors.torch import save_file
    save_file(hf_state_dict(state, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg, eot_id), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot_id, "eos_token_id": eot_id}, indent=2))


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


def export(ckpt: CK.Checkpoint, tokenizer_path: Path, out: Path):
    cfg = ckpt.config.model
    tok = tk.load_tokenizer(tokenizer_path)
    eot_id = tok.token_to_id(tk.EOT)
    out.mkdir(parents=True, exist_ok=True)
    write_model(ckpt.model, cfg, out, eot_id)
    shutil.copyfile(tokenizer_path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tk.EOT, "bos_token": tk.EOT,
        "unk_token": None, "model_max_length": cfg.context, "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": tk.EOT, "bos_token": tk.EOT}, indent=2))


def main(argv=None):
    p = argparse.ArgumentParser(description="Export a checkpoint as a HuggingFace Llama directory.")
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
        sys.exit(f"error: cannot write {out} ({e.strerror or e}): choose a folder you can write to")
    print(f"wrote {args.out}: config.json, model.safetensors, tokenizer.json, tokenizer_config.json "
          f"(load with transformers.AutoModelForCausalLM.from_pretrained({args.out!r}))")


if __name__ == "__main__":
    main()
