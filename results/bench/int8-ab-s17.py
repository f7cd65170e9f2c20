# usage: python results/bench/int8-ab-s17.py BATCHES [ROUNDS] (jemalloc preloaded, OMP_WAIT_POLICY=PASSIVE): the shipped rst_cnn_fb's eval forward in bf16 and int8 taking turns, median of the rounds
import sys, time, statistics, torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.precision import inference
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
for B in [int(b) for b in sys.argv[1].split(",")]:
    x = torch.randn(B, 1, 56, 56)
    ts = {"bf16": [], "int8": []}
    for p in ts:
        with inference(p):
            m(x); m(x)
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 7):
        for p in ts:
            with inference(p):
                s = time.perf_counter(); m(x); ts[p].append(time.perf_counter() - s)
    a, b = (statistics.median(ts[p]) * 1e3 for p in ts)
    print(f"batch {B}: bf16 {a:.1f} ms, int8 {b:.1f} ms, int8/bf16 {b/a:.2f}")
