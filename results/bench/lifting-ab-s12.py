# usage: python lifting-ab-s12.py pooled|responses OLD_CHECKOUT NEW_CHECKOUT BATCH:fp32|bf16 ...
# (jemalloc preloaded): the lifting layer's fused forward, or its responses alone, old and new
# code alternating in one process
import sys, torch, time
def load(root):
    for k in [k for k in sys.modules if k.startswith("rstmodel")]: del sys.modules[k]
    sys.path.insert(0, root)
    from rstmodel.checkpoint import load_checkpoint
    sys.path.pop(0)
    m, meta = load_checkpoint(sys.argv[3] + "/models/rst_cnn_fb.pt")  # the new checkout's
    m=m.float().eval()
    return [mod for mod in m.modules() if type(mod).__name__=="LiftingRSTConv"][0]
mode, old, new = sys.argv[1:4]
L={r:load(r) for r in (old, new)}
call = (lambda l, x: l.forward_pooled(x, relu=True)) if mode == "pooled" else (lambda l, x: l._responses(x))
for B, dt in [(int(a.split(':')[0]), a.split(':')[1]) for a in sys.argv[4:]]:
    x=torch.randn(B,1,56,56); res={}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt=="bf16"):
        outs={r:call(l, x) for r,l in L.items()}
        for rep in range(7 if B<128 else 3):
            for r,l in L.items():
                s=time.perf_counter(); call(l, x); res.setdefault(r,[]).append(time.perf_counter()-s)
    d=(outs[old].float()-outs[new].float()).abs().max().item()
    o,n=[sorted(v)[len(v)//2]*1e3 for v in res.values()]
    print(B, dt, f"lift old {o:.1f} new {n:.1f} ms diff {d:.2e}", flush=True)
