"""FlashAttention-2 varlen (torch.nn.attention.varlen, window_size) against FlexAttention at 88m's shape:
one layer forward+backward, documents masked apart, windows 1,792 and 896. Layouts: the study's (500-5,500)
and short documents (exponential, mean 600, like real corpora). max_k exact vs T."""
import statistics, sys, time
import torch
import model as M, measure as ME, bench as BE
from torch.nn.attention.varlen import varlen_attn

dev = torch.device("cuda"); B, T, H, D = 16, 8192, 6, 128
scale = 0.12
g = torch.Generator(dev).manual_seed(0)
torch._dynamo.config.recompile_limit = 64

def layout(kind):
    starts = torch.zeros(B, T, dtype=torch.int32, device=dev)
    if kind == "study":
        starts[:, torch.cumsum(torch.randint(500, 5500, (T // 500,), device=dev, generator=g), 0).clamp(max=T - 1)] = 1
    else:
        for b in range(B):
            L = torch.empty(200).exponential_(1 / 600, generator=torch.Generator().manual_seed(b)).long().clamp(min=8)
            p = torch.cumsum(L, 0); p = p[p < T]
            starts[b, p.to(dev)] = 1
    return torch.cumsum(starts, dim=1, dtype=torch.int32)

def cu_from(doc):
    flat = doc.reshape(-1)
    new = torch.ones_like(flat, dtype=torch.bool)
    new[1:] = flat[1:] != flat[:-1]
    new[::T] = True
    idx = new.nonzero().squeeze(1).to(torch.int32)
    cu = torch.cat([idx, torch.tensor([B * T], device=dev, dtype=torch.int32)])
    return cu, int((cu[1:] - cu[:-1]).max())

q4, k4, v4 = (torch.randn(B, T, H, D, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
rows = []
def flex_call(bm):
    return lambda: M.attention(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), block_mask=bm, scale=scale).transpose(1, 2)
def varlen_call(cu, mx, w):
    return lambda: varlen_attn(q4.view(B * T, H, D), k4.view(B * T, H, D), v4.view(B * T, H, D), cu, cu, mx, mx,
                               scale=scale, window_size=(w - 1, 0)).view(B, T, H, D)
compiled_varlen = torch.compile(lambda q, k, v, cu, mx, w: varlen_attn(q, k, v, cu, cu, mx, mx, scale=scale, window_size=(w - 1, 0)), dynamic=False)
for kind in ("study", "short"):
    doc = layout(kind)
    cu, mx = cu_from(doc)
    for w in (1792, 896):
        pairs = BE.attended_pairs(doc, w)
        flops = 3.5 * 4 * D * H * pairs
        bm = M.flex_block_mask(doc, w, T, dev)
        ref = flex_call(bm)().float()
        got = varlen_call(cu, mx, w)().float()
        err = (ref - got).abs().max().item()
        for name, fn in [("flex", flex_call(bm)), (f"varlen max={mx}", varlen_call(cu, mx, w)), (f"varlen max=T", varlen_call(cu, T, w)),
                         ("varlen compiled", lambda: compiled_varlen(q4.view(B * T, H, D), k4.view(B * T, H, D), v4.view(B * T, H, D), cu, mx, w))]:
            run = ME.backward_from_scratch(lambda: fn().float().sum(), (q4, k4, v4))
            fwd = ME.median_seconds(lambda: fn(), dev, 20, 5)
            s = ME.median_seconds(run, dev, 20, 5)
            ks = sum(ME.kernel_times(run, dev).values()) / 1000
            rows.append((kind, len(cu) - 1, w, name, fwd * 1e3, s * 1e3, ks * 1e3, flops / ks / 1e12, err))
            print(rows[-1], flush=True)
print(f"{'docs':6s} {'N':>4s} {'window':>6s} {'path':22s} {'fwd ms':>7s} {'f+b ms':>7s} {'kern ms':>7s} {'TFLOP/s':>7s} {'max|diff|':>9s}")
for r in rows:
    print(f"{r[0]:6s} {r[1]:4d} {r[2]:6d} {r[3]:22s} {r[4]:7.3f} {r[5]:7.3f} {r[6]:7.3f} {r[7]:7.1f} {r[8]:9.2e}")
