"""Stability sweeps: how a classifier's prediction moves as its input is rotated, rescaled
and deformed (what the paper measures), in numpy and scipy (``serve.transforms``: the same
conventions as the project's torch transforms, no torch needed).

One request builds, per model input size, a batch ``[1 + n_rot + n_scale + n_def, C, H, W]``:
the prepared image (the model's size, [0, 1]) followed by

- rotation: by 0..360 degrees about the centre (quarter turns are exact pixel
  permutations, the rest bilinear, zero fill);
- scale: by log-spaced factors (one of them exactly 1), over the RS training range (0.3 to
  1 of the original object) and beyond, relative to the image as given;
- deformation: ``D_tau x = x(u - tau(u))`` (paper eq. 10) along one seeded smooth random
  field ``tau`` scaled so that ``|grad tau|_inf`` runs from 0 to 0.2 (assumption A3: < 1/5).

Each model runs the distinct images of its batch in one call (the web page runs one call
per sweep, rotation first). Per sweep step it reports the probability of the class
predicted for the unperturbed image and the top-1 label; a sweep's *agreement* is the
fraction of its steps whose top-1 label equals the unperturbed one, and the model's
stability number is the rotation agreement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from PIL import Image

from .classifier import softmax
from .transforms import rotate_scale, smooth_field, sup_slope, warp

__all__ = [
    "SweepSpec",
    "Sweep",
    "SweepResult",
    "ModelStability",
    "StabilityReport",
    "build_sweeps",
    "probabilities",
    "measure_stability",
    "join_reports",
    "plot_report",
    "thumbnails",
    "TRAIN_SCALE_RANGE",
]

SWEEP_NAMES = ("rotation", "scale", "deformation")
TRAIN_SCALE_RANGE = (0.3, 1.0)  # RS-MNIST / RS-Fashion object scales (paper Section 5.1)


@dataclass(frozen=True)
class SweepSpec:
    """What the stability panel sweeps over."""

    rotation_steps: int = 24  # angles 0, 360/n, ... degrees (every 15 degrees)
    scale_range: tuple[float, float] = (0.2, 1.5)  # factors, log-spaced, 1 included
    scale_steps: int = 12
    max_deformation: float = 0.2  # largest |grad tau|_inf
    deformation_steps: int = 6  # 0 .. max_deformation, evenly spaced
    seed: int = 0  # of the deformation field

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale_range", tuple(float(v) for v in self.scale_range))
        for name in ("rotation_steps", "scale_steps", "deformation_steps"):
            steps = getattr(self, name)
            if not 2 <= steps <= 180:
                raise ValueError(f"{name} must lie in 2..180, got {steps}")
        low, high = self.scale_range
        if not 0 < low < high <= 4:
            raise ValueError(
                f"scale_range must be (low, high) with 0 < low < high <= 4, got {self.scale_range}"
            )
        if not 0 < self.max_deformation < 1:
            raise ValueError(f"max_deformation must lie in (0, 1), got {self.max_deformation}")

    def values(self) -> dict[str, np.ndarray]:
        """Sweep name -> parameter values (degrees, scale factors, |grad tau|_inf)."""
        return {
            "rotation": np.arange(self.rotation_steps) * (360.0 / self.rotation_steps),
            "scale": self._scales(),
            "deformation": np.linspace(0.0, self.max_deformation, self.deformation_steps),
        }

    def _scales(self) -> np.ndarray:
        """Log-spaced factors; when the range holds 1, exactly 1 is one of them (the
        unperturbed image) and each side of it is evenly log-spaced."""
        low, high = self.scale_range
        n = self.scale_steps
        if n < 3 or not low < 1 < high:
            return np.geomspace(low, high, n)
        below, above = -math.log(low), math.log(high)
        k = min(max(round((n - 1) * below / (below + above)), 1), n - 2)  # steps below 1
        return np.exp(
            np.concatenate([np.linspace(-below, 0, k + 1), np.linspace(0, above, n - k)[1:]])
        )

    @property
    def batch_size(self) -> int:
        """Images per model per request: the unperturbed one and every sweep step."""
        return 1 + self.rotation_steps + self.scale_steps + self.deformation_steps


UNITS = {"rotation": "degrees", "scale": "factor", "deformation": "|grad tau|_inf"}


@dataclass(frozen=True, eq=False)
class Sweep:
    """One transform swept over ``values``; images float32 ``[n, C, H, W]`` in [0, 1]."""

    name: str
    values: np.ndarray
    images: np.ndarray

    @property
    def unit(self) -> str:
        return UNITS[self.name]


def build_sweeps(
    image: np.ndarray, spec: SweepSpec, names: Sequence[str] = SWEEP_NAMES
) -> list[Sweep]:
    """The named sweeps (default: rotation, scale and deformation) of one prepared image
    ``[C, H, W]``."""
    if image.ndim != 3:
        raise ValueError(f"expected a prepared image [C, H, W], got shape {image.shape}")
    unknown = set(names) - set(SWEEP_NAMES)
    if unknown:
        raise ValueError(f"unknown sweeps {sorted(unknown)}; the sweeps are {SWEEP_NAMES}")
    x = np.ascontiguousarray(image, dtype=np.float32)  # [C, H, W]
    values = spec.values()
    return [
        Sweep(name, values[name], _swept(x, name, values[name], spec.seed))
        for name in SWEEP_NAMES
        if name in names
    ]


def _swept(x: np.ndarray, name: str, values: np.ndarray, seed: int) -> np.ndarray:
    """``x [C, H, W]`` at each step of one sweep -> float32 ``[n, C, H, W]`` in [0, 1]."""
    if name == "rotation":
        steps = [rotate_scale(x, float(degrees)) for degrees in values]
    elif name == "scale":
        steps = [rotate_scale(x, 0.0, float(factor)) for factor in values]
    else:
        field_ = smooth_field(*x.shape[-2:], seed)
        unit = field_ / sup_slope(field_)  # |grad tau|_inf = 1
        steps = [warp(x, float(norm) * unit) for norm in values]
    return np.clip(np.stack(steps), 0, 1).astype(np.float32)


def probabilities(classifier: Any, batch: np.ndarray) -> np.ndarray:
    """Softmax over one ``run_logits`` call. batch float32 ``[N, C, H, W]`` in [0, 1]
    -> ``[N, classes]``."""
    return softmax(classifier.run_logits(classifier.normalize(batch)))


@dataclass(frozen=True, eq=False)
class SweepResult:
    """One model on one sweep: P(unperturbed top-1 class) and top-1 per step."""

    name: str
    values: np.ndarray
    probability: np.ndarray  # [n]
    top1: list[str]
    agreement: float  # fraction of steps whose top-1 is the unperturbed one

    @property
    def unit(self) -> str:
        return UNITS[self.name]

    def changes(self, label: str) -> str:
        """Where along the sweep the top-1 differs from ``label``, in words: runs of
        neighbouring steps with the same other label, e.g. "Dress at 150 deg, Trouser at
        285-300 deg", or "Sandal at all 24 angles" when it never changes."""
        if all(t == label for t in self.top1):
            noun = {"rotation": "angles", "scale": "scales", "deformation": "strengths"}
            return f"{label} at all {len(self.top1)} {noun.get(self.name, 'steps')}"
        runs: dict[str, list[str]] = {}
        i = 0
        while i < len(self.top1):
            j = i
            while j + 1 < len(self.top1) and self.top1[j + 1] == self.top1[i]:
                j += 1
            if self.top1[i] != label:
                runs.setdefault(self.top1[i], []).append(self._span(i, j))
            i = j + 1
        return ", ".join(f"{other} at {', '.join(where)}" for other, where in runs.items())

    def _span(self, i: int, j: int) -> str:
        """Steps i..j as text: "150 deg", "285-300 deg", "x0.2-x0.33", "0.12-0.2"."""
        if self.name == "rotation":
            a, b = (f"{float(self.values[k]):g}" for k in (i, j))
            return f"{a} deg" if i == j else f"{a}-{b} deg"
        form = "x{:.2g}" if self.name == "scale" else "{:.2g}"
        a, b = (form.format(float(self.values[k])) for k in (i, j))
        return a if i == j else f"{a}-{b}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "values": [round(float(v), 6) for v in self.values],
            "probability": [round(float(p), 6) for p in self.probability],
            "top1": list(self.top1),
            "agreement": round(self.agreement, 6),
        }


@dataclass(frozen=True, eq=False)
class ModelStability:
    """One model's prediction on the unperturbed image and its sweeps."""

    model: str
    label: str
    index: int
    score: float
    probabilities: np.ndarray  # [classes], of the unperturbed image
    sweeps: dict[str, SweepResult]

    @property
    def stability(self) -> float:
        """The single number: fraction of the rotation sweep with an unchanged top-1."""
        return self.sweeps["rotation"].agreement

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "label": self.label,
            "index": self.index,
            "score": round(self.score, 6),
            "stability": round(self.stability, 6),
            "sweeps": {name: result.to_dict() for name, result in self.sweeps.items()},
            # where the top-1 label differs, in words ("Dress at 150 deg, ...")
            "changes": {name: result.changes(self.label) for name, result in self.sweeps.items()},
        }


@dataclass(frozen=True, eq=False)
class StabilityReport:
    """All models on one image; ``sweeps`` holds the inputs of the first model's size."""

    spec: SweepSpec
    models: list[ModelStability]
    sweeps: list[Sweep] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stability_definition": "fraction of the rotation sweep whose top-1 label equals "
            "the unperturbed top-1 label",
            "batch_size": self.spec.batch_size,
            "deformation_seed": self.spec.seed,
            "models": [m.to_dict() for m in self.models],
        }


def measure_stability(
    classifiers: Sequence[Any],
    image: Any,
    *,
    spec: SweepSpec | None = None,
    names: Sequence[str] | None = None,
    sweeps: Sequence[str] = SWEEP_NAMES,
) -> StabilityReport:
    """Sweep ``image`` (anything ``Classifier.prepare`` accepts) through every classifier.
    Each classifier runs once, on the distinct images among the unperturbed one and all sweep
    steps (``distinct_rows``) as one batch.
    ``names``: what the report calls each model (default: ``classifier.name``); ``sweeps``:
    which sweeps to run (a report of some of them joins with the rest by ``join_reports``)."""
    spec = spec or SweepSpec()
    if not classifiers:
        raise ValueError("need at least one classifier")
    names = list(names) if names is not None else [clf.name for clf in classifiers]
    chosen = tuple(sweeps)
    built: list[tuple[np.ndarray, list[Sweep]]] = []  # models of one input size share sweeps
    results: list[ModelStability] = []
    for clf, name in zip(classifiers, names, strict=True):
        prepared = np.asarray(clf.prepare(image), dtype=np.float32)[0]  # [C, H, W]
        swept = next(
            (s for p, s in built if p.shape == prepared.shape and (p == prepared).all()), None
        )
        if swept is None:
            swept = build_sweeps(prepared, spec, names=chosen)
            built.append((prepared, swept))
        # one batch per model: the unperturbed image first, then every sweep step; each
        # distinct image runs once (see distinct_rows)
        batch = np.concatenate([prepared[None]] + [s.images for s in swept])
        unique, inverse = distinct_rows(batch, swept, quarter_turns=_turn_invariant(clf))
        probs = probabilities(clf, batch[unique])[inverse]  # [1 + steps, classes]
        results.append(_summarise(name, clf.class_names, probs, swept))
    return StabilityReport(spec, results, built[0][1])


def join_reports(parts: Sequence[StabilityReport]) -> StabilityReport:
    """One report of several on one image: each of other models, or of other sweeps of the
    same models (the web app sweeps rotation first, then scale, then deformation). Models
    keep their first-seen order; the unperturbed prediction is the first part's."""
    if not parts:
        raise ValueError("need at least one report")
    models: dict[str, ModelStability] = {}
    for part in parts:
        for m in part.models:
            seen = models.get(m.model)
            models[m.model] = (
                m if seen is None else replace(seen, sweeps={**seen.sweeps, **m.sweeps})
            )
    inputs = {sweep.name: sweep for part in reversed(parts) for sweep in part.sweeps}
    ordered = [inputs[name] for name in SWEEP_NAMES if name in inputs]
    return StabilityReport(parts[0].spec, list(models.values()), ordered)


def _turn_invariant(classifier: Any) -> bool:
    """The export measured the model's logits unchanged under quarter turns."""
    meta = getattr(classifier, "metadata", None)
    return isinstance(meta, dict) and meta.get("rstcnn.quarter_turn_invariant") is True


def distinct_rows(
    batch: np.ndarray, sweeps: Sequence[Sweep], *, quarter_turns: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Which rows of a sweep batch (the unperturbed image, then each sweep's steps) a model
    must run: ``unique`` row indices and ``inverse`` with ``batch[unique][inverse]`` standing
    for ``batch``. Bit-identical images run once (the unperturbed image is also step 0 of
    the rotation and deformation sweeps and the scale factor 1). With ``quarter_turns`` (a
    model whose logits do not change under quarter turns of its input), the image rotated
    by ``a + 90 k`` degrees is that rotated by ``a`` turned k quarter turns about the centre,
    so it runs only at ``a`` when ``a`` is also a step: 24 rotation steps need 6 images."""
    alias = list(range(len(batch)))
    start = 1
    for sweep in sweeps:
        if quarter_turns and sweep.name == "rotation":
            angles = np.asarray(sweep.values, dtype=np.float64)
            for i, angle in enumerate(angles):
                same = np.flatnonzero(np.isclose(angles, angle % 90.0, atol=1e-9))
                if len(same) and same[0] != i:
                    alias[start + i] = start + int(same[0])
        start += len(sweep.values)
    seen: dict[bytes, int] = {}
    for i in range(len(batch)):
        if alias[i] == i:
            alias[i] = seen.setdefault(np.ascontiguousarray(batch[i]).tobytes(), i)
    roots = [alias[alias[i]] for i in range(len(batch))]
    unique, inverse = np.unique(roots, return_inverse=True)
    return unique, inverse


def _summarise(
    model: str, class_names: Sequence[str], probs: np.ndarray, sweeps: list[Sweep]
) -> ModelStability:
    names = list(class_names)
    index = int(probs[0].argmax())
    top = probs.argmax(axis=1)
    out: dict[str, SweepResult] = {}
    start = 1
    for sweep in sweeps:
        stop = start + len(sweep.values)
        top1 = top[start:stop]
        out[sweep.name] = SweepResult(
            sweep.name,
            sweep.values,
            probs[start:stop, index],
            [names[i] for i in top1],
            float(np.mean(top1 == index)),
        )
        start = stop
    return ModelStability(model, names[index], index, float(probs[0, index]), probs[0], out)


_TITLES = {
    "rotation": ("Rotation", "angle (degrees)"),
    "scale": ("Scale", "scale factor (log axis)"),
    "deformation": ("Deformation $D_\\tau$", "$|\\nabla\\tau|_\\infty$"),
}


def plot_report(
    report: StabilityReport, *, display_names: dict[str, str] | None = None, stacked: bool = False
) -> Figure:
    """Probability of the unperturbed prediction along each sweep, one line per model;
    crosses mark steps whose top-1 label changed. A ``Figure`` without pyplot (PNG by Agg).
    The sweeps side by side, or ``stacked`` one above the other (for narrow screens)."""
    names = display_names or {}
    shape = (len(SWEEP_NAMES), 1) if stacked else (1, len(SWEEP_NAMES))
    fig = Figure(figsize=(5.2, 11) if stacked else (13, 3.9), layout="constrained")
    axes = fig.subplots(*shape, sharey=True).ravel()
    colours = matplotlib.colormaps["tab10"].colors
    for ax, sweep_name in zip(axes, SWEEP_NAMES, strict=True):
        title, xlabel = _TITLES[sweep_name]
        ax.set_title(title)
        if any(sweep_name not in m.sweeps for m in report.models):  # not swept yet
            ax.text(0.5, 0.5, "measuring...", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        for k, model in enumerate(report.models):
            result = model.sweeps[sweep_name]
            colour = colours[k % len(colours)]
            shown = names.get(model.model, model.model)
            ax.plot(
                result.values,
                result.probability,
                "-o",
                color=colour,
                markersize=3,
                label=f"{shown}: '{model.label}', top-1 kept {result.agreement:.0%}",
            )
            flipped = np.array([label != model.label for label in result.top1])
            if flipped.any():
                ax.plot(
                    result.values[flipped],
                    result.probability[flipped],
                    "x",
                    color=colour,
                    markersize=7,
                    markeredgewidth=1.5,
                )
        if sweep_name == "scale":
            ax.set_xscale("log")
            ax.axvspan(*TRAIN_SCALE_RANGE, color="0.9", zorder=0, label="training scales 0.3-1")
            ticks = [t for t in (0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0) if _within(t, result)]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        if sweep_name == "rotation":
            ax.set_xticks(np.arange(0, 361, 90))
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    axes[0].set_ylabel("P(unperturbed top-1 class)")
    fig.suptitle("Prediction stability (x: top-1 label changed)")
    return fig


def _within(value: float, result: SweepResult) -> bool:
    return result.values.min() * 0.999 <= value <= result.values.max() * 1.001


def thumbnails(
    report: StabilityReport, *, per_sweep: int = 6, zoom: int = 2
) -> list[tuple[Image.Image, str]]:
    """Evenly picked transformed inputs of each sweep, captioned with the step and the
    models' top-1 labels in report order (``rot 90°: Coat | Shirt``).
    -> [(grey or RGB PIL image, caption)]."""
    out: list[tuple[Image.Image, str]] = []
    for sweep in report.sweeps:
        picks = np.unique(np.linspace(0, len(sweep.values) - 1, per_sweep).round().astype(int))
        for i in picks:
            labels = " | ".join(m.sweeps[sweep.name].top1[i] for m in report.models)
            out.append(
                (_to_pil(sweep.images[i], zoom), f"{_step(sweep.name, sweep.values[i])}: {labels}")
            )
    return out


def _step(name: str, value: float) -> str:
    if name == "rotation":
        return f"rot {value:.0f}\N{DEGREE SIGN}"
    if name == "scale":
        return f"x{value:.2f}"
    return f"def {value:.2f}"


def _to_pil(image: np.ndarray, zoom: int) -> Image.Image:
    """[C, H, W] in [0, 1] -> a grey (C = 1) or RGB picture, enlarged ``zoom`` times."""
    pixels = np.clip(np.rint(image * 255), 0, 255).astype(np.uint8)
    picture = Image.fromarray(pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0))
    return picture.resize((picture.width * zoom, picture.height * zoom), Image.NEAREST)
