"""Decode experiment: GPU time per graph replay per window vs wall time per token in generate()."""
import statistics, time, torch
import config as C, model as M, generate as G
torch._dynamo.config.recompile_limit = 64
torch.manual_seed(0)
cfg = C.preset("88m").model
m = M.Llama(cfg).cuda().eval().to(torch.bfloat16)
prompt = list(range(1, 17))
def replay_us(dec, batch, window, n=300):
    dec.capture_all(batch, 1024)
    key = [k for k in dec.graphs if k[0] == batch and k[1] == window][0]
    g = dec.graphs[key][0]
    for _ in range(20): g.replay()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / n
def gen_rate(dec, batch, reps=5):
    r = []
    for _ in range(reps):
        _, t = G.generate_batch(m, prompt, batch, 500, 0.0, 0, 1.0, None, decode=dec)
        s, f, e = t.marks; r.append(batch * 499 / (e - f))
    return statistics.median(r), max(r)
rows = []
for mode in ("default", "max-autotune-no-cudagraphs"):
    for batch in (1, 8):
        dec = G.GraphDecoder(m, mode)
        t0 = time.perf_counter(); dec.capture_all(batch, 1024); warm = time.perf_counter() - t0
        per = {w: round(replay_us(dec, batch, w), 1) for w in dec.windows}
        med, best = gen_rate(dec, batch)
        full = G.GraphDecoder(m, mode, windows=[1024])
        fmed, fbest = gen_rate(full, batch)
        rows.append((mode, batch, per, round(med), round(best), round(fmed), round(fbest), round(warm)))
        print(rows[-1], flush=True)
# profile one replay of window 128 and 1024 (max-autotune, batch 1)
from torch.profiler import profile, ProfilerActivity
dec = G.GraphDecoder(m, "max-autotune-no-cudagraphs"); dec.capture_all(1, 1024)
for w in (128, 1024):
    g = [v for k, v in dec.graphs.items() if k[1] == w][0][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    tot, cnt = {}, {}
    for e in ev:
        tot[e.name] = tot.get(e.name, 0) + e.device_time / 10; cnt[e.name] = cnt.get(e.name, 0) + 1
    print(f"window {w}: kernels per replay {len(ev)/10}, device us {sum(tot.values()):.1f}")
    for n, t in sorted(tot.items(), key=lambda kv: -kv[1])[:12]: print(f"  {t:6.1f} us {cnt[n]//10:3d} {n[:100]}")
print("| mode | batch | replay us per window | generate median tok/s (best) | full window median (best) | warm s |")
for r in rows: print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:,} ({r[4]:,}) | {r[5]:,} ({r[6]:,}) | {r[7]} |")
