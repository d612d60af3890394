"""The Triton kernels of kernels.py against the plain PyTorch paths they replace, on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported: hence a subprocess).
tests/test_gpu.py runs the same comparison compiled, on CUDA, in bfloat16."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# float16: the interpreter computes with NumPy, which has no bfloat16.
DECODE_CHECK = """
import torch, kernels as K, model as M
g = torch.Generator().manual_seed(0)
for B, Hkv, G, S, pos in [(1, 4, 3, 1024, 17), (2, 1, 2, 512, 300), (1, 2, 3, 256, 255), (1, 1, 1, 128, 0)]:
    q = torch.randn(B, Hkv, G, 64, generator=g).half()
    k, v = (torch.randn(B, Hkv, S, 64, generator=g).half() for _ in range(2))
    reference = M.decode_attention_matmuls(q.float(), k.float(), v.float(), (torch.arange(S) <= pos)[None, :])
    k[:, :, pos + 1:] = v[:, :, pos + 1:] = float("nan")  # stale cache past the token: never read
    out = K.decode_attention(q, k, v, torch.tensor([pos]))
    err = (out.float() - reference).abs().max().item()
    assert out.shape == q.shape and out.dtype == q.dtype and err < 2e-3, (B, Hkv, G, S, pos, err)
# Traced as one opaque op (its fake implementation gives the shapes), as in the compiled decode step.
step = torch.compile(lambda q, k, v, pos: K.decode_attention(q, k[:, :, :200], v[:, :, :200], pos),
                     backend="aot_eager", fullgraph=True)
k, v = torch.randn(2, 1, 256, 64, generator=g).half(), torch.randn(2, 1, 256, 64, generator=g).half()
q, pos = torch.randn(2, 1, 2, 64, generator=g).half(), torch.tensor([150])
assert torch.equal(step(q, k, v, pos), K.decode_attention(q, k, v, pos))

# Inside the model (fused_decode): the same logits as the plain path, prefill then 20 decode steps.
cfg = dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, context=64)
plain = M.Llama(M.ModelConfig(**cfg)).eval().half()
fused = M.Llama(M.ModelConfig(**cfg, fused_decode=True)).eval().half()
fused.load_state_dict(plain.state_dict())
calls, kernel = [], K.decode_attention
K.decode_attention = lambda *a: calls.append(1) or kernel(*a)
idx = torch.randint(0, 512, (2, 30), generator=g)
logits = []
with torch.no_grad():
    for m in (plain, fused):
        m.setup_cache(2)
        steps = [m(idx[:, :10], pos=torch.arange(10), window=10)[:, -1]]
        steps += [m(idx[:, t:t + 1], pos=torch.tensor([t]), window=t + 1)[:, -1] for t in range(10, 30)]
        logits.append(torch.stack(steps).float())
assert len(calls) == 2 * 20 and (logits[0] - logits[1]).abs().max() < 1e-2, len(calls)
print("agree")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs Triton for its CPU interpreter (pip install triton)")
def test_fused_decode_attention_matches_the_plain_path_and_stops_at_the_token():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", DECODE_CHECK], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and "agree" in done.stdout, done.stderr[-2000:]
