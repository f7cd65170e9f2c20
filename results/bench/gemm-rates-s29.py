# usage: python results/bench/gemm-rates-s29.py (jemalloc preloaded): native.small_gemm (float32, AVX2) on one thread, best of many, by the length of B
import time, torch, statistics
from rstmodel.layers import native
torch.set_num_threads(1)
def t(f, *a, reps=200):
    f(*a); ts=[]
    for _ in range(reps):
        s=time.perf_counter(); f(*a); ts.append(time.perf_counter()-s)
    return min(ts)
for (m,k) in [(56,60),(60,56),(12,56),(6,60)]:
  for n in (256,1024,4096,8640,65536):
    a=torch.randn(m,k); b=torch.randn(k,n)
    s1=t(native.small_gemm,a,b, reps=max(5, 2000000//n))
    print(f"{m}x{k}x{n}: {s1*1e6:.1f} us {m*k*n/s1/1e9:.1f} GMAC/s")
