# usage: python results/bench/quad-kernel-ab2-s17.py [ROWS] (from the repository root, jemalloc preloaded with MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1):
# the first int8 kernel (dc6500a's source, by git show) against the current one (unsigned spectra, the row quads broadcast inside vpdpbusd);
# the bf16 kernel as is and with the same embedded broadcast (the current source with btile's two dot products rewritten);
# ROWS "rows" runs the row-count comparison (2-16 rows) instead of the batch-8 / batch-1 shapes
import ctypes, os, subprocess, sys, tempfile, time, statistics, torch
from rstmodel.layers import native
work = tempfile.mkdtemp()
def build(text, name):
    src = os.path.join(work, name + ".c"); so = os.path.join(work, name + ".so")
    open(src, "w").write(text)
    subprocess.run(["gcc","-O3","-march=native","-shared","-fPIC","-fopenmp","-o",so,src],check=True); return ctypes.CDLL(so)
current = open("rstmodel/layers/_joined_rows.c").read()
first = subprocess.run(["git","show","dc6500a:rstmodel/layers/_joined_rows.c"],capture_output=True,text=True,check=True).stdout
before = """      a_re[r] = _mm512_dpbf16_ps(a_re[r], (__m512bh)_mm512_set1_epi32(p_re[r]), w);
      a_im[r] = _mm512_dpbf16_ps(a_im[r], (__m512bh)_mm512_set1_epi32(p_im[r]), w);"""
after = """      __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(a_re[r]) : "v"(w), "m"(p_re[r]));
      __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(a_im[r]) : "v"(w), "m"(p_im[r]));"""
assert before in current
old=build(first,"old"); new=build(current,"new"); basm=build(current.replace(before, after),"basm")
old.quad_rows_product.argtypes=[ctypes.c_void_p]*6+[ctypes.c_long]*5
new.quad_rows_product.argtypes=[ctypes.c_void_p]*5+[ctypes.c_long]*5
for l in (new,basm): l.paired_rows_product.argtypes=[ctypes.c_void_p]*4+[ctypes.c_long]*5
T=torch.get_num_threads(); torch.manual_seed(0)
shapes = [(1260,32,69,135),(462,32,135,204),(1260,4,69,135),(462,4,135,204),(462,8,135,204)]
if sys.argv[1:] == ["rows"]:
    shapes = [(462,2,135,204),(462,4,135,204),(462,8,135,204),(462,12,135,204),(462,16,135,204),(1260,8,69,135),(1260,16,69,135)]
for f,m,k,n in shapes:
    xr=torch.randn(f,m,k).bfloat16(); xi=torch.randn(f,m,k).bfloat16()
    gr,gi=torch.randn(f,k,n),torch.randn(f,k,n)
    # old packing: signed quads + corr
    tiles,k2=-(-n//16),-(-k//2)
    top=torch.maximum(gr.abs(),gi.abs()).amax(1,keepdim=True); inv=torch.full_like(top,127.0)/top
    qr,qi=torch.round(gr*inv),torch.round(gi*inv)
    q=torch.zeros(f,2*k2,tiles*16,2,dtype=torch.int8); q[:,:k,:n,0]=qr.to(torch.int8); q[:,:k,:n,1]=qi.to(torch.int8)
    gold=q.view(f,k2,2,tiles,16,2).permute(0,3,1,4,2,5).contiguous()
    corr=torch.zeros(f,tiles*16,dtype=torch.int32); corr[:,:n]=128*(qr+qi).sum(1).int()
    pq=native.pack_quads(gr,gi); pp=native.pack_pairs(gr,gi)
    ys=[torch.empty(2,f,m,n,dtype=torch.bfloat16) for _ in range(4)]
    fns=[lambda: old.quad_rows_product(xr.data_ptr(),xi.data_ptr(),gold.data_ptr(),pq.scale.data_ptr(),corr.data_ptr(),ys[0].data_ptr(),f,m,k,n,T),
         lambda: new.quad_rows_product(xr.data_ptr(),xi.data_ptr(),pq.g.data_ptr(),pq.scale.data_ptr(),ys[1].data_ptr(),f,m,k,n,T),
         lambda: new.paired_rows_product(xr.data_ptr(),xi.data_ptr(),pp.data_ptr(),ys[2].data_ptr(),f,m,k,n,T),
         lambda: basm.paired_rows_product(xr.data_ptr(),xi.data_ptr(),pp.data_ptr(),ys[3].data_ptr(),f,m,k,n,T)]
    for fn in fns: fn()
    assert torch.equal(ys[0],ys[1]) and torch.equal(ys[2],ys[3])
    ts=[[] for _ in fns]
    for r in range(9):
        for i,fn in enumerate(fns):
            s=time.perf_counter(); fn(); ts[i].append(time.perf_counter()-s)
    md=[statistics.median(t)*1e3 for t in ts]
    print(f"f{f} m{m} k{k} n{n}: int8 old {md[0]:.2f} new {md[1]:.2f} ({md[1]/md[0]:.2f}) | bf16 {md[2]:.2f} embedded {md[3]:.2f} ({md[3]/md[2]:.2f}) | int8 new / bf16 {md[1]/md[2]:.2f}")
