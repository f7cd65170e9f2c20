"""The twenty-seventh session's DFTs along H by pairs of frequencies (``native.dft_pairs_forward``
/ ``dft_pairs_inverse``, half the multiply-adds of the complex GEMM: X(n) and X(nh - n) from
one cos and one sin sum) against the complex GEMM (``native.small_gemm`` with the [2nh, 2H]
matrices), on a CPU with the portable (AVX2) build; runs at the commit that built them
(``git checkout`` it: the next commit took them out again):

1. the kernels alone at the shipped model's shapes (H, nh, L = Fw x maps), medians of 7;
2. the shipped model's eval forward with the pairs nowhere, below 8 MB of input, and
   everywhere, the forms taking turns in one process, in float32 and in ``inference("int16")``.

    python results/bench/dft-pairs-s27.py   (jemalloc preloaded, as the app runs)
"""

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alternate_s13 import run  # noqa: E402

from rstmodel import load_checkpoint  # noqa: E402
from rstmodel.layers import kernels, native  # noqa: E402
from rstmodel.precision import inference  # noqa: E402

# (H, nh, maps): layer 2 at batch 8 (grids 30 and 35), layer 3 at batch 8, layer 2 at batch
# 22 (a sweep), layer 2 at batch 1
SHAPES = [(28, 30, 4416), (28, 35, 4416), (14, 21, 8640), (28, 35, 12144), (28, 35, 552)]


def median(fn) -> float:
    """One warm-up, then the median of 7 runs (``alternate_s13.run`` with one form)."""
    return run({"form": fn})["form"]


def kernels_alone() -> None:
    print("| H | nh | L | forward GEMM ms | pairs ms | pairs / GEMM | inverse GEMM ms | pairs ms | pairs / GEMM |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for h, nh, maps in SHAPES:
        length = (nh // 2 + 1) * maps
        d = kernels._dft_matrices(h, h, nh, nh, torch.float32, torch.device("cpu"))
        a, y = torch.randn(h, 2, length), torch.randn(2, nh, length)
        gf = median(lambda: native.small_gemm(d.fwd_h, a.view(2 * h, length)))
        pf = median(lambda: native.dft_pairs_forward(d.pairs_fwd, a, nh))
        gi = median(lambda: native.small_gemm(d.inv_h, y.view(2 * nh, length)))
        pi = median(lambda: native.dft_pairs_inverse(d.pairs_inv, y))
        print(
            f"| {h} | {nh} | {length} | {gf * 1e3:.2f} | {pf * 1e3:.2f} | {pf / gf:.2f} | "
            f"{gi * 1e3:.2f} | {pi * 1e3:.2f} | {pi / gi:.2f} |"
        )


def model() -> None:
    net, meta = load_checkpoint(Path(__file__).resolve().parents[2] / "models" / "rst_cnn_fb.pt")
    net.eval()
    limits = {"GEMM": -1, "pairs below 8 MB": 8 << 20, "pairs everywhere": 1 << 40}
    print("\n| precision | batch | " + " | ".join(f"{k} ms" for k in limits) + " | max logit diff |")
    print("|---|---|" + "---|" * (len(limits) + 1))
    for precision in ("fp32", "int16"):
        for batch in (1, 8, 22):
            x = torch.randn(batch, meta.in_channels, meta.input_size, meta.input_size)
            out = {}

            def call(limit, x=x, out=out, precision=precision):
                kernels.PAIRS_MAX_BYTES = limit
                with inference(precision), torch.no_grad():
                    out[limit] = net(x)

            t = run({k: functools.partial(call, v) for k, v in limits.items()}, rounds=5)
            diff = max((o - out[-1]).abs().max().item() for o in out.values())
            cells = " | ".join(f"{t[k] * 1e3:.1f} ({t[k] / t['GEMM']:.2f}x)" for k in limits)
            print(f"| {precision} | {batch} | {cells} | {diff:.1e} |")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {native.build_name()}")
    kernels_alone()
    model()
