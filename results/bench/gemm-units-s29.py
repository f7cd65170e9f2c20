# usage: build /tmp/s29/v_UNIT_AHEAD.so from rstmodel/layers/_joined_rows_portable.c with -DUNIT=U -DAHEAD=A (AHEAD made overridable), then
# python results/bench/gemm-units-s29.py THREADS: small_gemm_f32 at the DFT shapes of batch 8, each variant / the shipped 64/64, medians of 5 rounds
import ctypes, time, statistics, sys, torch, itertools
torch.set_num_threads(1)
th = int(sys.argv[1]) if len(sys.argv) > 1 else 1
libs = {}
for u in (64, 128, 256, 512):
    for ah in (64, 256, 512):
        l = ctypes.CDLL(f"/tmp/s29/v_{u}_{ah}.so"); f = l.small_gemm_f32
        f.argtypes = [ctypes.c_void_p]*3 + [ctypes.c_long]*5; libs[(u, ah)] = f
shapes = [(56,60,138240),(60,56,70656),(28,42,143616),(56,60,8640)]
for (m,k,n) in shapes:
    a=torch.randn(m,k); b=torch.randn(k,n); c=torch.empty(m,n)
    res = {key: [] for key in libs}
    for r in range(5):
        for key, f in libs.items():
            f(a.data_ptr(), b.data_ptr(), c.data_ptr(), 1, m, k, n, th)
            s=time.perf_counter()
            for _ in range(3): f(a.data_ptr(), b.data_ptr(), c.data_ptr(), 1, m, k, n, th)
            res[key].append((time.perf_counter()-s)/3)
    assert torch.allclose(c, a@b, atol=1e-3, rtol=1e-4)
    base = statistics.median(res[(64,64)])
    print(f"{m}x{k}x{n} threads {th}: base {base*1e3:.2f} ms " + " ".join(f"{u}/{ah}:{statistics.median(v)/base:.2f}" for (u,ah), v in res.items()))
