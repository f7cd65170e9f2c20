"""``python -m rstcnn.train.model_bench``: the RST/CNN table and the old-against-new comparison."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "rstcnn.train.model_bench",
        "--batch",
        "2",
        "--repeats",
        "1",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_bench_compares_the_current_code_with_a_git_revision():
    done = bench("--models", "cnn", "--against", "HEAD")
    assert done.returncode == 0, done.stderr
    assert "building cnn ..." in done.stderr
    assert "the models taking turns; each ratio the median of the per-round ratios" in done.stdout
    lines = done.stdout.splitlines()
    assert any(line.startswith("| cnn | 494,805 |") for line in lines)
    table = lines[lines.index("current / HEAD (below 1: the current code is faster or smaller)") :]
    (row,) = [line for line in table if line.startswith("| cnn |")]
    ratios = [float(v) for v in row.strip("|").split("|")[1:]]
    assert len(ratios) == 4 and all(r > 0 for r in ratios)
    # the worktree is gone afterwards
    worktrees = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert "rstcnn-bench-" not in worktrees


def test_bench_builds_each_model_from_the_checkout_it_is_given(tmp_path):
    """``_load_model`` imports the library of the checkout it is given, and the next call
    another's. In a subprocess: re-importing the library re-registers its torch operators,
    which would leak into the rest of the suite."""
    fake = tmp_path / "rstmodel"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import torch\ndef create_model(name, **overrides):\n    return torch.nn.Linear(1, 1)\n"
    )
    script = f"""
import sys
from pathlib import Path
from rstcnn.train.model_bench import _load_model
old = _load_model("cnn", Path({str(tmp_path)!r}), {{}})
print(type(old).__name__, sys.modules["rstmodel"].__file__)
new = _load_model("cnn", Path({str(ROOT)!r}), {{}})
print(type(new).__name__, sys.modules["rstmodel"].__file__)
print({str(tmp_path)!r} in sys.path)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    old, new, on_path = done.stdout.splitlines()
    assert old == f"Linear {fake / '__init__.py'}"
    assert new == f"CNN {ROOT / 'rstmodel' / '__init__.py'}"
    assert on_path == "False"


def test_bench_names_an_unknown_revision():
    done = bench("--models", "cnn", "--against", "no-such-revision")
    assert done.returncode != 0
    assert "--against no-such-revision: git worktree add failed" in done.stderr


def test_floor_bench_times_each_op_of_the_basis_form_in_both_precisions():
    from rstcnn.export.floor_bench import KERNELS, LAYERS, R, measure

    rows = measure(repeats=1)
    assert [(layer, op) for layer, op, *_ in rows] == [
        (layer, op)
        for layer in LAYERS
        for op in [*(f"bank {k}x{k}" for k in KERNELS), "mixing 1x1"]
    ]
    assert all(fp32 > 0 and int8 > 0 for _, _, fp32, int8, _ in rows)
    cin, cout, side = LAYERS["layer 2"]
    mixing = next(g for layer, op, *_, g in rows if layer == "layer 2" and op == "mixing 1x1")
    assert mixing == R * len(KERNELS) * cin * 12 * cout * side * side / 1e9


def test_floor_bench_fft_form_is_the_eager_fft_path():
    from rstcnn.export.floor_bench import FFTForm, fft_layer

    layer = fft_layer(3, 5)
    form = FFTForm(layer, 8).eval()
    x = torch.randn(2, 3, 8, 4, 8, 8)
    with torch.no_grad():
        expected = layer.forward_fft(x, bias=layer.bias)
        assert torch.allclose(form(x), expected, atol=1e-4 * expected.abs().max().item())


def test_export_bench_times_each_form_and_checks_it_against_eager(capsys):
    from rstcnn.export import bench as export_bench
    from rstmodel.precision import bf16_supported, int8_supported, int16_supported

    forms = ["eager", "eager_bf16", "eager_int8", "eager_int16", "baked", "onnx"]
    argv = ["--models", "cnn", "--forms", *forms, "--batch", "3", "--split", "2", "--repeats", "1"]
    assert export_bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = {r.split(" | ")[1]: r.split(" | ") for r in out.splitlines() if r.startswith("| cnn |")}
    supported = {
        "eager_bf16": bf16_supported(),
        "eager_int8": int8_supported(),
        "eager_int16": int16_supported(),
    }
    run = [f for f in forms if supported.get(f, True)]
    assert sorted(rows) == sorted(run)
    for form in run:
        b1, batch, diff = (float(v.strip(" |")) for v in rows[form][2:5])
        assert b1 > 0 and batch > 0
        # float32 forms agree to round-off; bfloat16 to its 8-bit mantissa
        assert diff < (0.5 if form in supported else 1e-4), (form, diff)
    assert "| cnn: eager / onnx |" in out


def test_floor_bench_products_read_the_spectra_each_layout_needs():
    from rstcnn.export.floor_bench import KERNELS, PRODUCT_LAYOUTS, R, fft_layer, measure_products

    rows = measure_products(repeats=1, layers={"tiny": (3, 5, 8)})
    assert [layout for _, layout, *_ in rows] == list(PRODUCT_LAYOUTS)
    nh, nw = fft_layer(2, 2)._grid(8, 8)
    freqs = nh * (nw // 2 + 1) * (R // 4) * len(KERNELS)
    megabytes = {layout: mb for _, layout, f, mb, _ in rows if f == freqs}
    complex_pairs = freqs * 3 * 5 * 4 / 1e6  # float32 bytes of one real set
    assert megabytes == pytest.approx(
        {
            PRODUCT_LAYOUTS[0]: 3 * complex_pairs,
            PRODUCT_LAYOUTS[1]: 2 * complex_pairs,
            PRODUCT_LAYOUTS[2]: 2 * complex_pairs / 4,
            PRODUCT_LAYOUTS[3]: 2 * complex_pairs,
            PRODUCT_LAYOUTS[4]: 2 * complex_pairs / 4,
        }
    )
    assert all(ms > 0 for *_, ms in rows)


def test_floor_bench_grouped_products_are_the_batched_products():
    from rstcnn.export.floor_bench import PRODUCT_LAYOUTS, _timed_run, products_graph

    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 8, 3)).astype(np.float32)  # [F, rows, Cin]
    w = rng.standard_normal((6, 3, 10)).astype(np.float32)  # [F, Cin, N]
    model, feed = products_graph(PRODUCT_LAYOUTS[3], x, [w])
    assert feed.shape == (1, 18, 8, 1)
    got = _timed_run(model, feed, 1)[1].reshape(6, 10, 8)  # [F, N, rows]
    np.testing.assert_allclose(got.transpose(0, 2, 1), x @ w, rtol=1e-5, atol=1e-5)
    model, feed = products_graph(PRODUCT_LAYOUTS[1], x, [w])
    np.testing.assert_allclose(_timed_run(model, feed, 1)[1], x @ w, rtol=1e-5, atol=1e-5)
