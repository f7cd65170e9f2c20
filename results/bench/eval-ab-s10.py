import time, torch, sys, importlib
torch.set_num_threads(2)
def load(root):
    for k in [k for k in sys.modules if k.startswith("rstmodel")]: del sys.modules[k]
    sys.path.insert(0, root)
    from rstmodel.checkpoint import load_checkpoint
    from rstmodel.precision import inference
    sys.path.pop(0)
    m, meta = load_checkpoint("/work/main/models/rst_cnn_fb.pt")
    return m.float().eval(), inference
models = {"old": load("OLD_WORKTREE"), "new": load("/work/main")}
print({k: v[0].__class__.__module__ for k,v in models.items()})
for B in (1, 8, 22):
    x = torch.randn(B,1,56,56)
    res = {}
    outs={}
    for at in ("fp32","bf16"):
        for name,(m,inf) in models.items():
            with inf(at):
                for _ in range(2): outs[name,at]=m(x)
        for rep in range(5):
            for name,(m,inf) in models.items():
                with inf(at):
                    s=time.perf_counter(); m(x); res.setdefault((name,at),[]).append(time.perf_counter()-s)
        d=(outs["old",at]-outs["new",at]).abs().max().item()
        o,n=[sorted(res[k,at])[2]*1e3 for k in ("old","new")]
        print(f"batch {B} {at}: old {o:.1f} ms new {n:.1f} ms  new/old {n/o:.2f}  max|diff| {d:.2e}", flush=True)
