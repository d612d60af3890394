"""Generation: the decode loop over the model's KV cache, and its fast path.

generate() reads the prompt in one pass (prefill), then feeds one token per step through
decode_one, which writes that token's keys and values into the preallocated cache
(attention.KVCache) and attends over the positions written so far. Without the cache
(use_cache=False) every step re-reads the whole sequence: the slow reference.

Its fast paths: GraphDecoder replays the decode step as CUDA graphs (decoder(fast=False) is the plain step
it is tested against), and apply() swaps the decode kernels of speed's generation switches (onegpu_kernels.py)
into a model, as fastpaths.apply() swaps training's. Greedy decoding runs greedy_step, which also picks the token and
advances the position, so that a replay is the whole of a token's work. sample.py (the command) and
bench.py --generate use this module.
"""

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import attention as A
import fastpaths as FP
import model as M
import onegpu_kernels as K


def sample_next(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator=None):
    """One token per row from logits (B, vocab). temperature 0 is greedy; top_k keeps the k most
    likely tokens, top_p the smallest set whose probability reaches p (nucleus sampling)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keeps the token that crosses p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def decode_one(model: M.Llama, token, pos, window: int | None = None):
    """Logits (B, vocab) for the next token after token (B, 1) at position pos (1,), through the
    cache, reading its first `window` positions (all when None). Eager decoding passes the length
    so far; GraphDecoder passes the whole context, so that every replay has the same shapes."""
    return model(token, masks=A.cache_masks(pos, window or model.cfg.context, model.cfg.windows()))[:, -1]


def greedy_step(model: M.Llama, token, pos, window: int | None = None, recent=None):
    """One greedy step done on the device, in place: the most likely token after token (B, 1) at
    position pos (1,) written into token, and pos advanced by one. recent (K, B, 1), where given, moves
    up one row and takes the token last: after K steps it holds their K tokens, oldest first. Replayed
    as a CUDA graph (GraphDecoder.greedy), a token leaves the host nothing to do, where the pick, the copies
    into the graph's inputs and the position's increment took 19 of a batch-1 token's 250 us outside
    the graph on an H200 (docs/performance/generation.md)."""
    token.copy_(sample_next(decode_one(model, token, pos, window), temperature=0))
    pos.add_(1)
    if recent is not None:
        recent.copy_(torch.cat([recent[1:], token[None]]))


def greedy(model: M.Llama, token, pos, n: int, length: int):
    """n greedy tokens, each (B, 1), after token (B, 1) at pos (1,), eagerly: greedy_step on copies of
    both, each step reading the positions written so far (length, then one more a step)."""
    token, pos = token.clone(), pos.clone()
    for i in range(n):
        greedy_step(model, token, pos, length + i)
        yield token.clone()


@torch.no_grad()
def generate(model: M.Llama, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, generator=None, use_cache: bool = True, decode=None):
    """Yield (B, 1) new tokens one at a time after the prompt idx (B, T). With the cache, the
    prompt is read in one pass (prefill) and each step feeds one token through `decode`
    (decode_one, or its CUDA-graph replay: GraphDecoder), or at temperature 0 greedy_step (eagerly,
    or replayed by the GraphDecoder); without it, every step re-reads the whole sequence (the slow
    reference). Stops at the context length."""
    cfg = model.cfg
    B, T = idx.shape
    max_new_tokens = min(max_new_tokens, cfg.context - T)
    if max_new_tokens <= 0:
        return
    if use_cache:
        dtype = model.embed.weight.dtype
        if torch.is_autocast_enabled(idx.device.type):  # keys and values come out of autocast's matmuls
            dtype = torch.get_autocast_dtype(idx.device.type)
        model.setup_cache(B, dtype)
        decode = decode or decode_one
        logits = model(idx, masks=A.cache_masks(torch.arange(T, device=idx.device), T, cfg.windows()))[:, -1]
        pos = torch.full((1,), T, device=idx.device)  # on the device: no host-to-device copy per token
        if temperature == 0:  # the pick inside each step: a graph replays all of a token's work
            token = sample_next(logits, temperature=0)
            yield token
            steps = decode.greedy if isinstance(decode, GraphDecoder) else greedy
            yield from steps(model, token, pos, max_new_tokens - 1, T + 1)
            return
    for i in range(max_new_tokens):
        if not use_cache:
            logits = model(idx)[:, -1]
        token = sample_next(logits, temperature, top_k, top_p, generator)
        yield token
        if i + 1 == max_new_tokens:
            return
        if use_cache:
            # A graph replay overwrites these logits, but only at the next step's replay: sample_next
            # reads them before it in stream order, so no copy is needed.
            logits = decode(model, token, pos, T + i + 1)
            pos += 1
        else:
            idx = torch.cat([idx, token], dim=1)


# Greedy tokens one CUDA graph replays: that many greedy_steps captured back to back, so the host launches one
# replay and one copy out of the graph for 8 tokens, where it launched both for each. On an H200 with its
# server CPU that measured the same as one a replay (the 88m default at batch 1, Inductor's default mode:
# 240.4 against 239.7 us a token; `python bench.py --generate`, docs/performance/generation.md); it is the
# host's work a token that it cuts, for hosts slower than that one.
TOKENS_PER_REPLAY = 8


class GraphDecoder:
    """The decode step as a CUDA graph: decode_one compiled by Inductor (fused kernels), captured
    once per batch size and replayed for every token. A replay is one launch from Python for the
    whole step, where eager decoding launches about a hundred kernels and torch.compile's own
    CUDA graphs ("reduce-overhead") still check every weight on each call.

    A graph's shapes are fixed. The fused decode kernel (onegpu_kernels.decode_step, the default) reads
    the position from a tensor and stops there; the plain path reads all `context` cache positions,
    masked past the current length. Graphs per window of positions were measured and dropped: the
    step is bound by its ~80 small kernels, not by the bytes they read (docs/LOG.md, "Decode
    windows"). Inputs are copied into the graph's fixed buffers; the logits it returns are
    overwritten by the next replay. Greedy decoding replays a graph of tokens_per_replay greedy_steps
    instead, which feeds itself: its token and position buffers are its outputs too, and the tokens of
    a replay come out together (a graph of one step replays the last few of a generation).

    mode is Inductor's compile mode; None picks by batch size what measured fastest on an H200
    (docs/performance/generation.md): max-autotune at batch 1, where Inductor's own kernels for the
    one-row matmuls can fuse the norms and the activation in, and the default mode above it, where cuBLAS wins."""

    def __init__(self, model: M.Llama, mode: str | None = None, tokens_per_replay: int = TOKENS_PER_REPLAY):
        self.model, self.mode, self.tokens_per_replay = model, mode, tokens_per_replay
        self.greedy_sizes = tuple(dict.fromkeys((tokens_per_replay, 1)))  # greedy graphs' steps, largest first
        self.steps = {}  # (compile mode, dependent launches, fn) -> fn compiled so
        # Each batch size is one more compiled graph of decode_one, shared by every decoder in the
        # process; Dynamo's default limit (8) would stop a program that decodes many batch sizes.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.graphs = {}  # (batch, cache address, fn, steps) -> (graph, token, pos, logits or recent tokens)

    def step(self, batch: int, fn=decode_one):
        """fn (decode_one or greedy_step) compiled with this decoder's mode for `batch` sequences."""
        mode = self.mode or ("max-autotune-no-cudagraphs" if batch == 1 else "default")
        pdl = getattr(self.model, "dependent_launches", False)  # set by apply()
        if (mode, pdl, fn) not in self.steps:
            self.steps[mode, pdl, fn] = torch.compile(fn, options=compile_options(mode, pdl), fullgraph=True,
                                                      dynamic=False)
        return self.steps[mode, pdl, fn]

    def graph(self, token, pos, fn=decode_one, steps: int = 1):
        """The graph of `steps` calls of fn for this batch and cache, captured on first use, with token and
        pos copied into its input buffers: (graph, token, pos, logits or greedy_step's recent tokens)."""
        key = (token.shape[0], self.model.attentions()[0].cache.k.data_ptr(), fn, steps)
        if key not in self.graphs:
            self.graphs[key] = self.capture(token, pos, fn, steps)
        _, token_in, pos_in, _ = self.graphs[key]
        token_in.copy_(token)
        pos_in.copy_(pos)
        return self.graphs[key]

    @torch.no_grad()  # inference graphs: compiled with grad on, Inductor would trace a backward too
    def __call__(self, model, token, pos, length: int | None = None):
        """Logits after `token` at `pos` (length, the tokens so far, is what eager decoding reads;
        the graph always reads the whole cache)."""
        graph, _, _, logits = self.graph(token, pos)
        graph.replay()
        return logits

    @torch.no_grad()
    def greedy(self, model, token, pos, n: int, length: int):
        """As generate.greedy (length unused: the graph reads the whole cache): tokens_per_replay tokens a
        replay while that many are left, then one a replay."""
        for steps in self.greedy_sizes:
            if n < steps:
                continue
            graph, token, pos, recent = self.graph(token, pos, greedy_step, steps)
            for _ in range(n // steps):
                graph.replay()
                yield from recent[-steps:].clone()  # (steps, B, 1): the next replay overwrites recent
            n %= steps

    def capture_all(self, batch: int, greedy: bool = False):
        """Compile and capture now (warm-up), not during a timed generation, the graphs for `batch`:
        decode_one's, or for greedy decoding greedy_step's of tokens_per_replay steps and of one."""
        self.model.setup_cache(batch)
        device = self.model.embed.weight.device
        token, pos = torch.zeros(batch, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
        with torch.no_grad():
            for steps in self.greedy_sizes if greedy else (1,):
                self.graph(token, pos, greedy_step if greedy else decode_one, steps)

    def capture(self, token, pos, fn, steps: int):
        token_in, pos_in = token.clone(), pos.clone()
        # greedy_step's recent tokens: always tokens_per_replay rows, so that every graph of a batch replays
        # one compiled step (a shape of its own would compile it again)
        extra = (token.new_zeros(self.tokens_per_replay, *token.shape),) if fn is greedy_step else ()
        step = self.step(token.shape[0], fn)
        window = self.model.cfg.context
        # The cache is written from pos_in on during warm-up and capture: keep its contents as they were.
        saved = [(a.cache.k.clone(), a.cache.v.clone()) for a in self.model.attentions()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture requires
            for _ in range(3):
                token_in.copy_(token)  # greedy_step advances pos_in: each warm-up writes the same position
                pos_in.copy_(pos)
                step(self.model, token_in, pos_in, window, *extra)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(steps):
                logits = step(self.model, token_in, pos_in, window, *extra)
        for a, (k, v) in zip(self.model.attentions(), saved):
            a.cache.k.copy_(k)
            a.cache.v.copy_(v)
        return graph, token_in, pos_in, extra[0] if extra else logits


def compile_options(mode: str, pdl: bool) -> dict:
    """Inductor's settings for a decode step compiled in `mode`; with pdl (model.decode_pdl, on a card
    that has it), its generated kernels launch while the kernel before them runs and wait inside for
    what they read (Inductor's triton.enable_pdl; its matmul templates and cuBLAS's kernels launch as
    before; a torch without the setting leaves them all plain). torch.compile takes a mode or
    options, not both: these are the mode's own options."""
    pdl = pdl and hasattr(torch._inductor.config.triton, "enable_pdl")
    return torch._inductor.list_mode_options(mode) | ({"triton.enable_pdl": True} if pdl else {})


def decoder(model: M.Llama, device: torch.device, fast: bool = True, mode: str | None = None,
            tokens_per_replay: int = TOKENS_PER_REPLAY):
    """The decode step generate() uses: a GraphDecoder on CUDA (mode: Inductor's compile mode,
    None for the fastest measured at each batch size), the plain decode_one (this file) elsewhere or
    with fast=False (the reference the fast path is tested against)."""
    return GraphDecoder(model, mode, tokens_per_replay) if fast and device.type == "cuda" else decode_one


class Timer:
    """Time to first token, then the decode rate, synchronising the device at each mark."""

    def __init__(self, device: torch.device):
        self.device, self.marks = device, []

    def mark(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.marks.append(time.perf_counter())


def generate_batch(model: M.Llama, ids: list[int], batch: int, max_new_tokens: int, temperature: float,
                   top_k: int, top_p: float, generator, use_cache: bool = True, decode=None,
                   on_token=None) -> tuple[list[list[int]], Timer]:
    """`batch` continuations of ids decoded together. on_token(step, tokens (B,)) sees each step.
    Returns the new token ids per sample and the timer (start, first token, end)."""
    device = model.embed.weight.device
    idx = torch.tensor([ids] * batch, device=device)
    new, timer = [], Timer(device)
    timer.mark()
    for token in generate(model, idx, max_new_tokens, temperature, top_k, top_p, generator, use_cache,
                            decode=decode):
        new.append(token)
        if len(new) == 1:
            timer.mark()
        if on_token is not None:
            on_token(len(new) - 1, token[:, 0])
    timer.mark()
    tokens = torch.cat(new, dim=1).tolist() if new else [[] for _ in range(batch)]
    return tokens, timer


# --- The decode fast paths ------------------------------------------------------------------
# Swaps as fastpaths.py's (a subclass with the same parameters, its plain forward where the kernel does not
# run), applied once by apply() to a model on its device. Each runs with gradients off only.

def apply(model: M.Llama, speed: FP.SpeedConfig, device: torch.device) -> list[str]:
    """Swap into `model` the generation fast paths speed turns on (GENERATION_FAST_PATHS) where their kernels run
    (an Ampere or newer GPU; dependent launches from Hopper on). Returns the paths swapped in."""
    if not K.device_supported(device):
        return []
    on = FP.running(FP.GENERATION_FAST_PATHS, model.cfg, speed)
    pdl = "decode_pdl" in on and K.dependent_launch(device)
    small = "decode_matmuls" in on
    for module in list(model.modules()):
        if isinstance(module, M.Attention) and "fused_decode" in on:
            FP.swap(module, FusedDecodeAttention, split="split_decode" in on, pdl=pdl)
        elif isinstance(module, M.ReLU2) and ("decode_mlp" in on or small):
            FP.swap(module, DecodeReLU2, kernel="decode_mlp" in on, small=small, pdl=pdl)
        elif isinstance(module, nn.Linear) and small and type(module) is nn.Linear:
            FP.swap(module, SmallLinear)
    if small:
        FP.swap(model.output, SmallOutput)
    if "fused_decode" in on and model.value_embeds:
        FP.swap(model, GatheredValues)
    model.dependent_launches = pdl
    return [n for n in on if n != "decode_pdl" or pdl]


def small_linear(x, weight, relu2: bool = False):
    """F.linear without a bias (relu2: then relu(.)^2). A decode step's product, one new token for each of at
    most 16 sequences (x: (B, 1, d)), runs as onegpu_kernels.small_matmul, the square in its epilogue, tested
    against these lines. Not the prompt's: its kernel is autotuned per shape, once, and the compiled decode
    step's warm-up is where that costs nothing a user waits for."""
    one_token = x.dim() == 3 and x.shape[1] == 1
    if one_token and not torch.is_grad_enabled() and K.small_matmul_supported(x, weight):
        return K.small_matmul(x, weight, relu2)
    y = F.linear(x, weight)
    return F.relu(y).square() if relu2 else y


class SmallLinear(nn.Linear):
    """decode_matmuls: a bias-free nn.Linear through small_linear."""

    def forward(self, x):
        return small_linear(x, self.weight)


class SmallOutput(M.Output):
    """decode_matmuls: the head's product through small_linear."""

    def logits(self, x, weight):
        return M.softcap(small_linear(x, weight), self.cap, self.shift, self.temperature)


class DecodeReLU2(M.ReLU2):
    """decode_mlp: a decode step's ReLU² MLP as one kernel (onegpu_kernels.decode_mlp); decode_matmuls: its two
    matmuls through small_linear, the square in the first one's epilogue."""
    kernel = small = pdl = False

    def forward(self, x):
        if torch.is_grad_enabled():
            return super().forward(x)
        if self.kernel and K.decode_mlp_supported(x, self.w1.weight, self.w2.weight):
            # (P, B, T, d) float32 partial sums, one per 32 hidden units: their sum is the MLP's output
            return K.decode_mlp(x, self.w1.weight, self.w2.weight, self.pdl).sum(0).to(x.dtype)
        if self.small:
            return small_linear(small_linear(x, self.w1.weight, relu2=True), self.w2.weight)
        return super().forward(x)


class GatheredValues(M.Llama):
    """With the fused decode: a decoded token's rows of every value table gathered into one buffer before the
    first layer. The decode kernel is opaque to Inductor, which otherwise gathers each layer's rows in a kernel of
    its own just before it (a launch a table a token)."""

    def value_rows(self, idx) -> list:
        rows = super().value_rows(idx)
        return rows if torch.is_grad_enabled() else list(torch.stack(rows).unbind(0))


class FusedDecodeAttention(M.Attention):
    """fused_decode: one new token's QK-norm, RoPE, value mix, cache write, attention over positions 0..pos and
    gate in one Triton kernel (onegpu_kernels.decode_step), tested against the plain path. split: each head's
    cached positions over many programs (split_decode); pdl: launched as a dependent (decode_pdl)."""
    split = pdl = False

    def new_cache(self, batch: int, device, dtype) -> A.KVCache:
        cache = super().new_cache(batch, device, dtype)
        # split_decode's count of each head's finished programs, zero between steps
        cache.register_buffer("counts", torch.zeros(batch, self.n_kv_heads, device=device, dtype=torch.int32),
                              persistent=False)
        return cache

    def forward(self, x, rope, masks: A.Masks, ve=None, v_add=None):
        B, T, _ = x.shape
        assert v_add is None  # fastpaths' rule keeps this kernel out of a model with dense_last
        if masks.pos is None or torch.is_grad_enabled() or T != 1:
            return super().forward(x, rope, masks, ve)
        qkv = self.wqkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        if not K.decode_step_supported(qkv, self.cache.k):
            return self.wo(self.gated(self.attend(qkv, rope, masks, ve), x).reshape(B, T, -1))
        parts = {}
        if self.q_norm is not None:
            parts.update(q_gain=self.q_norm.weight, k_gain=self.k_norm.weight, eps=self.q_norm.eps)
        if self.v_mix is not None:
            parts.update(v_mix=self.v_mix, ve=ve)
        if self.gate is not None:
            parts.update(gate_x=x, gate_w=self.gate.weight)
        if self.split:
            parts.update(counts=self.cache.counts)
        if self.pdl:
            parts.update(pdl=True)
        y = K.decode_step(qkv, rope[0][0], rope[1][0], self.cache.k, self.cache.v, masks.pos,
                          self.scale or self.head_dim ** -0.5, window=self.window, **parts)  # (B, 1, H, hd)
        return self.wo(y.reshape(B, T, -1))
