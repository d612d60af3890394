"""Fifth round: max-autotune on top of the fused SwiGLU, 126m then 88m (same matmul shapes,
so the second reuses the first's autotuning from Inductor's cache)."""
import os
import sys
from pathlib import Path

import torch

import bench as B
import measure as ME

out = Path(os.environ["OUT"])
for preset in sys.argv[1:]:
    o = {**B.kernel_rungs(preset, 64, 3, {"train__batch_tokens": 524288})[0].overrides,
         **B.KERNEL_SWITCHES["+fused SwiGLU"], **B.KERNEL_SWITCHES["+max-autotune (no CUDA graphs)"]}
    journal = B.Journal(out / f"autotune_{preset}.partial.json",
                        {"preset": preset, "device": torch.cuda.get_device_name(), "batch_tokens": 524288}, True)
    rows = B.run([ME.Rung("+fused SwiGLU +max-autotune", preset, o, 3)], True, 480, journal)
    print(B.simple_table(rows), flush=True)
