"""Fifth round: the kernels study's fast rungs (no max-autotune) at one preset, plus the
fused loss and fused SwiGLU together, each rung in its own process; journal under $OUT."""
import os
import sys
from pathlib import Path

import torch

import bench as B
import measure as ME

preset, mb, only_both = sys.argv[1], int(sys.argv[2]), "both" in sys.argv[3:]
base = {"train__batch_tokens": 524288}
rungs = [r for r in B.kernel_rungs(preset, mb, 3, base) if "autotune" not in r.name]
both = {**rungs[0].overrides, **B.KERNEL_SWITCHES["+fused loss"], **B.KERNEL_SWITCHES["+fused SwiGLU"]}
rungs = ([] if only_both else rungs) + [ME.Rung("+fused loss +fused SwiGLU", preset, both, 3)]
out = Path(os.environ["OUT"])
journal = B.Journal(out / f"kernels_{preset}.partial.json",
                    {"preset": preset, "device": torch.cuda.get_device_name(), "batch_tokens": 524288}, True)
rows = B.run(rungs, True, 240, journal)
print(B.simple_table(rows))
