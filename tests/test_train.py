"""train/run.py end to end on a tiny synthetic RS-Fashion, exact resume, train/report.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rstcnn.train import engine, fastpath, precision_check, report, resampling, run, step_cost
from rstcnn.train.budgets import SWEEP_MODELS
from rstmodel import create_model, load_checkpoint
from rstmodel.data import ArrayDataset, RSConfig, VariantDataset, collate, load_rs
from rstmodel.layers import ConvMethod
from rstmodel.precision import (
    bf16_supported,
    inference,
    int8_products,
    int8_supported,
    int16_products,
    int16_supported,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "train" / "run.py"
THREADS = os.environ.get("RST_TEST_THREADS", "1")
TINY_CNN = ("--model-arg", "channels=(4,6,8)", "--model-arg", "hidden=16")


def write_idx(path: Path, array: np.ndarray) -> None:
    """An uncompressed IDX file of uint8 data: magic 0x00000800 + ndim, big-endian dims."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict[str, Path]:
    """400 random 28x28 images as IDX files, and an RS cache prepared from them."""
    root = tmp_path_factory.mktemp("source")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(400, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=400, dtype=np.uint8)
    write_idx(root / "train-images-idx3-ubyte", images[:300])
    write_idx(root / "train-labels-idx1-ubyte", labels[:300])
    write_idx(root / "t10k-images-idx3-ubyte", images[300:])
    write_idx(root / "t10k-labels-idx1-ubyte", labels[300:])
    cache = tmp_path_factory.mktemp("cache")
    load_rs(RSConfig("rs-fashion"), cache_dir=cache, data_root=root)  # subprocesses reuse it
    return {"root": root, "cache": cache}


@pytest.fixture
def env(source, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("RSTCNN_DATA", str(source["cache"]))
    # RSTCNN_ALLOCATOR=system: no re-exec (it would import torch twice per launch)
    extra = {"RSTCNN_DATA": str(source["cache"]), "RSTCNN_ALLOCATOR": "system"}
    return {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}


def cli(source: dict[str, Path], out: Path, *extra: str, model: str = "cnn") -> list[str]:
    """Arguments for a tiny run: 128 train / 64 validation / 64 test images."""
    return [
        "--model",
        model,
        "--data",
        "rs-fashion",
        "--data-root",
        str(source["root"]),
        "--train-size",
        "128",
        "--val-size",
        "64",
        "--limit-test",
        "64",
        "--batch-size",
        "32",
        "--threads",
        THREADS,
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]


def launch(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpointed_an_epoch(out: Path) -> bool:
    """metrics.jsonl has a line and last.pt was replaced after it (epoch >= 1 saved)."""
    last, lines = out / "last.pt", out / "metrics.jsonl"
    try:
        return bool(metrics(out)) and last.stat().st_mtime_ns >= lines.stat().st_mtime_ns
    except FileNotFoundError:
        return False


def without_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("time_s")} for r in records]


def assert_same_weights(a: Path, b: Path) -> None:
    first = torch.load(a, weights_only=True)
    second = torch.load(b, weights_only=True)
    assert first["state_dict"].keys() == second["state_dict"].keys()
    for key, value in first["state_dict"].items():
        assert torch.equal(value, second["state_dict"][key]), f"{key} differs"
    assert first["extra"]["epoch"] == second["extra"]["epoch"]


def test_end_to_end_rst_model(tmp_path, source, env):
    out = tmp_path / "run"
    args = cli(source, out, "--epochs", "2", "--limit-train", "32", "--augment", model="rst_cnn_fb")
    args += ["--model-arg", "channels=(4,6,8)", "--model-arg", "hidden=16"]
    env = {k: v for k, v in env.items() if k != "RSTCNN_ALLOCATOR"}  # the real entry: re-exec
    code, log = finish(launch(args, env))
    assert code == 0, log
    assert "device: cpu" in log

    records = metrics(out)
    assert [r["epoch"] for r in records] == [1, 2]
    assert [r["lr"] for r in records] == pytest.approx([0.01, 0.001])  # tenfold after half
    for r in records:
        assert {"train_loss", "train_acc", "val_loss", "val_acc", "time_s"} <= set(r)
        assert 0 <= r["train_acc"] <= 1 and 0 <= r["val_acc"] <= 1 and r["time_s"] > 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "rst_cnn_fb" and summary["augment"] is True
    assert (summary["train_images"], summary["val_images"], summary["test_size"]) == (32, 64, 64)
    assert 0 <= summary["test_acc"] <= 1 and summary["best_epoch"] in (1, 2)
    best_val = max(r["val_acc"] for r in records)
    assert summary["best_val_acc"] == best_val
    assert "train/run.py" in summary["command"] and summary["train_seconds"] > 0
    assert summary["config"]["channels"] == [4, 6, 8]

    model, meta = load_checkpoint(out / "best.pt")
    assert model.config.channels == (4, 6, 8) and meta.model_name == "rst_cnn_fb"
    assert meta.class_names[-1] == "Ankle boot" and meta.input_size == 56
    assert len(meta.mean) == 1 and meta.std[0] > 0
    assert meta.metrics["epoch"] == summary["best_epoch"]
    assert meta.metrics["test_acc"] == summary["test_acc"]  # written back after the test


def test_killed_and_interrupted_runs_resume_exactly(tmp_path, source, env):
    epochs = ["--epochs", "3", "--augment", "--workers", "1"]  # workers: forked, seeded per epoch
    whole, killed, stopped = tmp_path / "whole", tmp_path / "killed", tmp_path / "stopped"
    reference = launch(cli(source, whole, *epochs), env)
    victims = {
        killed: (launch(cli(source, killed, *epochs), env), signal.SIGKILL),
        stopped: (launch(cli(source, stopped, *epochs), env), signal.SIGINT),
    }
    pending = dict(victims)
    deadline = time.monotonic() + 60
    while pending and time.monotonic() < deadline:  # signal each after its first epoch
        for out, (proc, sig) in list(pending.items()):
            if checkpointed_an_epoch(out):
                proc.send_signal(sig)
                del pending[out]
        time.sleep(0.01)
    assert not pending, "no epoch finished within 60 s"

    code, log = finish(victims[killed][0])
    assert code == -signal.SIGKILL, log
    code, log = finish(victims[stopped][0])
    assert code == 130, log
    assert "--resume" in log and "Traceback" not in log
    for out in (killed, stopped):
        assert not (out / "summary.json").exists(), "the run finished before the signal"
        assert 1 <= torch.load(out / "last.pt", weights_only=True)["extra"]["epoch"] < 3

    resumed = [launch(cli(source, out, *epochs, "--resume"), env) for out in (killed, stopped)]
    for proc in [reference, *resumed]:
        code, log = finish(proc)
        assert code == 0, log

    for out in (killed, stopped):
        for name in ("last.pt", "best.pt"):
            assert_same_weights(whole / name, out / name)
        assert without_times(metrics(out)) == without_times(metrics(whole))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["test_acc"] == json.loads((whole / "summary.json").read_text())["test_acc"]


def test_gpu_session_script_dry_run_on_cpu(tmp_path, source, pipelines_run):
    """scripts/gpu_session.sh, what a lent GPU machine runs, on the CPU with a tiny budget:
    it renders the protocol's realisations, times and profiles the fast path, runs the
    protocol's shards side by side with its flags into the committed record, carries an
    unfinished run to the next call, and leaves exactly the files that come back."""
    from rstmodel.precision import bf16_supported

    out, work, record = tmp_path / "out", tmp_path / "work", tmp_path / "record"
    # bfloat16 where this CPU runs it; where it would be emulated (minutes a step), float32
    bf16 = "--bf16 " if bf16_supported() else ""
    settings = {
        "DEVICE": "cpu",
        "DEADLINE": "300",
        "REPRO_BUDGET": "smoke",
        "REPRO_SIZES": "64",
        "RESULTS": str(record),
        "RESUME": str(tmp_path / "nothing-to-resume"),
        "REPRO_FLAGS": "",  # float32 on the CPU (the GPU default is --bf16)
        # trials 0 and 1 of cnn and scale_cnn in two processes side by side
        "SHARDS": "rst_cnn_fb@1 cnn,scale_cnn@0-0 cnn,scale_cnn@1-1",
        "FASTPATH_ALIGNED": "(8,8,8)",  # the whole step again at other widths
        "FASTPATH_SETTINGS": "bf16;bf16 torch" if bf16 else "fp32;tf32",
        "STEP_COST_ARGS": f"--batch 2 {bf16}--model-arg channels=(4,6,8) --model-arg hidden=16",
        "FASTPATH_ARGS": "--steps 1 --batch 8 --profile --align-probe --model-arg channels=(4,6,8)",
        "DATA_ROOT": str(source["root"]),
        "WORK": str(work),
        "OUT": str(out),
        "PY": sys.executable,
        "RSTCNN_ALLOCATOR": "system",
        "SPLIT_LIMIT": "8",  # the served file against its checkpoint on the last 8 test images
        "SPLIT_THREADS": "1",
        "K_SWEEP": "1",
        "K_SWEEP_SIZE": "64",
        "KERNEL_PROBE_ARGS": f"--batch 2 --steps 1 {bf16}--model-arg channels=(4,6,8)",
        "KERNEL_CHECK_LIMIT": "8",  # a checkpoint of this small source (the shipped one's is 70K)
        "KERNEL_CHECK_CHECKPOINT": str(pipelines_run / "best.pt"),
    }

    def session(**more):
        proc = subprocess.run(
            ["bash", "scripts/gpu_session.sh"],
            cwd=REPO,
            env={**os.environ, **settings, **more},
            capture_output=True,
            text=True,
            # ~50 s a call on an idle 2-core CPU; a hang guard with room for a loaded machine
            # (600 s was hit twice beside a training run under nice)
            timeout=1800,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    stdout = session()
    assert "data ready: 3 renderings" in stdout, stdout
    assert "fastest training setting: flags" in stdout and "device busy per step" in stdout
    assert "past the deadline" not in stdout  # every shard finished in time
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "record.tgz", "split-check.tgz"]
    with tarfile.open(out / "split-check.tgz") as tar:
        check = json.load(tar.extractfile("split-check/split-check-rst_cnn_fb.int8.json"))
        eager = json.load(tar.extractfile("split-check/split-check-rst_cnn_fb.eager.json"))
    assert check["images"] == check["of"] == 8 and check["precision"] == "int8"
    # the checkpoint as the app serves it by eager torch: int8 products, bf16 or int16
    # products, the first this CPU has (the shipped checkpoint's gates pass), else float32
    runs = [("int8", int8_supported()), ("bf16", bf16_supported()), ("int16", int16_supported())]
    served = next((p for p, ok in runs if ok), "fp32")
    assert eager["images"] == 8 and eager["precision"] == served
    assert eager["providers"] == [f"torch-{eager['precision']}"]
    assert stdout.count("8 of 8 images") == 2 and "split check: 8 of 8 images" in stdout
    with tarfile.open(out / "logs.tgz") as tar:
        rows = json.load(tar.extractfile("fastpath/fastpath.json"))
        assert {row["model"] for row in rows} == {"cnn", "rst_cnn_fb"}
        assert (
            "| kernel | launches / step |" in tar.extractfile("fastpath/profile.md").read().decode()
        )
        log = tar.extractfile("logs/session.log").read().decode()
        sweep = json.load(tar.extractfile("k-sweep/sweep.json"))
        assert "logs/fastpath.log" in tar.getnames()
        aligned = json.load(tar.extractfile("fastpath-aligned/fastpath.json"))
        assert {row["model"] for row in aligned} == {"cnn", "rst_cnn_fb"}
        cost = tar.extractfile("fastpath/step-cost.md").read().decode()
        assert "| **all** | all |" in cost and "- measured " in cost  # beside fastpath's time
        head = tar.extractfile("fastpath-aligned/fastpath.md").read().decode().splitlines()[0]
        assert head.endswith("rst_cnn_fb channels=(8, 8, 8)")  # the later --model-arg wins
        assert "| blocks.1.0 | (4, 6) |" in tar.extractfile("fastpath/align.md").read().decode()
        assert "| blocks.2.0 |" in tar.extractfile("fastpath/kernels.md").read().decode()
        # the shipped checkpoint with and without the fused kernels (here their stand-ins)
        if bf16_supported("cpu"):
            names = [f"logs/kernels-check-{k}.json" for k in ("torch", "triton")]
            checks = [json.load(tar.extractfile(name)) for name in names]
            assert [c["images"] for c in checks] == [8, 8]
            assert checks[0]["fp32_acc"] == checks[1]["fp32_acc"]
        else:
            assert "no native bfloat16" in tar.extractfile("logs/kernels-check.log").read().decode()
    # the sweep's report covers every sweep model; only rst_cnn_fb was trained here
    assert [r["model"] for r in sweep["rows"]] == list(SWEEP_MODELS)
    assert [(r["model"], r["trials"]) for r in sweep["rows"] if r["trials"]] == [("rst_cnn_fb", 1)]
    assert "k sweep: Verdict: no verdict yet" in log
    runs = sorted(p.name for p in (record / "runs").iterdir())
    assert runs == [
        "cnn-64-t0",
        "cnn-64-t1",
        "rst_cnn_fb-64-t0",
        "scale_cnn-64-t0",
        "scale_cnn-64-t1",
    ]
    with tarfile.open(out / "record.tgz") as tar:
        names = [n for n in tar.getnames() if n.endswith("/summary.json")]
    assert len(names) == 5
    assert "finished runs in the record: cnn-64-t0 cnn-64-t1 rst_cnn_fb-64-t0" in log

    # an unfinished run (last.pt, no summary) carried in as RESUME is picked up where it
    # stopped (rst_cnn_fb's trial, its summary taken away from both places); one no shard
    # runs comes back as its own resume-<run>.tgz
    resume = tmp_path / "resume"
    shutil.copytree(work / "reproduce", resume)
    for name in ("rst_cnn_fb-64-t0", "scale_cnn-64-t1"):  # scale_cnn: in no shard this time
        (resume / "rs-fashion" / "smoke" / name / "summary.json").unlink()
    shutil.rmtree(record / "runs" / "rst_cnn_fb-64-t0")
    shutil.rmtree(work)
    # a call that only runs shards: every measurement of the first call off
    off = ("FASTPATH_SETTINGS", "STEP_COST_ARGS", "KERNEL_PROBE_ARGS", "K_SWEEP")
    stdout = session(
        SHARDS="rst_cnn_fb@1",
        RESUME=str(resume),
        SPLIT_CHECKPOINT="",  # off
        KERNEL_CHECK_LIMIT="",
        **dict.fromkeys(off, ""),
    )
    assert sorted(p.name for p in (work / "logs").iterdir()) == [
        "prepare-0.log",
        "prepare-1.log",
        "prepare-2.log",
        "reproduce-rst_cnn_fb-1.log",
        "session.log",
    ]
    assert "resuming" in (work / "logs" / "reproduce-rst_cnn_fb-1.log").read_text().lower()
    summary = json.loads((record / "runs" / "rst_cnn_fb-64-t0" / "summary.json").read_text())
    assert summary["epochs"] == 1 and summary["train_images"] == 64
    assert sorted(p.name for p in out.glob("resume-*.tgz")) == ["resume-scale_cnn-64-t1.tgz"]
    assert "split check: 8 of 8" not in stdout  # SPLIT_CHECKPOINT="" turns it off
    with tarfile.open(out / "resume-scale_cnn-64-t1.tgz") as tar:
        assert "rs-fashion/smoke/scale_cnn-64-t1/last.pt" in tar.getnames()


def test_tf32_flag():
    assert run.parse_args([]).tf32 is True
    assert run.parse_args(["--no-tf32"]).tf32 is False


def test_unwritable_out_fails_before_training(tmp_path, source, env, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "run"
    assert run.main(cli(source, out, "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert "not a writable folder" in err and str(out) in err and "--out" in err


def test_too_little_disk_space_fails_before_training(tmp_path, source, env, monkeypatch, capsys):
    monkeypatch.setattr(engine.shutil, "disk_usage", lambda path: type("U", (), {"free": 4096})())
    out = tmp_path / "run"
    assert run.main(cli(source, out, "--epochs", "1")) == 2
    assert "MiB free" in capsys.readouterr().err
    assert not (out / "last.pt").exists() and not metrics(out)


def test_disk_full_mid_checkpoint_is_one_line(tmp_path, source, env, monkeypatch, capsys):
    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(engine, "save_checkpoint", full)
    monkeypatch.setattr(logging.root, "handlers", [])  # log to this test's captured stderr
    assert run.main(cli(source, tmp_path / "run", "--epochs", "1")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "disk is full" in line[0] and "--resume" in line[0]


def test_read_only_data_cache_is_one_line(tmp_path, source, env, monkeypatch, capsys):
    import rstmodel.data.cache as cache

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "fresh-cache"))  # nothing cached yet
    monkeypatch.setattr(cache, "_replace_atomically", read_only)
    monkeypatch.setattr(logging.root, "handlers", [])  # log to this test's captured stderr
    assert run.main(cli(source, tmp_path / "run", "--epochs", "1")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "read-only" in err and "RSTCNN_DATA" in err


def test_existing_runs_need_resume_with_the_same_settings(tmp_path, source, env, capsys):
    out = tmp_path / "run"
    assert run.main(cli(source, out, "--epochs", "1", "--limit-train", "32")) == 0
    assert run.main(cli(source, out, "--epochs", "1", "--limit-train", "32")) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (
        run.main(
            cli(source, out, "--epochs", "1", "--limit-train", "32", "--lr", "0.1", "--resume")
        )
        == 2
    )
    assert "lr: 0.01 -> 0.1" in capsys.readouterr().err
    before = (out / "summary.json").read_text()
    assert run.main(cli(source, out, "--epochs", "1", "--limit-train", "32", "--resume")) == 0
    assert (out / "summary.json").read_text() == before  # finished: nothing to do


def test_bf16_training_runs_and_is_a_setting(tmp_path, source, env, capsys, monkeypatch, caplog):
    out = tmp_path / "run"
    args = cli(source, out, "--epochs", "2", "--limit-train", "32", model="rst_cnn_fb")
    args += ["--model-arg", "channels=(4,6,8)", "--model-arg", "hidden=16"]
    monkeypatch.setenv("LD_PRELOAD", "")  # as a process not on jemalloc
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(engine, "bf16_supported", lambda device: True)
    assert run.main([*args, "--bf16"]) == 0
    assert "RSTCNN_ALLOCATOR=jemalloc" in caplog.text  # the tip
    assert "no native bfloat16" not in caplog.text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bf16"] is True and 0 <= summary["test_acc"] <= 1
    records = metrics(out)
    assert all(np.isfinite(r["train_loss"]) and np.isfinite(r["val_loss"]) for r in records)
    model, meta = load_checkpoint(out / "best.pt")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay float32
    assert meta.extra["run"]["bf16"] is True
    # resuming in another precision is refused; a checkpoint from before the setting
    # existed counts as float32
    assert run.main([*args, "--resume"]) == 2
    assert "bf16: True -> False" in capsys.readouterr().err
    last = torch.load(out / "last.pt", weights_only=False)
    del last["extra"]["run"]["bf16"]
    torch.save(last, out / "last.pt")
    assert run.main([*args, "--resume"]) == 0


def test_bf16_training_on_a_cpu_without_bfloat16_says_it_is_emulated(
    tmp_path, source, env, monkeypatch, caplog
):
    """Autocast emulates bfloat16 where the CPU lacks it (14x slower than float32 on an
    AVX2 CPU): the run goes on, and its log says so and what to do."""
    monkeypatch.setattr(engine, "bf16_supported", lambda device: False)
    caplog.set_level(logging.INFO)
    args = cli(source, tmp_path / "run", "--epochs", "1", "--limit-train", "32", "--bf16")
    assert run.main(args) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no native bfloat16" in w and "drop --bf16" in w for w in warnings), warnings
    assert "RSTCNN_ALLOCATOR=jemalloc" not in caplog.text  # not the allocator's tip as well


def test_trials_get_one_folder_and_seed_each(tmp_path, source, env, capsys):
    out = tmp_path / "runs"
    assert run.main(cli(source, out, "--epochs", "1", "--limit-train", "32", "--trials", "2")) == 0
    summaries = [json.loads((out / f"trial{i}" / "summary.json").read_text()) for i in (0, 1)]
    assert [s["seed"] for s in summaries] == [0, 1]
    assert "over 2 trials" in capsys.readouterr().out
    assert report.main([str(out)]) == 0
    assert "| cnn | rs-fashion | 128 | no | ID | 2 |" in capsys.readouterr().out


def write_stl10(folder: Path, train: int, test: int) -> None:
    """Random images and labels in the official binary layout (3 x 96 x 96 per image)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for split, n in (("train", train), ("test", test)):
        rng.integers(0, 256, n * 3 * 96 * 96, dtype=np.uint8).tofile(folder / f"{split}_X.bin")
        rng.integers(1, 11, n, dtype=np.uint8).tofile(folder / f"{split}_y.bin")


def test_stl10_run_reports_id_and_ood_accuracy(tmp_path, capsys):
    write_stl10(tmp_path / "stl10_binary", train=16, test=8)
    out = tmp_path / "run"
    args = ["--model", "resnet16", "--model-arg", "widths=(4,4,8)", "--data", "stl10"]
    args += ["--stl10-root", str(tmp_path), "--epochs", "2", "--batch-size", "8"]
    args += ["--device", "cpu", "--threads", THREADS, "--out", str(out)]
    assert run.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer"] == "sgd" and summary["milestones"] == [1, 1, 1, 2]
    assert (summary["train_images"], summary["val_images"], summary["test_ood_size"]) == (16, 0, 8)
    assert 0 <= summary["test_acc"] <= 1 and 0 <= summary["test_ood_acc"] <= 1
    assert summary["best_epoch"] == 2  # no validation split: the last epoch
    assert [r["val_acc"] for r in metrics(out)] == [None, None]
    _, meta = load_checkpoint(out / "best.pt")
    assert meta.in_channels == 3 and len(meta.std) == 3 and meta.class_names[0] == "airplane"


def test_report_groups_trials_beside_the_paper(tmp_path, capsys):
    for i, acc in enumerate((0.78, 0.80)):
        folder = tmp_path / "runs" / f"trial{i}"
        folder.mkdir(parents=True)
        summary = {"model": "rst_cnn_fb", "data": "rs-fashion", "train_size": 5000}
        summary |= {"augment": False, "epochs": 60, "seed": i, "test_acc": acc}
        (folder / "summary.json").write_text(json.dumps(summary))
    peer = tmp_path / "runs" / "peer" / "summary.json"  # the paper reports it as RDCF
    peer.parent.mkdir()
    peer.write_text(
        json.dumps(
            {"model": "rot_cnn", "data": "rs-fashion", "train_size": 2000, "augment": True}
            | {"epochs": 60, "test_acc": 0.7446}
        )
    )
    stl = tmp_path / "stl" / "summary.json"
    stl.parent.mkdir()
    stl.write_text(
        json.dumps(
            {"model": "resnet16", "data": "stl10", "train_size": None, "augment": False}
            | {"epochs": 5, "limit_train": 64, "test_acc": 0.5, "test_ood_acc": 0.25}
        )
    )
    assert report.main([str(tmp_path / "runs"), str(tmp_path / "stl")]) == 0
    table = capsys.readouterr().out
    assert (
        "| rst_cnn_fb | rs-fashion | 5000 | no | ID | 2 | 79.00 ± 1.00 | 78.64 ± 0.60 | +0.36 |  |"
        in table
    )
    assert (
        "| resnet16 | stl10 | all | no | OOD | 1 | 25.00 | 37.63 ± 1.95 | -12.63 | reduced budget |"
        in table
    )  # one trial has no spread to show
    assert (
        "| rot_cnn | rs-fashion | 2000 | yes | ID | 1 | 74.46 | 73.46 ± 0.10 | +1.00 | paper: RDCF |"
        in table
    )


# ---------------------------------------------------------------- resampling pipelines, --init


@pytest.fixture(scope="module")
def pipelines_run(source, tmp_path_factory) -> Path:
    """A tiny CNN trained one epoch on the bicubic and antialiased renderings and tested
    on Pillow's too (run.main in this process)."""
    out = tmp_path_factory.mktemp("pipelines") / "run"
    args = cli(source, out, "--epochs", "1", "--limit-train", "32", *TINY_CNN)
    args += ["--train-resampling", "bicubic", "antialiased", "--test-resampling", "pillow"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RSTCNN_DATA", str(source["cache"]))
        assert run.main(args) == 0
    return out


def test_runs_train_and_test_on_resampling_pipelines(pipelines_run):
    summary = json.loads((pipelines_run / "summary.json").read_text())
    assert summary["train_resampling"] == ["bicubic", "antialiased"]
    assert "training images rendered by bicubic / antialiased" in summary["data_description"]
    assert summary["train_images"] == 32
    assert summary["test_size"] == summary["test_pillow_size"] == 64
    assert 0 <= summary["test_acc"] <= 1 and 0 <= summary["test_pillow_acc"] <= 1
    assert np.isfinite(summary["test_pillow_loss"])
    _, meta = load_checkpoint(pipelines_run / "best.pt")
    assert meta.metrics["test_pillow_acc"] == summary["test_pillow_acc"]
    assert meta.extra["run"]["train_resampling"] == ["bicubic", "antialiased"]


def test_train_resampling_reads_every_pipeline(tmp_path, source, env):
    """--train-resampling: a VariantDataset over each pipeline's rendering of the same
    training images; --test-resampling: the same test images by another pipeline."""
    argv = cli(source, tmp_path / "run", "--limit-train", "32", "--test-resampling", "pillow")
    args = run.parse_args([*argv, "--train-resampling", "bicubic", "antialiased", "bicubic"])
    assert args.train_resampling == ("bicubic", "antialiased")  # repeats dropped
    data = engine.load_rs_data(args)
    assert type(data.train) is VariantDataset and data.train.batched
    assert "rendered by bicubic / antialiased" in data.description
    rendered = {}
    for i, name in enumerate(("bicubic", "antialiased")):
        config = RSConfig("rs-fashion", resampling=name)
        rendered[name] = load_rs(config, data_root=source["root"]).split(128, num_val=64)
        expected = rendered[name].train.images[:32]
        np.testing.assert_array_equal(data.train.variants[i][:, 0].numpy(), expected)
    assert not np.array_equal(data.train.variants[0], data.train.variants[1])
    np.testing.assert_array_equal(data.train.labels.numpy(), rendered["bicubic"].train.labels[:32])

    # one image read 64 times in a batch: every read is one pipeline's rendering, both occur
    x, y = collate(data.train.__getitems__([5] * 64))
    normalize = data.train.transform
    options = torch.stack([normalize(v[5].float() / 255) for v in data.train.variants])
    picks = [int((options - image).flatten(1).abs().amax(1).argmin()) for image in x]
    for image, pick in zip(x, picks, strict=True):
        torch.testing.assert_close(image, options[pick])
    assert set(picks) == {0, 1} and set(y.tolist()) == {int(data.train.labels[5])}

    test, pillow = data.evals["test"], data.evals["test_pillow"]
    assert len(test) == len(pillow) == 64 and torch.equal(test.labels, pillow.labels)
    np.testing.assert_array_equal(
        pillow.images[:, 0].numpy(),
        load_rs(RSConfig("rs-fashion", resampling="pillow"), data_root=source["root"])
        .split(128, num_val=64)
        .test.images[:64],
    )
    assert not torch.equal(test.images, pillow.images)

    plain = engine.load_rs_data(run.parse_args(cli(source, tmp_path / "plain")))
    assert type(plain.train) is ArrayDataset and "rendered by" not in plain.description
    assert set(plain.evals) == {"val", "test"}


def test_init_starts_from_the_checkpoint_weights(tmp_path, source, env, pipelines_run, capsys):
    best = pipelines_run / "best.pt"
    saved = torch.load(best, weights_only=True)["state_dict"]

    def trial(*extra: str) -> engine.Trial:
        out = tmp_path / "trial"
        args = run.parse_args(cli(source, out, "--limit-train", "32", *TINY_CNN, *extra))
        data = engine.load_data(args)
        cpu, stop = torch.device("cpu"), engine.StopRequest()
        return engine.Trial(args, data, seed=0, out=out, device=cpu, stop=stop)

    started = trial("--init", str(best)).model.state_dict()
    assert started.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(started[key], value), key
    fresh = trial().model.state_dict()
    assert any(not torch.equal(fresh[k], saved[k]) for k in saved)  # the check can fail

    out = tmp_path / "fine-tune"
    argv = cli(source, out, "--epochs", "1", "--limit-train", "32", *TINY_CNN, "--init", str(best))
    assert run.main([*argv, "--lr", "1e-6"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["init"] == str(best) and summary["train_resampling"] == ["bicubic"]
    tuned = torch.load(out / "last.pt", weights_only=True)["state_dict"]
    weights = [k for k, v in saved.items() if v.is_floating_point() and "running_" not in k]
    drift = max((tuned[k] - saved[k]).abs().max().item() for k in weights)
    assert 0 < drift < 1e-4  # trained on from the checkpoint, at a tiny learning rate

    wider = ("--model-arg", "channels=(4,6,10)", "--model-arg", "hidden=16")
    argv = cli(source, tmp_path / "wider", "--epochs", "1", "--limit-train", "32", *wider)
    assert run.main([*argv, "--init", str(best)]) == run.EXIT_SETUP
    err = capsys.readouterr().err
    assert f"--init {best} holds cnn" in err and "--model-arg" in err
    argv = cli(source, tmp_path / "rst", "--epochs", "1", *TINY_CNN, model="rst_cnn_fb")
    assert run.main([*argv, "--init", str(best)]) == run.EXIT_SETUP
    assert "this run builds rst_cnn_fb" in capsys.readouterr().err
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    argv = cli(source, tmp_path / "garbage", "--epochs", "1", *TINY_CNN, "--init", str(garbage))
    assert run.main(argv) == run.EXIT_SETUP
    assert "error: --init:" in capsys.readouterr().err


def test_parser_rejects_missing_init_and_pipelines_off_rs_data(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run.parse_args(["--init", str(tmp_path / "missing.pt")])
    assert exit_.value.code == 2
    assert "missing.pt: no such checkpoint" in capsys.readouterr().err
    stl10 = ["--data", "stl10", "--stl10-root", str(tmp_path)]
    for flags in (["--train-resampling", "bicubic", "bilinear"], ["--test-resampling", "pillow"]):
        with pytest.raises(SystemExit) as exit_:
            run.parse_args([*stl10, *flags])
        assert exit_.value.code == 2
        assert "are for RS data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.parse_args(["--train-resampling", "lanczos"])
    assert "invalid choice: 'lanczos'" in capsys.readouterr().err
    assert run.parse_args(stl10).train_resampling == ("bicubic",)


def test_resampling_report_per_pipeline(tmp_path, source, env, pipelines_run, capsys):
    """train/resampling.py measures a checkpoint on its own test split as each pipeline
    renders it: the same numbers train/run.py reported for the same images."""
    best = pipelines_run / "best.pt"
    summary = json.loads((pipelines_run / "summary.json").read_text())
    pipelines = ["bicubic", "pillow", "bilinear"]
    rows = resampling.measure([best], pipelines, 64, data_root=source["root"])
    assert len(rows) == 1
    row = rows[0]
    assert row["checkpoint"] == str(best) and row["model"] == "cnn" and row["images"] == 64
    assert all(0 <= row[p] <= 1 for p in pipelines)
    assert row["bicubic"] == pytest.approx(summary["test_acc"])
    assert row["pillow"] == pytest.approx(summary["test_pillow_acc"])
    lines = resampling.table(rows, pipelines).splitlines()
    assert len(lines) == 3
    assert lines[0] == (
        "| checkpoint | model | images | bicubic | pillow | bilinear "
        "| pillow - bicubic | bilinear - bicubic |"
    )
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == [str(best), "cnn", "64"]
    assert cells[3] == f"{100 * row['bicubic']:.2f} %"
    assert cells[6] == f"{100 * (row['pillow'] - row['bicubic']):+.2f}"

    out = tmp_path / "report"
    argv = [str(best), "--limit", "16", "--data-root", str(source["root"]), "--out", str(out)]
    assert resampling.main(argv) == 0
    assert "| pillow - bicubic |" in capsys.readouterr().out
    assert json.loads((out / "rows.json").read_text())[0]["images"] == 16
    assert (out / "table.md").read_text().count("\n") == 3

    missing = tmp_path / "missing.pt"
    assert resampling.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and str(missing) in err


# ---------------------------------------------------------------- train/fastpath.py


def test_fastpath_setting_flags_are_train_run_flags():
    assert fastpath.Setting("a", "fp32").flags == ["--no-tf32"]
    assert fastpath.Setting("b", "tf32").flags == []
    assert fastpath.Setting("c", "bf16").flags == ["--bf16"]
    direct = fastpath.Setting("d", "bf16", ConvMethod.DIRECT)
    assert direct.flags == ["--bf16", "--model-arg", "method='direct'"]
    assert set(fastpath.TRAIN_SETTINGS) < set(fastpath.EVAL_SETTINGS)
    assert fastpath.Setting("e", "bf16", kernels="torch").env == {"RSTCNN_KERNELS": "torch"}
    assert fastpath.Setting("f", "bf16").env == {}
    for setting in fastpath.EVAL_SETTINGS:
        args = run.parse_args(["--model", "rst_cnn_fb", *setting.flags])
        assert args.tf32 is (setting.precision != "fp32"), setting
        assert args.bf16 is (setting.precision == "bf16"), setting
        method = args.model_args.pop("method", "auto")
        assert method == setting.method.value and not args.model_args, setting
        model = create_model("rst_cnn_fb", channels=(4, 6, 8), method=method)
        assert model.config.method == setting.method


def test_fastpath_dry_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "fastpath"
    argv = ["--device", "cpu", "--model-arg", "channels=(4,6,8)", "--steps", "1", "--batch", "4"]
    assert fastpath.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-2].startswith("FLAGS:")  # "FLAGS:" alone when the default was fastest
    rows = json.loads((out / "fastpath.json").read_text())
    expected = [
        (setting.name, model)
        for setting in fastpath.EVAL_SETTINGS
        for model in ("cnn", "rst_cnn_fb")
        if model == "rst_cnn_fb" or setting.method is ConvMethod.AUTO
    ]
    assert [(r["setting"], r["model"]) for r in rows] == expected
    trained = {s.name for s in fastpath.TRAIN_SETTINGS}
    for r in rows:
        assert ("train_s" in r) == (r["setting"] in trained), r
        assert r["eval_s"] > 0 and r["eval1_ms"] > 0 and r.get("train_s", 1) > 0
        assert r["flags"] == next(s for s in fastpath.EVAL_SETTINGS if s.name == r["setting"]).flags
    text = (out / "fastpath.md").read_text()
    assert text.startswith("cpu, torch ") and "batch 4" in text
    for r in rows:
        assert f"| {r['model']} | {r['setting']} |" in text
    best = min(
        (r for r in rows if r["model"] == "rst_cnn_fb" and "train_s" in r),
        key=lambda r: r["train_s"],
    )
    assert f"fastest training setting: {best['setting']} (" in text
    flags = printed[-2].removeprefix("FLAGS:").split()  # as the script's $FLAGS splits
    assert flags == best["flags"]
    env = dict(kv.split("=") for kv in printed[-1].removeprefix("ENV:").split())
    assert (
        env
        == best["env"]
        == next(s.env for s in fastpath.EVAL_SETTINGS if s.name == best["setting"])
    )
    args = run.parse_args(["--model", "rst_cnn_fb", *flags])
    assert args.bf16 is ("--bf16" in flags) and args.tf32 is ("--no-tf32" not in flags)


def test_precision_check_compares_bf16_with_float32(tmp_path, source, env, pipelines_run, capsys):
    """train/precision_check.py: the float32 pass is the run's own test result; bfloat16
    (where the CPU has it) agrees on the top class nearly everywhere; the verdict is the
    exit status."""
    best = pipelines_run / "best.pt"
    summary = json.loads((pipelines_run / "summary.json").read_text())
    if not bf16_supported("cpu"):
        assert precision_check.main([str(best)]) == 2
        assert "no native bfloat16" in capsys.readouterr().err
        return
    r = precision_check.check(best, 64, 32, "cpu", 0.5, source["root"])
    assert r["images"] == 64 and r["model"] == "cnn"
    assert r["fp32_acc"] == pytest.approx(summary["test_acc"])
    assert r["precision"] == "bf16" and 0 <= r["reduced_acc"] <= 1 and r["top1_agreement"] >= 0.9
    assert 0 < r["max_logit_change"] < 0.1 and r["fp32_s"] > 0 and r["reduced_s"] > 0
    assert r["passes"] == (100 * (r["fp32_acc"] - r["reduced_acc"]) <= 0.5)
    out = tmp_path / "r.json"
    argv = [str(best), "--limit", "64", "--batch", "32", "--data-root", str(source["root"])]
    code = precision_check.main([*argv, "--json", str(out)])
    assert code == (0 if r["passes"] else 1)
    assert json.loads(out.read_text())["top1_agreement"] == r["top1_agreement"]
    assert "top-1 agreement" in capsys.readouterr().out
    # --record: the gate beside the checkpoint, which the app's eager engine reads
    from rstcnn.serve.classifier import Classifier
    from rstcnn.serve.eager import gate_path

    assert precision_check.main([*argv, "--record"]) == code
    assert str(gate_path(best)) in capsys.readouterr().out
    gate = json.loads(gate_path(best).read_text())
    assert gate["passes"] == r["passes"] and gate["images"] == 64
    assert gate["drop_points"] == pytest.approx(100 * (r["fp32_acc"] - r["reduced_acc"]))
    assert gate["precision"] == "bf16"
    served = Classifier.from_checkpoint(best)
    assert served.metadata["rstcnn.precision"] == ("bf16" if r["passes"] else "fp32")
    # int8 products: its own gate file; "auto" serves int8 first where it passed
    if int8_supported("cpu"):
        assert precision_check.main([*argv, "--precision", "int8", "--record"]) in (0, 1)
        assert str(gate_path(best, "int8")) in capsys.readouterr().out
        gate8 = json.loads(gate_path(best, "int8").read_text())
        assert gate8["precision"] == "int8" and gate8["images"] == 64
        served = Classifier.from_checkpoint(best)
        passed = [p for p, ok in (("int8", gate8["passes"]), ("bf16", r["passes"])) if ok]
        assert served.metadata["rstcnn.precision"] == (passed[0] if passed else "fp32")
        gate_path(best, "int8").unlink()
    else:
        assert precision_check.main([*argv, "--precision", "int8"]) == 2
        assert "cannot run int8 products" in capsys.readouterr().err
    gate_path(best).unlink()
    assert precision_check.main([str(tmp_path / "missing.pt")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_precision_check_records_an_int16_gate_that_the_app_serves(source, pipelines_run, capsys):
    """``--precision int16`` where the CPU has the AVX2 kernels: the gate beside the
    checkpoint, and ``Classifier.from_checkpoint`` ("auto") then serves int16 where neither
    int8 nor bfloat16 runs; elsewhere the check says what the CPU lacks (exit status 2)."""
    from rstcnn.serve.classifier import Classifier
    from rstcnn.serve.eager import gate_path

    best = pipelines_run / "best.pt"
    argv = [str(best), "--limit", "32", "--batch", "16", "--data-root", str(source["root"])]
    argv += ["--precision", "int16"]
    if not int16_supported("cpu"):
        assert precision_check.main(argv) == 2
        assert "cannot run int16 products" in capsys.readouterr().err
        return
    try:
        # a CNN has no per-frequency products: int16 gives its float32 logits
        assert precision_check.main([*argv, "--record"]) == 0
        out = capsys.readouterr().out
        assert str(gate_path(best, "int16")) in out and "int16" in out
        gate = json.loads(gate_path(best, "int16").read_text())
        assert gate["precision"] == "int16" and gate["passes"] and gate["drop_points"] == 0
        assert gate["images"] == 32 and gate["top1_agreement"] == 1.0
        served = Classifier.from_checkpoint(best)
        if not (int8_supported("cpu") or bf16_supported("cpu")):
            assert served.metadata["rstcnn.precision"] == "int16"
            assert served.metadata["rstcnn.gate"]["precision"] == "int16"
        assert Classifier.from_checkpoint(best, "fp32").metadata["rstcnn.precision"] == "fp32"
    finally:
        gate_path(best, "int16").unlink(missing_ok=True)


def test_inference_precision_context():
    model = create_model("cnn", channels=(4, 6, 8)).eval()
    x = torch.randn(4, 1, 56, 56)
    with torch.no_grad():
        exact = model(x)
    with inference("fp32"):
        assert torch.equal(model(x), exact)
    with pytest.raises(ValueError, match="choose one of fp32, bf16"), inference("fp16"):
        pass
    if bf16_supported("cpu"):
        with inference("bf16"):
            half = model(x).float()
        assert ((half - exact).norm() / exact.norm()).item() < 0.05
    else:
        with pytest.raises(ValueError, match="no native bfloat16"), inference("bf16"):
            pass
    assert not int8_products()
    if int8_supported("cpu"):
        with inference("int8"):
            assert int8_products() and torch.is_autocast_enabled("cpu")
            with inference("bf16"):
                assert not int8_products()
            assert int8_products()
        assert not int8_products() and not torch.is_autocast_enabled("cpu")
    with (
        pytest.raises(ValueError, match="cannot run int8 products"),
        inference("int8", "meta"),
    ):
        pass
    assert not int16_products()
    if int16_supported("cpu"):
        with inference("int16"):  # float32 throughout, only the products on integers
            assert int16_products() and not int8_products()
            assert not torch.is_autocast_enabled("cpu") and torch.is_inference_mode_enabled()
            assert torch.allclose(model(x), exact, rtol=1e-5, atol=1e-5)  # no FFT path here
            with inference("fp32"):
                assert not int16_products()
        assert not int16_products()
    with (
        pytest.raises(ValueError, match="cannot run int16 products"),
        inference("int16", "meta"),
    ):
        pass


def test_train_config_is_frozen_validated_and_varied_by_replace():
    """The typed config the CLI parses into and the experiment runners build directly."""
    import dataclasses

    from rstcnn.train.config import RS_RECIPE, STL10_RECIPE, TrainConfig, settings_of

    config = TrainConfig(model="cnn", train_size=2000, model_args={"hidden": 8})
    assert (config.epochs, config.batch_size, config.lr) == (60, 128, 0.01)
    assert config.recipe is RS_RECIPE and config.val_size == RS_RECIPE.val_size
    assert config.out == Path("runs/cnn-rs-fashion-2000-r0-s0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.epochs = 3  # type: ignore[misc]
    fewer = dataclasses.replace(config, epochs=3, train_resampling=("bicubic", "pillow", "bicubic"))
    assert fewer.epochs == 3 and fewer.train_resampling == ("bicubic", "pillow")
    assert (
        run.parse_args(["--model", "cnn", "--train-size", "2000", "--model-arg", "hidden=8"])
        == config
    )
    stl = TrainConfig(model="cnn", data="stl10", stl10_root=Path("/x"))
    assert stl.recipe is STL10_RECIPE and stl.train_size is None and stl.epochs == 1000
    for bad, words in [
        ({"epochs": 0}, "epochs must be at least 1"),
        ({"model": "nope"}, "not registered"),
        ({"data": "rs-fashion-upright"}, "choose from"),
        ({"lr": 0.0}, "lr must be positive"),
        ({"train_resampling": ("lanczos",)}, "choose from"),
        ({"data": "stl10"}, "needs stl10_root"),
    ]:
        with pytest.raises(ValueError, match=words):
            TrainConfig(**bad)
    # a run on other images than the data set's protocol records them as such
    upright = TrainConfig(model="cnn", data_label="rs-fashion-upright")
    settings = settings_of(upright, seed=4)
    assert settings["data"] == "rs-fashion-upright" and settings["seed"] == 4
    assert settings["train_resampling"] == ["bicubic"]  # plain JSON, as checkpoints hold it


@pytest.mark.parametrize("model", ["sfcnn", "sesn", "sevf"])
def test_the_peers_train_through_the_command_line(model, tmp_path, source, env):
    """python train/run.py --model NAME for the paper's peers (a tiny width)."""
    out = tmp_path / model
    args = cli(source, out, "--epochs", "1", "--model-arg", "channels=(2,3,4)", model=model)
    assert run.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == model and 0 <= summary["test_acc"] <= 1
    loaded, meta = load_checkpoint(out / "best.pt")
    assert meta.model_name == model and loaded.config.channels == (2, 3, 4)


def test_fastpath_align_probe_times_each_rst_conv_at_both_widths(tmp_path, capsys):
    out = tmp_path / "fastpath"
    argv = ["--device", "cpu", "--model-arg", "channels=(4,6,9)", "--steps", "1", "--batch", "2"]
    assert fastpath.main([*argv, "--settings", "fp32", "--align-probe", "--out", str(out)]) == 0
    text = (out / "align.md").read_text()
    assert text == capsys.readouterr().out.split("ENV:")[1].split("\n", 1)[1]
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| blocks")]
    # the lifting conv keeps its one image channel; the group convs round both widths up
    assert [(r[1], r[3]) for r in rows] == [
        ("(1, 4)", "(1, 8)"),
        ("(4, 6)", "(8, 8)"),
        ("(6, 9)", "(8, 16)"),
    ]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)


def test_step_cost_counts_flops_and_bytes_of_each_operator():
    """train/step_cost.py's tally: a matrix product's FLOPs and the bytes it reads and
    writes, exactly; a view moves nothing; an in-place operator reads and writes its target
    (an indexed one only the rows it writes); the floor is the binding one of the two peaks."""
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    mm = step_cost.count(lambda: a @ b).costs[("all", "matmul")]
    assert (mm.calls, mm.flops, mm.bytes) == (1, 2 * 6 * 5 * 7, 4 * (30 + 35 + 42))
    assert mm.floor_s == pytest.approx(max(mm.flops / 989e12, mm.bytes / 4.8e12))
    shared = b.expand(100, 5, 7)  # one matrix for 100 products: read once, not 100 times
    batched = step_cost.count(lambda: torch.bmm(a.expand(100, 6, 5), shared)).costs
    assert batched[("all", "matmul")].bytes == 4 * (30 + 35 + 100 * 42)
    copied = step_cost.count(lambda: a.t().contiguous()).costs  # the transpose: a view
    assert list(copied) == [("all", "gather/copy")]
    assert copied[("all", "gather/copy")].bytes == 2 * 4 * 30
    c, a3, b3 = torch.zeros(3, 6, 7), torch.randn(3, 6, 5), torch.randn(3, 5, 7)
    into = step_cost.count(lambda: c.baddbmm_(a3, b3)).costs[("all", "matmul")]
    apart = step_cost.count(lambda: torch.baddbmm(c, a3, b3)).costs[("all", "matmul")]
    assert into.flops == apart.flops >= 2 * 3 * 6 * 5 * 7  # in place counts as out of place
    x = torch.zeros(10)
    added = step_cost.count(lambda: x.add_(1.0))
    assert list(added.ops) == [("all", "add_")]
    added = added.costs[("all", "elementwise")]
    assert (added.calls, added.flops, added.bytes) == (1, 0, 2 * 40)
    # writing 3 rows of a 100-row target moves those rows, not the target
    big, rows, index = torch.zeros(100, 8), torch.randn(3, 8), torch.tensor([5, 1, 9])
    copied = step_cost.count(lambda: big.index_copy_(0, index, rows)).costs
    assert copied[("all", "gather/copy")].bytes == 2 * 4 * 24 + 8 * 3
    summed = step_cost.count(lambda: big.index_add_(0, index, rows)).costs
    assert summed[("all", "gather/copy")].bytes == 3 * 4 * 24 + 8 * 3


def test_step_cost_of_a_training_step_by_layer(tmp_path, capsys):
    """A whole training step, attributed to the RST blocks: the backward pass costs between
    one and two forwards in FLOPs (no gradient for the input images), and the report's
    totals are the sum of its rows."""
    tiny = {"channels": (4, 6, 8), "hidden": 16}
    model = create_model("rst_cnn_fb", **tiny)
    x = torch.randn(2, 1, 56, 56)
    forward = step_cost.count(lambda: model(x)).costs
    out = tmp_path / "cost.md"
    argv = ["--batch", "2", "--model-arg", "channels=(4,6,8)", "--model-arg", "hidden=16"]
    assert step_cost.main([*argv, "--measured-ms", "10", "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    assert {r[0] for r in rows if r[0].startswith("blocks.")} == {
        "blocks.0",
        "blocks.1",
        "blocks.2",
    }
    end = next(i for i, r in enumerate(rows) if r[0] == "**all**")  # the kinds' table ends
    step_gflop = float(rows[end][3].replace(",", ""))
    parts = [float(r[3].replace(",", "")) for r in rows[:end] if len(r) == 6 and r[2].isdigit()]
    assert sum(parts) == pytest.approx(step_gflop, abs=0.01 * len(parts))
    assert "| blocks.1 | `bmm` |" in text  # the operators that bound the step, by name
    forward_gflop = sum(c.flops for c in forward.values()) / 1e9
    assert 2.0 * forward_gflop < step_gflop <= 3.0 * forward_gflop + 0.1
    assert "measured 10.00 ms per step" in text


def test_kernel_probe_times_and_counts_each_layer_both_ways(tmp_path, capsys):
    """train/kernel_probe.py on the CPU (the kernels' torch stand-ins): one row per RST
    convolution, each timed and counted with and without the fused kernels; the fused
    operators move fewer bytes than the torch ones they replace."""
    from rstcnn.train import kernel_probe

    out = tmp_path / "kernels.md"
    argv = ["--device", "cpu", "--batch", "2", "--steps", "1", "--bf16"]
    assert kernel_probe.main([*argv, "--model-arg", "channels=(4,6,8)", "--out", str(out)]) == 0
    text = out.read_text()
    assert capsys.readouterr().out.endswith(text)  # printed, then written
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| blocks")]
    assert [r[0] for r in rows] == ["| blocks.0.0", "| blocks.1.0", "| blocks.2.0"]
    for r in rows:
        assert float(r[1]) > 0 and float(r[4]) > 0  # both timed
        assert float(r[5]) < float(r[2])  # the fused operators' bytes: fewer


def test_loops_log_their_progress_where_no_bar_is_drawn(monkeypatch, caplog):
    """Output not a terminal (nohup, a log file): tqdm draws nothing, so the loops log the
    batches done and the time left instead; on a terminal, or off the main process, they
    log nothing and pass every item through."""
    from tqdm import tqdm

    monkeypatch.setattr(engine, "HEARTBEAT_S", 0.0)
    with caplog.at_level(logging.INFO, logger="train"):
        items = list(engine.logged(tqdm(range(4), disable=True), "test"))
    assert items == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("test: 1 of 4 batches,") and "min left" in lines[0]
    assert lines[-1].startswith("test: 4 of 4 batches,") and len(lines) == 4
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train"):
        assert list(engine.logged(tqdm(iter("ab"), disable=True), "val")) == ["a", "b"]
        assert list(engine.logged(tqdm(range(3), disable=True), "val", show=False)) == [0, 1, 2]
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        "val: 1 batches",
        "val: 2 batches",
    ]
    monkeypatch.setattr(engine, "HEARTBEAT_S", 3600.0)
    with caplog.at_level(logging.INFO, logger="train"):
        caplog.clear()
        assert list(engine.logged(tqdm(range(3), disable=True), "val")) == [0, 1, 2]
    assert not caplog.records
