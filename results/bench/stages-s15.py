# usage: B=8 P=bf16 python results/bench/stages-s15.py (jemalloc preloaded): the shipped rst_cnn_fb eval, time per stage
# (forward DFTs, products, inverse DFTs, row gather/scatter, modules) inside three forwards
import os, time, torch, statistics, collections
from rstmodel.checkpoint import load_checkpoint
from rstmodel.layers import native, conv as convmod, kernels
from rstmodel.precision import inference
B = int(os.environ.get("B", 8)); P = os.environ.get("P", "bf16")
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
x = torch.randn(B, 1, 56, 56)
acc = collections.defaultdict(float)
def wrap(obj, attr, label):
    f = getattr(obj, attr)
    def g(*a, **k):
        s = time.perf_counter(); y = f(*a, **k); acc[label] += time.perf_counter() - s; return y
    setattr(obj, attr, g)
wrap(native, "paired_rows_product", "products"); wrap(native, "joined_rows_product", "products")
wrap(convmod._RealDFT2, "apply", "dft fwd"); wrap(convmod._InverseRealDFT2, "apply", "dft inv")
wrap(convmod._GatherRows, "apply", "gather"); wrap(convmod._ScatterRows, "apply", "scatter")
for name, mod in m.named_children():
    wrap(mod, "forward", "module " + name)
with inference(P):
    m(x); m(x)
    for r in range(3):
        acc.clear(); s = time.perf_counter(); m(x); t = time.perf_counter() - s
        print(f"forward {t*1e3:.0f} ms:", ", ".join(f"{k} {v*1e3:.0f}" for k, v in acc.items()))
