"""A bounded load test and soak of the HTTP API on loopback.

    python -m serve.loadtest --clients 8 --requests 400 [--url http://127.0.0.1:7860]
                             [--model M.onnx ...] [--image PNG] [--endpoint classify]
    python -m serve.loadtest --soak [--requests 1000] [--max-rss-gb 3]

Without ``--url`` it starts ``python serve/app.py`` on a free loopback port with the given
models (default: the shipped ones), waits for ``/healthz``, and stops it afterwards.
``clients`` threads, each with its own HTTP connection, send exactly ``requests`` requests
in total, one at a time each; the report gives throughput, p50 / p95 / max latency and
every failure: a valid request not answered 200 with a well-formed body, or a bad one not
answered with its expected 4xx. Exit status 1 when any request failed (or, in a soak, when
the server grew past ``--max-rss-gb``). Only loopback addresses are accepted as targets.

``--soak`` mixes classification (80 %), stability sweeps (4 %, of the image mirrored, so
that the server sweeps it rather than answering from its gallery cache) and bad or hostile uploads
(16 %: empty, text, truncated, a decompression-bomb header, an ICO and a GIF whose
headers lie, a NaN TIFF, a 40,000,000 x 1 PNG, bodies over the limit, declared and
chunked, a forged ``Host``, an unknown model, a bad field) in a seeded order, and samples
the server's resident memory (when it started the server) every 0.25 s.
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import itertools
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

from rstcnn.serve import probes

__all__ = ["LoadResult", "Probe", "RssSampler", "run_load", "run_plan", "soak_plan", "main"]

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Probe:
    """One kind of request: ``expect`` holds the statuses that count as right (200 for a
    valid request, whose body must also hold the answer); ``body`` is sent as the
    multipart ``image`` file, ``chunked`` as a streamed raw body instead."""

    name: str
    endpoint: str
    expect: tuple[int, ...] = (200,)
    body: bytes | None = None
    data: dict[str, str] | None = None
    headers: dict[str, str] | None = None
    chunked: int = 0  # bytes of a streamed (chunked) body

    @property
    def valid(self) -> bool:
        return 200 in self.expect


@dataclass
class LoadResult:
    clients: int
    requests: int
    seconds: float
    latencies: list[float]  # seconds, valid requests answered right
    failures: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # (probe, status) -> requests

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    def report(self) -> str:
        ms = [1000 * self.percentile(q) for q in (50, 95, 100)]
        lines = [
            f"clients {self.clients}, requests {self.requests}, "
            f"ok {self.requests - len(self.failures)}, failed {len(self.failures)}",
            f"wall {self.seconds:.2f} s, valid answered {len(self.latencies)}, "
            f"{self.throughput:.1f} req/s",
            f"latency (valid) p50 {ms[0]:.1f} ms, p95 {ms[1]:.1f} ms, max {ms[2]:.1f} ms",
        ]
        if len({name for name, _ in self.counts}) > 1:
            lines.append(
                "answers: "
                + ", ".join(f"{n} {st}: {c}" for (n, st), c in sorted(self.counts.items()))
            )
        lines += [f"failure: {f}" for f in self.failures[:10]]
        return "\n".join(lines)


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"the load test only targets loopback addresses, not {host!r}")


def _answers(url: str) -> bool:
    """Whether a server answers ``GET /healthz`` at ``url`` (any status: it is there)."""
    try:
        httpx.get(f"{url.rstrip('/')}/healthz", timeout=10.0)
    except httpx.TransportError:
        return False
    return True


def run_load(
    url: str,
    image: bytes,
    *,
    clients: int,
    requests: int,
    endpoint: str = "/v1/classify",
    data: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> LoadResult:
    """Send ``requests`` POSTs of ``image`` from ``clients`` threads; bounded in count and
    by ``timeout`` per request."""
    name = endpoint.rsplit("/", 1)[-1]
    plan = [Probe(name, endpoint, body=image, data=data)] * max(requests, 0)
    return run_plan(url, plan, clients=clients, timeout=timeout)


def run_plan(
    url: str, plan: Sequence[Probe], *, clients: int, timeout: float = 120.0
) -> LoadResult:
    """Send every request of ``plan`` once, in order, from ``clients`` threads."""
    _check_loopback(url)
    if clients < 1 or not plan:
        raise ValueError(f"need clients >= 1 and requests >= 1, got {clients}, {len(plan)}")
    tickets = itertools.count()
    lock = threading.Lock()
    result = LoadResult(clients, len(plan), 0.0, [])
    base = url.rstrip("/")

    def client() -> None:
        with httpx.Client(timeout=timeout) as session:
            while True:
                with lock:
                    ticket = next(tickets)
                if ticket >= len(plan):
                    return
                probe = plan[ticket]
                start = time.perf_counter()
                try:
                    status, problem = _send(session, base, probe)
                except httpx.HTTPError as err:
                    status, problem = "error", f"{probe.name}: {type(err).__name__}: {err}"
                elapsed = time.perf_counter() - start
                with lock:
                    result.counts[(probe.name, status)] += 1
                    if problem is not None:
                        result.failures.append(problem)
                    elif probe.valid:
                        result.latencies.append(elapsed)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.perf_counter() - start
    return result


def _send(session: httpx.Client, base: str, probe: Probe) -> tuple[int, str | None]:
    """One request -> (status, problem or None)."""
    target = base + probe.endpoint
    if probe.chunked:
        answer = session.post(
            target,
            content=chunked_upload(probe.chunked),
            headers={"content-type": f"multipart/form-data; boundary={_BOUNDARY}"},
        )
    else:
        files = (
            {"image": ("probe.png", probe.body, "image/png")} if probe.body is not None else None
        )
        answer = session.post(target, files=files, data=probe.data, headers=probe.headers)
    try:
        body = answer.json()
    except ValueError:
        return answer.status_code, f"{probe.name}: HTTP {answer.status_code}, not JSON"
    if answer.status_code not in probe.expect:
        return answer.status_code, (
            f"{probe.name}: HTTP {answer.status_code} (expected {probe.expect}): {str(body)[:160]}"
        )
    if probe.valid and not ("predictions" in body or "models" in body):
        return answer.status_code, f"{probe.name}: malformed answer {str(body)[:160]}"
    if not probe.valid and not isinstance(body.get("detail"), str):
        return answer.status_code, f"{probe.name}: error without a string detail: {body}"
    return answer.status_code, None


_BOUNDARY = "rstcnn-soak"


def chunked_upload(size: int) -> Iterator[bytes]:
    """A well-formed multipart body with an ``image`` file of ``size`` bytes, streamed in
    1 MiB pieces (sent with chunked transfer encoding: no Content-Length up front)."""
    yield (
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="big.png"'
        "\r\nContent-Type: image/png\r\n\r\n"
    ).encode()
    piece = bytes(1 << 20)
    for start in range(0, size, len(piece)):
        yield piece[: min(len(piece), size - start)]
    yield f"\r\n--{_BOUNDARY}--\r\n".encode()


def soak_probes(image: bytes) -> tuple[list[Probe], list[Probe], list[Probe]]:
    """(classification, stability, bad and hostile) probes around one valid ``image``."""
    over = bytes(22 << 20)  # past the 21 MiB request limit
    default = Probe("classify", "/v1/classify", body=image)
    cnn = Probe("classify-cnn", "/v1/classify", body=image, data={"model": "cnn", "top_k": "3"})
    long = Probe("classify-40Mx1", "/v1/classify", body=probes.png_zeros(40_000_000, 1))
    classify = [default] * 4 + [cnn] * 3 + [long]
    stability = [Probe("stability", "/v1/stability", body=_mirrored(image))]
    bad = [
        Probe("empty", "/v1/classify", (400,), body=b""),
        Probe("text", "/v1/classify", (415,), body=b"not an image\n" * 20),
        Probe("truncated", "/v1/classify", (422,), body=image[: len(image) // 2]),
        Probe("bomb-header", "/v1/classify", (413,), body=probes.png_header(10_000, 10_000)),
        Probe("lying-ico", "/v1/classify", (415,), body=probes.lying_ico()),
        Probe("lying-gif", "/v1/stability", (413,), body=probes.lying_gif()),
        Probe("nan-tiff", "/v1/classify", (422,), body=probes.nan_tiff()),
        Probe("over-limit", "/v1/classify", (413,), body=over),
        Probe("over-limit-chunked", "/v1/classify", (413,), chunked=len(over)),
        Probe("forged-host", "/v1/classify", (400,), body=image, headers={"host": "evil.test"}),
        Probe("unknown-model", "/v1/stability", (404,), body=image, data={"model": "nope"}),
        Probe("bad-field", "/v1/classify", (422,), body=image, data={"top_k": "0"}),
    ]
    return classify, stability, bad


def _mirrored(image: bytes) -> bytes:
    """``image`` mirrored left to right, as PNG: not a gallery image, so the server sweeps
    it instead of answering from the sweeps it made at start-up."""
    from PIL import Image, ImageOps

    buffer = io.BytesIO()
    ImageOps.mirror(Image.open(io.BytesIO(image))).save(buffer, format="PNG")
    return buffer.getvalue()


def soak_plan(image: bytes, requests: int, *, seed: int = 0) -> list[Probe]:
    """``requests`` probes: 80 % classification, 4 % sweeps, 16 % bad, seeded order."""
    classify, stability, bad = soak_probes(image)
    rng = random.Random(seed)
    plan = []
    for _ in range(requests):
        draw = rng.random()
        pool = classify if draw < 0.80 else stability if draw < 0.84 else bad
        plan.append(rng.choice(pool))
    return plan


class RssSampler:
    """Samples a process's resident memory (``/proc/PID/status``) every ``every`` s."""

    def __init__(self, pid: int, every: float = 0.25):
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int]] = []  # (seconds, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - start, self.rss()))
            except (OSError, RuntimeError):
                return
            self._stop.wait(self.every)

    @contextmanager
    def running(self) -> Iterator[RssSampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(5)

    def summary(self) -> dict[str, float]:
        values = np.array([v for _, v in self.samples], dtype=np.float64) / 2**30
        if values.size == 0:
            return {}
        tenth = max(1, values.size // 10)
        return {
            "start_gib": float(values[0]),
            "max_gib": float(values.max()),
            "first_tenth_max_gib": float(values[:tenth].max()),
            "last_tenth_max_gib": float(values[-tenth:].max()),
            "end_gib": float(values[-1]),
        }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    models: Sequence[str] | None,
    *,
    extra: Sequence[str] = (),
    wait: float = 180.0,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """``python serve/app.py`` on a free loopback port (``env``: its environment, default
    this one's); returns (process, base URL) once ``/healthz`` answers. Raises RuntimeError
    if it exits or does not answer in time."""
    port = _free_port()
    command = [sys.executable, str(REPO_ROOT / "serve" / "app.py"), "--port", str(port), *extra]
    for model in models or ():
        command += ["--model", model]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.terminate()
    raise RuntimeError(f"the server did not answer /healthz within {wait:.0f} s")


def _default_image() -> bytes:
    """The shipped gallery's first real test image, else a synthetic blob."""
    from rstcnn.serve.samples import GALLERY

    found = sorted(GALLERY.glob("sample_*.png"))
    if found:
        return found[0].read_bytes()
    from PIL import Image

    yy, xx = np.mgrid[:56, :56]
    blob = 255 * np.exp(-((xx - 30) ** 2 / 60 + (yy - 26) ** 2 / 200))
    buffer = io.BytesIO()
    Image.fromarray(blob.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, help="default 200; with --soak 1000")
    parser.add_argument("--url", help="a running server on loopback (default: start one)")
    parser.add_argument("--model", action="append", help="ONNX model for the started server")
    parser.add_argument("--image", help="PNG/JPEG to send (default: a gallery image)")
    parser.add_argument("--endpoint", choices=["classify", "stability"], default="classify")
    parser.add_argument("--threads", type=int, help="onnxruntime threads per model (server)")
    parser.add_argument("--soak", action="store_true", help="mixed valid, bad and hostile load")
    parser.add_argument("--seed", type=int, default=0, help="order of the soak's requests")
    parser.add_argument(
        "--max-rss-gb", type=float, default=3.0, help="soak: fail when the server grows past it"
    )
    args = parser.parse_args(argv)
    requests = args.requests or (1000 if args.soak else 200)
    if args.clients < 1 or requests < 1:
        parser.error(f"--clients and --requests must be >= 1, got {args.clients} and {requests}")
    if args.url is not None:
        if urlparse(args.url).scheme not in ("http", "https"):
            parser.error(
                f"--url must be an http:// address, e.g. http://127.0.0.1:7860, got {args.url!r}"
            )
        try:
            _check_loopback(args.url)
        except ValueError as err:
            parser.error(str(err))
    if args.image and not Path(args.image).is_file():
        parser.error(f"--image {args.image}: no such file")

    image = Path(args.image).read_bytes() if args.image else _default_image()
    process = None
    url = args.url
    if url is None:
        extra = ["--threads", str(args.threads)] if args.threads else []
        process, url = start_server(args.model, extra=extra)
    sampler = RssSampler(process.pid) if process is not None and args.soak else None
    try:
        _check_loopback(url)
        if process is None and not _answers(url):
            print(
                f"error: no server answers at {url} (start one with `bash scripts/demo.sh`, or "
                "leave out --url and the load test starts its own)",
                file=sys.stderr,
            )
            return 2
        if args.soak:
            plan = soak_plan(image, requests, seed=args.seed)
            classify, stability, _ = soak_probes(image)
            run_plan(url, [*{p.name: p for p in classify}.values(), *stability], clients=1)
            if sampler is None:
                result = run_plan(url, plan, clients=args.clients)
            else:
                with sampler.running():
                    result = run_plan(url, plan, clients=args.clients)
        else:
            # one warm-up request (session start, first allocation) outside the measurement
            endpoint = f"/v1/{args.endpoint}"
            run_load(url, image, clients=1, requests=1, endpoint=endpoint)
            result = run_load(
                url, image, clients=args.clients, requests=requests, endpoint=endpoint
            )
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    cores = os.cpu_count()
    what = "soak (mixed)" if args.soak else f"POST /v1/{args.endpoint}"
    print(f"{what} {url} ({platform.machine()}, {cores} CPU cores)")
    print(result.report())
    failed = bool(result.failures)
    if sampler is not None:
        memory = sampler.summary()
        print(
            "server RSS (GiB): "
            + ", ".join(f"{k.removesuffix('_gib')} {v:.2f}" for k, v in memory.items())
            + f"; ceiling {args.max_rss_gb:g}"
        )
        if memory and memory["max_gib"] > args.max_rss_gb:
            print(f"FAILED: the server grew past {args.max_rss_gb:g} GiB")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
