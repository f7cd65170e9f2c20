# usage: python eval-ab-s10.py OLD_CHECKOUT NEW_CHECKOUT [BATCHES [PRECISIONS]] (jemalloc preloaded)
# e.g. ... /tmp/old /work/main 1,8,22 fp32,bf16 (the defaults): the shipped rst_cnn_fb's eval, the
# two checkouts taking turns in one process, median of 5, and the largest logit difference
# between them. (Until the thirteenth session the checkouts were edited into the file as
# OLD_WORKTREE and /work/main; a run that left OLD_WORKTREE in place compared the current
# code with itself.)
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
models = {"old": load(sys.argv[1]), "new": load(sys.argv[2])}
files = {k: type(m).forward.__code__.co_filename for k, (m, _) in models.items()}
print(files)
assert files["old"] != files["new"], "both checkouts resolved to the same code"
batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,8,22").split(",")]
precisions = (sys.argv[4] if len(sys.argv) > 4 else "fp32,bf16").split(",")
for B in batches:
    x = torch.randn(B,1,56,56)
    res = {}
    outs={}
    for at in precisions:
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
