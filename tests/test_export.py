"""Export: bake parity for every model, batch-norm folding, ONNX graph, metadata, parity and
invariance through onnxruntime, the to_onnx / to_tensorrt command lines."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from torch import nn

import rstmodel
from rstcnn.export import to_onnx
from rstcnn.export.bake import BASIS, bake
from rstcnn.export.onnx_export import check_onnx, export_model, export_onnx, group_metadata
from rstcnn.export.to_tensorrt import fp16_model, missing_requirements
from rstmodel.data import RSConfig, default_cache_dir, load_rs
from rstmodel.layers import GroupRSTConv

REPO = Path(__file__).resolve().parents[1]

# small but complete versions of every registered model
SMALL = {
    "cnn": {"channels": (4, 6, 8), "hidden": 16},
    "resnet16": {"widths": (8, 8, 16), "input_size": 32},
    "rst_resnet16": {"widths": (4, 4, 8), "input_size": 32},
}
RST_SMALL = {"channels": (3, 4, 5), "hidden": 8}
# what the ONNX graph may hold: standard ops, nothing model-specific
ALLOWED_OPS = {
    "Add",
    "Concat",
    "Conv",
    "Flatten",
    "Gemm",
    "MatMul",
    "MaxPool",
    "Mul",
    "ReduceMax",
    "Relu",
    "Reshape",
    "Shape",
    "Slice",
    "Split",
    "Squeeze",
    "Transpose",
    "Unsqueeze",
}


def small_model(name: str, **extra) -> nn.Module:
    return rstmodel.create_model(name, **{**SMALL.get(name, RST_SMALL), **extra})


def randomize_norms(model: nn.Module, seed: int = 0, *, negative: bool = True) -> None:
    """Running statistics and affine parameters far from the defaults; with ``negative``
    about a third of the batch-norm scales are negative."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.5)
                m.running_var.copy_(torch.rand(n, generator=gen) * 2 + 0.2)
                gamma = torch.rand(n, generator=gen) + 0.2
                if negative:
                    gamma[torch.rand(n, generator=gen) < 0.35] *= -1
                m.weight.copy_(gamma)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.5)


def input_shape(model: nn.Module) -> tuple[int, int, int]:
    c = model.config
    return c.in_channels, c.input_size, c.input_size


def train_steps(model: nn.Module, steps: int = 3) -> None:
    """A few Adam steps in train mode after an eval call, so a stale eval cache would show."""
    dtype = next(model.parameters()).dtype
    x = torch.randn(4, *input_shape(model), dtype=dtype)
    y = torch.randint(0, 10, (4,))
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


# ---------------------------------------------------------------- bake


@pytest.mark.parametrize("name", rstmodel.list_models())
def test_bake_matches_the_model_and_leaves_it_alone(name):
    model = small_model(name).double()
    train_steps(model)
    randomize_norms(model)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.requires_grad for p in model.parameters()]
    baked = bake(model)
    x = torch.randn(3, *input_shape(model), dtype=torch.float64)
    with torch.no_grad():
        expected, got = model(x), baked(x)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-10 * max(scale, 1.0)
    # the source is untouched: weights, mode, gradient flags
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training and grads == [p.requires_grad for p in model.parameters()]
    # plain torch only: no rstmodel class, no batch norm, no einsum
    assert all(type(m).__module__.startswith("torch.") for m in baked.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in baked.modules())
    assert "einsum" not in baked.code


@pytest.mark.parametrize("name", ["rst_cnn_fb", "rst_cnn_sl", "rot_cnn", "scale_cnn"])
def test_quarter_turn_bake_is_the_same_function_with_a_quarter_of_the_rotations(name):
    """bake(quarter_turns=True): R/4 base rotations on the four turned copies of each image
    give the model's logits (float64, to round-off), with a quarter of the rotation-specific
    filters."""
    model = small_model(name).double()
    if model.spec.rotations % 4:
        with pytest.raises(ValueError, match="R not divisible by 4"):
            bake(model, quarter_turns=True)
        return
    train_steps(model)
    randomize_norms(model)
    model.eval()
    plain, turned = bake(model), bake(model, quarter_turns=True)
    x = torch.randn(3, *input_shape(model), dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        got = turned(x)
    assert (got - expected).abs().max().item() <= 1e-10 * max(expected.abs().max().item(), 1.0)
    assert got.shape == expected.shape
    spatial = [
        sum(m.weight.numel() for m in g.modules() if isinstance(m, nn.Conv2d))
        for g in (plain, turned)
    ]
    assert spatial[1] < spatial[0]
    assert all(type(m).__module__.startswith("torch.") for m in turned.modules())


def test_quarter_turn_bake_is_refused_where_it_would_be_wrong():
    with pytest.raises(ValueError, match="several rotation taps"):
        bake(small_model("rst_cnn_plus_fb").eval(), quarter_turns=True)
    with pytest.raises(ValueError, match="no RST convolution"):
        bake(small_model("cnn").eval(), quarter_turns=True)


def test_bake_folds_positive_norm_scales_and_keeps_the_rest():
    """All-positive scales: no multiplication remains (every scale is folded into a conv or
    the FC layer). Mixed signs: a Mul by the signs remains, and the result still matches."""
    for name in ("rst_cnn_fb", "cnn"):
        model = small_model(name).double().eval()
        randomize_norms(model, negative=False)
        baked = bake(model)
        assert "mul" not in baked.code
        x = torch.randn(2, *input_shape(model), dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(baked(x), model(x), rtol=1e-10, atol=1e-10)

        randomize_norms(model, seed=1, negative=True)
        baked = bake(model)
        assert "mul" in baked.code
        with torch.no_grad():
            torch.testing.assert_close(baked(x), model(x), rtol=1e-10, atol=1e-10)


def test_head_norm_folds_entirely():
    """Linear -> BatchNorm1d in the head folds into the Linear: the head is Gemm, ReLU, Gemm."""
    model = small_model("rst_cnn_fb").eval()
    randomize_norms(model)
    baked = bake(model)
    head = [m for m in baked.modules() if isinstance(m, (nn.Linear, nn.ReLU))][-3:]
    assert [type(m) for m in head] == [nn.Linear, nn.ReLU, nn.Linear]


def test_default_rst_cnn_fb_bakes_to_basis_form_and_a_small_file():
    model = rstmodel.create_model("rst_cnn_fb").eval()
    randomize_norms(model)
    spec = model.spec
    convs = [m for m in model.modules() if isinstance(m, GroupRSTConv)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(69, 135), (135, 204)]
    assert all(c.static_form(s) == BASIS for c in convs for s in range(spec.num_scales))
    baked = bake(model)
    convs = [m for m in baked.modules() if isinstance(m, nn.Conv2d)]
    spatial = [m for m in convs if m.kernel_size[0] > 1]
    # every spatial conv is a fixed basis bank on one input plane; the rest is 1x1 mixing
    assert spatial and all(m.in_channels == 1 for m in spatial)
    assert all(m.kernel_size == (1, 1) for m in convs if m not in spatial)
    stored = sum(t.numel() * t.element_size() for t in baked.state_dict().values())
    assert stored < 4e6, f"{stored / 1e6:.1f} MB"
    x = torch.randn(1, 1, 56, 56)
    with torch.no_grad():
        expected, got = model(x), baked(x)
    assert (got - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())


def test_group_metadata_reports_the_configuration():
    group = group_metadata(rstmodel.create_model("rst_cnn_plus_fb", channels=(2, 3, 4)))
    assert group["rotations"] == 8 and group["scales"] == 4 and group["K"] == 12
    assert group["basis"] == "fb" and group["kernel_sizes"] == [5, 7, 11, 15]
    assert group["taps"] == {"rotation": 4, "scale": 1, "mode": "coarse"}
    assert group_metadata(small_model("cnn")) is None


# ---------------------------------------------------------------- ONNX


def save_small_checkpoint(path: Path, model: nn.Module, name: str) -> None:
    rstmodel.save_checkpoint(
        path,
        model,
        model_name=name,
        class_names=[f"class {i}" for i in range(10)],
        input_size=model.config.input_size,
        in_channels=model.config.in_channels,
        normalization=([0.25], [0.35]),
        metrics={"epoch": 3, "val_acc": 0.625, "train_loss": 0.9},
        extra={"run": {"data": "rs-fashion", "realisation": 0}},
    )


@pytest.fixture(scope="module")
def rst_export(tmp_path_factory):
    """A trained-a-little, 2-scale RST-CNN, its checkpoint and its ONNX export."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("rst")
    model = small_model("rst_cnn_fb", num_scales=2)
    train_steps(model, steps=2)
    randomize_norms(model)
    model.eval()
    checkpoint = folder / "model.pt"
    save_small_checkpoint(checkpoint, model, "rst_cnn_fb")
    path, loaded, meta = export_onnx(checkpoint, folder / "model.onnx")
    return path, loaded, meta, checkpoint


def ops(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(path).graph.node}


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_onnx_graph_is_standard_ops_with_a_dynamic_batch(rst_export):
    path = rst_export[0]
    found = ops(path)
    assert "Einsum" not in found and "BatchNormalization" not in found
    assert found <= ALLOWED_OPS, found - ALLOWED_OPS
    proto = onnx.load(path)
    (inp,), (out,) = proto.graph.input, proto.graph.output
    assert (inp.name, out.name) == ("images", "logits")
    dims = inp.type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [1, 56, 56]
    assert not any(
        init.data_location == onnx.TensorProto.EXTERNAL for init in proto.graph.initializer
    )


def test_onnx_metadata_round_trip(rst_export):
    path, model, meta, checkpoint = rst_export
    props = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert props["rstcnn.model"] == "rst_cnn_fb"
    assert json.loads(props["rstcnn.class_names"]) == list(meta.class_names)
    assert json.loads(props["rstcnn.input_size"]) == [1, 56, 56]
    assert json.loads(props["rstcnn.normalization"]) == {"mean": [0.25], "std": [0.35]}
    group = json.loads(props["rstcnn.group"])
    assert (group["rotations"], group["scales"], group["K"]) == (8, 2, 12)
    assert props["rstcnn.checkpoint_sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    assert props["rstcnn.version"] == rstmodel.__version__
    assert json.loads(props["rstcnn.accuracy"]) == {"epoch": 3, "val_acc": 0.625}
    assert all(isinstance(v, str) for v in props.values())


def test_onnxruntime_matches_the_eager_model_at_any_batch(rst_export):
    path, model, _, _ = rst_export
    sess = session(path)
    for batch in (1, 5):
        x = torch.randn(batch, 1, 56, 56)
        with torch.no_grad():
            expected = model(x).numpy()
        got = sess.run(["logits"], {"images": x.numpy()})[0]
        assert got.shape == (batch, 10)
        assert np.abs(got - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


def test_ninety_degree_turns_give_the_same_logits_through_onnxruntime(rst_export, blobs):
    sess = session(rst_export[0])
    x = blobs((2, 1), 56).float().numpy()
    turned = [np.ascontiguousarray(np.rot90(x, k, axes=(2, 3))) for k in range(4)]
    logits = [sess.run(["logits"], {"images": t})[0] for t in turned]
    scale = np.abs(logits[0]).max()
    for other in logits[1:]:
        assert np.abs(other - logits[0]).max() <= 1e-5 * max(1.0, scale)
    # control: a circular shift is no symmetry of the model, so the test can fail
    shifted = np.roll(x, 3, axis=3)
    assert np.abs(sess.run(["logits"], {"images": shifted})[0] - logits[0]).max() > 1e-4


def test_cnn_exports_with_fixed_pools(tmp_path):
    model = small_model("cnn").eval()
    randomize_norms(model)
    path = export_model(model, tmp_path / "cnn.onnx", input_shape=(1, 56, 56))
    assert ops(path) <= ALLOWED_OPS
    x = torch.randn(3, 1, 56, 56)
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(
        session(path).run(None, {"images": x.numpy()})[0], expected, atol=1e-5
    )


def test_check_detects_a_model_that_differs(rst_export):
    path, model, meta, _ = rst_export
    images = np.random.default_rng(0).integers(0, 256, (6, 1, 56, 56), dtype=np.uint8)
    assert check_onnx(path, model, images, meta.mean, meta.std).ok
    other = small_model("rst_cnn_fb", num_scales=2).eval()
    result = check_onnx(path, other, images, meta.mean, meta.std)
    assert not result.ok and result.max_abs_diff > 1e-2


def test_check_tells_a_near_tie_from_a_changed_decision(tmp_path):
    """A top-1 change where eager's two best logits lie within twice the tolerance is a tie
    round-off may turn; anywhere else it fails the check (and so does the logit gap)."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.zeros((3, 4), np.float32)  # logits = bias: class 0 and 1 tied to 1e-5
    bias = np.array([1.0, 1.0 + 1e-5, 0.0], np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["images"], ["flat"]),
            helper.make_node("Gemm", ["flat", "w", "b"], ["logits"], transB=1),
        ],
        "tie",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["n", 1, 2, 2])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 3])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    path = tmp_path / "tie.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    images = np.zeros((2, 1, 2, 2), np.uint8)

    def eager(nudge: list[float]) -> nn.Module:
        linear = nn.Linear(4, 3)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(weight))
            linear.bias.copy_(torch.from_numpy(bias) + torch.tensor(nudge))
        return nn.Sequential(nn.Flatten(), linear).eval()

    same = check_onnx(path, eager([0, 0, 0]), images, (0.0,), (1.0,))
    assert same.ok and (same.top1_mismatches, same.ties) == (0, 0)
    tie = check_onnx(path, eager([3e-5, 0, 0]), images, (0.0,), (1.0,))  # eager picks 0
    assert tie.ok and (tie.top1_mismatches, tie.ties) == (0, 2)
    changed = check_onnx(path, eager([0.5, 0, 0]), images, (0.0,), (1.0,))
    assert not changed.ok and (changed.top1_mismatches, changed.ties) == (2, 0)


# ---------------------------------------------------------------- command lines


def run_cli(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "export" / script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=300,
    )


def data_cache(tmp_path: Path) -> dict[str, str]:
    """The environment for --check: the prepared RS-Fashion cache if there is one, else a
    tiny synthetic cache built from random digits (as tests/test_data.py does)."""
    config = RSConfig("rs-fashion")
    if config.cache_path(default_cache_dir()).is_file():
        return {}
    rng = np.random.default_rng(3)
    idx = tmp_path / "idx"
    idx.mkdir()
    for stem, array in (
        ("train-images-idx3-ubyte", rng.integers(0, 256, (60, 28, 28), dtype=np.uint8)),
        ("train-labels-idx1-ubyte", rng.integers(0, 10, 60, dtype=np.uint8)),
    ):
        header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        (idx / stem).write_bytes(header + array.tobytes())
    load_rs(config, cache_dir=tmp_path / "cache", data_root=idx)
    return {"RSTCNN_DATA": str(tmp_path / "cache")}


def test_to_onnx_cli_exports_and_checks_on_real_images(rst_export, tmp_path):
    checkpoint = rst_export[3]
    out = tmp_path / "cli.onnx"
    done = run_cli(
        "to_onnx.py", str(checkpoint), "-o", str(out), "--check", "24", env=data_cache(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert "check ok: 24 images" in done.stdout
    assert out.is_file() and ops(out) <= ALLOWED_OPS


def test_to_onnx_names_the_command_when_the_data_is_not_prepared(
    rst_export, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "nothing"))
    out = tmp_path / "never.onnx"
    assert to_onnx.main([str(rst_export[3]), "-o", str(out), "--check", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "python train/prepare_data.py --data rs-fashion" in err
    assert not out.exists()  # checked before the export


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a checkpoint at all")


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _foreign(path: Path) -> None:
    torch.save({"weights": torch.zeros(3)}, path)


@pytest.mark.parametrize("write", [_garbage, _empty, _foreign])
def test_to_onnx_refuses_corrupt_and_foreign_checkpoints(tmp_path, capsys, write):
    bad = tmp_path / "bad.pt"
    write(bad)
    assert to_onnx.main([str(bad)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(bad) in lines[0]
    assert not (tmp_path / "bad.onnx").exists()


def test_to_onnx_cli_error_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.pt"
    _garbage(bad)
    done = run_cli("to_onnx.py", str(bad))
    assert done.returncode == 2 and done.stderr.startswith("error:")
    assert "Traceback" not in done.stderr


def test_to_onnx_refuses_an_output_it_cannot_write_before_exporting(tmp_path, capsys):
    """-o into a folder that cannot be made: one line saying so, before the export runs."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "model.onnx"
    assert to_onnx.main([str(REPO / "models" / "cnn.pt"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot write {out}") and "-o" in err[0]


# ---------------------------------------------------------------- TensorRT


def _tensorrt_usable() -> bool:
    return not missing_requirements()


@pytest.mark.skipif(_tensorrt_usable(), reason="TensorRT and a GPU are here: the engine test runs")
def test_to_tensorrt_says_what_is_missing(rst_export):
    done = run_cli("to_tensorrt.py", str(rst_export[0]), "-o", "/nonexistent/never.plan")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    message = done.stderr
    assert "error:" in message
    if not torch.cuda.is_available():
        assert "CUDA GPU" in message
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert "TensorRT" in message


def test_fp16_graph_keeps_float32_io_and_the_logits(rst_export):
    path = rst_export[0]
    half = fp16_model(onnx.load(path))
    inits = [i for i in half.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert not inits
    assert half.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    x = np.random.default_rng(1).standard_normal((2, 1, 56, 56)).astype(np.float32)
    full = session(path).run(None, {"images": x})[0]
    got = ort.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"images": x}
    )[0]
    assert got.dtype == np.float32
    assert np.abs(got - full).max() <= 2e-2 * max(1.0, np.abs(full).max())


def _cuda_and_tensorrt() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _cuda_and_tensorrt(), reason="needs a CUDA GPU and TensorRT")
@pytest.mark.parametrize("fp16", [False, True])
def test_tensorrt_engine_matches_onnxruntime(rst_export, tmp_path, fp16):
    from rstcnn.export.to_tensorrt import build_engine
    from rstcnn.serve import Classifier

    path = rst_export[0]
    plan = build_engine(path, tmp_path / "model.plan", fp16=fp16, max_batch=8)
    trt_clf = Classifier.from_tensorrt(plan)
    onnx_clf = Classifier.from_onnx(path, providers=["CPUExecutionProvider"])
    assert trt_clf.class_names == onnx_clf.class_names and trt_clf.providers == ["TensorRT"]
    images = np.random.default_rng(2).integers(0, 256, (11, 56, 56), dtype=np.uint8)
    batch = onnx_clf.normalize(onnx_clf.prepare(list(images)))
    expected = onnx_clf.run_logits(batch)
    got = trt_clf.run_logits(batch)  # 11 > max batch 8: two engine calls
    tolerance = 5e-2 if fp16 else 1e-3
    assert np.abs(got - expected).max() <= tolerance * max(1.0, np.abs(expected).max())


# ---------------------------------------------------------------- reduced precision


@pytest.fixture(scope="module")
def real_test_images(tmp_path_factory):
    """Normalised real test images and their labels (the app's gallery: RS-Fashion)."""
    from serving import gallery

    found = gallery(tmp_path_factory.getbasetemp())
    images = np.stack([np.asarray(Image.open(s.path).convert("L")) for s in found])
    labels = np.array([s.label for s in found])
    return ((images[:, None].astype(np.float32) / 255 - 0.5) / 0.5).astype(np.float32), labels


def _check_int8_layout(model: onnx.ModelProto) -> None:
    """int8 where it is faster, one activation grid per layer: the multi-channel convs
    (the 1x1 mixing) read int8 weights, the single-channel basis banks keep float weights,
    and the convs of one layer (same weight and input shapes: its rotation and scale
    branches) read their inputs on one (scale, zero point)."""
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    grids: dict[str, set] = {}
    quantized = banks = 0
    for node in (n for n in model.graph.node if n.op_type == "Conv"):
        weight = producer.get(node.input[1])
        if weight is None:  # a float initializer
            assert values[node.input[1]].shape[1] == 1, "a multi-channel conv stayed float"
            banks += 1
            continue
        assert weight.op_type == "DequantizeLinear" and values[weight.input[0]].dtype == np.int8
        assert values[weight.input[0]].shape[1] > 1
        grid = producer[node.input[0]]  # the input's DequantizeLinear
        assert grid.op_type == "DequantizeLinear"
        key = (float(values[grid.input[1]]), int(values[grid.input[2]]))
        grids.setdefault(values[weight.input[0]].shape, set()).add(key)
        quantized += 1
    assert quantized > len(grids) and banks > 0  # branches share a grid; banks stay float
    assert all(len(g) == 1 for g in grids.values()), grids


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_reduced_precision_runs_in_the_classifier_and_is_gated(
    rst_export, real_test_images, tmp_path, precision
):
    from rstcnn.export.precision import GATE_POINTS, convert, gate
    from rstcnn.serve import Classifier

    path = rst_export[0]
    x, labels = real_test_images
    out = tmp_path / f"{precision}.onnx"
    convert(path, out, precision, calibration=x[:8], calibration_source="gallery")
    meta = {p.key: p.value for p in onnx.load(out).metadata_props}
    assert meta["rstcnn.precision"] == precision
    assert json.loads(meta["rstcnn.class_names"]) == json.loads(
        {p.key: p.value for p in onnx.load(path).metadata_props}["rstcnn.class_names"]
    )
    kinds = {n.op_type for n in onnx.load(out).graph.node}
    if precision == "int8":
        assert {"QuantizeLinear", "DequantizeLinear"} <= kinds
        assert json.loads(meta["rstcnn.calibration"])["images"] == 8
        _check_int8_layout(onnx.load(out))
    else:
        assert "Cast" in kinds and "rstcnn.calibration" not in meta
    clf = Classifier.from_onnx(out, threads=1)
    reference = Classifier.from_onnx(path, threads=1)
    grey = ((x * 0.5 + 0.5) * 255).round().astype(np.uint8)[:, 0]
    probs = clf.predict_proba(list(grey))
    assert probs.shape == (len(x), 10) and np.allclose(probs.sum(1), 1, atol=1e-4)
    agree = (probs.argmax(1) == reference.predict_proba(list(grey)).argmax(1)).mean()
    assert agree >= 0.75  # a few flips at most on a small random-ish model
    result = gate(out, path, x, labels)
    assert result.precision == precision and result.count == len(x)
    assert result.reference_quarter_turn < 1e-4  # float32: exactly invariant up to round-off
    assert result.ok == (result.drop_points <= GATE_POINTS)
    assert precision in result.report()


def test_current_says_when_a_reduced_file_may_stand_in_for_its_checkpoint(
    rst_export, real_test_images, tmp_path
):
    from rstcnn.export.precision import GateResult, convert, current, main, record_gate

    path, _, _, checkpoint = rst_export
    x, _ = real_test_images
    out = tmp_path / "m.int8.onnx"
    assert not current(out, checkpoint)[0]  # missing
    convert(path, out, "int8", calibration=x[:4])
    ok, why = current(out, checkpoint)
    assert not ok and "accuracy check" in why  # never checked
    result = GateResult("int8", 40, 0.80, 0.80, 1.0, 0.1, 0.1, 0.0)
    record_gate(out, result)
    assert current(out, checkpoint)[0] and main(["current", str(out), str(checkpoint)]) == 0
    record_gate(out, GateResult("int8", 40, 0.70, 0.80, 0.9, 1.0, 0.1, 0.0))  # failed gate
    assert not current(out, checkpoint)[0]
    record_gate(out, result)
    other = tmp_path / "other.pt"
    other.write_bytes(checkpoint.read_bytes() + b"\0")  # another version of the checkpoint
    ok, why = current(out, other)
    assert not ok and "another version" in why and main(["current", str(out), str(other)]) == 1
    (tmp_path / "junk.onnx").write_bytes(b"not onnx")
    assert not current(tmp_path / "junk.onnx", checkpoint)[0]


def test_the_gate_counts_a_drop_of_whole_images_exactly():
    """5 of 1,000 images lost is the 0.5-point limit itself, and passes; 6 do not. In plain
    floats 100 * (0.842 - 0.837) is 0.5000000000000004, which failed a file at the limit."""
    from rstcnn.export.precision import GATE_POINTS, GateResult, accuracy_drop_points

    def right(n: int) -> float:  # the accuracy of n right of 1,000, as np.mean gives it
        return float((np.arange(1000) < n).mean())

    assert 100 * (right(842) - right(837)) > GATE_POINTS  # the round-off the gate must not see
    assert accuracy_drop_points(right(842), right(837)) == GATE_POINTS
    assert GateResult("int8", 1000, right(837), right(842), 0.97, 2.0, 0.1, 0.0).ok
    assert not GateResult("int8", 1000, right(836), right(842), 0.97, 2.0, 0.1, 0.0).ok
    assert accuracy_drop_points(right(837), right(842)) == -GATE_POINTS  # a gain


def test_precision_arguments_are_checked(rst_export, tmp_path):
    from rstcnn.export.precision import convert

    with pytest.raises(ValueError, match="calibration"):
        convert(rst_export[0], tmp_path / "a.onnx", "int8")
    with pytest.raises(ValueError, match="precision"):
        convert(rst_export[0], tmp_path / "a.onnx", "int4")
    with pytest.raises(SystemExit):
        to_onnx.parse_args([str(rst_export[3]), "--calibration", "0"])


def test_quarter_turn_form_exports_and_runs_in_onnxruntime(tmp_path):
    model = small_model("rst_cnn_fb")
    train_steps(model)
    randomize_norms(model)
    model.eval()
    path = export_model(
        model, tmp_path / "q.onnx", input_shape=input_shape(model), quarter_turns=True
    )
    assert ops(path) <= ALLOWED_OPS, ops(path) - ALLOWED_OPS
    x = torch.randn(5, *input_shape(model))
    with torch.no_grad():
        expected = model(x).numpy()
    got = session(path).run(None, {"images": x.numpy()})[0]
    assert np.abs(got - expected).max() <= 1e-4 * max(np.abs(expected).max(), 1.0)


@pytest.mark.parametrize("name", ["rdcf_plus", "sesn", "sfcnn", "sfcnn_plus", "sevf"])
def test_the_paper_peers_export_and_match_through_onnxruntime(name, tmp_path):
    """The peers take the same path as every model: checkpoint -> export/to_onnx.py's
    export_onnx -> onnxruntime, with the eager model's logits."""
    torch.manual_seed(0)
    model = small_model(name)
    train_steps(model, steps=2)
    randomize_norms(model)
    model.eval()
    checkpoint = tmp_path / "model.pt"
    save_small_checkpoint(checkpoint, model, name)
    path, loaded, _ = export_onnx(checkpoint, tmp_path / "model.onnx")
    x = torch.randn(3, *input_shape(model))
    with torch.no_grad():
        expected = loaded(x).numpy()
    (got,) = session(path).run(None, {"images": x.numpy()})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


# ---------------------------------------------------------------- whole-split check


def test_split_check_compares_the_served_file_with_eager_and_resumes(
    rst_export, tmp_path, monkeypatch, capsys
):
    from rstcnn.export import split_check
    from rstcnn.serve.classifier import Classifier

    for key, value in data_cache(tmp_path).items():
        monkeypatch.setenv(key, value)
    path, checkpoint = rst_export[0], rst_export[3]
    out = tmp_path / "check.json"
    argv = [str(checkpoint), str(path), "--out", str(out), "--no-progress", "--chunk", "5"]
    assert split_check.main([*argv, "--limit", "12"]) == 0
    first = json.loads(out.read_text())
    assert first["images"] == first["of"] == 12 and first["within_gate"]
    assert first["top1_agreement"] == 1.0 and first["points"] == 0.0
    assert first["max_abs_logit_diff"] < 1e-4  # the float32 file is the eager model
    assert first["precision"] == "fp32" and "within the 0.5 gate" in capsys.readouterr().out

    # a call stopped after two chunks: the next call runs only the third
    state_path = out.with_suffix(".state.npz")
    with np.load(state_path) as saved:
        arrays = {k: saved[k].copy() for k in saved.files}
    arrays["served"][10:] = -1
    np.savez(state_path, **arrays)
    seen = []
    original = Classifier.run_logits
    monkeypatch.setattr(
        Classifier, "run_logits", lambda self, b: seen.append(len(b)) or original(self, b)
    )
    assert split_check.main([*argv, "--limit", "12"]) == 0
    assert seen == [2] and json.loads(out.read_text())["top1_agreement"] == 1.0

    # a state left by another chunk size: exactly the images not yet run, none skipped
    with np.load(state_path) as saved:
        arrays = {k: saved[k].copy() for k in saved.files}
    arrays["served"][[3, 4, 8]] = -1
    np.savez(state_path, **arrays)
    seen.clear()
    assert split_check.main([*argv[:-1], "2", "--limit", "12"]) == 0
    assert seen == [2, 1] and json.loads(out.read_text())["images"] == 12

    # a second served copy of the checkpoint (the eager engine, a .pt) reads the float32
    # logits the first check left beside it: the eager reference runs on no image again
    reference = tmp_path / f"eager-logits-{checkpoint.stem}.npz"
    assert reference.is_file()
    recorded = []
    other = tmp_path / "eager-copy.json"
    eager_argv = [str(checkpoint), str(checkpoint), "--out", str(other), "--no-progress"]
    with monkeypatch.context() as patch:
        patch.setattr(
            split_check.EagerLogits, "record", lambda self, index, logits: recorded.append(index)
        )
        assert split_check.main([*eager_argv, "--limit", "12"]) == 0
    assert recorded == [] and json.loads(other.read_text())["images"] == 12

    # other images: neither the saved state nor the reference is reused
    seen.clear()
    assert split_check.main([*argv, "--limit", "7"]) == 0
    assert seen == [5, 2] and json.loads(out.read_text())["of"] == 7
    with np.load(reference) as saved:
        assert saved["logits"].shape[0] == 7 and not np.isnan(saved["logits"]).any()


def test_split_check_names_what_is_missing(rst_export, tmp_path, monkeypatch, capsys):
    from rstcnn.export import split_check

    monkeypatch.setenv("RSTCNN_DATA", str(tmp_path / "nothing"))
    argv = [str(rst_export[3]), str(rst_export[0]), "--out", str(tmp_path / "x.json")]
    assert split_check.main([*argv, "--limit", "4"]) == 2
    assert "python train/prepare_data.py" in capsys.readouterr().err
    assert split_check.main([str(tmp_path / "none.pt"), str(rst_export[0]), "--limit", "4"]) == 2


def test_data_sample_whole_split_is_what_follows_training_and_validation(
    rst_export, tmp_path, monkeypatch
):
    import dataclasses

    from rstcnn.export.onnx_export import ExportError, data_sample

    for key, value in data_cache(tmp_path).items():
        monkeypatch.setenv(key, value)
    meta = rst_export[2]
    with pytest.raises(ExportError, match="train_size"):
        data_sample(meta, None)

    def with_run(**sizes):
        return dataclasses.replace(
            meta, extra={**meta.extra, "run": {**meta.extra["run"], **sizes}}
        )

    images, labels = data_sample(with_run(train_size=20, val_size=10), None, labels=True)
    fewer = data_sample(with_run(train_size=25, val_size=10), None)
    assert len(labels) == len(images) > 0 and len(fewer) == len(images) - 5
    assert np.array_equal(images, data_sample(meta, len(images)))  # the end of the permutation
    assert len(data_sample(with_run(train_size=20, val_size=10), None, split="train")) == 20


def test_split_check_cut_off_leaves_the_summary_of_its_chunks(rst_export, tmp_path, monkeypatch):
    from rstcnn.export import split_check
    from rstcnn.serve.classifier import Classifier

    for key, value in data_cache(tmp_path).items():
        monkeypatch.setenv(key, value)
    calls = []
    original = Classifier.run_logits

    def stop_second(self, batch):
        calls.append(len(batch))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setattr(Classifier, "run_logits", stop_second)
    out = tmp_path / "cut.json"
    argv = [str(rst_export[3]), str(rst_export[0]), "--out", str(out), "--no-progress"]
    with pytest.raises(KeyboardInterrupt):
        split_check.main([*argv, "--limit", "9", "--chunk", "5"])
    partial = json.loads(out.read_text())
    assert partial["images"] == 5 and partial["of"] == 9 and not partial["within_gate"]


# ---------------------------------------------------------------- eager engine (serve.eager)


def test_eager_engine_is_the_exported_file_in_float32(rst_export):
    """Classifier.from_checkpoint(precision="fp32") runs the checkpoint as the exported
    file does: the same logits, the same metadata where they share it."""
    from rstcnn.serve.classifier import Classifier

    path, checkpoint = rst_export[0], rst_export[3]
    eager = Classifier.from_checkpoint(checkpoint, "fp32", max_batch=3)
    onnx_clf = Classifier.from_onnx(path)
    x = np.random.default_rng(1).random((5, *onnx_clf.input_size), dtype=np.float32)
    got, want = eager.run_logits(eager.normalize(x)), onnx_clf.run_logits(onnx_clf.normalize(x))
    assert got.shape == want.shape == (5, len(onnx_clf.class_names))
    assert np.abs(got - want).max() < 1e-4
    for key in ("model", "class_names", "input_size", "normalization", "checkpoint_sha256"):
        assert eager.metadata["rstcnn." + key] == onnx_clf.metadata["rstcnn." + key], key
    turns = "rstcnn.quarter_turn_invariant"
    assert eager.metadata[turns] is onnx_clf.metadata[turns] is True
    assert eager.metadata["rstcnn.precision"] == "fp32" and eager.providers == ["torch-fp32"]
    assert eager.source == str(checkpoint)


def test_eager_engine_joins_concurrent_calls_with_the_same_answers(rst_export):
    """Calls that arrive while the eager engine runs are joined into one forward pass
    (serve.coalesce); each caller gets the logits its own images have alone."""
    import threading

    from rstcnn.serve.classifier import Classifier

    eager = Classifier.from_checkpoint(rst_export[3], "fp32", max_batch=8)
    rng = np.random.default_rng(2)
    images = [
        eager.normalize(rng.random((1, *eager.input_size), dtype=np.float32)) for _ in range(6)
    ]
    alone = [eager.run_logits(x) for x in images]
    calls_before = len(eager._run.batches)
    got = [None] * len(images)
    start = threading.Barrier(len(images))

    def classify(i):
        start.wait()
        got[i] = eager.run_logits(images[i])

    threads = [threading.Thread(target=classify, args=(i,)) for i in range(len(images))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for want, have in zip(alone, got, strict=True):
        np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)
    assert len(eager._run.batches) - calls_before < len(images)  # some calls were joined


def test_eager_bf16_is_served_only_with_its_own_passing_check(
    rst_export, tmp_path, caplog, monkeypatch
):
    """The gates as a CPU with native bfloat16 reads them (such a CPU stood in for where
    there is none: loading runs no bfloat16); where there is none, asking for it is refused."""
    import shutil

    from rstcnn.export.onnx_export import file_sha256
    from rstcnn.serve.classifier import Classifier
    from rstcnn.serve.eager import gate_path, write_gate
    from rstcnn.serve.variants import servable
    from rstmodel import precision

    checkpoint = tmp_path / "model.pt"
    shutil.copy(rst_export[3], checkpoint)
    monkeypatch.setattr(precision, "bf16_supported", lambda *_: False)
    with pytest.raises(ValueError, match="does not run bf16 natively.*'auto' or 'fp32'"):
        Classifier.from_checkpoint(checkpoint, "bf16")
    monkeypatch.setattr(precision, "bf16_supported", lambda *_: True)
    bf16_supported = precision.bf16_supported
    digest = file_sha256(checkpoint)
    # no check recorded: "auto" is exact float32; bf16 asked for is not servable
    assert Classifier.from_checkpoint(checkpoint).metadata["rstcnn.precision"] == "fp32"
    half = Classifier.from_checkpoint(checkpoint, "bf16")
    assert servable(half) == (False, "bf16 without an accuracy check (export it with --check N)")
    # a check of another version of the file is ignored, and said so
    record = {"passes": True, "images": 64, "drop_points": 0.1, "limit_points": 0.5}
    write_gate(checkpoint, "0" * 64, record)
    assert not servable(Classifier.from_checkpoint(checkpoint, "bf16"))[0]
    assert "made for another version" in caplog.text
    # its own passing check: servable; "auto" takes bf16 where the CPU has it
    assert write_gate(checkpoint, digest, record) == gate_path(checkpoint)
    assert gate_path(checkpoint).name == "model.bf16-gate.json"
    half = Classifier.from_checkpoint(checkpoint, "bf16")
    assert servable(half) == (True, "bf16, accuracy check passed (-0.10 points on 64 test images)")
    auto = Classifier.from_checkpoint(checkpoint)
    assert auto.metadata["rstcnn.precision"] == ("bf16" if bf16_supported() else "fp32")
    # a failing check: not servable
    write_gate(checkpoint, digest, {**record, "passes": False, "drop_points": 0.9})
    assert not servable(Classifier.from_checkpoint(checkpoint, "bf16"))[0]
    assert Classifier.from_checkpoint(checkpoint).metadata["rstcnn.precision"] == "fp32"


@pytest.mark.skipif(
    not __import__("rstmodel.precision").precision.int8_supported(), reason="no int8 products here"
)
def test_eager_int8_is_served_with_its_own_check_and_first_when_both_pass(rst_export, tmp_path):
    """The int8 products' check is a file of its own (``model.int8-gate.json``); with both
    checks passing "auto" serves int8, whose logits stay near float32's."""
    import shutil

    from rstcnn.export.onnx_export import file_sha256
    from rstcnn.serve.classifier import Classifier
    from rstcnn.serve.eager import gate_path, write_gate
    from rstcnn.serve.variants import servable

    checkpoint = tmp_path / "model.pt"
    shutil.copy(rst_export[3], checkpoint)
    digest = file_sha256(checkpoint)
    record = {"passes": True, "images": 64, "drop_points": 0.0, "limit_points": 0.5}
    write_gate(checkpoint, digest, record)  # bf16 alone: auto serves bf16
    assert Classifier.from_checkpoint(checkpoint).metadata["rstcnn.precision"] == "bf16"
    quant = Classifier.from_checkpoint(checkpoint, "int8")
    assert servable(quant) == (False, "int8 without an accuracy check (export it with --check N)")
    assert write_gate(checkpoint, digest, record, "int8") == gate_path(checkpoint, "int8")
    assert gate_path(checkpoint, "int8").name == "model.int8-gate.json"
    auto = Classifier.from_checkpoint(checkpoint)
    assert auto.metadata["rstcnn.precision"] == "int8" and servable(auto)[0]
    exact = Classifier.from_checkpoint(checkpoint, "fp32")
    x = np.random.default_rng(0).standard_normal((3, 1, 56, 56)).astype(np.float32)
    want, got = exact.run_logits(x), auto.run_logits(x)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max() and not np.array_equal(got, want)
    write_gate(checkpoint, digest, {**record, "passes": False}, "int8")  # failing: bf16 again
    assert Classifier.from_checkpoint(checkpoint).metadata["rstcnn.precision"] == "bf16"
    with pytest.raises(ValueError, match="no accuracy check for precision 'fp32'"):
        gate_path(checkpoint, "fp32")


@pytest.mark.skipif(
    not __import__("rstmodel.precision").precision.int16_supported(), reason="no int16 products"
)
def test_eager_int16_is_served_with_its_own_check(rst_export, tmp_path):
    """On an AVX2 CPU (neither int8 nor bfloat16): with its passing check "auto" serves the
    int16 products, whose logits stay within ~10^-3 of float32's; a failing check serves
    float32."""
    import shutil

    from rstcnn.export.onnx_export import file_sha256
    from rstcnn.serve.classifier import Classifier
    from rstcnn.serve.eager import gate_path, write_gate
    from rstcnn.serve.variants import servable
    from rstmodel.precision import bf16_supported, int8_supported

    checkpoint = tmp_path / "model.pt"
    shutil.copy(rst_export[3], checkpoint)
    digest = file_sha256(checkpoint)
    quant = Classifier.from_checkpoint(checkpoint, "int16")
    assert servable(quant) == (False, "int16 without an accuracy check (export it with --check N)")
    record = {"passes": True, "images": 64, "drop_points": 0.0, "limit_points": 0.5}
    assert write_gate(checkpoint, digest, record, "int16") == gate_path(checkpoint, "int16")
    assert gate_path(checkpoint, "int16").name == "model.int16-gate.json"
    auto = Classifier.from_checkpoint(checkpoint)
    if not (int8_supported() or bf16_supported()):
        assert auto.metadata["rstcnn.precision"] == "int16" and servable(auto)[0]
    quant = Classifier.from_checkpoint(checkpoint, "int16")
    exact = Classifier.from_checkpoint(checkpoint, "fp32")
    x = np.random.default_rng(0).standard_normal((3, 1, 56, 56)).astype(np.float32)
    want, got = exact.run_logits(x), quant.run_logits(x)
    assert np.abs(got - want).max() < 3e-3 * np.abs(want).max() and not np.array_equal(got, want)
    write_gate(checkpoint, digest, {**record, "passes": False}, "int16")
    assert Classifier.from_checkpoint(checkpoint).metadata["rstcnn.precision"] in (
        "fp32",
        "bf16",
        "int8",
    )
    if not (int8_supported() or bf16_supported()):
        assert Classifier.from_checkpoint(checkpoint).metadata["rstcnn.precision"] == "fp32"


def test_eager_engine_names_a_bad_checkpoint(tmp_path):
    from rstcnn.serve.classifier import Classifier

    with pytest.raises(ValueError, match="no checkpoint at"):
        Classifier.from_checkpoint(tmp_path / "none.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt"):
        Classifier.from_checkpoint(bad)
    with pytest.raises(ValueError, match="precision must be one of"):
        Classifier.from_checkpoint(bad, "fp16")


def test_app_serves_a_checkpoint_beside_its_exported_file(rst_export):
    """serve/app.py --model X.pt --model X.onnx: the two compete as files of one checkpoint."""
    from rstcnn.serve.app import _load
    from rstcnn.serve.variants import fastest_variants

    loaded = _load([str(rst_export[3]), str(rst_export[0])], threads=1)
    assert [c.providers[0] for c in loaded] == ["torch-fp32", "CPUExecutionProvider"]
    served, lines = fastest_variants(loaded, batch=4, repeats=1)
    assert len(served) == 1 and len(lines) == 2
    verdicts = sorted(line.rsplit(", ", 1)[1] for line in lines)
    if served[0] in loaded:  # one copy the faster at both sizes
        assert verdicts == ["served", "slower"]
    else:  # each the faster at one size (by the timing of the moment): the two routed
        assert verdicts == ["served", "served for up to 2 images"]
        assert sorted(served[0].providers) == ["CPUExecutionProvider", "torch-fp32"]
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        _load(["missing.pt"], threads=None)


def test_app_default_models_are_the_shipped_files_of_a_fresh_checkout():
    """`python serve/app.py` with no --model serves the committed int8 files (the float32
    exports are not committed), and a missing file says how to make it."""
    from rstcnn.serve.app import DEFAULT_MODELS, _load

    loaded = _load(None, threads=1)
    assert [c.name for c in loaded] == ["rst_cnn_fb", "cnn"]
    assert all(c.metadata["rstcnn.precision"] == "int8" for c in loaded)
    assert all(m.endswith(".int8.onnx") for m in DEFAULT_MODELS)
    with pytest.raises(FileNotFoundError, match="export/to_onnx.py missing.pt -o missing.onnx"):
        _load(["missing.onnx"], threads=None)
