# usage: python results/bench/bf16-train-avx2-s29.py (jemalloc preloaded): rst_cnn_fb training step of 32, float32 against bf16 autocast, two rounds
import time, torch
from rstmodel.models import create_model
m = create_model("rst_cnn_fb")
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(32, 1, 56, 56); y = torch.randint(0, 10, (32,))
def step(bf):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf):
        loss = torch.nn.functional.cross_entropy(m(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
for bf in (False, True, False, True):
    step(bf); s = time.perf_counter(); step(bf); step(bf); print("bf16" if bf else "fp32", f"{(time.perf_counter()-s)/2:.2f} s/step of 32")
