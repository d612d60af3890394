# Next round, group 2: GPU0 resumes the 126m ladder (carry .gpu/state/l126.partial.json from group 1);
# GPU1 runs the GPU tests, then coordinate descent at 22m.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R/l126; cp .gpu/state/l126.partial.json $R/l126/ladder.partial.json
( CUDA_VISIBLE_DEVICES=0 timeout 540 python3 bench.py --ladder --preset 126m --out $R/l126 --resume > $R/l126.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 250 python3 -m pytest -q tests/test_gpu.py > $R/gpu_tests.log 2>&1
  timeout 280 python3 .gpu/next/coord.py 22m 512 2 $R/coord22.partial.json > $R/coord22.log 2>&1 ) &
wait
tar czf $OUT/r2.tgz -C $R .
grep -A20 "^| rung" $R/l126.log | cut -c1-140; tail -2 $R/gpu_tests.log; grep -A4 "^| rung" $R/coord22.log
