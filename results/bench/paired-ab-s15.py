# usage: B=8 python results/bench/paired-ab-s15.py (jemalloc preloaded): the shipped rst_cnn_fb
# in bfloat16 autocast eval at batch B, the compiled bf16 product kernel switched on and off
# in turn (ROUNDS rounds, each the median of 3 forwards), and each form's logits against float32
import os, statistics, time
import torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.layers import native
from rstmodel.precision import inference

B, rounds = int(os.environ.get("B", 8)), int(os.environ.get("ROUNDS", 5))
torch.manual_seed(0)
m, _ = load_checkpoint("models/rst_cnn_fb.pt")
m = m.float().eval()
x = torch.randn(B, 1, 56, 56)
real = native.paired_available
with inference("fp32"):
    ref = m(x)
out, times = {}, {"kernel": [], "gauss": []}
for r in range(rounds):
    for mode in times:
        native.paired_available = real if mode == "kernel" else (lambda *_: False)
        with inference("bf16"):
            out[mode] = m(x).float()
            ts = []
            for _ in range(3):
                s = time.perf_counter(); m(x); ts.append(time.perf_counter() - s)
        times[mode].append(statistics.median(ts))
ratios = [k / g for k, g in zip(times["kernel"], times["gauss"])]
for mode, ts in times.items():
    print(f"{mode}: forward ms per round", [round(t * 1e3, 1) for t in ts],
          f"| max |logit - float32| {(out[mode] - ref).abs().max():.3f}")
print(f"batch {B}: kernel / gauss per round", [round(q, 3) for q in ratios], "median", round(statistics.median(ratios), 3))
print("top-1 agree with float32:", {k: (v.argmax(1) == ref.argmax(1)).float().mean().item() for k, v in out.items()})
