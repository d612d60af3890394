# Sixth round, group 2: GPU0 resumes the 88m ladder, then starts 126m; GPU1 resumes 22m, then the GPU tests.
# FIRST: a folder holding group 1's two ladder.partial.json files, renamed ladder_88m/ladder_22m.partial.json.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R/l88 $R/l22 $R/l126
cp $FIRST/ladder_88m.partial.json $R/l88/ladder.partial.json
cp $FIRST/ladder_22m.partial.json $R/l22/ladder.partial.json
T0=$(date +%s)
( export CUDA_VISIBLE_DEVICES=0
  timeout 530 python3 bench.py --ladder --preset 88m --out $R/l88 --resume > $R/l88.log 2>&1
  left=$((535 - ($(date +%s) - T0)))
  timeout $left python3 bench.py --ladder --preset 126m --out $R/l126 > $R/l126.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 400 python3 bench.py --ladder --preset 22m --out $R/l22 --resume > $R/l22.log 2>&1
  left=$((535 - ($(date +%s) - T0)))
  timeout $left python3 -m pytest -q tests/test_gpu.py > $R/gpu_tests.log 2>&1 ) &
wait
tar czf $OUT/r2.tgz -C $R .
for p in l88 l22 l126; do echo "== $p"; grep "^roof" $R/$p.log; grep -A20 "^| rung" $R/$p.log | cut -c1-110; python3 -c "
import json
d=json.load(open('$R/$p/ladder.partial.json'))
for e in d['measured']: r=e['row']; print(r['rung'], r.get('micro_batch'), round(r.get('tok_s') or 0), r.get('peak_gib'), r.get('skipped',''))" 2>&1 | tail -8; done
echo "== tests"; tail -3 $R/gpu_tests.log
echo "elapsed $(( $(date +%s) - T0 )) s"
