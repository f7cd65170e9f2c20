"""serve.Classifier: every accepted input form, every refused one, batching, providers,
metadata, and an inference path that never imports torch."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

import rstmodel
from rstcnn.export.onnx_export import export_model
from rstcnn.serve import MAX_PIXELS, Classifier, Prediction
from rstcnn.serve import classifier as clf_mod

CLASSES = [f"c{i}" for i in range(10)]


def metadata(channels: int = 1, size: int = 56) -> dict[str, str]:
    return {
        "rstcnn.model": "fake",
        "rstcnn.class_names": json.dumps(CLASSES),
        "rstcnn.input_size": json.dumps([channels, size, size]),
        "rstcnn.normalization": json.dumps({"mean": [0.5] * channels, "std": [0.25] * channels}),
    }


class Recorder:
    """A fake backend: logits = per-image means of each of the first 10 pixels' rows, and
    a log of the batch shapes it was called with."""

    def __init__(self):
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        self.calls.append(batch.shape)
        return batch.reshape(batch.shape[0], -1)[:, :10] * np.arange(1, 11, dtype=np.float32)


def fake(channels: int = 1, size: int = 56) -> tuple[Classifier, Recorder]:
    run = Recorder()
    return Classifier(run, metadata(channels, size), ["fake"]), run


def grey(h: int = 56, w: int = 56, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w), dtype=np.uint8)


# ---------------------------------------------------------------- accepted inputs


def test_every_grey_form_prepares_to_the_same_pixels(tmp_path):
    clf, _ = fake()
    img = grey()
    expected = img.astype(np.float32)[None, None] / 255
    png = tmp_path / "img.png"
    Image.fromarray(img).save(png)
    forms = [
        img,
        img[..., None],
        np.repeat(img[..., None], 3, axis=2),  # grey RGB: luma of equal channels
        np.concatenate([np.repeat(img[..., None], 3, 2), np.full((56, 56, 1), 255, np.uint8)], 2),
        img.astype(np.float32) / 255,
        img.astype(np.float64) / 255,
        img.astype(np.uint16) * 257,
        Image.fromarray(img),
        Image.fromarray(img).convert("RGB"),
        Image.fromarray(img).convert("RGBA"),
        Image.fromarray(img).convert("LA"),
        Image.fromarray(img).convert("P"),
        Image.fromarray(img.astype(np.uint16) * 257),  # 16-bit grey (I;16)
        Image.fromarray(img.astype(np.float32) / 255),  # mode F
        str(png),
        png,
    ]
    for i, form in enumerate(forms):
        got = clf.prepare(form)
        assert got.shape == (1, 1, 56, 56) and got.dtype == np.float32, i
        np.testing.assert_allclose(got, expected, atol=1.5 / 255, err_msg=f"form {i}")
    batch = clf.prepare(forms)
    assert batch.shape == (len(forms), 1, 56, 56)


def test_cmyk_palette_jpeg_gif_and_one_bit_images_are_read(tmp_path):
    clf, _ = fake()
    img = Image.fromarray(grey()).convert("RGB")
    files = []
    for name, image in (
        ("a.jpg", img),
        ("b.gif", img.convert("P")),
        ("c.tif", img.convert("CMYK")),
        ("d.png", img.convert("1")),
        ("e.png", Image.fromarray(grey().astype(np.uint16) * 257)),
    ):
        image.save(tmp_path / name)
        files.append(tmp_path / name)
    batch = clf.prepare(files + [img.convert("CMYK"), img.convert("1"), img.convert("YCbCr")])
    assert batch.shape == (8, 1, 56, 56) and batch.min() >= 0 and batch.max() <= 1
    ref = clf.prepare(img)[0]
    assert np.abs(batch[2] - ref).max() < 0.02  # CMYK round trip through RGB
    assert np.abs(batch[4] - ref).max() < 1e-3  # 16-bit PNG


def test_transparency_is_composited_on_black():
    clf, _ = fake()
    rgba = np.zeros((56, 56, 4), dtype=np.uint8)
    rgba[..., :3] = 200
    rgba[:, :28, 3] = 255  # left half opaque, right half transparent
    got = clf.prepare(rgba)[0, 0]
    assert np.allclose(got[:, :28], 200 / 255, atol=1e-6) and np.all(got[:, 28:] == 0)
    palette = Image.fromarray(rgba).convert("P")
    palette.info["transparency"] = 0
    assert clf.prepare(palette).shape == (1, 1, 56, 56)


def test_colour_model_gets_rgb_and_grey_is_repeated():
    clf, _ = fake(channels=3)
    img = grey()
    got = clf.prepare([img, Image.fromarray(img).convert("RGB")])
    assert got.shape == (2, 3, 56, 56)
    np.testing.assert_allclose(got[0], np.repeat(img[None].astype(np.float32) / 255, 3, 0))
    np.testing.assert_allclose(got[0], got[1], atol=1e-6)


def test_any_size_is_padded_to_square_and_resized():
    clf, _ = fake()
    wide = np.full((28, 56), 255, dtype=np.uint8)  # pads 14 black rows above and below
    got = clf.prepare(wide)[0, 0]
    assert got.shape == (56, 56)
    assert np.all(got[:13] < 0.02) and np.all(got[-13:] < 0.02) and np.all(got[16:40] > 0.98)
    for shape in ((7, 7), (300, 200), (1, 1), (57, 1000)):
        assert clf.prepare(np.ones(shape, np.float32) * 0.5).shape == (1, 1, 56, 56)
    small = clf.prepare(grey(28, 28))[0, 0]  # bicubic upsizing, clipped to [0, 1]
    assert small.min() >= 0 and small.max() <= 1


def test_a_4d_array_is_a_batch():
    clf, run = fake()
    batch = np.stack([grey(seed=i)[..., None] for i in range(5)])  # [5, H, W, 1]
    probs = clf.predict_proba(batch)
    assert probs.shape == (5, 10) and run.calls == [(5, 1, 56, 56)]


@pytest.mark.parametrize(
    "shape, says",
    [
        ((5, 1, 56, 56), "pass array.transpose(0, 2, 3, 1)"),  # torch's N x C x H x W
        ((3, 56, 56), "pass array.transpose(1, 2, 0)"),  # one image, channels first
        ((5, 56, 56), "a stack of 5 grey images? pass array[..., None]"),
    ],
)
def test_array_layouts_it_cannot_read_are_refused_with_the_fix(shape, says):
    """What a torch user hands over (channels first, or a stack of grey images) is not
    guessed at: the error names the layout expected and the one-line fix."""
    clf, run = fake()
    with pytest.raises(ValueError, match=re.escape(says)):
        clf.predict_proba(np.zeros(shape, np.uint8))
    assert run.calls == []
    fixed = np.zeros(shape, np.uint8)
    fixed = fixed.transpose(0, 2, 3, 1) if len(shape) == 4 else fixed.transpose(1, 2, 0)
    if shape == (5, 56, 56):
        fixed = np.zeros(shape, np.uint8)[..., None]
    assert clf.predict_proba(fixed).shape[1] == 10


# ---------------------------------------------------------------- outputs and batching


def test_predict_proba_and_predict():
    clf, _ = fake()
    images = [grey(seed=i) for i in range(4)]
    probs = clf.predict_proba(images)
    assert probs.dtype == np.float32 and probs.shape == (4, 10)
    np.testing.assert_allclose(probs.sum(1), 1, atol=1e-6)
    preds = clf.predict(images, top_k=3)
    assert len(preds) == 4 and all(len(p) == 3 for p in preds)
    for row, p in zip(probs, preds, strict=True):
        assert [q.index for q in p] == list(np.argsort(-row)[:3])
        assert p[0].score >= p[1].score >= p[2].score
        assert p[0].label == CLASSES[p[0].index] and p[0].score == pytest.approx(row[p[0].index])
    assert preds[0][0].to_dict() == {
        "label": preds[0][0].label,
        "index": preds[0][0].index,
        "score": preds[0][0].score,
    }
    assert len(clf.predict(images[0], top_k=50)[0]) == 10  # clamped to the classes
    with pytest.raises(dataclasses.FrozenInstanceError):
        preds[0][0].score = 1.0  # type: ignore[misc]
    assert isinstance(preds[0][0], Prediction)


def test_one_backend_call_per_batch_and_chunks_for_huge_batches():
    clf, run = fake(size=8)
    clf.predict_proba([grey(8, 8, seed=i) for i in range(20)])
    assert run.calls == [(20, 1, 8, 8)]
    run.calls.clear()
    n = clf_mod.MAX_BATCH * 2 + 3
    logits = clf.run_logits(np.zeros((n, 1, 8, 8), np.float32))
    assert logits.shape == (n, 10)
    assert [c[0] for c in run.calls] == [clf_mod.MAX_BATCH, clf_mod.MAX_BATCH, 3]


def test_normalize_uses_the_metadata():
    clf, _ = fake()
    x = np.full((2, 1, 56, 56), 0.75, np.float32)
    np.testing.assert_allclose(clf.normalize(x), 1.0)  # (0.75 - 0.5) / 0.25


# ---------------------------------------------------------------- refused inputs


def huge_png(path: Path, width: int, height: int) -> None:
    """A tiny PNG whose header claims width x height (valid CRCs, truncated pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(grey(4, 4)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    ihdr = 8 + 8  # signature, then length + type of the IHDR chunk
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    path.write_bytes(bytes(data))


def bad_inputs(tmp_path: Path) -> dict[str, tuple[object, str]]:
    text = tmp_path / "notes.png"
    text.write_text("this is not an image")
    truncated = tmp_path / "truncated.png"
    Image.fromarray(grey()).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:100])
    huge = tmp_path / "huge.png"
    huge_png(huge, 10_000, 10_000)
    large = tmp_path / "large.png"
    huge_png(large, 7_000, 7_000)  # over MAX_PIXELS, under Pillow's own bomb limit
    nan = np.full((56, 56), 0.5, np.float32)
    nan[3, 3] = np.nan
    return {
        "empty list": ([], "empty"),
        "empty array batch": (np.zeros((0, 56, 56, 1), np.uint8), "empty"),
        "missing file": (tmp_path / "nowhere.png", "no such file"),
        "text file": (text, "cannot read"),
        "truncated file": (truncated, "truncated"),
        "100 megapixels (file)": (huge, "megapixel"),
        "49 megapixels (file)": (large, "megapixel"),
        "100 megapixels (array)": (np.broadcast_to(np.uint8(0), (10_000, 10_000)), "megapixel"),
        "NaN": (nan, "NaN"),
        "inf": (np.full((56, 56), np.inf, np.float32), "NaN or infinite"),
        "0..255 floats": (grey().astype(np.float32), "[0, 1]"),
        "two channels": (np.zeros((56, 56, 2), np.uint8), "H x W"),
        "5-D array": (np.zeros((1, 1, 56, 56, 1), np.uint8), "H x W"),
        "int64": (np.zeros((56, 56), np.int64), "dtype"),
        "bool": (np.zeros((56, 56), bool), "dtype"),
        "no pixels": (np.zeros((0, 56), np.uint8), "no pixels"),
        "a dict": ({"image": 1}, "unsupported image type"),
        "None": (None, "unsupported image type"),
    }


def test_bad_inputs_raise_value_error_with_a_message(tmp_path):
    clf, run = fake()
    for name, (item, words) in bad_inputs(tmp_path).items():
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            clf.predict(item)
        assert not run.calls, name
    # in a list, the message names the image
    with pytest.raises(ValueError, match="image 1: .*NaN"):
        clf.predict_proba([grey(), np.full((56, 56), np.nan, np.float32)])
    for top_k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="top_k"):
            clf.predict(grey(), top_k=top_k)


def test_run_logits_checks_its_batch():
    clf, run = fake()
    for batch, words in (
        (np.zeros((2, 1, 28, 28), np.float32), "expected a batch"),
        (np.zeros((2, 56, 56), np.float32), "expected a batch"),
        (np.zeros((2, 1, 56, 56), np.uint8), "float"),
        (np.zeros((0, 1, 56, 56), np.float32), "empty"),
        (np.full((1, 1, 56, 56), np.nan, np.float32), "NaN"),
        ([[0.0]], "numpy array"),
    ):
        with pytest.raises(ValueError, match=words):
            clf.run_logits(batch)
    assert not run.calls


@pytest.mark.parametrize(
    "key, value",
    [
        ("rstcnn.input_size", "[1, 56]"),
        ("rstcnn.input_size", "7"),
        ("rstcnn.normalization", '{"mean": [0.5]}'),
        ("rstcnn.normalization", '{"mean": [0.5], "std": [0.0]}'),
        ("rstcnn.class_names", "not json"),
    ],
)
def test_malformed_metadata_is_refused(key, value):
    with pytest.raises(ValueError, match="metadata"):
        Classifier(Recorder(), {**metadata(), key: value}, ["fake"])


def test_pixel_limit_is_a_documented_module_constant():
    assert MAX_PIXELS == clf_mod.MAX_PIXELS and 10_000_000 <= MAX_PIXELS < 100_000_000
    assert "MAX_PIXELS" in clf_mod.__doc__


# ---------------------------------------------------------------- real onnxruntime sessions


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = rstmodel.create_model("cnn", channels=(4, 6, 8), hidden=16).eval()
    path = tmp_path_factory.mktemp("onnx") / "cnn.onnx"
    return export_model(model, path, input_shape=(1, 56, 56), metadata=metadata())


def test_from_onnx_reads_the_metadata_and_runs(onnx_model):
    clf = Classifier.from_onnx(onnx_model, threads=1)
    assert clf.name == "fake" and clf.class_names == CLASSES and clf.input_size == (1, 56, 56)
    assert clf.normalization == {"mean": [0.5], "std": [0.25]}
    assert clf.providers == ["CPUExecutionProvider"]
    assert clf.metadata["rstcnn.class_names"] == CLASSES
    probs = clf.predict_proba([grey(seed=i) for i in range(3)])
    assert probs.shape == (3, 10) and np.allclose(probs.sum(1), 1, atol=1e-6)
    single = clf.predict_proba(grey(seed=1))
    np.testing.assert_allclose(single[0], probs[1], atol=1e-6)


def test_session_settings_give_the_same_answers(onnx_model):
    images = [grey(seed=i) for i in range(4)]
    expected = Classifier.from_onnx(onnx_model, threads=1).predict_proba(images)
    for settings in (
        {"optimization": "none"},
        {"optimization": "basic"},
        {"optimization": "extended"},
        {"memory_arena": True, "threads": 2},
    ):
        got = Classifier.from_onnx(onnx_model, **settings).predict_proba(images)
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=str(settings))
    with pytest.raises(ValueError, match="optimization"):
        Classifier.from_onnx(onnx_model, optimization="max")


def test_a_gpu_provider_that_cannot_start_is_reported(onnx_model, caplog):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: the fallback does not happen")
    with caplog.at_level(logging.WARNING, logger="serve.classifier"):
        clf = Classifier.from_onnx(
            onnx_model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
        )
    assert clf.providers == ["CPUExecutionProvider"]
    assert "CUDAExecutionProvider requested but not usable" in caplog.text


def test_models_without_metadata_or_not_onnx_are_refused(onnx_model, tmp_path):
    proto = onnx.load(onnx_model)
    del proto.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, bare)
    with pytest.raises(ValueError, match="not an rstcnn model"):
        Classifier.from_onnx(bare)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="not a loadable ONNX model"):
        Classifier.from_onnx(junk)
    with pytest.raises(ValueError, match="no ONNX model"):
        Classifier.from_onnx(tmp_path / "missing.onnx")


def test_inference_path_imports_no_torch(onnx_model, tmp_path):
    png = tmp_path / "x.png"
    Image.fromarray(grey()).save(png)
    code = (
        "import sys, numpy as np\n"
        "from rstcnn.serve.classifier import Classifier\n"
        f"clf = Classifier.from_onnx({str(onnx_model)!r}, threads=1)\n"
        f"preds = clf.predict([{str(png)!r}, np.zeros((30, 40), np.uint8)], top_k=2)\n"
        "assert len(preds) == 2 and len(preds[0]) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_classifier_reads_files_as_the_http_api_decodes_them(tmp_path):
    """One set of image rules: a file given to ``Classifier.prepare`` and the same bytes
    decoded by the API (``serve.uploads.decode_image``) give the same input, bit for bit,
    for transparency, palettes, 16-bit grey, float grey beyond [0, 1] and 1-bit images."""
    from rstcnn.serve.uploads import decode_image

    clf, _ = fake()
    img = grey()
    alpha = Image.fromarray(255 - img)
    forms = {
        "rgba.png": Image.merge("RGBA", [Image.fromarray(img)] * 3 + [alpha]),
        "la.png": Image.merge("LA", [Image.fromarray(img), alpha]),
        "p.png": Image.fromarray(img).convert("P"),
        "i16.png": Image.fromarray(img.astype(np.uint16) * 257),
        "f.tif": Image.fromarray(img.astype(np.float32) / 200 - 0.1),  # clipped to [0, 1]
        "one.png": Image.fromarray(img > 100),
    }
    for name, image in forms.items():
        path = tmp_path / name
        image.save(path)
        api = clf.prepare(decode_image(path.read_bytes()))
        np.testing.assert_array_equal(clf.prepare(str(path)), api, err_msg=name)
