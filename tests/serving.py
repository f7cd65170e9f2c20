"""Helpers shared by the web app tests: tiny exported models, real test images, a live
server on 127.0.0.1. Files are made once per test session under pytest's base temp folder
(a lock keeps test modules from making them twice)."""

from __future__ import annotations

import fcntl
import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rstmodel.data import CLASS_NAMES

FASHION_CLASSES = list(CLASS_NAMES["rs-fashion"])
TINY = {"rst_cnn_fb": {"channels": (4, 6, 8), "hidden": 16}, "cnn": {"channels": (4, 6, 8)}}


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tiny_onnx_models(base: Path) -> list[Path]:
    """Small random RST-CNN(FB) and CNN, saved as checkpoints and exported with the
    project's exporter. -> [rst_cnn_fb.onnx, cnn.onnx]."""
    import rstmodel
    from rstcnn.export.onnx_export import export_onnx

    folder = base / "serve-models"
    out = [folder / f"{name}.onnx" for name in TINY]
    with _locked(folder):
        for (name, overrides), path in zip(TINY.items(), out, strict=True):
            if path.is_file():
                continue
            torch.manual_seed(1)
            model = rstmodel.create_model(name, **overrides)
            _settle_batch_norms(model)
            checkpoint = path.with_suffix(".pt")
            rstmodel.save_checkpoint(
                checkpoint,
                model.eval(),
                model_name=name,
                class_names=FASHION_CLASSES,
                input_size=56,
                in_channels=1,
                normalization=((0.2,), (0.3,)),
                metrics={"test_acc": 0.5},
            )
            export_onnx(checkpoint, path)
    return out


def _settle_batch_norms(model: torch.nn.Module) -> None:
    """Running statistics from a few random batches, so a random model's outputs are not
    swamped by unnormalised activations."""
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.rand(8, 1, 56, 56))
    model.eval()


def gallery(base: Path) -> list:
    """The app's real test images (RS-Fashion cache or Debian Fashion-MNIST)."""
    from rstcnn.serve.samples import write_samples

    folder = base / "serve-samples"
    with _locked(folder.with_name("serve-samples-lock")):
        return write_samples(folder)


def png_bytes(image: Image.Image, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=str(save.pop("format", "PNG")), **save)
    return buffer.getvalue()


def grey(path: Path) -> np.ndarray:
    """uint8 [H, W] pixels of a PNG."""
    return np.asarray(Image.open(path).convert("L"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(app: object, **timeouts: float) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 in a thread, configured as ``serve/app.py``
    does (``timeouts``: ``head_timeout``, ``body_timeout``); yields the base URL. (Gradio
    clients hold a heartbeat stream open; shutdown cancels it after 2 s, which uvicorn
    would log as an error: its log is kept to critical messages.)"""
    import uvicorn

    from rstcnn.serve.guards import server_config

    port = free_port()
    server = uvicorn.Server(
        server_config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="critical",
            timeout_graceful_shutdown=2,
            **timeouts,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def artifacts_dir() -> Path:
    """Where tests leave files for people to look at: $RSTCNN_ARTIFACTS or tests/artifacts."""
    folder = Path(os.environ.get("RSTCNN_ARTIFACTS") or Path(__file__).parent / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
