"""The wheel as a user installs it: one ``rstcnn`` namespace (nothing installed as top-level
``train``, ``export`` or ``serve``), the gallery inside it, and every console command."""

from __future__ import annotations

import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [
    "rstcnn-train",
    "rstcnn-export",
    "rstcnn-serve",
    "rstcnn-prepare-data",
    "rstcnn-reproduce",
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    done = subprocess.run([*cmd, "-w", str(out), str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = out.glob("rstcnn-*.whl")
    return found


def test_the_wheel_holds_one_namespace_and_the_gallery(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rstcnn", "rstmodel"}
    assert "rstcnn/serve/gallery/samples.json" in names
    for source in ("_joined_rows.c", "_joined_rows_portable.c", "_kernels_common.h"):
        assert f"rstmodel/layers/{source}" in names  # the compiled kernels' sources
    assert any(n.startswith("rstcnn/serve/gallery/") and n.endswith(".png") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert all(f"{c} = " in text for c in COMMANDS)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA")))
    requires = [line for line in metadata.decode().splitlines() if line.startswith("Requires-Dist")]
    torch = [line for line in requires if line.startswith("Requires-Dist: torch")]
    versions = [line.split(";")[0] for line in torch]
    assert versions and all(">=" in v and "==" not in v for v in versions)  # ranges, no pins
    assert not any("torch" in line and 'extra == "serve"' in line for line in requires)


def test_each_command_runs_from_a_fresh_environment(wheel, tmp_path):
    """A new virtual environment (its dependencies seen through a .pth to this one's
    site-packages), the wheel installed into it, each command's --help run outside the
    checkout; and ``import train`` fails there (no top-level module of that name)."""
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for command in COMMANDS:
        done = subprocess.run(
            [str(env / "bin" / command), "--help"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
        )
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
        assert "usage:" in done.stdout, command
    where = subprocess.run(
        [str(python), "-c", "import rstcnn.serve, sys; print(rstcnn.serve.__file__); import train"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert where.stdout.startswith(str(env)), where.stdout  # the wheel's copy, not the checkout
    assert "No module named 'train'" in where.stderr
