"""What one training step of a model costs at the hardware's limits: every operator's
floating-point operations and the bytes it moves, counted as the step runs, and from them
the time the step would take if each operator ran at the card's peak arithmetic rate or its
peak memory bandwidth, whichever binds.

    python train/step_cost.py --device cpu --batch 128 --bf16               # counts here
    python train/step_cost.py --device cuda --batch 128 --bf16 --measured-ms 125.8

Each operator is counted as the eager step dispatches it (a ``TorchDispatchMode``): its FLOPs
by torch's own formulas (``torch.utils.flop_counter``; matrix products and convolutions, the
only operators with many), its bytes as every tensor it reads and writes, once (views move
nothing; an in-place operator reads and writes its target, or the rows of it that it writes,
for ``index_copy_`` and its kin). That is the traffic of the
unfused implementation: a fused kernel moves less, so the floor it gives is the floor of
*this* implementation, not of the algorithm. The step is attributed per layer (``blocks.N``,
the rest ``head / loss / optimiser``) and per kind of operator (matrix product, convolution,
gather and copy, elementwise). ``--measured-ms`` (e.g. from train/fastpath.py on the card)
adds how much of each bound the step reaches.

Peaks default to an NVIDIA H200 in bfloat16 (989 TFLOP/s dense tensor-core, 4.8 TB/s HBM3e);
an H100 SXM has the same arithmetic and 3.35 TB/s.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.config import add_model_arg
from rstcnn.train.fastpath import Setting, train_step
from rstmodel.layers import triton_ops

triton_ops.register_flops()  # the FFT path's mixing kernel, one operator

H200_TFLOPS, H200_TBPS = 989.0, 4.8

_KINDS = {
    "matmul": {
        "mm", "bmm", "addmm", "baddbmm", "_addmm_activation", "dot", "mv",
        "complex_bmm", "pooled_mix", "pooled_mix_grad",  # rstmodel's fused kernels
    },
    "conv": {"convolution", "convolution_backward", "cudnn_convolution", "_convolution"},
    "gather/copy": {
        "copy_", "clone", "_to_copy", "cat", "stack", "index_select", "gather", "index",
        "scatter", "scatter_add", "index_add", "index_copy", "index_put", "_index_put_impl_",
        "constant_pad_nd", "roll", "new_zeros", "zeros_like", "repeat", "flip",
    },
}  # fmt: skip


def kind_of(name: str) -> str:
    """The kind of an aten operator by its name (overload packet); an in-place operator
    (``baddbmm_``) is of its out-of-place one's kind."""
    for candidate in (name, name.rstrip("_")):
        for kind, names in _KINDS.items():
            if candidate in names:
                return kind
    return "elementwise"


@dataclass
class Cost:
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    floor_s: float = 0.0  # each operator at the binding peak, summed

    def add(self, other: Cost) -> None:
        self.calls += other.calls
        self.flops += other.flops
        self.bytes += other.bytes
        self.floor_s += other.floor_s


# in-place operators that write only the rows they are given, not their whole target: the
# position of those values in their arguments, and how often their bytes cross (index_add_
# also reads the rows it adds to)
_ROW_WRITES = {"index_copy_": (3, 1), "index_add_": (3, 2), "index_put_": (2, 1)}


def _is_view(func) -> bool:
    """True for operators whose result aliases an input without writing it (no traffic)."""
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _bytes(tensors) -> int:
    """The memory the tensors span, each once: a broadcast (expanded, stride 0) operand
    counts its distinct elements, not its logical size."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen and t.numel() > 0:
            seen.add(id(t))
            span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
            total += min(t.numel(), span) * t.element_size()
    return total


class Tally(TorchDispatchMode):
    """Costs by (layer, kind) in ``costs`` and by (layer, aten operator) in ``ops``."""

    def __init__(self, tracker: ModuleTracker | None, tflops: float, tbps: float):
        super().__init__()
        self.tracker, self.peak_flops, self.peak_bw = tracker, tflops * 1e12, tbps * 1e12
        self.costs: dict[tuple[str, str], Cost] = defaultdict(Cost)
        self.ops: dict[tuple[str, str], Cost] = defaultdict(Cost)  # by (layer, operator)

    def _where(self) -> str:
        if self.tracker is None:
            return "all"
        names = " ".join(sorted(self.tracker.parents))
        found = re.findall(r"blocks\.(\d+)", names)
        return f"blocks.{max(map(int, found))}" if found else "head / loss / optimiser"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_view(func):
            return out
        packet = func.overloadpacket
        formula = flop_registry.get(packet)
        if formula is None and packet.__name__.endswith("_"):  # in place: as out of place
            formula = flop_registry.get(getattr(torch.ops.aten, packet.__name__[:-1], None))
        flops = 0 if formula is None else formula(*args, **kwargs, out_val=out)
        rows = _ROW_WRITES.get(packet.__name__)
        if rows is None:
            moved = _bytes(tree_flatten((args, kwargs))[0]) + _bytes(tree_flatten(out)[0])
        else:  # the values and indices read, the rows written (and read, to add to)
            values, crossings = rows
            moved = _bytes(tree_flatten((args[1:], kwargs))[0]) + crossings * _bytes([args[values]])
        where, cost = self._where(), Cost(1, flops, moved)
        cost.floor_s = max(flops / self.peak_flops, moved / self.peak_bw)
        self.costs[(where, kind_of(packet.__name__))].add(cost)
        self.ops[(where, packet.__name__)].add(cost)
        return out


def count(
    fn: Callable[[], Any],
    *,
    per_layer: bool = False,
    tflops: float = H200_TFLOPS,
    tbps: float = H200_TBPS,
) -> Tally:
    """The operators ``fn()`` dispatches: calls, FLOPs, bytes moved and the time at the
    peaks, by (layer, kind) and by (layer, operator); the layer is ``all``, or with
    ``per_layer`` the ``blocks.N`` running."""
    tracker = ModuleTracker() if per_layer else None
    tally = Tally(tracker, tflops, tbps)
    with tracker or nullcontext(), tally:
        fn()
    return tally


def report(
    costs: dict[tuple[str, str], Cost],
    batch: int,
    measured_ms: float | None = None,
    ops: dict[tuple[str, str], Cost] | None = None,
    top: int = 12,
) -> str:
    """A markdown table by layer and kind, totals and (with ``measured_ms``) the fraction of
    each bound the measured step reaches; with ``ops`` the ``top`` operators by floor."""
    lines = [
        "| layer | kind | calls | GFLOP | GB moved | floor (ms) |",
        "|---|---|---|---|---|---|",
    ]
    total = Cost()
    for (where, kind), c in sorted(costs.items(), key=lambda kv: (kv[0][0], -kv[1].floor_s)):
        lines.append(
            f"| {where} | {kind} | {c.calls} | {c.flops / 1e9:,.2f} | {c.bytes / 1e9:.2f} "
            f"| {c.floor_s * 1e3:.2f} |"
        )
        total.add(c)
    lines.append(
        f"| **all** | all | {total.calls} | {total.flops / 1e9:,.2f} | {total.bytes / 1e9:.2f} "
        f"| **{total.floor_s * 1e3:.2f}** |"
    )
    floor_ms = total.floor_s * 1e3
    lines += [
        "",
        f"- per image: {total.flops / batch / 1e9:.2f} GFLOP, {total.bytes / batch / 1e6:.1f} MB "
        f"moved; the floor of this implementation: {floor_ms:.2f} ms per step of {batch}, "
        f"{batch / total.floor_s:,.0f} img/s",
    ]
    if measured_ms is not None:
        lines.append(
            f"- measured {measured_ms:.2f} ms per step: {floor_ms / measured_ms:.1%} of the "
            f"floor's speed, {total.flops / (measured_ms / 1e3) / 1e12:.1f} TFLOP/s, "
            f"{total.bytes / (measured_ms / 1e3) / 1e12:.2f} TB/s"
        )
    if ops:
        lines += ["", "| layer | operator | calls | GFLOP | GB moved | floor (ms) |"]
        lines.append("|---|---|---|---|---|---|")
        for (where, name), c in sorted(ops.items(), key=lambda kv: -kv[1].floor_s)[:top]:
            lines.append(
                f"| {where} | `{name}` | {c.calls} | {c.flops / 1e9:,.2f} | "
                f"{c.bytes / 1e9:.2f} | {c.floor_s * 1e3:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="rst_cnn_fb")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    add_model_arg(parser, "config override, a Python literal")
    parser.add_argument("--peak-tflops", type=float, default=H200_TFLOPS)
    parser.add_argument("--peak-tbps", type=float, default=H200_TBPS)
    parser.add_argument("--measured-ms", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the table here (.md)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    setting = Setting("bf16" if args.bf16 else "fp32", "bf16" if args.bf16 else "fp32")
    step = train_step(args.model, setting, dict(args.model_args), device, args.batch)
    step()  # warm: cached spectra, method choices, optimiser state
    peaks = {"tflops": args.peak_tflops, "tbps": args.peak_tbps}
    tally = count(step, per_layer=True, **peaks)
    head = (
        f"# One training step of {args.model}, batch {args.batch}, {setting.precision}, "
        f"counted on {args.device}\n\nPeaks: {args.peak_tflops:g} TFLOP/s, "
        f"{args.peak_tbps:g} TB/s\n\n"
    )
    text = head + report(tally.costs, args.batch, args.measured_ms, tally.ops)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
