"""Sixth round: 200-step loss curves at 88m, plain against the candidate default (fused SwiGLU + bf16 residual)."""
import sys

import bench as B

P = B.CURVE_PLAIN
B.CURVE_VARIANTS = {"plain": P, "fused SwiGLU + bf16 residual": P + ["--fused-swiglu", "--bf16-residual"]}
B.main(["--loss-curves", "--batch-tokens", "32768", "--micro-batch-size", "32", "--timeout", "150",
        "--out", sys.argv[1]])
