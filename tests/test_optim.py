"""optim.py: which tensors each optimizer updates, the schedules' shapes, and Muon's update
against the published algorithm computed in float64."""

import dataclasses
import math

import pytest
import torch

import config as C
import model as M
import optim as O
import train as TR
from conftest import tiny_model_cfg


def names_in(opt, model) -> list[set[str]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [{by_id[id(p)] for p in g["params"]} for g in opt.param_groups]


def test_muon_takes_the_block_matrices_and_adamw_the_rest_by_role():
    model = M.Llama(tiny_model_cfg(n_layers=1, mlp="relu2", qk_norm=True, tie_embeddings=False))
    opt = O.configure_optimizer(model, C.TrainConfig(steps=1, muon=True, muon_lr=0.02, lr=0.004))
    muon, embed, head, scalars = names_in(opt, model)
    assert muon == {"blocks.0.attn.wqkv.weight", "blocks.0.attn.wo.weight", "blocks.0.mlp.w1.weight",
                    "blocks.0.mlp.w2.weight"}
    assert embed == {"embed.weight"} and head == {"head.weight"}
    assert scalars == {"norm.weight", "blocks.0.attn_norm.weight", "blocks.0.mlp_norm.weight",
                       "blocks.0.attn.q_norm.weight", "blocks.0.attn.k_norm.weight"}
    assert [g["lr_ratio"] for g in opt.param_groups] == pytest.approx([5.0, 1.0, 1.0, 1.0])
    assert opt.param_groups[0]["splits"][0] == [64, 64, 64]  # wqkv: q, k, v orthogonalised apart


def test_each_adamw_group_runs_at_its_own_rate_and_the_record_parts_find_theirs():
    """embed_lr, head_lr and scalar_lr become each group's ratio to train.lr, so the schedule scales
    them together; value embeddings train with the embedding, the mixing scalars with the gains and
    the gate with Muon (it is a block matrix)."""
    cfg = tiny_model_cfg(n_layers=2, tie_embeddings=False, value_embeds=1, unet_skips=True, x0_mix=True, attn_gate=True)
    model = M.Llama(cfg)
    opt = O.configure_optimizer(model, C.TrainConfig(steps=1, muon=True, lr=0.008, embed_lr=0.6, head_lr=0.004,
                                                     scalar_lr=0.04))
    muon, embed, head, scalars = names_in(opt, model)
    assert "blocks.0.attn.gate.weight" in muon and embed == {"embed.weight", "value_embeds.0.weight"}
    assert {"skip_weights", "blocks.1.x0_mix", "blocks.0.attn.v_mix", "blocks.1.attn.v_mix"} <= scalars
    ratios = {g["role"]: g["lr_ratio"] for g in opt.param_groups}
    assert ratios["embed"] == pytest.approx(75) and ratios["head"] == pytest.approx(0.5)
    assert ratios["scalars"] == pytest.approx(5)


def test_each_adamw_group_steps_with_its_own_betas():
    """head_beta1, embed_beta1 and scalar_beta1/2 (modded-nanogpt's since #52 and #57) reach the moments torch keeps:
    after one step of gradient g, each group's first moment is (1 - beta1) g and its second (1 - beta2) g^2; an
    unset one (0) is train.beta1 / beta2."""
    model = M.Llama(tiny_model_cfg(n_layers=2, tie_embeddings=False, value_embeds=1))
    tcfg = C.TrainConfig(steps=1, muon=True, lr=0.008, beta1=0.8, beta2=0.95, head_beta1=0.5, embed_beta1=0.75,
                         scalar_beta1=0.9, scalar_beta2=0.99, optimizer="for-loop")
    opt = O.configure_optimizer(model, tcfg)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    adamw = O.inner_optimizers(opt)[1]
    want = {"embed": (0.75, 0.95), "head": (0.5, 0.95), "scalars": (0.9, 0.99)}
    for group in adamw.param_groups:
        b1, b2 = want[group["role"]]
        for p in group["params"]:
            state = adamw.state[p]
            assert state["exp_avg"] == pytest.approx(torch.full_like(p, (1 - b1) * 0.5))
            assert state["exp_avg_sq"] == pytest.approx(torch.full_like(p, (1 - b2) * 0.25))
    plain = O.configure_optimizer(model, dataclasses.replace(tcfg, head_beta1=0.0, scalar_beta2=0.0))
    assert {g["role"]: g["betas"] for g in O.inner_optimizers(plain)[1].param_groups} == {
        "embed": (0.75, 0.95), "head": (0.8, 0.95), "scalars": (0.9, 0.95)}


def test_dense_connections_step_in_their_own_adamw_group_at_the_records_rate_and_betas():
    """dense_last's two connections (matrices outside the blocks) take neither Muon nor the scalars' rate: a quarter of
    train.lr, betas (0.9, 0.99), no decay (record #81's), under Muon or AdamW alone."""
    model = M.Llama(tiny_model_cfg(n_layers=4, n_heads=2, n_kv_heads=2, dense_last=True))
    for muon in (True, False):
        opt = O.configure_optimizer(model, C.TrainConfig(steps=1, muon=muon, lr=0.008, scalar_lr=0.04,
                                                         adam_weight_decay=0.005, optimizer="for-loop"))
        dense = next(g for g in O.inner_optimizers(opt)[-1].param_groups if g["role"] == "dense")
        by_id = {id(p): n for n, p in model.named_parameters()}
        assert {by_id[id(p)] for p in dense["params"]} == {f"dense.{j}.{w}" for j in (0, 1)
                                                           for w in ("w1.weight", "w2.weight", "w2.bias")}
        assert dense["lr_ratio"] == pytest.approx(0.25) and dense["betas"] == (0.9, 0.99)
        assert dense["cautious_decay"] == 0.0 and dense["weight_decay"] == 0.0


def test_adamw_decays_only_the_block_matrices():
    model = M.Llama(tiny_model_cfg(n_layers=1))
    opt = O.configure_optimizer(model, C.TrainConfig(steps=1))
    decayed, embed, scalars = names_in(opt, model)
    assert decayed == {"blocks.0.attn.wqkv.weight", "blocks.0.attn.wo.weight", "blocks.0.mlp.w13.weight",
                       "blocks.0.mlp.w2.weight"}
    assert embed == {"embed.weight"} and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.0]
    assert opt.defaults["betas"] == (0.9, 0.95)  # GPT-3's, the article's


def test_muon_momentum_warms_up_linearly_then_holds():
    cfg = C.TrainConfig(steps=1, muon=True, muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup=300)
    assert [O.muon_momentum_at(s, cfg) for s in (0, 150, 300, 1000)] == pytest.approx([0.85, 0.90, 0.95, 0.95])
    assert O.muon_momentum_at(0, C.TrainConfig(steps=1, muon_momentum=0.9)) == 0.9  # no warm-up: as configured


def test_muon_momentum_cools_down_over_the_last_steps():
    """modded-nanogpt record #39's cool-down: 0.95 back to 0.85 over the last 50 of the run's steps."""
    cfg = C.TrainConfig(steps=1, muon=True, muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup=300,
                        muon_momentum_cooldown=50)
    at = [O.muon_momentum_at(s, cfg, 1000) for s in (0, 300, 950, 975, 1000)]
    assert at == pytest.approx([0.85, 0.95, 0.95, 0.90, 0.85])
    off = C.TrainConfig(steps=1, muon=True, muon_momentum=0.95)
    assert O.muon_momentum_at(1000, off, 1000) == 0.95  # no cool-down: as configured


def test_muon_momentum_has_no_cool_down_before_the_runs_length_is_known():
    """configure_optimizer asks for step 0's momentum without the run's length (a --seconds run sizes it later)."""
    cfg = C.TrainConfig(steps=1, muon=True, muon_momentum=0.95, muon_momentum_cooldown=50)
    assert O.muon_momentum_at(0, cfg) == 0.95


def test_cautious_weight_decay_decays_only_where_the_update_agrees_in_float64():
    """Records #43/#50: p -= lr * wd * p * (update * p >= 0) + lr * update, with update the step Muon takes."""
    torch.manual_seed(0)
    p0, grad = torch.randn(32, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)

    def step(weight_decay, cautious):
        p = torch.nn.Parameter(p0.clone())
        p.grad = grad.clone()
        O.Muon([p], lr=0.1, momentum=0.9, weight_decay=weight_decay, ns_dtype=torch.float64,
               cautious=cautious).step()
        return p.detach()
    update = (p0 - step(0.0, False)) / 0.1  # the step Muon takes, decay aside
    agree = (update * p0 >= 0).double()
    assert 0.2 < agree.mean() < 0.8  # both kinds of entries are there
    torch.testing.assert_close(step(0.5, True), p0 - 0.1 * 0.5 * p0 * agree - 0.1 * update, rtol=0, atol=1e-12)
    torch.testing.assert_close(step(0.5, False), p0 * (1 - 0.1 * 0.5) - 0.1 * update, rtol=0, atol=1e-12)


def test_cautious_adam_decays_by_the_rate_squared_where_the_step_moves_toward_zero_in_float64():
    """Record #50 on Adam: p -= lr^2 c p (u p > 0) + u over three steps, u Adam's step (its moments carried), c the
    group's cautious_decay; a group without one steps as AdamW."""
    torch.manual_seed(0)
    p0, grads = torch.randn(32, 16, dtype=torch.float64), torch.randn(3, 32, 16, dtype=torch.float64)
    lr, c, (b1, b2), eps = 0.1, 2.0, (0.8, 0.95), 1e-12
    m = v = torch.zeros_like(p0)
    expected, agree = p0.clone(), []
    for t, g in enumerate(grads, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        u = lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + eps)
        agree.append((u * expected > 0).double().mean())
        expected = expected - lr ** 2 * c * expected * (u * expected > 0) - u
    assert all(0.2 < a < 0.8 for a in agree)  # both kinds of entries, each step
    p, plain = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = O.CautiousAdamW([{"params": [p], "cautious_decay": c}, {"params": [plain], "cautious_decay": 0.0}],
                          lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
    reference = torch.optim.AdamW([p0.clone().requires_grad_()], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
    for g in grads:
        p.grad, plain.grad, reference.param_groups[0]["params"][0].grad = g.clone(), g.clone(), g.clone()
        opt.step()
        reference.step()
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(plain.detach(), reference.param_groups[0]["params"][0].detach(), rtol=0, atol=0)


def test_adam_weight_decay_takes_the_records_multipliers_by_role():
    """train.adam_weight_decay: the head x150, the embeddings x5, the scalars not at all; 0 keeps torch's AdamW."""
    model = M.Llama(tiny_model_cfg(n_layers=1, tie_embeddings=False))
    adam = O.configure_optimizer(model, C.TrainConfig(steps=1, muon=True, adam_weight_decay=0.004)).optimizers[1]
    assert type(adam) is O.CautiousAdamW
    assert {g["role"]: g["cautious_decay"] for g in adam.param_groups} == pytest.approx(
        {"embed": 0.02, "head": 0.6, "scalars": 0.0})
    assert type(O.configure_optimizer(model, C.TrainConfig(steps=1, muon=True)).optimizers[1]) is torch.optim.AdamW


def test_a_loaded_state_keeps_the_configured_hyperparameters():
    """The moments come from the checkpoint, every hyperparameter from the config: torch's own
    load_state_dict would put the saved momentum, betas and ratios back."""
    model = M.Llama(tiny_model_cfg(n_layers=1))
    old = O.configure_optimizer(model, C.TrainConfig(steps=1, muon=True, muon_momentum=0.95, muon_lr=0.02, beta1=0.9))
    model(torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))).backward()
    old.step()
    new = O.configure_optimizer(model, C.TrainConfig(steps=1, muon=True, muon_momentum=0.9, muon_lr=0.04, beta1=0.8))
    O.load_state(new, old.state_dict())
    muon, *adam = new.param_groups
    assert muon["momentum"] == 0.9 and muon["lr_ratio"] == pytest.approx(0.04 / 6e-4)
    assert all(g["betas"] == (0.8, 0.95) for g in adam)
    first = [s["momentum_buffer"] for s in old.optimizers[0].state.values()]
    assert all(torch.equal(a, b["momentum_buffer"]) for a, b in zip(first, new.optimizers[0].state.values()))
    with pytest.raises(ValueError, match="optimizer is Muon \\+ AdamW, this run's is AdamW alone: resume with --muon"):
        O.load_state(O.configure_optimizer(model, C.TrainConfig(steps=1)), old.state_dict())


def test_the_schedules_shapes():
    cosine = C.TrainConfig(lr=1.0, warmup_steps=10, steps=110)
    assert [O.lr_at(s, cosine, 110) for s in (0, 9)] == pytest.approx([0.1, 1.0])
    assert O.lr_at(60, cosine, 110) == pytest.approx(0.55) and O.lr_at(110, cosine, 110) == pytest.approx(0.1)
    wsd = C.TrainConfig(lr=1.0, warmup_steps=10, steps=100, schedule="wsd", warmdown_fraction=0.4, min_lr_ratio=0.0)
    lrs = [O.lr_at(s, wsd, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and all(lr == 1.0 for lr in lrs[9:61])  # warm-up, then stable to step 60
    assert lrs[80] == pytest.approx(0.5) and lrs[99] == pytest.approx(0.025)  # a straight line to zero at step 100
    assert O.lr_at(100, wsd, 100) == 0.0


def published_muon(p, grads, lr, momentum, weight_decay, splits=None):
    """Jordan's muon.py (github.com/KellerJordan/Muon), in float64: momentum as an exponential
    average, Nesterov by a second lerp, five quintic Newton-Schulz steps on each part, scaled by
    max(1, rows/cols) ** 0.5, decoupled weight decay."""
    p, buf = p.clone().double(), torch.zeros_like(p, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum)
        parts = []
        for u in (update.split(splits) if splits else [update]):
            x = u.T if u.shape[0] > u.shape[1] else u
            x = x / (x.norm() + 1e-7)
            for _ in range(5):
                a = x @ x.T
                x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
            x = x.T if u.shape[0] > u.shape[1] else x
            parts.append(x * max(1, u.shape[0] / u.shape[1]) ** 0.5)
        p.mul_(1 - lr * weight_decay).add_(torch.cat(parts), alpha=-lr)
    return p


@pytest.mark.parametrize("splits", [None, [32, 16, 16]])
def test_muon_equals_the_published_update_in_float64(splits):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(64, 48, generator=gen, dtype=torch.float64)
    grads = [torch.randn(64, 48, generator=gen, dtype=torch.float64) for _ in range(3)]
    p = torch.nn.Parameter(start.clone())
    opt = O.Muon([{"params": [p], "splits": [splits]}], lr=0.02, momentum=0.95, weight_decay=0.1,
                 ns_dtype=torch.float64)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = published_muon(start, grads, 0.02, 0.95, 0.1, splits)
    # 1e-8, not 1e-15: the published code divides by (norm + 1e-7) where torch and we clamp the norm at
    # 1e-7, and the momentum is scaled by (1 - momentum) there; five Newton-Schulz steps are not exactly
    # scale-free, which moves the result by about 1e-9 on updates of size 0.02.
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-8)
    # the parts were orthogonalised apart: treating the stack as one matrix gives another update
    if splits:
        assert (published_muon(start, grads, 0.02, 0.95, 0.1) - expected).abs().max() > 1e-3


def record_muon(start, grads, lr, momentum, beta2, splits=None):
    """modded-nanogpt's Muon step after records #38 and #41, written out per part in float64: Nesterov
    momentum, five Polar Express steps on the wide orientation, then NorMuon's rescaling (beta2 > 0)."""
    p, buf = start.clone(), torch.zeros_like(start)
    moments = {}
    for g in grads:
        buf = momentum * buf + g
        update = g + momentum * buf
        parts = []
        for i, u in enumerate(update.split(splits) if splits else [update]):
            x = u.T if u.shape[0] > u.shape[1] else u
            x = x / (x.norm() * 1.02 + 1e-6)
            for a, b, c in O.POLAR_EXPRESS:
                m = x @ x.T
                x = a * x + (b * m + c * m @ m) @ x
            x = x.T if u.shape[0] > u.shape[1] else x
            if beta2:
                dim = 1 if x.shape[0] >= x.shape[1] else 0
                v = moments.get(i, torch.zeros(1, dtype=x.dtype))
                moments[i] = v = beta2 * v + (1 - beta2) * (x * x).mean(dim=dim, keepdim=True)
                y = x / v.clamp(min=1e-10).sqrt()
                x = y * (x.norm() / y.norm())
            parts.append(x * max(1, u.shape[0] / u.shape[1]) ** 0.5)
        p = p - lr * torch.cat(parts)
    return p


@pytest.mark.parametrize("beta2", [0.0, 0.95])
@pytest.mark.parametrize("splits", [None, [32, 64, 8]])
def test_polar_express_and_normuon_equal_the_records_update_in_float64(splits, beta2):
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(104, 48, generator=gen, dtype=torch.float64)
    grads = [torch.randn(104, 48, generator=gen, dtype=torch.float64) for _ in range(3)]
    p = torch.nn.Parameter(start.clone())
    opt = O.Muon([{"params": [p], "splits": [splits]}], lr=0.02, momentum=0.95, ns_dtype=torch.float64,
                 iteration="polar-express", beta2=beta2)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), record_muon(start, grads, 0.02, 0.95, beta2, splits), rtol=0, atol=1e-12)
    if beta2:  # it changes the update, and its moments are saved with the optimizer
        assert (record_muon(start, grads, 0.02, 0.95, 0.0, splits) - p.detach()).abs().max() > 1e-4
        state = opt.state_dict()["state"][0]["second_moment"]
        assert [tuple(m.shape) for m in state] == ([(1, 48), (64, 1), (1, 48)] if splits else [(104, 1)])


def test_polar_express_lands_nearer_one_than_newton_schulz():
    """Five Polar Express steps leave the singular values of an ill-conditioned matrix nearer 1 than five of
    Newton-Schulz's quintic (its point: the same five steps, each quintic fitted to what the last left)."""
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(96, 32, generator=gen, dtype=torch.float64))
    g = (u * torch.logspace(0, -3, 32, dtype=torch.float64)) @ v.T  # singular values 1 down to 1e-3
    spread = {it: (torch.linalg.svdvals(O.orthogonalize(g[None], torch.float64, iteration=it)) - 1).abs().max()
              for it in ("newton-schulz", "polar-express")}
    assert spread["polar-express"] < spread["newton-schulz"]


def test_muon_orthogonalises_a_batch_of_parts():
    """Five Newton-Schulz steps leave each matrix's singular values near one (within Jordan's
    published band of about 0.7 to 1.2), whatever the input's scale."""
    g = torch.randn(3, 32, 96, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e3
    s = torch.linalg.svdvals(O.orthogonalize(g, torch.float64))
    assert s.min() > 0.6 and s.max() < 1.25


def test_muon_and_adamw_state_round_trips():
    model = M.Llama(tiny_model_cfg(n_layers=1))
    cfg = C.TrainConfig(steps=1, muon=True)
    opt = O.configure_optimizer(model, cfg)
    model(torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))).backward()
    opt.step()
    again = O.configure_optimizer(model, cfg)
    again.load_state_dict(opt.state_dict())
    first = [s["momentum_buffer"] for s in opt.optimizers[0].state.values()]
    assert all(torch.equal(a, b["momentum_buffer"]) for a, b in zip(first, again.optimizers[0].state.values()))
    with pytest.raises(ValueError, match="not Muon \\+ AdamW: resume with the optimizer the run was started with"):
        again.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    assert math.isclose(again.param_groups[0]["lr"], 0.02)


def test_muon_tall_scale_steps_a_tall_matrix_sqrt_rows_over_cols_further():
    """A 4:1 matrix (the MLP up-projection's shape) moves twice as far with tall_scale as without
    (modded-nanogpt's record steps every matrix at lr); a square one the same either way."""
    moved = {}
    for tall_scale in (True, False):
        torch.manual_seed(0)
        tall, square = torch.nn.Parameter(torch.randn(64, 16)), torch.nn.Parameter(torch.randn(16, 16))
        opt = O.Muon([tall, square], lr=0.1, ns_dtype=torch.float64, tall_scale=tall_scale)
        before = tall.detach().clone(), square.detach().clone()
        tall.grad, square.grad = torch.randn(64, 16), torch.randn(16, 16)
        opt.step()
        moved[tall_scale] = [(p.detach() - b).norm().item() for p, b in zip((tall, square), before)]
    assert abs(moved[True][0] / moved[False][0] - 2.0) < 1e-6 and abs(moved[True][1] - moved[False][1]) < 1e-9


def two_muon_steps() -> list[torch.Tensor]:
    """Muon's two steps on 9 float64 matrices of three shapes, one of them stacked, with seeded
    gradients: what each gloo rank runs below, and the one-process reference."""
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 6)] * 5 + [(6, 10)] * 3 + [(14, 6)]  # the last stacks parts of 8 and 6 rows
    params = [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64)) for s in shapes]
    opt = O.Muon([{"params": params, "splits": [None] * 8 + [[8, 6]]}], lr=0.05, ns_dtype=torch.float64)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        opt.step()
    return [p.detach() for p in params]


SHARED_MUON = '''
import os, sys, torch, torch.distributed as dist
sys.path[:0] = sys.argv[1:3]
import optim as O
from test_optim import two_muon_steps
dist.init_process_group("gloo")
iterated = []  # the stack sizes this rank orthogonalised
inner = O.orthogonalize
O.orthogonalize = lambda g, dtype, **kw: iterated.append(g.shape[0]) or inner(g, dtype, **kw)
torch.save({"params": two_muon_steps(), "iterated": iterated}, f"{sys.argv[3]}/rank{dist.get_rank()}.pt")
# Both ranks leave together, the group closed: a rank that exits while gloo's threads still talk to the
# other aborts it ("terminate called without an active exception", about once in 10 runs). Even so, a
# CI run on 2026-12-03 saw rank 1 end in SIGABRT (not reproduced in 45 runs since). Its cause is not
# known here; gloo's threads are known to abort during interpreter finalization (pytorch/pytorch#179291),
# so each rank leaves without finalizing, its result already on disk.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


@pytest.mark.slow  # tests/test_train.py's record run through two gloo ranks shares Muon's iteration in the fast tier
def test_two_gloo_ranks_share_muons_iteration_and_equal_one_process(tmp_path, free_port):
    """optim.Muon under a process group of two gloo ranks: each rank orthogonalises half of each
    shape's parts (rounded up; 6 parts of (8, 6) with the stacked one's first part, 3 of (6, 10))
    and all-gathers the rest; the parameters after two steps equal the one-process update."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "shared_muon.py"
    script.write_text(SHARED_MUON)
    here = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port}",
                           str(script), str(here.parent), str(here), str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    # each step, each rank: 3 of the 6 parts of (8, 6), 2 of the 3 of (6, 10) (one of them padding on
    # rank 1), and the one (6, 6) part or its padding; one process would iterate on 6, 3 and 1
    assert [r["iterated"] for r in ranks] == [[3, 2, 1, 3, 2, 1]] * 2
    for r in ranks:
        for mine, one in zip(r["params"], two_muon_steps()):
            torch.testing.assert_close(mine, one, rtol=1e-12, atol=1e-12)


def test_a_head_tied_through_the_optimizer_trains_as_a_tied_model_then_apart_in_float64():
    """train.untie_at: the untied model whose optimizer sums the embedding's gradient into the head's and copies the
    head back steps exactly as the tied model (one matrix, both uses' gradients summed by autograd) at the head's
    rate; the embedding has no optimizer state while tied. Breaks if the sum, the skip or the copy goes."""
    torch.manual_seed(0)
    tied = M.Llama(tiny_model_cfg(n_layers=1, logit_softcap=15.0)).double()
    apart = M.Llama(tiny_model_cfg(n_layers=1, logit_softcap=15.0, tie_embeddings=False)).double()
    with torch.no_grad():
        for name, p in apart.named_parameters():
            p.copy_(tied.embed.weight if name == "head.weight" else dict(tied.named_parameters())[name])
    tcfg = C.TrainConfig(steps=4, lr=1e-2, embed_lr=0.5, head_lr=2e-2, grad_clip=1.0)
    opt_tied = O.configure_optimizer(tied, tcfg)
    opt_apart = O.configure_optimizer(apart, C.TrainConfig(**{**tcfg.__dict__, "untie_at": 0.5}))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, tied.cfg.vocab_size, (2, 17), generator=gen)
        batch = (x[:, :-1], x[:, 1:])
        for model, opt, tie in ((tied, opt_tied, None), (apart, opt_apart, (apart.head.weight, apart.embed.weight, True))):
            TR.train_step(model, opt, lambda: batch, 1, tcfg, torch.device("cpu"), tcfg.lr, tie=tie)
    torch.testing.assert_close(apart.head.weight, tied.embed.weight, rtol=0, atol=1e-12)
    torch.testing.assert_close(apart.embed.weight, tied.embed.weight, rtol=0, atol=0)
    torch.testing.assert_close(apart.blocks[0].attn.wqkv.weight, tied.blocks[0].attn.wqkv.weight, rtol=0, atol=1e-12)
    assert apart.embed.weight not in opt_apart.state and tied.embed.weight in opt_tied.state


def test_untied_the_embedding_starts_from_the_heads_adam_moments_once():
    """At the first step apart the embedding's AdamW state is a copy of the head's (record #53), its own tensors;
    a later step keeps the embedding's own."""
    head, embed = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    opt = torch.optim.AdamW([head, embed], lr=0.1)
    head.grad = torch.randn(8, 4)
    opt.step()
    O.tie_grads(opt, head, embed, tied=False)
    assert set(opt.state[embed]) == set(opt.state[head])
    for key, value in opt.state[head].items():
        torch.testing.assert_close(opt.state[embed][key], value)
        assert opt.state[embed][key] is not value
    before = opt.state[embed]["exp_avg"].clone()
    opt.state[head]["exp_avg"].add_(1.0)
    O.tie_grads(opt, head, embed, tied=False)
    torch.testing.assert_close(opt.state[embed]["exp_avg"], before)


def test_the_head_and_a_token_embedding_it_shares_step_at_the_heads_rate():
    """A tied embedding is the head too, and so is an untied one tied through the optimizer (train.untie_at): both
    step in the head's group; value embeddings keep the embedding's."""
    cfg = tiny_model_cfg(n_layers=2, value_embeds=1)
    for model, tcfg in ((M.Llama(cfg), C.TrainConfig(steps=1)),
                        (M.Llama(dataclasses.replace(cfg, tie_embeddings=False)), C.TrainConfig(steps=1, untie_at=0.5))):
        groups = {role: {n for n, _ in pairs} for role, pairs in O.param_groups(model, tcfg.untie_at > 0).items()}
        assert "embed.weight" in groups["head"] and groups["embed"] == {"value_embeds.0.weight"}
