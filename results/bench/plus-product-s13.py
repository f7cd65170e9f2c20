# usage: python plus-product-s13.py (jemalloc preloaded): the Gauss product's three forms in float32
# (A: bmm + two baddbmm, as before; B: three bmm, then passes that add; C: two of them
# stacked; D: the three bmm alone), alternating in one process
import torch, time
torch.manual_seed(0)
def t(f, n=7):
    f(); ts=[]
    for _ in range(n):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    return sorted(ts)[n//2]
for F,M,K,N in [(1260,256,69,135),(462,256,135,204),(1260,32,69,135)]:
    xr=torch.randn(F,M,K); xi=torch.randn(F,M,K); gr=torch.randn(F,K,N); gd=torch.randn(F,K,N); gs=torch.randn(F,K,N)
    gstk=torch.stack([-gs,gd]).view(2*F,K,N)
    def A():
        m=torch.bmm(xr+xi,gr); y=m.new_empty(2,*m.shape)
        torch.baddbmm(m,xi,gs,alpha=-1,out=y[0]); torch.baddbmm(m,xr,gd,out=y[1]); return y
    def B():
        m=torch.bmm(xr+xi,gr); y=m.new_empty(2,*m.shape)
        torch.bmm(xi,gs,out=y[0]); torch.sub(m,y[0],out=y[0]); torch.bmm(xr,gd,out=y[1]); y[1].add_(m); return y
    def C():
        m=torch.bmm(xr+xi,gr)
        xs=torch.stack([xi,xr]).view(2*F,M,K)
        y=torch.bmm(xs,gstk).view(2,F,M,N); y.add_(m); return y
    def D():  # reference: three bmm only
        m=torch.bmm(xr+xi,gr); a=torch.bmm(xi,gs); b=torch.bmm(xr,gd); return m
    y0=A(); assert torch.allclose(B(),y0,atol=1e-3) and torch.allclose(C(),y0,atol=1e-3)
    for f in (A,B,C,D): print(F,M,K,N,f.__name__, f"{t(f)*1e3:.1f} ms")
