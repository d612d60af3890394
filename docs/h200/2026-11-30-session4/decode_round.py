"""Decode round: tune decode_step's launch (keys per loop step, warps, stages) by timing the kernel
alone at several positions, take the fastest at batch 1, check it (GPU tests), then run
bench.py --generate and a kernel profile of the fused decode step with it."""
import itertools, sys, time, torch
import kernels as K, model as M
print("torch", torch.__version__, flush=True)
H, Hkv, S, D = 12, 4, 1024, 64
POS = (16, 128, 256, 512, 1000)

def kernel_us(B, pos, block, warps, stages, n=20):
    g = torch.Generator("cuda").manual_seed(0)
    qkv = torch.randn(B, 1, H + 2 * Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cos, sin = (t[pos].bfloat16().cuda() for t in M.rope_tables(D, S, 10000.0))
    out = qkv.new_empty(B, 1, H, D); p = torch.tensor([pos], device="cuda")
    launch = lambda: K._decode_step_kernel[(B, Hkv)](qkv, cos, sin, kc, vc, out, p, D ** -0.5, qkv.stride(0), qkv.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), out.stride(0), out.stride(2), H=H, HKV=Hkv, G=3, G_PAD=16, D=D,
        BLOCK=block, num_warps=warps, num_stages=stages)
    launch(); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n): launch()
    for _ in range(3): graph.replay()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10): graph.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / (10 * n)

t0 = time.time()
rows = []
for block, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
    try:
        b1 = [kernel_us(1, p, block, warps, stages) for p in POS]
        b8 = [kernel_us(8, p, block, warps, stages) for p in POS]
    except Exception as ex:
        print(block, warps, stages, "failed:", str(ex).splitlines()[0][:100]); continue
    rows.append((sum(b1[:4]) / 4, block, warps, stages, b1, b8))
print(f"kernel us per launch (launches back to back in a CUDA graph), positions {POS}; {time.time() - t0:.0f} s")
print("block warps stages | batch 1 ... | batch 8 ...")
for mean, block, warps, stages, b1, b8 in sorted(rows):
    print(f"{block:4d} {warps:2d} {stages:2d} | " + " ".join(f"{x:5.1f}" for x in b1) + " | " + " ".join(f"{x:5.1f}" for x in b8))
best = min(rows)
print("was", (K.BLOCK_KEYS, K.DECODE_WARPS, K.DECODE_STAGES), "chosen", best[1:4], flush=True)
K.BLOCK_KEYS, K.DECODE_WARPS, K.DECODE_STAGES = best[1:4]

import pytest
pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_gpu.py", "-k", "fused_decode"])
import bench
t0 = time.time()
try:
    bench.main(["--generate", "--out", "/tmp/gen"])
except SystemExit:
    pass
print(f"generate study {time.time() - t0:.0f} s", flush=True)
sys.path.insert(0, ".gpu")
from decode_profile import kernel_profile
torch._dynamo.reset()
for mode in ("max-autotune-no-cudagraphs", "default"):
    kernel_profile(True, mode, top=16)
