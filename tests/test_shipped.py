"""The shipped checkpoints in models/: loadable, as documented, and accurate on real test
images of the split they were trained on (RS-Fashion realisation 0, built here from the
Debian Fashion-MNIST files), rendered both by the project's bicubic pipeline and by the
held-out Pillow one (``rstmodel.data.HELD_OUT_RESAMPLING``) that no training image came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import rstmodel
from rstmodel.data import (
    HELD_OUT_RESAMPLING,
    TRAIN_RESAMPLINGS,
    RSConfig,
    find_source,
    load_source,
    split_indices,
)
from rstmodel.data.rs import draw_parameters, rotate_scale_upsize

MODELS = Path(__file__).resolve().parents[1] / "models"
PAPER_RST_FB_5K = 0.7864  # the paper's RST-CNN(FB), RS-Fashion, N_tr = 5000
NUM_IMAGES = 96


@pytest.fixture(scope="module", params=["bicubic", HELD_OUT_RESAMPLING])
def test_images(request, tmp_path_factory):
    """The last NUM_IMAGES test images of the shipped models' split, rendered by each
    pipeline from the source images with the realisation's own draws (the same bytes as the
    cached realisation, without rendering all 70,000), normalised later."""
    _, meta = rstmodel.load_checkpoint(MODELS / "rst_cnn_fb.pt")
    run = meta.extra["run"]
    config = RSConfig(run["data"], realisation=run["realisation"], resampling=request.param)
    info = find_source(config.dataset.base, sources_dir=tmp_path_factory.mktemp("sources"))
    source = load_source(info)
    angles, scales, order = draw_parameters(source.labels.shape[0], config)
    test = split_indices(order, run["train_size"], num_val=run["val_size"])[2]
    assert test.shape[0] == meta.metrics["test_size"]
    pick = test[-NUM_IMAGES:]
    images = np.stack(
        [
            rotate_scale_upsize(source.images[i], angles[i], scales[i], 56, config.resampling)
            for i in pick
        ]
    )
    return images, source.labels[pick]


@pytest.mark.parametrize("name", ["rst_cnn_fb", "cnn"])
def test_shipped_checkpoint_is_what_models_readme_says(name):
    path = MODELS / f"{name}.pt"
    assert path.stat().st_size <= 10 * 2**20
    model, meta = rstmodel.load_checkpoint(path)
    assert meta.model_name == name and len(meta.class_names) == 10
    assert (meta.in_channels, meta.input_size) == (1, 56)
    assert sum(p.numel() for p in model.parameters()) == {"rst_cnn_fb": 499874, "cnn": 494805}[name]
    run = meta.extra["run"]
    assert (run["data"], run["train_size"], run["augment"]) == ("rs-fashion", 20000, False)
    # trained over every training resampling pipeline, never the held-out one it is tested
    # on: both 14 epochs from scratch
    assert (run["init"], run["epochs"]) == (None, 14)
    assert run["train_resampling"] == list(TRAIN_RESAMPLINGS)
    assert HELD_OUT_RESAMPLING not in run["train_resampling"]
    readme = (MODELS / "README.md").read_text()
    assert f"**{100 * meta.metrics['test_acc']:.2f} %**" in readme
    assert f"**{100 * meta.metrics['test_pillow_acc']:.2f} %**" in readme


def test_shipped_rst_model_beats_the_paper_and_the_cnn():
    _, rst = rstmodel.load_checkpoint(MODELS / "rst_cnn_fb.pt")
    _, cnn = rstmodel.load_checkpoint(MODELS / "cnn.pt")
    assert rst.metrics["test_acc"] >= PAPER_RST_FB_5K
    assert rst.metrics["test_acc"] > cnn.metrics["test_acc"] + 0.05
    assert rst.metrics["test_size"] == cnn.metrics["test_size"] == 48000


@pytest.mark.parametrize("name", ["rst_cnn_fb", "cnn"])
def test_shipped_models_do_not_depend_on_how_an_image_was_resampled(name):
    """Recorded on all 48,000 test images: at most 1.5 points lost on the held-out Pillow
    rendering of the same test images against the project's own."""
    _, meta = rstmodel.load_checkpoint(MODELS / f"{name}.pt")
    assert meta.metrics["test_pillow_size"] == meta.metrics["test_size"] == 48000
    assert meta.metrics["test_acc"] - meta.metrics["test_pillow_acc"] <= 0.015


@pytest.mark.parametrize("name, floor", [("rst_cnn_fb", 0.72), ("cnn", 0.6)])
def test_shipped_models_classify_real_test_images(test_images, name, floor):
    # recorded test accuracy 84.4 % / 74.5 %; the floors sit > 3 binomial std below
    model, meta = rstmodel.load_checkpoint(MODELS / f"{name}.pt")
    model.eval()
    images, labels = test_images
    x = torch.from_numpy(images[:, None].astype(np.float32) / 255)
    x = (x - meta.mean[0]) / meta.std[0]
    with torch.no_grad():
        logits = torch.cat([model(x[i : i + 32]) for i in range(0, len(x), 32)])
    accuracy = (logits.argmax(1).numpy() == labels).mean()
    assert accuracy >= floor, f"{name}: {accuracy:.3f} on {len(labels)} real test images"
    if name == "rst_cnn_fb":  # invariant to quarter turns by construction
        with torch.no_grad():
            turned = model(torch.rot90(x[:8], 1, dims=(-2, -1)))
        assert (turned - logits[:8]).abs().max() < 1e-4 * logits[:8].abs().max()


@pytest.mark.parametrize("precision", ["bf16", "int8", "int16"])
def test_shipped_accuracy_checks_belong_to_the_shipped_checkpoint(precision):
    """Each reduced precision's recorded check beside the RST-CNN (what the app reads to
    serve it so) passes and names the shipped checkpoint file's SHA-256: a re-shipped
    checkpoint needs its checks made again, or the app ignores them."""
    import json

    from rstcnn.export.onnx_export import file_sha256
    from rstcnn.serve.eager import gate_path, read_gate

    checkpoint = MODELS / "rst_cnn_fb.pt"
    record = json.loads(gate_path(checkpoint, precision).read_text())
    assert record["precision"] == precision and record["images"] >= 1000
    assert read_gate(checkpoint, file_sha256(checkpoint), precision) == {**record, "passes": True}
    assert record["drop_points"] <= record["limit_points"] == 0.5


def test_shipped_rst_model_in_int16_matches_float32_on_real_images(test_images):
    """Where the CPU runs the int16 products (AVX2 without AVX-512): the top class of every
    real test image is float32's, the logits within 10^-3 of the largest, and quarter turns
    still keep them (each turned copy's rows are quantized alike)."""
    from rstmodel.precision import inference, int16_supported

    if not int16_supported():
        pytest.skip("no int16 products on this CPU (its int8 and bfloat16 checks run instead)")
    model, meta = rstmodel.load_checkpoint(MODELS / "rst_cnn_fb.pt")
    model.eval()
    images, _ = test_images
    x = (torch.from_numpy(images[:32, None].astype(np.float32) / 255) - meta.mean[0]) / meta.std[0]
    with inference("fp32"):
        exact = model(x)
    with inference("int16"):
        quant = model(x)
        turned = model(torch.rot90(x[:8], 1, dims=(-2, -1)))
    assert torch.equal(quant.argmax(1), exact.argmax(1))
    assert 0 < (quant - exact).abs().max() < 1e-3 * exact.abs().max()
    assert (turned - quant[:8]).abs().max() < 1e-4 * quant[:8].abs().max()
