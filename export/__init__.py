"""Deployment: ``bake`` (plain torch), ONNX export and its parity check, TensorRT engines,
inference benchmarks. ``export.bake(model)`` is ``export.bake.bake``."""

from .bake import bake

__all__ = ["bake"]
