"""Generate text from a trained checkpoint, streaming it as it comes.

    python sample.py --ckpt runs/tiny --prompt "def parse(" --max-new-tokens 200
    echo "import os" | python sample.py --ckpt runs/tiny --temperature 0      # greedy, prompt on stdin

The model decodes with its KV cache (--no-cache re-reads the whole sequence every token, the
slow reference). bfloat16 autocast on CUDA, float32 on CPU.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

import data as D
import model as M
import tokenizer as tk


def load_checkpoint(path: str | Path, device) -> dict:
    """A run folder or a ckpt.pt file."""
    path = Path(path)
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: pass a run folder (runs/NAME) or its ckpt.pt")
    return torch.load(path, map_location=device, weights_only=False)


def checkpoint_tokenizer(ckpt: dict, override: str | None = None) -> tuple:
    """The tokenizer the checkpoint was trained with: its data folder's, or `override`. Refuses
    one whose hash differs from the checkpoint's."""
    if override:
        path = Path(override)
    else:
        data_cfg = D.DataConfig(**ckpt["config"]["data"])
        path = D.data_dir(data_cfg, ckpt["config"]["model"]["vocab_size"]) / "tokenizer.json"
    found = tk.tokenizer_hash(path) if path.is_file() else None
    if found is None:
        raise FileNotFoundError(f"tokenizer {path} not found: pass --tokenizer PATH to the tokenizer.json "
                                f"the checkpoint was trained with (hash {ckpt['tokenizer_hash']})")
    if found != ckpt["tokenizer_hash"]:
        raise ValueError(f"tokenizer {path} has hash {found}, but the checkpoint was trained with tokenizer "
                         f"{ckpt['tokenizer_hash']}: pass --tokenizer with the original tokenizer.json")
    return tk.load_tokenizer(path), path


def check_settings(temperature: float, top_k: int, top_p: float, max_new_tokens: int):
    if temperature < 0:
        raise ValueError(f"--temperature {temperature}: must be >= 0 (0 means greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p}: must be in (0, 1] (1 keeps every token)")
    if top_k < 0:
        raise ValueError(f"--top-k {top_k}: must be >= 0 (0 keeps every token)")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: must be at least 1")


def prompt_ids(tok, prompt: str, context: int, warn=print) -> list[int]:
    """Token ids of the prompt, cut to its last context - 1 tokens so at least one new token fits.
    An empty prompt starts from the end-of-text token, as a new document would."""
    ids = tok.encode(prompt).ids or [tok.token_to_id(tk.EOT)]
    if len(ids) > context - 1:
        warn(f"warning: the prompt has {len(ids)} tokens, more than the context of {context} allows; "
             f"keeping its last {context - 1}")
        ids = ids[-(context - 1):]
    return ids


def stream(model: M.Llama, tok, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, top_p: float,
           generator, use_cache: bool = True, out=sys.stdout, autocast=None) -> list[int]:
    """Generate after ids, writing the decoded text as it grows. Returns the new token ids."""
    device = model.embed.weight.device
    idx = torch.tensor([ids], device=device)
    new, shown = [], ""
    with autocast or torch.autocast(device.type, enabled=False):
        for token in M.generate(model, idx, max_new_tokens, temperature, top_k, top_p, generator, use_cache):
            new.append(token.item())
            text = tok.decode(new)
            if out is not None and not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
                out.write(text[len(shown):])
                out.flush()
                shown = text
    if out is not None:
        out.write(tok.decode(new)[len(shown):] + "\n")
    return new


def main(argv=None):
    p = argparse.ArgumentParser(description="Generate text from a checkpoint.")
    p.add_argument("--ckpt", required=True, help="run folder (runs/NAME) or a ckpt.pt file")
    p.add_argument("--prompt", default=None, help="text to continue (default: stdin if piped, else empty)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 keeps every token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--no-cache", action="store_true", help="re-read the whole sequence each token (slow reference)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one the run trained with)")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    try:
        check_settings(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
        ckpt = load_checkpoint(args.ckpt, device)
        tok, tok_path = checkpoint_tokenizer(ckpt, args.tokenizer)
        model = M.from_checkpoint(ckpt).to(device).eval()
        prompt = args.prompt if args.prompt is not None else ("" if sys.stdin.isatty() else sys.stdin.read())
        ids = prompt_ids(tok, prompt, model.cfg.context, warn=lambda s: print(s, file=sys.stderr))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    generator = torch.Generator(device=device).manual_seed(args.seed)
    total, start = 0, time.perf_counter()
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        sys.stdout.write(prompt)
        total += len(stream(model, tok, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                            generator, not args.no_cache, autocast=autocast))
    seconds = time.perf_counter() - start
    print(f"[{total} tokens in {seconds:.2f} s: {total / seconds:,.1f} tokens/s, "
          f"{'no cache' if args.no_cache else 'KV cache'}, {device.type}]", file=sys.stderr)


if __name__ == "__main__":
    main()
