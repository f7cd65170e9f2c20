# usage: B=8 P=bf16 WHICH=pooled_mix_available python results/bench/native-ab-s15.py (jemalloc preloaded):
# the shipped rst_cnn_fb eval at batch B and precision P, one of rstmodel.layers.native's kernels
# (WHICH: its availability check) switched on and off in turn (ROUNDS rounds, each the median of
# 3 forwards), and each form's logits against float32 without it
import os, statistics, time
import torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.layers import native
from rstmodel.precision import inference

B, rounds = int(os.environ.get("B", 8)), int(os.environ.get("ROUNDS", 5))
P, which = os.environ.get("P", "bf16"), os.environ.get("WHICH", "pooled_mix_available")
torch.manual_seed(0)
m, _ = load_checkpoint("models/rst_cnn_fb.pt")
m = m.float().eval()
x = torch.randn(B, 1, 56, 56)
real = getattr(native, which)
setattr(native, which, lambda *_: False)
with inference("fp32"):
    ref = m(x)
out, times = {}, {"kernel": [], "torch": []}
for r in range(rounds):
    for mode in times:
        setattr(native, which, real if mode == "kernel" else (lambda *_: False))
        with inference(P):
            out[mode] = m(x).float()
            ts = []
            for _ in range(3):
                s = time.perf_counter(); m(x); ts.append(time.perf_counter() - s)
        times[mode].append(statistics.median(ts))
ratios = [k / g for k, g in zip(times["kernel"], times["torch"])]
print(f"{which} {P} batch {B}")
for mode, ts in times.items():
    print(f"{mode}: forward ms per round", [round(t * 1e3, 1) for t in ts],
          f"| max |logit - float32 without it| {(out[mode] - ref).abs().max():.2e}")
print("kernel / torch per round", [round(q, 3) for q in ratios], "median", round(statistics.median(ratios), 3))
