# Group 3: GPU0 finishes the 126m ladder (max-autotune, fp8); GPU1 coordinate descent at 22m, 2 runs each.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R/l126; cp .gpu/state/l126.partial.json $R/l126/ladder.partial.json
( CUDA_VISIBLE_DEVICES=0 timeout 530 python3 bench.py --ladder --preset 126m --out $R/l126 --resume > $R/l126.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout 530 python3 .gpu/next/coord.py 22m 512 2 $R/coord22.partial.json > $R/coord22.log 2>&1 ) &
wait
tar czf $OUT/r3.tgz -C $R .
grep -A22 "^| rung" $R/l126.log | cut -c1-160; grep -A6 "^| rung" $R/coord22.log
