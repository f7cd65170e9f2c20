"""train/run.py under torchrun: two gloo processes on the CPU, tiny synthetic RS-Fashion."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_train import REPO, SCRIPT, cli, env, metrics, source  # noqa: F401 (fixtures)

from rstmodel import load_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch without torch.distributed"
)


def torchrun(args: list[str], environ: dict[str, str], procs: int = 2) -> tuple[int, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={procs}", str(SCRIPT), *args]
    proc = subprocess.run(
        command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=120, check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_two_processes_write_the_one_process_files(tmp_path, source, env):  # noqa: F811
    # RSTCNN_ALLOCATOR=retain: run.py must not re-exec itself under torchrun
    ddp_env = {**env, "OMP_NUM_THREADS": "1", "RSTCNN_ALLOCATOR": "retain"}
    single, double = tmp_path / "one", tmp_path / "two"
    assert (
        subprocess.run(
            [sys.executable, str(SCRIPT), *cli(source, single, "--epochs", "2")],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=120,
            check=False,
        ).returncode
        == 0
    )
    code, log = torchrun(cli(source, double, "--epochs", "2", "--augment"), ddp_env)
    assert code == 0, log
    assert log.count("test accuracy:") == 1  # rank 0 alone reports

    one, two = metrics(single), metrics(double)
    assert [r["epoch"] for r in two] == [1, 2]
    assert [set(r) for r in two] == [set(r) for r in one]
    assert all(0 <= r["train_acc"] <= 1 and 0 <= r["val_acc"] <= 1 for r in two)

    model, meta = load_checkpoint(double / "best.pt")
    assert meta.model_name == "cnn" and meta.metrics["epoch"] in (1, 2)
    raw = torch.load(double / "last.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in raw["state_dict"])
    assert raw["extra"]["env"]["processes"] == 2

    summary = json.loads((double / "summary.json").read_text())
    assert set(json.loads((single / "summary.json").read_text())) | {"processes"} == set(summary)
    assert summary["processes"] == 2 and summary["test_size"] == 64  # the whole test split
    assert summary["val_images"] == 64 and summary["train_images"] == 128

    # --resume under torchrun: every rank loads last.pt, then best.pt is tested again
    (double / "summary.json").unlink()
    code, log = torchrun(cli(source, double, "--epochs", "2", "--augment", "--resume"), ddp_env)
    assert code == 0, log
    assert [r["epoch"] for r in metrics(double)] == [1, 2]
