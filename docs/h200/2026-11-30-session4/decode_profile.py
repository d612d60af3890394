"""Kernel profile of one compiled decode step (88m, bf16, batch 1, pos 500), outside a CUDA graph.
10 steps profiled after 5 warm-up steps."""
import dataclasses, sys, torch
from torch.profiler import profile, ProfilerActivity
import config as C, model as M, generate as G

def kernel_profile(fused: bool, mode: str, top: int = 12):
    torch.manual_seed(0)
    cfg = C.preset("88m").model
    m = M.Llama(dataclasses.replace(cfg, fused_decode=fused)).cuda().eval().to(torch.bfloat16)
    m.setup_cache(1)
    step = torch.compile(G.decode_one, mode=mode, fullgraph=True, dynamic=False)
    tok = torch.ones(1, 1, dtype=torch.long, device="cuda"); pos = torch.full((1,), 500, device="cuda")
    with torch.no_grad():
        for _ in range(5): step(m, tok, pos, cfg.context)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10): step(m, tok, pos, cfg.context)
            torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    tot, cnt = {}, {}
    for e in ev:
        tot[e.name] = tot.get(e.name, 0) + e.device_time / 10
        cnt[e.name] = cnt.get(e.name, 0) + 1
    print(f"fused_decode={fused} mode={mode}: kernels per step {len(ev) / 10}, device us per step {sum(tot.values()):.1f}")
    for n, t in sorted(tot.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t:6.1f} us {cnt[n] // 10:3d}x {n[:100]}", flush=True)

if __name__ == "__main__":
    for fused in (False, True):
        kernel_profile(fused, sys.argv[1] if len(sys.argv) > 1 else "default")
