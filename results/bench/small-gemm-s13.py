# usage: python small-gemm-s13.py: the batch-1 per-frequency product (joined form, 8 rows,
# layer 2's spectra) against a plain read of the same bytes
import torch, time
def run(fs, rounds=7):
    res={k:[] for k in fs}
    for k,f in fs.items(): f()
    for _ in range(rounds):
        for k,f in fs.items():
            s=time.perf_counter(); f(); res[k].append(time.perf_counter()-s)
    return {k:sorted(v)[rounds//2] for k,v in res.items()}
F=4334
g=torch.randn(F,69,270); x=torch.randn(F,8,69)
gb=g.numel()*4/1e9
gt=g.mT.contiguous().mT  # column-major per batch
r=run({'sum':lambda: g.sum(), 'bmm':lambda: torch.bmm(x,g), 'bmm colmajor':lambda: torch.bmm(x,gt),
       'matmul':lambda: torch.matmul(x,g), 'loop mv':lambda: [torch.mm(x[i],g[i]) for i in range(0,F)]})
for k,v in r.items(): print(f"{k:14s} {v*1e3:7.1f} ms {gb/v:6.1f} GB/s")
