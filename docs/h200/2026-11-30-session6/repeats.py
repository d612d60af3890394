"""Sixth round: one preset's compiled base, +fused SwiGLU and +fused SwiGLU +bf16 residual, measured
`repeats` times in turn (bench.run's repeats). Usage: repeats.py PRESET MICRO_BATCH REPEATS OUT_JSON"""
import sys
from pathlib import Path

import torch

import bench as B
import measure as ME

preset, mb, repeats, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
base = B.kernel_rungs(preset, mb, 3, {"train__batch_tokens": 524288})[0]
swiglu = {**base.overrides, **B.KERNEL_SWITCHES["+fused SwiGLU"]}
rungs = [base, ME.Rung("+fused SwiGLU", preset, swiglu, 3),
         ME.Rung("+fused SwiGLU +bf16 residual", preset, {**swiglu, **B.KERNEL_SWITCHES["+bf16 residual"]}, 3)]
journal = B.Journal(out, {"preset": preset, "device": torch.cuda.get_device_name(), "batch_tokens": 524288}, False)
print(B.simple_table(B.run(rungs, True, 240, journal, repeats=repeats)), flush=True)
