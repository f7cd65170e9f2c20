"""Eighteenth session: the --bf16 training step of rst_cnn_fb (batch 128) with the lifting
layer's pooled mixing compiled (widened bfloat16 operands) against the chunked torch form
it replaced, in turns in one process; the float32 step beside them.

    python results/bench/bf16-train-step-s18.py [rounds]   (jemalloc, retaining MALLOC_CONF)
"""

import statistics
import sys
import time

import torch

import rstmodel
from rstmodel.layers import native


def main(rounds: int) -> None:
    torch.manual_seed(0)
    model = rstmodel.create_model("rst_cnn_fb").train()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.randn(128, 1, 56, 56), torch.randint(0, 10, (128,))
    available = native.pooled_mix_train_available

    def step(bf16: bool, kernels: bool) -> float:
        native.pooled_mix_train_available = available if kernels else (lambda *_: False)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    settings = {
        "bf16, compiled pooled mixing": (True, True),
        "bf16, chunked torch form (before)": (True, False),
        "float32 (compiled, as before)": (False, True),
    }
    for args in settings.values():
        step(*args)  # warm-up
    times = {name: [] for name in settings}
    for _ in range(rounds):
        for name, args in settings.items():
            times[name].append(step(*args))
    base = statistics.median(times["bf16, chunked torch form (before)"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:36s} median {med:6.2f} s  ({base / med:.2f}x the bf16 step before)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
