"""The web app's sweep, one batch per model against staged (rotation first, then scale,
then deformation, each model one batch per sweep, as the page runs it), in one run.

    python -m serve.stage_bench [--model models/rst_cnn_fb.int8.onnx --model ...]
                                [--sample 3] [--repeats 3]

Prints, per repeat, the time of the whole sweep both ways, when the staged run had its
rotation result (what the page shows first), and the ratio staged / one batch.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from rstcnn.serve import Classifier
from rstcnn.serve.stability import SWEEP_NAMES, SweepSpec, measure_stability

DEFAULT_MODELS = ("models/rst_cnn_fb.int8.onnx", "models/cnn.int8.onnx")


def measure(models: Sequence[Classifier], image, spec: SweepSpec) -> dict[str, float]:
    """One repeat: seconds for the one-batch sweep, the staged sweep, and the staged
    sweep's rotation stage."""
    start = time.perf_counter()
    for clf in models:
        measure_stability([clf], image, spec=spec)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    first = None
    for stage in SWEEP_NAMES:
        measure_stability(models, image, spec=spec, sweeps=[stage])
        first = first if first is not None else time.perf_counter() - start
    staged = time.perf_counter() - start
    return {"one_batch_s": whole, "staged_s": staged, "rotation_shown_s": first}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", type=Path, help="ONNX file (repeatable)")
    parser.add_argument("--sample", type=int, default=3, help="which gallery test image")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    args = parser.parse_args(argv)
    from rstcnn.serve.samples import GALLERY, load_samples
    from rstcnn.serve.uploads import decode_image

    samples = load_samples(GALLERY)
    image = decode_image(samples[args.sample % len(samples)].path.read_bytes())
    models = [
        Classifier.from_onnx(path, threads=args.threads)
        for path in (args.model or [Path(m) for m in DEFAULT_MODELS])
    ]
    spec = SweepSpec()
    measure(models, image, spec)  # warm-up
    print(f"models: {', '.join(m.name for m in models)}; sweep of {spec.batch_size} images")
    for repeat in range(args.repeats):
        r = measure(models, image, spec)
        print(
            f"repeat {repeat + 1}: one batch per model {r['one_batch_s']:.2f} s | staged "
            f"{r['staged_s']:.2f} s, rotation shown after {r['rotation_shown_s']:.2f} s | "
            f"staged / one batch {r['staged_s'] / r['one_batch_s']:.2f}"
        )


if __name__ == "__main__":
    main()
