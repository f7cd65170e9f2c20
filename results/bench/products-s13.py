# usage: python products-s13.py read|conv (jemalloc preloaded)
#   read: the batch-1 per-frequency product (joined form, 8 rows, layer 2's spectra) against
#         a plain read of the same bytes
#   conv: the per-frequency products as batched GEMMs (MKL) against one grouped conv1d
#         (oneDNN), forward and both backward products
import sys, time
from alternate_s13 import run  # this folder's timing loop
import torch, torch.nn.functional as Fn
def read():
    F=4334
    g=torch.randn(F,69,270); x=torch.randn(F,8,69)
    gb=g.numel()*4/1e9
    gt=g.mT.contiguous().mT  # column-major per batch
    r=run({'sum':lambda: g.sum(), 'bmm':lambda: torch.bmm(x,g), 'bmm colmajor':lambda: torch.bmm(x,gt),
           'matmul':lambda: torch.matmul(x,g), 'loop mv':lambda: [torch.mm(x[i],g[i]) for i in range(0,F)]})
    for k,v in r.items(): print(f"{k:14s} {v*1e3:7.1f} ms {gb/v:6.1f} GB/s")
def conv():
    for dt in (torch.float32, torch.bfloat16):
      for F,M,K,N in [(1260,32,69,135),(1260,256,69,135),(462,256,135,204)]:
        if dt==torch.bfloat16 and M==256: continue
        x=torch.randn(F,M,K,dtype=dt); g=torch.randn(F,K,N,dtype=dt); dy=torch.randn(F,M,N,dtype=dt)
        w=g.mT.contiguous().reshape(F*N,K,1)
        xa=x.permute(0,2,1).reshape(1,F*K,M).contiguous()
        dya=dy.permute(0,2,1).reshape(1,F*N,M).contiguous()
        def cb(mask):
            return lambda: torch.ops.aten.convolution_backward(dya, xa, w, None, [1],[0],[1],False,[0],F,mask)
        fs={'bmm fwd':lambda: torch.bmm(x,g),'conv fwd':lambda: Fn.conv1d(xa,w,groups=F)}
        if dt==torch.float32:
            fs.update({'bmm dx':lambda: torch.bmm(dy,g.mT),'conv dx':cb([True,False,False]),'bmm dg':lambda: torch.bmm(x.mT,dy),'conv dw':cb([False,True,False])})
        r=run(fs)
        print(dt,F,M,K,N,"  ".join(f"{k} {v*1e3:.1f}" for k,v in r.items()))
{"read": read, "conv": conv}[sys.argv[1]]()
