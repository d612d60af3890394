# Next round, group 1 (two H200s, ~9.5 min): GPU0 the 126m ladder (stopped by the limit, resumed in group 2);
# GPU1 memory at mb16 with the defaults, the profile with the defaults, coordinate descent at 88m.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R/l126 $R/prof
T0=$(date +%s)
( CUDA_VISIBLE_DEVICES=0 timeout 540 python3 bench.py --ladder --preset 126m --out $R/l126 > $R/l126.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 110 python3 .gpu/next/mem16.py > $R/mem16.log 2>&1
  timeout 120 python3 bench.py --profile --micro-batch-size 64 --fused-swiglu --bf16-residual --out $R/prof > $R/profile.log 2>&1
  left=$((540 - ($(date +%s) - T0)))
  timeout $left python3 .gpu/next/coord.py 88m 64 2 $R/coord88.partial.json > $R/coord88.log 2>&1 ) &
wait
rm -f $R/prof/*.png
tar czf $OUT/r1.tgz -C $R .
grep "^{" $R/mem16.log | cut -c1-200; grep -A8 "^| rung" $R/profile.log
python3 -c "
import json
for f in ('$R/coord88.partial.json', '$R/l126/ladder.partial.json'):
    for e in json.load(open(f))['measured']: r=e['row']; print(r['rung'], r.get('micro_batch'), round(r.get('tok_s') or 0), r.get('peak_gib'), r.get('warmup_s'), r.get('skipped',''))"
