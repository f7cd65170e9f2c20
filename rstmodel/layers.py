"""RST layers (paper eq. 4-5, "Implementation Details"): lifting and joint group
convolutions, equivariant batch norm, pooling.

Feature maps are ``[B, C, R, S, H, W]`` (see ``rstmodel.group``). Filters are expanded from
trainable coefficients over a fixed sampled basis ``[K, R, S, k, k]`` (``rstmodel.basis``):

    lifting  x1(u, r, s, o) = sum_i  x0(., i)      * F1[o, i, r, s]              + b[o]
    joint    xl(u, r, s, o) = sum_{i, lt, la} x(., i, r + shift(lt), s + la) * Fl[o, i, lt, la, r, s] + b[o]

with ``F[..., r, s] = sum_k a[..., k] basis[k, r, s]`` and ``*`` the cross-correlation of
``torch.nn.functional.conv2d`` ('same' size, zero padding). Rotation taps are circular,
scale taps read zeros past the truncated scale range (the paper's boundary leakage).

Each convolution has a direct reference path (per-scale grouped ``conv2d``) and a fast
path; ``ConvMethod.AUTO`` picks the fast one and a test checks both agree. In eval mode the
expanded filters are cached, keyed on the parameters' version counters, so an optimiser
step, ``train()`` or ``load_state_dict`` never leaves a stale cache behind.
"""

from __future__ import annotations

import copy
import math
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from .basis import BasisSpec, sample_basis

__all__ = [
    "ConvMethod",
    "RotationTaps",
    "LiftingRSTConv",
    "GroupRSTConv",
    "RSTBatchNorm",
    "RSTMaxPool",
    "GroupMaxPool",
    "plain_module",
    "plain_copy",
    "fft_size",
]


class ConvMethod(str, Enum):
    AUTO = "auto"
    DIRECT = "direct"  # reference: per-scale grouped conv2d
    FFT = "fft"  # joint conv: per-frequency channel mixing (kernel-size independent)
    BASIS = "basis"  # lifting: convolve with the basis, then mix (K << channels * R)


class RotationTaps(str, Enum):
    COARSE = "coarse"  # paper: taps on a grid of L_theta points, shift l * Nr / L_theta
    ADJACENT = "adjacent"  # public code: L_theta neighbouring rotations, shift l


def fft_size(n: int) -> int:
    """Smallest 2-3-5-7-smooth integer >= n (fast FFT lengths)."""
    m = n
    while True:
        k = m
        for p in (2, 3, 5, 7):
            while k % p == 0:
                k //= p
        if k == 1:
            return m
        m += 1


class _Frozen(nn.Module):
    """Tracing scaffold for ``plain_module``; never part of an exported module."""

    def __init__(self, forward, tensors: dict[str, Tensor]):
        super().__init__()
        self._forward = forward
        for key, value in tensors.items():
            self.register_buffer(key, value.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(self, x)


def plain_module(forward, tensors: dict[str, Tensor], name: str) -> fx.GraphModule:
    """A ``torch.fx.GraphModule`` (plain torch, no rstmodel class) computing
    ``forward(root, x)``, with ``tensors`` frozen as buffers."""
    root = _Frozen(forward, tensors)
    graph = fx.Tracer().trace(root)
    return fx.GraphModule(root, graph, class_name=name)


def plain_copy(model: nn.Module, entry: str = "forward") -> fx.GraphModule:
    """Eval-mode plain-torch copy of a model: every module with an ``export()`` is replaced
    by its export, and the rest is traced into one ``torch.fx.GraphModule`` calling
    ``model.<entry>(x)``. The source model is not touched."""
    net = copy.deepcopy(model).eval()

    def swap(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, _EXPORTABLE):
                setattr(parent, name, child.export())
            else:
                swap(child)

    swap(net)
    root = _Frozen(lambda m, x: getattr(m.net, entry)(x), {})
    root.net = net
    graph = fx.Tracer().trace(root)
    return fx.GraphModule(root, graph, class_name=f"Exported{type(model).__name__}").eval()


def _check_features(x: Tensor, channels: int, rotations: int, scales: int, name: str) -> None:
    expected = f"[B, {channels}, {rotations}, {scales}, H, W]"
    if x.dim() != 6 or tuple(x.shape[1:4]) != (channels, rotations, scales):
        raise ValueError(f"{name} expects a feature map {expected}, got shape {tuple(x.shape)}")


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
        self._cache: dict[str, tuple[tuple, Tensor]] = {}
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
        if hasattr(self, "_spectra"):
            self._spectra.clear()
        return out

    def _cached(self, name: str, build) -> Tensor:
        """``build()`` in training; in eval, reuse until the parameters change."""
        if self.training or torch.is_grad_enabled() and self.weight.requires_grad:
            return build()
        key = (
            self.weight._version,
            self.weight.data_ptr(),
            self.basis.data_ptr(),
            self.weight.dtype,
            self.weight.device,
        )
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            hit = (key, build())
            self._cache[name] = hit
        return hit[1]

    def _add_bias(self, y: Tensor) -> Tensor:
        if self.bias is None:
            return y
        return y + self.bias.view(1, -1, 1, 1, 1, 1)

    def _window(self, s: int) -> slice:
        k = self.spec.kernel_size
        ks = self.spec.kernel_sizes[s]
        lo = (k - ks) // 2
        return slice(lo, lo + ks)


class LiftingRSTConv(_BasisConv):
    """Z2 -> RST lifting convolution (eq. 4).  x [B, Cin, H, W] -> [B, Cout, R, S, H, W]."""

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

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"LiftingRSTConv expects images [B, {self.in_channels}, H, W], "
                f"got shape {tuple(x.shape)}"
            )
        if self.method is ConvMethod.DIRECT:
            return self._add_bias(self.forward_direct(x))
        return self._add_bias(self.forward_basis(x))

    def conv_weights(self) -> list[Tensor]:
        """Per scale s, the conv2d weight ``[Cout*R, Cin, ks, ks]`` (its own kernel size)."""
        out = []
        for s in range(self.spec.num_scales):
            w = self._window(s)
            basis = self.basis[:, :, s, w, w]  # [K, R, ks, ks]
            # [Cout, Cin, K] x [K, R, ks, ks] -> [Cout, R, Cin, ks, ks]
            out.append(torch.einsum("oik,krxy->orixy", self.weight, basis).flatten(0, 1))
        return out

    def forward_direct(self, x: Tensor) -> Tensor:
        """Reference: one conv2d per scale with every rotated filter stacked on Cout."""
        return self._direct(x, self._cached("direct", self.conv_weights))

    def _direct(self, x: Tensor, weights: list[Tensor]) -> Tensor:
        shape = (self.out_channels, self.spec.rotations)
        # per scale: [B, Cout*R, H, W] -> [B, Cout, R, H, W]
        ys = [F.conv2d(x, w, padding=w.shape[-1] // 2).unflatten(1, shape) for w in weights]
        return torch.stack(ys, dim=3)  # [B, Cout, R, S, H, W]

    def export(self) -> fx.GraphModule:
        """Plain-torch copy of this layer with its filters frozen (the direct path)."""
        with torch.no_grad():
            weights = self.conv_weights()
        tensors = {f"w{s}": w for s, w in enumerate(weights)}
        if self.bias is not None:
            tensors["bias"] = self.bias.view(1, -1, 1, 1, 1, 1)
        nsc, direct = len(weights), self._direct.__func__

        def forward(m: nn.Module, x: Tensor) -> Tensor:
            y = direct(self, x, [getattr(m, f"w{s}") for s in range(nsc)])
            return y + m.bias if hasattr(m, "bias") else y

        return plain_module(forward, tensors, "ExportedLiftingRSTConv")

    def forward_basis(self, x: Tensor) -> Tensor:
        """Convolve each input channel with the K R basis copies, then mix the K responses
        into Cout channels with one matmul (cost ~ K R + Cout K per pixel and scale instead
        of Cout R k^2)."""
        b, c, h, wd = x.shape
        rot, nsc, nk = self.spec.rotations, self.spec.num_scales, self.spec.num_funcs
        resp = []
        for s in range(nsc):
            w = self._window(s)
            ws = self.basis[:, :, s, w, w].flatten(0, 1)  # [K*R, ks, ks]
            ws = ws.unsqueeze(1).repeat(c, 1, 1, 1)  # [Cin*K*R, 1, ks, ks]
            y = F.conv2d(x, ws, padding=ws.shape[-1] // 2, groups=c)  # [B, Cin*K*R, H, W]
            resp.append(y.view(b, c * nk, rot, h, wd))
        y = torch.stack(resp, dim=3).view(b, c * nk, rot * nsc * h * wd)  # [B, Cin*K, R*S*H*W]
        a = self.weight.reshape(self.out_channels, c * nk)  # [Cout, Cin*K]
        return torch.matmul(a, y).view(b, self.out_channels, rot, nsc, h, wd)


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
        if self.method is ConvMethod.BASIS:
            raise ValueError("GroupRSTConv supports methods auto, direct and fft")
        step = rot // rotation_taps if tap_mode is RotationTaps.COARSE else 1
        # index[t, r] = rotation read by output rotation r through rotation tap t
        rshift = torch.arange(rotation_taps) * step
        self.register_buffer(
            "rot_index", (torch.arange(rot)[None] + rshift[:, None]) % rot, persistent=False
        )
        self._spectra: dict[tuple[int, int], Tensor] = {}

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
        method = self.method
        if method is ConvMethod.AUTO:
            method = self.choose_method(x.shape[0], x.shape[-2], x.shape[-1])
        if method is ConvMethod.DIRECT:
            return self._add_bias(self.forward_direct(x))
        return self._add_bias(self.forward_fft(x))

    def choose_method(self, batch: int, h: int, w: int) -> ConvMethod:
        """The cheaper of DIRECT and FFT by a multiply-add count. The FFT path pays for its
        filter spectra (Cin Cout R S n^2 numbers, whatever the batch) and runs its complex
        batched matmuls at about a quarter of conv2d's rate; it is refused while the
        spectra outweigh both 1 GiB and the batch's own input and output spectra."""
        rot, nsc = self.spec.rotations, self.spec.num_scales
        cit, cout = self.in_channels * self.taps, self.out_channels
        n = fft_size(max(h, w) + self.spec.kernel_size // 2)
        freqs = rot * nsc * n * (n // 2 + 1)
        if freqs * cit * cout > max(2**30 // 8, batch * (cit + cout) * freqs):
            return ConvMethod.DIRECT
        direct = batch * h * w * rot * sum(k * k for k in self.spec.kernel_sizes) * cit * cout
        build = 2 * self.spec.num_funcs * freqs * cit * cout if self.training else 0
        transforms = 5 * batch * (cit + cout) * rot * nsc * n * n * math.log2(n * n)
        fft = 4 * (4 * batch * freqs * cit * cout + build) + transforms
        return ConvMethod.FFT if fft < direct else ConvMethod.DIRECT

    def conv_weights(self) -> list[list[Tensor]]:
        """Per scale s and tap t, the conv2d weight ``[R*Cout, Cin, ks, ks]`` (groups = R)."""
        out = []
        for s in range(self.spec.num_scales):
            w = self._window(s)
            basis = self.basis[:, :, s, w, w]  # [K, R, ks, ks]
            # [Cout, Cin, T, K] x [K, R, ks, ks] -> [T, R, Cout, Cin, ks, ks]
            f = torch.einsum("oitk,krxy->troixy", self.weight, basis)
            out.append(list(f.flatten(1, 2).unbind(0)))
        return out

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

    def export(self) -> fx.GraphModule:
        """Plain-torch copy of this layer with its filters frozen (the direct path)."""
        with torch.no_grad():
            weights = self.conv_weights()
        tensors = {f"w{s}_{t}": w for s, ws in enumerate(weights) for t, w in enumerate(ws)}
        if self.bias is not None:
            tensors["bias"] = self.bias.view(1, -1, 1, 1, 1, 1)
        shape = [(s, len(ws)) for s, ws in enumerate(weights)]
        direct = self._direct.__func__
        frozen = copy.copy(self)  # shares the index buffers; tracing reads them as constants

        def forward(m: nn.Module, x: Tensor) -> Tensor:
            ws = [[getattr(m, f"w{s}_{t}") for t in range(n)] for s, n in shape]
            y = direct(frozen, x, ws)
            return y + m.bias if hasattr(m, "bias") else y

        return plain_module(forward, tensors, "ExportedGroupRSTConv")

    def _basis_spectrum(self, n: int, device: torch.device) -> Tensor:
        """Spectra of the basis for a 'same' cross-correlation on an n x n periodic grid,
        as real ``[2, R*S*n*(n//2+1), K]`` (real and imaginary parts)."""
        key = (n, str(device), self.weight.dtype)
        spec = self._spectra.get(key)
        if spec is None:
            k = self.spec.kernel_size
            p = k // 2
            placed = torch.zeros(*self.basis.shape[:3], n, n, dtype=torch.float64)
            # tap at offset m (rows, cols) goes to index m mod n
            placed[..., :k, :k] = torch.from_numpy(sample_basis(self.spec).copy())
            placed = torch.roll(placed, shifts=(-p, -p), dims=(-2, -1))
            g = torch.fft.rfft2(placed).conj()  # [K, R, S, n, n//2+1]
            g = g.flatten(1).transpose(0, 1)  # [R*S*n*F, K]
            spec = torch.stack([g.real, g.imag]).to(device=device, dtype=self.weight.dtype)
            self._spectra[key] = spec
        return spec

    def spectra(self, n: int) -> Tensor:
        """Filter spectra ``[R*S*n*F, Cin*T, Cout]`` (complex) for an n x n FFT grid."""
        basis_spec = self._basis_spectrum(n, self.weight.device)  # [2, RSNF, K]
        a = self.weight.permute(3, 1, 2, 0).reshape(self.spec.num_funcs, -1)  # [K, Cin*T*Cout]
        g = torch.complex(basis_spec[0] @ a, basis_spec[1] @ a)  # [RSNF, Cin*T*Cout]
        return g.view(g.shape[0], self.in_channels * self.taps, self.out_channels)

    def forward_fft(self, x: Tensor) -> Tensor:
        """Per-frequency channel mixing: cost independent of the kernel size."""
        b, _, rot, nsc, h, wd = x.shape
        p = self.spec.kernel_size // 2
        n = fft_size(max(h, wd) + p)
        g = self._cached(f"fft{n}", lambda: self.spectra(n))  # [RSNF, Cin*T, Cout]
        xf = torch.fft.rfftn(x, s=(n, n), dim=(-2, -1))  # [B, Cin, R, S, n, F]
        xt = self.gather_taps(xf)  # [B, Cin, T, R, S, n, F]
        nf = n * (n // 2 + 1)
        xm = xt.permute(3, 4, 5, 6, 0, 1, 2).reshape(rot * nsc * nf, b, -1)  # [RSNF, B, Cin*T]
        ym = torch.bmm(xm, g)  # [RSNF, B, Cout]
        yf = ym.view(rot, nsc, n, n // 2 + 1, b, self.out_channels).permute(4, 5, 0, 1, 2, 3)
        y = torch.fft.irfftn(yf, s=(n, n), dim=(-2, -1))  # [B, Cout, R, S, n, n]
        return y[..., :h, :wd]


class RSTBatchNorm(nn.BatchNorm3d):
    """Batch norm with one statistic per channel, shared over R, S, H, W (equivariant).
    x [B, C, R, S, H, W] -> same shape."""

    def export(self) -> fx.GraphModule:
        """Plain-torch eval-mode copy: a per-channel affine map with the running stats."""
        with torch.no_grad():
            scale = torch.rsqrt(self.running_var + self.eps)
            if self.weight is not None:
                scale = scale * self.weight
            shift = -self.running_mean * scale
            if self.bias is not None:
                shift = shift + self.bias
        view = (1, -1, 1, 1, 1, 1)
        tensors = {"scale": scale.view(view), "shift": shift.view(view)}
        return plain_module(lambda m, x: x * m.scale + m.shift, tensors, "ExportedRSTBatchNorm")

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 6 or x.shape[1] != self.num_features:
            raise ValueError(
                f"RSTBatchNorm expects [B, {self.num_features}, R, S, H, W], got {tuple(x.shape)}"
            )
        return super().forward(x.flatten(2, 3)).view_as(x)


class _MaxPoolReLU(torch.autograd.Function):
    """relu(max over 2x2 windows) of [N, H, W] planes; saves a uint8 argmax, not int64."""

    @staticmethod
    def forward(ctx, x: Tensor, relu: bool) -> Tensor:
        h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
        parts = [x[..., i:h:2, j:w:2] for i in (0, 1) for j in (0, 1)]
        m = parts[0]
        idx = torch.zeros(m.shape, dtype=torch.uint8, device=x.device)
        for d, p in enumerate(parts[1:], start=1):
            better = p > m
            m = torch.maximum(m, p)
            idx.masked_fill_(better, d)
        if relu:
            idx.masked_fill_(m <= 0, 4)  # no gradient where relu clamps
            m = m.clamp_min(0)
        ctx.save_for_backward(idx)
        ctx.in_shape = x.shape
        return m

    @staticmethod
    def backward(ctx, grad: Tensor):
        (idx,) = ctx.saved_tensors
        h, w = idx.shape[-2] * 2, idx.shape[-1] * 2
        gx = grad.new_zeros(ctx.in_shape)
        for d, (i, j) in enumerate((a, b) for a in (0, 1) for b in (0, 1)):
            gx[..., i:h:2, j:w:2] = grad * (idx == d)
        return gx, None


class RSTMaxPool(nn.Module):
    """2x2 spatial max-pool of feature maps, optionally fused with a ReLU before it
    (max commutes with ReLU, so pooling first touches a quarter of the data).

    Odd sizes are refused: a 2x2 grid that drops a row breaks the 90-degree symmetry.
    x [..., H, W] -> [..., H/2, W/2]."""

    def __init__(self, *, relu: bool = False):
        super().__init__()
        self.relu = relu

    def extra_repr(self) -> str:
        return f"relu={self.relu}"

    def export(self) -> fx.GraphModule:
        relu = self.relu

        def forward(m: nn.Module, x: Tensor) -> Tensor:
            # [B, C, R, S, H, W] -> [B, C, R*S, H, W] -> pooled -> [B, C, R, S, H/2, W/2]
            y = F.max_pool3d(x.flatten(2, 3), (1, 2, 2)).unflatten(2, (x.size(2), -1))
            return F.relu(y) if relu else y

        return plain_module(forward, {}, "ExportedRSTMaxPool")

    def forward(self, x: Tensor) -> Tensor:
        h, w = x.shape[-2:]
        if h % 2 or w % 2:
            raise ValueError(
                f"RSTMaxPool needs even spatial sizes to stay exact under 90-degree turns, "
                f"got {h}x{w}: resize the input"
            )
        return _MaxPoolReLU.apply(x, self.relu)


class GroupMaxPool(nn.Module):
    """Max over the group axes: R and S, and space too when ``spatial``.
    x [B, C, R, S, H, W] -> [B, C, H, W] or [B, C] (spatial)."""

    def __init__(self, *, spatial: bool = True):
        super().__init__()
        self.spatial = spatial

    def extra_repr(self) -> str:
        return f"spatial={self.spatial}"

    def export(self) -> fx.GraphModule:
        dims = (2, 3, 4, 5) if self.spatial else (2, 3)
        return plain_module(lambda m, x: x.amax(dim=dims), {}, "ExportedGroupMaxPool")

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 6:
            raise ValueError(f"GroupMaxPool expects [B, C, R, S, H, W], got {tuple(x.shape)}")
        dims = (2, 3, 4, 5) if self.spatial else (2, 3)
        return x.amax(dim=dims)


_EXPORTABLE = (LiftingRSTConv, GroupRSTConv, RSTBatchNorm, RSTMaxPool, GroupMaxPool)
