# usage: python results/bench/gemm-ab-s16.py A.c B.c ... (jemalloc preloaded): each build of rstmodel/layers/_joined_rows.c (gcc -O3 -march=native -fopenmp)
# times small_gemm_bf16 / small_gemm_pool_bf16 at the FFT path's shapes (batch 8), the builds taking turns, median of 9; ratios to the first
import ctypes, subprocess, sys, time, statistics, torch
torch.manual_seed(0)
libs = []
for i, src in enumerate(sys.argv[1:]):
    so = f"/tmp/gemm-ab-v{i}.so"
    subprocess.run(["gcc", "-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", "-o", so, src], check=True)
    lib = ctypes.CDLL(so)
    lib.small_gemm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
    lib.small_gemm_pool_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 6
    libs.append(lib)
T = torch.get_num_threads()
shapes = [((56, 70), (1, 70, 155520)), ((56, 66), (1, 66, 146880)), ((28, 34), (1, 34, 117504)),
          ((14, 20), (14, 20, 13056)), ((32, 28), (28, 28, 4416)), ((66, 56), (1, 56, 75072)), ("pool", (28, 32), (28, 32, 8640)), ("pool", (14, 18), (14, 18, 13056))]
for sh in shapes:
    pool = sh[0] == "pool"
    sa, sb = sh[1:] if pool else sh
    a = torch.randn(*sa).bfloat16(); b = torch.randn(*sb).bfloat16()
    outs = []
    fns = []
    for lib in libs:
        if pool:
            c = torch.empty(sb[0] // 2, sa[0] // 2, sb[2], dtype=torch.bfloat16)
            f = lambda lib=lib, c=c: lib.small_gemm_pool_bf16(a.data_ptr(), b.data_ptr(), c.data_ptr(), sb[0], sa[0], sa[1], sb[2], 1, T)
        else:
            c = torch.empty(sb[0], sa[0], sb[2], dtype=torch.bfloat16)
            f = lambda lib=lib, c=c: lib.small_gemm_bf16(a.data_ptr(), b.data_ptr(), c.data_ptr(), sb[0], sa[0], sa[1], sb[2], T)
        f(); outs.append(c); fns.append(f)
    assert all(torch.equal(outs[0], o) for o in outs), "builds disagree"
    ts = [[] for _ in fns]
    for r in range(9):
        for i, f in enumerate(fns):
            s = time.perf_counter(); f(); ts[i].append(time.perf_counter() - s)
    macs = sa[0] * sa[1] * sb[0] * sb[2]
    med = [statistics.median(t) * 1e3 for t in ts]
    print(("pool " if pool else "") + f"{sa} x {sb}: " + "  ".join(f"{m:.2f} ms ({macs/m/1e6:.0f} G/s, {m/med[0]:.2f})" for m in med))
