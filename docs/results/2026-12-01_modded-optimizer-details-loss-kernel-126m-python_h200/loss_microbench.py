"""The training loss on one micro-batch of the record preset (32,768 tokens, 32,768 vocab, soft-cap 15):
the plain compiled loss against kernels.cross_entropy, alone on bf16 logits and behind the FP8 head.
usage (from the repository root, on a CUDA GPU): PYTHONPATH=$PWD python docs/results/2026-12-01_modded-optimizer-details-loss-kernel-126m-python_h200/loss_microbench.py OUT.json"""
import json, sys
import torch
import torch.nn.functional as F
import kernels as K, model as M

N, V, D, CAP = 32768, 32768, 768, 15.0
g = torch.Generator("cuda").manual_seed(0)
t = torch.randint(0, V, (N,), device="cuda", generator=g)
z = (torch.randn(N, V, device="cuda", generator=g) * 3).bfloat16().requires_grad_()
x = torch.randn(N, D, device="cuda", generator=g).bfloat16().requires_grad_()
w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).requires_grad_()

def ce_plain(z): return F.cross_entropy(M.softcap(z.float(), CAP), t)
def ce_kernel(z): return K.cross_entropy(z, t, CAP)[0].mean()
def head(loss):
    def f(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = M.fp8_linear(x, w, grad_bound=1.0 / N)
        return loss(logits)
    return f

def timed(f, inp, backward, n=20):
    for _ in range(3):
        l = f(inp); (l.backward() if backward else None)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        l = f(inp); (l.backward() if backward else None)
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n, l.item()

rows = []
for name, f, inp in [("loss plain", ce_plain, z), ("loss kernel", ce_kernel, z),
                     ("fp8 head + loss plain", head(ce_plain), x), ("fp8 head + loss kernel", head(ce_kernel), x)]:
    c = torch.compile(f)
    fwd, loss = timed(c, inp, False)
    both, _ = timed(c, inp, True)
    rows.append({"what": name, "forward_ms": round(fwd, 3), "forward_backward_ms": round(both, 3), "loss": round(loss, 5)})
    print(rows[-1], flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "N": N, "V": V, "rows": rows},
          open(sys.argv[1], "w"), indent=1)
# bf16 logits are 2 GiB: one read is 0.45 ms at 4.8 TB/s
print(f"{'what':26s} {'forward ms':>11s} {'fwd+bwd ms':>11s}")
for r in rows:
    print(f"{r['what']:26s} {r['forward_ms']:11.3f} {r['forward_backward_ms']:11.3f}")
