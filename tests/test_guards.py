"""What an attacker tried against the server, each through the real HTTP server: no file read
through the web page's event, no request for another host, no input that costs gigabytes,
no queue without bound, no slow client held forever, the documented status codes and error
shape, security headers, CORS only where asked for."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from serving import live_server

from rstcnn.serve import Classifier, probes
from rstcnn.serve.api import Limits
from rstcnn.serve.app import build_app
from rstcnn.serve.guards import Gate, allowed_hosts
from rstcnn.serve.loadtest import chunked_upload, run_plan, soak_plan, start_server
from rstcnn.serve.stability import SweepSpec
from rstcnn.serve.uploads import UploadError, read_uploaded

SPEC = SweepSpec(rotation_steps=4, scale_steps=3, deformation_steps=2)


@pytest.fixture(scope="module")
def real_server(model_paths, samples, tmp_path_factory) -> Iterator[tuple[str, int, Path]]:
    """``python serve/app.py`` as a user starts it -> (URL, its PID, its Gradio cache)."""
    cache = tmp_path_factory.mktemp("gradio-cache")
    env = {**os.environ, "GRADIO_TEMP_DIR": str(cache)}
    extra = ["--samples-dir", str(samples[0].path.parent), "--threads", "1"]
    process, url = start_server([str(m) for m in model_paths], extra=extra, env=env)
    try:
        yield url, process.pid, cache
    finally:
        process.terminate()
        process.wait(30)


# ---------------------------------------------------------------- 1. file read through the UI


def _ui_call(url: str, path: str) -> str:
    """The web page's event with a file payload naming ``path`` -> the event stream."""
    payload = {"path": path, "meta": {"_type": "gradio.FileData"}}
    started = httpx.post(
        f"{url}/gradio_api/call/analyse", json={"data": [payload, None, 3, False, "upload"]}
    )
    assert started.status_code == 200, started.text
    event = started.json()["event_id"]
    return httpx.get(f"{url}/gradio_api/call/analyse/{event}", timeout=20).text


def test_the_page_event_opens_no_file_it_did_not_upload(real_server, samples, tmp_path):
    url, _, cache = real_server
    secret = tmp_path / "secret.png"
    shutil.copy(samples[0].path, secret)
    missing = tmp_path / "missing.png"
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)  # opening it to read would block until a writer came
    answers = {}
    for name, path in (("secret", secret), ("missing", missing), ("fifo", fifo)):
        start = time.monotonic()
        answers[name] = _ui_call(url, str(path)).replace(str(path), "<path>")
        assert time.monotonic() - start < 15
        assert "event: error" in answers[name] and "T-shirt" not in answers[name], answers[name]
    # the same answer whether the file exists or not: no oracle
    assert answers["secret"] == answers["missing"] == answers["fifo"]
    assert "not uploaded" in answers["secret"]
    with pytest.raises(OSError) as nobody:  # no process holds the FIFO open for reading
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert nobody.value.errno == errno.ENXIO
    assert "event: error" in _ui_call(url, "/dev/zero")
    assert not [p for p in cache.rglob("*") if p.name == "secret.png"]  # nothing copied
    assert httpx.get(f"{url}/healthz").status_code == 200


def test_read_uploaded_allows_only_regular_files_inside_its_folders(tmp_path, samples):
    inside, outside = tmp_path / "uploads", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    good = inside / "a.png"
    shutil.copy(samples[0].path, good)
    assert read_uploaded(good, [inside]) == samples[0].path.read_bytes()
    secret = outside / "secret.png"
    shutil.copy(samples[0].path, secret)
    link = inside / "link.png"
    link.symlink_to(secret)  # a link inside that leads outside
    fifo = inside / "pipe.png"
    os.mkfifo(fifo)
    for path in (secret, link, inside / ".." / "elsewhere" / "secret.png", fifo, "/dev/zero"):
        with pytest.raises(UploadError) as refused:
            read_uploaded(path, [inside])
        assert refused.value.status == 403, path
    big = inside / "big.png"
    big.write_bytes(bytes(2048))
    with pytest.raises(UploadError) as large:
        read_uploaded(big, [inside], limit=1024)
    assert large.value.status == 413


# ---------------------------------------------------------------- Host header


def test_requests_for_another_host_are_refused(real_server):
    url, _, _ = real_server
    port = url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", "localhost.evil.example"):
        for path in ("/healthz", "/", "/gradio_api/info"):
            answer = httpx.get(url + path, headers={"host": host})
            assert answer.status_code == 400, (host, path)
            assert "--allowed-host" in answer.json()["detail"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
        assert httpx.get(url + "/healthz", headers={"host": host}).status_code == 200


def test_allowed_hosts_follow_the_bind_address():
    assert allowed_hosts("127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert "192.0.2.7" in allowed_hosts("192.0.2.7")
    wildcard = allowed_hosts("0.0.0.0", ["Example.org"])
    assert {"example.org", socket.gethostname().lower()} <= wildcard


# ---------------------------------------------------------------- 2 and 3. costly inputs


def _peak_growth(pid: int, request) -> tuple[httpx.Response, float]:
    """(answer, growth of the server's peak resident memory in MiB) of one request."""

    def peak() -> int:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak := current
    before = peak()
    answer = request()
    return answer, (peak() - before) / 1024


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("40,000,000 x 1 PNG", 200),  # pad after resizing: a valid, cheap image
        ("20,000 x 10 PNG", 200),
        ("6,000 x 6,000 PNG", 200),
        ("ICO claiming 16x16 holding 13,000 x 13,000", 415),
        ("GIF claiming 16x16 with an 8,000 x 8,000 frame", 413),
        ("PNG header claiming 100 megapixels", 413),
    ],
)
def test_costly_inputs_stay_under_a_memory_ceiling(real_server, name, status):
    url, pid, _ = real_server
    data = {
        "40,000,000 x 1 PNG": lambda: probes.png_zeros(40_000_000, 1),
        "20,000 x 10 PNG": lambda: probes.png_zeros(20_000, 10),
        "6,000 x 6,000 PNG": lambda: probes.png_zeros(6_000, 6_000),
        "ICO claiming 16x16 holding 13,000 x 13,000": probes.lying_ico,
        "GIF claiming 16x16 with an 8,000 x 8,000 frame": probes.lying_gif,
        "PNG header claiming 100 megapixels": lambda: probes.png_header(10_000, 10_000),
    }[name]()
    answer, grown = _peak_growth(
        pid,
        lambda: httpx.post(
            f"{url}/v1/classify", files={"image": ("x", data, "image/png")}, timeout=60
        ),
    )
    assert answer.status_code == status, answer.text
    assert grown < 200, f"{name}: the server's peak grew by {grown:.0f} MiB"
    if status != 200:
        assert isinstance(answer.json()["detail"], str)


# ---------------------------------------------------------------- 4. bounded queues


class Held:
    """A classifier whose batches of more than one image wait for ``release``."""

    def __init__(self, inner: Classifier):
        self.inner = inner
        self.release = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def run_logits(self, batch: np.ndarray) -> np.ndarray:
        if batch.shape[0] > 1:
            self.entered.set()
            assert self.release.wait(30)
        return self.inner.run_logits(batch)


def test_sweeps_beyond_the_queue_get_503_and_classification_goes_on(model_paths, samples):
    held = Held(Classifier.from_onnx(model_paths[1], threads=1))
    app = build_app(
        [held],
        samples_dir=samples[0].path.parent,
        spec=SPEC,
        limits=Limits(sweeps=1, sweep_queue=0),
    )
    png = samples[0].path.read_bytes()
    with live_server(app) as url:
        first: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: first.append(
                httpx.post(f"{url}/v1/stability", files={"image": ("a.png", png)}, timeout=60)
            )
        )
        worker.start()
        try:
            assert held.entered.wait(30)
            busy = httpx.post(f"{url}/v1/stability", files={"image": ("a.png", png)})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "5"
            assert "busy" in busy.json()["detail"]
            quick = httpx.post(f"{url}/v1/classify", files={"image": ("a.png", png)})
            assert quick.status_code == 200
        finally:
            held.release.set()
            worker.join(60)
        assert first[0].status_code == 200


def test_gate_bounds_running_and_waiting():
    gate = Gate("test", running=1, waiting=1, wait=0.2)
    inside = threading.Event()
    leave = threading.Event()

    def hold() -> None:
        with gate.enter():
            inside.set()
            leave.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    with pytest.raises(RuntimeError, match="no test slot"), gate.enter():  # 0.2 s, then no
        pass
    leave.set()
    holder.join(5)
    with gate.enter():
        assert gate.admitted == 1
    assert gate.admitted == 0


def test_a_gate_is_quiet_only_when_nobody_has_been_inside_for_a_while():
    import time

    gate = Gate("test", running=2, waiting=2)
    assert gate.quiet_for(3600)  # never entered
    with gate.enter():
        assert not gate.quiet_for(0.0)  # someone inside
    assert gate.quiet_for(0.0) and not gate.quiet_for(0.5)  # just left
    time.sleep(0.2)
    assert gate.quiet_for(0.1) and not gate.quiet_for(5.0)


def test_background_work_enters_only_an_idle_gate():
    gate = Gate("test", running=1, waiting=4)
    with gate.enter_if_idle():
        assert gate.admitted == 1
    with gate.enter(), pytest.raises(RuntimeError, match="running"), gate.enter_if_idle():
        pass
    assert gate.admitted == 0


def test_long_inputs_run_in_chunks_of_max_batch(model_paths):
    clf = Classifier.from_onnx(model_paths[1], threads=1, max_batch=8)
    sizes: list[int] = []
    inner = clf._run
    clf._run = lambda batch: sizes.append(batch.shape[0]) or inner(batch)
    probs = clf.predict_proba(np.zeros((20, 56, 56, 1), np.uint8))
    assert probs.shape == (20, 10) and sizes == [8, 8, 4]
    with pytest.raises(ValueError, match="max_batch"):
        Classifier.from_onnx(model_paths[1], max_batch=0)


# ---------------------------------------------------------------- 5. slow clients


@pytest.fixture(scope="module")
def quick_deadlines(model_paths, samples) -> Iterator[str]:
    app = build_app(model_paths, samples_dir=samples[0].path.parent, spec=SPEC, threads=1)
    with live_server(app, head_timeout=1.0, body_timeout=1.5) as url:
        yield url


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_clients_are_cut_off(quick_deadlines):
    url = quick_deadlines
    stalled = []
    start = time.monotonic()
    for i in range(8):
        sock = _connect(url)
        if i % 2:  # half a request head
            sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        else:  # a head and part of the body it announced
            sock.sendall(
                b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: "
                b"multipart/form-data; boundary=x\r\ncontent-length: 1000\r\n\r\n--x\r\n"
            )
        stalled.append(sock)
    idle = _connect(url)  # says nothing at all
    answers = [_read_all(sock) for sock in stalled]
    assert _read_all(idle) == b""
    assert time.monotonic() - start < 6  # deadlines 1 s and 1.5 s, not forever
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert b'"detail"' in answer
    for sock in [*stalled, idle]:
        sock.close()
    # a request that arrives in pieces but in time is answered
    sock = _connect(url)
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    time.sleep(0.3)
    sock.sendall(b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert _read_all(sock).startswith(b"HTTP/1.1 200")
    sock.close()


# ---------------------------------------------------------------- 6. the smaller items


def test_chunked_body_over_the_limit_gets_413(quick_deadlines):
    answer = httpx.post(
        f"{quick_deadlines}/v1/classify",
        content=chunked_upload(22 << 20),  # a well-formed form, no Content-Length
        headers={"content-type": "multipart/form-data; boundary=rstcnn-soak"},
        timeout=30,
    )
    assert answer.status_code == 413
    assert "MiB" in answer.json()["detail"]


@pytest.fixture(scope="module")
def client(model_paths, samples) -> TestClient:
    app = build_app(model_paths, samples_dir=samples[0].path.parent, spec=SPEC, threads=1)
    return TestClient(app, base_url="http://127.0.0.1")


def test_every_error_detail_is_a_string(client, samples):
    png = samples[0].path.read_bytes()
    for answer in (
        client.post("/v1/classify", data={"top_k": "3"}),  # no image
        client.post("/v1/classify", files={"image": ("a.png", png)}, data={"top_k": "0"}),
        client.post("/v1/classify", files={"image": ("a.png", png)}, data={"top_k": "x"}),
    ):
        assert answer.status_code == 422
        assert isinstance(answer.json()["detail"], str)
    assert "top_k" in answer.json()["detail"]
    nan = client.post("/v1/classify", files={"image": ("a.tif", probes.nan_tiff())})
    assert nan.status_code == 422 and "NaN" in nan.json()["detail"]


def test_security_headers_on_pages_answers_and_errors(client):
    for answer in (client.get("/"), client.get("/v1/models"), client.post("/v1/classify")):
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]


def test_cors_only_for_named_origins(client, model_paths, samples):
    for origin in ("http://localhost:5555", "http://127.0.0.1:9999", "null", "https://evil.test"):
        simple = client.get("/healthz", headers={"origin": origin})
        assert "access-control-allow-origin" not in simple.headers
        assert "access-control-allow-credentials" not in simple.headers
        preflight = client.options(
            "/gradio_api/info",
            headers={"origin": origin, "access-control-request-method": "POST"},
        )
        assert "access-control-allow-origin" not in preflight.headers
    named = build_app(
        model_paths, samples_dir=samples[0].path.parent, cors_origins=["https://app.example.org"]
    )
    answer = TestClient(named, base_url="http://127.0.0.1").get(
        "/healthz", headers={"origin": "https://app.example.org"}
    )
    assert answer.headers["access-control-allow-origin"] == "https://app.example.org"


def test_metadata_that_contradicts_the_graph_is_refused(model_paths, tmp_path):
    model = onnx.load(str(model_paths[1]))
    for prop in model.metadata_props:
        if prop.key == "rstcnn.input_size":
            prop.value = json.dumps([1, 5000, 5000])
    bad = tmp_path / "bad.onnx"
    onnx.save(model, str(bad))
    with pytest.raises(ValueError, match="contradicts"):
        Classifier.from_onnx(bad)


# ---------------------------------------------------------------- the soak, small


def test_a_small_soak_answers_every_request_right(real_server, samples):
    url, _, _ = real_server
    plan = soak_plan(samples[0].path.read_bytes(), 60, seed=1)
    assert {p.valid for p in plan} == {True, False}
    result = run_plan(url, plan, clients=4)
    assert result.failures == [], result.report()
    assert sum(result.counts.values()) == 60


def test_the_load_test_says_when_no_server_answers_at_its_url(capsys):
    """--url at a port where nothing listens: one line naming the URL and what to do, exit 2,
    not a run of connection errors reported as a load test."""
    from rstcnn.serve import loadtest

    url = f"http://127.0.0.1:{loadtest._free_port()}"  # a port that was free a moment ago
    assert loadtest.main(["--url", url, "--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert f"no server answers at {url}" in err and "scripts/demo.sh" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--url", "notaurl"], "--url must be an http:// address"),
        (["--url", "http://example.org:7860"], "only targets loopback addresses"),
        (["--url", "http://127.0.0.1:9", "--clients", "0"], "--clients and --requests must be"),
        (["--url", "http://127.0.0.1:9", "--image", "/no/such.png"], "no such file"),
    ],
)
def test_the_load_test_refuses_bad_arguments_before_it_starts_anything(argv, says, capsys):
    """A URL that is not an http loopback address, no clients, a missing image: a usage
    error (exit 2) naming the argument, before any server or client starts."""
    from rstcnn.serve import loadtest

    with pytest.raises(SystemExit) as done:
        loadtest.main(argv)
    assert done.value.code == 2
    assert says in capsys.readouterr().err
