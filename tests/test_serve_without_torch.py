"""Serving needs no torch: the web app, the HTTP API and the stability sweeps run in a
process where importing torch (or the training side) fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from serving import tiny_onnx_models

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib.abc, json, sys

class NoTraining(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        hidden = {"torch", "torchvision", "rstmodel", "rstcnn.train", "rstcnn.export"}
        if any(name == h or name.startswith(h + ".") for h in hidden):
            raise ImportError(f"{name} is hidden in this test")
        return None

sys.meta_path.insert(0, NoTraining())
from fastapi.testclient import TestClient
from rstcnn.serve.app import build_app
from rstcnn.serve.samples import GALLERY
from rstcnn.serve.stability import SweepSpec

models = json.loads(sys.argv[1])
app = build_app(models, spec=SweepSpec(rotation_steps=8, scale_steps=4, deformation_steps=3))
client = TestClient(app, base_url="http://127.0.0.1")
png = sorted(GALLERY.glob("sample_*.png"))[0].read_bytes()
swept = client.post("/v1/stability", files={"image": ("x.png", png, "image/png")})
labelled = client.post("/v1/classify", files={"image": ("x.png", png, "image/png")})
page = client.get("/")
print(json.dumps({
    "stability": swept.status_code,
    "models": [m["model"] for m in swept.json()["models"]],
    "rotation": [len(m["sweeps"]["rotation"]["top1"]) for m in swept.json()["models"]],
    "classify": labelled.status_code,
    "page": page.status_code,
    "gallery": len(app.state.samples),
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "rstmodel"}),
}))
"""


def test_the_app_and_api_run_with_torch_hidden(tmp_path_factory):
    models = [str(p) for p in tiny_onnx_models(tmp_path_factory.getbasetemp())]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(models)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stability"] == result["classify"] == result["page"] == 200, result
    assert result["models"] == ["rst_cnn_fb", "cnn"] and result["rotation"] == [8, 8]
    assert result["gallery"] == 12  # the shipped gallery, read without the training side
    assert result["loaded"] == []
