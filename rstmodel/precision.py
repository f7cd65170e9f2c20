"""Inference precision for eager torch: exact float32 (the default), bfloat16 autocast,
bfloat16 autocast with the FFT path's per-frequency products in int8, or float32 with those
products on 16-bit integers.

    from rstmodel import load_checkpoint
    from rstmodel.precision import inference
    model, meta = load_checkpoint("models/rst_cnn_fb.pt")
    with inference("bf16"):          # where the CPU has AVX512-BF16 / AMX, or on a GPU
        logits = model(x)

bfloat16 autocast runs the convolutions and matrix products in bfloat16 with float32
accumulation; batch-norm statistics and the FFT transforms stay float32. On this project's
2-core CPU (AMX) the full ``rst_cnn_fb`` evaluates a batch of 128 about 4x faster so
(BENCHMARKS.md); ``python train/precision_check.py CKPT`` measures what it costs in accuracy
on the checkpoint's own test images before you rely on it.

``int8`` is ``bf16`` with one change on the CPU: the group convolutions' per-frequency
complex products (``GroupRSTConv.forward_fft``, the bulk of the FFT path's multiply-adds)
run on 8-bit integers, each frequency's rows quantized as they come and the filter spectra
once (``rstmodel.layers.native.quad_rows_product``: AVX512-VNNI dot products, exact 32-bit
sums, scaled back to bfloat16). It needs a CPU with AVX512-BF16 and AVX512-VNNI and the
compiled kernels; ``int8_supported`` says whether this one has them.

``int16`` is for CPUs without those instructions (AVX2): everything stays float32 except the
same per-frequency products, which run on 16-bit integers (each frequency's rows and the
filter spectra scaled to ~12 bits, 2,820-3,944 levels at the shipped model's widths, so
that exact 32-bit sums cannot overflow: ``rstmodel.layers.native.word_rows_product``,
AVX2's ``vpmaddwd``; half the bytes of float32 spectra). The shipped RST-CNN's forward took
0.73x (one image) to 0.88x (22) the float32 time on an AVX2 EPYC, the logits within 0.006 of
float32's on its whole test split. It needs the portable (AVX2) build of the kernels;
``int16_supported`` says whether this CPU runs it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = [
    "PRECISIONS",
    "bf16_supported",
    "inference",
    "int8_products",
    "int8_supported",
    "int16_products",
    "int16_supported",
    "products",
]

PRECISIONS = ("fp32", "bf16", "int8", "int16")

_PRODUCTS = contextvars.ContextVar("rstmodel_products", default="")


def products() -> str:
    """The integer form of the per-frequency products in the code running now: "int8"
    inside ``inference("int8")``, "int16" inside ``inference("int16")``, "" elsewhere."""
    return _PRODUCTS.get()


def int8_products() -> bool:
    """Whether the code running now is inside ``inference("int8")``."""
    return _PRODUCTS.get() == "int8"


def int16_products() -> bool:
    """Whether the code running now is inside ``inference("int16")``."""
    return _PRODUCTS.get() == "int16"


def bf16_supported(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` runs bfloat16 natively (a CPU with AVX512-BF16 or AMX, or a GPU
    that supports it); elsewhere autocast would emulate it, slower than float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def int8_supported(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` runs ``inference("int8")``: a CPU with AVX512-BF16 and AVX512-VNNI
    where the compiled kernels build."""
    from rstmodel.layers import native

    device = torch.device(device)
    return device.type == "cpu" and bf16_supported(device) and native.quad_rows_built()


def int16_supported(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` runs ``inference("int16")``: a CPU with AVX2 (and no AVX-512,
    whose build has the int8 products instead) where the compiled kernels build."""
    from rstmodel.layers import native

    return torch.device(device).type == "cpu" and native.word_rows_built()


@contextlib.contextmanager
def inference(precision: str = "fp32", device: str | torch.device = "cpu") -> Iterator[None]:
    """No-gradient inference at ``precision`` (``PRECISIONS``) on ``device``: ``fp32`` is
    exact; ``bf16`` is autocast, refused with a ValueError where the device lacks it;
    ``int8`` is ``bf16`` with int8 per-frequency products (the CPU only: ``int8_supported``);
    ``int16`` is float32 with 16-bit integer per-frequency products (``int16_supported``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    if precision == "bf16" and not bf16_supported(device):
        raise ValueError(
            f"{device.type} here has no native bfloat16 (AVX512-BF16 or AMX on a CPU): "
            "use precision 'fp32'"
        )
    if precision == "int8" and not int8_supported(device):
        raise ValueError(
            f"{device.type} here cannot run int8 products (a CPU with AVX512-BF16 and "
            "AVX512-VNNI and a C compiler): use precision 'bf16' or 'fp32'"
        )
    if precision == "int16" and not int16_supported(device):
        raise ValueError(
            f"{device.type} here cannot run int16 products (a CPU with AVX2 but no AVX-512, "
            "and a C compiler): use precision 'fp32'"
        )
    token = _PRODUCTS.set(precision if precision in ("int8", "int16") else "")
    try:
        with (
            torch.inference_mode(),
            torch.autocast(
                device.type, dtype=torch.bfloat16, enabled=precision in ("bf16", "int8")
            ),
        ):
            yield
    finally:
        _PRODUCTS.reset(token)
