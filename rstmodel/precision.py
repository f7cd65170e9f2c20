"""Inference precision for eager torch: exact float32 (the default), bfloat16 autocast, or
bfloat16 autocast with the FFT path's per-frequency products in int8.

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
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["PRECISIONS", "bf16_supported", "inference", "int8_products", "int8_supported"]

PRECISIONS = ("fp32", "bf16", "int8")

_INT8_PRODUCTS = contextvars.ContextVar("rstmodel_int8_products", default=False)


def int8_products() -> bool:
    """Whether the code running now is inside ``inference("int8")``."""
    return _INT8_PRODUCTS.get()


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


@contextlib.contextmanager
def inference(precision: str = "fp32", device: str | torch.device = "cpu") -> Iterator[None]:
    """No-gradient inference at ``precision`` (``PRECISIONS``) on ``device``: ``fp32`` is
    exact; ``bf16`` is autocast, refused with a ValueError where the device lacks it;
    ``int8`` is ``bf16`` with int8 per-frequency products (the CPU only: ``int8_supported``)."""
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
    token = _INT8_PRODUCTS.set(precision == "int8")
    try:
        with (
            torch.inference_mode(),
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "fp32"),
        ):
            yield
    finally:
        _INT8_PRODUCTS.reset(token)
