# usage: OMP_WAIT_POLICY=PASSIVE python results/bench/fused-pool-blocks-s15.py (jemalloc preloaded): the shipped
# rst_cnn_fb's two group-conv blocks alone in bf16 eval, pooled before the scatter or not, in turn (11 rounds)
import os, statistics, time, torch
from rstmodel.checkpoint import load_checkpoint
from rstmodel.layers import GroupRSTConv
from rstmodel.precision import inference
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
real = GroupRSTConv.pools_fused
for B in (8, 1):
    x = torch.randn(B, 1, 56, 56)
    with inference("bf16"):
        h1 = m.blocks[0](x); h2 = m.blocks[1](h1)
        res = {}
        for blk, inp in ((1, h1), (2, h2)):
            ts = {"fused": [], "plain": []}
            for r in range(11):
                for mode in ts:
                    GroupRSTConv.pools_fused = real if mode == "fused" else (lambda self, x: False)
                    m.blocks[blk](inp)
                    s = time.perf_counter(); m.blocks[blk](inp); ts[mode].append(time.perf_counter() - s)
            rat = statistics.median([f / p for f, p in zip(ts["fused"], ts["plain"])])
            print(f"batch {B} block {blk}: fused {statistics.median(ts['fused'])*1e3:.1f} ms, plain {statistics.median(ts['plain'])*1e3:.1f} ms, per-round median ratio {rat:.3f}")
