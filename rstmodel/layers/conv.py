"""The RST convolutions: lifting (image -> group features) and joint group convolution,
each with its reference (direct) path and fast paths, the expanded-filter cache and the
method choice (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..basis import BasisSpec, sample_basis, steering
from ..precision import products
from . import native
from .common import (
    ConvMethod,
    RotationTaps,
    _check_features,
    _time_path,
)
from .kernels import (
    _autocast_dtype,
    _compute_dtype,
    _copy_runs,
    _fft_rows,
    _GatherRows,
    _GaussProduct,
    _InverseRealDFT2,
    _pooled_mix_rows,
    _PooledMix,
    _RealDFT2,
    _ScatterRows,
    inverse_real_dft2_pooled,
    joined_complex_product,
    real_dft2_rows,
)
from .pooling import _check_even
from .triton_ops import complex_mix, pooled_mix, pooled_mix_fits, use_triton

__all__ = ["LiftingRSTConv", "GroupRSTConv", "RSTPointwise"]

# The FFT path's per-frequency products with at most this many rows (one image, its four
# quarter turns) take the joined four-product form (``joined_complex_product``), which reads
# two filter spectra instead of the Gauss form's three: at batch 1 on a 2-core CPU 25 % less
# time in float32 and 15 % in bfloat16; from 8 rows on the Gauss form wins in bfloat16
# (BENCHMARKS.md, "Issue 13, eleventh session").
JOINED_PRODUCT_ROWS = 4


class _BasisConv(nn.Module):
    """Shared machinery: coefficients, the sampled basis buffer, the eval-mode cache."""

    def __init__(self, spec: BasisSpec, weight_shape: tuple[int, ...], bias: bool, fan_in: int):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(*weight_shape))  # [..., K]
        self.bias = nn.Parameter(torch.zeros(weight_shape[0])) if bias else None
        basis = torch.from_numpy(sample_basis(spec).copy()).float()
        self.register_buffer("basis", basis, persistent=False)  # [K, R, S, k, k]
        # Unit-variance responses for unit-variance inputs: Var(sum a * <basis, x>) ~ 1.
        energy = basis[:, 0, 0].pow(2).sum(dim=(-2, -1)).mean().item()
        nn.init.normal_(self.weight, std=math.sqrt(2.0 / (fan_in * energy)))
        self._cache: dict[str, tuple] = {}
        self._spectra: dict[tuple, Tensor] = {}  # FFT path: basis spectra per grid
        self._tuned: dict[tuple, ConvMethod] = {}  # TUNED: fastest path per input shape
        self._register_load_state_dict_pre_hook(lambda *args, **kwargs: self._cache.clear())

    def train(self, mode: bool = True):
        self._cache.clear()
        return super().train(mode)

    def _apply(self, fn, recurse: bool = True):
        # Casts and moves rebuild the basis from its float64 source, so a float64 model
        # holds the float64 basis rather than a widened float32 one.
        out = super()._apply(fn, recurse)
        exact = torch.from_numpy(sample_basis(self.spec).copy())
        self.basis = exact.to(device=self.basis.device, dtype=self.basis.dtype)
        self._cache.clear()
        self._spectra.clear()
        return out

    def _wants_grad(self, x: Tensor | None = None) -> bool:
        """Whether a call now records a gradient: grad mode on and ``x`` or a parameter
        requiring one (the fused and compiled eval paths keep none)."""
        wanted = (x is not None and x.requires_grad) or any(
            p.requires_grad for p in self.parameters()
        )
        return torch.is_grad_enabled() and wanted

    def _cached(self, name: str, build):
        """``build()`` in training; in eval, reuse until the parameters change. The key
        holds the version counter (optimiser steps, in-place ops) and a copy of the
        coefficients, compared on use, for edits through ``.data`` that bypass it. Entries
        are kept per autocast state: under autocast ``build()`` gives lower-precision
        tensors, which a later float32 call must not reuse."""
        if self.training or torch.is_grad_enabled() and self.weight.requires_grad:
            return build()
        autocast = _autocast_dtype(self.weight.device)
        if autocast is not None:
            name = f"{name}@{autocast}"
        key = (self.weight._version, self.weight.data_ptr(), self.weight.dtype, self.weight.device)
        hit = self._cache.get(name)
        if hit is None or hit[0] != key or not torch.equal(hit[1], self.weight):
            hit = (key, self.weight.detach().clone(), build())
            self._cache[name] = hit
        return hit[2]

    def _fastest(self, x: Tensor, paths: dict[ConvMethod, Callable[[Tensor], Tensor]]):
        """TUNED in eval mode: the path that ran ``x`` fastest (each timed once after a
        warm-up call that fills its caches), remembered per input shape, dtype, device and
        autocast state (bfloat16 autocast can make another path the fastest)."""
        key = (tuple(x.shape), x.dtype, x.device, _autocast_dtype(x.device), products())
        choice = self._tuned.get(key)
        if choice is None:
            with torch.no_grad():
                times = {method: _time_path(path, x) for method, path in paths.items()}
            choice = self._tuned[key] = min(times, key=times.get)
        return choice

    def resolve_method(self, x: Tensor | None = None) -> ConvMethod | None:
        """The one method resolver: the path a call on ``x`` takes. A fixed ``method`` as
        given; AUTO, and TUNED while training, the cheapest by multiply-adds
        (``choose_method``); TUNED in eval mode None: the caller times its paths on ``x``
        (``_fastest``)."""
        if self.method is ConvMethod.TUNED and not self.training:
            return None
        if self.method in (ConvMethod.AUTO, ConvMethod.TUNED):
            return self._cheapest(x)
        return self.method

    def _cheapest(self, x: Tensor | None) -> ConvMethod:
        raise NotImplementedError

    def _add_bias(self, y: Tensor) -> Tensor:
        if self.bias is None:
            return y
        return y + self.bias.view(1, -1, 1, 1, 1, 1)

    def _window(self, s: int) -> slice:
        k = self.spec.kernel_size
        ks = self.spec.kernel_sizes[s]
        lo = (k - ks) // 2
        return slice(lo, lo + ks)

    @property
    def taps(self) -> int:
        """Input planes read per input channel and output (r, s): 1, or L_theta L_alpha."""
        return 1

    def windowed_basis(self, s: int) -> Tensor:
        """The basis at scale ``s`` cut to that scale's kernel: ``[K, R, ks, ks]``."""
        w = self._window(s)
        return self.basis[:, :, s, w, w]

    def form_costs(self, s: int) -> dict[ConvMethod, int]:
        """Multiply-adds per output pixel and group element of the two static forms of
        scale ``s``: DIRECT (the expanded filters, ``Cin T Cout ks^2``) and BASIS (a conv with
        the K basis functions, then a 1x1 mixing, ``Cin T K (ks^2 + Cout)``). The one count
        behind the eager AUTO choice (summed over scales) and ``static_form``."""
        ks2 = self.spec.kernel_sizes[s] ** 2
        cin, cout, nk = self.in_channels * self.taps, self.out_channels, self.spec.num_funcs
        return {ConvMethod.DIRECT: cin * cout * ks2, ConvMethod.BASIS: cin * nk * (ks2 + cout)}

    def static_form(self, s: int) -> ConvMethod:
        """DIRECT or BASIS for scale ``s`` of a static (exported) graph: the one with fewer
        multiply-adds (``form_costs``; DIRECT on a tie), which onnxruntime measured fastest
        (``python -m export.forms_bench``)."""
        costs = self.form_costs(s)
        return (
            ConvMethod.DIRECT
            if costs[ConvMethod.DIRECT] <= costs[ConvMethod.BASIS]
            else ConvMethod.BASIS
        )


class LiftingRSTConv(_BasisConv):
    """Z2 -> RST lifting convolution (eq. 4).  x [B, Cin, H, W] -> [B, Cout, R, S, H, W].

    ``method``: AUTO (the cheaper by multiply-adds), DIRECT, or BASIS (FFT means BASIS)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        spec: BasisSpec,
        *,
        bias: bool = True,
        method: ConvMethod = ConvMethod.AUTO,
    ):
        if in_channels < 1 or out_channels < 1:
            raise ValueError("in_channels and out_channels must be positive")
        super().__init__(spec, (out_channels, in_channels, spec.num_funcs), bias, in_channels)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.method = ConvMethod(method)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, {self.spec.family.value}, "
            f"K={self.spec.num_funcs}, R={self.spec.rotations}, S={self.spec.num_scales}, "
            f"kernels={self.spec.kernel_sizes}, method={self.method.value}"
        )

    def filters(self) -> Tensor:
        """Expanded filters ``[Cout, R, S, Cin, k, k]``."""
        # [Cout, Cin, K] x [K, R, S, k, k] -> [Cout, R, S, Cin, k, k]
        return torch.einsum("oik,krsxy->orsixy", self.weight, self.basis)

    def _check_images(self, x: Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"LiftingRSTConv expects images [B, {self.in_channels}, H, W], "
                f"got shape {tuple(x.shape)}"
            )

    def forward(self, x: Tensor) -> Tensor:
        self._check_images(x)
        method = self.resolve_method(x)
        if method is None:
            paths = {ConvMethod.DIRECT: self.forward_direct, ConvMethod.BASIS: self.forward_basis}
            method = self._fastest(x, paths)
        if method is ConvMethod.DIRECT:
            return self._add_bias(self.forward_direct(x))
        return self.forward_basis(x, bias=self.bias)

    def _cheapest(self, x: Tensor | None) -> ConvMethod:
        return self.choose_method()

    def choose_method(self) -> ConvMethod:
        """DIRECT when Cout R kernels cost fewer multiply-adds than K R basis kernels plus
        the mixing (few output channels), else BASIS (``form_costs`` over all scales)."""
        costs = [self.form_costs(s) for s in range(self.spec.num_scales)]
        direct = sum(c[ConvMethod.DIRECT] for c in costs)
        basis = sum(c[ConvMethod.BASIS] for c in costs)
        return ConvMethod.DIRECT if direct < basis else ConvMethod.BASIS

    def expanded(self, s: int) -> Tensor:
        """The filters of scale ``s`` for every rotation: ``[R, Cout, Cin, ks, ks]``."""
        # [Cout, Cin, K] x [K, R, ks, ks] -> [R, Cout, Cin, ks, ks]
        return torch.einsum("oik,krxy->roixy", self.weight, self.windowed_basis(s))

    def conv_weights(self) -> list[Tensor]:
        """Per scale s, the conv2d weight ``[Cout*R, Cin, ks, ks]`` (its own kernel size)."""
        return [self.expanded(s).transpose(0, 1).flatten(0, 1) for s in range(self.spec.num_scales)]

    def forward_direct(self, x: Tensor) -> Tensor:
        """Reference: one conv2d per scale with every rotated filter stacked on Cout."""
        return self._direct(x, self._cached("direct", self.conv_weights))

    def _direct(self, x: Tensor, weights: list[Tensor]) -> Tensor:
        shape = (self.out_channels, self.spec.rotations)
        # per scale: [B, Cout*R, H, W] -> [B, Cout, R, H, W]
        ys = [F.conv2d(x, w, padding=w.shape[-1] // 2).unflatten(1, shape) for w in weights]
        return torch.stack(ys, dim=3)  # [B, Cout, R, S, H, W]

    def forward_basis(self, x: Tensor, *, bias: Tensor | None = None) -> Tensor:
        """Convolve each input channel with the K R basis copies, then mix the K responses
        into Cout channels with one GEMM (cost ~ K R k^2 + Cout K per pixel and scale instead
        of Cout R k^2), which also adds ``bias`` [Cout] if given. The result is spatial-major
        (see ``is_spatial_major``): the mixing GEMM writes it in that layout directly, and the
        pooling and FFT convolutions that follow want it. x [B, Cin, H, W] -> [B, Cout, R, S,
        H, W]."""
        resp = self._responses(x)  # [H, W, R, S, B, Cin*K]
        c, nk = self.in_channels, self.spec.num_funcs
        a = self.weight.reshape(self.out_channels, c * nk)  # [Cout, Cin*K]
        resp2d = resp.view(-1, c * nk)
        # [H*W*R*S*B, Cout]
        y = resp2d @ a.t() if bias is None else torch.addmm(bias, resp2d, a.t())
        return y.view(*resp.shape[:-1], self.out_channels).permute(4, 5, 2, 3, 0, 1)

    def _responses(self, x: Tensor, rotations: int | None = None) -> Tensor:
        """Responses to the K R S basis copies, spatial-major ``[H, W, R, S, B, Cin*K]``
        (``rotations``: to those of the first ones only, R = ``rotations``).
        The convolutions run channels-last with the basis copies ordered (r, k), so each
        output pixel holds runs of K values that one copy per scale moves into place (the
        channels-first output had K R H W strides between them: 2.6x slower at batch 128)."""
        b, c, h, wd = x.shape
        rot = self.spec.rotations if rotations is None else rotations
        nk, nsc = self.spec.num_funcs, self.spec.num_scales
        # .to, not .contiguous: with one channel both layouts count as contiguous and
        # .contiguous keeps the strides that make the convolution answer channels-first
        xl = x.to(memory_format=torch.channels_last)
        out = None
        for s in range(nsc):
            w = self._window(s)
            ws = self.basis[:, :rot, s, w, w].transpose(0, 1).flatten(0, 1)  # [R*K, ks, ks]
            ws = ws.unsqueeze(1).repeat(c, 1, 1, 1)  # [Cin*R*K, 1, ks, ks], rows (c, r, k)
            ws = ws.to(memory_format=torch.channels_last)
            y = F.conv2d(xl, ws, padding=ws.shape[-1] // 2, groups=c)  # memory (b, h, w, c, r, k)
            y = y.permute(0, 2, 3, 1).reshape(b, h, wd, c, rot, nk)
            if out is None:
                out = y.new_empty(h, wd, rot, nsc, b, c, nk)
            _copy_runs(out[:, :, :, s], y.permute(1, 2, 4, 0, 3, 5))  # [H, W, R, B, Cin, K]
        return out.view(h, wd, rot, nsc, b, c * nk)

    def pools_fused(self, x: Tensor | None = None) -> bool:
        """Whether ``forward_pooled`` applies: the call would take the basis path (AUTO or
        BASIS; TUNED in eval mode times the unfused paths instead). ``x``: unused (the
        choice does not depend on it), as ``GroupRSTConv.pools_fused`` takes it."""
        return self.resolve_method() is ConvMethod.BASIS

    def forward_pooled(self, x: Tensor, *, relu: bool) -> Tensor:
        """``RSTMaxPool(relu)(forward(x))`` on the basis path, without storing the
        full-resolution map or its gradient (at batch 128 in ``rst_cnn_fb`` a 3.5 GB map):
        the mixing GEMM runs a few windows of two image rows at a time (``MIX_CHUNK_ROWS``)
        and pools them at once. On the CPU without a gradient, where the basis is steerable
        (``basis.steering``: each rotated copy a fixed combination M_r of the upright K),
        the convolutions run the K upright copies only, an R-th of their multiply-adds
        and of the responses' memory, and the compiled pooled mixing takes the weights
        ``a M_r`` for rotation r (the same sums up to round-off: the basis itself holds
        ``M_r`` to 1e-10 of its largest sample).
        x [B, Cin, H, W] -> [B, Cout, R, S, H/2, W/2]."""
        self._check_images(x)
        b, _, h, w = x.shape
        _check_even(h, w)
        rot, nsc, cout = self.spec.rotations, self.spec.num_scales, self.out_channels
        a = self.weight.reshape(cout, -1)  # [Cout, Cin*K]
        steer = self._steered_weights()
        if steer is not None:  # compiled, CPU: one pass over the upright responses
            resp = self._responses(x, rotations=1).view(h, -1, a.shape[1])
            if native.pooled_mix_available(resp, steer, self.bias):
                y = native.pooled_mix(resp, steer, self.bias, relu, w)
                return y.view(h // 2, w // 2, rot, nsc, b, cout).permute(4, 5, 2, 3, 0, 1)
        resp = self._responses(x).view(h, -1, a.shape[1])  # [H, W*R*S*B, Cin*K]
        if use_triton(resp) and not resp.requires_grad and pooled_mix_fits(resp):
            y = pooled_mix(resp, a, self.bias, relu, w)  # one kernel each way
        elif native.pooled_mix_available(resp, a, self.bias):  # compiled, CPU: one pass
            y = native.pooled_mix(resp, a, self.bias, relu, w)
        elif torch.is_grad_enabled():
            y = _PooledMix.apply(resp, a, self.bias, relu, w)
        else:  # no backward to come: no argmax to keep (the weights still require grad)
            y, _ = _pooled_mix_rows(resp, a, self.bias, relu, w, argmax=False)
        return y.view(h // 2, w // 2, rot, nsc, b, cout).permute(4, 5, 2, 3, 0, 1)

    def _steered_weights(self) -> Tensor | None:
        """``a M_r`` for every rotation r, ``[R, Cout, Cin*K]`` (``forward_pooled``), where
        the basis is steerable and the compiled kernel may serve (CPU, no gradient); else
        None."""
        if (
            self.weight.device.type != "cpu"
            or self._wants_grad()
            or not native.pooled_mix_available(self.weight[:0])
        ):
            return None
        return self._cached("steered", self._build_steered)

    def _build_steered(self) -> Tensor | None:
        mats = steering(self.spec)
        if mats is None:
            return None
        m = torch.tensor(mats, dtype=self.weight.dtype)  # [R, K, K]
        # a_r[o, c, j] = sum_k a[o, c, k] M_r[k, j]: rotation r's response to mode k is
        # sum_j M_r[k, j] times the upright response to mode j
        steered = torch.einsum("ock,rkj->rocj", self.weight.detach(), m)
        return steered.reshape(m.shape[0], self.out_channels, -1)


class GroupRSTConv(_BasisConv):
    """Joint RST group convolution (eq. 5).  x [B, Cin, R, S, H, W] -> [B, Cout, R, S, H, W].

    ``rotation_taps`` = L_theta (must divide R for COARSE taps), ``scale_taps`` = L_alpha.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        spec: BasisSpec,
        *,
        rotation_taps: int = 1,
        scale_taps: int = 1,
        tap_mode: RotationTaps = RotationTaps.COARSE,
        bias: bool = True,
        method: ConvMethod = ConvMethod.AUTO,
    ):
        if in_channels < 1 or out_channels < 1:
            raise ValueError("in_channels and out_channels must be positive")
        rot = spec.rotations
        tap_mode = RotationTaps(tap_mode)
        if not 1 <= rotation_taps <= rot:
            raise ValueError(
                f"rotation_taps (L_theta) must be in [1, Nr={rot}], got {rotation_taps}"
            )
        if tap_mode is RotationTaps.COARSE and rot % rotation_taps:
            raise ValueError(
                f"rotation_taps (L_theta={rotation_taps}) must divide Nr={rot} for the paper's "
                "coarse rotation grid; pick a divisor or tap_mode='adjacent'"
            )
        if not 1 <= scale_taps <= spec.num_scales:
            raise ValueError(
                f"scale_taps (L_alpha) must be in [1, Ns={spec.num_scales}], got {scale_taps}"
            )
        taps = rotation_taps * scale_taps
        super().__init__(
            spec, (out_channels, in_channels, taps, spec.num_funcs), bias, in_channels * taps
        )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.rotation_taps = rotation_taps
        self.scale_taps = scale_taps
        self.tap_mode = tap_mode
        self.method = ConvMethod(method)
        step = rot // rotation_taps if tap_mode is RotationTaps.COARSE else 1
        # index[t, r] = rotation read by output rotation r through rotation tap t
        rshift = torch.arange(rotation_taps) * step
        self.register_buffer(
            "rot_index", (torch.arange(rot)[None] + rshift[:, None]) % rot, persistent=False
        )

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, {self.spec.family.value}, "
            f"K={self.spec.num_funcs}, R={self.spec.rotations}, S={self.spec.num_scales}, "
            f"L_theta={self.rotation_taps} ({self.tap_mode.value}), L_alpha={self.scale_taps}, "
            f"kernels={self.spec.kernel_sizes}, method={self.method.value}"
        )

    @property
    def taps(self) -> int:
        return self.rotation_taps * self.scale_taps

    def filters(self) -> Tensor:
        """Expanded filters ``[Cout, R, S, Cin, T, k, k]``, T = (L_theta, L_alpha) flattened."""
        # [Cout, Cin, T, K] x [K, R, S, k, k] -> [Cout, R, S, Cin, T, k, k]
        return torch.einsum("oitk,krsxy->orsitxy", self.weight, self.basis)

    def gather_taps(self, x: Tensor) -> Tensor:
        """``[B, C, R, S, ...] -> [B, C, T, R, S, ...]``: what each tap reads at each (r, s)."""
        nsc = self.spec.num_scales
        xr = x[:, :, self.rot_index]  # [B, C, Lt, R, S, ...]
        if self.scale_taps > 1:
            pad = torch.zeros_like(xr[:, :, :, :, : self.scale_taps - 1])
            xr = torch.cat([xr, pad], dim=4)  # zeros past the largest scale
            xr = torch.stack(
                [xr[:, :, :, :, la : la + nsc] for la in range(self.scale_taps)], dim=3
            )
        else:
            xr = xr.unsqueeze(3)  # [B, C, Lt, La=1, R, S, ...]
        return xr.flatten(2, 3)  # [B, C, T, R, S, ...], T = Lt * La

    def forward(self, x: Tensor) -> Tensor:
        _check_features(
            x, self.in_channels, self.spec.rotations, self.spec.num_scales, "GroupRSTConv"
        )
        method = self.resolve_method(x)
        if method is None:
            paths = {
                ConvMethod.DIRECT: self.forward_direct,
                ConvMethod.BASIS: self.forward_basis,
                ConvMethod.FFT: self.forward_fft,
            }
            allowed = self.method_costs(x.shape[0], x.shape[-2], x.shape[-1])
            method = self._fastest(x, {m: paths[m] for m in allowed})
        if method is ConvMethod.DIRECT:
            return self._add_bias(self.forward_direct(x))
        if method is ConvMethod.BASIS:
            return self._add_bias(self.forward_basis(x))
        return self.forward_fft(x, bias=self.bias)

    def _cheapest(self, x: Tensor | None) -> ConvMethod:
        if x is None:
            raise ValueError("GroupRSTConv's cheapest path depends on the input's shape")
        return self.choose_method(x.shape[0], x.shape[-2], x.shape[-1])

    def choose_method(self, batch: int, h: int, w: int) -> ConvMethod:
        """The cheapest path by multiply-adds (``method_costs``)."""
        costs = self.method_costs(batch, h, w)
        return min(costs, key=costs.get)

    def method_costs(self, batch: int, h: int, w: int) -> dict[ConvMethod, float]:
        """Multiply-adds of each path this call may take (all three run as GEMMs or convolutions).
        FFT does 3 real products per complex one and also pays for its filter spectra
        (3 Cin Cout R nh Fw floats per scale whatever the batch, a quarter of that when
        ``quarter_turns`` shares them); it is refused while they outweigh both 2 GiB and the
        batch's spectra. BASIS keeps K responses per input channel, so it serves eval only."""
        rot, nsc, nk = self.spec.rotations, self.spec.num_scales, self.spec.num_funcs
        cit, cout = self.in_channels * self.taps, self.out_channels
        static = [self.form_costs(s) for s in range(nsc)]
        costs = {ConvMethod.DIRECT: batch * h * w * rot * sum(c[ConvMethod.DIRECT] for c in static)}
        maps = batch * rot  # per scale
        freqs = dfts = 0
        for first, end, nh, nw in self.scale_blocks(h, w):
            fw, scales = nw // 2 + 1, end - first
            freqs += rot * scales * nh * fw
            dfts += maps * scales * self.in_channels * 2 * fw * h * (w + 2 * nh)
            dfts += maps * scales * cout * 2 * h * fw * (2 * nh + w)
        filters = freqs // self.quarter_turns(h, w)  # distinct filter spectra
        if filters * cit * cout * 12 <= max(2**31, batch * (cit + cout) * freqs * 8):
            build = 2 * nk * filters * cit * cout if self.training else 0
            costs[ConvMethod.FFT] = 3 * batch * freqs * cit * cout + dfts + build
        if not self.training:
            # depthwise convolutions run at about a third of a dense one's rate
            costs[ConvMethod.BASIS] = (
                3 * batch * h * w * rot * sum(c[ConvMethod.BASIS] for c in static)
            )
        return costs

    def expanded(self, s: int) -> Tensor:
        """The filters of scale ``s`` for every output rotation: ``[R, Cout, T, Cin, ks, ks]``
        (tap t reads the planes ``gather_taps`` gives it)."""
        # [Cout, Cin, T, K] x [K, R, ks, ks] -> [R, Cout, T, Cin, ks, ks]
        return torch.einsum("oitk,krxy->rotixy", self.weight, self.windowed_basis(s))

    def conv_weights(self) -> list[list[Tensor]]:
        """Per scale s and tap t, the conv2d weight ``[R*Cout, Cin, ks, ks]`` (groups = R)."""
        return [
            list(self.expanded(s).permute(2, 0, 1, 3, 4, 5).flatten(1, 2).unbind(0))
            for s in range(self.spec.num_scales)
        ]

    def forward_direct(self, x: Tensor) -> Tensor:
        """Reference: per scale and tap, one conv2d with groups = R (a conv per tap rather
        than one over Cin*T stacked channels: oneDNN's weight gradient collapses for large
        per-group input counts)."""
        return self._direct(x, self._cached("direct", self.conv_weights))

    def _direct(self, x: Tensor, weights: list[list[Tensor]]) -> Tensor:
        rot = self.spec.rotations
        xt = self.gather_taps(x)  # [B, Cin, T, R, S, H, W]
        out = []
        for s, ws in enumerate(weights):
            y = 0
            for t, wt in enumerate(ws):
                xs = xt[:, :, t, :, s].transpose(1, 2).flatten(1, 2)  # [B, R*Cin, H, W]
                y = y + F.conv2d(xs, wt, padding=wt.shape[-1] // 2, groups=rot)  # [B, R*Cout, H, W]
            out.append(y.unflatten(1, (rot, self.out_channels)).transpose(1, 2))
        return torch.stack(out, dim=3)  # [B, Cout, R, S, H, W]

    def forward_basis(self, x: Tensor) -> Tensor:
        """Convolve every (input channel, tap) plane with the K basis copies of its output
        rotation and scale (depthwise), then mix the K responses into Cout channels (a 1x1
        conv shared by the rotations): cost ~ Cin T K (k^2 + Cout) per pixel instead of
        Cin T Cout k^2, at K times the input's memory.
        x [B, Cin, R, S, H, W] -> [B, Cout, R, S, H, W]."""
        weights = self._cached("basis", self.basis_weights)
        return self._basis(x, weights)

    def basis_weights(self) -> tuple[list[Tensor], Tensor]:
        """Depthwise basis filters per scale ``[R*Cin*T*K, 1, ks, ks]`` and the mixing
        weight ``[R*Cout, Cin*T*K, 1, 1]`` (groups = R)."""
        rot, groups = self.spec.rotations, self.in_channels * self.taps
        depthwise = []
        for s in range(self.spec.num_scales):
            basis = self.windowed_basis(s).transpose(0, 1)  # [R, K, ks, ks]
            basis = basis[:, None].expand(rot, groups, *basis.shape[1:])  # [R, Cin*T, K, ks, ks]
            depthwise.append(basis.reshape(-1, 1, *basis.shape[-2:]))
        mix = self.weight.reshape(self.out_channels, -1, 1, 1).repeat(rot, 1, 1, 1)
        return depthwise, mix

    def _basis(self, x: Tensor, weights: tuple[list[Tensor], Tensor]) -> Tensor:
        depthwise, mix = weights
        rot, cout = self.spec.rotations, self.out_channels
        xt = self.gather_taps(x)  # [B, Cin, T, R, S, H, W]
        out = []
        for s, filt in enumerate(depthwise):
            xs = xt[:, :, :, :, s].permute(0, 3, 1, 2, 4, 5).flatten(1, 3)  # [B, R*Cin*T, H, W]
            resp = F.conv2d(xs, filt, padding=filt.shape[-1] // 2, groups=xs.shape[1])
            y = F.conv2d(resp, mix, groups=rot)  # [B, R*Cout, H, W]
            out.append(y.unflatten(1, (rot, cout)).transpose(1, 2))
        return torch.stack(out, dim=3)  # [B, Cout, R, S, H, W]

    def _basis_spectrum(self, nh: int, nw: int, rotations: int, scales: range) -> Tensor:
        """Basis spectra for a 'same' cross-correlation on an nh x nw periodic grid, for the
        first ``rotations`` rotations and the given scales, each cut to its kernel: real
        ``[3, nh*Fw*rotations*S', K]`` (real part, imaginary minus real, real plus imaginary:
        the three products of ``forward_fft``), Fw = nw//2 + 1, rows ordered (n, f, r, s)."""
        key = (nh, nw, rotations, scales, str(self.weight.device), self.weight.dtype)
        spec = self._spectra.get(key)
        if spec is None:
            basis = torch.from_numpy(sample_basis(self.spec)[:, :rotations].copy())
            placed = torch.zeros(*basis.shape[:2], len(scales), nh, nw, dtype=torch.float64)
            for i, s in enumerate(scales):
                ks, win = self.spec.kernel_sizes[s], self._window(s)
                # the tap at offset m (rows, cols) from the kernel centre goes to index m mod n
                placed[:, :, i, :ks, :ks] = basis[:, :, s, win, win]
                placed[:, :, i] = torch.roll(placed[:, :, i], (-(ks // 2), -(ks // 2)), (-2, -1))
            # correlation: Y = X conj(G)
            g = torch.fft.rfft2(placed).conj()  # [K, R, S', nh, Fw]
            g = g.permute(3, 4, 1, 2, 0).reshape(-1, g.shape[0])  # [nh*Fw*R*S', K]
            spec = torch.stack([g.real, g.imag - g.real, g.real + g.imag]).to(
                device=self.weight.device, dtype=self.weight.dtype
            )
            self._spectra[key] = spec
        return spec

    def spectra(
        self,
        nh: int,
        nw: int,
        rotations: int | None = None,
        scales: range | None = None,
        *,
        gauss: bool = True,
    ) -> tuple[Tensor, ...]:
        """Filter spectra G of the first ``rotations`` rotations (default all R) and the
        given scales (default all) as (Re G, Im G - Re G, Re G + Im G) for ``_GaussProduct``,
        or (Re G, Im G) with ``gauss=False`` (``complex_mix``), each ``[nh*Fw*rotations*S',
        Cin*T, Cout]``."""
        rotations = self.spec.rotations if rotations is None else rotations
        scales = range(self.spec.num_scales) if scales is None else scales
        basis_spec = self._basis_spectrum(nh, nw, rotations, scales)  # [3, NFRS, K]
        if not gauss:
            basis_spec = torch.stack([basis_spec[0], basis_spec[1] + basis_spec[0]])
        a = self.weight.permute(3, 1, 2, 0).reshape(self.spec.num_funcs, -1)  # [K, Cin*T*Cout]
        shape = (basis_spec.shape[1], self.in_channels * self.taps, self.out_channels)
        return tuple((part @ a).view(shape) for part in basis_spec)

    def _float_spectra(self, *args) -> tuple[Tensor, Tensor]:
        """``spectra(*args, gauss=False)`` computed in float32 even under autocast, for
        kernels that round them once into their own layout."""
        with torch.autocast(self.weight.device.type, enabled=False):
            return self.spectra(*args, gauss=False)

    def quarter_turns(self, h: int, w: int) -> int:
        """4 when the FFT path can share each filter spectrum between output rotations a
        quarter turn apart, else 1. The sampled basis turns exactly by 90 degrees every R/4
        rotation indices, so for a square map y_{p + qR/4} = rot90^q(x_{p + qR/4}
        turned back q quarter turns, correlated with the filter of rotation p): the four
        turned copies become four times the batch of one GEMM per frequency, with a quarter
        of the filter spectra (memory, and the reads that bound small batches). Needs one
        rotation tap (taps would read other quarters), R divisible by 4 and H = W."""
        rot = self.spec.rotations
        return 4 if self.rotation_taps == 1 and rot % 4 == 0 and h == w else 1

    def pools_fused(self, x: Tensor) -> bool:
        """Whether ``forward_pooled`` applies to ``x``: the call takes the FFT path, no
        gradient is wanted (the fused pool keeps no argmax) and the maps have even sides."""
        h, w = x.shape[-2:]
        return (
            not self._wants_grad(x)
            and h % 2 == 0
            and w % 2 == 0
            and self.resolve_method(x) is ConvMethod.FFT
        )

    def forward_pooled(self, x: Tensor, *, relu: bool) -> Tensor:
        """``RSTMaxPool(relu)(forward(x))`` on the FFT path, without a gradient: each block
        of scales is pooled in its own rows, where maps are turned back by quarter turns
        (a 2x2 window of an even-sided map turns into a 2x2 window), so only the pooled
        quarter of the map is scattered back to the feature layout.
        x [B, Cin, R, S, H, W] -> [B, Cout, R, S, H/2, W/2]."""
        _check_even(*x.shape[-2:])
        return self.forward_fft(x, bias=self.bias, pool_relu=relu)

    def forward_fft(
        self,
        x: Tensor,
        *,
        share_quarter_turns: bool = True,
        bias: Tensor | None = None,
        pool_relu: bool | None = None,
    ) -> Tensor:
        """Per-frequency channel mixing, cost independent of the kernel size. The 2D DFTs
        are matrix products (GEMMs beat FFTs at these sizes) on the spatial-major memory
        layout ``[H, W, R, S, B, C]``, where the frequency-wise channel mixing is a plain
        batched matmul over contiguous ``[B, C]`` blocks; the result keeps that layout
        (``spatial_major``). Each block of scales (``scale_blocks``) runs on the smallest
        periodic grid its kernels allow. ``share_quarter_turns``: use ``quarter_turns`` where
        it applies (False: one filter spectrum per rotation, the plain path it must equal).
        ``bias`` [Cout], if given, enters the spectrum at frequency (0, 0) (``_GaussProduct``).
        ``pool_relu`` True or False: each block's maps 2x2 max-pooled (then through a ReLU
        if True) before they go back to the feature layout (``forward_pooled``).
        x [B, Cin, R, S, H, W] -> [B, Cout, R, S, H, W] (H/2, W/2 pooled)."""
        b, cin, rot, nsc, h, w = x.shape
        quarters = self.quarter_turns(h, w) if share_quarter_turns else 1
        blocks = self.scale_blocks(h, w)
        xs = x.permute(4, 5, 2, 3, 0, 1).contiguous().view(-1, b * cin)  # rows (h, w, r, s)
        # each block's rows (h, w, p, s, q), map r = q R/4 + p turned back q quarter turns
        bounds = (*(first for first, *_ in blocks), nsc)
        rows = _fft_rows(h, w, rot, quarters, bounds, x.device)
        out = targets = None
        if rows is None:
            parts = [(xs, None)]
        elif self._wants_grad(x):
            parts = [(part, None) for part in _GatherRows.apply(xs, *rows)]
        else:  # no gradient: each block's DFT reads its rows where they lie (real_dft2_rows)
            xs = xs.to(_compute_dtype(xs))
            parts = [(xs, index) for index in rows]
            if pool_relu is not None:  # ... and its pooled maps go straight to their rows
                targets = _fft_rows(h // 2, w // 2, rot, quarters, bounds, x.device)
                out = xs.new_empty(h // 2 * (w // 2) * rot * nsc, b * self.out_channels)
        scatters = [None] * len(blocks) if out is None else [(out, t) for t in targets]
        ys = [
            self._fft_block(part, (h, w), block, quarters, bias, pool_relu, index, scatter)
            for (part, index), block, scatter in zip(parts, blocks, scatters, strict=True)
        ]
        if pool_relu is not None:  # pooled where the maps are turned back: see forward_pooled
            h, w = h // 2, w // 2
            rows = None if rows is None else _fft_rows(h, w, rot, quarters, bounds, x.device)
        # every map back to its rows (h, w, r, s), turned forward again
        y = out if out is not None else ys[0] if rows is None else _ScatterRows.apply(rows, *ys)
        return y.view(h, w, rot, nsc, b, self.out_channels).permute(4, 5, 2, 3, 0, 1)

    def _fft_block(
        self,
        xs: Tensor,
        size: tuple[int, int],
        block: tuple[int, int, int, int],
        quarters: int,
        bias: Tensor | None,
        pool_relu: bool | None = None,
        index: Tensor | None = None,
        scatter: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | None:
        """``forward_fft`` for the scales of one block: maps ``[rows (h, w, p, s, q),
        B*Cin] -> [the same rows, B*Cout]`` (``pool_relu``: rows (h/2, w/2, p, s, q));
        with ``index``, the block's rows are ``xs[index]`` (no gradient); with ``scatter``
        ``(out, targets)`` (pooled, no gradient) the pooled rows go to ``out[targets]``
        and nothing is returned."""
        (h, w), (first, end, nh, nw) = size, block
        fw, nsc, cin = nw // 2 + 1, end - first, self.in_channels
        filt_rot, bq = self.spec.rotations // quarters, xs.shape[1] // cin * quarters
        shape = (h, w, nh, nw)
        rows = xs.shape[0] if index is None else index.numel()
        if index is None:
            x_re, x_im = _RealDFT2.apply(xs.view(h, -1), shape)  # [nh, Fw, R'*S'*B'*Cin]
        else:
            x_re, x_im = real_dft2_rows(xs, index, shape)
        freqs = nh * fw * filt_rot * nsc
        shape6 = (nh, fw, filt_rot, nsc, bq, cin)
        x_re = self._gather_spectral_taps(x_re.view(shape6), quarters).view(freqs, bq, -1)
        x_im = self._gather_spectral_taps(x_im.view(shape6), quarters).view(freqs, bq, -1)
        # per frequency: [B', Cin*T] @ [Cin*T, Cout], complex; the bias enters at frequency
        # (0, 0), the first R'*S' rows
        dc = (bias, filt_rot * nsc, float(nh * nw))
        scales, name = range(first, end), f"{nh}x{nw}r{filt_rot}s{first}-{end}"
        if use_triton(x_re):  # one Triton kernel
            g = self._cached(
                "fftc" + name, lambda: self.spectra(nh, nw, filt_rot, scales, gauss=False)
            )
            y = complex_mix(x_re, x_im, *g, *dc)  # [Re; Im], [2, NFRS, B', Cout]
        elif native.word_rows_available(x_re, x_im):  # compiled, CPU int16 eval
            g = self._cached(
                "ffti16" + name,
                lambda: native.pack_words(*self._float_spectra(nh, nw, filt_rot, scales)),
            )
            y = native.word_rows_product(x_re, x_im, g, self.out_channels, *dc)
        elif native.available(x_re, x_im):  # compiled, CPU float32 eval
            g = self._cached(
                "fftp" + name,
                lambda: native.pack_joined(*self.spectra(nh, nw, filt_rot, scales, gauss=False)),
            )
            y = native.joined_rows_product(x_re, x_im, g, self.out_channels, *dc)
        elif native.quad_rows_available(x_re, x_im):  # compiled, CPU int8 eval
            g = self._cached(
                "ffti8" + name,
                lambda: native.pack_quads(*self._float_spectra(nh, nw, filt_rot, scales)),
            )
            y = native.quad_rows_product(x_re, x_im, g, self.out_channels, *dc)
        elif native.paired_available(x_re, x_im):  # compiled, CPU bfloat16 eval
            g = self._cached(
                "fftb" + name,
                lambda: native.pack_pairs(*self._float_spectra(nh, nw, filt_rot, scales)),
            )
            y = native.paired_rows_product(x_re, x_im, g, self.out_channels, *dc)
        elif bq <= JOINED_PRODUCT_ROWS:  # few rows: reading the spectra binds, two not three
            g = self._cached(
                "fftj" + name,
                lambda: torch.cat(self.spectra(nh, nw, filt_rot, scales, gauss=False), dim=2),
            )
            y = joined_complex_product(x_re, x_im, g, *dc)
        else:  # three real products
            g = self._cached("fft" + name, lambda: self.spectra(nh, nw, filt_rot, scales))
            y = _GaussProduct.apply(x_re, x_im, *g, *dc)
        if pool_relu is not None:  # no gradient: see forward_pooled
            if scatter is not None:
                inverse_real_dft2_pooled(y, shape, pool_relu, *scatter)
                return None
            return inverse_real_dft2_pooled(y, shape, pool_relu).view(rows // 4, -1)
        return _InverseRealDFT2.apply(y, shape).view(rows, -1)  # [H, W, R'*S'*B'*Cout]

    def scale_blocks(self, h: int, w: int) -> list[tuple[int, int, int, int]]:
        """``(first scale, end, nh, nw)`` of each block of scales that the FFT path runs on
        one nh x nw periodic grid: each scale on the smallest grid its own kernel allows
        (``_grid``; the mixing and the DFTs cost in proportion to the grid), scales of equal
        grids together. With L_alpha > 1 a tap reads the next scales' maps, whose spectra
        must then lie on its grid: all scales on the largest kernel's."""
        if self.scale_taps > 1:
            return [(0, self.spec.num_scales, *self._grid(h, w))]
        blocks: list[tuple[int, int, int, int]] = []
        for s, k in enumerate(self.spec.kernel_sizes):
            grid = self._grid(h, w, k)
            if blocks and blocks[-1][2:] == grid:
                blocks[-1] = (blocks[-1][0], s + 1, *grid)
            else:
                blocks.append((s, s + 1, *grid))
        return blocks

    def _grid(self, h: int, w: int, k: int | None = None) -> tuple[int, int]:
        """Periodic grid of the FFT path for a k x k kernel (default the largest scale's):
        no wrap-around into the first H x W outputs (n >= H + k//2) and room for the whole
        kernel (n >= k). Any size will do: the DFTs are GEMMs."""
        k = self.spec.kernel_size if k is None else k
        return max(h + k // 2, k), max(w + k // 2, k)

    def _gather_spectral_taps(self, xf: Tensor, quarters: int = 1) -> Tensor:
        """``[nh, Fw, R', S', B', C] -> [nh, Fw, R', S', B', C, T]`` (what each tap reads);
        with shared quarter turns R' = R/4 and the one rotation tap reads its own rotation."""
        if self.taps == 1:
            return xf.unsqueeze(-1)
        nsc = xf.shape[3]
        taps = []
        for idx in self.rot_index:
            xr = xf.index_select(2, idx) if quarters == 1 else xf
            if self.scale_taps > 1:
                xr = torch.cat([xr, torch.zeros_like(xr[:, :, :, : self.scale_taps - 1])], dim=3)
            taps += [xr[:, :, :, la : la + nsc] for la in range(self.scale_taps)]
        return torch.stack(taps, dim=-1)


class RSTPointwise(nn.Module):
    """Channel mixing shared by every (r, s): an equivariant 1x1 conv.
    x [B, Cin, R, S, H, W] -> [B, Cout, R, S, H, W]."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x.flatten(2, 3)).unflatten(2, x.shape[2:4])
