# The fifth round's GPU commands (one NVIDIA H200, torch 2.11.0+cu130), run from the repository
# root with PYTHONPATH=. and OUT set to a folder for the results. Three calls, each on a fresh machine.

# 1. The kernels study's rungs at 126m and 88m (micro-batch 64; the 88m "both" rung hit the time limit),
#    then the GPU tests. (A profile queued after them did not start.)
timeout 240 python3 docs/h200/2026-11-30-session5/kernel_rungs.py 126m 64 2>&1 | tee $OUT/kernels_126m.log
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee $OUT/gpu_tests.log
timeout 170 python3 docs/h200/2026-11-30-session5/kernel_rungs.py 88m 64 2>&1 | tee $OUT/kernels_88m.log

# 2. Loss curves, 22m's rungs, 126m's "both" rung, the profile with both fused kernels.
timeout 270 python3 docs/h200/2026-11-30-session5/curves.py /tmp/lc 2>&1 | tee $OUT/loss_curves.log
timeout 160 python3 docs/h200/2026-11-30-session5/kernel_rungs.py 22m 64 2>&1 | tee $OUT/kernels_22m.log
timeout 60 python3 docs/h200/2026-11-30-session5/kernel_rungs.py 126m 64 both 2>&1 | tee $OUT/kernels_126m_both.log
timeout 75 python3 bench.py --profile --micro-batch-size 64 --fused-loss --fused-swiglu --out $OUT/prof 2>&1 | tail -12

# 3. max-autotune on top of the fused SwiGLU, 126m (cold Inductor cache), then 88m (same matmul shapes).
timeout 560 python3 docs/h200/2026-11-30-session5/autotune.py 126m 88m 2>&1 | tee $OUT/autotune.log

# 4. The bf16 residual stream on top of the fused SwiGLU at 88m, then its GPU parity tests.
timeout 85 python3 docs/h200/2026-11-30-session5/bf16_residual.py 2>&1 | tee $OUT/bf16_residual.log
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "bf16_residual" 2>&1 | tail -3
