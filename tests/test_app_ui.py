"""The Gradio UI through gradio_client against a live server on 127.0.0.1, the command
line, and a bounded load test of /v1/classify on loopback."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import httpx
import numpy as np
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image
from serving import grey, live_server, tiny_onnx_models

from rstcnn.serve import Classifier
from rstcnn.serve.api import ModelSet
from rstcnn.serve.app import _analyse, build_app, main
from rstcnn.serve.loadtest import _free_port, run_load
from rstcnn.serve.stability import SweepSpec, measure_stability
from rstcnn.serve.uploads import decode_image

SPEC = SweepSpec(rotation_steps=12, scale_steps=6, deformation_steps=4)


@pytest.fixture(scope="module")
def server(tmp_path_factory, samples):
    models = tiny_onnx_models(tmp_path_factory.getbasetemp())
    app = build_app(models, samples_dir=samples[0].path.parent, spec=SPEC, threads=1)
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server, tmp_path_factory) -> Iterator[Client]:
    downloads = tmp_path_factory.mktemp("gradio-downloads")
    client = Client(server, verbose=False, analytics_enabled=False, download_files=str(downloads))
    yield client
    client.close()


def analyse(client: Client, path: Path | None, *, top_k: int = 3, invert: bool = False):
    image = handle_file(str(path)) if path is not None else None
    return client.predict(image, None, top_k, invert, api_name="/analyse")


def test_ui_classifies_a_real_test_image(client, server, samples):
    path = samples[0].path
    status, rst, cnn, summary, plot, thumbs = analyse(client, path)
    api = httpx.post(
        server + "/v1/classify",
        files={"image": ("x.png", path.read_bytes(), "image/png")},
        data={"top_k": "3"},
    ).json()
    assert rst["label"] == api["predictions"][0]["label"]
    assert [c["label"] for c in rst["confidences"]] == [p["label"] for p in api["predictions"]]
    np.testing.assert_allclose(
        [c["confidence"] for c in rst["confidences"]],
        [p["score"] for p in api["predictions"]],
        atol=1e-5,
    )
    assert len(cnn["confidences"]) == 3
    assert f"x {SPEC.batch_size} images, one batch per model" in status
    assert "RST-CNN(FB)" in summary and "CNN" in summary and rst["label"] in summary
    swept = httpx.post(server + "/v1/stability", files={"image": ("x.png", path.read_bytes())})
    for entry in swept.json()["models"]:  # the page names the same label changes as the API
        assert entry["changes"]["rotation"] in summary
    assert plot["type"] == "matplotlib" and plot["plot"].startswith("data:image/png;base64,")
    assert len(thumbs) == 6 + 6 + 4  # up to 6 per sweep
    first = Image.open(thumbs[0]["image"])
    assert first.size == (112, 112)
    np.testing.assert_array_equal(np.asarray(first.convert("L"))[::2, ::2], grey(path))
    assert thumbs[0]["caption"].startswith("rot 0")


def test_ui_invert_and_top_k(client, samples, tmp_path):
    dark = tmp_path / "dark.png"
    Image.fromarray(255 - grey(samples[1].path)).save(dark)
    plain = analyse(client, samples[1].path, top_k=5)
    inverted = analyse(client, dark, top_k=5, invert=True)
    assert len(plain[1]["confidences"]) == 5
    assert _confidences(inverted[1]) == pytest.approx(_confidences(plain[1]), abs=1e-5)
    assert "(inverted)" in inverted[0]
    assert "background looks light" not in plain[0] + inverted[0]
    forgot = analyse(client, dark, top_k=5)  # dark on light without Invert: the page says so
    assert "background looks light" in forgot[0] and "tick *Invert*" in forgot[0]


def test_page_speaks_plainly_with_a_model_card(server):
    page = httpx.get(server + "/").text
    assert "Does the prediction survive a turn?" in page
    config = httpx.get(server + "/config").json()
    texts = [c.get("props", {}).get("value") for c in config["components"]]
    details = next(t for t in texts if isinstance(t, str) and t.startswith("**The models.**"))
    for words in ("Ankle boot", "light object on a dark background", "Limits", "|grad tau|_inf"):
        assert words in details
    intro = next(t for t in texts if isinstance(t, str) and "survive a turn" in t)
    assert "tau" not in intro and "realisation" not in intro  # the maths stays in Details


def test_link_previews_name_the_app_and_the_link(server):
    """One set of Open Graph / Twitter tags, ours: the app's title and the address asked
    for, none of Gradio's ("Gradio", "{url}", remote pictures)."""
    page = httpx.get(server + "/?sample=4").text
    head = "\n".join(re.findall(r"<meta[^>]*>", page[: page.index("</head>")]))
    assert head.count('property="og:title"') == 1 and head.count('name="twitter:title"') == 1
    assert '<meta property="og:title" content="RST-CNN: prediction stability" />' in head
    assert f'<meta property="og:url" content="{server}/?sample=4" />' in head
    for theirs in ('content="Gradio"', "{url}", "gradio.app", "githubusercontent", "@Gradio"):
        assert theirs not in head, theirs
    assert int(httpx.get(server + "/").headers["content-length"]) == len(
        httpx.get(server + "/").content
    )


def test_the_page_lists_the_http_api(server):
    """The "Use via API" section names every /v1 route with its curl line; Gradio's own
    API panel (only its event endpoint, and an MCP schema that 404s) is not linked."""
    config = httpx.get(server + "/config").json()
    texts = [c.get("props", {}).get("value") for c in config["components"]]
    api = next(t for t in texts if isinstance(t, str) and "/v1/classify" in t and "curl" in t)
    for route in ("/healthz", "/v1/models", "/v1/classify", "/v1/stability", "/docs"):
        assert f"`{route}`" in api or f"({route})" in api, route
    assert config["footer_links"] == []
    info = httpx.get(server + "/gradio_api/info").json()
    returns = [r["label"] for r in info["named_endpoints"]["/analyse"]["returns"]]
    assert not any(label.startswith("value_") for label in returns), returns


def _confidences(label: dict) -> dict[str, float]:
    return {c["label"]: c["confidence"] for c in label["confidences"]}


def test_ui_reports_bad_input(client, tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not an image at all\n")
    with pytest.raises(AppError, match="not an image"):
        analyse(client, text)
    broken = tmp_path / "broken.png"
    good = tmp_path / "good.png"
    Image.fromarray(np.full((40, 40), 200, np.uint8)).save(good)
    broken.write_bytes(good.read_bytes()[:60])
    with pytest.raises(AppError, match="damaged or truncated"):
        analyse(client, broken)
    with pytest.raises(AppError, match="Upload an image"):
        analyse(client, None)
    assert client.predict(handle_file(str(good)), None, 1, False, api_name="/analyse")


def test_bounded_load_on_loopback(server, samples):
    result = run_load(server, samples[0].path.read_bytes(), clients=4, requests=24)
    assert result.failures == [] and len(result.latencies) == 24
    assert result.throughput > 0 and result.percentile(95) >= result.percentile(50) > 0
    with pytest.raises(ValueError, match="loopback"):
        run_load("http://192.0.2.1:80", b"", clients=1, requests=1)


def test_command_line_refuses_a_missing_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--model", str(tmp_path / "no.onnx"), "--port", str(_free_port())])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "no model at" in err and "export/to_onnx.py" in err


def test_command_line_refuses_a_port_in_use_before_loading_models(tmp_path, capsys, monkeypatch):
    """A second server on a taken port: one line saying so and what to do, exit 2, before
    the models load (which takes seconds), not a log that says it serves and then fails."""
    from rstcnn.serve import app as app_module

    monkeypatch.setattr(app_module, "build_app", lambda *a, **k: pytest.fail("models loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as done:
            main(["--model", str(tmp_path / "m.onnx"), "--port", str(port)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and "in use" in err and "--port" in err


def test_command_line_refuses_a_port_out_of_range_and_names_a_corrupt_checkpoint_once(
    tmp_path, capsys
):
    """--port 99999 is a usage error (not socket's OverflowError); a corrupt checkpoint is
    one line that names the file once and says what to do."""
    with pytest.raises(SystemExit) as done:
        main(["--port", "99999"])
    assert done.value.code == 2
    assert "--port must be 0 .. 65535, got 99999" in capsys.readouterr().err
    broken = tmp_path / "model.pt"
    broken.write_bytes(b"PK\x03\x04 cut off")
    with pytest.raises(SystemExit) as done:
        main(["--model", str(broken), "--port", "0"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "not a readable checkpoint" in err
    assert err.count(str(broken)) == 1 and "train again" in err


def test_drawing_is_inverted_and_flattened_on_white(tmp_path, samples, tmp_path_factory):
    """The Draw tab: dark strokes on a transparent canvas read as light strokes on black."""
    models = ModelSet(
        [Classifier.from_onnx(p) for p in tiny_onnx_models(tmp_path_factory.getbasetemp())]
    )
    pixels = grey(samples[6].path)
    strokes = Image.merge("LA", [Image.new("L", (56, 56), 0), Image.fromarray(pixels)])
    drawing = tmp_path / "drawing.png"
    strokes.save(drawing)
    steps = list(
        _analyse(
            models, SPEC, None, {"composite": {"path": str(drawing)}}, 3, False, "draw", [tmp_path]
        )
    )
    # labels first, then the sweeps as they land: rotation (both models) while scale runs,
    # rotation and scale while deformation runs, then all
    assert len(steps) == 4 and "(inverted)" in steps[-1][0]
    assert "rotation swept" in steps[1][0] and "now scale" in steps[1][0]
    assert "rotation, scale swept" in steps[2][0] and "now deformation" in steps[2][0]
    first, second = (models.display[name] for name in models.names)
    for names in (steps[1][3], steps[-1][3]):
        assert f"{first}:" in names and f"{second}:" in names  # both models' rotation
    assert "| ... | ... |" in steps[1][3] and "rescaled" not in steps[1][3]
    assert "rescaled" in steps[2][3] and "deformed" not in steps[2][3]
    assert "..." not in steps[-1][3] and "deformed" in steps[-1][3]
    waiting = [t.get_text() for ax in steps[1][4].axes for t in ax.texts]
    assert waiting == ["measuring...", "measuring..."]  # scale and deformation panels
    assert not any(ax.texts for ax in steps[-1][4].axes)
    # the staged sweeps join to the one-batch report the API answers
    drawn = decode_image(drawing.read_bytes(), invert=True)
    whole = measure_stability([clf for _, clf in models], drawn, spec=SPEC, names=models.names)
    whole = whole.to_dict()
    reports: list = []
    list(
        _analyse(
            models,
            SPEC,
            None,
            {"composite": {"path": str(drawing)}},
            3,
            False,
            "draw",
            [tmp_path],
            reports=reports,
        )
    )
    staged = reports[0].to_dict()
    for a, b in zip(staged["models"], whole["models"], strict=True):
        assert a["sweeps"].keys() == b["sweeps"].keys() and a["label"] == b["label"]
        for name in a["sweeps"]:
            assert a["sweeps"][name]["top1"] == b["sweeps"][name]["top1"]
            np.testing.assert_allclose(
                a["sweeps"][name]["probability"], b["sweeps"][name]["probability"], atol=1e-5
            )
    expected = models.get("cnn").predict(pixels, top_k=3)[0]
    assert steps[-1][2] == pytest.approx({p.label: p.score for p in expected}, abs=2e-3)
    with pytest.raises(gr.Error, match="Draw something first"):
        list(_analyse(models, SPEC, None, {"composite": None}, 3, False, "draw", [tmp_path]))


def test_stage_bench_times_the_sweep_both_ways(samples, tmp_path_factory):
    from rstcnn.serve.stage_bench import measure

    models = [Classifier.from_onnx(p) for p in tiny_onnx_models(tmp_path_factory.getbasetemp())]
    timed = measure(models, grey(samples[0].path), SPEC)
    assert 0 < timed["rotation_shown_s"] < timed["staged_s"] and timed["one_batch_s"] > 0


def test_model_cards_name_the_engine_each_model_runs_on(tmp_path_factory):
    """The details' model cards say what computes each model: onnxruntime for a file, eager
    torch (and its precision) for a checkpoint."""
    from rstcnn.serve.app import _details

    files = [Classifier.from_onnx(p) for p in tiny_onnx_models(tmp_path_factory.getbasetemp())]
    eager = files[1]  # as serve.eager labels a checkpoint it runs
    eager.providers = ["torch-int8"]
    eager.metadata["rstcnn.precision"] = "int8"
    text = _details(ModelSet([files[0], eager]), SPEC)
    cards = [line for line in text.splitlines() if line.startswith("- **")]
    assert len(cards) == 2
    assert "runs in float32 (onnxruntime)" in cards[0]
    assert "runs in int8 (eager torch)" in cards[1]
