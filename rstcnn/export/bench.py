"""Inference speed of the deployment forms: ``python -m export.bench [--forms ...]``.

For each model (default ``rst_cnn_fb`` and ``cnn``, random weights with perturbed batch
norm statistics, so no checkpoint is needed) and each form

    eager    the library model in eval mode (its fastest paths, train-form parameters)
    eager_bf16  the same under bfloat16 autocast (``rstmodel.precision``; only where the
             CPU runs bfloat16 natively)
    eager_int8  the same with the FFT path's per-frequency products in int8
             (``inference("int8")``; only where the CPU has AVX512-BF16 and AVX512-VNNI)
    eager_int16  float32 with those products on 16-bit integers (``inference("int16")``;
             only where the CPU has AVX2 and the kernels are the AVX2 build)
    baked    ``export.bake``: plain torch, static convolutions, batch norms folded
    onnx     the exported ONNX file on onnxruntime's CPU provider

prints the median latency at batch 1 and the median time of one batch of 128 (each after
one warm-up call), then the ratios: eager / onnx per model, and each form of the first
model over the same form of the last (the RST-CNN / CNN cost). torch and onnxruntime get
the same number of threads (``--threads``). ``--split N`` runs the batch as calls of N
images, for every form alike (the eager RST model needs over 10 GB at batch 128).
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

import rstmodel
from rstcnn.export.bake import bake
from rstcnn.export.onnx_export import export_model
from rstcnn.train.runtime import use_retaining_allocator
from rstmodel.precision import bf16_supported, inference, int8_supported, int16_supported

FORMS = ("eager", "eager_bf16", "eager_int8", "eager_int16", "baked", "onnx")
DEFAULT_FORMS = ("eager", "baked", "onnx")


def perturb_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random batch-norm statistics and affine parameters (some scales negative), so the
    folding does real work."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.3)
                m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
                m.weight.copy_(torch.randn(n, generator=gen))
                m.bias.copy_(torch.randn(n, generator=gen) * 0.3)
    return model


def time_call(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def runners(model: nn.Module, shape: tuple[int, int, int], threads: int, folder: Path):
    """``{form: run(x float32 numpy) -> logits}`` for the three forms."""
    import onnxruntime as ort

    baked = bake(model, torch.zeros(1, *shape))
    path = export_model(model, folder / "model.onnx", input_shape=shape)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def torch_form(net: nn.Module, precision: str = "fp32") -> Callable[[np.ndarray], np.ndarray]:
        def run(x: np.ndarray) -> np.ndarray:
            with inference(precision):
                return net(torch.from_numpy(x)).float().numpy()

        return run

    return {
        "eager": torch_form(model),
        "eager_bf16": torch_form(model, "bf16"),
        "eager_int8": torch_form(model, "int8"),
        "eager_int16": torch_form(model, "int16"),
        "baked": torch_form(baked),
        "onnx": lambda x: session.run(None, {"images": x})[0],
    }


# the reduced-precision eager forms: whether this CPU runs each, and what it lacks if not
_NEEDS = {
    "eager_bf16": (bf16_supported, "has no native bfloat16"),
    "eager_int8": (int8_supported, "cannot run int8 products"),
    "eager_int16": (int16_supported, "cannot run int16 products"),
}


def measure(name: str, args: argparse.Namespace, folder: Path) -> dict[str, dict[str, float]]:
    model = perturb_norms(rstmodel.create_model(name)).eval()
    config = model.config
    shape = (config.in_channels, config.input_size, config.input_size)
    forms = runners(model, shape, args.threads, folder)
    rng = np.random.default_rng(0)
    x1 = rng.standard_normal((1, *shape), dtype=np.float32)
    xb = rng.standard_normal((args.batch, *shape), dtype=np.float32)
    split = args.split or args.batch
    chunks = [xb[i : i + split] for i in range(0, args.batch, split)]
    reference = forms["eager"](x1)
    out: dict[str, dict[str, float]] = {}
    for form in args.forms:
        if form in _NEEDS and not _NEEDS[form][0]():
            logging.warning("%s: this CPU %s, %s not run", name, _NEEDS[form][1], form)
            continue
        run = forms[form]
        diff = float(np.abs(run(x1) - reference).max())
        b1 = time_call(lambda run=run: run(x1), args.repeats)
        bb = time_call(lambda run=run: [run(c) for c in chunks], max(1, args.repeats // 5))
        out[form] = {"b1": b1, "batch": bb, "diff": diff}
        logging.info(
            "%s %s: %.1f ms at batch 1, %.2f s at batch %d", name, form, b1 * 1e3, bb, args.batch
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--models", nargs="+", default=["rst_cnn_fb", "cnn"])
    parser.add_argument("--forms", nargs="+", default=list(DEFAULT_FORMS), choices=FORMS)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls at batch 1 (default 5)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", type=int, help="run the batch as calls of this many images")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger().setLevel(logging.INFO)
    for noisy in ("onnxscript", "onnx_ir", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder = Path(tmp) / name
            folder.mkdir()
            results[name] = measure(name, args, folder)

    print(
        f"\n{platform.machine()}, {torch.get_num_threads()} torch threads / {args.threads} "
        f"onnxruntime threads, torch {torch.__version__}, python {platform.python_version()}"
        + (f", batch {args.batch} as calls of {args.split}" if args.split else "")
        + "\n"
    )
    print(f"| model | form | batch 1 (ms) | batch {args.batch} (s) | max abs diff vs eager |")
    print("|---|---|---|---|---|")
    for name, forms in results.items():
        for form, r in forms.items():
            print(f"| {name} | {form} | {r['b1'] * 1e3:.1f} | {r['batch']:.3f} | {r['diff']:.1e} |")
    print("\n| ratio | batch 1 | batch " + str(args.batch) + " |\n|---|---|---|")
    for name, forms in results.items():
        for form in forms:
            if form != "eager" and "eager" in forms:
                e, f = forms["eager"], forms[form]
                print(
                    f"| {name}: eager / {form} | {e['b1'] / f['b1']:.2f}x | {e['batch'] / f['batch']:.2f}x |"
                )
    if len(results) > 1:
        first, last = list(results)[0], list(results)[-1]
        for form in results[first]:
            if form in results[last]:
                a, b = results[first][form], results[last][form]
                print(
                    f"| {first} / {last}, {form} | {a['b1'] / b['b1']:.1f}x | {a['batch'] / b['batch']:.1f}x |"
                )
    return 0


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
