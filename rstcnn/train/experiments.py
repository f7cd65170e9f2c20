"""Shared pieces of the paper's experiments (train/equivariance.py, stability.py,
reproduce.py, ood.py): test images, models cut into layers, group elements from the command
line, CSV / JSON / plot output.

A model's *stages* are the modules whose outputs are its layer-wise features
``x^(l) [B, C, R, S, H_l, W_l]`` (l = 1..L); raw images in [0, 1] go in, and a checkpoint's
input normalisation is the front of the first stage, so group actions and deformations act
on raw images (zero fill = black, as in the data).
"""

from __future__ import annotations

import ast
import csv
import json
import logging
import math
import operator
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rstmodel import RSTElement, load_checkpoint
from rstmodel.data import RSConfig, load_rs

log = logging.getLogger(__name__)

__all__ = [
    "SYNTHETIC",
    "Normalize",
    "Stages",
    "load_images",
    "synthetic_images",
    "stages_of",
    "stage_outputs",
    "load_stages",
    "parse_element",
    "format_element",
    "element_on_map",
    "write_csv",
    "write_json",
    "plt",
]

SYNTHETIC = "synthetic"


def plt():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


# ---------------------------------------------------------------- images


def synthetic_images(count: int, size: int = 56, *, seed: int = 0) -> Tensor:
    """Smooth non-negative test images (sums of Gaussian strokes near the centre), for
    tests and runs without prepared data. -> float32 [count, 1, size, size] in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    yy, xx = torch.meshgrid(idx, idx, indexing="ij")
    blobs = 6
    centres = (torch.rand(count, blobs, 2, generator=gen, dtype=torch.float64) - 0.5) * 0.4 * size
    widths = size / 28 * (1.0 + 1.5 * torch.rand(count, blobs, generator=gen, dtype=torch.float64))
    dx = xx - centres[..., 0, None, None]  # [N, blobs, H, W]
    dy = yy - centres[..., 1, None, None]
    images = torch.exp(-(dx**2 + dy**2) / (2 * widths[..., None, None] ** 2)).sum(1)
    images = images / images.flatten(1).amax(1)[:, None, None]
    return images[:, None].float()


def load_images(
    data: str, count: int, *, realisation: int = 0, offset: int = 0, seed: int = 0
) -> Tensor:
    """``count`` test images of an RS data set (``rs-mnist`` / ``rs-fashion``: the images
    after the 5,000 train and 2,000 validation ones of the split permutation, skipping
    ``offset``) or ``synthetic`` ones. -> float32 [count, 1, 56, 56] in [0, 1]."""
    if data == SYNTHETIC:
        return synthetic_images(count, seed=seed + offset)
    rs = load_rs(RSConfig(data, realisation=realisation))
    test = rs.split(5000).test
    if offset + count > len(test):
        raise ValueError(f"{data} has {len(test)} test images, asked for {offset + count}")
    images = torch.from_numpy(test.images[offset : offset + count].astype(np.float32) / 255)
    return images[:, None]


# ---------------------------------------------------------------- layer-wise features


class Normalize(nn.Module):
    """(x - mean) / std per channel.  x [B, C, H, W] -> same."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


class Stages(nn.Module):
    """A model cut into its layers: ``stages[l]`` maps x^(l) to x^(l+1) (x^(0): images).
    ``scale_step``: Delta alpha between the scales of the feature maps."""

    def __init__(self, stages: Iterable[nn.Module], *, scale_step: float, input_size: int):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.scale_step = scale_step
        self.input_size = input_size

    def __len__(self) -> int:
        return len(self.stages)

    def forward(self, x: Tensor) -> list[Tensor]:
        return stage_outputs(self, x)


def stage_outputs(stages: Stages, x: Tensor) -> list[Tensor]:
    """Every layer's output for images x [B, Cin, N, N] -> [x^(1), ..., x^(L)]."""
    outs = []
    for stage in stages.stages:
        x = stage(x)
        outs.append(x)
    return outs


def stages_of(model: nn.Module, normalization: tuple[Sequence[float], Sequence[float]] | None):
    """The equivariant layers of an RST-CNN (``model.blocks``: conv -> pool+ReLU -> BN),
    eval mode, with the input normalisation in front of the first."""
    if not hasattr(model, "blocks") or not hasattr(model, "spec"):
        raise ValueError(
            f"{type(model).__name__} has no RST feature layers (blocks / spec): "
            "layer-wise group actions need an RST-CNN"
        )
    blocks = list(model.blocks)
    if normalization is not None:
        blocks[0] = nn.Sequential(Normalize(*normalization), blocks[0])
    stages = Stages(blocks, scale_step=model.spec.scale_step, input_size=model.config.input_size)
    return stages.eval()


def load_stages(path: str | Path) -> tuple[Stages, nn.Module, Any]:
    """(stages, model, metadata) of a checkpoint written by train/run.py."""
    model, meta = load_checkpoint(path, map_location="cpu")
    model.eval()
    return stages_of(model, (meta.mean, meta.std)), model, meta


# ---------------------------------------------------------------- group elements

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def _number(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _number(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_number(node.left), _number(node.right))
    raise ValueError("only numbers, pi and + - * / ** are allowed")


def parse_element(text: str) -> RSTElement:
    """``"ETA,BETA,VX,VY"`` (angle in rad, log2 scale, shift in input pixels; ``pi`` and
    arithmetic allowed, e.g. ``-pi/2,-0.5,0,0``) -> RSTElement."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (2, 4):
        raise ValueError(f"expected ETA,BETA or ETA,BETA,VX,VY, got {text!r}")
    try:
        values = [_number(ast.parse(p, mode="eval").body) for p in parts]
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        raise ValueError(f"cannot read the group element {text!r}: {err}") from None
    shift = (values[2], values[3]) if len(values) == 4 else (0.0, 0.0)
    return RSTElement(values[0], values[1], shift)


def format_element(g: RSTElement) -> str:
    turns = g.angle / math.pi
    if abs(turns * 8 - round(turns * 8)) > 1e-9:
        angle = f"{g.angle:.4g}"
    else:
        angle = "0" if turns == 0 else f"{turns:g}pi"
    return f"({angle}, {g.log2_scale:.4g}, ({g.shift[0]:g}, {g.shift[1]:g}))"


def element_on_map(g: RSTElement, map_size: int, input_size: int) -> RSTElement:
    """g with its shift expressed in the pixels of a ``map_size`` map of an input of
    ``input_size`` pixels (pooling halves the grid; its centre stays the centre)."""
    factor = map_size / input_size
    return RSTElement(g.angle, g.log2_scale, (g.shift[0] * factor, g.shift[1] * factor))


# ---------------------------------------------------------------- output


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rows of equal keys as a CSV file (floats with 6 significant digits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        path.write_text("", encoding="utf-8")
        return
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
