"""The compiled few-row product (``rstmodel.layers.native``) against ``torch.bmm``'s."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rstmodel.basis import BasisFamily, BasisSpec
from rstmodel.layers import GroupRSTConv, native
from rstmodel.layers.kernels import joined_complex_product

SPEC = BasisSpec(BasisFamily.FOURIER_BESSEL, 6, 8, (2.5, 2.5 * 2**0.5, 5.0))  # kernels 5, 7, 9

pytestmark = pytest.mark.skipif(
    native._library() is None, reason="no C compiler, or neither AVX-512 nor AVX2 here"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("n", [16, 37])
def test_packed_product_is_the_joined_product(rows, n):
    """Row counts below, at and past one group of four (whole groups and every remainder),
    a width that fills its tiles and one that does not, the bias at frequency (0, 0): the
    same values as ``joined_complex_product``."""
    f, k = 11, 9
    x_re, x_im = torch.randn(2, f, rows, k).unbind(0)
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    bias = torch.randn(n)
    want = joined_complex_product(x_re, x_im, torch.cat([g_re, g_im], 2), bias, 3, 2.5)
    got = native.joined_rows_product(x_re, x_im, native.pack_joined(g_re, g_im), n, bias, 3, 2.5)
    assert got.shape == (2, f, rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_product_refuses_spectra_packed_for_another_shape():
    x = torch.randn(5, 4, 6)
    packed = native.pack_joined(torch.randn(5, 6, 20), torch.randn(5, 6, 20))
    with pytest.raises(ValueError, match="not packed for 5 x 6 x 40"):
        native.joined_rows_product(x, x, packed, 40)
    with pytest.raises(ValueError, match="float32 only"):
        native.joined_rows_product(x, x, packed.double(), 20)
    with pytest.raises(ValueError, match="at least one row, not 0"):
        empty = torch.randn(5, 0, 6)
        native.joined_rows_product(empty, empty, packed, 20)


@pytest.mark.parametrize("batch,plain_form", [(1, "fftj"), (3, "fft")])
def test_the_fft_path_takes_the_kernel_in_float32_eval(monkeypatch, batch, plain_form):
    """Eval in float32 packs the spectra once (``fftp``) and gives what the ``torch.bmm``
    forms give (the joined form for one image, the Gauss form for more); with a gradient
    wanted, under autocast, or the kernel switched off, the library keeps ``torch.bmm``."""
    conv = GroupRSTConv(3, 4, SPEC).eval()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(batch, 3, 8, 3, 10, 10)
    with torch.no_grad():
        fast = conv.forward_fft(x, bias=conv.bias)
        assert {k[:4] for k in conv._cache} == {"fftp"}
        monkeypatch.setattr(native, "available", lambda *_: False)
        conv._cache.clear()
        plain = conv.forward_fft(x, bias=conv.bias)
        assert {k[:4] if k[3] in "pj" else k[:3] for k in conv._cache} == {plain_form}
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    rows = x.flatten(0, 3)[:, None]
    assert native.available(rows, rows)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # spectra built under it: bfloat16
        assert not native.available(rows, rows)
    rows.requires_grad_(True)
    assert not native.available(rows, rows)


def test_the_kernel_is_built_once_and_only_where_it_can_be(tmp_path, monkeypatch):
    """Built into ``$RSTMODEL_CACHE`` and reused; ``RSTMODEL_NATIVE=0``, or a source that
    does not compile, leaves ``torch.bmm`` serving (no exception)."""
    monkeypatch.setenv("RSTMODEL_CACHE", str(tmp_path / "cache"))
    native._library.cache_clear()
    real_source, real_header = native._source, native.HEADER
    try:
        assert native._library() is not None
        (built,) = (tmp_path / "cache").glob("joined_rows-*.so")
        stamp = built.stat().st_mtime_ns
        native._library.cache_clear()
        assert native._library() is not None and built.stat().st_mtime_ns == stamp
        lock = f".{built.name}.lock"  # held while a process builds (the test below)
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [lock, built.name]

        header = tmp_path / "common.h"  # an edit to the shared header builds anew
        header.write_text(native.HEADER.read_text() + "/* edited */\n")
        monkeypatch.setattr(native, "HEADER", header)
        native._library.cache_clear()
        assert native._library() is not None
        assert len(list((tmp_path / "cache").glob("joined_rows-*.so"))) == 2
        monkeypatch.setattr(native, "HEADER", real_header)

        native._library.cache_clear()
        monkeypatch.setenv("RSTMODEL_NATIVE", "0")
        assert native._library() is None
        assert not native.available(torch.zeros(3, 1, 2), torch.zeros(3, 1, 2))

        native._library.cache_clear()
        monkeypatch.delenv("RSTMODEL_NATIVE")
        broken = tmp_path / "broken.c"
        broken.write_text("this is not C\n")
        monkeypatch.setattr(native, "_source", lambda: broken)
        assert native._library() is None

        native._library.cache_clear()
        monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : fpu sse sse2 avx")
        monkeypatch.setattr(native, "_source", real_source)
        assert native._source() is None and native._library() is None
    finally:
        monkeypatch.undo()
        native._library.cache_clear()


def test_a_model_after_training_steps_gives_the_torch_logits_at_batch_1(monkeypatch):
    """The packed spectra are part of the eval cache: after optimiser steps the kernel reads
    the new filters, and one image's logits match the ``torch.bmm`` form's."""
    from rstmodel import create_model

    torch.manual_seed(0)
    model = create_model("rst_cnn_fb", channels=(4, 6, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(1, 1, 56, 56)
    real = native.available
    for _ in range(2):
        model.train()
        loss = model(torch.randn(4, 1, 56, 56)).logsumexp(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            monkeypatch.setattr(native, "available", real)
            fast = model(x)
            monkeypatch.setattr(native, "available", lambda *_: False)
            plain = model(x)
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    caches = [m._cache for m in model.modules() if hasattr(m, "_cache")]
    assert any(k.startswith("fftp") for cache in caches for k in cache)


paired = pytest.mark.skipif(
    native._library() is None or not hasattr(native._library(), "paired_rows_product"),
    reason="no AVX512-BF16 on this machine",
)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().double()


@paired
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 16, 21])
@pytest.mark.parametrize("n", [16, 37])
def test_paired_product_is_the_complex_product_rounded_once(rows, n):
    """Row counts below, at and past one group of eight (whole groups and every remainder),
    widths that fill their tiles and not: each output is the exact complex product of the
    bfloat16-rounded rows and spectra, summed in float32 and rounded once to bfloat16."""
    f, k = 11, 9
    x_re, x_im = torch.randn(2, f, rows, k).unbind(0)
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    bias = torch.randn(n)
    want = joined_complex_product(
        _bf16(x_re), _bf16(x_im), torch.cat([_bf16(g_re), _bf16(g_im)], 2), _bf16(bias), 3, 2.5
    )
    got = native.paired_rows_product(x_re, x_im, native.pack_pairs(g_re, g_im), n, bias, 3, 2.5)
    assert got.dtype == torch.bfloat16 and got.shape == (2, f, rows, n)
    err = (got.double() - want).abs()
    # one rounding to bfloat16 (half a unit in the last place: at most 2^-8 of the value)
    # of a float32 sum; the bias rows are rounded twice more, as torch adds it in bfloat16
    bound = want.abs() * 2**-8 + 1e-5
    parts = (want[0, :3] - 2.5 * _bf16(bias)).abs() + 2.5 * _bf16(bias).abs()
    bound[0, :3] = parts * 3 * 2**-8 + 1e-5  # each rounding relative to what it rounds
    assert (err <= bound).all(), (err / bound).max()
    assert (err > 1e-4).any()  # rounded: not a float32 result in disguise


@paired
def test_paired_product_refuses_spectra_not_paired_for_it():
    x = torch.randn(5, 4, 6)
    packed = native.pack_pairs(torch.randn(5, 6, 20), torch.randn(5, 6, 20))
    assert packed.dtype == torch.bfloat16 and packed.shape == (5, 2, 6, 16, 2)
    with pytest.raises(ValueError, match="not paired for 5 x 6 x 40"):
        native.paired_rows_product(x, x, packed, 40)
    with pytest.raises(ValueError, match="bfloat16 spectra only"):
        native.paired_rows_product(x, x, packed.float(), 20)
    with pytest.raises(ValueError, match="at least one row, not 0"):
        empty = torch.randn(5, 0, 6)
        native.paired_rows_product(empty, empty, packed, 20)


@paired
@pytest.mark.parametrize("batch", [1, 3])
def test_the_fft_path_takes_the_paired_kernel_in_bfloat16_eval(monkeypatch, batch):
    """Under bfloat16 autocast in eval the FFT path packs float32 spectra once into pairs
    (``fftb``) and stays as close to float32 as the ``torch.bmm`` forms do; outside
    autocast, or with a gradient wanted, the kernel is not taken."""
    torch.manual_seed(1)
    conv = GroupRSTConv(3, 4, SPEC).eval()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(batch, 3, 8, 3, 10, 10)
    with torch.no_grad():
        exact = conv.forward_fft(x, bias=conv.bias)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast = conv.forward_fft(x, bias=conv.bias)
            assert any(key.startswith("fftb") for key in conv._cache)
            monkeypatch.setattr(native, "paired_available", lambda *_: False)
            plain = conv.forward_fft(x, bias=conv.bias)
    scale = exact.abs().max()
    fast_err, plain_err = (fast.float() - exact).abs().max(), (plain.float() - exact).abs().max()
    assert fast_err < 0.02 * scale and fast_err <= 2 * plain_err + 1e-3 * scale
    monkeypatch.undo()
    rows = x.flatten(0, 3)[:, None]
    assert not native.paired_available(rows, rows)  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert native.paired_available(rows, rows)
        rows.requires_grad_(True)
        assert not native.paired_available(rows, rows)


def _integer_case(f: int, rows: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
    """Rows ``[F, M, K]`` of varied scale (the first all zeros), spectra ``[F, K, N]`` and a
    bias ``[N]`` for the integer products' exactness tests, seeded by the shape."""
    torch.manual_seed(rows * k + n)
    x_re, x_im = (torch.randn(2, f, rows, k) * torch.rand(f, rows, 1) * 10).unbind(0)
    x_re[0, 0], x_im[0, 0] = 0, 0
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    return x_re, x_im, g_re, g_im, torch.randn(n)


quads = pytest.mark.skipif(
    not native.quad_rows_built(), reason="no AVX512-BF16 and AVX512-VNNI on this machine"
)


@quads
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 21])
@pytest.mark.parametrize(("k", "n"), [(9, 16), (16, 37), (33, 20), (69, 135)])
def test_int8_product_is_its_reference_exactly(rows, k, n):
    """Row counts at and around the groups of eight, odd and even input widths (a lane's
    second input column past K), widths past whole tiles, a row of zeros and the bias: the
    kernel's bfloat16 outputs are ``quad_rows_reference``'s bit for bit (the integer sums
    are exact, the scalings the same float32 steps)."""
    f = 5
    x_re, x_im, g_re, g_im, bias = _integer_case(f, rows, k, n)
    got = native.quad_rows_product(x_re, x_im, native.pack_quads(g_re, g_im), n, bias, 2, 1.5)
    want = native.quad_rows_reference(x_re, x_im, g_re, g_im, bias, 2, 1.5)
    assert got.dtype == torch.bfloat16 and got.shape == (2, f, rows, n)
    assert torch.equal(got, want)
    assert torch.equal(got[:, 0, 0, :], want[:, 0, 0, :]) and not got[1, 0, 0].any()


def test_int8_reference_is_close_to_the_complex_product():
    """The reference itself: 8-bit rows and spectra, each scaled by its largest part, give
    the complex product to about 1 % of its largest value at these widths."""
    torch.manual_seed(0)
    f, m, k, n = 7, 6, 69, 40
    x_re, x_im = torch.randn(2, f, m, k).unbind(0)
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    got = native.quad_rows_reference(x_re, x_im, g_re, g_im).double()
    want = joined_complex_product(
        _bf16(x_re), _bf16(x_im), torch.cat([g_re.double(), g_im.double()], 2)
    )
    err = (got - want).abs().amax((2, 3)) / want.abs().amax((2, 3))
    assert err.max() < 0.02 and err.max() > 1e-4


@quads
def test_int8_product_refuses_spectra_not_made_for_it():
    x = torch.randn(5, 4, 6)
    spectra = native.pack_quads(torch.randn(5, 6, 20), torch.randn(5, 6, 20))
    assert spectra.g.dtype == torch.uint8 and spectra.g.shape == (5, 2, 3, 16, 4)
    assert spectra.scale.shape == (5, 32)
    with pytest.raises(ValueError, match="not quads for 5 x 6 x 40"):
        native.quad_rows_product(x, x, spectra, 40)
    with pytest.raises(ValueError, match="at least one row, not 0"):
        empty = torch.randn(5, 0, 6)
        native.quad_rows_product(empty, empty, spectra, 20)


def test_pack_quads_lays_out_each_lane_as_two_input_columns():
    """Lane c of tile t, quad i: (Re, Im) of input column 2i then 2i + 1 for column 16t + c,
    each the spectrum times 127 over its column's largest part, rounded, plus 128; 128
    (zero) past K and N; the scale the column's largest / 127, zero past N."""
    torch.manual_seed(0)
    f, k, n = 2, 5, 19
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    spectra = native.pack_quads(g_re, g_im)
    assert spectra.g.dtype == torch.uint8
    q = spectra.g.view(f, 2, 3, 16, 2, 2).int() - 128  # [F, T, K2, lane, pair column, re/im]
    top = torch.maximum(g_re.abs(), g_im.abs()).amax(1)  # [F, N]
    for col in (0, 7, 16, 18):
        t, c = divmod(col, 16)
        for i in range(k):
            for part, g in enumerate((g_re, g_im)):
                value = torch.round(g[0, i, col] * (127.0 / top[0, col]))
                assert q[0, t, i // 2, c, i % 2, part] == value
        assert spectra.scale[0, col] == top[0, col] / 127
    assert not q[:, :, 2, :, 1].any()  # input column 5: past K
    assert not q[:, 1, :, 3:].any() and not spectra.scale[:, 19:].any()  # past N


@quads
@pytest.mark.parametrize("batch", [1, 3])
def test_the_fft_path_takes_the_int8_kernel_only_in_int8_inference(batch):
    """``inference("int8")`` in eval packs the spectra once into quads (``ffti8``) and
    stays close to float32; plain bfloat16 autocast keeps the bfloat16 kernel."""
    from rstmodel.precision import inference

    torch.manual_seed(1)
    conv = GroupRSTConv(3, 4, SPEC).eval()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(batch, 3, 8, 3, 10, 10)
    exact = conv.forward_fft(x, bias=conv.bias)
    with inference("bf16"):
        half = conv.forward_fft(x, bias=conv.bias)
    assert not any(key.startswith("ffti8") for key in conv._cache)
    with inference("int8"):
        quant = conv.forward_fft(x, bias=conv.bias)
    assert any(key.startswith("ffti8") for key in conv._cache)
    scale = exact.abs().max()
    assert (quant.float() - exact).abs().max() < 0.03 * scale
    assert not torch.equal(quant, half)
    rows = x.flatten(0, 3)[:, None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not native.quad_rows_available(rows, rows)  # bf16 autocast alone


words = pytest.mark.skipif(
    not native.word_rows_built(),
    reason="the int16 products are the AVX2 build's (checked on every AVX2 CPU below)",
)


@words
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 21])
@pytest.mark.parametrize(("k", "n"), [(1, 3), (9, 16), (16, 37), (33, 20), (69, 135)])
def test_int16_product_is_its_reference_exactly(rows, k, n):
    """Row counts at and around the groups of four, input widths past whole vectors, output
    widths past whole tiles, a row of zeros and the bias: the kernel's float32 outputs are
    ``word_rows_reference``'s bit for bit (the integer sums are exact, the scalings the same
    float32 steps)."""
    f = 5
    x_re, x_im, g_re, g_im, bias = _integer_case(f, rows, k, n)
    got = native.word_rows_product(x_re, x_im, native.pack_words(g_re, g_im), n, bias, 2, 1.5)
    want = native.word_rows_reference(x_re, x_im, g_re, g_im, bias, 2, 1.5)
    assert got.dtype == torch.float32 and got.shape == (2, f, rows, n)
    assert torch.equal(got, want)
    assert not got[1, 0, 0].any()  # the zero row's imaginary part (the bias is real)


def test_int16_reference_is_close_to_the_complex_product():
    """The reference itself: rows and spectra on ~12 bits, each scaled by its largest part,
    give the complex product to about 10^-3 of its largest value at the shipped model's
    widths (int8: about 10^-2)."""
    torch.manual_seed(0)
    f, m, k, n = 7, 6, 69, 40
    x_re, x_im = torch.randn(2, f, m, k).unbind(0)
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    got = native.word_rows_reference(x_re, x_im, g_re, g_im).double()
    want = joined_complex_product(
        x_re.double(), x_im.double(), torch.cat([g_re.double(), g_im.double()], 2)
    )
    err = (got - want).abs().amax((2, 3)) / want.abs().amax((2, 3))
    assert 1e-6 < err.max() < 2e-3


@pytest.mark.parametrize("k", [1, 2, 69, 135, 204, 1000, 100000])
def test_word_levels_are_the_most_whose_sums_fit_32_bits(k):
    """2 K L^2 < 2^31 (a sum of 2K products of values in [-L, L]), and L + 1 would not fit
    (or L is int16's largest)."""
    levels = native.word_levels(k)
    assert 2 * k * levels**2 < 2**31
    assert levels == 32767 or 2 * k * (levels + 1) ** 2 >= 2**31
    with pytest.raises(ValueError, match="at least one input column"):
        native.word_levels(0)


def test_pack_words_lays_out_each_lane_as_one_columns_pair():
    """Lane c of tile t, input column i: (Re, Im) of column 16t + c, each the spectrum
    times L over its column's largest part, rounded; zero past N; the scale the column's
    largest / L, zero past N."""
    torch.manual_seed(0)
    f, k, n = 2, 5, 19
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    spectra = native.pack_words(g_re, g_im)
    levels = native.word_levels(k)
    assert spectra.levels == levels and spectra.g.dtype == torch.int16
    assert spectra.g.shape == (f, 2, k, 16, 2) and spectra.scale.shape == (f, 32)
    top = torch.maximum(g_re.abs(), g_im.abs()).amax(1)  # [F, N]
    for col in (0, 7, 16, 18):
        t, c = divmod(col, 16)
        for i in range(k):
            for part, g in enumerate((g_re, g_im)):
                value = torch.round(g[1, i, col] * (levels / top[1, col]))
                assert spectra.g[1, t, i, c, part] == value
        assert spectra.scale[1, col] == top[1, col] / levels
    assert spectra.g.abs().max() == levels  # each column's largest part
    assert not spectra.g[:, 1, :, 3:].any() and not spectra.scale[:, 19:].any()  # past N


@words
def test_int16_product_refuses_what_it_cannot_take():
    x = torch.randn(5, 4, 6)
    spectra = native.pack_words(torch.randn(5, 6, 20), torch.randn(5, 6, 20))
    with pytest.raises(ValueError, match="not words for 5 x 6 x 40"):
        native.word_rows_product(x, x, spectra, 40)
    with pytest.raises(ValueError, match="at least one row, not 0"):
        empty = torch.randn(5, 0, 6)
        native.word_rows_product(empty, empty, spectra, 20)
    with pytest.raises(ValueError, match="float32 rows only"):
        native.word_rows_product(x.double(), x.double(), spectra, 20)
    with pytest.raises(ValueError, match="could overflow 32-bit sums over K = 6"):
        native.word_rows_product(x, x, spectra._replace(levels=20000), 20)


@words
@pytest.mark.parametrize("batch", [1, 3])
def test_the_fft_path_takes_the_int16_kernel_only_in_int16_inference(batch):
    """``inference("int16")`` in eval packs the spectra once into words (``ffti16``) and
    stays within ~10^-3 of float32, which alone keeps the float32 kernel; outside it the
    kernel is not offered."""
    from rstmodel.precision import inference

    torch.manual_seed(1)
    conv = GroupRSTConv(3, 4, SPEC).eval()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(batch, 3, 8, 3, 10, 10)
    with torch.no_grad():
        exact = conv.forward_fft(x, bias=conv.bias)
    assert not any(key.startswith("ffti16") for key in conv._cache)
    with inference("int16"):
        quant = conv.forward_fft(x, bias=conv.bias)
        assert native.word_rows_available(x[0, :, 0], x[0, :, 0])
    assert any(key.startswith("ffti16") for key in conv._cache)
    assert quant.dtype == torch.float32
    err = (quant - exact).abs().max() / exact.abs().max()
    assert 0 < err < 3e-3
    assert not native.word_rows_available(x[0, :, 0], x[0, :, 0])


@pytest.mark.skipif(native._library() is None, reason="no kernel on this machine")
def test_processes_starting_at_once_build_the_kernel_once(tmp_path):
    """Two processes that find no kernel at the same moment: one compiles it, the other
    waits for it and loads the same file (a file renamed over one a process had loaded
    would leave that process mapping a deleted copy)."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.DEBUG, format='%(message)s'); "
        "from rstmodel.layers import native; lib = native._library(); "
        "maps = [m for m in open('/proc/self/maps') if lib._name in m]; "
        "print(bool(maps) and not any(m.strip().endswith('(deleted)') for m in maps))"
    )
    env = {**os.environ, "RSTMODEL_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.decode().strip() for out, _ in outs] == ["True", "True"]
    assert sum(err.decode().count("compiling _joined_rows") for _, err in outs) == 1, outs
    assert len(list((tmp_path / "cache").glob("joined_rows-*.so"))) == 1


def test_the_kernel_shares_torchs_openmp_runtime():
    """Loaded beside torch, the kernel's OpenMP threads are torch's own (one libgomp in the
    process): a second runtime's threads would contend with torch's waiting ones."""
    from pathlib import Path

    torch.ones(4096).sum()  # torch's runtime started
    lib = native._library()
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    assert lib._name in mapped
    assert len({path for path in mapped if "libgomp" in path}) == 1, mapped


@pytest.mark.parametrize("cout", [5, 16, 37, 69, 100])
@pytest.mark.parametrize("relu,with_bias", [(True, True), (False, False)])
@pytest.mark.parametrize("kk", [12, 7])
def test_pooled_mix_is_the_torch_mixing_and_pool_in_float32(cout, relu, with_bias, kk):
    """Widths below, at and past one tile of 16 and past one group of five tiles, odd and
    even inputs, with and without bias and ReLU: the values of ``_pooled_mix_rows``."""
    from rstmodel.layers.kernels import _pooled_mix_rows

    h, w, m = 6, 4, 3
    resp = torch.randn(h, w * m, kk)
    a, bias = torch.randn(cout, kk), torch.randn(cout) if with_bias else None
    want, _ = _pooled_mix_rows(resp, a, bias, relu, w, argmax=False)
    got = native.pooled_mix(resp, a, bias, relu, w)
    assert got.shape == (h // 2, w // 2, m, cout) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not relu or (got >= 0).all()


@paired
@pytest.mark.parametrize("cout", [16, 37, 100])
def test_pooled_mix_in_bfloat16_rounds_once(cout):
    """bfloat16 responses and weights: each pooled output is the exact value rounded once
    (half a unit in the last place at most)."""
    from rstmodel.layers.kernels import _pooled_mix_rows

    h, w, m, kk = 4, 6, 5, 12
    resp = torch.randn(h, w * m, kk).bfloat16()
    a, bias = torch.randn(cout, kk), torch.randn(cout)
    want, _ = _pooled_mix_rows(
        resp.double(), _bf16(a), bias.double(), True, w, argmax=False
    )  # the weights rounded as the kernel reads them, the bias in float32
    got = native.pooled_mix(resp, a, bias, True, w)
    assert got.dtype == torch.bfloat16 and got.shape == (h // 2, w // 2, m, cout)
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-5).all(), err.max()
    assert (err > 1e-4).any()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=paired)])
def test_pooled_mix_with_weight_sets_mixes_the_shared_responses_by_each(dtype):
    """``a`` [R, Cout, KK]: output map r M + m is response map m mixed by ``a[r]`` (the
    steered lifting layer), each set the single-set kernel's values."""
    h, w, m, kk, cout, sets = 4, 6, 3, 12, 37, 4
    resp = torch.randn(h, w * m, kk).to(dtype)
    a, bias = torch.randn(sets, cout, kk), torch.randn(cout)
    got = native.pooled_mix(resp, a, bias, True, w)
    assert got.shape == (h // 2, w // 2, sets * m, cout) and got.dtype == dtype
    each = [native.pooled_mix(resp, a[r], bias, True, w) for r in range(sets)]
    assert torch.equal(got, torch.cat(each, dim=2))
    with pytest.raises(ValueError, match="do not fit 6 columns and 12 inputs"):
        native.pooled_mix(resp, torch.randn(sets, cout, 11), bias, True, w)


def test_the_lifting_layer_steers_the_upright_responses_where_the_basis_allows(monkeypatch):
    """A steerable basis (FB): eval without a gradient convolves the upright copies only
    and gives the plain path's pooled maps to round-off, quarter turns included; a basis
    that does not steer (SL) convolves every rotation, as does a call that wants a
    gradient."""
    from rstmodel.layers import LiftingRSTConv
    from rstmodel.layers import conv as convmod

    seen = []
    real = convmod.LiftingRSTConv._responses

    def responses(self, x, rotations=None):
        seen.append(rotations)
        return real(self, x, rotations)

    monkeypatch.setattr(convmod.LiftingRSTConv, "_responses", responses)
    torch.manual_seed(0)
    x = torch.randn(2, 2, 16, 16)
    sl = BasisSpec(BasisFamily.STURM_LIOUVILLE, 6, 8, (2.5, 3.5))
    for spec, steers in ((SPEC, True), (sl, False)):
        conv = LiftingRSTConv(2, 20, spec).eval()
        seen.clear()
        with torch.no_grad():
            fast = conv.forward_pooled(x, relu=True)
            turned = conv.forward_pooled(torch.rot90(x, 1, (-2, -1)), relu=True)
            with monkeypatch.context() as patch:
                patch.setattr(convmod, "steering", lambda spec: None)
                conv._cache.clear()
                plain = conv.forward_pooled(x, relu=True)
        assert seen[0] == (1 if steers else None) and seen[-1] is None
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
        want = torch.roll(torch.rot90(fast, 1, (-2, -1)), 2, dims=2)  # R = 8: two indices
        torch.testing.assert_close(turned, want, rtol=1e-5, atol=1e-5)
    conv = LiftingRSTConv(2, 20, SPEC).eval()
    with torch.no_grad():
        assert conv._steered_weights() is not None
    assert conv._steered_weights() is None  # a gradient wanted: the torch path


@pytest.mark.parametrize("cout", [5, 37, 69])
@pytest.mark.parametrize("relu,with_bias", [(True, True), (False, False)])
def test_pooled_mix_train_is_the_torch_forward_with_its_argmax(cout, relu, with_bias):
    """Training's forward (float32): the pooled map of ``_pooled_mix_rows(argmax=True)`` (to
    round-off: the library's GEMM sums narrow outputs in its own order) and its one-byte
    window positions, ties included (equal pixels: the first in scan order wins), 4 where
    the ReLU clamps."""
    from rstmodel.layers.kernels import _pooled_mix_rows

    h, w, m, kk = 6, 8, 3, 12
    resp = torch.randn(h, w, m, kk)
    resp[:, 1::4] = resp[:, 0::4]  # windows 0, 2: left and right columns equal
    resp[1::4, 2::4] = resp[0::4, 2::4]  # window 1: top and bottom rows equal
    resp = resp.view(h, w * m, kk)
    a, bias = torch.randn(cout, kk), torch.randn(cout) if with_bias else None
    want, want_code = _pooled_mix_rows(resp, a, bias, relu, w, argmax=True)
    got, code = native.pooled_mix_train(resp, a, bias, relu, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(code, want_code)
    assert set(code.unique().tolist()) >= ({0, 1, 2, 3, 4} if relu else {0, 1, 2, 3})


def test_pooled_mix_grad_is_the_torch_coefficient_gradient():
    """The coefficients' gradient from the pooled gradient and the argmax: the torch form's
    to float32 round-off (the sums run in another order); clamped outputs add nothing."""
    from rstmodel.layers.kernels import _pooled_mix_grads

    h, w, m, kk, cout = 8, 6, 5, 12, 37
    resp, a, bias = torch.randn(h, w * m, kk), torch.randn(cout, kk), torch.randn(cout)
    _, code = native.pooled_mix_train(resp, a, bias, True, w)
    grad = torch.randn(h // 2, w // 2, m, cout)
    _, want = _pooled_mix_grads(resp, grad, code, w, None, torch.float32)
    got = native.pooled_mix_grad(resp, grad, code, w)
    assert got.shape == (cout, kk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    clamped = torch.full_like(code, 4)
    assert not native.pooled_mix_grad(resp, grad, clamped, w).any()
    with pytest.raises(ValueError, match="float32"):
        native.pooled_mix_grad(resp.double(), grad, code, w)


def test_pooled_mix_train_widens_bfloat16_operands():
    """Training under bfloat16 autocast: the responses, coefficients and bias widened exactly,
    the float32 kernel's pooled map rounded once to bfloat16 and its window codes; the torch
    form's to bfloat16's rounding (it rounds each sum, then the sum plus the bias); the
    gradient from the widened responses."""
    from rstmodel.layers.kernels import _pooled_mix_rows

    h, w, m, kk, cout = 6, 8, 3, 12, 37
    resp = torch.randn(h, w * m, kk).bfloat16()
    a, bias = torch.randn(cout, kk).bfloat16(), torch.randn(cout).bfloat16()
    got, code = native.pooled_mix_train(resp, a, bias, True, w)
    want, want_code = native.pooled_mix_train(resp.float(), a.float(), bias.float(), True, w)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    assert torch.equal(code, want_code)
    torch_form, _ = _pooled_mix_rows(resp, a, bias, True, w, argmax=True)
    torch.testing.assert_close(got.float(), torch_form.float(), rtol=2e-2, atol=2e-2)
    grad = torch.randn(h // 2, w // 2, m, cout)
    wide = native.pooled_mix_grad(resp.float(), grad, code, w)
    torch.testing.assert_close(native.pooled_mix_grad(resp, grad, code, w), wide)


def test_a_bfloat16_training_step_takes_the_lifting_kernels(monkeypatch):
    """Under bfloat16 autocast (``--bf16``) the lifting layer's pooled mixing and its
    coefficients' gradient run compiled, not as thousands of chunked torch ops, and every
    parameter's gradient is the torch form's to bfloat16's rounding."""
    from rstmodel import create_model
    from rstmodel.layers import kernels

    torch.manual_seed(0)
    model = create_model("rst_cnn_fb", channels=(20, 6, 8)).train()
    x, y = torch.randn(4, 1, 56, 56), torch.randint(0, 10, (4,))
    calls = []
    real = native.pooled_mix_grad
    monkeypatch.setattr(native, "pooled_mix_grad", lambda *a: calls.append(a[0].dtype) or real(*a))

    def grads():
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout mask
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    state = {k: v.clone() for k, v in model.state_dict().items()}
    fast = grads()
    assert calls == [torch.bfloat16]
    model.load_state_dict(state)
    monkeypatch.setattr(kernels.native, "pooled_mix_train_available", lambda *_: False)
    plain = grads()
    for name, g in plain.items():
        err = (fast[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 0.05, (name, float(err))


def test_a_training_step_through_the_lifting_kernels_gives_the_torch_gradients(monkeypatch):
    """A model's training step (float32, CPU): the lifting layer's forward and coefficient
    gradient run through the kernels, and every parameter's gradient is the torch path's to
    round-off."""
    from rstmodel import create_model
    from rstmodel.layers import kernels

    torch.manual_seed(0)
    model = create_model("rst_cnn_fb", channels=(20, 6, 8)).train()
    x, y = torch.randn(4, 1, 56, 56), torch.randint(0, 10, (4,))
    calls = []
    real = native.pooled_mix_grad
    monkeypatch.setattr(native, "pooled_mix_grad", lambda *a: calls.append(1) or real(*a))

    def grads():
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout mask
        torch.nn.functional.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    state = {k: v.clone() for k, v in model.state_dict().items()}
    fast = grads()
    assert calls
    model.load_state_dict(state)  # the batch norms' running statistics as before
    monkeypatch.setattr(kernels.native, "pooled_mix_train_available", lambda *_: False)
    plain = grads()
    for name, g in plain.items():
        torch.testing.assert_close(fast[name], g, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,c", [(5, 204), (257, 16), (1000, 37), (70000, 69)])
def test_column_stats_are_the_float64_sums(dtype, n, c):
    """The batch norm's one-pass column sums (x less a shift and its squares; g and g times
    x less the shift) against float64 sums of the same values, for a mean far from zero, C
    below and past one 16-column tile, N within and past one 256-row block: within 5e-6 of
    the sum of the terms' sizes (a row left out of 70,000 would be 1.4e-5)."""
    torch.manual_seed(0)
    x = (torch.randn(n, c) * 0.5 + 100).to(dtype)
    g = torch.randn(n, c).to(dtype)
    shift = x[:4096].float().mean(0)
    xd, gd, kd = x.double(), g.double(), shift.double()
    got = (*native.column_stats(x, shift), *native.column_stats(x, shift, g))
    terms = (xd - kd, (xd - kd) ** 2, gd, gd * (xd - kd))
    for sums, t in zip(got, terms, strict=True):
        assert sums.dtype == torch.float64 and sums.shape == (c,)
        assert ((sums - t.sum(0)).abs() <= 5e-6 * t.abs().sum(0) + 1e-12).all()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.column_stats(x.double(), shift)
    assert not native.column_stats_available(x, g.float() if dtype != torch.float32 else g.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_batch_norm_through_the_column_kernel_is_its_torch_form(dtype, monkeypatch):
    """``_RowBatchNorm`` with its statistics and the backward's sums compiled (one pass, a
    shifted variance): the statistics within 1e-6 of float64 ones (the chunked torch form's
    float32 GEMVs are ~100x further off: 2.5e-5 in the mean here), the output and every
    gradient the torch form's to the dtype's round-off."""
    from rstmodel.layers import norm

    torch.manual_seed(0)
    x0 = (torch.randn(20000, 69) * 3 + 5).to(dtype)
    w0, b0 = torch.rand(69) + 0.5, torch.randn(69)
    g = torch.randn(20000, 69).to(dtype)
    calls = []
    real = native.column_stats
    monkeypatch.setattr(native, "column_stats", lambda *a: calls.append(1) or real(*a))

    def run():
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        y, mean, var = norm._RowBatchNorm.apply(x, w, b, 1e-5)
        y.backward(g)
        return y, mean, var, x.grad, w.grad, b.grad

    fast = run()
    assert len(calls) == 2  # the statistics, the backward's two sums
    var, mean = torch.var_mean(x0.double(), dim=0, correction=0)
    torch.testing.assert_close(fast[1].double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast[2].double(), var, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(native, "column_stats_available", lambda *_: False)
    plain = run()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for name, f, p in zip(("y", "mean", "var", "x.grad"), fast[:4], plain[:4], strict=True):
        torch.testing.assert_close(f.float(), p.float(), rtol=tol, atol=tol, msg=name)
    # w.grad and b.grad are sums over 20,000 rows: two float32 sums in different orders (the
    # torch form's follows the thread count) differ by more than an elementwise tolerance
    # (1.4e-3 on sums of ~460 with one thread), so each form is held to the float64 sum of
    # the same terms, to 1e-5 of the sum of the terms' magnitudes (float32 sums here: <= 1.2e-7
    # in either dtype)
    xhat = (x0.double() - mean) / torch.sqrt(var + 1e-5)
    terms = {"w.grad": g.double() * xhat, "b.grad": g.double()}
    for (name, t), f, p in zip(terms.items(), fast[4:], plain[4:], strict=True):
        exact, scale = t.sum(0), t.abs().sum(0)
        for form, got in (("compiled", f), ("torch", p)):
            err = ((got.double() - exact).abs() / scale).max().item()
            assert err < 1e-5, f"{name}, {form} form: {err:.1e} of the terms' magnitude"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("relu", [True, False])
def test_pool2x2_is_the_torch_pool_bit_for_bit(dtype, relu):
    """The compiled 2x2 pool of [H, W, L] rows: ``_pool_quads``' maxima and window codes
    exactly (ties: the first in scan order; 4 where the ReLU clamps), L past one 16-lane
    tile; its gradient ``_unpool_quads``' exactly."""
    from rstmodel.layers.pooling import _pool_quads, _unpool_quads

    torch.manual_seed(0)
    x = torch.randn(6, 8, 37).to(dtype)
    x[:, 1::2] = torch.where(torch.rand(6, 4, 37) < 0.3, x[:, 0::2], x[:, 1::2])  # ties
    x[1::2] = torch.where(torch.rand(3, 8, 37) < 0.3, x[0::2], x[1::2])
    out, code = native.pool2x2(x, relu, argmax=True)
    quads = [x[i::2, j::2] for i in (0, 1) for j in (0, 1)]
    want, want_code = _pool_quads(*quads, relu=relu, argmax=True)
    assert torch.equal(out, want) and torch.equal(code, want_code)
    assert set(code.unique().tolist()) == ({0, 1, 2, 3, 4} if relu else {0, 1, 2, 3})
    assert native.pool2x2(x, relu, argmax=False)[1] is None
    grad = torch.randn(3, 4, 37).to(dtype)
    want_gx = torch.full_like(x, float("nan"))
    _unpool_quads(grad, code, [want_gx[i::2, j::2] for i in (0, 1) for j in (0, 1)])
    assert torch.equal(native.unpool2x2(grad, code), want_gx)
    assert not native.pool2x2_available(torch.randn(5, 8, 3))  # odd H


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rst_max_pool_of_spatial_major_maps_takes_the_kernel(dtype, monkeypatch):
    """``RSTMaxPool`` on a spatial-major feature map (the FFT path's layout) runs compiled,
    forward and backward, with the torch form's output and gradient exactly, in the same
    layout; any other layout keeps the torch form."""
    from rstmodel.layers import RSTMaxPool
    from rstmodel.layers.common import is_spatial_major

    torch.manual_seed(0)
    x0 = torch.randn(3, 5, 8, 2, 6, 6).to(dtype)
    x0 = x0.permute(4, 5, 2, 3, 0, 1).contiguous().permute(4, 5, 2, 3, 0, 1)
    grad = torch.randn(3, 5, 8, 2, 3, 3).to(dtype)
    calls = []
    real = native.pool2x2
    monkeypatch.setattr(native, "pool2x2", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        x = x0.detach().requires_grad_(True)
        y = RSTMaxPool(relu=True)(x)
        y.backward(grad)
        return y, x.grad

    RSTMaxPool(relu=True)(x0.contiguous())
    assert not calls  # channels-first: the torch form
    y, gx = run()
    assert calls and is_spatial_major(y) and is_spatial_major(gx)
    monkeypatch.setattr(native, "pool2x2_available", lambda *_: False)
    y_ref, gx_ref = run()
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


def test_pooled_mix_says_what_it_cannot_take():
    resp = torch.randn(4, 6 * 2, 12)
    with pytest.raises(ValueError, match="do not fit 5 columns"):
        native.pooled_mix(resp, torch.randn(8, 12), None, True, 5)
    with pytest.raises(ValueError, match="do not fit 6 columns and 12 inputs"):
        native.pooled_mix(resp, torch.randn(8, 11), None, True, 6)
    odd = torch.randn(4, 12, 7).bfloat16()
    assert not native.pooled_mix_available(odd)
    with pytest.raises(ValueError, match="even KK"):
        native.pooled_mix(odd, torch.randn(8, 7), None, True, 6)
    assert not native.pooled_mix_available(resp.double())
    weight = torch.randn(8, 12, requires_grad=True)
    assert not native.pooled_mix_available(resp, weight, None)  # its gradient is wanted
    with torch.no_grad():
        assert native.pooled_mix_available(resp, weight, None)
    assert not native.pooled_mix_available(resp.requires_grad_(True))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_lifting_layer_takes_the_pooled_mix_in_eval(monkeypatch, precision):
    """A model's eval forward runs the lifting layer's mixing and pool through the kernel,
    and its logits are those of the torch path: the same in float32 (within round-off), as
    close to float32 as the torch path in bfloat16."""
    from rstmodel import create_model
    from rstmodel.precision import bf16_supported, inference

    if precision == "bf16" and not (
        bf16_supported() and native.pooled_mix_available(torch.zeros(2, 2, 2, dtype=torch.bfloat16))
    ):
        pytest.skip("no AVX512-BF16 kernel on this machine")
    torch.manual_seed(0)
    model = create_model("rst_cnn_fb", channels=(20, 6, 8)).eval()  # the basis path lifts
    x = torch.randn(2, 1, 56, 56)
    calls = []
    real = native.pooled_mix
    monkeypatch.setattr(native, "pooled_mix", lambda *a: calls.append(1) or real(*a))
    with inference("fp32"):
        exact = model(x)
    with inference(precision):
        fast = model(x).float()
        assert calls
        monkeypatch.setattr(native, "pooled_mix_available", lambda *_: False)
        plain = model(x).float()
    if precision == "fp32":
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    else:
        scale = exact.abs().max()
        assert (fast - exact).abs().max() <= 2 * (plain - exact).abs().max() + 0.01 * scale


@paired
@pytest.mark.parametrize(
    "m,k,batch,segments,seg",
    [
        (32, 28, 3, 8, 552),
        (18, 14, 2, 16, 69),
        (5, 2, 3, 4, 40),
        (9, 4, 2, 3, 33),
        (3, 6, 1, 2, 64),
    ],
)
def test_small_gemm_gather_is_the_product_of_the_gathered_rows(m, k, batch, segments, seg):
    """Segments of B's rows of 32, 33, 40, 64, 69 and 552 values, so that panels of 32
    columns lie in one segment, span two, or end short: the same values, bit for bit, as
    ``small_gemm`` on the gathered copy (rows repeated and in any order)."""
    src = torch.randn(50, seg).bfloat16()
    a = torch.randn(m, k).bfloat16()
    index = torch.randint(0, 50, (batch * k * segments,))
    want = native.small_gemm(a, src[index].view(batch, k, segments * seg))
    got = native.small_gemm_gather(a, src, index, batch)
    assert got.shape == (batch, m, segments * seg) and torch.equal(got, want)


@paired
def test_small_gemm_gather_says_what_it_cannot_take():
    a, src = torch.randn(4, 6).bfloat16(), torch.randn(10, 40).bfloat16()
    index = torch.zeros(2 * 6 * 3, dtype=torch.long)
    assert not native.small_gemm_gather_available(a, src[:, :31])  # rows under 32
    assert not native.small_gemm_gather_available(a.float(), src.float())
    assert not native.small_gemm_gather_available(a[:, :5], src)  # odd K
    with pytest.raises(ValueError, match="rows of >= 32"):
        native.small_gemm_gather(a, src[:, :31], index, 2)
    with pytest.raises(ValueError, match="indices"):
        native.small_gemm_gather(a, src, index[:-1], 2)
    with pytest.raises(ValueError, match="outside the 10 rows"):
        native.small_gemm_gather(a, src, index + 10, 2)


@paired
def test_the_fft_path_reads_its_rows_where_they_lie_in_bfloat16_eval(monkeypatch):
    """Eval in bfloat16 without a gradient: the forward DFTs read each block's rows through
    ``small_gemm_gather``, and the logits are, bit for bit, those of the gathered copy."""
    from rstmodel import create_model
    from rstmodel.precision import inference

    torch.manual_seed(0)
    model = create_model("rst_cnn_fb", channels=(8, 10, 12)).eval()
    x = torch.randn(4, 1, 56, 56)  # rows of B Cin = 32 and 40 values
    calls = []
    real = native.small_gemm_gather
    monkeypatch.setattr(native, "small_gemm_gather", lambda *a: calls.append(1) or real(*a))
    with inference("bf16"):
        fast = model(x)
        assert len(calls) == 8  # each block of scales of both group convolutions
        monkeypatch.setattr(native, "small_gemm_gather_available", lambda *_: False)
        plain = model(x)
    assert torch.equal(fast, plain)


@paired
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((5, 6), (6, 33)), ((13, 2), (2, 32)), ((8, 28), (3, 28, 70)), ((70, 56), (56, 100))],
)
def test_small_gemm_is_the_product_rounded_once(a_shape, b_shape):
    """Rows of A below, at and past one block of eight; panels of 32 columns whole and cut
    short; one matrix or a batch: the exact product of the bfloat16 inputs, rounded once."""
    a = torch.randn(*a_shape).bfloat16()
    b = torch.randn(*b_shape).bfloat16()
    want = a.double() @ b.double()
    got = native.small_gemm(a, b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-5).all(), err.max()


@paired
def test_small_gemm_refuses_what_it_cannot_take():
    b = torch.randn(7, 40).bfloat16()
    assert not native.small_gemm_available(torch.randn(4, 7).bfloat16(), b)  # odd K
    assert not native.small_gemm_available(torch.randn(4, 6), torch.randn(6, 40))  # float32
    assert not native.small_gemm_available(torch.randn(4, 6).bfloat16(), b)  # K mismatch
    a = torch.randn(4, 6).bfloat16().requires_grad_(True)
    assert not native.small_gemm_available(a, torch.randn(6, 40).bfloat16())
    with pytest.raises(ValueError, match="even K"):
        native.small_gemm(torch.randn(4, 7).bfloat16(), b)


@paired
def test_the_dfts_take_the_small_gemm_in_bfloat16(monkeypatch):
    """Under bfloat16 autocast the FFT path's DFTs run through the kernel and the layer's
    output stays as close to float32 as with torch's GEMMs."""
    torch.manual_seed(2)
    conv = GroupRSTConv(3, 4, SPEC).eval()
    x = torch.randn(2, 3, 8, 3, 10, 10)
    calls = []
    real = native.small_gemm
    monkeypatch.setattr(native, "small_gemm", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        exact = conv.forward_fft(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast = conv.forward_fft(x).float()
            assert len(calls) >= 4  # two GEMMs each way
            monkeypatch.setattr(native, "small_gemm_available", lambda *_: False)
            plain = conv.forward_fft(x).float()
    scale = exact.abs().max()
    assert (fast - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-3 * scale


@paired
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("w,h,n", [(28, 4, 70), (6, 2, 33), (14, 6, 32)])
def test_small_gemm_pool_is_the_product_pooled(relu, w, h, n):
    """Widths that are and are not a multiple of four rows, panels whole and cut short: the
    2x2 max pool (and ReLU) of the exact product, rounded once (rounding is monotone, so
    this is also the pool of the rounded product)."""
    k = 10
    a, b = torch.randn(w, k).bfloat16(), torch.randn(h, k, n).bfloat16()
    full = (a.double() @ b.double()).view(h // 2, 2, w // 2, 2, n).amax((1, 3))
    want = full.clamp_min(0) if relu else full
    with torch.no_grad():
        got = native.small_gemm_pool(a, b, relu)
    assert got.shape == (h // 2, w // 2, n) and got.dtype == torch.bfloat16
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-5).all(), err.max()
    assert not relu or (got >= 0).all()


@paired
@paired
@pytest.mark.parametrize(
    "w,k,h,segments,seg", [(28, 32, 4, 8, 552), (14, 18, 2, 16, 69), (4, 6, 2, 3, 33)]
)
def test_small_gemm_pool_scatters_its_rows_where_the_index_says(w, k, h, segments, seg):
    """``out``/``index``: each pooled row's segments written to the rows of ``out`` named
    by ``index`` (any order, rows not named untouched), bit for bit the pooled values."""
    a, b = torch.randn(w, k).bfloat16(), torch.randn(h, k, segments * seg).bfloat16()
    with torch.no_grad():
        pooled = native.small_gemm_pool(a, b, True)
        rows = (h // 2) * (w // 2) * segments
        index = torch.randperm(rows + 5)[:rows]
        out = torch.full((rows + 5, seg), 7.0, dtype=torch.bfloat16)
        want = out.clone()
        want[index] = pooled.reshape(-1, seg)
        assert native.small_gemm_pool(a, b, True, out=out, index=index) is out
        assert torch.equal(out, want)
        with pytest.raises(ValueError, match="row indices"):
            native.small_gemm_pool(a, b, True, out=out, index=index[:-1])
        with pytest.raises(ValueError, match="SEG >= 32"):
            native.small_gemm_pool(a, b, True, out=out.float(), index=index)


@paired
def test_small_gemm_pool_refuses_what_it_cannot_take():
    a, b = torch.randn(6, 4).bfloat16(), torch.randn(4, 4, 8).bfloat16()
    assert not native.small_gemm_pool_available(a, b)  # gradients could be wanted
    with torch.no_grad():
        assert native.small_gemm_pool_available(a, b)
        assert not native.small_gemm_pool_available(a[:5], b)  # odd W
        assert not native.small_gemm_pool_available(a, b[:3])  # odd H
        with pytest.raises(ValueError, match="even H, W"):
            native.small_gemm_pool(a, b[:3], True)


f32_gemms = pytest.mark.skipif(
    not hasattr(native._library(), "small_gemm_f32"),
    reason="the float32 DFT GEMMs are the AVX2 build's (checked on every AVX2 CPU below)",
)


@f32_gemms
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((5, 6), (6, 33)),
        ((13, 3), (3, 17)),
        ((1, 7), (2, 7, 40)),
        ((8, 28), (3, 28, 70)),
        ((56, 70), (70, 200)),
        ((7, 1), (1, 129)),
    ],
)
def test_small_gemm_is_the_float32_product(a_shape, b_shape):
    """Rows of A in blocks of six and every remainder (1, 5, 7, 8, 13, 56 rows), odd K,
    panels of 16 columns whole and cut short, one matrix or a batch: the product of the
    float32 inputs, summed in float32."""
    a, b = torch.randn(*a_shape), torch.randn(*b_shape)
    got = native.small_gemm(a, b)
    want = a.double() @ b.double()
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@f32_gemms
@pytest.mark.parametrize("n", [65536, 65544, 65537])
def test_small_gemm_streams_a_large_output_with_the_same_values(n):
    """An output of 8 MB or more whose rows lie on 32-byte boundaries is written past the
    caches (non-temporal stores; n = 65537 rows are not aligned and are stored as usual):
    the values are those of the same product in column halves small enough to stay in the
    caches, bit for bit, and the float32 product's."""
    torch.manual_seed(n)
    a, b = torch.randn(32, 9), torch.randn(9, n)
    got = native.small_gemm(a, b)  # 32 x 65536 x 4 bytes = 8 MB
    half = n // 2
    parts = torch.cat([native.small_gemm(a, b[:, :half]), native.small_gemm(a, b[:, half:])], 1)
    assert torch.equal(got, parts)
    torch.testing.assert_close(got.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)


@f32_gemms
@pytest.mark.parametrize(
    "m,k,batch,segments,seg",
    [(32, 28, 3, 8, 552), (18, 14, 2, 16, 69), (5, 3, 3, 4, 40), (9, 4, 2, 3, 33)],
)
def test_small_gemm_gather_is_the_float32_product_of_the_gathered_rows(m, k, batch, segments, seg):
    """Segments of 33-552 values, so that panels lie in one segment, span two, or end short:
    bit for bit ``small_gemm`` on the gathered copy (rows repeated and in any order)."""
    src, a = torch.randn(50, seg), torch.randn(m, k)
    index = torch.randint(0, 50, (batch * k * segments,))
    want = native.small_gemm(a, src[index].view(batch, k, segments * seg))
    got = native.small_gemm_gather(a, src, index, batch)
    assert got.shape == (batch, m, segments * seg) and torch.equal(got, want)


@f32_gemms
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("w,h,k,n", [(28, 4, 32, 70), (6, 2, 5, 33), (14, 6, 28, 16), (2, 2, 1, 7)])
def test_small_gemm_pool_is_the_float32_product_pooled(relu, w, h, k, n):
    """The 2x2 max pool (and ReLU) of the product, widths whole and cut short; scattered
    through an index, bit for bit the same values in the rows it names, others untouched."""
    a, b = torch.randn(w, k), torch.randn(h, k, n)
    full = (a.double() @ b.double()).view(h // 2, 2, w // 2, 2, n).amax((1, 3))
    want = full.clamp_min(0) if relu else full
    with torch.no_grad():
        got = native.small_gemm_pool(a, b, relu)
        assert got.shape == (h // 2, w // 2, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        if n < 32:
            return
        rows = (h // 2) * (w // 2)
        index = torch.randperm(rows + 3)[:rows]
        out = torch.full((rows + 3, n), 7.0)
        expect = out.clone()
        expect[index] = got.reshape(-1, n)
        assert native.small_gemm_pool(a, b, relu, out=out, index=index) is out
        assert torch.equal(out, expect)


@f32_gemms
def test_small_gemm_refuses_what_the_float32_kernels_cannot_take():
    a, b = torch.randn(4, 6), torch.randn(6, 40)
    assert native.small_gemm_available(a, b)
    assert not native.small_gemm_available(a.double(), b.double())
    assert not native.small_gemm_available(a, b.bfloat16())  # mixed dtypes
    assert not native.small_gemm_available(torch.randn(4, 513), torch.randn(513, 40))
    assert not native.small_gemm_available(a.requires_grad_(True), b)
    with pytest.raises(ValueError, match="K <= 512"):
        native.small_gemm(a.double(), b.double())


@f32_gemms
def test_the_fft_path_takes_the_float32_gemms_in_eval(monkeypatch):
    """Eval in float32: every DFT GEMM of the FFT path runs through the kernels (the forward
    DFTs' first reading rows where they lie, the inverse's last pooled), and the logits are
    those of torch's GEMMs."""
    from rstmodel import create_model

    torch.manual_seed(0)
    model = create_model("rst_cnn_fb", channels=(8, 10, 12)).eval()
    x = torch.randn(4, 1, 56, 56)  # rows of B Cin = 32 and 40 values
    calls = {}
    for name in ("small_gemm", "small_gemm_gather", "small_gemm_pool"):
        real = getattr(native, name)
        monkeypatch.setattr(
            native,
            name,
            lambda *a, n=name, r=real, **k: calls.update({n: calls.get(n, 0) + 1}) or r(*a, **k),
        )
    with torch.no_grad():
        fast = model(x)
        assert calls == {"small_gemm_gather": 8, "small_gemm": 16, "small_gemm_pool": 8}
        for name in (
            "small_gemm_available",
            "small_gemm_gather_available",
            "small_gemm_pool_available",
        ):
            monkeypatch.setattr(native, name, lambda *_: False)
        plain = model(x)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_the_source_follows_the_cpu(monkeypatch):
    """Every kernel where the CPU has AVX-512, the float32 ones where it has AVX2 and FMA
    (the portable source), torch's forms elsewhere."""
    for flags, want in [
        ("flags : fpu avx avx2 fma avx512f avx512bw", native.SOURCE),
        ("flags : fpu avx avx2 fma", native.PORTABLE_SOURCE),
        ("flags : fpu avx avx2", None),
    ]:
        monkeypatch.setattr(native, "_cpu_flags", lambda flags=flags: flags)
        assert native._source() == want, flags


@pytest.mark.skipif(
    not {"avx2", "fma"} <= set(native._cpu_flags().split()), reason="no AVX2 and FMA here"
)
def test_the_portable_kernels_give_the_torch_values_wherever_they_build(monkeypatch):
    """The portable source built on this CPU whichever source it would get (an AVX-512 CPU
    runs AVX2 too, so the build is checked on every machine the suite runs on): the same
    checks as the default build's, over each kernel's group remainders and partial tiles,
    its int16 products, and no bfloat16 or int8 dot-product kernel in it."""
    monkeypatch.setattr(native, "_source", lambda: native.PORTABLE_SOURCE)
    native._library.cache_clear()
    try:
        lib = native._library()
        assert lib is not None and hasattr(lib, "column_stats")
        assert not hasattr(lib, "paired_rows_product") and not hasattr(lib, "small_gemm_bf16")
        assert hasattr(lib, "small_gemm_f32")
        for rows in (1, 2, 3, 4, 5, 8):
            for n in (7, 16, 37):
                test_packed_product_is_the_joined_product(rows, n)
        for cout in (5, 8, 16, 37, 69):
            test_pooled_mix_is_the_torch_mixing_and_pool_in_float32(cout, True, True, 12)
            test_pooled_mix_is_the_torch_mixing_and_pool_in_float32(cout, False, False, 7)
            test_pooled_mix_train_is_the_torch_forward_with_its_argmax(cout, True, True)
        test_pooled_mix_grad_is_the_torch_coefficient_gradient()
        for dtype in (torch.float32, torch.bfloat16):
            test_pool2x2_is_the_torch_pool_bit_for_bit(dtype, True)
            test_pool2x2_is_the_torch_pool_bit_for_bit(dtype, False)
            for n, c in ((5, 204), (1000, 37), (70000, 69)):
                test_column_stats_are_the_float64_sums(dtype, n, c)
        for a_shape, b_shape in (((13, 3), (3, 17)), ((8, 28), (3, 28, 70)), ((1, 7), (7, 129))):
            test_small_gemm_is_the_float32_product(a_shape, b_shape)
        test_small_gemm_streams_a_large_output_with_the_same_values(65536)
        test_small_gemm_gather_is_the_float32_product_of_the_gathered_rows(18, 14, 2, 16, 69)
        test_small_gemm_gather_is_the_float32_product_of_the_gathered_rows(9, 4, 2, 3, 33)
        for relu in (True, False):
            test_small_gemm_pool_is_the_float32_product_pooled(relu, 28, 4, 32, 70)
            test_small_gemm_pool_is_the_float32_product_pooled(relu, 6, 2, 5, 33)
        test_the_fft_path_takes_the_float32_gemms_in_eval(monkeypatch)
        assert native.word_rows_built()
        for rows in (1, 3, 4, 5, 9):
            for k, n in ((1, 3), (33, 20), (69, 135)):
                test_int16_product_is_its_reference_exactly(rows, k, n)
        test_int16_product_refuses_what_it_cannot_take()
        test_the_fft_path_takes_the_int16_kernel_only_in_int16_inference(3)
    finally:
        monkeypatch.undo()
        native._library.cache_clear()


def test_build_name_says_which_kernels_run(monkeypatch):
    """What benchmark headers print: the build this CPU gets, or torch's forms."""
    want = {native.SOURCE: "AVX-512 kernels", native.PORTABLE_SOURCE: "AVX2 kernels"}
    assert native.build_name() == want[native._source()]
    native._library.cache_clear()
    monkeypatch.setenv("RSTMODEL_NATIVE", "0")
    try:
        assert native.build_name() == "torch's forms"
    finally:
        monkeypatch.undo()
        native._library.cache_clear()


def test_the_precision_checks_read_their_own_checkouts_precision_module(monkeypatch):
    """``model_bench --against`` keeps two checkouts' ``rstmodel`` in one process, the
    older imported last: the kernels' checks use the ``rstmodel.precision`` of their own
    checkout (bound at import), not whatever ``sys.modules`` holds by that name when they
    run (an older one without int16 products broke the bench)."""
    import sys
    import types

    from rstmodel import precision

    monkeypatch.setitem(sys.modules, "rstmodel.precision", types.ModuleType("rstmodel.precision"))
    rows = torch.randn(3, 2, 4)
    with torch.no_grad():
        assert native.word_rows_available(rows, rows) is False
        assert native.quad_rows_available(rows, rows) is False
    assert native._precision is precision
