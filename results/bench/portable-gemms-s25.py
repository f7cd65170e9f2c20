"""Twenty-fifth session, AVX2 CPU: the float32 DFT GEMM kernels and the interleaved product
rows, measured in one process with the forms taking turns (median of rounds).

python results/bench/portable-gemms-s25.py [--against REV]

1. ``native.small_gemm`` (float32, the portable build) against torch's GEMM (MKL) at the
   shipped RST-CNN's DFT shapes, and ``small_gemm_pool`` against torch's GEMM and pool;
2. the shipped model's float32 eval with the DFT kernels on and off (``*_available``
   patched), batches 1, 8 and 22 (a stability sweep's distinct images);
3. ``joined_rows_product`` of this tree against the portable source at REV (default
   ffc471a: before the rows were interleaved), same outputs checked bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alternate_s13 import run as alternate  # noqa: E402

from rstmodel.checkpoint import load_checkpoint  # noqa: E402
from rstmodel.layers import native  # noqa: E402
from rstmodel.precision import inference  # noqa: E402

GEMMS = ("small_gemm_available", "small_gemm_gather_available", "small_gemm_pool_available")


def turns(forms: dict, rounds: int) -> dict[str, float]:
    """Median ms of each zero-argument callable, the forms taking turns each round
    (``alternate_s13.run``, the bench folder's timing loop)."""
    return {name: seconds * 1000 for name, seconds in alternate(forms, rounds).items()}


def gemms() -> None:
    print("## 1. small_gemm (float32) against torch's GEMM, 2 threads, median of 7")
    print("| A | B | torch ms | kernel ms | kernel / torch |\n|---|---|---|---|---|")
    for a_shape, b_shape in [
        ((56, 70), (70, 155520)),
        ((70, 56), (56, 79488)),
        ((28, 42), (42, 143616)),
        ((56, 70), (70, 19440)),
        ((28, 32), (4, 32, 8640)),
        ((28, 32), (28, 32, 8640)),
    ]:
        a, b = torch.randn(*a_shape), torch.randn(*b_shape)
        lib_gemm = (
            (lambda a=a, b=b: a @ b)
            if b.dim() == 2
            else (lambda a=a, b=b: torch.bmm(a.expand(b.shape[0], *a.shape), b))
        )
        ms = turns({"torch": lib_gemm, "kernel": lambda a=a, b=b: native.small_gemm(a, b)}, 7)
        print(
            f"| {a_shape} | {b_shape} | {ms['torch']:.2f} | {ms['kernel']:.2f} | {ms['kernel'] / ms['torch']:.2f} |"
        )


def pooled() -> None:
    from rstmodel.layers.kernels import _pool_quads

    print("\n## 1b. small_gemm_pool (float32) against torch's bmm and pool, median of 7")
    print("| A | B | torch ms | kernel ms | kernel / torch |\n|---|---|---|---|---|")

    def torch_form(a, b):
        h, w = b.shape[0], a.shape[0]
        v = torch.bmm(a.expand(h, *a.shape), b).view(h // 2, 2, w // 2, 2, b.shape[-1])
        out = v.new_empty(h // 2, w // 2, v.shape[-1])
        quads = (v[:, 0, :, 0], v[:, 0, :, 1], v[:, 1, :, 0], v[:, 1, :, 1])
        _pool_quads(*quads, relu=True, argmax=False, out=out)
        return out

    for w, k, h, n in [(28, 32, 28, 8640), (28, 36, 28, 8640), (14, 18, 14, 13056)]:
        a, b = torch.randn(w, k), torch.randn(h, k, n)
        with torch.no_grad():
            ms = turns(
                {
                    "torch": lambda a=a, b=b: torch_form(a, b),
                    "kernel": lambda a=a, b=b: native.small_gemm_pool(a, b, True),
                },
                7,
            )
        print(
            f"| {(w, k)} | {(h, k, n)} | {ms['torch']:.2f} | {ms['kernel']:.2f} | {ms['kernel'] / ms['torch']:.2f} |"
        )


def model() -> None:
    print("\n## 2. shipped rst_cnn_fb, float32 eval, DFT kernels on / off, median of 5")
    print("| batch | off ms | on ms | on / off | max logit difference |\n|---|---|---|---|---|")
    net, meta = load_checkpoint(ROOT / "models/rst_cnn_fb.pt")
    net = net.float().eval()
    real = {name: getattr(native, name) for name in GEMMS}

    def run(x, on):
        for name, f in real.items():
            setattr(native, name, f if on else (lambda *a, **k: False))
        return net(x)

    for batch in (1, 8, 22):
        x = torch.randn(batch, meta.in_channels, meta.input_size, meta.input_size)
        with torch.no_grad(), inference("fp32"):
            diff = (run(x, True) - run(x, False)).abs().max().item()
            ms = turns({"off": lambda x=x: run(x, False), "on": lambda x=x: run(x, True)}, 5)
        print(
            f"| {batch} | {ms['off']:.1f} | {ms['on']:.1f} | {ms['on'] / ms['off']:.2f} | {diff:.1e} |"
        )
    for name, f in real.items():
        setattr(native, name, f)


def products(rev: str) -> None:
    print(f"\n## 3. joined_rows_product, this tree against {rev}, 2 threads, median of 7")
    print("| F, M, K, N | old ms | new ms | new / old |\n|---|---|---|---|")
    src = ROOT / "rstmodel/layers/_joined_rows_portable.c"
    old = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:rstmodel/layers/_joined_rows_portable.c"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old.c").write_text(old)
        for name, path in (("old", Path(tmp) / "old.c"), ("new", src)):
            so = Path(tmp) / f"{name}.so"
            subprocess.run(
                ["cc", *native.FLAGS, "-I", str(src.parent), "-o", str(so), str(path)], check=True
            )
            lib = ctypes.CDLL(str(so))
            lib.joined_rows_product.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
            libs[name] = lib
        for f, m, k, n in [
            (1122, 4, 69, 135),
            (1122, 32, 69, 135),
            (380, 32, 135, 204),
            (1122, 88, 69, 135),
            (380, 88, 135, 204),
        ]:
            x = torch.randn(f, 2 * m, k)
            packed = native.pack_joined(torch.randn(f, k, n), torch.randn(f, k, n))
            ys = {name: torch.empty(2, f, m, n) for name in libs}

            def call(name, x=x, packed=packed, ys=ys, f=f, m=m, k=k, n=n):
                libs[name].joined_rows_product(
                    x.data_ptr(), packed.data_ptr(), ys[name].data_ptr(), f, m, k, n, 2
                )

            ms = turns({"old": lambda: call("old"), "new": lambda: call("new")}, 7)
            assert torch.equal(ys["old"], ys["new"])
            print(
                f"| {f}, {m}, {k}, {n} | {ms['old']:.1f} | {ms['new']:.1f} | {ms['new'] / ms['old']:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default="ffc471a")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"# {native.build_name()}, torch {torch.__version__}, 2 threads")
    gemms()
    pooled()
    model()
    products(args.against)


if __name__ == "__main__":
    main()
