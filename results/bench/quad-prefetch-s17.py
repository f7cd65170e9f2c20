# usage: python results/bench/quad-prefetch-s17.py (repository root; /tmp/q8/cur_s17.c = git show 7f02918:rstmodel/layers/_joined_rows.c, jemalloc preloaded with MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1; needs /tmp/q8/pf4.c, pf8.c, pf16.c: the int8 kernel of 7f02918 with a prefetch 32, 48 and 64 lanes ahead when M >= 8): the kernel without and with the prefetch, in turn
import ctypes, os, subprocess, sys, time, statistics, torch
from rstmodel.layers import native
def build(src, name):
    so=f"/tmp/q8/{name}.so"; subprocess.run(["gcc","-O3","-march=native","-shared","-fPIC","-fopenmp","-o",so,src],check=True)
    l=ctypes.CDLL(so); l.quad_rows_product.argtypes=[ctypes.c_void_p]*5+[ctypes.c_long]*5; return l
libs=[build("/tmp/q8/cur_s17.c","cur")]+[build(f"/tmp/q8/pf{a}.c",f"pf{a}") for a in (4,8,16)]
T=torch.get_num_threads(); torch.manual_seed(0)
for f,m,k,n in [(1260,32,69,135),(462,32,135,204),(1260,4,69,135),(462,4,135,204),(462,8,135,204),(1260,8,69,135)]:
    xr=torch.randn(f,m,k).bfloat16(); xi=torch.randn(f,m,k).bfloat16()
    pq=native.pack_quads(torch.randn(f,k,n),torch.randn(f,k,n))
    ys=[torch.empty(2,f,m,n,dtype=torch.bfloat16) for _ in libs]
    fns=[lambda l=l,y=y: l.quad_rows_product(xr.data_ptr(),xi.data_ptr(),pq.g.data_ptr(),pq.scale.data_ptr(),y.data_ptr(),f,m,k,n,T) for l,y in zip(libs,ys)]
    for fn in fns: fn()
    assert all(torch.equal(ys[0],y) for y in ys)
    ts=[[] for _ in fns]
    for r in range(11):
        for i,fn in enumerate(fns):
            s=time.perf_counter(); fn(); ts[i].append(time.perf_counter()-s)
    md=[statistics.median(t)*1e3 for t in ts]
    print(f"f{f} m{m} k{k} n{n}: current {md[0]:.2f} | prefetch (m >= 8) 32, 48, 64 ahead: "+" ".join(f"{x:.2f} ({x/md[0]:.2f})" for x in md[1:]))
