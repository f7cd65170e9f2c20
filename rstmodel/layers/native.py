"""Compiled kernels for the FFT path's per-frequency products in eval on the CPU: float32
with AVX-512 or AVX2 (a portable build, below), and bfloat16 autocast where the CPU has
AVX512-BF16.

At batch 1 the eval forward's per-frequency complex products (``[4 turned copies, Cin] x
[Cin, Cout]`` for every frequency) read hundreds of MB of filter spectra and do 8 multiply-
adds per value read: they are bound by the reads. ``torch.bmm`` hands each frequency to a
GEMM library that reads the spectrum with strides, ~10-12 GB/s on this project's 2-core
CPU. ``_joined_rows.c`` reads the spectra in the order they are stored, packed once (the
eval-mode cache) into tiles of 16 columns with their real and imaginary parts side by side,
keeps four rows' sums in registers at a time (the tile stays in L1 for the next four) and
writes ``[Re y; Im y]`` directly. It does the four real products of each complex one where
the Gauss form (``kernels._GaussProduct``) does three. On that CPU the whole model's eval
took 0.75-0.79x the time at batch 1; at batches 8 and 128 the products took ~0.9x the Gauss
form's time and the forward the same within noise, with two packed spectra cached where the
Gauss form keeps three (636 against 915 MiB at batch 8): it serves float32 eval at every
batch (BENCHMARKS.md, "Issue 13, fourteenth session").

In bfloat16 (``paired_rows_product``) each 32-bit lane of the packed spectra holds one
column's pair (Re G, Im G), and one AVX512-BF16 dot-product instruction, which sums two
bfloat16 products into float32, gives the real part of a complex product for 16 columns
from the broadcast pair (Re x, -Im x), or the imaginary part from (Im x, Re x): the four
real products in two instructions, two bytes per spectrum value read (the Gauss form's
three spectra: six), the sums rounded to bfloat16 once. It serves eval under bfloat16
autocast at every batch (BENCHMARKS.md, "Issue 13, fifteenth session").

In ``rstmodel.precision.inference("int8")`` (``quad_rows_product``, where the CPU also has
AVX512-VNNI) the products run on 8-bit integers: each frequency's rows are scaled by 127 over
their largest part and rounded as the kernel reads them, the spectra likewise per frequency
and column once (the eval cache, ``pack_quads``), and one dot-product instruction (four byte
products summed into 32 bits) takes two input columns' (Re, Im) pairs at once: twice the
bfloat16 instruction's products, a byte per spectrum value read. The row's bytes are the
instruction's signed operand, broadcast from memory inside it (an inline-assembly form:
GCC does not fold the intrinsic's broadcast), so the spectra are stored offset by 128 and
each row's offset sum is taken off its results. The integer sums are exact;
they are scaled back and rounded to bfloat16 once, so ``quad_rows_reference`` gives the same
values with torch. On this project's CPU the kernel takes 0.54-0.63x the bfloat16 one's time
at batch 8's shapes and the forward 0.70-0.83x at batches 1-32; the shipped RST-CNN keeps its
float32 accuracy on 1,000 test images (BENCHMARKS.md, "Issue 13, seventeenth session").

Two more kernels serve eval on the CPU beside them. ``pooled_mix``: the lifting layer's
channel mixing (each pixel's K basis responses times a ``[Cout, K]`` matrix) and the 2x2
max pool with bias and ReLU in one pass, the full-resolution mixed map never written (a
GEMM of inner size 12 ran at ~12 G multiply-adds/s in torch, chunked and pooled after);
float32 gives the torch path's values (the same sums in the same order), bfloat16 rounds
each pooled value once. Where the basis is steerable (``basis.steering``, the FB basis) it
takes one set of weights per rotation over the responses to the upright copies only, so the
lifting layer convolves an R-th of the copies (``LiftingRSTConv.forward_pooled``). In
float32 training the same pass also writes the one-byte window position that won each output
(``pooled_mix_train``), and ``pooled_mix_grad`` sums the coefficients' gradient from it and
the responses of the winning pixels, where the torch form unpools a full-resolution gradient
map and multiplies it by the responses (``kernels._PooledMix``; the training step 0.81-0.87x
at batch 64, BENCHMARKS.md, "Issue 13, sixteenth session"). ``small_gemm``: the DFTs' GEMMs in bfloat16, a DFT matrix of a few
dozen rows and columns kept in L1 times maps with millions of columns, B's rows paired for
the dot-product instruction by a word permute per panel of 32 columns (1.2-3.3x the library
GEMM at the FFT path's shapes; it serves the DFTs' forward passes, in training too).
``small_gemm_pool``: the inverse DFT's last GEMM with the 2x2 max pool (and ReLU) that
follows the group convolution, the two image rows of each window computed side by side and
only the pooled values written (``GroupRSTConv.forward_pooled``, eval); given a table of
rows and an index, it writes each pooled row's segments where the feature layout keeps them
(the scatter back from the blocks' quarter-turned rows, fused). ``small_gemm_gather``: the
forward DFT's first GEMM reading each block's rows from the feature layout through an index,
where the FFT path would otherwise write a gathered copy and read it back
(``kernels.real_dft2_rows``).

The portable build has the three DFT GEMM kernels in float32 (``small_gemm`` and the others
take the dtype of their operands): on a 2-core AVX2 CPU the library GEMM (MKL) ran the
DFTs' shapes at 11-25 G multiply-adds/s, the kernel 0.60-0.89x its time (0.64-0.67x for the
pooled form against the GEMM and a pool), and float32 eval of the shipped RST-CNN took
0.77-0.89x the time at batches 1-22 with them (BENCHMARKS.md, "Issue 13, twenty-fifth
session"). An output of 8 MB or more (a sweep batch's) is written with non-temporal stores,
which skip reading each line before writing it (0.69-0.81x the time at those shapes). The
AVX-512 build keeps the library GEMM for float32.

The portable build's answer to the int8 products is ``word_rows_product``, inside
``rstmodel.precision.inference("int16")`` (float32 otherwise): each frequency's rows and the
filter spectra (``pack_words``) are scaled to ``word_levels(K)`` (~12 bits at the shipped
model's widths, the most for which no 32-bit sum can overflow) and rounded, and AVX2's word
multiply-add (two 16-bit products summed into 32 bits, 16 per instruction where a float32
FMA does 8) takes each column's (Re G, Im G) pair with the broadcast (Re x, -Im x) or
(Im x, Re x); the sums are exact and scaled back to float32 once, so ``word_rows_reference``
gives the same values with torch. On the Zen 3 CPU it was measured on, one word multiply-add
issues per cycle against two FMAs (``results/bench/peak-s26.c``: ~52 against ~56 G
multiply-adds/s per core), so what it gains is half the spectra's bytes and a loop that runs
near that peak in cache (~50 G/s per thread, the float32 kernel ~25-35): 0.51x the float32
kernel's time at one image, where reading the spectra binds, 0.74-0.78x at 8-22 images,
where reading the rows and writing the outputs weigh as much as the multiply-adds
(BENCHMARKS.md, "Issue 13, twenty-sixth session").

All the kernels split their work between OpenMP threads. Built with ``-fopenmp`` the
library needs ``libgomp.so.1``, which the loader finds already loaded beside torch (its
wheel bundles that soname): the threads are torch's own pool, and none of them spins
against the kernel for the cores, as a separate set of threads did (the bfloat16 products
at batch 8 took 130 ms on their own pthreads beside torch's waiting threads, 82 on
torch's).

The kernels are compiled with the system's C compiler on first use (``-O3 -march=native
-fopenmp``, about a second) into a cache folder keyed by the source, the compiler flags
and the CPU's flags: ``$RSTMODEL_CACHE``, else ``$XDG_CACHE_HOME/rstmodel``, else
``~/.cache/rstmodel``. Where the CPU has AVX2 and FMA but no AVX-512 the source is
``_joined_rows_portable.c``: the float32 kernels (``joined_rows_product``, ``pooled_mix``
and its training pair, ``column_stats``, ``pool2x2``; the DFTs' GEMMs, above) with the
same entry points, layouts and values, in GCC's generic vectors of 8 floats (a tile of 16
taken as two halves, fewer sums held in registers for AVX2's 16 of them). Where there is no compiler, neither
instruction set, or ``RSTMODEL_NATIVE=0``, every ``*available`` check is False and the
library keeps torch's forms (``kernels.joined_complex_product``, ``kernels._GaussProduct``,
``kernels._pooled_mix_rows``, the DFTs' GEMMs), the references these kernels are tested
against; without AVX512-BF16 only the float32 kernels are built.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

# bound now, not looked up at call time: model_bench keeps two checkouts' rstmodel in one
# process, and a lookup by name from a function would find the other checkout's
from .. import precision as _precision

__all__ = [
    "available",
    "build_name",
    "pack_joined",
    "joined_rows_product",
    "paired_available",
    "pack_pairs",
    "paired_rows_product",
    "QuadSpectra",
    "pack_quads",
    "quad_rows_available",
    "quad_rows_built",
    "quad_rows_product",
    "quad_rows_reference",
    "WordSpectra",
    "word_levels",
    "pack_words",
    "word_rows_available",
    "word_rows_built",
    "word_rows_product",
    "word_rows_reference",
    "pooled_mix_available",
    "pooled_mix",
    "pooled_mix_train_available",
    "pooled_mix_train",
    "pooled_mix_grad",
    "column_stats_available",
    "column_stats",
    "pool2x2_available",
    "pool2x2",
    "unpool2x2",
    "small_gemm_available",
    "small_gemm",
    "small_gemm_gather_available",
    "small_gemm_gather",
    "small_gemm_pool_available",
    "small_gemm_pool",
    "TILE",
]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_joined_rows.c")  # AVX-512: every kernel
PORTABLE_SOURCE = Path(__file__).with_name("_joined_rows_portable.c")  # AVX2: float32 ones
HEADER = Path(__file__).with_name("_kernels_common.h")  # what both include
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp")
TILE = 16  # columns per tile: one AVX-512 register of float32
_lock = threading.Lock()


def _cache_dir() -> Path:
    explicit = os.environ.get("RSTMODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rstmodel"


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _source() -> Path | None:
    """The kernels' source for this CPU: every kernel where it has AVX-512, the float32
    ones where it has AVX2 and FMA, none elsewhere."""
    flags = set(_cpu_flags().split())
    if "avx512f" in flags:
        return SOURCE
    if {"avx2", "fma"} <= flags:
        return PORTABLE_SOURCE
    return None


def build_name() -> str:
    """Which kernels run on this CPU, in words for a benchmark's header: "AVX-512 kernels",
    "AVX2 kernels" or "torch's forms" (no compiler, neither instruction set, or
    ``RSTMODEL_NATIVE=0``)."""
    if _library() is None:
        return "torch's forms"
    return "AVX-512 kernels" if _source() == SOURCE else "AVX2 kernels"


def _build(compiler: str, source: Path, target: Path) -> bool:
    """Compile ``source`` to ``target`` (written whole, then renamed into place); False, with
    the compiler's last line logged, where it does not compile."""
    log.debug("compiling %s -> %s", source.name, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, "-o", str(out), str(source)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode:
            log.info(
                "the FFT path's few-row kernel did not compile (%s); torch.bmm serves",
                done.stderr.strip().splitlines()[-1:] or done.returncode,
            )
            return False
        os.replace(out, target)
    return True


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with the reason logged) where it cannot be had."""
    if os.environ.get("RSTMODEL_NATIVE", "1") == "0":
        return None
    if not sys.platform.startswith("linux"):
        return None
    import fcntl  # POSIX only, as is what follows

    source = _source()
    if source is None:
        log.info("no AVX2 or AVX-512 here: the FFT path's few-row products stay on torch.bmm")
        return None
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    compiler = shutil.which(compiler) or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the FFT path's few-row products stay on torch.bmm")
        return None
    key = hashlib.sha256(
        "\n".join([source.read_text(), HEADER.read_text(), compiler, *FLAGS, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"joined_rows-{key}.so"
    with _lock:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # one build however many processes start at once: the others wait, then load it
            # (a file replaced under a process that had loaded it would be mapped twice)
            with open(target.parent / f".{target.name}.lock", "w") as held:
                fcntl.flock(held, fcntl.LOCK_EX)
                if not target.exists() and not _build(compiler, source, target):
                    return None
        except (OSError, subprocess.SubprocessError) as err:
            log.info("could not build %s (%s); torch.bmm serves", target, err)
            return None
        lib = ctypes.CDLL(str(target))
    fn = lib.joined_rows_product
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
    fn.restype = ctypes.c_int
    lib.pooled_mix_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 8
    lib.pooled_mix_grad_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 6
    lib.pooled_mix_grad_f32.restype = ctypes.c_int
    lib.pooled_mix_f32.restype = ctypes.c_int
    if hasattr(lib, "column_stats"):  # AVX-512 where the CPU has AVX512-BW and -VL; AVX2
        lib.column_stats.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4
        lib.column_stats.restype = ctypes.c_int
        lib.pool2x2.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 6
        lib.pool2x2.restype = ctypes.c_int
        lib.unpool2x2.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
        lib.unpool2x2.restype = ctypes.c_int
    if hasattr(lib, "small_gemm_f32"):  # the portable build (AVX2)
        lib.small_gemm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
        lib.small_gemm_gather_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 6
        lib.small_gemm_pool_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 6
        lib.small_gemm_pool_scatter_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 7
        for name in (
            "small_gemm",
            "small_gemm_gather",
            "small_gemm_pool",
            "small_gemm_pool_scatter",
        ):
            getattr(lib, f"{name}_f32").restype = ctypes.c_int
    if hasattr(lib, "word_rows_product"):  # the portable build (AVX2)
        lib.word_rows_product.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 6
        lib.word_rows_product.restype = ctypes.c_int
    if hasattr(lib, "paired_rows_product"):  # built where the CPU has AVX512-BF16
        fn = lib.paired_rows_product
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5
        fn.restype = ctypes.c_int
        if hasattr(lib, "quad_rows_product"):  # and AVX512-VNNI
            lib.quad_rows_product.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 5
            lib.quad_rows_product.restype = ctypes.c_int
        lib.pooled_mix_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 8
        lib.pooled_mix_bf16.restype = ctypes.c_int
        lib.small_gemm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
        lib.small_gemm_bf16.restype = ctypes.c_int
        lib.small_gemm_gather_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 6
        lib.small_gemm_gather_bf16.restype = ctypes.c_int
        lib.small_gemm_pool_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 6
        lib.small_gemm_pool_bf16.restype = ctypes.c_int
        lib.small_gemm_pool_scatter_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 7
        lib.small_gemm_pool_scatter_bf16.restype = ctypes.c_int
    return lib


def available(x_re: Tensor, x_im: Tensor) -> bool:
    """Whether ``joined_rows_product`` serves these row blocks ``[F, M, K]``: float32 on
    the CPU outside autocast (whose spectra would come in bfloat16), no gradient wanted
    (eval), and the kernel built here."""
    return (
        x_re.device.type == "cpu"
        and x_re.dtype == x_im.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not (torch.is_grad_enabled() and (x_re.requires_grad or x_im.requires_grad))
        and _library() is not None
    )


def paired_available(x_re: Tensor, x_im: Tensor) -> bool:
    """Whether ``paired_rows_product`` serves these row blocks: bfloat16 autocast eval on
    the CPU (no gradient wanted) and the kernel built here with AVX512-BF16."""
    lib = _library() if x_re.device.type == "cpu" else None
    return (
        lib is not None
        and hasattr(lib, "paired_rows_product")
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and not (torch.is_grad_enabled() and (x_re.requires_grad or x_im.requires_grad))
    )


def pack_joined(g_re: Tensor, g_im: Tensor) -> Tensor:
    """Filter spectra ``[F, K, N]`` (real and imaginary parts) as the kernel reads them:
    ``[F, T, K, 2, TILE]``, tile t holding columns ``t*TILE : (t+1)*TILE`` (zero past N),
    real part then imaginary part."""
    f, k, n = g_re.shape
    tiles = -(-n // TILE)
    packed = g_re.new_zeros(f, k, 2, tiles * TILE)
    packed[:, :, 0, :n] = g_re
    packed[:, :, 1, :n] = g_im
    return packed.view(f, k, 2, tiles, TILE).permute(0, 3, 1, 2, 4).contiguous()


def pack_pairs(g_re: Tensor, g_im: Tensor) -> Tensor:
    """Filter spectra ``[F, K, N]`` as ``paired_rows_product`` reads them: bfloat16
    ``[F, T, K, TILE, 2]``, tile t holding columns ``t*TILE : (t+1)*TILE`` (zero past N),
    each column's (Re G, Im G) side by side. Round the spectra once: pass them in float32."""
    f, k, n = g_re.shape
    tiles = -(-n // TILE)
    packed = torch.zeros(f, k, tiles * TILE, 2, dtype=torch.bfloat16, device=g_re.device)
    packed[:, :, :n, 0] = g_re
    packed[:, :, :n, 1] = g_im
    return packed.view(f, k, tiles, TILE, 2).transpose(1, 2).contiguous()


def joined_rows_product(
    x_re: Tensor,
    x_im: Tensor,
    packed: Tensor,
    n: int,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> Tensor:
    """``kernels.joined_complex_product`` with the spectra packed by ``pack_joined``:
    x ``[F, M, K]`` each -> ``[Re y; Im y]`` ``[2, F, M, N]``; the bias added as there."""
    f, m, k = x_re.shape
    if packed.shape != (f, -(-n // TILE), k, 2, TILE) or not packed.is_contiguous():
        raise ValueError(f"spectra {tuple(packed.shape)} are not packed for {f} x {k} x {n}")
    if {x_re.dtype, x_im.dtype, packed.dtype} != {torch.float32}:
        raise ValueError(f"float32 only, not {x_re.dtype} rows and {packed.dtype} spectra")
    x = torch.cat([x_re, x_im], 1)  # [F, 2M, K]
    y = x.new_empty(2, f, m, n)
    threads = max(1, torch.get_num_threads())
    if _library().joined_rows_product(
        x.data_ptr(), packed.data_ptr(), y.data_ptr(), f, m, k, n, threads
    ):
        raise ValueError(f"the kernel takes at least one row, not {m}")
    return _with_bias(y, bias, dc_rows, dc_scale)


def paired_rows_product(
    x_re: Tensor,
    x_im: Tensor,
    packed: Tensor,
    n: int,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> Tensor:
    """``joined_rows_product`` in bfloat16 with the spectra packed by ``pack_pairs``:
    x ``[F, M, K]`` each (rounded to bfloat16) -> ``[Re y; Im y]`` ``[2, F, M, N]``
    bfloat16, each output summed in float32 and rounded once; the bias added as there."""
    f, m, k = x_re.shape
    if packed.shape != (f, -(-n // TILE), k, TILE, 2) or not packed.is_contiguous():
        raise ValueError(f"spectra {tuple(packed.shape)} are not paired for {f} x {k} x {n}")
    if packed.dtype != torch.bfloat16:
        raise ValueError(f"bfloat16 spectra only, not {packed.dtype}")
    fn = _library().paired_rows_product
    return _bf16_rows_product(fn, x_re, x_im, (packed,), n, bias, dc_rows, dc_scale)


def _bf16_rows_product(
    fn, x_re: Tensor, x_im: Tensor, spectra: tuple[Tensor, ...], n: int, bias, dc_rows, dc_scale
) -> Tensor:
    """Run a bfloat16 products kernel ``fn(x_re, x_im, *spectra, y, F, M, K, N, threads)``
    on the rows (rounded to bfloat16): ``y [2, F, M, N]`` bfloat16 with the bias added at
    the first ``dc_rows`` frequencies' real parts."""
    f, m, k = x_re.shape
    x_re = x_re.to(torch.bfloat16).contiguous()
    x_im = x_im.to(torch.bfloat16).contiguous()
    y = x_re.new_empty(2, f, m, n)
    threads = max(1, torch.get_num_threads())
    pointers = [t.data_ptr() for t in (x_re, x_im, *spectra, y)]
    err = fn(*pointers, f, m, k, n, threads)
    if err:
        raise ValueError(
            f"the kernel takes at least one row, not {m}" if err == 1 else "out of memory"
        )
    return _with_bias(y, bias, dc_rows, dc_scale)


class QuadSpectra(NamedTuple):
    """Filter spectra as ``quad_rows_product`` reads them (``pack_quads``)."""

    g: Tensor  # uint8 [F, T, ceil(K/2), TILE, 4]: per column (Re, Im) of two input columns + 128
    scale: Tensor  # float32 [F, T*TILE]: each column's scale (zero past N)


def _quantize(values: Tensor, top: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """``values`` times ``levels`` / ``top`` (broadcast), rounded to the nearest integer
    (ties to even), and the scale ``top / levels``: what the kernels do, in the same float32
    steps (a scalar over a tensor is a reciprocal times it, two roundings: tensors here)."""
    top = top.float()
    steps = torch.full_like(top, float(levels))
    inv = steps / top.clamp_min(torch.finfo(torch.float32).tiny)
    inv = torch.where(top > 0, inv, 0.0)
    return torch.round(values.float() * inv), top / steps


def _quantized_columns(g_re: Tensor, g_im: Tensor, levels: int, rows: int) -> tuple[Tensor, Tensor]:
    """Filter spectra ``[F, K, N]`` quantized to ``levels`` per frequency and column (over
    the K input columns, real and imaginary parts together): int16 ``[F, rows, T*TILE, 2]``
    holding (Re, Im), zero past K rows and N columns, and float32 ``[F, T*TILE]`` each
    column's scale (zero past N), for the integer kernels' packings."""
    f, k, n = g_re.shape
    width = -(-n // TILE) * TILE
    top = torch.maximum(g_re.abs(), g_im.abs()).amax(1, keepdim=True)  # [F, 1, N]
    (q_re, scale), (q_im, _) = _quantize(g_re, top, levels), _quantize(g_im, top, levels)
    q = torch.zeros(f, rows, width, 2, dtype=torch.int16, device=g_re.device)
    q[:, :k, :n, 0] = q_re.to(torch.int16)
    q[:, :k, :n, 1] = q_im.to(torch.int16)
    scales = torch.zeros(f, width, dtype=torch.float32, device=g_re.device)
    scales[:, :n] = scale[:, 0]
    return q, scales


def pack_quads(g_re: Tensor, g_im: Tensor) -> QuadSpectra:
    """Filter spectra ``[F, K, N]`` (float32) quantized to 8 bits per frequency and column
    (``127 / max |Re G|, |Im G|`` over the K input columns), offset by 128 (unsigned) and
    packed for ``quad_rows_product``."""
    f, k, n = g_re.shape
    tiles, k2 = -(-n // TILE), -(-k // 2)
    q, scales = _quantized_columns(g_re, g_im, 127, 2 * k2)
    packed = (q + 128).to(torch.uint8).view(f, k2, 2, tiles, TILE, 2)
    packed = packed.permute(0, 3, 1, 4, 2, 5).contiguous()
    return QuadSpectra(packed.view(f, tiles, k2, TILE, 4), scales)


def quad_rows_built() -> bool:
    """Whether the kernels here were built with ``quad_rows_product`` (AVX512-BF16 and
    AVX512-VNNI)."""
    lib = _library()
    return lib is not None and hasattr(lib, "quad_rows_product")


def quad_rows_available(x_re: Tensor, x_im: Tensor) -> bool:
    """Whether ``quad_rows_product`` serves these row blocks: inside
    ``rstmodel.precision.inference("int8")``, ``paired_available`` and the kernel built."""
    return _precision.int8_products() and paired_available(x_re, x_im) and quad_rows_built()


def quad_rows_product(
    x_re: Tensor,
    x_im: Tensor,
    spectra: QuadSpectra,
    n: int,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> Tensor:
    """``paired_rows_product`` in int8: each frequency's rows ``x [F, M, K]`` (rounded to
    bfloat16) quantized per row (``127 / max |Re x|, |Im x|``), the spectra as
    ``pack_quads`` quantized them, the complex products summed exactly in 32-bit integers
    and scaled back: ``[Re y; Im y]`` ``[2, F, M, N]`` bfloat16, the bias added as there.
    ``quad_rows_reference`` computes the same values with torch."""
    f, m, k = x_re.shape
    tiles, k2 = -(-n // TILE), -(-k // 2)
    if spectra.g.shape != (f, tiles, k2, TILE, 4) or not spectra.g.is_contiguous():
        raise ValueError(f"spectra {tuple(spectra.g.shape)} are not quads for {f} x {k} x {n}")
    fn = _library().quad_rows_product
    return _bf16_rows_product(fn, x_re, x_im, spectra, n, bias, dc_rows, dc_scale)


def quad_rows_reference(
    x_re: Tensor,
    x_im: Tensor,
    g_re: Tensor,
    g_im: Tensor,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> Tensor:
    """What ``quad_rows_product`` computes (on ``pack_quads(g_re, g_im)``), in torch: the
    integer products summed in float64 (exact), the same scalings and roundings."""
    x_re, x_im = x_re.to(torch.bfloat16).float(), x_im.to(torch.bfloat16).float()
    y = _integer_product(x_re, x_im, g_re, g_im, 127).to(torch.bfloat16)
    return _with_bias(y, bias, dc_rows, dc_scale)


def _integer_product(x_re: Tensor, x_im: Tensor, g_re: Tensor, g_im: Tensor, levels: int) -> Tensor:
    """The integer kernels' complex products in torch: each frequency's rows ``[F, M, K]``
    quantized to ``levels`` over their largest part, the spectra ``[F, K, N]`` per column,
    the integer products summed in float64 (exact), scaled back in float32 with the scale
    product rounded once, as the kernels do: ``[Re y; Im y]`` ``[2, F, M, N]`` float32."""
    top = torch.maximum(x_re.abs(), x_im.abs()).amax(2, keepdim=True)  # [F, M, 1]
    (q_re, sx), (q_im, _) = _quantize(x_re, top, levels), _quantize(x_im, top, levels)
    gtop = torch.maximum(g_re.abs(), g_im.abs()).amax(1, keepdim=True)
    (w_re, sg), (w_im, _) = _quantize(g_re, gtop, levels), _quantize(g_im, gtop, levels)
    q_re, q_im, w_re, w_im = (t.double() for t in (q_re, q_im, w_re, w_im))
    s = sx * sg  # [F, M, N] float32, one rounding as the kernels'
    return torch.stack(
        [(q_re @ w_re - q_im @ w_im).float() * s, (q_im @ w_re + q_re @ w_im).float() * s]
    )


def _with_bias(y: Tensor, bias: Tensor | None, dc_rows: int, dc_scale: float) -> Tensor:
    """``y`` ``[2, F, M, N]`` with the bias (times ``dc_scale``, in y's dtype) added to the
    real parts of its first ``dc_rows`` frequencies, as the products' wrappers add it."""
    if bias is not None:
        y[0, :dc_rows] += bias.to(y.dtype) * dc_scale
    return y


class WordSpectra(NamedTuple):
    """Filter spectra as ``word_rows_product`` reads them (``pack_words``)."""

    g: Tensor  # int16 [F, T, K, TILE, 2]: per column (Re G, Im G), zero past N
    scale: Tensor  # float32 [F, T*TILE]: each column's scale (zero past N)
    levels: int  # the integer range both sides were scaled to: word_levels(K)


def word_levels(k: int) -> int:
    """The largest integer range ``L`` (values in ``[-L, L]``) for 16-bit rows and spectra
    whose complex products over ``k`` input columns sum without overflow in 32 bits: each
    sum is at most ``2 k L^2 < 2^31``. 3,944 (~12 bits) at K = 69, 2,820 at K = 135."""
    if k < 1:
        raise ValueError(f"at least one input column, not {k}")
    return min(32767, math.isqrt((2**31 - 1) // (2 * k)))


def pack_words(g_re: Tensor, g_im: Tensor) -> WordSpectra:
    """Filter spectra ``[F, K, N]`` (float32) quantized to ``word_levels(K)`` per frequency
    and column (over the K input columns, real and imaginary parts together) and packed as
    ``word_rows_product`` reads them."""
    f, k, n = g_re.shape
    tiles, levels = -(-n // TILE), word_levels(k)
    q, scales = _quantized_columns(g_re, g_im, levels, k)
    packed = q.view(f, k, tiles, TILE, 2).transpose(1, 2).contiguous()
    return WordSpectra(packed, scales, levels)


def word_rows_built() -> bool:
    """Whether the kernels here were built with ``word_rows_product`` (the portable AVX2
    build)."""
    lib = _library()
    return lib is not None and hasattr(lib, "word_rows_product")


def word_rows_available(x_re: Tensor, x_im: Tensor) -> bool:
    """Whether ``word_rows_product`` serves these row blocks: float32 eval on the CPU inside
    ``rstmodel.precision.inference("int16")`` and the kernel built."""
    return _precision.int16_products() and available(x_re, x_im) and word_rows_built()


def word_rows_product(
    x_re: Tensor,
    x_im: Tensor,
    spectra: WordSpectra,
    n: int,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> Tensor:
    """``joined_rows_product`` on 16-bit integers: each frequency's rows ``x [F, M, K]``
    (float32) quantized per row to ``spectra.levels`` (over ``|Re x|, |Im x|``), the spectra
    as ``pack_words`` quantized them, the complex products summed exactly in 32 bits and
    scaled back: ``[Re y; Im y]`` ``[2, F, M, N]`` float32, the bias added as there.
    ``word_rows_reference`` computes the same values with torch."""
    f, m, k = x_re.shape
    tiles = -(-n // TILE)
    if spectra.g.shape != (f, tiles, k, TILE, 2) or not spectra.g.is_contiguous():
        raise ValueError(f"spectra {tuple(spectra.g.shape)} are not words for {f} x {k} x {n}")
    if x_re.dtype != torch.float32 or x_im.dtype != torch.float32:
        raise ValueError(f"float32 rows only, not {x_re.dtype}")
    x_re, x_im = x_re.contiguous(), x_im.contiguous()
    y = x_re.new_empty(2, f, m, n)
    threads = max(1, torch.get_num_threads())
    pointers = [t.data_ptr() for t in (x_re, x_im, spectra.g, spectra.scale, y)]
    err = _library().word_rows_product(*pointers, f, m, k, n, spectra.levels, threads)
    if err:
        raise ValueError(
            {1: f"the kernel takes at least one row, not {m}", 2: "out of memory"}.get(
                err, f"levels {spectra.levels} could overflow 32-bit sums over K = {k}"
            )
        )
    return _with_bias(y, bias, dc_rows, dc_scale)


def word_rows_reference(
    x_re: Tensor,
    x_im: Tensor,
    g_re: Tensor,
    g_im: Tensor,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> Tensor:
    """What ``word_rows_product`` computes (on ``pack_words(g_re, g_im)``), in torch: the
    integer products summed in float64 (exact), the same scalings and roundings."""
    y = _integer_product(x_re, x_im, g_re, g_im, word_levels(x_re.shape[-1]))
    return _with_bias(y, bias, dc_rows, dc_scale)


def pooled_mix_available(resp: Tensor, *params: Tensor | None) -> bool:
    """Whether ``pooled_mix`` serves the lifting layer's responses ``resp`` ``[H, W*M, KK]``
    mixed by ``params`` (weights, bias): on the CPU, no gradient wanted for any of them,
    float32, or bfloat16 with an even KK where the CPU has AVX512-BF16, and the kernels
    built here."""
    lib = _library() if resp.device.type == "cpu" else None
    wanted = any(t is not None and t.requires_grad for t in (resp, *params))
    if lib is None or (torch.is_grad_enabled() and wanted):
        return False
    if resp.dtype == torch.float32:
        return True
    return (
        resp.dtype == torch.bfloat16 and hasattr(lib, "pooled_mix_bf16") and resp.shape[-1] % 2 == 0
    )


def pooled_mix(resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int) -> Tensor:
    """``kernels._pooled_mix_rows(resp, a, bias, relu, w, argmax=False)[0]`` in one pass, in
    ``resp``'s dtype: the responses ``[H, W*M, KK]`` of M maps times ``a`` ``[Cout, KK]``,
    plus the bias, each 2x2 window's maximum, through the ReLU if ``relu``: ``[H/2, W/2, M,
    Cout]``. The full-resolution mixed map is never written; each output is summed in
    float32 and rounded once.

    ``a`` ``[R, Cout, KK]`` (a steerable basis: ``LiftingRSTConv.forward_pooled``): the
    responses hold M maps per pixel and the output R M, map ``r M + m`` being map m mixed
    by ``a[r]``: ``[H/2, W/2, R*M, Cout]``."""
    return _pooled_mix(resp, a, bias, relu, w, argmax=False)[0]


def _pooled_mix(
    resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int, argmax: bool
) -> tuple[Tensor, Tensor | None]:
    """``pooled_mix``, and with ``argmax`` (float32) the window codes (``pooled_mix_train``)."""
    h, wm, kk = resp.shape
    sets = 1 if a.dim() == 2 else a.shape[0]
    m, cout = wm // w, a.shape[-2]
    if h % 2 or w % 2 or wm != w * m or a.shape[-1] != kk:
        raise ValueError(f"responses {tuple(resp.shape)} do not fit {w} columns and {kk} inputs")
    tiles = -(-cout // TILE)
    padded = torch.zeros(tiles * TILE, dtype=torch.float32)
    if bias is not None:
        padded[:cout] = bias.detach().float()
    wt = torch.zeros(sets, tiles * TILE, kk, dtype=resp.dtype)
    wt[:, :cout] = a.detach().view(sets, cout, kk)
    out = resp.new_empty(h // 2, w // 2, sets * m, cout)
    code = torch.empty(out.shape, dtype=torch.uint8) if argmax else None
    resp = resp.detach().contiguous()
    if resp.dtype == torch.float32:
        fn, wt = _library().pooled_mix_f32, wt.view(sets, tiles, TILE, kk).transpose(2, 3)
    elif resp.dtype == torch.bfloat16 and kk % 2 == 0:
        fn = _library().pooled_mix_bf16
        wt = wt.view(sets, tiles, TILE, kk // 2, 2).transpose(2, 3)  # pairs of channels
    else:
        raise ValueError(f"float32, or bfloat16 with an even KK, not {resp.dtype} with {kk}")
    wt = wt.contiguous()
    threads = max(1, torch.get_num_threads())
    args = (resp.data_ptr(), wt.data_ptr(), padded.data_ptr(), out.data_ptr())
    if resp.dtype == torch.float32:
        args += (0 if code is None else code.data_ptr(),)
    elif code is not None:
        raise ValueError(f"the window codes in float32 only, not {resp.dtype}")
    if fn(*args, h, w, sets * m, kk, cout, sets, int(relu), threads):
        raise ValueError(f"no 2x2 window in {h} x {w}")
    return out, code


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the row kernels read


def pooled_mix_train_available(resp: Tensor, a: Tensor) -> bool:
    """Whether ``pooled_mix_train`` and ``pooled_mix_grad`` serve the training forward and
    the coefficients' gradient of ``kernels._PooledMix``: float32 or bfloat16 (autocast) on
    the CPU, the kernels built here."""
    lib = _library() if resp.device.type == a.device.type == "cpu" else None
    dtypes_ok = resp.dtype in _KERNEL_DTYPES and a.dtype in _KERNEL_DTYPES
    return lib is not None and dtypes_ok and a.dim() == 2


def pooled_mix_train(
    resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int
) -> tuple[Tensor, Tensor]:
    """``kernels._pooled_mix_rows(resp, a, bias, relu, w, argmax=True)`` in one pass: the
    pooled map ``[H/2, W/2, M, Cout]`` in ``resp``'s dtype and the one-byte window position
    that won each output (``kernels._pool_quads``' code, 4 where the ReLU clamps). The
    float32 kernel: the same sums in the same order as there; bfloat16 operands are widened
    exactly, summed in float32 and the pooled map rounded once (the torch form rounds each
    sum to bfloat16, then adds the bias and rounds again)."""
    if not pooled_mix_train_available(resp, a):
        raise ValueError(f"float32 or bfloat16 on the CPU only, not {resp.dtype} / {a.dtype}")
    wide = [None if t is None else t.float() for t in (resp, a, bias)]
    out, code = _pooled_mix(*wide, relu, w, argmax=True)
    return out.to(resp.dtype), code


def pooled_mix_grad(resp: Tensor, grad: Tensor, code: Tensor, w: int) -> Tensor:
    """The coefficients' gradient ``[Cout, KK]`` (float32) of ``pooled_mix_train``'s map from
    its gradient ``grad`` ``[H/2, W/2, M, Cout]`` and ``code``: each pooled output's gradient
    times the responses of the pixel that won it, summed (``kernels._pooled_mix_grads``'
    grad_a, without the full-resolution gradient map). bfloat16 responses are widened."""
    h, wm, kk = resp.shape
    m, cout = wm // w, grad.shape[-1]
    if resp.dtype == torch.bfloat16:
        resp = resp.float()
    if (
        resp.dtype != torch.float32
        or grad.dtype != torch.float32
        or code.dtype != torch.uint8
        or grad.shape != (h // 2, w // 2, m, cout)
        or code.shape != grad.shape
    ):
        raise ValueError(
            f"float32 or bfloat16 responses {tuple(resp.shape)} and a float32 gradient and byte code "
            f"[{h // 2}, {w // 2}, {m}, Cout] only"
        )
    tiles = -(-cout // TILE)
    threads = max(1, torch.get_num_threads())
    partial = torch.zeros(threads, tiles, kk, TILE, dtype=torch.float32)
    resp, grad, code = resp.contiguous(), grad.contiguous(), code.contiguous()
    args = (resp.data_ptr(), grad.data_ptr(), code.data_ptr(), partial.data_ptr())
    if _library().pooled_mix_grad_f32(*args, h, w, m, kk, cout, threads):
        raise ValueError(f"no 2x2 window in {h} x {w}")
    # [tiles, K, 16] -> [Cout, K]
    return partial.sum(0).transpose(1, 2).reshape(tiles * TILE, kk)[:cout].contiguous()


def column_stats_available(x: Tensor, g: Tensor | None = None) -> bool:
    """Whether ``column_stats`` serves ``x`` (and ``g``): [N, C] float32 or bfloat16 on the
    CPU (``g`` of the same shape and dtype), the kernel built here."""
    lib = _library() if x.device.type == "cpu" else None
    return (
        lib is not None
        and hasattr(lib, "column_stats")
        and x.dim() == 2
        and x.dtype in _KERNEL_DTYPES
        and (g is None or (g.shape == x.shape and g.dtype == x.dtype and g.device == x.device))
    )


def column_stats(x: Tensor, shift: Tensor, g: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The batch norm's column sums over the rows of ``x`` [N, C] in one pass, float64 [C]
    each: ``(sum (x - shift), sum (x - shift)^2)``, or with ``g`` ``(sum g, sum g (x -
    shift))``. ``shift`` [C] (float32 in the kernel): near each column's mean, the one-pass
    variance loses no digits. Blocks of 256 rows are summed in float32 and added in float64
    (``_RowBatchNorm``'s torch form: chunks of 16,384 rows by a float32 GEMV)."""
    if not column_stats_available(x, g):
        raise ValueError(
            f"[N, C] float32 or bfloat16 on the CPU only, not {tuple(x.shape)} {x.dtype}"
        )
    n, c = x.shape
    x = x.detach().contiguous()
    g = None if g is None else g.detach().contiguous()
    k = shift.detach().to(torch.float32).contiguous()
    if k.shape != (c,):
        raise ValueError(f"the shift is [{c}], not {tuple(k.shape)}")
    out = torch.zeros(2, c, dtype=torch.float64)
    threads = max(1, torch.get_num_threads())
    gp = None if g is None else g.data_ptr()
    bf16 = int(x.dtype == torch.bfloat16)
    if _library().column_stats(x.data_ptr(), gp, k.data_ptr(), out.data_ptr(), n, c, bf16, threads):
        raise ValueError(f"no rows to sum in {tuple(x.shape)}")
    return out[0], out[1]


def pool2x2_available(x: Tensor) -> bool:
    """Whether ``pool2x2`` (and ``unpool2x2`` for its gradient) serve ``x`` [H, W, L]:
    float32 or bfloat16 on the CPU, contiguous, even H and W, the kernels built here."""
    lib = _library() if x.device.type == "cpu" else None
    return (
        lib is not None
        and hasattr(lib, "pool2x2")
        and x.dim() == 3
        and x.dtype in _KERNEL_DTYPES
        and x.is_contiguous()
        and x.shape[0] % 2 == 0
        and x.shape[1] % 2 == 0
    )


def pool2x2(x: Tensor, relu: bool, argmax: bool) -> tuple[Tensor, Tensor | None]:
    """``pooling._pool_quads`` of spatial-major maps in one pass: x [H, W, L] -> the maximum
    of each 2x2 window [H/2, W/2, L] (through the ReLU if ``relu``) and, with ``argmax``,
    the window position that won each output as a byte (scan order, the first of equal
    values winning; 4 where the ReLU clamps). The same values: a maximum is one of its
    inputs, so bfloat16 loses nothing."""
    if not pool2x2_available(x):
        raise ValueError(
            f"contiguous [H, W, L] float32 or bfloat16 with even H, W, not {tuple(x.shape)} {x.dtype}"
        )
    h, w, n = x.shape
    x = x.detach()
    out = x.new_empty(h // 2, w // 2, n)
    code = torch.empty(out.shape, dtype=torch.uint8) if argmax else None
    threads = max(1, torch.get_num_threads())
    cp = None if code is None else code.data_ptr()
    bf16 = int(x.dtype == torch.bfloat16)
    _library().pool2x2(x.data_ptr(), out.data_ptr(), cp, h, w, n, int(relu), bf16, threads)
    return out, code


def unpool2x2(grad: Tensor, code: Tensor) -> Tensor:
    """The gradient of ``pool2x2``: grad [H/2, W/2, L] into the window position ``code``
    names, zeros at the other three (at all four where the code is 4): [H, W, L]."""
    hh, ww, n = grad.shape
    if code.shape != grad.shape or code.dtype != torch.uint8 or grad.dtype not in _KERNEL_DTYPES:
        raise ValueError(
            f"a float32 or bfloat16 gradient and its byte code, not {grad.dtype} / {code.dtype}"
        )
    grad, code = grad.detach().contiguous(), code.contiguous()
    gx = grad.new_empty(2 * hh, 2 * ww, n)
    threads = max(1, torch.get_num_threads())
    bf16 = int(grad.dtype == torch.bfloat16)
    _library().unpool2x2(
        grad.data_ptr(), code.data_ptr(), gx.data_ptr(), 2 * hh, 2 * ww, n, bf16, threads
    )
    return gx


SMALL_GEMM_MAX_K = 512  # the kernels' buffers of B's rows (KMAX)
# the DFT GEMM kernels' suffix by dtype: bfloat16 in the AVX-512 build (AVX512-BF16), float32
# in the portable one (AVX2)
_GEMM_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _gemm_kernel(name: str, a: Tensor) -> ctypes._CFuncPtr:
    return getattr(_library(), f"{name}_{_GEMM_DTYPES[a.dtype]}")


def small_gemm_available(a: Tensor, b: Tensor) -> bool:
    """Whether ``small_gemm`` serves ``a @ b``: on the CPU, bfloat16 (an even K; AVX-512
    build) or float32 (the portable AVX2 build), K of at most ``SMALL_GEMM_MAX_K``, no
    gradient wanted through the product, the kernel built here."""
    return _dft_gemm_ok("small_gemm", a, b) and b.dim() in (2, 3) and b.shape[-2] == a.shape[-1]


def _dft_gemm_ok(kernel: str, a: Tensor, b: Tensor) -> bool:
    """What the DFT GEMM kernels share: on the CPU, ``a`` and ``b`` of one dtype whose
    kernel is built here (bfloat16: AVX512-BF16, and an even K; float32: AVX2 without
    AVX-512), a 2D ``a`` with K of at most ``SMALL_GEMM_MAX_K``, no gradient wanted."""
    lib = _library() if a.device.type == b.device.type == "cpu" else None
    suffix = _GEMM_DTYPES.get(a.dtype)
    k = a.shape[-1]
    return (
        lib is not None
        and suffix is not None
        and hasattr(lib, f"{kernel}_{suffix}")
        and b.dtype == a.dtype
        and a.dim() == 2
        and (k % 2 == 0 or suffix == "f32")
        and 1 <= k <= SMALL_GEMM_MAX_K
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    )


def small_gemm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a small ``a`` ``[M, K]`` and ``b`` ``[K, N]`` or ``[B, K, N]`` with
    long rows (the DFTs' GEMMs), in ``a``'s dtype: bfloat16 sums each output in float32 and
    rounds it once; float32 sums in float32 (in another order than a library GEMM)."""
    if not small_gemm_available(a, b):
        raise ValueError(
            f"bfloat16 (even K) or float32, as built here, [M, K] @ [(B,) K, N] with K <= "
            f"{SMALL_GEMM_MAX_K} only, not {a.dtype} {tuple(a.shape)} @ {b.dtype} "
            f"{tuple(b.shape)}"
        )
    m, k = a.shape
    batch, n = (1 if b.dim() == 2 else b.shape[0]), b.shape[-1]
    a, b = a.contiguous(), b.contiguous()
    c = b.new_empty(*b.shape[:-2], m, n)
    threads = max(1, torch.get_num_threads())
    if _gemm_kernel("small_gemm", a)(
        a.data_ptr(), b.data_ptr(), c.data_ptr(), batch, m, k, n, threads
    ):
        raise ValueError(f"no product for {tuple(a.shape)} @ {tuple(b.shape)}")
    return c


def small_gemm_gather_available(a: Tensor, src: Tensor) -> bool:
    """Whether ``small_gemm_gather`` serves ``a`` and the table of rows ``src`` ``[rows,
    SEG]``: as ``small_gemm``, with rows of at least 32 values."""
    return _dft_gemm_ok("small_gemm_gather", a, src) and src.dim() == 2 and src.shape[1] >= 32


def small_gemm_gather(a: Tensor, src: Tensor, index: Tensor, batch: int) -> Tensor:
    """``small_gemm(a, src[index].view(batch, K, N))`` without the gathered copy: ``a``
    ``[M, K]``, ``src`` ``[rows, SEG]`` (its dtype), ``index`` ``[batch * K * J]`` (int64)
    naming the row of ``src`` for each segment of SEG columns of B (N = J SEG): the forward
    DFT's first GEMM reading the FFT path's blocks of maps where they lie
    (``kernels.real_dft2_rows``). Returns ``[batch, M, N]``."""
    m, k = a.shape
    seg = src.shape[1]
    if not small_gemm_gather_available(a, src) or index.numel() % (batch * k):
        raise ValueError(
            f"[M, K] and rows of >= 32 of a kernel's dtype, K <= {SMALL_GEMM_MAX_K} (even in "
            f"bfloat16) and "
            f"{batch} x K x J indices only, not {a.dtype} {tuple(a.shape)}, {src.dtype} "
            f"{tuple(src.shape)}, {index.numel()} indices"
        )
    n = index.numel() // (batch * k) * seg
    a, src = a.contiguous(), src.contiguous()
    index = index.to(torch.int64).contiguous()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= src.shape[0]):
        raise ValueError(f"row indices outside the {src.shape[0]} rows")
    c = src.new_empty(batch, m, n)
    threads = max(1, torch.get_num_threads())
    if _gemm_kernel("small_gemm_gather", a)(
        a.data_ptr(), src.data_ptr(), index.data_ptr(), c.data_ptr(), batch, m, k, n, seg, threads
    ):
        raise ValueError(f"no gathered product for {tuple(a.shape)} and rows {tuple(src.shape)}")
    return c


def small_gemm_pool_available(a: Tensor, b: Tensor) -> bool:
    """Whether ``small_gemm_pool`` serves ``a`` ``[W, K]`` and ``b`` ``[H, K, N]``: as
    ``small_gemm``, with even H and W and no gradient wanted."""
    return (
        b.dim() == 3
        and small_gemm_available(a, b)
        and b.shape[0] % 2 == 0
        and a.shape[0] % 2 == 0
        and not torch.is_grad_enabled()
    )


def small_gemm_pool(
    a: Tensor, b: Tensor, relu: bool, out: Tensor | None = None, index: Tensor | None = None
) -> Tensor:
    """``a @ b`` (``[H, W, N]``, a small ``a`` ``[W, K]``, ``b`` ``[H, K, N]``) 2x2
    max-pooled over (H, W), through a ReLU if ``relu``: ``[H/2, W/2, N]`` in their dtype
    (bfloat16 or float32, as ``small_gemm``), the full-resolution product never written (the
    inverse DFT's last GEMM and the pool after it). With ``out`` ``[rows, SEG]`` (the same
    dtype, SEG >= 32) and ``index`` ``[H/2 * W/2 * J]`` (N = J SEG): each pooled row's
    segments written to the rows of ``out`` that ``index`` names, ``out[index] =
    pooled.view(-1, SEG)`` (the scatter after the group convolution,
    ``GroupRSTConv.forward_pooled``); returns ``out``."""
    if not small_gemm_pool_available(a, b):
        raise ValueError(
            f"[W, K] @ [H, K, N] of a kernel's dtype with even H, W and K <= "
            f"{SMALL_GEMM_MAX_K} (even in bfloat16), no gradient, only: not {a.dtype} "
            f"{tuple(a.shape)} @ {b.dtype} {tuple(b.shape)}"
        )
    (w, k), (h, _, n) = a.shape, b.shape
    a, b = a.contiguous(), b.contiguous()
    threads = max(1, torch.get_num_threads())
    if out is None:
        out = b.new_empty(h // 2, w // 2, n)
        done = _gemm_kernel("small_gemm_pool", a)(
            a.data_ptr(), b.data_ptr(), out.data_ptr(), h, w, k, n, int(relu), threads
        )
    else:
        seg = out.shape[-1]
        index = index.to(torch.int64).contiguous()
        if (
            out.dtype != b.dtype
            or out.dim() != 2
            or not out.is_contiguous()
            or seg < 32
            or n % seg
            or index.numel() != (h // 2) * (w // 2) * (n // seg)
            or int(index.min()) < 0
            or int(index.max()) >= out.shape[0]
        ):
            raise ValueError(
                f"a contiguous {b.dtype} [rows, SEG >= 32] dividing {n} columns and "
                f"{(h // 2) * (w // 2)} x J row indices only, not {out.dtype} "
                f"{tuple(out.shape)} and {index.numel()} indices"
            )
        done = _gemm_kernel("small_gemm_pool_scatter", a)(
            a.data_ptr(),
            b.data_ptr(),
            out.data_ptr(),
            index.data_ptr(),
            h,
            w,
            k,
            n,
            seg,
            int(relu),
            threads,
        )
    if done:
        raise ValueError(f"no pooled product for {tuple(a.shape)} @ {tuple(b.shape)}")
    return out
