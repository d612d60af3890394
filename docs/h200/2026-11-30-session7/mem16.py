"""Next round: 88m at micro-batch 16 with today's defaults (fused SwiGLU + bf16 stream) and the memory switches."""
import bench as B
import measure as ME

base = {"train__micro_batch": 16, "train__optimizer": "fused", "train__batch_tokens": 524288, **B.FAST,
        **B.DEFAULT_KERNELS}
for name, o in [("mb16 defaults", {}), ("mb16 --recompute-mlp", {"train__recompute_mlp": True}),
                ("mb16 --recompute-mlp --fused-loss", {"train__recompute_mlp": True, "model__fused_loss": True})]:
    print(ME.run_in_subprocess(ME.Rung(name, "88m", {**base, **o}, 3), 100).row(), flush=True)
