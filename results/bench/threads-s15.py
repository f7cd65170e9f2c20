# usage: OMP_WAIT_POLICY=PASSIVE python results/bench/threads-s15.py (jemalloc preloaded): rst_cnn_fb bf16 eval,
# 2 threads at batch 8 against 1 thread at batch 4 (what two single-threaded engines side by side would each run)
import os, time, statistics, torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.precision import inference
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
xs = {b: torch.randn(b, 1, 56, 56) for b in (4, 8)}
with inference("bf16"):
    for b in xs: m(xs[b])
    for r in range(3):
        for th, b in ((2, 8), (1, 4), (2, 4)):
            torch.set_num_threads(th); m(xs[b])
            ts = []
            for _ in range(3):
                s = time.perf_counter(); m(xs[b]); ts.append(time.perf_counter() - s)
            print(f"threads {th} batch {b}: {statistics.median(ts)*1e3:.0f} ms")
