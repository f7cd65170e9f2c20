"""HTTP API through the ASGI test client: every endpoint, every kind of bad upload, image
modes, one batch per model per stability request, and the sweeps' transforms."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from serving import grey, png_bytes

from rstcnn.serve import MAX_PIXELS, Classifier, probes
from rstcnn.serve.app import build_app
from rstcnn.serve.stability import SweepSpec, build_sweeps, measure_stability
from rstcnn.serve.uploads import MAX_UPLOAD_BYTES, UploadError, decode_image

SPEC = SweepSpec(rotation_steps=8, scale_steps=5, deformation_steps=3)


class Counting:
    """A classifier wrapper that counts model runs and records their batch sizes."""

    def __init__(self, inner: Classifier):
        self.inner = inner
        self.batches: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def run_logits(self, batch: np.ndarray) -> np.ndarray:
        self.batches.append(int(batch.shape[0]))
        return self.inner.run_logits(batch)

    def predict_proba(self, images):
        self.batches.append(-1)  # any other path into the model counts too
        return self.inner.predict_proba(images)


@pytest.fixture(scope="module")
def counted(model_paths) -> list[Counting]:
    return [Counting(Classifier.from_onnx(p, threads=1)) for p in model_paths]


@pytest.fixture(scope="module")
def client(counted, samples, tmp_path_factory) -> TestClient:
    folder = samples[0].path.parent
    app = build_app(counted, samples_dir=folder, spec=SPEC)
    return TestClient(app, base_url="http://127.0.0.1")


def upload(data: bytes, name: str = "x.png", mime: str = "image/png") -> dict:
    return {"image": (name, data, mime)}


def test_health_models_and_docs(client):
    health = client.get("/healthz")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "models": ["rst_cnn_fb", "cnn"]}

    listed = client.get("/v1/models").json()
    assert listed["default"] == "rst_cnn_fb"
    assert [m["architecture"] for m in listed["models"]] == ["rst_cnn_fb", "cnn"]
    assert listed["models"][0]["input_size"] == [1, 56, 56]
    assert len(listed["models"][1]["classes"]) == 10
    assert listed["limits"] == {
        "max_upload_bytes": MAX_UPLOAD_BYTES,
        "max_pixels": MAX_PIXELS,
        "sweeps_running": 1,
        "sweeps_waiting": 8,
        "classify_running": 8,
        "classify_waiting": 24,
    }

    spec = client.get("/openapi.json").json()
    assert {"/healthz", "/v1/models", "/v1/classify", "/v1/stability"} <= set(spec["paths"])
    assert client.get("/docs").status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and "gradio" in page.text.lower()


def test_classify_matches_the_classifier(client, counted, samples):
    data = samples[0].path.read_bytes()
    answer = client.post("/v1/classify", files=upload(data), data={"top_k": "3"})
    assert answer.status_code == 200
    body = answer.json()
    assert body["model"] == "rst_cnn_fb"
    scores = [p["score"] for p in body["predictions"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    expected = counted[0].inner.predict(grey(samples[0].path), top_k=3)[0]
    assert [p["label"] for p in body["predictions"]] == [p.label for p in expected]
    np.testing.assert_allclose(scores, [p.score for p in expected], atol=1e-5)

    other = client.post("/v1/classify", files=upload(data), data={"model": "cnn", "top_k": "50"})
    assert other.status_code == 200
    assert other.json()["model"] == "cnn"
    assert len(other.json()["predictions"]) == 10  # top_k is capped at the class count
    assert abs(sum(p["score"] for p in other.json()["predictions"]) - 1) < 1e-4


def test_invert_equals_a_dark_on_light_upload(client, samples):
    pixels = grey(samples[1].path)
    plain = client.post(
        "/v1/classify", files=upload(samples[1].path.read_bytes()), data={"top_k": "10"}
    )
    dark = png_bytes(Image.fromarray(255 - pixels))
    inverted = client.post(
        "/v1/classify", files=upload(dark), data={"invert": "true", "top_k": "10"}
    )
    assert inverted.status_code == 200
    assert _scores(inverted) == pytest.approx(_scores(plain), abs=1e-5)
    not_inverted = client.post("/v1/classify", files=upload(dark), data={"top_k": "10"})
    assert _scores(not_inverted) != pytest.approx(_scores(plain), abs=1e-3)


def _scores(answer) -> dict[str, float]:
    return {p["label"]: p["score"] for p in answer.json()["predictions"]}


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize(
    ("case", "status", "words"),
    [
        ("empty", 400, "empty"),
        ("text", 415, "not an image"),
        ("truncated", 422, "truncated"),
        ("100 megapixels", 413, "megapixel"),
        ("too many bytes", 413, "MiB"),
    ],
)
def test_bad_uploads_get_4xx_json(client, samples, case, status, words):
    png = samples[0].path.read_bytes()
    data = {
        "empty": b"",
        "text": b"this is not an image\n" * 10,
        "truncated": png[: len(png) // 2],
        "100 megapixels": probes.png_header(10_000, 10_000),
        "too many bytes": png + b"\0" * (MAX_UPLOAD_BYTES + 2**20),
    }[case]
    for endpoint in ("/v1/classify", "/v1/stability"):
        answer = client.post(endpoint, files=upload(data))
        assert answer.status_code == status, (case, endpoint, answer.text)
        assert words in answer.json()["detail"]
    assert client.get("/healthz").status_code == 200  # still serving


def test_bad_fields_get_4xx_json(client, samples):
    png = samples[0].path.read_bytes()
    missing = client.post("/v1/classify", data={"top_k": "3"})
    assert missing.status_code == 422 and "image" in missing.text
    zero = client.post("/v1/classify", files=upload(png), data={"top_k": "0"})
    assert zero.status_code == 422
    unknown = client.post("/v1/stability", files=upload(png), data={"model": "resnet"})
    assert unknown.status_code == 404 and "rst_cnn_fb" in unknown.json()["detail"]


def _modes(pixels: np.ndarray) -> dict[str, tuple[bytes, float]]:
    """The same picture in other modes and formats -> (file bytes, tolerance vs. grey)."""
    base = Image.fromarray(pixels)
    rgba = Image.merge("RGBA", [Image.new("L", base.size, 255)] * 3 + [base])  # alpha = object
    wide = Image.fromarray(pixels.astype(np.uint16) * 257)  # 16-bit grey, same values
    assert wide.mode.startswith("I;16")
    return {
        "16-bit": (png_bytes(wide), 1e-5),
        "RGBA": (png_bytes(rgba), 1e-2),
        "palette": (png_bytes(base.convert("RGB").quantize(256)), 5e-2),
        "CMYK": (png_bytes(base.convert("CMYK"), format="JPEG", quality=95), 1e-1),
        "LA": (png_bytes(Image.merge("LA", [Image.new("L", base.size, 255), base])), 1e-2),
    }


def test_image_modes_are_read_as_the_same_picture(client, samples):
    pixels = grey(samples[2].path)
    reference = client.post("/v1/classify", files=upload(png_bytes(Image.fromarray(pixels))))
    expected = {p["label"]: p["score"] for p in reference.json()["predictions"]}
    for mode, (data, tolerance) in _modes(pixels).items():
        answer = client.post("/v1/classify", files=upload(data), data={"top_k": "10"})
        assert answer.status_code == 200, (mode, answer.text)
        scores = {p["label"]: p["score"] for p in answer.json()["predictions"]}
        for label, score in expected.items():
            assert abs(scores[label] - score) <= tolerance, (mode, label)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decode_image_values():
    ramp = np.arange(256, dtype=np.uint8).reshape(16, 16)
    np.testing.assert_allclose(decode_image(png_bytes(Image.fromarray(ramp))), ramp / 255)
    wide = Image.fromarray(ramp.astype(np.uint16) * 257)
    np.testing.assert_allclose(decode_image(png_bytes(wide)), ramp / 255, atol=1e-6)
    # transparent pixels become the models' black background, or white before inversion
    clear = Image.new("RGBA", (4, 4), (200, 10, 10, 0))
    assert decode_image(png_bytes(clear)).max() == 0
    assert decode_image(png_bytes(clear), invert=True).max() == 0
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red
    colour = decode_image(png_bytes(cmyk, format="JPEG", quality=100))
    assert colour.shape == (8, 8, 3) and colour[0, 0] == pytest.approx([1, 0, 0], abs=0.02)
    with pytest.raises(UploadError) as err:
        decode_image(probes.png_header(MAX_PIXELS, 2))
    assert err.value.status == 413


def test_stability_runs_one_batch_per_model(client, counted, samples):
    for c in counted:
        c.batches.clear()
    answer = client.post("/v1/stability", files=upload(samples[3].path.read_bytes()))
    assert answer.status_code == 200
    body = answer.json()
    # one batch per model, of its distinct images: the unperturbed one is also rotation 0,
    # scale 1 and deformation 0; the RST-CNN (quarter-turn invariant) runs rotations 0 and 45
    # only, the CNN all 8
    assert [c.batches for c in counted] == [[SPEC.batch_size - 3 - 6], [SPEC.batch_size - 3]]
    assert body["batch_size"] == SPEC.batch_size == 1 + 8 + 5 + 3
    assert [m["model"] for m in body["models"]] == ["rst_cnn_fb", "cnn"]
    classified = client.post("/v1/classify", files=upload(samples[3].path.read_bytes())).json()
    for entry in body["models"]:
        assert set(entry["sweeps"]) == {"rotation", "scale", "deformation"}
        rotation = entry["sweeps"]["rotation"]
        assert rotation["values"] == pytest.approx(np.arange(8) * 45)
        assert rotation["unit"] == "degrees"
        assert entry["stability"] == rotation["agreement"]
        assert set(entry["changes"]) == set(entry["sweeps"])
        if rotation["agreement"] == 1:
            assert entry["changes"]["rotation"] == f"{entry['label']} at all 8 angles"
        else:  # each other label the sweep found is named with its angles
            for label in set(rotation["top1"]) - {entry["label"]}:
                assert f"{label} at " in entry["changes"]["rotation"]
        for sweep in entry["sweeps"].values():
            assert 0 <= min(sweep["probability"]) <= max(sweep["probability"]) <= 1
            agree = np.mean([label == entry["label"] for label in sweep["top1"]])
            assert sweep["agreement"] == pytest.approx(agree)
        # step 0 of the rotation and deformation sweeps is the unperturbed image
        assert rotation["probability"][0] == pytest.approx(entry["score"], abs=1e-5)
        assert entry["sweeps"]["deformation"]["probability"][0] == pytest.approx(
            entry["score"], abs=1e-5
        )
    top = classified["predictions"][0]
    assert (body["models"][0]["label"], body["models"][0]["score"]) == (
        top["label"],
        pytest.approx(top["score"], abs=1e-5),
    )
    one = client.post(
        "/v1/stability", files=upload(samples[3].path.read_bytes()), data={"model": "cnn"}
    )
    assert [m["model"] for m in one.json()["models"]] == ["cnn"]


def test_rst_model_is_stable_under_quarter_turns(counted, samples):
    """The RST-CNN's logits are invariant to 90-degree turns and the sweep turns exactly,
    so its probability curve repeats every quarter turn; the CNN's need not."""
    report = measure_stability(counted, grey(samples[4].path), spec=SweepSpec(rotation_steps=8))
    rst, cnn = (m.sweeps["rotation"].probability for m in report.models)
    np.testing.assert_allclose(rst[[0, 2, 4, 6]], rst[0], atol=1e-5)
    assert np.abs(cnn[[2, 4, 6]] - cnn[0]).max() > 1e-4


def test_sweep_transforms(samples):
    image = grey(samples[5].path)[None].astype(np.float32) / 255  # [1, 56, 56]
    spec = SweepSpec(rotation_steps=4, scale_range=(0.5, 2.0), scale_steps=3, deformation_steps=3)
    rotation, scale, deformation = build_sweeps(image, spec)
    assert rotation.images.shape == (4, 1, 56, 56)
    np.testing.assert_array_equal(rotation.images[1], np.rot90(image, 1, axes=(1, 2)))
    np.testing.assert_array_equal(rotation.images[0], image)
    assert scale.values == pytest.approx([0.5, 1.0, 2.0])
    np.testing.assert_allclose(scale.images[1], image, atol=1e-6)
    # shrinking halves the object's extent: its mass drops about four-fold
    assert scale.images[0].sum() == pytest.approx(image.sum() / 4, rel=0.1)
    assert deformation.values == pytest.approx([0.0, 0.1, 0.2])
    np.testing.assert_allclose(deformation.images[0], image, atol=1e-6)
    moved = [np.abs(d - image).mean() for d in deformation.images]
    assert 0 < moved[1] < moved[2]  # a larger |grad tau| moves the picture more


def test_numpy_sweeps_agree_with_the_torch_transforms(samples):
    """serve.transforms (numpy/scipy, what serving runs) against the project's torch
    transforms on a real test image: quarter turns bit for bit, the rest to float32
    rounding; the slope norm and the warp on one field."""
    import math

    import torch

    from rstcnn.serve.transforms import rotate_scale, smooth_field, sup_slope, warp
    from rstmodel.data.transforms import jacobian_sup_norm
    from rstmodel.data.transforms import warp as torch_warp
    from rstmodel.group import RSTElement, act_on_image

    image = grey(samples[5].path)[None].astype(np.float32) / 255  # [1, 56, 56]
    x = torch.from_numpy(image)
    for degrees, factor in [(0, 1), (90, 1), (180, 1), (270, 1), (15, 1), (135, 0.7), (0, 0.3)]:
        g = RSTElement(angle=math.radians(degrees), log2_scale=math.log2(factor))
        ours, theirs = rotate_scale(image, degrees, factor), act_on_image(x, g).numpy()
        if degrees % 90 == 0 and factor == 1:
            np.testing.assert_array_equal(ours, theirs)
        else:
            np.testing.assert_allclose(ours, theirs, atol=2e-5)
    tau = smooth_field(56, 56, seed=3)
    assert sup_slope(tau) == pytest.approx(jacobian_sup_norm(torch.from_numpy(tau)).item())
    tau *= 0.2 / sup_slope(tau)
    reference = torch_warp(x[None].double(), torch.from_numpy(tau)[None]).float().numpy()[0]
    np.testing.assert_allclose(warp(image, tau), reference, atol=1e-6)
    assert not np.allclose(smooth_field(56, 56, seed=3), smooth_field(56, 56, seed=4))


def test_gallery_images_are_answered_from_sweeps_made_at_start_up(counted, samples):
    from rstcnn.serve.app import _analyse, warm_gallery

    app = build_app(counted, samples_dir=samples[0].path.parent, spec=SPEC)
    client = TestClient(app, base_url="http://127.0.0.1")
    png = samples[3].path.read_bytes()
    fresh = client.post("/v1/stability", files=upload(png)).json()
    warm_gallery(app).join(120)
    assert len(app.state.sweep_cache) == len(samples)
    before = [len(c.batches) for c in counted]
    cached = client.post("/v1/stability", files=upload(png))
    one = client.post("/v1/stability", files=upload(png), data={"model": "cnn"})
    assert [len(c.batches) for c in counted] == before  # no model ran
    assert cached.json() == fresh
    assert [m["model"] for m in one.json()["models"]] == ["cnn"]
    assert one.json()["models"][0] == fresh["models"][1]
    other = png_bytes(Image.fromarray(255 - grey(samples[3].path)))  # not in the gallery
    assert client.post("/v1/stability", files=upload(other)).status_code == 200
    assert [len(c.batches) for c in counted] > before
    models, spec = app.state.models, SPEC
    steps = list(
        _analyse(
            models,
            spec,
            str(samples[3].path),
            None,
            3,
            False,
            "upload",
            [samples[0].path.parent],
            cache=app.state.sweep_cache,
        )
    )
    assert "swept at start-up" in steps[-1][0]


def test_gallery_sweeps_wait_out_a_load_of_classifications(monkeypatch):
    """The background sweeps of the gallery run only when no classification has run for
    ``pause`` seconds: under a load of classifications they wait, and run after it."""
    import threading
    import time

    from rstcnn.serve import api
    from rstcnn.serve.guards import Gate

    swept = []
    monkeypatch.setattr(api, "measure_stability", lambda models, pixels, **kw: swept.append(1))
    meta = {
        "rstcnn.model": "m",
        "rstcnn.class_names": '["a", "b"]',
        "rstcnn.input_size": "[1, 8, 8]",
        "rstcnn.normalization": '{"mean": [0.5], "std": [0.25]}',
    }
    models = api.ModelSet([Classifier(lambda b: np.zeros((len(b), 2), np.float32), meta, ["x"])])
    sweeps, classify = (
        Gate("stability", running=1, waiting=1),
        Gate("classify", running=8, waiting=8),
    )
    cache = api.SweepCache(models, SweepSpec(), sweeps, yield_to=(classify,))
    images = [np.full((8, 8), v, np.uint8) for v in (0, 1)]

    stop = threading.Event()

    def load() -> None:  # back-to-back classifications, as 8 clients keep the gate busy
        while not stop.is_set():
            with classify.enter():
                time.sleep(0.02)

    clients = threading.Thread(target=load)
    clients.start()
    warm = cache.warm(images, pause=0.1)
    time.sleep(1.0)
    assert swept == [] and warm.is_alive()  # waited out the load
    stop.set()
    clients.join()
    warm.join(10)
    assert swept == [1, 1] and len(cache) == 2  # then ran, once the gate was quiet
    assert not classify.quiet_for(60) and classify.quiet_for(0.0)


def test_changes_name_each_other_label_with_its_runs_of_steps():
    from rstcnn.serve.stability import SweepResult

    angles = np.arange(24) * 15.0
    top1 = ["Sandal"] * 10 + ["Dress"] + ["Sandal"] * 8 + ["Trouser"] * 2 + ["Sandal"] * 3
    turned = SweepResult("rotation", angles, np.zeros(24), top1, 0.875)
    assert turned.changes("Sandal") == "Dress at 150 deg, Trouser at 285-300 deg"
    assert turned.changes("Dress") == "Sandal at 0-135 deg, 165-270 deg, 315-345 deg, " + (
        "Trouser at 285-300 deg"
    )
    steady = SweepResult("rotation", angles, np.zeros(24), ["Sandal"] * 24, 1.0)
    assert steady.changes("Sandal") == "Sandal at all 24 angles"
    scales = SweepResult(
        "scale", np.array([0.2, 0.33, 0.6, 1.0]), np.zeros(4), ["Bag"] * 2 + ["Coat"] * 2, 0.5
    )
    assert scales.changes("Coat") == "Bag at x0.2-x0.33"
    bent = SweepResult(
        "deformation", np.linspace(0, 0.2, 6), np.zeros(6), ["Coat"] * 5 + ["Bag"], 0.8
    )
    assert bent.changes("Coat") == "Bag at 0.2"


def test_sweeps_reuse_exactly_what_they_may(counted, samples):
    """The distinct-row batch gives the full batch's probabilities: to round-off for the
    quarter-turn invariant RST-CNN, bit for bit for duplicates."""
    from rstcnn.serve.stability import build_sweeps, distinct_rows, probabilities

    rst, cnn = (c.inner for c in counted)
    assert rst.metadata["rstcnn.quarter_turn_invariant"] is True
    assert cnn.metadata["rstcnn.quarter_turn_invariant"] is False
    image = np.asarray(rst.prepare(grey(samples[5].path)), dtype=np.float32)[0]
    sweeps = build_sweeps(image, SweepSpec(rotation_steps=24, scale_steps=5))
    batch = np.concatenate([image[None]] + [s.images for s in sweeps])
    full = probabilities(rst, batch)
    unique, inverse = distinct_rows(batch, sweeps, quarter_turns=True)
    assert len(unique) == len(batch) - 3 - 18  # 6 of 24 angles; 3 copies of the image
    np.testing.assert_allclose(probabilities(rst, batch[unique])[inverse], full, atol=1e-5)
    unique, inverse = distinct_rows(batch, sweeps)
    assert len(unique) == len(batch) - 3
    np.testing.assert_array_equal(batch[unique][inverse], batch)
