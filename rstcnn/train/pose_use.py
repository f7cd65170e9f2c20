"""Which pose a trained model reads: accuracy, and the group element its final max-pool picks,
against the rotation and scale each test image was rendered with.

    python train/pose_use.py models/rst_cnn_fb.pt models/cnn.pt --out results/pose-use
    python train/pose_use.py CHECKPOINT --images 512 --sweep 32

1. **Accuracy by pose** (every checkpoint): ``--images`` test images of the checkpoint's own
   realisation and split (the images after its N_tr train and the validation ones), binned by
   the object scale (the data's 0.3-1) and by the angle. An invariance that holds shows as a
   flat row.
2. **The group axes in use** (RST-CNNs): for every channel of the last equivariant map, the
   rotation index and the scale index of its maximum, the element the group max-pool reads.
   (a) On the same test images: the share of channels that win at each scale index, by object
   scale. Equivariance in use moves the winner up one index each time the object grows by the
   model's scale ratio; a winner pinned at an end of the truncated scale axis cannot move.
   (b) Controlled, content fixed: ``--sweep`` source images rendered by the data set's own
   pipeline at one pose and one group step away (the rotation step 2 pi / Nr; the scale ratio
   down and up), and the share of channels whose winner moves by exactly that one index. A
   quarter turn of the rendered image (``np.rot90``) permutes the sampled filters exactly, so
   there the share is 1 up to ties (``tests/test_experiments.py`` checks it).
Channels that are constant over the group and space for an image (dead after the ReLU) have
no winner and are left out. Writes ``pose_use.md``, ``pose_use.csv`` and ``pose_use.png``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.engine import setup_cli
from rstcnn.train.experiments import plt, write_csv
from rstcnn.train.runtime import use_retaining_allocator, user_errors
from rstmodel.checkpoint import load_checkpoint
from rstmodel.data.cache import default_cache_dir
from rstmodel.data.rs import RSConfig, RSData, load_rs, rotate_scale_upsize
from rstmodel.data.sources import find_source, load_source
from rstmodel.models.rst_cnn import RSTCNN

log = logging.getLogger("rstcnn.pose_use")

SCALE_BINS = np.linspace(0.3, 1.0, 8)
ANGLE_BINS = np.linspace(0.0, 2 * math.pi, 9)


def winners(features: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The element each channel's maximum sits at. features [B, C, R, S, h, w] ->
    (rotation index [B, C], scale index [B, C], alive [B, C] bool: not constant)."""
    flat = features.flatten(4)
    peak = flat.amax(-1)  # [B, C, R, S]: max over space
    alive = flat.flatten(2).amax(-1) > flat.flatten(2).amin(-1)
    index = peak.flatten(2).argmax(-1)
    scales = features.shape[3]
    return index // scales, index % scales, alive


def moved_share(before: Tensor, after: Tensor, alive: Tensor, step: int, period: int | None):
    """Share of live channels whose winner moved by exactly ``step`` indices (mod ``period``
    on the cyclic rotation axis)."""
    shift = after - before
    if period is not None:
        shift = shift % period
        step %= period
    return (shift == step)[alive].float().mean().item()


def _batches(fn: Callable[[Tensor], Tensor], x: Tensor, batch: int = 64) -> Tensor:
    with torch.no_grad():
        return torch.cat([fn(x[i : i + batch]) for i in range(0, len(x), batch)])


@lru_cache(maxsize=2)
def _realisation(data: str, realisation: int, data_root: Path | None) -> RSData:
    """One RS realisation, read once for every checkpoint of a call."""
    return load_rs(RSConfig(data, realisation=realisation), data_root=data_root)


@lru_cache(maxsize=2)
def _source_images(rs: RSData, data_root: Path | None) -> np.ndarray:
    """The realisation's upright source images (index i renders as the RS image i)."""
    sources_dir = default_cache_dir() / "sources"
    info = find_source(rs.config.dataset.base, data_root=data_root, sources_dir=sources_dir)
    return load_source(info).images


def _normalise(images: np.ndarray, mean: float, std: float) -> Tensor:
    return (torch.from_numpy(images.astype(np.float32) / 255)[:, None] - mean) / std


def accuracy_by_pose(pred, labels, scales, angles) -> list[dict]:
    rows = []
    for axis, values, edges, unit in (
        ("scale", scales, SCALE_BINS, 1.0),
        ("angle", angles, ANGLE_BINS, 180 / math.pi),
    ):
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            sel = (values >= lo) & (values < hi)
            rows.append(
                {
                    "axis": axis,
                    "low": round(lo * unit, 3),
                    "high": round(hi * unit, 3),
                    "images": int(sel.sum()),
                    "accuracy": float((pred[sel] == labels[sel]).mean()) if sel.any() else None,
                }
            )
    return rows


def scale_winners_by_object_scale(s_win: Tensor, alive: Tensor, scales, num_scales: int):
    """[bins, num_scales]: share of live channels winning at each scale index, by object scale."""
    table = np.zeros((len(SCALE_BINS) - 1, num_scales))
    for b, (lo, hi) in enumerate(zip(SCALE_BINS[:-1], SCALE_BINS[1:], strict=True)):
        sel = torch.from_numpy((scales >= lo) & (scales < hi))
        won, live = s_win[sel], alive[sel]
        for s in range(num_scales):
            table[b, s] = ((won == s) & live).sum().item() / max(live.sum().item(), 1)
    return table


def controlled_sweep(model, meta, sources: np.ndarray, base_scale: float) -> dict[str, float]:
    """Winner moves for one group step, content fixed (part 2b of the module doc)."""
    config = meta.config
    nr, ns, ratio = config["rotations"], config["num_scales"], config["scale_ratio"]
    mean, std = meta.mean[0], meta.std[0]

    def feats(images: list[np.ndarray]) -> tuple[Tensor, Tensor, Tensor]:
        return winners(_batches(model.forward_features, _normalise(np.stack(images), mean, std)))

    base = [rotate_scale_upsize(im, 0.0, base_scale) for im in sources]
    r0, s0, alive = feats(base)
    out: dict[str, float] = {}
    if nr > 1:
        r1, _, a1 = feats([rotate_scale_upsize(im, 2 * math.pi / nr, base_scale) for im in sources])
        out[f"rotation +{360 / nr:g} deg: winner +1 index"] = moved_share(r0, r1, alive & a1, 1, nr)
        if nr % 4 == 0:
            rq, _, aq = feats([np.ascontiguousarray(np.rot90(im)) for im in base])
            out["quarter turn (rot90): winner +Nr/4 (exact)"] = moved_share(
                r0, rq, alive & aq, nr // 4, nr
            )
    if ns > 1:
        for sign, word in ((-1, "down"), (1, "up")):
            size = base_scale * ratio**sign
            _, s1, a1 = feats([rotate_scale_upsize(im, 0.0, size) for im in sources])
            live = alive & a1
            out[f"scale x{ratio**sign:.3f}: winner {word} 1 index"] = moved_share(
                s0, s1, live, sign, None
            )
            out[f"scale x{ratio**sign:.3f}: winner unmoved"] = moved_share(s0, s1, live, 0, None)
    return out


def analyse(path: Path, args: argparse.Namespace, bar: tqdm) -> dict:
    model, meta = load_checkpoint(path)
    run = (meta.extra or {}).get("run", {})
    data = run.get("data")
    if data not in ("rs-mnist", "rs-fashion"):
        raise SystemExit(
            f"{path} was trained on {data!r}: pose_use.py reads RS-MNIST / RS-Fashion checkpoints"
        )
    rs = _realisation(data, run.get("realisation", 0), args.data_root)
    test = rs.split(run.get("train_size", 5000), num_val=run.get("val_size", 2000)).test
    count = min(args.images, len(test))
    idx = test.indices[:count]
    x = _normalise(test.images[:count], meta.mean[0], meta.std[0])
    equivariant = isinstance(model, RSTCNN)  # [B, C, R, S, h, w] maps; others: accuracy only
    name = f"{meta.model_name} ({path})"
    result: dict = {"name": name, "model": meta.model_name}
    if equivariant:
        feats = _batches(model.forward_features, x)
        pred = model.head(model.pool(feats)).argmax(-1).numpy()
        _, s_win, alive = winners(feats)
        result["scale_table"] = scale_winners_by_object_scale(
            s_win, alive, rs.scales[idx], meta.config["num_scales"]
        )
        result["scale_ratio"] = meta.config["scale_ratio"]
    else:
        pred = _batches(model, x).argmax(-1).numpy()
    bar.update(1)
    result["rows"] = accuracy_by_pose(pred, test.labels[:count], rs.scales[idx], rs.angles[idx])
    result["accuracy"] = float((pred == test.labels[:count]).mean())
    if equivariant and args.sweep:
        sources = _source_images(rs, args.data_root)[idx[: args.sweep]]
        result["sweep"] = controlled_sweep(model, meta, sources, args.base_scale)
    bar.update(1)
    return result


def markdown(results: list[dict], args: argparse.Namespace, seconds: float) -> str:
    lines = [f"# Pose use ({seconds:.0f} s)", "", f"`{' '.join(sys.argv)}`", ""]
    for axis, title, fmt in (("scale", "object scale", ".1f"), ("angle", "angle (degrees)", ".0f")):
        bins = [r for r in results[0]["rows"] if r["axis"] == axis]
        head = ["all"] * (axis == "scale") + [f"{r['low']:{fmt}}-{r['high']:{fmt}}" for r in bins]
        lines += [f"## Accuracy (%) by {title}", "", "| model | " + " | ".join(head) + " |"]
        lines += ["|---" * (len(head) + 1) + "|"]
        for res in results:
            cells = [_pct(res["accuracy"])] * (axis == "scale")
            cells += [_pct(r["accuracy"]) for r in res["rows"] if r["axis"] == axis]
            lines.append(f"| {res['name']} | " + " | ".join(cells) + " |")
        lines.append("")
    for res in results:
        if "scale_table" not in res:
            continue
        table = res["scale_table"]
        lines += [f"## {res['name']}: share of channels winning at each scale index", ""]
        lines += ["| object scale | " + " | ".join(f"s={s}" for s in range(table.shape[1])) + " |"]
        lines.append("|---" * (table.shape[1] + 1) + "|")
        for b, row in enumerate(table):
            span = f"{SCALE_BINS[b]:.1f}-{SCALE_BINS[b + 1]:.1f}"
            lines.append(f"| {span} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
        if res.get("sweep"):
            lines += [
                "",
                f"Controlled ({args.sweep} source images at scale {args.base_scale}):",
                "",
            ]
            lines += [f"- {k}: {v:.2f}" for k, v in res["sweep"].items()]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def plot(results: list[dict], path: Path) -> None:
    pyplot = plt()
    tables = [r for r in results if "scale_table" in r]
    fig, axes = pyplot.subplots(1, 1 + len(tables), figsize=(5 + 4 * len(tables), 3.6))
    axes = np.atleast_1d(axes)
    centres = (SCALE_BINS[:-1] + SCALE_BINS[1:]) / 2
    for res in results:
        acc = [r["accuracy"] for r in res["rows"] if r["axis"] == "scale"]
        axes[0].plot(
            centres, [100 * a if a is not None else np.nan for a in acc], "o-", label=res["model"]
        )
    axes[0].set(xlabel="object scale", ylabel="test accuracy (%)", title="accuracy by scale")
    axes[0].legend(fontsize=8)
    for ax, res in zip(axes[1:], tables, strict=True):
        image = ax.imshow(
            res["scale_table"].T,
            origin="lower",
            aspect="auto",
            vmin=0,
            vmax=1,
            extent=(SCALE_BINS[0], SCALE_BINS[-1], -0.5, res["scale_table"].shape[1] - 0.5),
        )
        ax.set(
            xlabel="object scale",
            ylabel="winning scale index",
            title=f"{res['model']}: channels' winners",
        )
        # equivariance in use: a channel whose winner is the top index on the largest objects
        top = res["scale_table"].shape[1] - 1
        sizes = np.linspace(SCALE_BINS[0], SCALE_BINS[-1], 50)
        ax.plot(
            sizes,
            top + np.log(sizes) / math.log(res["scale_ratio"]),
            "w--",
            lw=1,
            label="followed exactly",
        )
        ax.set_ylim(-0.5, top + 0.5)
        ax.legend(fontsize=8, loc="lower right")
        fig.colorbar(image, ax=ax, label="share of channels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", type=Path, nargs="+", help="trained RS checkpoints")
    parser.add_argument("--images", type=int, default=2000, help="test images per checkpoint")
    parser.add_argument("--sweep", type=int, default=64, help="source images, controlled sweep")
    parser.add_argument("--base-scale", type=float, default=0.6, help="the sweep's middle scale")
    parser.add_argument("--data-root", type=Path, default=None, help="the source images' folder")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("outputs/pose-use"))
    args = parser.parse_args(argv)
    if args.images < 1 or args.sweep < 0:
        parser.error("--images must be >= 1 and --sweep >= 0")
    if not 0.3 <= args.base_scale <= 1:
        parser.error("--base-scale must lie in the data's object scales, 0.3 .. 1")
    for path in args.checkpoints:
        if not path.is_file():
            parser.error(f"no checkpoint at {path}")
    return args


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_cli(args.threads)
    started = time.perf_counter()
    bar = tqdm(total=2 * len(args.checkpoints), desc="pose use", unit="step")
    with bar:
        results = [analyse(path, args, bar) for path in args.checkpoints]
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(
        args.out / "pose_use.csv",
        [{"model": r["name"], **row} for r in results for row in r["rows"]],
    )
    plot(results, args.out / "pose_use.png")
    text = markdown(results, args, seconds)
    (args.out / "pose_use.md").write_text(text, "utf-8")
    print(text, end="")
    log.info("wrote %s (%.0f s)", args.out, seconds)
    return 0


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
