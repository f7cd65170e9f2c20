# usage: OMP_WAIT_POLICY=PASSIVE python results/bench/engine8-s15.py (jemalloc preloaded): the served eager engine
# (serve.eager.load, bf16) driven by 8 client threads in one process, no HTTP; the bf16 product kernel on and off in turn
import os, threading, time, statistics
import numpy as np
from rstcnn.serve import eager
from rstmodel.layers import native
run, meta, _ = eager.load("models/rst_cnn_fb.pt")
x = np.random.default_rng(0).standard_normal((1, 1, 56, 56)).astype(np.float32)
real = native.paired_available
sizes = []
orig = run._run
def spy(batch):
    sizes.append(len(batch)); return orig(batch)
run._run = spy
def drive(n_per=12):
    def client():
        for _ in range(n_per): run(x)
    ts = [threading.Thread(target=client) for _ in range(8)]
    s = time.perf_counter(); [t.start() for t in ts]; [t.join() for t in ts]
    return 8 * n_per / (time.perf_counter() - s)
drive(2)
for r in range(3):
    for mode in ("kernel", "gauss"):
        native.paired_available = real if mode == "kernel" else (lambda *_: False)
        drive(1); sizes.clear()
        rate = drive()
        print(mode, f"{rate:.1f} images/s, batches {statistics.mean(sizes):.1f} images on average")
