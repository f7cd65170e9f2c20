# usage: B=8 python results/bench/eval-parts-s14.py (jemalloc preloaded): rst_cnn_fb eval in float32 at batch B, the
# compiled product kernel switched on and off in turn (three rounds), each forward with the time its products took
import torch, time, rstmodel, statistics, os
from rstmodel.layers import native, conv as convmod
torch.manual_seed(0)
m = rstmodel.create_model('rst_cnn_fb').eval()
B = int(os.environ.get("B", 8))
x = torch.randn(B, 1, 56, 56)
real = native.available
acc = {"kernel": 0.0, "gauss": 0.0}
rk, rg = native.joined_rows_product, convmod._GaussProduct.apply
def tk(*a, **k):
    s = time.perf_counter(); y = rk(*a, **k); acc["kernel"] += time.perf_counter() - s; return y
def tg(*a, **k):
    s = time.perf_counter(); y = rg(*a, **k); acc["gauss"] += time.perf_counter() - s; return y
native.joined_rows_product = tk
convmod._GaussProduct.apply = tg
res = {"native": [], "bmm": []}
with torch.no_grad():
    for _ in range(3):
        for mode in res:
            native.available = real if mode == "native" else (lambda *_: False)
            m(x)
            acc.update(kernel=0.0, gauss=0.0)
            s = time.perf_counter(); m(x); t = time.perf_counter() - s
            print(mode, f"forward {t*1e3:.0f} ms, products {1e3*(acc['kernel'] + acc['gauss']):.0f} ms")
