# usage: [OMP_WAIT_POLICY=... | GOMP_SPINCOUNT=...] python results/bench/spin-s16.py LABEL (jemalloc preloaded): the
# shipped rst_cnn_fb's bfloat16 eval forward at batches 1 and 8, median of 9, in this process's OpenMP wait setting
# (run one process per setting, in turn: the setting is read when torch starts)
import sys, time, statistics, torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.precision import inference
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
out = []
for b in (1, 8):
    x = torch.randn(b, 1, 56, 56)
    with inference("bf16"):
        for _ in range(2): m(x)
        ts = []
        for _ in range(9):
            s = time.perf_counter(); m(x); ts.append(time.perf_counter() - s)
    out.append(f"batch {b} {statistics.median(ts) * 1e3:.1f} ms")
print(sys.argv[1], ", ".join(out))
