"""88m at micro-batch 16, compiled BF16 (524,288-token steps, 3 timed steps): peak memory and speed
with the fused loss and recompute_mlp, each rung in its own process."""
import measure as ME
base = {"train__micro_batch": 16, "train__tf32": True, "train__bf16": True, "train__compile": True,
        "train__optimizer": "fused", "train__batch_tokens": 524288}
rows = []
for name, o in [("mb16 fused loss", {"model__fused_loss": True}),
                ("mb16 fused loss + recompute MLP", {"model__fused_loss": True, "train__recompute_mlp": True}),
                ("mb16 recompute MLP", {"train__recompute_mlp": True})]:
    r = ME.run_in_subprocess(ME.Rung(name, "88m", {**base, **o}, 3), 170).row()
    rows.append(r)
    print(name, r, flush=True)
print("| rung | tok/s | peak GiB | reserved GiB |\n|---|---:|---:|---:|")
for r in rows:
    print(f"| {r['name'] if 'name' in r else r.get('rung')} | {round(r.get('tok_s') or 0):,} | {r.get('peak_gib')} | {r.get('reserved_gib')} | {r.get('skipped', '')}")
