"""Prepared arrays on disk: a compressed ``.npz`` plus a JSON manifest beside it.

The manifest records what the arrays are (data set, source, seed, parameters, sizes) and a
sha256 of the arrays themselves; ``load_cached`` returns nothing, with the reason logged,
when the files are missing, the manifest disagrees with what the caller expects, or the
checksum fails, so the caller re-prepares. Writes go to a temporary name first and are
renamed into place, arrays before manifest, so an interrupted write never verifies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CACHE_FORMAT",
    "arrays_sha256",
    "default_cache_dir",
    "manifest_path",
    "save_cached",
    "load_cached",
]

log = logging.getLogger(__name__)

CACHE_FORMAT = 1


def arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over each array's name, dtype, shape and bytes, names in sorted order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}\n".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def manifest_path(path: Path) -> Path:
    """``x/realisation0.npz -> x/realisation0.json``."""
    return path.with_suffix(".json")


def _replace_atomically(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_cached(
    path: str | Path, arrays: Mapping[str, np.ndarray], manifest: Mapping[str, Any]
) -> dict:
    """Write ``arrays`` to ``path`` (.npz, zlib) and the manifest to ``path.json``.

    The manifest written is ``manifest`` plus ``format``, ``arrays`` (dtype and shape of
    each) and ``sha256`` (``arrays_sha256``); it is returned.
    """
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"cache files end in .npz, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {
        **manifest,
        "format": CACHE_FORMAT,
        "arrays": {
            name: {"dtype": a.dtype.str, "shape": list(a.shape)} for name, a in arrays.items()
        },
        "sha256": arrays_sha256(arrays),
    }
    _replace_atomically(path, lambda handle: np.savez_compressed(handle, **arrays))
    text = json.dumps(full, indent=2, sort_keys=True) + "\n"
    _replace_atomically(manifest_path(path), lambda handle: handle.write(text.encode()))
    return full


def load_cached(
    path: str | Path, expect: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], dict] | None:
    """The arrays and manifest at ``path`` if both exist, the manifest equals ``expect`` on
    each of its keys and the arrays match their checksum; otherwise None (reason logged)."""
    path = Path(path)
    meta = manifest_path(path)
    if not path.is_file() or not meta.is_file():
        log.info("no cache at %s", path)
        return None
    try:
        manifest = json.loads(meta.read_text())
    except (OSError, json.JSONDecodeError) as err:
        log.warning("unreadable manifest %s (%s); preparing again", meta, err)
        return None
    wanted = {"format": CACHE_FORMAT, **expect}
    for key, value in wanted.items():
        if manifest.get(key) != value:
            log.warning(
                "cache %s was made with %s=%r, now %r; preparing again",
                path,
                key,
                manifest.get(key),
                value,
            )
            return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
        log.warning("unreadable cache %s (%s); preparing again", path, err)
        return None
    if arrays_sha256(arrays) != manifest.get("sha256"):
        log.warning("checksum mismatch in %s; preparing again", path)
        return None
    return arrays, manifest


def default_cache_dir() -> Path:
    """``$RSTCNN_DATA`` if set; else ``data/`` at the repository root when this package sits
    in a checkout (a ``pyproject.toml`` two levels up); else ``~/.cache/rstcnn``."""
    env = os.environ.get("RSTCNN_DATA")
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return root / "data"
    return Path.home() / ".cache" / "rstcnn"
