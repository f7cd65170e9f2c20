# usage: [ROUNDS=3] python train-ab-s12.py OLD_CHECKOUT NEW_CHECKOUT BATCH [bf16] (jemalloc preloaded)
# prints each checkout's median step and, per round, the second checkout's time over the first's
import os, sys, torch, time
def load(root):
    for k in [k for k in sys.modules if k.startswith("rstmodel")]: del sys.modules[k]
    sys.path.insert(0, root)
    from rstmodel.models.registry import create_model
    sys.path.pop(0)
    torch.manual_seed(0)
    return create_model("rst_cnn_fb").train()
B=int(sys.argv[3]); bf=len(sys.argv)>4 and sys.argv[4]=="bf16"
models={r:load(r) for r in (sys.argv[1], sys.argv[2])}
files=[type(m).forward.__code__.co_filename for m in models.values()]
print(files); assert files[0]!=files[1], "both checkouts resolved to the same code"
x=torch.randn(B,1,56,56); y=torch.randint(0,10,(B,))
opts={r:torch.optim.Adam(m.parameters(), lr=1e-3) for r,m in models.items()}
def step(r):
    m=models[r]; opt=opts[r]
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf):
        loss=torch.nn.functional.cross_entropy(m(x), y)
    loss.backward(); opt.step(); return loss.item()
res={}
for r in models: step(r)
rounds=int(os.environ.get('ROUNDS', 3))
for rep in range(rounds):
    for r in models:
        s=time.perf_counter(); l=step(r); res.setdefault(r,[]).append(time.perf_counter()-s)
for r,v in res.items(): print(r, B, "bf16" if bf else "fp32", f"median {sorted(v)[len(v)//2]:.2f} s", [f"{t:.2f}" for t in v])
old, new = res.values()
print("new/old per round", [f"{b/a:.2f}" for a, b in zip(old, new)])
