# usage: python results/bench/lanes-s29.py int16 (jemalloc preloaded, OMP_WAIT_POLICY=PASSIVE)
# rst_cnn_fb int16 eval: one forward of batch 8 on 2 threads vs two forwards of batch 4, one thread each, at once
import time, statistics, threading, torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.precision import inference
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
x8 = torch.randn(8, 1, 56, 56); x4a, x4b = x8[:4].clone(), x8[4:].clone()
prec = __import__("sys").argv[1] if len(__import__("sys").argv) > 1 else "int16"
def one(x, out, i):
    torch.set_num_threads(1)
    with torch.no_grad(), inference(prec):
        s = time.perf_counter(); out[i] = m(x); out[i + 2] = time.perf_counter() - s
with torch.no_grad(), inference(prec):
    ref = m(x8); m(x4a)
res = {"joint": [], "lanes": [], "lane1": []}
for r in range(6):
    torch.set_num_threads(2)
    with torch.no_grad(), inference(prec):
        s = time.perf_counter(); y = m(x8); res["joint"].append(time.perf_counter() - s)
    out = [None] * 4
    ts = [threading.Thread(target=one, args=(x, out, i)) for i, x in enumerate((x4a, x4b))]
    s = time.perf_counter(); [t.start() for t in ts]; [t.join() for t in ts]; res["lanes"].append(time.perf_counter() - s)
    res["lane1"].append(max(out[2], out[3]))
    d = (torch.cat(out[:2]) - y).abs().max().item()
print(prec, {k: f"{statistics.median(v)*1e3:.0f} ms" for k, v in res.items()}, "maxdiff", d, "threads now", torch.get_num_threads())
