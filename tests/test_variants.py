"""serve.variants: of several exported files of one checkpoint, the server keeps the fastest
that may be served (float32, or a reduced copy whose recorded accuracy check passed)."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient

from rstcnn.export.precision import GATE_POINTS, GateResult, convert, record_gate
from rstcnn.serve import Classifier
from rstcnn.serve.app import build_app
from rstcnn.serve.variants import fastest_variants, servable


def gate_result(passes: bool) -> GateResult:
    drop = 0.1 if passes else GATE_POINTS + 1
    return GateResult("int8", 32, 0.80 - drop / 100, 0.80, 0.97, 0.2, 0.05, 1e-6)


@pytest.fixture(scope="module")
def variants(model_paths, tmp_path_factory):
    """The tiny exported CNN, an int8 copy with a passing check, one with a failing check
    and one never checked."""
    folder = tmp_path_factory.mktemp("variants")
    cnn = model_paths[1]
    x = np.random.default_rng(0).normal(size=(8, 1, 56, 56)).astype(np.float32)
    paths = {"fp32": cnn}
    for name, passes in (("passed", True), ("failed", False), ("unchecked", None)):
        out = folder / f"cnn.{name}.onnx"
        convert(cnn, out, "int8", calibration=x, calibration_source="noise")
        if passes is not None:
            record_gate(out, gate_result(passes))
        paths[name] = out
    return paths


def test_record_gate_writes_the_verdict_into_the_file(variants):
    meta = {p.key: p.value for p in onnx.load(variants["passed"]).metadata_props}
    gate = json.loads(meta["rstcnn.gate"])
    assert gate["passes"] is True and gate["images"] == 32 and gate["limit_points"] == GATE_POINTS
    assert gate["drop_points"] == pytest.approx(0.1)
    assert meta["rstcnn.precision"] == "int8"  # the rest of the metadata is kept
    failed = json.loads(
        {p.key: p.value for p in onnx.load(variants["failed"]).metadata_props}["rstcnn.gate"]
    )
    assert failed["passes"] is False


def test_servable_reads_precision_and_gate(variants):
    load = {k: Classifier.from_onnx(p, threads=1) for k, p in variants.items()}
    assert servable(load["fp32"]) == (True, "float32")
    ok, why = servable(load["passed"])
    assert ok and why == "int8, accuracy check passed (-0.10 points on 32 test images)"
    ok, why = servable(load["failed"])
    assert not ok and "failed its accuracy check" in why and "limit -0.5" in why
    ok, why = servable(load["unchecked"])
    assert not ok and "without an accuracy check" in why and "--check" in why


def test_fastest_servable_file_of_each_checkpoint_is_kept(variants, model_paths, caplog):
    load = {k: Classifier.from_onnx(p, threads=1) for k, p in variants.items()}
    rst = Classifier.from_onnx(model_paths[0], threads=1)
    order = [rst, load["unchecked"], load["fp32"], load["failed"], load["passed"]]
    with caplog.at_level(logging.INFO, logger="serve.variants"):
        kept, lines = fastest_variants(order, batch=4, repeats=1)
    assert kept[0] is rst  # another checkpoint: kept, in its place
    assert len(kept) == 2
    # one of the two servable files, or both routed by batch size (the faster alone for one image)
    sources = [load["fp32"].source, load["passed"].source]
    assert kept[1] in (load["fp32"], load["passed"]) or all(s in kept[1].source for s in sources)
    assert sum("not served" in line for line in lines) == 2
    timed = [line for line in lines if "ms per batch of 2" in line]  # the screening batch
    assert len(timed) == 2 and sum(line.endswith("served") for line in timed) == 1
    assert all(line in caplog.text for line in lines)
    # a single servable file is kept without timing
    kept, lines = fastest_variants([load["fp32"], load["failed"]], batch=4)
    assert kept == [load["fp32"]] and len(lines) == 1


def test_the_app_serves_one_file_per_checkpoint(variants, model_paths, samples):
    folder = samples[0].path.parent
    app = build_app([model_paths[0], variants["fp32"], variants["unchecked"]], samples_dir=folder)
    listed = TestClient(app, base_url="http://127.0.0.1").get("/v1/models").json()
    names = [m["name"] for m in listed["models"]]
    assert names == ["rst_cnn_fb", "cnn"]  # the unchecked int8 copy is not served
    with pytest.raises(ValueError, match="no servable model"):
        build_app([variants["unchecked"]], samples_dir=folder)


class FakeClock:
    """The clock ``serve.variants`` times with: a fake backend advances it by its modelled
    cost, so the timings the decisions read are exact (a real sleep overshoots by
    milliseconds on a loaded 2-core CI machine, which flipped 1.2x into 1.5x)."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


@pytest.fixture
def fake_clock(monkeypatch):
    """Used by every test of ``timed_fake`` copies (the real files above keep the real clock)."""
    import types

    import rstcnn.serve.variants as variants_module

    monkeypatch.setattr(
        variants_module, "time", types.SimpleNamespace(perf_counter=FakeClock.perf_counter)
    )


def timed_fake(name: str, fixed: float, per_image: float, calls: list) -> Classifier:
    """A Classifier of one checkpoint ("abc") whose backend takes ``fixed + per_image * n``
    seconds of the fake clock and logs (name, n)."""
    meta = {
        "rstcnn.model": "m",
        "rstcnn.class_names": json.dumps(["a", "b"]),
        "rstcnn.input_size": json.dumps([1, 8, 8]),
        "rstcnn.normalization": json.dumps({"mean": [0.5], "std": [0.25]}),
        "rstcnn.checkpoint_sha256": "abc",
    }

    def run(batch: np.ndarray) -> np.ndarray:
        calls.append((name, len(batch)))
        FakeClock.now += fixed + per_image * len(batch)
        return np.zeros((len(batch), 2), np.float32)

    clf = Classifier(run, meta, [name])
    clf.source = f"{name}.file"
    return clf


def test_a_file_faster_alone_serves_single_images_and_the_other_the_sweeps(fake_clock):
    calls: list = []
    lean = timed_fake("lean", 0.001, 0.010, calls)  # wins one image: 11 ms against 31
    wide = timed_fake("wide", 0.030, 0.001, calls)  # wins 16 images: 46 ms against 161
    kept, lines = fastest_variants([lean, wide], batch=16, repeats=1)
    (both,) = kept
    assert both.providers == ["wide", "lean"] and both.source.startswith("wide.file")
    assert any(
        line.startswith("m (lean.file)") and "served for up to 4 images" in line for line in lines
    )
    assert any(line.startswith("m (wide.file)") and line.endswith(", served") for line in lines)
    calls.clear()
    both.run_logits(np.zeros((1, 1, 8, 8), np.float32))
    both.run_logits(np.zeros((4, 1, 8, 8), np.float32))
    both.run_logits(np.zeros((5, 1, 8, 8), np.float32))
    assert calls == [("lean", 1), ("lean", 4), ("wide", 5)]
    # the same file winning both: served alone, as before
    calls.clear()
    kept, lines = fastest_variants(
        [wide, timed_fake("slow", 0.050, 0.020, calls)], batch=4, repeats=1
    )
    assert kept == [wide] and sum(line.endswith(", served") for line in lines) == 1


def test_a_file_only_a_little_faster_alone_does_not_take_the_single_images(fake_clock):
    """Within ROUTE_MARGIN at one image the sweep's winner serves every call: start-up
    timings are noisy, and a joining engine is the faster one under concurrent load."""
    calls: list = []
    close = timed_fake("close", 0.100, 0.010, calls)  # one image 110 ms, 16 images 260 ms
    wide = timed_fake("wide", 0.115, 0.001, calls)  # one image 116 ms (< 1.25 x 110), 16: 131
    kept, lines = fastest_variants([close, wide], batch=16, repeats=1)
    assert kept == [wide]
    assert any(line.startswith("m (close.file)") and line.endswith(", slower") for line in lines)


def test_a_copy_far_slower_at_the_screening_batch_is_not_run_at_the_sweeps(fake_clock):
    """Each copy warms up and runs once at sqrt(batch) images; only those within
    CONTENDER_MARGIN of the fastest there run the sweep's batch (warm-up and ``repeats``),
    the start-up's longest wait. One image: every copy (it may be routed single images)."""
    calls: list = []
    quick = timed_fake("quick", 0.010, 0.001, calls)  # 4 images: 14 ms; 16: 26; one: 11
    slow = timed_fake("slow", 0.040, 0.004, calls)  # 4 images: 56 ms (4x); one: 44
    near = timed_fake("near", 0.012, 0.001, calls)  # 4 images: 16 ms; 16: 28; one: 13
    kept, lines = fastest_variants([slow, quick, near], batch=16, repeats=3)
    assert kept == [quick]
    for name, runs in (("quick", 4), ("near", 4), ("slow", 0)):  # warm-up + 3, or none
        assert calls.count((name, 16)) == runs and calls.count((name, 4)) == 2, calls
    # one image: warm-up + 3, but warm-up + 1 for a copy already 1.5x slower there
    assert [calls.count((name, 1)) for name in ("quick", "near", "slow")] == [4, 4, 2], calls
    assert any(
        line.startswith("m (slow.file)") and "per batch of 16" not in line and "slower" in line
        for line in lines
    )
    assert any(line.startswith("m (quick.file)") and "ms per batch of 16" in line for line in lines)


def test_a_sole_contender_is_served_without_the_sweeps_batch(fake_clock):
    calls: list = []
    quick = timed_fake("quick", 0.010, 0.001, calls)
    slow = timed_fake("slow", 0.040, 0.004, calls)
    kept, lines = fastest_variants([slow, quick], batch=16, repeats=3)
    assert kept == [quick] and not any(n == 16 for _, n in calls), calls
    assert any(line.startswith("m (quick.file)") and line.endswith(", served") for line in lines)


def test_a_copy_far_slower_at_its_first_run_is_not_timed_again(fake_clock):
    """Among contenders at the sweep's batch, one whose first timed run there is
    CONTENDER_MARGIN slower than the fastest first run is not timed again."""
    calls: list = []
    # 4 images: 45 and 60 ms (both contenders); 16 images: 57 ms against 150 (2.6x); one
    # image: 42 and 37.5 ms (not faster by ROUTE_MARGIN)
    quick = timed_fake("quick", 0.041, 0.001, calls)
    slow = timed_fake("slow", 0.030, 0.0075, calls)
    kept, lines = fastest_variants([slow, quick], batch=16, repeats=3)
    assert kept == [quick]
    assert calls.count(("quick", 16)) == 4 and calls.count(("slow", 16)) == 2, calls
