# usage: python results/bench/pooled-mix-s15.py (jemalloc preloaded): native.pooled_mix against the torch form
# (kernels._pooled_mix_rows) at the lifting layer's shape, batch 8 (M = 256), float32 and bfloat16
import torch, time, statistics
from rstmodel.layers import native
from rstmodel.layers.kernels import _pooled_mix_rows
torch.manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    for (h, w, m, kk, cout) in [(4, 6, 3, 12, 69), (6, 4, 5, 10, 37), (56, 56, 256, 12, 69)]:
        resp = torch.randn(h, w * m, kk).to(dt); a = torch.randn(cout, kk); bias = torch.randn(cout)
        with torch.no_grad():
            ref, _ = _pooled_mix_rows(resp.double(), a.to(dt).double(), bias.double(), True, w, argmax=False)
            got = native.pooled_mix(resp, a, bias, True, w)
            err = (got.double() - ref).abs().max().item()
            print(dt, (h, w, m, kk, cout), f"max err {err:.3g} of {ref.abs().max().item():.3g}")
            if h > 10:
                for name, fn in [("torch", lambda: _pooled_mix_rows(resp, a, bias, True, w, argmax=False)), ("kernel", lambda: native.pooled_mix(resp, a, bias, True, w))]:
                    fn(); ts = []
                    for _ in range(5):
                        s = time.perf_counter(); fn(); ts.append(time.perf_counter() - s)
                    print(f"   {name}: {statistics.median(ts)*1e3:.1f} ms")
