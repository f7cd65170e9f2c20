"""onnxruntime session settings measured the way a user runs a model: each setting in a
fresh process through ``serve.Classifier.from_onnx``, one table per model, in one run.

    python -m serve.session_bench [--model models/rst_cnn_fb.onnx --model models/cnn.onnx]
                                  [--batch 43] [--repeats 20] [--setting defaults ...]

Per setting: the time to load the model, the median latency of one image (``--repeats``
calls), the time of a stability sweep's batch (``--batch`` images, median of 3), the peak
resident memory (VmHWM) and the resident memory after the runs (VmRSS), and each time as a
ratio to the defaults measured in the same run. Settings: the defaults (no memory arena,
onnxruntime's thread count, optimisation "all"), 1 and 2 intra-op threads, the memory arena
on, and the optimisation levels "extended", "basic" and "none". Linux only
(``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODELS = ("models/rst_cnn_fb.onnx", "models/cnn.onnx")
SETTINGS: dict[str, dict] = {
    "defaults": {},
    "threads 1": {"threads": 1},
    "threads 2": {"threads": 2},
    "memory arena on": {"memory_arena": True},
    "optimisation extended": {"optimization": "extended"},
    "optimisation basic": {"optimization": "basic"},
    "optimisation none": {"optimization": "none"},
}


def _status() -> dict[str, float]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}


def measure(model: str, options: dict, batch: int, repeats: int) -> dict[str, float]:
    """In this process: load seconds, batch-1 median ms, batch seconds, GiB peak / after."""
    import numpy as np

    from rstcnn.serve import Classifier

    start = time.perf_counter()
    clf = Classifier.from_onnx(model, max_batch=batch, **options)
    load = time.perf_counter() - start
    images = np.random.default_rng(0).random((batch, *clf.input_size), dtype=np.float32)
    clf.run_logits(images[:1])  # first run: allocations, kernel selection
    single = []
    for i in range(repeats):
        start = time.perf_counter()
        clf.run_logits(images[i % batch : i % batch + 1])
        single.append(time.perf_counter() - start)
    full = []
    for _ in range(3):
        start = time.perf_counter()
        clf.run_logits(images)
        full.append(time.perf_counter() - start)
    memory = _status()
    return {
        "load_s": load,
        "batch1_ms": 1000 * float(np.median(single)),
        "batch_s": float(np.median(full)),
        "peak_gib": memory["VmHWM"],
        "after_gib": memory["VmRSS"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="ONNX model (repeatable)")
    parser.add_argument("--batch", type=int, default=43, help="a sweep's batch (default 43)")
    parser.add_argument("--repeats", type=int, default=20, help="batch-1 calls (default 20)")
    parser.add_argument(
        "--setting", action="append", choices=list(SETTINGS), help="only these (repeatable)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one setting, JSON on stdout
    args = parser.parse_args(argv)
    models = args.model or [str(REPO_ROOT / m) for m in DEFAULT_MODELS]
    if args.child:
        model, name = json.loads(args.child)
        print(json.dumps(measure(model, SETTINGS[name], args.batch, args.repeats)))
        return 0
    print(
        f"{platform.machine()}, {os.cpu_count()} CPU cores; batch {args.batch}, fresh process each"
    )
    for model in models:
        rows = {}
        for name in args.setting or SETTINGS:
            command = [sys.executable, "-m", "rstcnn.serve.session_bench", "--child"]
            command += [json.dumps([model, name]), "--batch", str(args.batch)]
            command += ["--repeats", str(args.repeats)]
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
            if done.returncode != 0:
                print(f"{name}: failed: {done.stderr.strip().splitlines()[-1:]}")
                continue
            rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        base = rows.get("defaults")
        print(f"\n{Path(model).name}")
        print(
            "| setting | load s | batch 1 ms | x defaults | batch s | x defaults "
            "| peak GiB | RSS after GiB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            r1 = r["batch1_ms"] / base["batch1_ms"] if base else float("nan")
            rb = r["batch_s"] / base["batch_s"] if base else float("nan")
            print(
                f"| {name} | {r['load_s']:.2f} | {r['batch1_ms']:.1f} | {r1:.2f} | "
                f"{r['batch_s']:.2f} | {rb:.2f} | {r['peak_gib']:.2f} | {r['after_gib']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
