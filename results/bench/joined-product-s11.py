import time, torch, sys
torch.set_num_threads(2)
from rstmodel.checkpoint import load_checkpoint
import rstmodel.layers.conv as conv
m, _ = load_checkpoint("models/rst_cnn_fb.pt"); m = m.float().eval()
x = torch.randn(1, 1, 56, 56)
res = {}
with torch.no_grad():
    for rows in (4, 0):
        conv.JOINED_PRODUCT_ROWS = rows
        for _ in range(3): m(x)
    for rep in range(7):
        for rows in (4, 0):
            conv.JOINED_PRODUCT_ROWS = rows
            s = time.perf_counter(); m(x); res.setdefault(rows, []).append(time.perf_counter() - s)
for rows, ts in res.items(): print("joined" if rows else "gauss", f"{sorted(ts)[3]*1e3:.1f} ms")
