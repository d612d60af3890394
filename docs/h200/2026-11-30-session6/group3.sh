# Sixth round, group 3: repeated base / +fused SwiGLU / +bf16 residual rungs: 126m (mb64) on GPU0, 22m (mb512) on GPU1.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R
( CUDA_VISIBLE_DEVICES=0 timeout 440 python3 docs/h200/2026-11-30-session6/repeats.py 126m 64 2 $R/rep126.partial.json > $R/rep126.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout 440 python3 docs/h200/2026-11-30-session6/repeats.py 22m 512 3 $R/rep22.partial.json > $R/rep22.log 2>&1 ) &
wait
tar czf $OUT/r3.tgz -C $R .
for p in rep126 rep22; do echo "== $p"; grep -A8 "^| rung" $R/$p.log | cut -c1-150; python3 -c "
import json
d=json.load(open('$R/$p.partial.json'))
for e in d['measured']: r=e['row']; print(r['rung'], round(r.get('tok_s') or 0), r.get('peak_gib'), r.get('spread'), r.get('skipped',''))" 2>&1 | tail -9; done
