"""onnxruntime's CPU memory arena on and off, in one run: time and resident memory of a
stability-sweep-sized batch through an exported model.

    python -m serve.arena_bench [--model models/rst_cnn_fb.onnx] [--batch 43] [--runs 3]

Each setting runs in a fresh process (so neither inherits the other's heap): it loads the
model with ``Classifier.from_onnx(memory_arena=...)``, runs ``--runs`` batches and reports
the median time, the peak resident memory (VmHWM) and the resident memory after the last
run (VmRSS), in GiB. Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _status() -> dict[str, float]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}


def measure(model: str, batch: int, runs: int, arena: bool) -> dict[str, float]:
    """In this process: median seconds per batch, peak and final resident GiB."""
    import numpy as np

    from serve import Classifier

    clf = Classifier.from_onnx(model, memory_arena=arena, max_batch=batch)
    images = np.random.default_rng(0).random((batch, *clf.input_size), dtype=np.float32)
    loaded = _status()["VmRSS"]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        clf.run_logits(images)
        times.append(time.perf_counter() - start)
    after = _status()
    return {
        "seconds": float(np.median(times)),
        "loaded_gib": loaded,
        "peak_gib": after["VmHWM"],
        "after_gib": after["VmRSS"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "rst_cnn_fb.onnx"))
    parser.add_argument("--batch", type=int, default=43, help="images per run (a sweep: 43)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--arena", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arena:  # the child: one setting, JSON on stdout
        print(json.dumps(measure(args.model, args.batch, args.runs, args.arena == "on")))
        return 0
    results = {}
    for arena in ("on", "off"):
        command = [sys.executable, "-m", "serve.arena_bench", "--arena", arena]
        command += ["--model", args.model, "--batch", str(args.batch), "--runs", str(args.runs)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, check=True)
        results[arena] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{Path(args.model).name}, batch {args.batch}, {args.runs} runs ({platform.machine()})")
    print("| arena | s / batch | RSS loaded GiB | peak GiB | RSS after GiB |")
    print("|---|---|---|---|---|")
    for arena, r in results.items():
        print(
            f"| {arena} | {r['seconds']:.2f} | {r['loaded_gib']:.2f} | {r['peak_gib']:.2f} "
            f"| {r['after_gib']:.2f} |"
        )
    on, off = results["on"], results["off"]
    print(
        f"off / on: time {off['seconds'] / on['seconds']:.2f}x, peak "
        f"{off['peak_gib'] / on['peak_gib']:.2f}x, kept after the runs "
        f"{off['after_gib'] / on['after_gib']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
