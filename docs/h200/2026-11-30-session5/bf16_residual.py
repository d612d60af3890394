"""Fifth round: the fused SwiGLU default at 88m, then the same with the bf16 residual stream (journal under $OUT)."""
import os
from pathlib import Path

import torch

import bench as B
import measure as ME

out = Path(os.environ["OUT"])
o = {**B.kernel_rungs("88m", 64, 3, {"train__batch_tokens": 524288})[0].overrides, **B.KERNEL_SWITCHES["+fused SwiGLU"]}
rungs = [ME.Rung("+fused SwiGLU", "88m", o, 3), ME.Rung("+fused SwiGLU +bf16 residual", "88m",
                                                          {**o, **B.KERNEL_SWITCHES["+bf16 residual"]}, 3)]
journal = B.Journal(out / "bf16_residual_88m.partial.json",
                    {"preset": "88m", "device": torch.cuda.get_device_name(), "batch_tokens": 524288}, True)
print(B.simple_table(B.run(rungs, True, 60, journal)), flush=True)
