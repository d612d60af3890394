"""Profile training steps of a preset on the prepared corpus (documents masked as it trains):
step times at the window schedule's two ends, GPU busy share, kernel classes, the optimizer step.
usage: PYTHONPATH=$PWD python .gpu/realprof.py PRESET OUT.json NAME=OVERRIDES_JSON [NAME=OVERRIDES_JSON ...]"""
import gc, json, sys, time, statistics
from pathlib import Path
import torch
import config as C, measure as ME, train as TR

preset, out = sys.argv[1], Path(sys.argv[2])
variants = [(a.split("=", 1)[0], json.loads(a.split("=", 1)[1])) for a in sys.argv[3:]]
DATA = {"data__corpus": "python", "data__max_documents": 0, "data__tokenizer_documents": 10000,
        "train__micro_batch": 4, "train__steps": 1000, "train__tokens": 0, "train__seconds": 0.0,
        "train__sample_tokens": 0, "train__warmup_steps": 0}
results = []
for name, overrides in variants:
    t0 = time.time()
    cfg = C.preset(preset, **{**DATA, **overrides})
    r = TR.setup(cfg, log=lambda *a, **k: None)
    dev, tc, mc = r.device, r.cfg.train, r.cfg.model
    ends = [tc.window_start or mc.attn_window, mc.attn_window]

    def step(accum, w):
        return TR.train_step(r.model, r.optimizer, r.train_loader.next_batch, accum, tc, dev, 1e-4,
                             windows=mc.windows(w))[0].item()
    step(2, ends[-1]); torch.cuda.synchronize()
    row = {"variant": name, "overrides": overrides, "accum": r.accum, "setup_compile_s": round(time.time() - t0)}
    print(f"{name}: setup+compile {row['setup_compile_s']} s", flush=True)
    for w in ends:
        step(2, w)
        ts = []
        for _ in range(3):
            torch.cuda.synchronize(); t = time.perf_counter(); step(r.accum, w); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        row[f"step_ms_w{w}"] = round(1000 * statistics.median(ts), 1)
        # two micro-batches and the optimizer: wall time against the kernels' summed time
        walls = []
        for _ in range(3):
            torch.cuda.synchronize(); t = time.perf_counter(); step(2, w); torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
        names = ME.kernel_times(lambda: step(2, w), dev)
        classes = {}
        for n, ms in names.items():
            c = ME.kernel_class(n); classes[c] = classes.get(c, 0) + ms
        row[f"w{w}"] = {"wall_ms_2mb": round(1000 * statistics.median(walls), 2), "kernel_ms_2mb": round(sum(classes.values()), 2),
                        "classes": {k: round(v, 2) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
                        "top": [(n[:160], round(ms, 3)) for n, ms in sorted(names.items(), key=lambda kv: -kv[1])[:45]]}
        print(name, w, row[f"step_ms_w{w}"], row[f"w{w}"]["wall_ms_2mb"], row[f"w{w}"]["kernel_ms_2mb"], row[f"w{w}"]["classes"], flush=True)
    # the optimizer step alone, on real gradients
    ts = []
    for _ in range(4):
        TR.forward_loss(r.model, r.train_loader.next_batch(), tc, dev, mc.windows(ends[-1])).backward()
        torch.cuda.synchronize(); t = time.perf_counter(); r.optimizer.step(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t); r.optimizer.zero_grad(set_to_none=True)
    row["optimizer_ms"] = round(1000 * statistics.median(ts[1:]), 2)
    row["mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(name, "optimizer", row["optimizer_ms"], "ms; mem", row["mem_gib"], flush=True)
    results.append(row)
    out.write_text(json.dumps({"preset": preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "rows": results}, indent=1))
    del r; gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
print(f"{'variant':12s} " + " ".join(f"{k:>12s}" for k in ("step@start", "step@end", "busy@end", "opt ms")))
for row in results:
    ks = [k for k in row if k.startswith("step_ms_w")]
    wend = row[f"w{ks[-1][9:]}"]
    print(f"{row['variant']:12s} {row[ks[0]]:12.1f} {row[ks[-1]]:12.1f} {wend['kernel_ms_2mb'] / wend['wall_ms_2mb']:12.1%} {row['optimizer_ms']:12.2f}")
