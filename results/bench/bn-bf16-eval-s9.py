"""One-off: the shipped rst_cnn_fb, eval under bf16 autocast at a sweep's batch of 22 and at
batch 1, with the batch norm's map in bfloat16 (this session) and in float32 (before),
alternating in one process, median of 5 per figure after a warm-up."""

import statistics
import time

import torch

from rstmodel import load_checkpoint
from rstmodel.layers import norm

model, _ = load_checkpoint("models/rst_cnn_fb.pt")
model.eval()
new = norm.RSTBatchNorm._forward_rows


def old_exact(self, x):  # the code before, verbatim arithmetic
    if self.training or not self.track_running_stats:
        raise RuntimeError
    scale = torch.rsqrt(self.running_var + self.eps) * self.weight
    shift = -self.running_mean * scale + self.bias
    return torch.addcmul(shift, x, scale)


torch.manual_seed(0)
for batch in (22, 1):
    x = torch.randn(batch, 1, 56, 56)
    times = {"bf16 map (new)": [], "float32 map (before)": []}
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for rnd in range(6):
            for label, fn in (("bf16 map (new)", new), ("float32 map (before)", old_exact)):
                norm.RSTBatchNorm._forward_rows = fn
                t = time.perf_counter()
                model(x)
                dt = time.perf_counter() - t
                if rnd:
                    times[label].append(dt)
    for label, ts in times.items():
        print(f"batch {batch}: {label}: median {1e3 * statistics.median(ts):.1f} ms of {len(ts)}")
