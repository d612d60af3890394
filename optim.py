"""The optimizer and the learning-rate schedule: what train.py steps with.

    AdamW (the article's recipe): every parameter, weight decay on the block matrices only.
    Muon (train.muon): the block matrices, whose update is orthogonalised; AdamW keeps the
        embedding, the head and the norm gains, which are not matrices acting on the stream.

AdamW's other parameters fall in three groups with a learning rate each (train.embed_lr, head_lr,
scalar_lr; 0 means train.lr): the token and value embeddings, an untied head, and the norm gains
and mixing scalars. modded-nanogpt trains them at 0.6, 0.008 and 0.04 (its Adam lr 0.008 with
multipliers 75, 1 and 5): an embedding row moves only when its token occurs, and a row read through
a norm only changes by direction, so it wants a far larger step than a matrix every token uses.
Every group's rate follows the one schedule (lr_at) as its `lr_ratio` to train.lr.

Muon ("MomentUm Orthogonalized by Newton-schulz", Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/)
keeps SGD momentum and replaces each matrix's update by the nearest semi-orthogonal matrix, found
with five steps of a quintic Newton-Schulz iteration. modded-nanogpt's controlled optimizer
track measured it at 1.73x fewer steps than AdamW to the same loss (124M model, 524K batch).

torch.optim.Muon (PyTorch 2.9+) computes the same update, matrix by matrix. This file's Muon
differs in two ways, each for a reason:
  - stacked matrices are orthogonalised part by part: w13 holds SwiGLU's W1 and W3 and wqkv holds
    Wq, Wk and Wv; orthogonalising the stack as one matrix would couple parts that act
    independently (modded-nanogpt orthogonalises q, k and v separately for the same reason);
  - parts of equal shape are orthogonalised together, as one batched matmul per Newton-Schulz
    step, where torch's loop launches about 15 kernels per matrix (an 88m model has 40 of them).
For a matrix that is not split, the update equals torch.optim.Muon's (tests/test_optim.py).

Under torchrun every rank holds the same all-reduced gradients, so each would orthogonalise every
matrix again. With `shared` (train.muon_shared, the default) each rank orthogonalises a 1/world share
of each shape's parts and the ranks all-gather the results, as modded-nanogpt splits its Muon work;
the update is the one-process update (a test with two gloo processes).
"""

import math
from collections import defaultdict

import torch
import torch.distributed as dist

import config as C
import onegpu_kernels as K
import model as M

# The optimizer's fast path beside model.TRAINING_FAST_PATHS: a train setting, off unless named, whose
# plain twin is orthogonalize's batched matmuls.
FAST_PATHS = {"muon_kernel": "muon kernel"}

# Newton-Schulz quintic coefficients, chosen to maximise the slope at zero (Jordan 2024;
# the same constants as torch.optim.Muon).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# Polar Express (Amsel et al. 2025, arXiv 2505.16932; modded-nanogpt record #38): a quintic of its own at each
# of the five steps, each the minimax-optimal one for the singular values the step before can leave, so the
# five land nearer 1 than Newton-Schulz's one quintic five times. Computed there for five steps with a safety
# factor of 2e-2 (the input is divided by 1.02 times its norm) and a cushion of 2.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
POLAR_EXPRESS_SAFETY = 1.02


# --- The schedule --------------------------------------------------------------------------

def lr_at(step: int, cfg: C.TrainConfig, steps: int) -> float:
    """The AdamW learning rate at `step` (Muon's follows the same shape at train.muon_lr).

    cosine: linear warm-up to lr, then a cosine down to min_lr_ratio * lr at the last step
        (GPT-3, Llama).
    wsd: warm-up, stable at lr, then a linear warm-down to min_lr_ratio * lr over the last
        warmdown_fraction of the steps (Hägele et al. 2024; modded-nanogpt, nanochat)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.warmdown_fraction * steps))
        left = (steps - step) / decay_steps  # 1 where the warm-down starts, 0 at the end
        return cfg.lr * (floor + (1 - floor) * min(1.0, max(0.0, left)))
    progress = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (floor + (1 - floor) * cosine)


# --- Muon ----------------------------------------------------------------------------------

def muon_momentum_at(step: int, cfg: C.TrainConfig, steps: int | None = None) -> float:
    """Muon's momentum at `step` of `steps`: from muon_momentum_start up to muon_momentum, linearly over the first
    muon_momentum_warmup steps (modded-nanogpt: 0.85 to 0.95 over 300 steps), constant, then back down to
    muon_momentum_start over the last muon_momentum_cooldown steps (modded-nanogpt record #39: 50; none where
    steps is None, a length not known yet). A lower momentum early averages over fewer of the first, fast-changing
    gradients; late, it lets the last steps of the cool-down count more."""
    low, high = cfg.muon_momentum_start, cfg.muon_momentum
    if step < cfg.muon_momentum_warmup:
        frac = step / cfg.muon_momentum_warmup
        return (1 - frac) * low + frac * high
    cooldown_start = (steps or 0) - cfg.muon_momentum_cooldown
    if cfg.muon_momentum_cooldown and steps is not None and step > cooldown_start:
        frac = min(1.0, (step - cooldown_start) / cfg.muon_momentum_cooldown)
        return (1 - frac) * high + frac * low
    return high


def orthogonalize(g: torch.Tensor, dtype: torch.dtype, eps: float = 1e-7, kernel: bool = False,
                  iteration: str = "newton-schulz") -> torch.Tensor:
    """The Newton-Schulz iteration on a stack of matrices g (n, rows, cols): about U V^T of each
    matrix's SVD U S V^T (the singular values land in roughly [0.7, 1.2], which trains as well).
    Computed in `dtype` (bfloat16 on a GPU, as published); returns g's dtype. kernel: the two symmetric
    products through onegpu_kernels.gram where it runs (train.muon_kernel), each symmetric tile computed once.
    iteration: "newton-schulz" (one quintic five times) or "polar-express" (POLAR_EXPRESS, a quintic a step)."""
    x = g.to(dtype)
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:  # iterate on the wide orientation: the Gram matrix is the smaller square
        x = x.mT
    if iteration == "polar-express":
        steps = POLAR_EXPRESS
        x = x / (x.norm(dim=(-2, -1), keepdim=True) * POLAR_EXPRESS_SAFETY + 1e-6)
    else:
        steps = (NS_COEFFICIENTS,) * NS_STEPS
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    kernel = kernel and K.gram_supported(x)
    for a, b, c in steps:
        # x <- a x + (b G + c G G) x with G = x x^T, as three batched matmuls whose epilogues do the
        # scaling and the adding (baddbmm: beta * input + alpha * batch1 @ batch2), no kernel between
        if kernel:
            gram = K.gram(x)
            mix = K.gram(gram, gram, alpha=c, beta=b)  # G G = G G^T: G is symmetric
        else:
            gram = x @ x.mT
            mix = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, mix, x, beta=a)
    return (x if wide else x.mT).to(g.dtype)


def orthogonalize_shared(g: torch.Tensor, dtype: torch.dtype, kernel: bool = False,
                         iteration: str = "newton-schulz") -> torch.Tensor:
    """orthogonalize(g, dtype, kernel=kernel, iteration=iteration) with the work split over the ranks of the process group: rank r
    iterates on parts [r * k, (r + 1) * k) of the n (k = n / world rounded up; zero matrices pad
    the last share, and stay zero), then every rank gathers all of them. g: (n, rows, cols)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    k = -(-g.shape[0] // world)
    padded = torch.cat([g, g.new_zeros(k * world - g.shape[0], *g.shape[1:])]) if k * world > g.shape[0] else g
    gathered = torch.empty_like(padded)
    dist.all_gather(list(gathered.chunk(world)), orthogonalize(padded[rank * k:(rank + 1) * k], dtype, kernel=kernel,
                                                                 iteration=iteration).contiguous())
    return gathered[:g.shape[0]]


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters. Each group may give `splits`: a list, one per parameter, of the row
    counts its stacked parts have (None: the matrix is one part). Per part of shape (A, B):
        buf = momentum * buf + grad;   update = grad + momentum * buf (Nesterov)
        p  -= lr * max(1, A/B) ** 0.5 * orthogonalize(update)  (after decoupled weight decay)
    The group's `tall_scale` False drops the max(1, A/B) ** 0.5: every part then steps at lr.
    ns_dtype: the iteration's dtype; None means bfloat16 on CUDA, float32 elsewhere (a CPU's
    bfloat16 matmuls are slow). Tests pass float64 to compare with the published algorithm.
    shared: in a process group of several ranks, split the iteration over them (orthogonalize_shared);
    every rank must then step with the same gradients, as DDP's all-reduce leaves them.
    kernel: the iteration's symmetric products through onegpu_kernels.gram where it runs (orthogonalize).
    iteration: "newton-schulz" or "polar-express" (orthogonalize).
    beta2: NorMuon (Li et al. 2025, arXiv 2510.05491; modded-nanogpt records #41-#48) where > 0: each part's
    orthogonalised update divided by the root of an EMA (decay beta2) of its squared rows' means (columns' for a
    wide part), then scaled back to its own Frobenius norm, so that no neuron steps much further than another."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_dtype: torch.dtype | None = None, tall_scale: bool = True, shared: bool = True,
                 kernel: bool = False, iteration: str = "newton-schulz", beta2: float = 0.0,
                 cautious: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, splits=None,
                                      tall_scale=tall_scale))
        self.ns_dtype, self.shared, self.kernel = ns_dtype, shared, kernel
        self.iteration, self.beta2, self.cautious = iteration, beta2, cautious
        for group in self.param_groups:
            for p in group["params"]:
                assert p.dim() == 2, f"Muon updates matrices only, got a parameter of shape {tuple(p.shape)}"

    @torch.no_grad()
    def step(self, closure=None):
        # The lines over every matrix are foreach ops, a few launches for the whole list where a loop over the
        # matrices launched one a matrix: at 88m a step ran 355 ops that launch a kernel, 86 now (docs/LOG.md,
        # 2026-12-04), most of those gone elementwise ops on one matrix that a GPU finishes in microseconds.
        for group in self.param_groups:
            splits = group["splits"] or [None] * len(group["params"])
            live = [(p, rows) for p, rows in zip(group["params"], splits) if p.grad is not None]
            if not live:
                continue
            params, grads = [p for p, _ in live], [p.grad for p, _ in live]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, grads)
            updates = torch._foreach_add(grads, bufs, alpha=group["momentum"])
            by_shape = defaultdict(list)  # part shape -> the parts' updates (views)
            moments = defaultdict(list)  # part shape -> the parts' NorMuon second moments (with beta2)
            for p, update, (_, rows) in zip(params, updates, live):
                parts = update.split(rows) if rows else [update]
                for i, part in enumerate(parts):
                    by_shape[tuple(part.shape)].append(part)
                if self.beta2:
                    for part, moment in zip(parts, self.second_moments(p, parts)):
                        moments[tuple(part.shape)].append(moment)
            dtype = self.ns_dtype or (torch.bfloat16 if params[0].is_cuda else torch.float32)
            split = self.shared and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            iterate = orthogonalize_shared if split else orthogonalize
            for (A, B), parts in by_shape.items():
                # max(1, A/B) ** 0.5: a tall part's orthogonal update has a smaller RMS; this keeps
                # every part's step the same size (Jordan's scaling, torch's adjust_lr_fn "original")
                scale = max(1.0, A / B) ** 0.5 if group["tall_scale"] else 1.0
                ortho = iterate(torch.stack(parts), dtype, kernel=self.kernel, iteration=self.iteration)
                if self.beta2:
                    ortho = normalized_neurons(ortho, moments[(A, B)], self.beta2)
                if scale != 1.0:
                    ortho.mul_(scale)
                torch._foreach_copy_(parts, list(ortho.unbind(0)))  # views of their matrices' updates: in place
            if group["weight_decay"]:
                decay(params, updates, group["lr"] * group["weight_decay"], self.cautious)
            torch._foreach_add_(params, updates, alpha=-group["lr"])
        return None

    def second_moments(self, p: torch.Tensor, parts: list) -> list[torch.Tensor]:
        """NorMuon's second moment of each of p's parts, in at least float32: (A, 1) a row for a part of A >= B
        rows, else (1, B) a column, zero at the first step."""
        state, dtype = self.state[p], torch.promote_types(p.dtype, torch.float32)
        if "second_moment" not in state:
            state["second_moment"] = [torch.zeros((A, 1) if A >= B else (1, B), device=p.device, dtype=dtype)
                                      for A, B in (part.shape for part in parts)]
        return state["second_moment"]


def decay(params: list, updates: list, rate: float, cautious: bool):
    """Decoupled weight decay, p -= rate * p, before the step p -= lr * update. Cautious (modded-nanogpt records
    #43 and #50): only where p and its update have the same sign (p * update >= 0), the entries the step moves
    toward zero anyway; the others keep their size."""
    if not cautious:
        torch._foreach_mul_(params, 1 - rate)
        return
    agree = [(p * u >= 0).to(p.dtype) for p, u in zip(params, updates)]
    torch._foreach_addcmul_(params, params, agree, value=-rate)


def normalized_neurons(ortho: torch.Tensor, moments: list, beta2: float) -> torch.Tensor:
    """NorMuon's step on a stack of orthogonalised updates ortho (n, A, B): each row (A >= B; columns where
    A < B) divided by the root of its mean square's EMA, moments (one (A, 1) or (1, B) tensor a part, updated in
    place), then each matrix scaled back to its Frobenius norm. Returns a new (n, A, B) tensor in ortho's dtype."""
    A, B = ortho.shape[-2:]
    u = ortho.to(moments[0].dtype)
    mean_sq = u.square().mean(dim=-1 if A >= B else -2, keepdim=True)  # (n, A, 1) or (n, 1, B)
    ema = torch.stack(moments).lerp_(mean_sq, 1 - beta2)
    torch._foreach_copy_(moments, list(ema.unbind(0)))
    scaled = u * ema.clamp(min=1e-10).rsqrt()
    norm = u.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-10)
    return (scaled * norm).to(ortho.dtype)


# --- Assembling the optimizer --------------------------------------------------------------

class Optimizers:
    """Muon and AdamW stepped as one optimizer: what train_step and checkpoints see. param_groups
    lists both, each group with its `lr_ratio` to the scheduled AdamW learning rate."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict):
        if len(state.get("optimizers", [])) != len(self.optimizers):
            raise ValueError("the checkpoint's optimizer state is not Muon + AdamW: resume with the optimizer "
                             "the run was started with (train.muon)")
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)


def inner_optimizers(optimizer) -> list:
    """The torch optimizers behind train_step's optimizer (Muon and AdamW, or AdamW alone)."""
    return list(optimizer.optimizers) if isinstance(optimizer, Optimizers) else [optimizer]


# --- One matrix for the head and the embedding, then two (train.untie_at) -------------------
# modded-nanogpt's records #51 and #53 train the head and the token embedding as one matrix, as a tied model does,
# for the first 2/3 of the run, then apart. Here the model stays untied (its head keeps its fast paths) and the
# optimizer ties them: the two gradients summed into the head's, the head stepped, the embedding set to a copy.

@torch.no_grad()
def share_init(model: M.Llama, std: float = 0.005):
    """The one matrix's start: the head at N(0, std^2) (record #51's 0.005; an untied head starts at zero, which an
    embedding must not), the embedding a copy of it."""
    model.head.weight.normal_(0.0, std)
    model.embed.weight.copy_(model.head.weight)


@torch.no_grad()
def tie_grads(optimizer, head: torch.Tensor, embed: torch.Tensor, tied: bool):
    """Before the optimizer's step. Tied: the embedding's gradient joins the head's, the sum a tied weight's
    two uses give, and the embedding sits the step out (grad None: no optimizer touches it; train_step then
    copies the head into it). Apart: at the first such step the embedding's AdamW moments start as a copy of the head's
    (record #53) rather than at zero; it has no state until then, so this happens once, resumed or not."""
    if tied:
        head.grad.add_(embed.grad)
        embed.grad = None
        return
    for opt in inner_optimizers(optimizer):
        if head in opt.state and embed not in opt.state:
            opt.state[embed] = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[head].items()}


def set_step_rates(optimizer, lr: float, muon_momentum: float | None = None):
    """This step's rates into every group: the scheduled AdamW rate `lr` (lr_at) times the group's
    lr_ratio, and Muon's momentum (muon_momentum_at; None leaves it as configured)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
        if muon_momentum is not None and "splits" in group:  # a Muon group
            group["momentum"] = muon_momentum


def load_state(optimizer, state: dict):
    """Put a checkpoint's optimizer state (moments, momentum buffers, step counts) into `optimizer`,
    keeping the hyperparameters it was built with from the config. torch's load_state_dict puts the
    saved ones back too (momentum, betas, eps, weight decay, lr_ratio), so a resume that changed
    them would report the change and not make it."""
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    muon_run = "optimizers" in state
    if muon_run != isinstance(optimizer, Optimizers):
        raise ValueError(f"the checkpoint's optimizer is {'Muon + AdamW' if muon_run else 'AdamW alone'}, this run's "
                         f"is {'Muon + AdamW' if not muon_run else 'AdamW alone'}: resume with "
                         f"{'--muon' if muon_run else '--no-muon'}, as the run was started")
    try:
        optimizer.load_state_dict(state)
    except ValueError as e:
        if "parameter group" not in str(e):
            raise
        raise ValueError("the checkpoint's optimizer groups its parameters differently from this version of "
                         "onegpu (embedding, head and scalars each have a group of their own since per-group "
                         "learning rates): finish the run with the version that started it") from None
    for group, values in zip(optimizer.param_groups, configured):
        group.update(values)


def stacked_rows(name: str, p: torch.Tensor, cfg: M.ModelConfig) -> list[int] | None:
    """The row counts of the matrices stacked in parameter `name`: wqkv is [Wq; Wk; Wv] and a
    SwiGLU w13 is [W1; W3]. None for a matrix that is one part."""
    if name.endswith("attn.wqkv.weight"):
        kv = cfg.n_kv_heads * cfg.head_dim
        return [cfg.d_model, kv, kv]
    if name.endswith("mlp.w13.weight"):
        return [cfg.ffn_hidden, cfg.ffn_hidden]
    return None


def param_groups(model: M.Llama, shared_head: bool = False) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """(name, parameter) pairs by role: "matrices" are the block matrices (weight decay with AdamW,
    Muon's with muon); "embed" the value and bigram embeddings and an untied token embedding, "head" the head,
    "scalars" the norm gains and mixing scalars, "dense" dense_last's connections. A token embedding that is also
    the head (tied, or shared_head: train.untie_at) steps as the head does, as modded-nanogpt's records #51 and #53
    step it. None of the last four has AdamW's decay: a rare token's row would shrink between the few steps that
    update it; decay would pull norm gains toward zero, not toward one (train.adam_weight_decay decays the first two,
    only where a step moves an entry toward zero anyway: CautiousAdamW)."""
    groups = {"matrices": [], "embed": [], "head": [], "scalars": [], "dense": []}
    headlike = ("head.weight", "embed.weight") if model.cfg.tie_embeddings or shared_head else ("head.weight",)
    for name, p in model.named_parameters():
        if p.dim() == 2 and name.startswith("blocks."):
            role = "matrices"
        elif name in headlike:
            role = "head"
        elif name in ("embed.weight", "bigram.weight") or name.startswith("value_embeds."):
            role = "embed"
        elif name.startswith("dense."):
            role = "dense"
        else:
            role = "scalars"
        groups[role].append((name, p))
    return groups


# train.adam_weight_decay's multiplier by role: modded-nanogpt's (records #50 on) for its head and token embedding
# (150), its value and bigram tables (5) and its scalars (0). Our untied token embedding steps at the tables' rate
# (embed_lr), where 150 would take a quarter of each row a step: it decays as they do.
ADAM_DECAY = {"head": 150.0, "embed": 5.0, "scalars": 0.0, "dense": 0.0}
# model.dense_last's connections (record #81): a quarter of AdamW's rate, betas (0.9, 0.99), no decay (the record's).
DENSE_LR_RATIO, DENSE_BETAS = 0.25, (0.9, 0.99)


def adamw_groups(groups: dict, cfg: C.TrainConfig) -> list[dict]:
    """AdamW's groups, one per role that has parameters, each at its own learning rate and betas; none has AdamW's
    own decay, some CautiousAdamW's (train.adam_weight_decay)."""
    rates = {"embed": cfg.embed_lr, "head": cfg.head_lr, "scalars": cfg.scalar_lr, "dense": DENSE_LR_RATIO * cfg.lr}
    betas = {"embed": (cfg.embed_beta1, 0.0), "head": (cfg.head_beta1, 0.0),
             "scalars": (cfg.scalar_beta1, cfg.scalar_beta2), "dense": DENSE_BETAS}
    return [{"params": [p for _, p in groups[role]], "weight_decay": 0.0, "lr_ratio": (rate or cfg.lr) / cfg.lr,
             "betas": (betas[role][0] or cfg.beta1, betas[role][1] or cfg.beta2),
             "role": role, "cautious_decay": cfg.adam_weight_decay * ADAM_DECAY[role]}
            for role, rate in rates.items() if groups[role]]


class CautiousAdamW(torch.optim.AdamW):
    """AdamW that first decays each entry its step moves toward zero by lr^2 x the group's "cautious_decay"
    (modded-nanogpt's cautious weight decay on Adam, record #50: the decay grows and shrinks with the rate
    squared). Adam's step has the sign of its new first moment, beta1 m + (1 - beta1) g, known before the step;
    decaying p first changes nothing Adam computes, so this is the record's p - lr^2 c mask p - step."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._step_supports_amp_scaling = False  # the mask reads the gradients: a GradScaler unscales them first

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            rate, beta1 = group["lr"] ** 2 * group["cautious_decay"], group["betas"][0]
            if not rate:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                # the new first moment beta1 m + (1 - beta1) g (m is 0 at the first step) times p, > 0 where the step
                # moves p toward zero; one temporary the size of p (the bigram table's is 0.5 GB at 126m)
                m = self.state[p].get("exp_avg")
                toward = p.grad.mul(p) if m is None else torch.lerp(p.grad, m, beta1).mul_(p)
                p.addcmul_(p, toward.gt_(0), value=-rate)
        return super().step(closure)


def configure_optimizer(model: M.Llama, cfg: C.TrainConfig):
    """AdamW on everything, or Muon on the block matrices and AdamW on the rest (cfg.muon)."""
    groups = param_groups(model, shared_head=cfg.untie_at > 0)
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[cfg.optimizer]
    adam = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, **impl)
    matrices = [p for _, p in groups["matrices"]]
    adamw = CautiousAdamW if cfg.adam_weight_decay else torch.optim.AdamW
    if not cfg.muon:
        return adamw([{"params": matrices, "weight_decay": cfg.weight_decay, "lr_ratio": 1.0, "role": "matrices",
                       "cautious_decay": 0.0}, *adamw_groups(groups, cfg)], **adam)
    muon = Muon([{"params": matrices, "lr_ratio": cfg.muon_lr / cfg.lr, "role": "matrices",
                  "splits": [stacked_rows(n, p, model.cfg) for n, p in groups["matrices"]]}],
                lr=cfg.muon_lr, momentum=muon_momentum_at(0, cfg), weight_decay=cfg.muon_weight_decay,
                tall_scale=cfg.muon_tall_scale, shared=cfg.muon_shared, kernel=cfg.muon_kernel,
                iteration=cfg.muon_iteration, beta2=cfg.muon_beta2, cautious=cfg.muon_cautious)
    return Optimizers(muon, adamw(adamw_groups(groups, cfg), **adam))
