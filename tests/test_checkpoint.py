"""Checkpoints: round trip, atomic writes, and refusal of corrupt or foreign files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rstmodel import CheckpointError, create_model, load_checkpoint, save_checkpoint
from rstmodel import checkpoint as ckpt
from rstmodel.layers import RotationTaps

CLASSES = [f"class{i}" for i in range(10)]


def save(path: Path, model: torch.nn.Module, name: str, **extra) -> None:
    config = model.config
    save_checkpoint(
        path,
        model,
        model_name=name,
        class_names=CLASSES,
        input_size=config.input_size,
        in_channels=config.in_channels,
        normalization=([0.25] * config.in_channels, [0.5] * config.in_channels),
        metrics={"val_acc": 0.5, "epoch": 3},
        extra=extra,
    )


def trained_cnn() -> torch.nn.Module:
    """A small CNN after two optimiser steps (running BN statistics no longer at init)."""
    model = create_model("cnn", channels=(4, 6, 8), hidden=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        x, y = torch.randn(8, 1, 56, 56), torch.randint(0, 10, (8,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


@pytest.fixture
def saved_cnn(tmp_path) -> tuple[Path, torch.nn.Module]:
    model = trained_cnn()
    path = tmp_path / "cnn.pt"
    save(path, model, "cnn", step=torch.arange(3))
    return path, model


def test_round_trip_gives_the_same_outputs_and_metadata(saved_cnn):
    path, model = saved_cnn
    loaded, meta = load_checkpoint(path)
    assert not loaded.training
    assert loaded.config == model.config
    x = torch.randn(4, 1, 56, 56)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert meta.model_name == "cnn" and meta.class_names == tuple(CLASSES)
    assert (meta.input_size, meta.in_channels, meta.mean, meta.std) == (56, 1, (0.25,), (0.5,))
    assert meta.metrics == {"val_acc": 0.5, "epoch": 3}
    assert torch.equal(meta.extra["step"], torch.arange(3))
    assert meta.format_version == ckpt.FORMAT_VERSION


def test_enums_and_tuples_round_trip_for_an_rst_model(tmp_path):
    model = create_model(
        "rst_cnn_sl", channels=(4, 6, 8), hidden=16, rotation_taps=2, tap_mode="adjacent"
    ).eval()
    path = tmp_path / "rst.pt"
    save(path, model, "rst_cnn_sl")
    raw = torch.load(path, weights_only=True)
    assert raw["config"]["tap_mode"] == "adjacent" and raw["config"]["channels"] == (4, 6, 8)
    loaded, meta = load_checkpoint(path)
    assert loaded.config == model.config
    assert loaded.config.tap_mode is RotationTaps.ADJACENT
    assert isinstance(loaded.config.channels, tuple)
    x = torch.randn(2, 1, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_write_is_atomic(tmp_path, saved_cnn, monkeypatch):
    path, _ = saved_cnn
    before = path.read_bytes()

    def fail(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        save(path, create_model("cnn", channels=(4, 6, 8), hidden=16), "cnn")
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_save_refuses_objects_that_are_not_plain(tmp_path):
    model = create_model("cnn", channels=(4, 6, 8), hidden=16)
    with pytest.raises(TypeError, match=r"\['bad'\] holds a \w*Path"):
        save(tmp_path / "x.pt", model, "cnn", bad=Path("."))
    with pytest.raises(ValueError, match="unknown model"):
        save_checkpoint(
            tmp_path / "x.pt",
            model,
            model_name="nope",
            class_names=CLASSES,
            input_size=56,
            in_channels=1,
            normalization=([0.0], [1.0]),
        )
    assert not list(tmp_path.iterdir())


def test_truncated_and_garbage_files_are_rejected(tmp_path, saved_cnn):
    path, _ = saved_cnn
    data = path.read_bytes()
    cases = {
        "truncated.pt": data[: len(data) // 2],
        "garbage.pt": os.urandom(4096),
        "empty.pt": b"",
        "text.pt": b"not a checkpoint\n",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match="not a readable checkpoint"):
            load_checkpoint(tmp_path / name)


def test_foreign_files_are_rejected(tmp_path):
    plain = tmp_path / "state_dict.pt"
    torch.save(create_model("cnn", channels=(4, 6, 8), hidden=16).state_dict(), plain)
    with pytest.raises(CheckpointError, match="bare state dict"):
        load_checkpoint(plain)
    other = tmp_path / "list.pt"
    torch.save([1, 2, 3], other)
    with pytest.raises(CheckpointError, match="not an rstcnn checkpoint"):
        load_checkpoint(other)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


class _RunsCode:
    """Unpickling this calls ``Path.touch`` on the marker: a stand-in for any code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("writer", ["torch", "pickle"])
def test_pickled_objects_are_refused_without_running_code(tmp_path, writer):
    marker = tmp_path / "code-ran"
    payload = {"format": ckpt.FORMAT_TAG, "model_name": "cnn", "x": _RunsCode(marker)}
    path = tmp_path / "evil.pt"
    if writer == "torch":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(CheckpointError, match="nothing in it was executed"):
        load_checkpoint(path)
    assert not marker.exists()


def _rewrite(path: Path, **changes) -> None:
    payload = torch.load(path, weights_only=True)
    for key, value in changes.items():
        if value is None:
            del payload[key]
        else:
            payload[key] = value
    torch.save(payload, path)


def test_unknown_model_name_is_rejected(saved_cnn):
    path, _ = saved_cnn
    _rewrite(path, model_name="resnet9000")
    with pytest.raises(CheckpointError, match="'resnet9000'.*does not know"):
        load_checkpoint(path)


def test_invalid_contents_are_rejected(saved_cnn):
    path, _ = saved_cnn
    good = path.read_bytes()
    payload = torch.load(path, weights_only=True)

    def expect(match: str, **changes) -> None:
        path.write_bytes(good)
        _rewrite(path, **changes)
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(path)

    expect("newer rstcnn", format_version=ckpt.FORMAT_VERSION + 1)
    expect("lacks state_dict", state_dict=None)
    expect("cannot be rebuilt", config={**payload["config"], "wings": 2})
    expect("cannot be rebuilt", config={**payload["config"], "kernel_size": 4})
    state = dict(payload["state_dict"])
    state["features.0.weight"] = torch.zeros(5, 1, 7, 7)
    expect("do not fit", state_dict=state)
    state = dict(payload["state_dict"])
    del state["head.2.bias"]
    expect("do not fit", state_dict=state)
    expect("normalization", normalization={"mean": [0.0], "std": [0.0]})
    expect("3 class names", class_names=["a", "b", "c"])
    expect("config input_size=56", input_size=32)


def test_records_written_with_the_old_spelling_still_read(tmp_path):
    """Checkpoints and summaries written before the rename spell the realisation
    ``realization``: they load with today's key (shipped models, resumable runs, the
    committed results), and a resume compares them as equal."""
    path = tmp_path / "old.pt"
    run = {"data": "rs-fashion", "realization": 3, "seed": 3}
    save(path, trained_cnn(), "cnn", run=run)
    _, meta = load_checkpoint(path)
    assert meta.extra["run"] == {"data": "rs-fashion", "realisation": 3, "seed": 3}
    assert ckpt.upgrade_record({"realisation": 1, "model": "cnn"}) == {
        "realisation": 1,
        "model": "cnn",
    }
    from rstcnn.train import report

    (tmp_path / "summary.json").write_text(
        '{"model": "cnn", "data": "rs-fashion", "test_acc": 0.5, "realization": 2}'
    )
    (summary,) = report.load_summaries([tmp_path / "summary.json"])
    assert summary["realisation"] == 2 and "realization" not in summary
