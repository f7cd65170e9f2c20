# usage: python results/bench/small-gemm-s15.py (jemalloc preloaded): native.small_gemm against torch.matmul in
# bfloat16 at the FFT path's DFT shapes (batch 8), median of 7, with the relative error against float64
import torch, time, statistics
from rstmodel.layers import native
torch.manual_seed(0)
def t(f, n=7):
    f(); ts=[]
    for _ in range(n):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    return statistics.median(ts)*1e3
for shape_a, shape_b in [((5, 6), (6, 33)), ((70, 56), (3, 56, 45)), ((56, 70), (70, 155520)), ((56, 66), (66, 146880)), ((28, 34), (34, 117504)), ((14, 20), (14, 20, 13056)), ((28, 32), (28, 32, 8640)), ((32, 28), (28, 28, 4416)), ((66, 56), (56, 75072))]:
    a = torch.randn(*shape_a).bfloat16(); b = torch.randn(*shape_b).bfloat16()
    ref = a.double() @ b.double()
    got = native.small_gemm(a, b)
    err = ((got.double() - ref).abs() / (ref.abs() + 1e-3)).max().item()
    macs = a.shape[0] * a.shape[1] * b.numel() // a.shape[1]
    if macs > 1e6:
        tt = t(lambda: torch.matmul(a, b)); tk = t(lambda: native.small_gemm(a, b))
        print(shape_a, shape_b, f"rel err {err:.2e}  torch {tt:.2f} ms ({macs/tt/1e6:.0f} G/s)  kernel {tk:.2f} ms ({macs/tk/1e6:.0f} G/s)")
    else:
        print(shape_a, shape_b, f"rel err {err:.2e}")
