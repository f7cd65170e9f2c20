"""Inference precision for eager torch: exact float32 (the default) or bfloat16 autocast.

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["PRECISIONS", "bf16_supported", "inference"]

PRECISIONS = ("fp32", "bf16")


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


@contextlib.contextmanager
def inference(precision: str = "fp32", device: str | torch.device = "cpu") -> Iterator[None]:
    """No-gradient inference at ``precision`` (``PRECISIONS``) on ``device``: ``fp32`` is
    exact; ``bf16`` is autocast, refused with a ValueError where the device lacks it."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    if precision == "bf16" and not bf16_supported(device):
        raise ValueError(
            f"{device.type} here has no native bfloat16 (AVX512-BF16 or AMX on a CPU): "
            "use precision 'fp32'"
        )
    with (
        torch.inference_mode(),
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"),
    ):
        yield
