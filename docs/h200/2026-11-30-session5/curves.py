"""Fifth round: the loss curves of the plain model and the fused SwiGLU alone (88m, 200 steps)."""
import sys

import bench as B

B.CURVE_VARIANTS = {k: B.CURVE_VARIANTS[k] for k in ("plain", "fused SwiGLU")}
B.main(["--loss-curves", "--batch-tokens", "32768", "--micro-batch-size", "32", "--timeout", "150",
        "--out", sys.argv[1]])
