"""rstcnn: the command lines and services around the ``rstmodel`` library.

- ``rstcnn.train``: training (``rstcnn-train``), the paper's experiments, benchmarks;
- ``rstcnn.export``: baking the fixed bases into plain convolutions, ONNX (``rstcnn-export``)
  and TensorRT;
- ``rstcnn.serve``: onnxruntime inference, the web app and HTTP API (``rstcnn-serve``); it
  imports no torch.

From a checkout, ``train/``, ``export/`` and ``serve/`` at the top are links to these
folders, so ``python train/run.py`` and ``python export/to_onnx.py`` work as before.
"""
