"""Deployment: ``export.bake.bake`` (plain torch), ONNX export and its parity check
(``export/to_onnx.py``), TensorRT engines (``export/to_tensorrt.py``), inference
benchmarks (``python -m export.bench``)."""
