"""The paper's experiments: equivariance error (eq. 14), deformation stability (Theorem 1),
the accuracy-table driver and the out-of-distribution experiment, each at a smoke budget."""

from __future__ import annotations

import csv
import importlib
import json
import logging
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from rstcnn.train import budgets, engine, equivariance, ood, pose_use, reproduce, run, stability
from rstcnn.train.experiments import parse_element, stages_of, synthetic_images
from rstmodel import RSTElement, act_on_features, create_model, load_checkpoint, save_checkpoint

QUARTER = RSTElement(math.pi / 2, 0.0)


def small_stack(**fields) -> equivariance.StackConfig:
    base = dict(num_funcs=5, num_scales=5, channels=2, layers=3, rotation_taps=4, scale_taps=2)
    return equivariance.StackConfig(**{**base, **fields})


@pytest.fixture
def images() -> torch.Tensor:
    return synthetic_images(2, 32, seed=3).double()


def test_parse_element():
    g = parse_element("-pi/2, -0.5, 1, 2")
    assert g == RSTElement(-math.pi / 2, -0.5, (1.0, 2.0))
    assert parse_element("pi,0") == RSTElement(math.pi, 0.0)
    with pytest.raises(ValueError, match="group element"):
        parse_element("__import__('os'),0")


def test_quarter_turn_is_exact_and_a_wrong_shift_is_not(images):
    stages = equivariance.random_stack(small_stack(), seed=0, input_size=32).double()
    mid = small_stack().zero_index
    errors = equivariance.equivariance_errors(stages, images, QUARTER, scale_index=mid)
    assert errors.shape == (3, 2)
    assert errors.max() < 1e-11

    def wrong(x, g, step):  # one rotation index too far
        return torch.roll(act_on_features(x, g, scale_step=step), 1, dims=2)

    bad = equivariance.equivariance_errors(
        stages, images, QUARTER, scale_index=mid, feature_action=wrong
    )
    assert bad.min() > 0.05


def test_quarter_turn_float32_round_off(images):
    stages = equivariance.random_stack(small_stack(), seed=1, input_size=32)
    errors = equivariance.equivariance_errors(stages, images.float(), QUARTER, scale_index=2)
    assert errors.max() < 1e-5


def test_scale_shift_direction(images):
    """A downscaled input must match the features one scale step up (beta = -step): the
    lifting layer is then close to equivariant, and much closer than with the opposite shift."""
    config = small_stack(num_funcs=3, scale_taps=1)
    stages = equivariance.random_stack(config, seed=0, input_size=32).double()
    g = RSTElement(-math.pi / 2, -config.scale_step)
    right = equivariance.equivariance_errors(stages, images, g, scale_index=config.zero_index)

    def opposite(x, h, step):
        return act_on_features(x, RSTElement(h.angle, -h.log2_scale), scale_step=step)

    wrong = equivariance.equivariance_errors(
        stages, images, g, scale_index=config.zero_index, feature_action=opposite
    )
    assert 1e-4 < right[0].max() < 0.2
    assert wrong[0].min() > 3 * right[0].max()


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A tiny RST-CNN(FB) with non-trivial batch-norm statistics, saved like train/run.py."""
    torch.manual_seed(0)
    model = create_model("rst_cnn_fb", channels=(3, 4, 5), hidden=8)
    with torch.no_grad():
        model.train()
        for _ in range(2):
            model(torch.randn(4, 1, 56, 56))
    path = tmp_path / "tiny.pt"
    save_checkpoint(
        path,
        model.eval(),
        model_name="rst_cnn_fb",
        class_names=[str(i) for i in range(10)],
        input_size=56,
        in_channels=1,
        normalization=([0.2], [0.3]),
        extra={"run": {"data": "synthetic"}},
    )
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_equivariance_cli_on_a_checkpoint_is_exact_for_quarter_turns(tmp_path, checkpoint):
    out = tmp_path / "eq"
    args = ["--checkpoint", str(checkpoint), "--data", "synthetic", "--images", "2"]
    args += ["--element", "pi/2,0,0,0", "--dtype", "float64", "--out", str(out)]
    assert equivariance.main(args) == 0
    rows = read_csv(out / "equivariance.csv")
    assert [int(r["layer"]) for r in rows] == [1, 2, 3]
    assert max(float(r["mean"]) for r in rows) < 1e-10  # biases and BN shifts included
    assert (out / "equivariance.png").stat().st_size > 1000
    assert "layer 3" in (out / "equivariance.md").read_text()


def test_equivariance_cli_smoke(tmp_path):
    out = tmp_path / "eq"
    args = ["--budget", "smoke", "--data", "synthetic", "--num-funcs", "5", "--layers", "2"]
    assert equivariance.main([*args, "--scale-taps", "1", "2", "--out", str(out)]) == 0
    rows = read_csv(out / "equivariance.csv")
    assert {(r["L_alpha"], r["layer"]) for r in rows} == {
        ("1", "1"),
        ("1", "2"),
        ("2", "1"),
        ("2", "2"),
    }
    assert all(0 < float(r["mean"]) < 1 for r in rows)


def test_norms():
    x = torch.ones(1, 2, 4, 4)
    assert stability.input_norm(x).item() == pytest.approx(4.0)
    feats = torch.zeros(1, 1, 2, 3, 2, 2)
    feats[:, :, :, 1] = 1.0  # one scale carries it all: the sup picks it
    # 2x2 map of a 4x4 input: each map pixel is 4 input pixels
    assert stability.feature_norm(feats, 4).item() == pytest.approx(4.0)
    assert stability.feature_norm(feats, 4, slice(2, None)).item() == 0.0


def test_filter_bounds_follow_the_coefficients():
    model = create_model("rst_cnn_fb", channels=(2, 3, 4), hidden=8).eval()
    base = stability.filter_bounds(model)
    assert len(base) == 3 and all(a > 0 for a in base)
    with torch.no_grad():
        model.blocks[1][0].weight.mul_(2)
    doubled = stability.filter_bounds(model)
    assert doubled[1] == pytest.approx(2 * base[1])
    assert doubled[0] == pytest.approx(base[0]) and doubled[2] == pytest.approx(base[2])
    # one coefficient on the lowest mode, one channel in and out: pi * rho_0 * sqrt(mu_1) |a|
    lift = create_model("rst_cnn_fb", channels=(1, 1, 1), hidden=8).eval()
    with torch.no_grad():
        for block in lift.blocks:
            block[0].weight.zero_()
        lift.blocks[0][0].weight[0, 0, 0] = 0.5
    mu = lift.spec.eigenvalues()[0]
    expected = math.pi * lift.spec.scales[0] * math.sqrt(mu) * 0.5
    assert stability.filter_bounds(lift)[0] == pytest.approx(expected, rel=1e-3)  # BN eps


def test_stability_errors_vanish_without_deformation(checkpoint):
    from rstcnn.train.experiments import load_stages

    stages, _, _ = load_stages(checkpoint)
    stages = stages.double()
    images = synthetic_images(2, 56).double()
    gen = torch.Generator().manual_seed(0)
    exact = stability.stability_errors(stages, images, QUARTER, 0.0, gen)
    assert exact["relative"].max() < 1e-10
    deformed = stability.stability_errors(stages, images, QUARTER, 0.2, gen)
    assert deformed["relative"].min() > 1e-3
    assert deformed["grad_tau"].numpy() == pytest.approx([0.2, 0.2])


def test_stability_cli_smoke(tmp_path, checkpoint):
    out = tmp_path / "stab"
    args = [str(checkpoint), "--budget", "smoke", "--also", str(checkpoint), "--out", str(out)]
    assert stability.main(args) == 0
    rows = read_csv(out / "stability.csv")
    models = {r["model"] for r in rows}
    assert "random, K=3" in models and sum("trained" in m for m in models) == 2
    bounds = json.loads((out / "stability_bounds.json").read_text())
    assert len(bounds["A"]) == 3 and bounds["radius"] == pytest.approx(10.0)
    assert (out / "stability.png").stat().st_size > 1000
    assert "A2" in (out / "stability.md").read_text()


def test_stages_refuse_a_plain_cnn():
    with pytest.raises(ValueError, match="RST-CNN"):
        stages_of(create_model("cnn"), None)


# ---------------------------------------------------------------- accuracy tables and OOD


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def idx_source(tmp_path_factory) -> Path:
    """300 random 28x28 images and labels as the four IDX files of a Fashion-MNIST folder."""
    root = tmp_path_factory.mktemp("idx")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(300, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=300, dtype=np.uint8)
    write_idx(root / "train-images-idx3-ubyte", images[:240])
    write_idx(root / "train-labels-idx1-ubyte", labels[:240])
    write_idx(root / "t10k-images-idx3-ubyte", images[240:])
    write_idx(root / "t10k-labels-idx1-ubyte", labels[240:])
    return root


def test_shrink_keeps_the_image_centred():
    images = np.zeros((1, 56, 56), dtype=np.uint8)
    images[0, 26:30, 26:30] = 200  # a 4x4 square at the centre
    small = budgets.shrink(images, 32)
    assert small.shape == (1, 32, 32) and small.dtype == np.uint8
    assert (small[0, 15:17, 15:17] == 200).all() and small.sum() == 4 * 200
    assert budgets.shrink(images, 56) is images


def test_reproduce_smoke(tmp_path, idx_source, monkeypatch):
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    out = tmp_path / "out"
    args = ["--data", "rs-fashion", "--budget", "smoke", "--models", "cnn", "rst_cnn_fb"]
    args += ["--data-root", str(idx_source), "--out", str(out), "--threads", "1"]
    assert reproduce.main(args) == 0
    root = out / "rs-fashion" / "smoke"
    rows = read_csv(root / "results.csv")
    assert {(r["model"], r["augment"]) for r in rows} == {
        (m, a) for m in ("cnn", "rst_cnn_fb") for a in ("False", "True")
    }
    assert all(r["input_size"] == "32" and 0 <= float(r["test_acc"]) <= 100 for r in rows)
    table = (root / "table.md").read_text()
    assert "reduced budget" in table and "| cnn | rs-fashion | 64 |" in table
    assert (root / "accuracy.png").stat().st_size > 1000
    wide = (root / "table_wide.md").read_text()
    assert "| rst_cnn_fb |" in wide and "N_tr 64 +aug" in wide
    # finished runs are skipped: a second call trains nothing and rewrites the same table
    stamp = (root / "cnn-64-t0" / "summary.json").stat().st_mtime_ns
    assert reproduce.main(args) == 0
    assert (root / "cnn-64-t0" / "summary.json").stat().st_mtime_ns == stamp
    assert (root / "table.md").read_text() == table


def test_ood_smoke(tmp_path, idx_source, monkeypatch):
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    out = tmp_path / "ood"
    args = ["--budget", "smoke", "--data-root", str(idx_source), "--out", str(out)]
    assert ood.main([*args, "--threads", "1"]) == 0
    rows = read_csv(out / "fashion" / "smoke" / "ood.csv")
    assert [r["model"] for r in rows] == ["cnn", "rst_cnn_fb"]
    for r in rows:
        for key in ("test_acc", "test_ood_acc", "test_rs_acc"):
            assert 0 <= float(r[key]) <= 100
    summary = json.loads((out / "fashion" / "smoke" / "cnn" / "summary.json").read_text())
    assert summary["data"] == "fashion-upright" and summary["test_ood_acc"] is not None
    assert "OOD" in (out / "fashion" / "smoke" / "ood.md").read_text()


def test_ood_does_not_read_another_commands_data_option_as_its_data_root(capsys):
    """--data (train/run.py's and reproduce.py's option) is not a prefix of --data-root here."""
    with pytest.raises(SystemExit) as done:
        ood.main(["--data", "stl10"])
    assert done.value.code == 2
    assert "unrecognized arguments: --data stl10" in capsys.readouterr().err


def test_ood_stl10_protocol_runs_train_run_and_reports(tmp_path, capsys):
    folder = tmp_path / "stl10_binary"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("test", 4)):
        rng.integers(0, 256, n * 3 * 96 * 96, dtype=np.uint8).tofile(folder / f"{split}_X.bin")
        rng.integers(1, 11, n, dtype=np.uint8).tofile(folder / f"{split}_y.bin")
    out = tmp_path / "out"
    args = ["--stl10-root", str(tmp_path), "--models", "resnet16", "--epochs", "1"]
    args += ["--trials", "1", "--batch-size", "4", "--threads", "1", "--device", "cpu"]
    assert ood.main([*args, "--model-arg", "widths=(4,4,8)", "--out", str(out)]) == 0
    table = (out / "stl10" / "table.md").read_text()
    assert "| resnet16 | stl10 | all | no | ID | 1 |" in table
    assert "| resnet16 | stl10 | all | no | OOD | 1 |" in table and "37.63" in table


def test_budget_data_sizes(tmp_path, idx_source, monkeypatch):
    """The full budget reads train/run.py's data as it is (56x56, every remaining test image);
    smaller budgets reduce the images and cut the test split."""
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    argv = ["--data", "rs-fashion", "--train-size", "64", "--val-size", "32"]
    args = run.parse_args([*argv, "--data-root", str(idx_source)])
    full = budgets.Budget(56, {64: 1}, 1, 32, None, None, train_sizes=(64,))
    data = budgets.load_data(args, full, idx_source)
    assert data.input_size == 56 and len(data.evals["test"]) == 300 - 64 - 32
    smoke = budgets.BUDGETS["smoke"]
    data = budgets.load_data(args, smoke, idx_source)
    assert data.input_size == 32 and len(data.evals["test"]) == smoke.test_size
    assert data.train[0][0].shape == (1, 32, 32)


def test_reproduce_plan_order_and_committed_results(tmp_path, idx_source, monkeypatch, capsys):
    """The full protocol's order (no augmentation, larger N_tr, trial by trial, MODELS order);
    --results keeps finished runs and counts them as done on a later call elsewhere."""
    full = budgets.BUDGETS["full"]
    specs = reproduce.plan(full, ["rst_cnn_fb", "cnn"], [True, False], 2)
    names = [s.name for s in specs]
    assert names[:4] == ["cnn-5000-t0", "rst_cnn_fb-5000-t0", "cnn-5000-t1", "rst_cnn_fb-5000-t1"]
    assert names[4] == "cnn-2000-t0" and names[-1] == "rst_cnn_fb-2000-aug-t1"
    # a shard of the trials: only trials 1 and 2, so that processes side by side share a model
    shard = reproduce.plan(full, ["cnn"], [False], 3, [5000], first_trial=1)
    assert [s.name for s in shard] == ["cnn-5000-t1", "cnn-5000-t2"]
    for bad in (["--trials", "2", "--first-trial", "2"], ["--first-trial", "-1"]):
        with pytest.raises(SystemExit):
            reproduce.parse_args(["--data", "rs-fashion", "--budget", "full", *bad])
    # "--trials 1 --first-trial 1" reads as "one trial, number 1": the error says what to pass
    capsys.readouterr()
    with pytest.raises(SystemExit):
        reproduce.parse_args(["--data", "rs-fashion", "--trials", "1", "--first-trial", "1"])
    assert "--trials 2 --first-trial 1" in capsys.readouterr().err
    args = reproduce.parse_args(["--data", "rs-fashion", "--budget", "full"])
    assert args.results == Path("results/reproduce/rs-fashion-full")
    with pytest.raises(SystemExit):
        reproduce.parse_args(["--data", "rs-fashion", "--deadline", "10", "--jobs", "2"])
    with pytest.raises(SystemExit):
        reproduce.parse_args(["--data", "rs-fashion", "--budget", "full", "--train-sizes", "64"])
    # a finished run kept in results/ counts as done from another output folder
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    out, kept = tmp_path / "out", tmp_path / "kept"
    argv = ["--data", "rs-fashion", "--budget", "smoke", "--models", "cnn", "--augment", "no"]
    argv += ["--data-root", str(idx_source), "--threads", "1", "--results", str(kept)]
    assert reproduce.main([*argv, "--out", str(out)]) == 0
    assert (kept / "runs" / "cnn-64-t0" / "summary.json").is_file()
    assert (kept / "runs" / "cnn-64-t0" / "metrics.jsonl").is_file()
    assert "| cnn | rs-fashion | 64 |" in (kept / "table.md").read_text()
    protocol = (kept / "protocol.md").read_text()  # the record's, not one call's
    assert "Runs made by several calls" in protocol and "parameters: cnn " in protocol
    elsewhere = tmp_path / "elsewhere"
    assert reproduce.main([*argv, "--out", str(elsewhere)]) == 0
    assert not (elsewhere / "rs-fashion" / "smoke" / "cnn-64-t0").exists()  # not trained again


def test_reproduce_keeps_each_run_as_it_finishes_and_reports(tmp_path, idx_source, monkeypatch):
    """A call stopped in its second run has already put the first in the committed record;
    --report writes the tables from the record without training anything."""
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    out, kept = tmp_path / "out", tmp_path / "kept"
    argv = ["--data", "rs-fashion", "--budget", "smoke", "--models", "cnn", "--augment", "no"]
    argv += ["--data-root", str(idx_source), "--threads", "1", "--results", str(kept)]
    real_run_one = reproduce.run_one

    def stop_in_second(spec, budget, opts):
        if spec.trial == 1:
            raise KeyboardInterrupt
        return real_run_one(spec, budget, opts)

    monkeypatch.setattr(reproduce, "run_one", stop_in_second)
    assert reproduce.main([*argv, "--trials", "2", "--out", str(out)]) == 1
    assert (kept / "runs" / "cnn-64-t0" / "summary.json").is_file()
    assert not (kept / "runs" / "cnn-64-t1").exists()
    # a later shard of another model: the record's tables keep the first shard's cell
    monkeypatch.setattr(reproduce, "run_one", real_run_one)
    other = [*argv[:5], "scale_cnn", *argv[6:]]
    assert reproduce.main([*other, "--trials", "1", "--out", str(out)]) == 0
    table = (kept / "table.md").read_text()
    assert "| cnn | rs-fashion | 64 | no | ID | 1 |" in table
    assert "| scale_cnn | rs-fashion | 64 | no | ID | 1 |" in table
    assert {r["model"] for r in read_csv(kept / "results.csv")} == {"cnn", "scale_cnn"}
    monkeypatch.setattr(reproduce, "run_one", lambda *a: pytest.fail("--report trained"))
    (kept / "table.md").unlink()
    assert reproduce.main([*argv, "--trials", "2", "--report", "--out", str(tmp_path / "o2")]) == 0
    assert "| cnn | rs-fashion | 64 | no | ID | 1 |" in (kept / "table.md").read_text()


def test_reproduce_parks_an_unfinished_run_in_the_record_and_resumes_it_elsewhere(
    tmp_path, idx_source, monkeypatch
):
    """A call stopped inside a run copies its last.pt, best.pt and metrics into the committed
    record's unfinished/; a later call on another --out (a fresh clone, another machine)
    resumes from them instead of starting over, and drops them once the run is recorded."""
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    kept = tmp_path / "kept"
    argv = ["--data", "rs-fashion", "--budget", "smoke", "--models", "cnn", "--augment", "no"]
    argv += ["--data-root", str(idx_source), "--threads", "1", "--results", str(kept)]
    real_run_one = reproduce.run_one

    def stopped_before_its_test(spec, budget, opts):
        real_run_one(spec, budget, opts)
        (opts["root"] / spec.name / "summary.json").unlink()  # as if stopped after the epoch
        raise KeyboardInterrupt

    monkeypatch.setattr(reproduce, "run_one", stopped_before_its_test)
    first = tmp_path / "first"
    assert reproduce.main([*argv, "--trials", "1", "--out", str(first)]) == 1
    parked = kept / "unfinished" / "cnn-64-t0"
    assert sorted(p.name for p in parked.iterdir()) == ["best.pt", "last.pt", "metrics.jsonl"]
    assert not (kept / "runs" / "cnn-64-t0").exists()
    epochs = (parked / "metrics.jsonl").read_text()
    assert epochs.count("\n") == 1

    monkeypatch.setattr(reproduce, "run_one", real_run_one)
    second = tmp_path / "second"
    assert reproduce.main([*argv, "--trials", "1", "--out", str(second)]) == 0
    run = second / "rs-fashion" / "smoke" / "cnn-64-t0"
    assert (run / "metrics.jsonl").read_text() == epochs  # resumed: no epoch trained again
    assert (kept / "runs" / "cnn-64-t0" / "summary.json").is_file()
    assert not parked.exists()


def test_train_trial_stops_on_sigint_even_when_started_ignoring_it(
    tmp_path, idx_source, monkeypatch
):
    """reproduce.py --deadline sends itself SIGINT, and a job started in the background by a
    script starts with SIGINT ignored: train_trial installs its own handler, so the trial
    stops at the next batch boundary either way instead of running on."""
    import os
    import signal

    # the realisation of the test's tiny source goes to a temporary cache, not over the
    # checkout's prepared data (data/), which the next real run would have to prepare again
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))

    full = budgets.BUDGETS["smoke"]
    args = budgets.budget_config(
        "cnn",
        64,
        full,
        data="rs-fashion",
        realisation=0,
        seed=0,
        out=tmp_path / "run",
        device="cpu",
        data_root=idx_source,
    )

    def data():
        loaded = budgets.load_data(args, full, idx_source)
        os.kill(os.getpid(), signal.SIGINT)  # arrives once the handler is in place
        return loaded

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(engine.Interrupted):
            budgets.train_trial(args, data)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored afterwards
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not (tmp_path / "run" / "summary.json").exists()


# ---------------------------------------------------------------- the basis-size sweep


def test_sweep_models_hold_the_paper_parameter_count():
    from rstmodel import create_model

    structures = ((6, 8), (9, 8), (12, 8), (17, 8), (49, 8), (12, 4))  # (K, Nr)
    for name, (k, nr) in zip(budgets.SWEEP_MODELS, structures, strict=True):
        model = create_model(name)
        params = sum(p.numel() for p in model.parameters())
        assert (model.config.num_funcs, model.config.rotations) == (k, nr), name
        assert 490_000 <= params <= 510_000, (name, params)
        reduced = budgets.budget_config(name, 2000, budgets.BUDGETS["reduced"]).model_args
        small = create_model(name, input_size=32, **reduced)
        assert 10_000 <= sum(p.numel() for p in small.parameters()) <= 13_000, name


def test_k_sweep_verdict_needs_trials_and_the_spread():
    from rstcnn.train.k_sweep import spread_verdict

    def row(model, k, mean, std, trials, ms):
        return {"model": model, "K": k, "mean": mean, "std": std, "trials": trials, "eval_ms": ms}

    default = row("rst_cnn_fb", 12, 78.0, 0.6, 3, 10.0)
    close, worse = (
        row("rst_cnn_fb_k6", 6, 77.5, 0.4, 3, 5.0),
        row("rst_cnn_fb_k9", 9, 76.0, 0.3, 3, 7.0),
    )
    assert spread_verdict([close, worse, default]).startswith(
        "rst_cnn_fb_k6 (K = 6) is at least as accurate"
    )
    better = row("rst_cnn_fb_k17", 17, 80.0, 0.2, 3, 6.0)  # cheaper and more accurate
    assert spread_verdict([worse, better, default]).startswith("rst_cnn_fb_k17 (K = 17)")
    assert "2.00x less" in spread_verdict([close, default])
    assert spread_verdict([worse, default]).startswith("rst_cnn_fb stays")
    assert spread_verdict([{**close, "trials": 2}, default]).startswith("no verdict yet")
    assert spread_verdict([close]).startswith("no verdict")
    slower = row("rst_cnn_fb_ref", 49, 78.2, 0.1, 3, 20.0)  # more accurate, but not cheaper
    assert spread_verdict([slower, default]).startswith("rst_cnn_fb stays")
    quarter = {**row("rst_cnn_fb_nr4", 12, 77.8, 0.5, 3, 5.0), "Nr": 4}  # half the branches
    assert spread_verdict([quarter, default]).startswith("rst_cnn_fb_nr4 (K = 12, Nr = 4) is")


def test_k_sweep_smoke_trains_times_and_plots(tmp_path, idx_source, monkeypatch):
    from rstcnn.train import k_sweep

    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    out, record, sweep = tmp_path / "out", tmp_path / "record", tmp_path / "sweep"
    base = ["--budget", "smoke", "--data-root", str(idx_source), "--out", str(out)]
    base += ["--results", str(record), "--sweep-out", str(sweep), "--threads", "1"]
    base += ["--time-batch", "4", "--repeats", "1", "--trials", "1"]
    args = [*base, "--models", "rst_cnn_fb_k6", "rst_cnn_fb"]
    assert k_sweep.main(args) == 0
    assert sorted(p.name for p in (record / "runs").iterdir()) == [
        "rst_cnn_fb-64-t0",
        "rst_cnn_fb_k6-64-t0",
    ]
    saved = json.loads((sweep / "sweep.json").read_text())
    every = {r["model"]: r for r in saved["rows"]}
    assert tuple(every) == k_sweep.SWEEP_MODELS  # the report covers the models not trained
    assert all(r["eval_ms"] > 0 and r["eval_ms_b1"] > 0 for r in every.values())
    rows = {m: r for m, r in every.items() if r["trials"]}
    assert sorted(rows) == ["rst_cnn_fb", "rst_cnn_fb_k6"]
    assert rows["rst_cnn_fb_k6"]["K"] == 6 and rows["rst_cnn_fb"]["K"] == 12
    assert all(r["trials"] == 1 and 0 <= r["mean"] <= 100 for r in rows.values())
    assert saved["verdict"].startswith("no verdict yet")
    text = (sweep / "sweep.md").read_text()
    assert "| rst_cnn_fb_k6 | 6 | 8 | 2.5 |" in text and "Verdict: no verdict yet" in text
    assert (sweep / "accuracy-vs-time.png").stat().st_size > 1000
    # --report trains nothing, and keeps what an earlier call left in --out in the record
    shutil.rmtree(record / "runs" / "rst_cnn_fb_k6-64-t0")
    assert k_sweep.main([*args, "--report"]) == 0
    assert (record / "runs" / "rst_cnn_fb_k6-64-t0" / "summary.json").is_file()
    # the record alone gives the same accuracies
    shutil.rmtree(out)
    assert k_sweep.main([*args, "--report"]) == 0
    again = {r["model"]: r for r in json.loads((sweep / "sweep.json").read_text())["rows"]}
    assert {m: r["accuracies"] for m, r in again.items()} == {
        m: r["accuracies"] for m, r in every.items()
    }
    assert not (out / "rs-fashion" / "smoke" / "rst_cnn_fb-64-t0").exists()
    # a later call that trains one more model keeps the earlier rows, and the report counts
    # every trial in the record, whatever --trials says
    shutil.copytree(record / "runs" / "rst_cnn_fb-64-t0", record / "runs" / "rst_cnn_fb-64-t1")
    assert k_sweep.main([*base, "--models", "rst_cnn_fb_nr4"]) == 0
    last = {r["model"]: r for r in json.loads((sweep / "sweep.json").read_text())["rows"]}
    assert {m: r["trials"] for m, r in last.items() if r["trials"]} == {
        "rst_cnn_fb": 2,
        "rst_cnn_fb_k6": 1,
        "rst_cnn_fb_nr4": 1,
    }
    assert last["rst_cnn_fb_nr4"]["Nr"] == 4


def test_reproduce_resume_only_finishes_carried_runs_and_starts_none(
    tmp_path, idx_source, monkeypatch
):
    """A run begun elsewhere (its last.pt carried in, no summary) is finished; a run never
    begun is left alone."""
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["--data", "rs-fashion", "--budget", "smoke", "--models", "cnn", "--augment", "no"]
    argv += ["--data-root", str(idx_source), "--threads", "1", "--out", str(out)]
    assert reproduce.main([*argv, "--trials", "1"]) == 0
    root = out / "rs-fashion" / "smoke"
    (root / "cnn-64-t0" / "summary.json").unlink()  # stopped after its last epoch, say
    assert reproduce.main([*argv, "--trials", "2", "--resume-only"]) == 1  # t1 still to do
    assert (root / "cnn-64-t0" / "summary.json").is_file()
    assert not (root / "cnn-64-t1").exists()


def test_deadline_sends_sigint_once_and_disarms():
    """The deadline is a SIGINT to this process (which a trial's own handler turns into a
    stop at the next batch); here a recording handler stands in for the trial's."""
    import signal
    import time

    got: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        with reproduce.deadline(0.05):
            time.sleep(0.3)
        assert got == [1]
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        with reproduce.deadline(5):
            pass  # left early: disarmed, nothing fires later
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        with reproduce.deadline(None):
            time.sleep(0.1)
        assert got == [1]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_pose_use_winners_and_moves():
    """The winner is the (rotation, scale) of a channel's maximum; constant channels have none;
    moves count exactly one step, cyclic on the rotation axis."""
    feats = torch.zeros(1, 3, 4, 2, 2, 2)
    feats[0, 0, 3, 1, 1, 0] = 5.0  # channel 0 peaks at rotation 3, scale 1
    feats[0, 1, 0, 0, 0, 1] = 2.0  # channel 1 at rotation 0, scale 0; channel 2 is constant
    r, s, alive = pose_use.winners(feats)
    assert r.tolist() == [[3, 0, 0]] and s.tolist() == [[1, 0, 0]]
    assert alive.tolist() == [[True, True, False]]
    after = torch.tensor([[0, 1, 2]])  # channel 0: 3 -> 0 is +1 mod 4; channel 2 not counted
    assert pose_use.moved_share(r, after, alive, 1, 4) == 1.0
    assert pose_use.moved_share(r, after, alive, 1, None) == 0.5


def _rs_checkpoint(path: Path, name: str, **config) -> Path:
    torch.manual_seed(0)
    model = create_model(name, **config)
    with torch.no_grad():
        model.train()
        model(torch.randn(8, 1, 56, 56))
    run_args = {"data": "rs-fashion", "train_size": 64, "val_size": 32, "realisation": 0}
    save_checkpoint(
        path,
        model.eval(),
        model_name=name,
        class_names=[str(i) for i in range(10)],
        input_size=56,
        in_channels=1,
        normalization=([0.2], [0.3]),
        extra={"run": run_args},
    )
    return path


def test_pose_use_cli_bins_accuracy_and_a_quarter_turn_moves_every_winner(
    tmp_path, idx_source, monkeypatch
):
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    rst = _rs_checkpoint(tmp_path / "rst.pt", "rst_cnn_fb", channels=(3, 4, 5), hidden=8)
    cnn = _rs_checkpoint(tmp_path / "cnn.pt", "cnn")
    out = tmp_path / "pose"
    args = [str(rst), str(cnn), "--images", "150", "--sweep", "6", "--data-root", str(idx_source)]
    assert pose_use.main([*args, "--out", str(out), "--threads", "1"]) == 0
    rows = read_csv(out / "pose_use.csv")
    for model in ("rst_cnn_fb", "cnn"):
        mine = [r for r in rows if r["model"].startswith(model)]
        assert [r["axis"] for r in mine] == ["scale"] * 7 + ["angle"] * 8
        counts = {
            axis: sum(int(r["images"]) for r in mine if r["axis"] == axis)
            for axis in ("scale", "angle")
        }
        assert counts == {"scale": 150, "angle": 150}  # every test image in one bin per axis
    text = (out / "pose_use.md").read_text()
    assert "quarter turn (rot90): winner +Nr/4 (exact): 1.00" in text
    assert text.count("share of channels winning at each scale index") == 1  # the RST model only
    assert (out / "pose_use.png").stat().st_size > 1000
    # the quarter turn permutes the sampled filters exactly: every live winner moves Nr/4
    model, meta = load_checkpoint(rst)
    sources = np.random.default_rng(1).integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    sweep = pose_use.controlled_sweep(model, meta, sources, 0.6)
    assert sweep["quarter turn (rot90): winner +Nr/4 (exact)"] == 1.0
    assert 0 <= sweep["rotation +45 deg: winner +1 index"] <= 1


def test_reproduce_bf16_on_a_cpu_without_bfloat16_says_it_is_emulated(
    tmp_path, idx_source, monkeypatch, caplog
):
    """A shard trained with --bf16 where the CPU emulates bfloat16 (14x slower than float32 for
    the RST step on an AVX2 CPU) warns as train/run.py does, on the console and in the run's
    own train.log."""
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    monkeypatch.setattr(engine, "bf16_supported", lambda device: False)
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    args = ["--data", "rs-fashion", "--budget", "smoke", "--models", "cnn", "--augment", "no"]
    args += ["--bf16", "--data-root", str(idx_source), "--out", str(out), "--threads", "1"]
    assert reproduce.main(args) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no native bfloat16" in w and "drop --bf16" in w for w in warnings), warnings
    assert (
        "no native bfloat16"
        in (out / "rs-fashion" / "smoke" / "cnn-64-t0" / "train.log").read_text()
    )


@pytest.mark.parametrize(
    "command, args",
    [
        ("stability", ["{ckpt}", "--threads", "1", "--out", "{out}"]),
        ("pose_use", ["{ckpt}", "--threads", "1", "--out", "{out}"]),
        ("equivariance", ["--checkpoint", "{ckpt}", "--data", "synthetic", "--out", "{out}"]),
        ("precision_check", ["{ckpt}", "--precision", "{precision}"]),
        ("resampling", ["{ckpt}", "--out", "{out}"]),
        (
            "reproduce",
            [
                "--data",
                "rs-mnist",
                "--budget",
                "smoke",
                "--data-root",
                "{missing}",
                "--out",
                "{out}",
            ],
        ),
        ("k_sweep", ["--budget", "smoke", "--data-root", "{missing}", "--out", "{out}"]),
    ],
)
def test_experiment_commands_end_with_one_error_line_on_what_a_user_can_mend(
    tmp_path, monkeypatch, capsys, command, args
):
    """A corrupt checkpoint or a missing data folder: one 'error:' line that says what to do
    and exit status 2, not a traceback."""
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "cache"))
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"PK\x03\x04 half a zip, cut off by a crash")
    missing = tmp_path / "no-such-folder"
    # precision_check: a precision this CPU runs (int8 and bf16 want AVX512-BF16, int16 AVX2
    # without AVX-512), so that the checkpoint is what it refuses; where the CPU runs none,
    # the line it ends with says so
    module = importlib.import_module(f"rstcnn.train.{command}")
    runs = [p for p, (ok, _) in getattr(module, "_SUPPORT", {}).items() if ok("cpu")]
    precision = runs[0] if runs else "int16"
    argv = [
        a.format(ckpt=ckpt, missing=missing, out=tmp_path / "out", precision=precision)
        for a in args
    ]
    monkeypatch.chdir(tmp_path)  # anything written by mistake lands here
    assert module.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    expected = "not a readable checkpoint" if "{ckpt}" in args else "is not a folder"
    if command == "precision_check" and not runs:
        expected = "nothing to check"
    assert err.startswith("error: ") and expected in err, err
