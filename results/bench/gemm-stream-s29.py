# usage: build /tmp/s29/base.so and /tmp/s29/nostream.so from rstmodel/layers/_joined_rows_portable.c (STREAM_BYTES made overridable; -DSTREAM_BYTES="(1L<<40)" for nostream), then python results/bench/gemm-stream-s29.py
import ctypes, time, statistics, sys, torch
torch.set_num_threads(1)
libs = {}
for name in ("base", "nostream"):
    f = ctypes.CDLL(f"/tmp/s29/{name}.so").small_gemm_f32; f.argtypes = [ctypes.c_void_p]*3 + [ctypes.c_long]*5; libs[name] = f
for th in (1, 2):
  for (m,k,n) in [(56,60,65536),(56,60,138240),(60,56,70656),(56,60,8640)]:
    a=torch.randn(m,k); b=torch.randn(k,n); c=torch.empty(m,n)
    res = {key: [] for key in libs}
    for r in range(5):
        for key, f in libs.items():
            f(a.data_ptr(), b.data_ptr(), c.data_ptr(), 1, m, k, n, th)
            s=time.perf_counter(); f(a.data_ptr(), b.data_ptr(), c.data_ptr(), 1, m, k, n, th); res[key].append(time.perf_counter()-s)
    print(th, f"{m}x{k}x{n}", " ".join(f"{key} {statistics.median(v)*1e3:.2f} ms ({m*k*n/statistics.median(v)/1e9:.1f} G/s, {4*(k*n+m*n)/statistics.median(v)/1e9:.1f} GB/s)" for key, v in res.items()))
