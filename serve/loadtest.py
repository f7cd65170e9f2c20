"""A bounded load test of ``POST /v1/classify`` on loopback.

    python -m serve.loadtest --clients 8 --requests 400 [--url http://127.0.0.1:7860]
                             [--model M.onnx ...] [--image PNG] [--endpoint classify]

Without ``--url`` it starts ``python serve/app.py`` on a free loopback port with the given
models (default: the shipped ones), waits for ``/healthz``, and stops it afterwards.
``clients`` threads, each with its own HTTP connection, send exactly ``requests`` requests
in total, one at a time each; the report gives throughput, p50 / p95 / max latency and
every failure (non-200 answer, malformed body or transport error). Exit status 1 when any
request failed. Only loopback addresses are accepted as targets.
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import itertools
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

__all__ = ["LoadResult", "run_load", "start_server", "main"]

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class LoadResult:
    clients: int
    requests: int
    seconds: float
    latencies: list[float]  # seconds, successful requests
    failures: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    def report(self) -> str:
        ms = [1000 * self.percentile(q) for q in (50, 95, 100)]
        lines = [
            f"clients {self.clients}, requests {self.requests}, "
            f"ok {len(self.latencies)}, failed {len(self.failures)}",
            f"wall {self.seconds:.2f} s, throughput {self.throughput:.1f} req/s",
            f"latency p50 {ms[0]:.1f} ms, p95 {ms[1]:.1f} ms, max {ms[2]:.1f} ms",
        ]
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
    _check_loopback(url)
    if clients < 1 or requests < 1:
        raise ValueError(f"need clients >= 1 and requests >= 1, got {clients}, {requests}")
    tickets = itertools.count()
    lock = threading.Lock()
    latencies: list[float] = []
    failures: list[str] = []
    target = url.rstrip("/") + endpoint

    def client() -> None:
        with httpx.Client(timeout=timeout) as session:
            while True:
                with lock:
                    ticket = next(tickets)
                if ticket >= requests:
                    return
                start = time.perf_counter()
                try:
                    answer = session.post(
                        target, files={"image": ("load.png", image, "image/png")}, data=data
                    )
                    elapsed = time.perf_counter() - start
                    body = answer.json()
                    ok = answer.status_code == 200 and ("predictions" in body or "models" in body)
                    problem = None if ok else f"HTTP {answer.status_code}: {str(body)[:200]}"
                except (httpx.HTTPError, ValueError) as err:
                    elapsed, problem = time.perf_counter() - start, f"{type(err).__name__}: {err}"
                with lock:
                    if problem is None:
                        latencies.append(elapsed)
                    else:
                        failures.append(problem)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return LoadResult(clients, requests, time.perf_counter() - start, latencies, failures)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    models: Sequence[str] | None, *, extra: Sequence[str] = (), wait: float = 180.0
) -> tuple[subprocess.Popen, str]:
    """``python serve/app.py`` on a free loopback port; returns (process, base URL) once
    ``/healthz`` answers. Raises RuntimeError if it exits or does not answer in time."""
    port = _free_port()
    command = [sys.executable, str(REPO_ROOT / "serve" / "app.py"), "--port", str(port), *extra]
    for model in models or ():
        command += ["--model", model]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
    """A real gallery image if the app wrote one, else a synthetic blob."""
    from rstmodel.data import default_cache_dir

    folder = default_cache_dir() / "app" / "samples"
    found = sorted(folder.glob("sample_*.png"))
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
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--url", help="a running server on loopback (default: start one)")
    parser.add_argument("--model", action="append", help="ONNX model for the started server")
    parser.add_argument("--image", help="PNG/JPEG to send (default: a gallery image)")
    parser.add_argument("--endpoint", choices=["classify", "stability"], default="classify")
    parser.add_argument("--threads", type=int, help="onnxruntime threads per model (server)")
    args = parser.parse_args(argv)

    image = Path(args.image).read_bytes() if args.image else _default_image()
    process = None
    url = args.url
    if url is None:
        extra = ["--threads", str(args.threads)] if args.threads else []
        process, url = start_server(args.model, extra=extra)
    try:
        _check_loopback(url)
        # one warm-up request (session start, first allocation) outside the measurement
        run_load(url, image, clients=1, requests=1, endpoint=f"/v1/{args.endpoint}")
        result = run_load(
            url,
            image,
            clients=args.clients,
            requests=args.requests,
            endpoint=f"/v1/{args.endpoint}",
        )
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    cores = os.cpu_count()
    print(f"POST {url}/v1/{args.endpoint} ({platform.machine()}, {cores} CPU cores)")
    print(result.report())
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
