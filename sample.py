"""Generate text from a trained checkpoint, streaming it as it comes.

    python sample.py --ckpt runs/tiny --prompt "def parse(" --max-new-tokens 200
    echo "import os" | python sample.py --ckpt runs/tiny --temperature 0      # greedy, prompt on stdin
    python sample.py --ckpt runs/88m --num-samples 8                          # 8 samples as one batch

The prompt is read in one pass (prefill), then each new token is one decode step through the
KV cache. On CUDA the decode step is compiled once and replays as a CUDA graph (every step has
the same shapes: see attention.KVCache and generate.GraphDecoder); --no-compile runs it eagerly and
--no-cache re-reads the whole sequence every token (the slow reference both are tested against).
On GPUs of compute capability 8.0 and newer each new token's RoPE, cache write and attention run
as one Triton kernel (onegpu_kernels.py), split over many programs with split_decode, and with
decode_matmuls its matmuls, with decode_mlp its ReLU² MLP, as kernels of their own; on Hopper (9.0) with
decode_pdl each kernel launches while the one before it runs; --no-fused-decode runs the plain PyTorch
paths, launched plainly, instead.
bfloat16 weights on CUDA, float32 on CPU. Speed goes to stderr: warm-up (compilation), time to
first token, prefill and decode tokens per second.
"""

import argparse
import sys
import time

import torch

import checkpoint as CK
import config as C
import fastpaths as FP
import generate as G
import model as M
import tokenizer as tk


def check_settings(temperature: float, top_k: int, top_p: float, max_new_tokens: int, num_samples: int):
    if temperature < 0:
        raise ValueError(f"--temperature {temperature}: must be >= 0 (0 means greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p}: must be in (0, 1] (1 keeps every token)")
    if top_k < 0:
        raise ValueError(f"--top-k {top_k}: must be >= 0 (0 keeps every token)")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if num_samples < 1:
        raise ValueError(f"--num-samples {num_samples}: must be at least 1")


def prompt_ids(tok, prompt: str, context: int, warn=print) -> list[int]:
    """Token ids of the prompt, cut to its last context - 1 tokens so at least one new token fits.
    An empty prompt starts from the end-of-text token, as a new document would."""
    ids = tok.encode(prompt).ids or [tok.token_to_id(tk.EOT)]
    if len(ids) > context - 1:
        warn(f"warning: the prompt has {len(ids)} tokens, more than the context of {context} allows; "
             f"keeping its last {context - 1}")
        ids = ids[-(context - 1):]
    return ids


class StreamPrinter:
    """An on_token callback that writes sample 0's text as it grows, whole characters only.
    Only the tokens not yet shown are decoded (byte-level BPE text is the concatenation of its
    pieces' text when they are cut at character boundaries), so each token costs the same
    however long the sample is; decoding the whole sample every token cost 10% of the CPU decode
    rate at 500 tokens."""

    def __init__(self, tok, out):
        self.tok, self.out, self.pending = tok, out, []

    def __call__(self, step, tokens):
        self.pending.append(int(tokens[0]))
        text = self.tok.decode(self.pending)
        if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
            self.out.write(text)
            self.out.flush()
            self.pending = []

    def finish(self):
        self.out.write(self.tok.decode(self.pending) + "\n")


def speed_report(timer: G.Timer, prompt_tokens: int, batch: int, new_tokens: int, mode: str, device) -> str:
    start, first, end = timer.marks
    prefill_s, decode_s = first - start, end - first
    decode_rate = batch * (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else float("nan")
    return (f"[{mode}, {device.type}, batch {batch}: first token after {prefill_s * 1000:.1f} ms (prefill "
            f"{batch * prompt_tokens / prefill_s:,.0f} tok/s over {prompt_tokens} prompt tokens), then "
            f"{decode_rate:,.1f} tok/s decoding {new_tokens - 1} more per sample]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text from a checkpoint.")
    p.add_argument("--ckpt", required=True, help="run folder (runs/NAME) or a ckpt.pt file")
    p.add_argument("--prompt", default=None, help="text to continue (default: stdin if piped, else empty)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="keep the k most likely tokens; 0 keeps all (default 50)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 keeps every token (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling: same seed, same text (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="samples, decoded together as one batch (default 1)")
    p.add_argument("--no-cache", action="store_true", help="re-read the whole sequence each token (slow reference)")
    p.add_argument("--no-compile", action="store_true", help="run the decode step eagerly (no CUDA graph)")
    p.add_argument("--no-fused-decode", action="store_true",
                   help="CUDA: plain PyTorch attention and matmuls for each new token, launched plainly, not the "
                        "Triton kernels (onegpu_kernels.py: decode_step, and small_matmul or decode_mlp where the "
                        "model has decode_matmuls or decode_mlp) nor dependent launches (decode_pdl)")
    for name, label in FP.GENERATION_FAST_PATHS.items():  # generation's own switches: the weights stay the same
        if name != "fused_decode":  # its off switch is --no-fused-decode, which turns all of them off
            p.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None,
                           help=f"CUDA: the {label} fast path on or off (default: as the checkpoint's config)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one the run trained with)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    try:
        check_settings(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.num_samples)
        device = C.pick_device(args.device)
        chosen = {f"speed__{s}": getattr(args, s) for s in FP.GENERATION_FAST_PATHS if getattr(args, s, None) is not None}
        if args.no_fused_decode:
            chosen = {f"speed__{s}": False for s in FP.GENERATION_FAST_PATHS}
        ckpt = CK.load(args.ckpt, device, **chosen)  # the Triton paths run on CUDA only; on a CPU the plain ones
        tok, _ = CK.tokenizer_for(ckpt, args.tokenizer)
        model = ckpt.build_model().to(device).eval()
        G.apply(model, ckpt.config.speed, device)  # the decode kernels its [speed] section turns on
        if args.prompt is not None:
            prompt = args.prompt
        elif sys.stdin.isatty():
            prompt = ""
        else:
            try:
                prompt = sys.stdin.buffer.read().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"stdin is not UTF-8 text ({e}): pipe in text, or pass --prompt") from None
        ids = prompt_ids(tok, prompt, model.cfg.context, warn=say)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    room = model.cfg.context - len(ids)
    if args.max_new_tokens > room:
        say(f"note: the context holds {model.cfg.context} tokens and the prompt uses {len(ids)}, so at most "
            f"{room} new tokens are generated (not {args.max_new_tokens})")
    if device.type == "cuda":  # bfloat16 weights: each decode step reads every weight once, so half the bytes
        model = model.to(torch.bfloat16)
    use_cache = not args.no_cache
    decode = G.decoder(model, device, fast=use_cache and not args.no_compile)
    if decode is not G.decode_one:  # compile and capture the CUDA graphs before the timed run
        t0 = time.perf_counter()
        decode.capture_all(args.num_samples, greedy=args.temperature == 0)
        # One untimed prefill and sampled token too, with the same settings: a process's first
        # pass pays CUDA's one-time setup (library handles, kernel loading, the sampler's random
        # generator), which measured 286 ms of first-token time on an H200 against ~10 ms warm.
        # Its own generator: the seeded run below draws exactly what it would without it.
        G.generate_batch(model, ids, args.num_samples, 1, args.temperature, args.top_k, args.top_p,
                         torch.Generator(device=device), use_cache, decode=decode)
        say(f"[warm-up: compiled the decode step, captured its CUDA graph and ran the prompt once in "
            f"{time.perf_counter() - t0:.1f} s]")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    batch = args.num_samples
    on_token = StreamPrinter(tok, sys.stdout) if batch == 1 else None
    if batch == 1:
        sys.stdout.write(prompt)
    tokens, timer = G.generate_batch(model, ids, batch, args.max_new_tokens, args.temperature, args.top_k,
                                   args.top_p, generator, use_cache, decode=decode, on_token=on_token)
    if batch == 1:
        on_token.finish()
    else:
        for i, sample in enumerate(tokens):
            print(f"--- sample {i + 1} ---\n{prompt}{tok.decode(sample)}")
    mode = "no cache" if args.no_cache else ("KV cache, CUDA graph" if decode is not G.decode_one else "KV cache")
    say(speed_report(timer, len(ids), batch, len(tokens[0]), mode, device))


if __name__ == "__main__":
    main()
