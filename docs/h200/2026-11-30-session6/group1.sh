# Sixth round, group 1 (two H200s): GPU0 the 88m ladder; GPU1 loss curves, mb16 memory, then the 22m ladder.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R/l88 $R/l22 $R/lc
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,power.limit,clocks.max.sm --format=csv > $R/gpus.csv
( CUDA_VISIBLE_DEVICES=0 timeout 540 python3 bench.py --ladder --preset 88m --out $R/l88 > $R/l88.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 250 python3 docs/h200/2026-11-30-session6/curves2.py $R/lc > $R/lc.log 2>&1
  timeout 140 python3 docs/h200/2026-11-30-session6/mem16.py > $R/mem16.log 2>&1
  left=$((540 - ($(date +%s) - T0)))
  timeout $left python3 bench.py --ladder --preset 22m --out $R/l22 > $R/l22.log 2>&1 ) &
wait
rm -f $R/lc/curves/*/ckpt*.pt
tar czf $OUT/r1.tgz -C $R .
echo "== curves"; grep -v "^  \|warn" $R/lc.log | tail -7
echo "== mem16"; grep "^{" $R/mem16.log | python3 -c "
import sys, ast
for l in sys.stdin:
    r = ast.literal_eval(l); print(r['rung'], round(r.get('tok_s') or 0), r.get('peak_gib'), r.get('skipped',''))"
for p in l88 l22; do echo "== $p"; grep "^rung\|^roof" $R/$p.log | tail -4; python3 -c "
import json,sys
d=json.load(open('$R/$p/ladder.partial.json'))
for e in d['measured']: r=e['row']; print(r['rung'], r.get('micro_batch'), round(r.get('tok_s') or 0), r.get('peak_gib'), r.get('skipped',''))" 2>&1 | tail -14; done
echo "elapsed $(( $(date +%s) - T0 )) s"
