# usage: B=8 P=bf16 python results/bench/fused-pool-ab-s15.py (jemalloc preloaded): the shipped rst_cnn_fb eval,
# the group convs' FFT path pooled before its scatter (GroupRSTConv.forward_pooled) switched on and off in turn
# (ROUNDS rounds, median of 3 forwards each), and the largest logit difference between the two
import os, statistics, time
import torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.layers import GroupRSTConv
from rstmodel.precision import inference

B, rounds, P = int(os.environ.get("B", 8)), int(os.environ.get("ROUNDS", 5)), os.environ.get("P", "bf16")
torch.manual_seed(0)
m, _ = load_checkpoint("models/rst_cnn_fb.pt")
m = m.float().eval()
x = torch.randn(B, 1, 56, 56)
real, taken = GroupRSTConv.pools_fused, []
out, times = {}, {"fused": [], "plain": []}
for r in range(rounds):
    for mode in times:
        GroupRSTConv.pools_fused = (lambda self, x: taken.append(1) or real(self, x)) if mode == "fused" else (lambda self, x: False)
        with inference(P):
            out[mode] = m(x).float()
            ts = []
            for _ in range(3):
                s = time.perf_counter(); m(x); ts.append(time.perf_counter() - s)
        times[mode].append(statistics.median(ts))
assert taken and real(next(c for c in m.modules() if isinstance(c, GroupRSTConv)), torch.zeros(1, 69, 8, 4, 28, 28)) is False  # grad wanted outside inference
ratios = [f / p for f, p in zip(times["fused"], times["plain"])]
print(f"{P} batch {B}: fused ms", [round(t * 1e3, 1) for t in times["fused"]], "plain ms", [round(t * 1e3, 1) for t in times["plain"]])
print("fused / plain per round", [round(q, 3) for q in ratios], "median", round(statistics.median(ratios), 3), "| max logit diff", (out["fused"] - out["plain"]).abs().max().item())
