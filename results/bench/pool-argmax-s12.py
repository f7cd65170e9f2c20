import torch, time
import torch.nn.functional as F
from rstmodel.layers.pooling import _pool_quads
def t(f, n=20):
    f(); ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[n//2]*1e6
n,m,c=2,2048,69
rows=torch.randn(2, 2*n*m, c)
bias=torch.randn(c)
out=torch.empty(n,m,c)
q=rows.view(2,n,2,m,c); quads=(q[0,:,0],q[0,:,1],q[1,:,0],q[1,:,1])
print("pool_quads argmax us", t(lambda: _pool_quads(*quads, out=out, bias=bias, relu=True, argmax=True)))
print("pool_quads no argmax us", t(lambda: _pool_quads(*quads, out=out, bias=bias, relu=True, argmax=False)))
# max_pool2d channels-last: [1, m*c, 2, 2n]
x4=rows.view(1, 2, 2*n, m*c).permute(0,3,1,2)  # N C H W with channels-last strides
print(x4.is_contiguous(memory_format=torch.channels_last))
def mp():
    y, idx = F.max_pool2d(x4, 2, return_indices=True)
    code = (idx // (2*n)) * 2 + idx % 2
    return y, code.to(torch.uint8)
print("max_pool2d idx+code us", t(mp))
print("max_pool2d no idx us", t(lambda: F.max_pool2d(x4, 2)))
p0,p1,p2,p3=quads
top=torch.maximum(p0,p1); bottom=torch.maximum(p2,p3); mm=torch.maximum(top,bottom)
print("gt", t(lambda: bottom>top), "gt strided", t(lambda: p3>p2))
a=(p3>p2); b=(p1>p0); cb=bottom>top
print("to uint8", t(lambda: a.to(torch.uint8)), "+2", t(lambda: a.to(torch.uint8)+2))
au=a.to(torch.uint8)+2; bu=b.to(torch.uint8)
print("where u8", t(lambda: torch.where(cb, au, bu)))
idx=torch.where(cb, au, bu)
print("le", t(lambda: mm<=0), "masked_fill", t(lambda: idx.masked_fill_(mm<=0, 4)))
print("where bool", t(lambda: torch.where(cb, a, b)))
print("arith code", t(lambda: (cb.to(torch.uint8) << 1) | torch.where(cb, a, b).to(torch.uint8)))
# float arithmetic code
def fcode():
    s = torch.where(cb, a, b)
    return cb.view(torch.uint8) * 2 + s.view(torch.uint8)
print("view code", t(fcode))
def newcode():
    cbu = cb.view(torch.uint8); 
    sel = (cbu & a.view(torch.uint8)) | ((cbu ^ 1) & b.view(torch.uint8))
    code = (cbu << 1) | sel
    code |= (mm <= 0).view(torch.uint8) << 2
    return code.clamp_max_(4)
ref=torch.where(cb, au, bu).masked_fill_(mm<=0, 4)
print("newcode", t(newcode), torch.equal(newcode(), ref))
def newcode2():
    cbu = cb.view(torch.uint8)
    sel = torch.where(cb, a, b)
    return sel
print("bitwise and", t(lambda: cb.view(torch.uint8) & a.view(torch.uint8)), "xor", t(lambda: cb.view(torch.uint8) ^ 1), "shift", t(lambda: cb.view(torch.uint8) << 1), "clamp", t(lambda: ref.clamp_max(4)))
print("bool and", t(lambda: cb & a), "logical_not", t(lambda: ~cb))
from rstmodel.layers.pooling import _unpool_quads
_, code = _pool_quads(*quads, out=out, bias=bias, relu=True, argmax=True)
g=torch.randn(n,m,c)
print("unpool us", t(lambda: _unpool_quads(g, code, quads)))
print("eq", t(lambda: code==1), "mul bool", t(lambda: torch.mul(g, code==1, out=quads[0])))
e=code==1
print("mul by bool only", t(lambda: torch.mul(g, e, out=quads[0])), "mul by float mask", t(lambda: torch.mul(g, e.float(), out=quads[0])), "masked where", t(lambda: torch.where(e, g, 0.0)))
print("bias grad", t(lambda: (g * (code < 4)).sum(dim=(0, 1))))
def v1():
    for d,qd in enumerate(quads):
        qd.copy_(g); qd.masked_fill_(code != d, 0)
print("copy+masked_fill", t(v1))
T=torch.eye(5,4)  # code 4 -> zeros
def v2():
    oh = F.embedding(code.long(), T)  # [n,m,c,4]
    r = rows.view(2,n,2,m,c).permute(1,3,4,0,2).reshape  # not used
    for d,qd in enumerate(quads):
        torch.mul(g, oh[...,d], out=qd)
print("embedding onehot", t(v2))
def v3():
    for d,qd in enumerate(quads):
        torch.mul(g, (code == d).to(g.dtype), out=qd)
print("eq->float then mul", t(v3))
cf=code.float()
def v4():
    cf = code.to(g.dtype)
    for d,qd in enumerate(quads):
        torch.mul(g, cf == d, out=qd)
print("float code eq", t(v4))
