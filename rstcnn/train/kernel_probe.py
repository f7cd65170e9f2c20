"""Each RST convolution of a model alone, with the fast paths' fused Triton kernels and with
torch's operators: time, bytes moved and the bandwidth that makes.

    python train/kernel_probe.py --device cuda --batch 128 --bf16 --out results/bench/x.md
    python train/kernel_probe.py --device cpu --batch 2 --model-arg "channels=(4,6,8)"  # dry run

For every convolution the model runs, called as the model calls it (the lifting layer fused
with its pool, ``forward_pooled``; the group convolutions through ``forward``), forward and
backward at ``--batch``: the median time (``RSTCNN_KERNELS=torch``, then ``triton``), the
bytes its operators move (``train/step_cost.py``'s count, on this device: each fused kernel is
one operator reading its operands and writing its results once) and the rate that is. The
rate against the card's bandwidth says how far each layer is from its own floor, and the
time ratio what the fused kernels buy per layer. On a CPU the kernels' torch stand-ins run
(no timing worth reading: a dry run of the script).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.config import add_model_arg
from rstcnn.train.engine import use_tf32
from rstcnn.train.fastpath import Setting, _timed, build, layer_inputs
from rstcnn.train.step_cost import count
from rstmodel.layers import LiftingRSTConv, triton_ops

KERNELS = ("torch", "triton")


def probe(args: argparse.Namespace) -> list[dict]:
    """One row per convolution: for each kernel choice its seconds, bytes and GB/s."""
    device = torch.device(args.device)
    setting = Setting("bf16" if args.bf16 else "fp32", "bf16" if args.bf16 else "fp32")
    use_tf32(device, False)
    model = build(args.model, setting, args.model_args, device).train()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    rows = []
    saved = os.environ.get(triton_ops.ENV)
    try:
        for name, shape in layer_inputs(model, device).items():
            layer = model.get_submodule(name)
            lifting = isinstance(layer, LiftingRSTConv)
            torch.manual_seed(0)
            # images need no gradient; feature maps do
            x = torch.randn(args.batch, *shape[1:], device=device, requires_grad=not lifting)

            def step(layer=layer, x=x, lifting=lifting) -> None:
                with autocast:
                    y = layer.forward_pooled(x, relu=True) if lifting else layer(x)
                y.float().sum().backward()

            row = {"layer": name, "shape": [args.batch, *shape[1:]]}
            for kernels in KERNELS:
                os.environ[triton_ops.ENV] = kernels
                seconds = _timed(step, device, 1, args.steps)
                moved = sum(c.bytes for c in count(step).costs.values())
                row[kernels] = {"s": seconds, "bytes": moved, "gb_s": moved / seconds / 1e9}
            rows.append(row)
            print(row, flush=True)
    finally:
        if saved is None:
            os.environ.pop(triton_ops.ENV, None)
        else:
            os.environ[triton_ops.ENV] = saved
    return rows


def report(rows: list[dict], args: argparse.Namespace, device_name: str) -> str:
    lines = [
        f"# Fused kernels per layer: {args.model}, batch {args.batch}, "
        f"{'bf16' if args.bf16 else 'fp32'}, {device_name}",
        "",
        "Forward and backward of each RST convolution alone, as the model calls it.",
        "",
        "| layer | torch ms | GB | GB/s | fused ms | GB | GB/s | fused / torch time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, f = r["torch"], r["triton"]
        lines.append(
            f"| {r['layer']} | {1e3 * t['s']:.2f} | {t['bytes'] / 1e9:.4g} | {t['gb_s']:,.0f} | "
            f"{1e3 * f['s']:.2f} | {f['bytes'] / 1e9:.4g} | {f['gb_s']:,.0f} | "
            f"{f['s'] / t['s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="rst_cnn_fb")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed calls per figure")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    add_model_arg(parser, "config override of --model, a Python literal")
    parser.add_argument("--out", type=Path, default=None, help="write the table here (.md)")
    args = parser.parse_args(argv)
    args.model_args = dict(args.model_args)
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch must be positive")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = report(probe(args), args, name)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
