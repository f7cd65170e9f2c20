# usage: B=8 P=bf16 (or int16) python results/bench/stages-s16.py (jemalloc preloaded, OMP_WAIT_POLICY=PASSIVE as the app):
# the shipped rst_cnn_fb eval, time per stage inside forwards (nested timers: "conv N" holds the stages under it)
import os, time, torch, collections
from rstmodel.checkpoint import load_checkpoint
from rstmodel.layers import native, conv as convmod, kernels
from rstmodel.precision import inference
B = int(os.environ.get("B", 8)); P = os.environ.get("P", "bf16")
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
x = torch.randn(B, 1, 56, 56)
acc = collections.defaultdict(float)
def wrap(obj, attr, label):
    f = getattr(obj, attr)
    def g(*a, **k):
        s = time.perf_counter(); y = f(*a, **k); acc[label] += time.perf_counter() - s; return y
    setattr(obj, attr, g)
wrap(native, "paired_rows_product", "products"); wrap(native, "joined_rows_product", "products"); wrap(native, "quad_rows_product", "products"); wrap(native, "word_rows_product", "products")  # int16 (s29)
wrap(convmod._RealDFT2, "apply", "dft fwd"); wrap(convmod, "real_dft2_rows", "dft fwd"); wrap(convmod, "inverse_real_dft2_pooled", "dft inv+pool")
wrap(convmod._GatherRows, "apply", "gather"); wrap(convmod._ScatterRows, "apply", "scatter")
wrap(native, "small_gemm_pool", "  inv W+pool kernel")
lift = m.blocks[0][0]
wrap(lift, "_responses", "lift responses"); wrap(native, "pooled_mix", "lift pooled_mix")
for i, blk in enumerate(m.blocks):
    wrap(blk[0], "forward_pooled", f"conv {i}"); wrap(blk[2], "forward", f"norm {i}")
    if i: wrap(blk[0], "_gather_spectral_taps", "spectral taps")
wrap(m, "forward", "forward")
with inference(P):
    m(x); m(x)
    for r in range(4):
        acc.clear(); m(x)
        print(", ".join(f"{k} {v*1e3:.1f}" for k, v in acc.items()))
