"""Sixth round: 88m at micro-batch 16, compiled BF16, fused AdamW, 524,288-token steps: peak memory
with the fifth round's defaults (fused SwiGLU) and the memory switches, each rung in its own process."""
import bench as B
import measure as ME

base = {"train__micro_batch": 16, "train__optimizer": "fused", "train__batch_tokens": 524288, **B.FAST,
        "model__fused_swiglu": True}
for name, o in [("mb16 default", {}),
                ("mb16 --bf16-residual", {"model__bf16_residual": True}),
                ("mb16 --recompute-mlp", {"train__recompute_mlp": True}),
                ("mb16 --recompute-mlp --bf16-residual", {"train__recompute_mlp": True, "model__bf16_residual": True}),
                ("mb16 --recompute-mlp --bf16-residual --fused-loss",
                 {"train__recompute_mlp": True, "model__bf16_residual": True, "model__fused_loss": True})]:
    print(ME.run_in_subprocess(ME.Rung(name, "88m", {**base, **o}, 3), 100).row(), flush=True)
