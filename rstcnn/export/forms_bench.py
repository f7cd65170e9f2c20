"""The exported forms of the RST convolutions measured in onnxruntime, in one run.

    python -m export.forms_bench [--checkpoint models/rst_cnn_fb.pt] [--rounds 2]

``export.bake`` writes each scale of each RST convolution as DIRECT (the expanded filters
as one static conv per rotation) or BASIS (a conv with the K basis functions, then a 1x1
mixing conv), by default whichever does fewer multiply-adds (each layer's ``static_form``). This bakes
the checkpoint with that rule and with fixed rules (DIRECT up to a kernel size, BASIS
everywhere) and in the quarter-turn form (``bake(quarter_turns=True)``: R/4 rotations on
four turned copies), exports each, checks each against the default file on the same images, and
times batch 1 (median of 10) and a sweep's batch of 43 in onnxruntime, ``--rounds`` times
in alternation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]


def _up_to(largest: int) -> Callable:
    from rstcnn.export.bake import BASIS, DIRECT

    def rule(layer, s: int):
        return DIRECT if layer.spec.kernel_sizes[s] <= largest else BASIS

    return rule


def main(argv: Sequence[str] | None = None) -> int:
    import onnxruntime as ort

    from rstcnn.export.onnx_export import export_model
    from rstmodel.checkpoint import load_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(REPO_ROOT / "models" / "rst_cnn_fb.pt"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    model, meta = load_checkpoint(args.checkpoint)
    shape = (meta.in_channels, meta.input_size, meta.input_size)
    rules = {  # name -> export_model's keywords
        "fewer multiply-adds (default)": {},
        "fewer multiply-adds, quarter turns": {"quarter_turns": True},
        "DIRECT up to 5x5": {"form": _up_to(5)},
        "DIRECT up to 7x7": {"form": _up_to(7)},
        "DIRECT up to 11x11": {"form": _up_to(11)},
        "BASIS everywhere": {"form": _up_to(0)},
    }
    x = np.random.default_rng(0).random((43, *shape), dtype=np.float32)
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in rules}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for i, (name, rule) in enumerate(rules.items()):
            path = Path(tmp) / f"form{i}.onnx"
            export_model(model, path, input_shape=shape, **rule)
            sessions[name] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        reference = next(iter(sessions.values())).run(None, {"images": x[:4]})[0]
        diffs = {
            name: float(np.abs(s.run(None, {"images": x[:4]})[0] - reference).max())
            for name, s in sessions.items()
        }
        for _ in range(args.rounds):
            for name, session in sessions.items():
                session.run(None, {"images": x[:1]})
                single = []
                for i in range(10):
                    start = time.perf_counter()
                    session.run(None, {"images": x[i : i + 1]})
                    single.append(time.perf_counter() - start)
                start = time.perf_counter()
                session.run(None, {"images": x})
                timings[name].append((1000 * float(np.median(single)), time.perf_counter() - start))
    base = timings["fewer multiply-adds (default)"]
    print(f"{Path(args.checkpoint).name}: onnxruntime, {args.rounds} rounds in alternation")
    print(
        "| form rule | batch 1 ms (each round) | x default | batch 43 s (each round) | x default | max logit diff |"
    )
    print("|---|---|---|---|---|---|")
    for name, rows in timings.items():
        b1 = " / ".join(f"{r[0]:.1f}" for r in rows)
        b43 = " / ".join(f"{r[1]:.2f}" for r in rows)
        r1 = np.mean([r[0] / b[0] for r, b in zip(rows, base, strict=True)])
        r43 = np.mean([r[1] / b[1] for r, b in zip(rows, base, strict=True)])
        print(f"| {name} | {b1} | {r1:.2f} | {b43} | {r43:.2f} | {diffs[name]:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
