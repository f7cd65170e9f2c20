# usage: python unpool-s13.py fused|masks (jemalloc preloaded): the max-pool's backward
#   fused: layer 2 at batch 64 (spatial-major, 54M pooled values): four masked products (the
#          twelfth session's code), one broadcast torch.where, and the same compiled by inductor
#   masks: the masks from bool compares cast to float (A, the twelfth session's code) against
#          byte arithmetic multiplied as bytes (C, this session's), and two mixes (B, D), at
#          layer 2 (batch 64), the lifting layer's chunk, and layer 2 at batch 1
import sys, time
from alternate_s13 import run  # this folder's timing loop
import torch
def fused():
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
def masks():
    torch.manual_seed(0)
    for shape in [(64,135,8,4,14,14),(2,2048,69),(1,69,8,4,28,28)]:
        if len(shape)==6:
            b,c,r,s_,h,w=shape
            full=torch.empty(2*h,2*w,r,s_,b,c).permute(4,5,2,3,0,1); quads=[full[...,i::2,j::2] for i in (0,1) for j in (0,1)]
            grad=torch.randn(h,w,r,s_,b,c).permute(4,5,2,3,0,1); idx=torch.randint(0,5,(h,w,r,s_,b,c),dtype=torch.uint8).permute(4,5,2,3,0,1)
        else:
            rows=torch.empty(2,2*shape[0]*shape[1],shape[2]); q=rows.view(2,shape[0],2,shape[1],shape[2]); quads=[q[0,:,0],q[0,:,1],q[1,:,0],q[1,:,1]]
            grad=torch.randn(*shape); idx=torch.randint(0,5,shape,dtype=torch.uint8)
        def A():
            for d,qd in enumerate(quads): torch.mul(grad,(idx==d).to(grad.dtype),out=qd)
        def B():
            onehot=1<<idx
            for d,qd in enumerate(quads): torch.mul(grad,((onehot>>d)&1).to(grad.dtype),out=qd)
        def C():
            onehot=1<<idx
            for d,qd in enumerate(quads): torch.mul(grad,(onehot>>d)&1,out=qd)
        def D():
            onehot=1<<idx
            for d,qd in enumerate(quads):
                m=onehot>>d; m&=1; torch.mul(grad,m.to(grad.dtype),out=qd)
        A(); ref=[q.clone() for q in quads]
        for f in (B,C,D):
            f(); assert all(torch.equal(a,b) for a,b in zip(ref,quads)), f.__name__
        r=run({'A':A,'B':B,'C':C,'D':D}, rounds=9)
        print(shape, "  ".join(f"{k} {v*1e3:.2f}ms" for k,v in r.items()))
{"fused": fused, "masks": masks}[sys.argv[1]]()
