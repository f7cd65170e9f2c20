"""TensorRT backend of ``Classifier.from_tensorrt`` (imported only by it).

Runs a serialized engine from ``export/to_tensorrt.py`` with TensorRT's Python API
(``execute_async_v3`` on named tensors); device buffers come from torch's CUDA allocator,
so this backend, unlike the onnxruntime one, needs torch and a CUDA GPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["load_engine"]


def load_engine(plan: str | Path) -> tuple[Callable[[np.ndarray], np.ndarray], dict[str, str]]:
    """``(run, metadata)``: ``run`` maps a float32 ``[N, C, H, W]`` batch to its logits,
    in chunks of the engine's largest batch; ``metadata`` is the ONNX model's."""
    plan = Path(plan)
    meta_file = plan.with_name(plan.name + ".json")
    if not plan.is_file():
        raise ValueError(f"no TensorRT engine at {plan}")
    if not meta_file.is_file():
        raise ValueError(f"no metadata at {meta_file}: build the engine with export/to_tensorrt.py")
    metadata = json.loads(meta_file.read_text())
    try:
        import tensorrt as trt
        import torch
    except ImportError as err:
        raise ImportError(f"the TensorRT backend needs tensorrt and torch: {err}") from None
    if not torch.cuda.is_available():
        raise RuntimeError("the TensorRT backend needs a CUDA GPU; none is visible")

    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan.read_bytes())
    if engine is None:
        raise ValueError(f"{plan} is not an engine this TensorRT ({trt.__version__}) can load")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    if len(inputs) != 1 or len(outputs) != 1:
        raise ValueError(f"{plan}: expected one input and one output, got {inputs} / {outputs}")
    inp, out = inputs[0], outputs[0]
    max_batch = int(engine.get_tensor_profile_shape(inp, 0)[2][0])
    dtypes = {trt.float32: torch.float32, trt.float16: torch.float16}
    in_dtype, out_dtype = dtypes[engine.get_tensor_dtype(inp)], dtypes[engine.get_tensor_dtype(out)]
    device = torch.device("cuda")

    def run_chunk(batch: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(batch).to(device=device, dtype=in_dtype).contiguous()
        context.set_input_shape(inp, tuple(x.shape))
        y = torch.empty(tuple(context.get_tensor_shape(out)), dtype=out_dtype, device=device)
        context.set_tensor_address(inp, x.data_ptr())
        context.set_tensor_address(out, y.data_ptr())
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return y.float().cpu().numpy()

    def run(batch: np.ndarray) -> np.ndarray:
        return np.concatenate(
            [run_chunk(batch[i : i + max_batch]) for i in range(0, batch.shape[0], max_batch)]
        )

    return run, metadata
