# usage: python unpool-s13.py (jemalloc preloaded): the layer-2 unpooling at batch 64 (spatial-major,
# 54M pooled values): four masked products, one broadcast torch.where, and the same compiled
import torch, time
def run(fs, rounds=7):
    res={k:[] for k in fs}
    for k,f in fs.items(): f()
    for _ in range(rounds):
        for k,f in fs.items():
            s=time.perf_counter(); f(); res[k].append(time.perf_counter()-s)
    return {k:sorted(v)[rounds//2] for k,v in res.items()}
X=8*4*64*135
full=torch.empty(28,28,X)
quads=[full.view(14,2,14,2,X)[:,a,:,b] for a in (0,1) for b in (0,1)]
grad=torch.randn(14,14,X); idx=torch.randint(0,5,(14,14,X),dtype=torch.uint8)
code=torch.tensor([[0,1],[2,3]],dtype=torch.uint8).view(1,2,1,2,1)
def A():
    for d,qd in enumerate(quads): torch.mul(grad,(idx==d).to(grad.dtype),out=qd)
def fused(grad, idx):
    return torch.where(idx[:,None,:,None]==code, grad[:,None,:,None], 0.0).view(28,28,-1)
t=time.time(); cf=torch.compile(fused); y=cf(grad,idx); print("compile s", round(time.time()-t,1))
A(); print("equal", torch.equal(y, full))
r=run({'A (4x eq,to,mul)':A,'eager where-broadcast':lambda: fused(grad,idx),'compiled':lambda: cf(grad,idx)})
for k,v in r.items(): print(f"{k:24s} {v*1e3:.1f} ms")
