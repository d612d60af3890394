"""Next round: the defaults against the defaults + --compile-mode coordinate-descent, repeated in turn.
Usage: coord.py PRESET MICRO_BATCH REPEATS OUT_JSON"""
import sys
from pathlib import Path

import torch

import bench as B
import measure as ME

preset, mb, repeats, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
rungs = B.kernel_rungs(preset, mb, 3, {"train__batch_tokens": 524288})
defaults = next(r for r in rungs if r.name == "the model's defaults")
tuned = ME.Rung("defaults + coordinate descent", preset,
                {**defaults.overrides, "train__compile_mode": "coordinate-descent"}, 3)
journal = B.Journal(out, {"preset": preset, "device": torch.cuda.get_device_name(), "batch_tokens": 524288}, False)
print(B.simple_table(B.run([defaults, tuned], True, 400, journal, repeats=repeats)), flush=True)
