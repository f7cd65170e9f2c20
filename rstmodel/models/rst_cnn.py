"""RST-CNN of the paper (Section 5.2): the CNN baseline's skeleton with RST layers.

lift -> [pool+ReLU -> BN] -> (group conv -> pool+ReLU -> BN) x (L-1) -> group max-pool over
R, S and space (only after the last conv layer) -> FC head. Max-pool commutes with ReLU, so
pooling first is the baseline's conv -> ReLU -> pool -> BN at a quarter of the cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import Tensor, nn

from ..basis import BasisFamily, BasisSpec, reference_spec
from ..layers import (
    ConvMethod,
    ConvPoolNorm,
    GroupMaxPool,
    GroupRSTConv,
    LiftingRSTConv,
    RotationTaps,
)
from .registry import check_images, register_model

__all__ = ["RSTCNNConfig", "RSTCNN"]


@dataclass(frozen=True)
class RSTCNNConfig:
    in_channels: int = 1
    num_classes: int = 10
    input_size: int = 56
    channels: tuple[int, ...] = (69, 135, 204)
    basis: BasisFamily = BasisFamily.FOURIER_BESSEL
    num_funcs: int = 12  # K lowest modes (12 = all FB modes below Nyquist at 2.5 px)
    rotations: int = 8  # Nr
    num_scales: int = 4  # Ns
    base_radius: float = 2.5  # support radius at the smallest scale, pixels
    scale_ratio: float = 3 ** (1 / 3)  # rho_{s+1} / rho_s; radii 2.5..7.5 -> kernels 5..15
    rotation_taps: int = 1  # L_theta
    scale_taps: int = 1  # L_alpha
    tap_mode: RotationTaps = RotationTaps.COARSE
    hidden: int = 256
    dropout: float = 0.7
    method: ConvMethod = ConvMethod.AUTO
    kernel_sizes: tuple[int, ...] | None = field(default=None)  # None: from the radii

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", tuple(self.channels))
        object.__setattr__(self, "basis", BasisFamily(self.basis))
        object.__setattr__(self, "tap_mode", RotationTaps(self.tap_mode))
        object.__setattr__(self, "method", ConvMethod(self.method))
        if self.rotations < 1:
            raise ValueError(f"rotations (Nr) must be >= 1, got {self.rotations}")
        if self.num_scales < 1:
            raise ValueError(f"num_scales (Ns) must be >= 1, got {self.num_scales}")
        if self.num_scales > 1 and self.scale_ratio <= 1:
            raise ValueError(
                f"scale_ratio must be > 1 so that scales ascend, got {self.scale_ratio}"
            )
        if not self.channels or min(self.channels) < 1:
            raise ValueError(f"channels must be positive, got {self.channels}")
        if self.input_size % 2 ** len(self.channels):
            raise ValueError(
                f"input_size {self.input_size} must be divisible by 2**{len(self.channels)} "
                "so every pooled map has even size (exact 90-degree equivariance)"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        self.basis_spec()  # validates K, kernels and aliasing

    def basis_spec(self) -> BasisSpec:
        if self.basis is BasisFamily.REFERENCE:
            spec = reference_spec(self.rotations, self.num_scales, self.num_funcs)
            if self.kernel_sizes is not None:
                spec = replace(spec, kernel_sizes=self.kernel_sizes)
            return spec
        radii = tuple(self.base_radius * self.scale_ratio**s for s in range(self.num_scales))
        return BasisSpec(self.basis, self.num_funcs, self.rotations, radii, self.kernel_sizes)


class RSTCNN(nn.Module):
    """x [B, Cin, N, N] -> logits [B, classes], invariant to 90-degree turns of the input."""

    def __init__(self, config: RSTCNNConfig):
        super().__init__()
        self.config = config
        spec = config.basis_spec()
        self.spec = spec
        blocks: list[nn.Module] = []
        cin = config.in_channels
        for i, c in enumerate(config.channels):
            if i == 0:
                conv: nn.Module = LiftingRSTConv(cin, c, spec, method=config.method)
            else:
                conv = GroupRSTConv(
                    cin,
                    c,
                    spec,
                    rotation_taps=config.rotation_taps,
                    scale_taps=config.scale_taps,
                    tap_mode=config.tap_mode,
                    method=config.method,
                )
            blocks.append(ConvPoolNorm(conv, c))
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.pool = GroupMaxPool(spatial=True)
        self.head = nn.Sequential(
            nn.Linear(cin, config.hidden),
            nn.BatchNorm1d(config.hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(config.dropout),
            nn.Linear(config.hidden, config.num_classes),
        )

    def check_input(self, x: Tensor) -> None:
        check_images(x, self.config.in_channels, self.config.input_size)

    def forward_features(self, x: Tensor) -> Tensor:
        """The last equivariant map.  x [B, Cin, N, N] -> [B, C, R, S, N/8, N/8]."""
        self.check_input(x)
        return self.blocks(x)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        """``forward`` without the input check.  x [B, Cin, N, N] -> [B, classes]."""
        return self.head(self.pool(self.blocks(x)))


def _rst(**fields):
    def build(**overrides) -> RSTCNN:
        return RSTCNN(replace(RSTCNNConfig(**fields), **overrides))

    return build


@register_model
def rst_cnn_fb(**overrides) -> RSTCNN:
    """RST-CNN(FB): Nr=8, Ns=4, L_theta=1, L_alpha=1, K=12 Fourier-Bessel modes, ~500K params."""
    return _rst()(**overrides)


@register_model
def rst_cnn_sl(**overrides) -> RSTCNN:
    """RST-CNN(SL): as RST-CNN(FB) with K=8 Sturm-Liouville modes, ~500K params."""
    return _rst(basis=BasisFamily.STURM_LIOUVILLE, num_funcs=8, channels=(83, 164, 247))(
        **overrides
    )


@register_model
def rst_cnn_plus_fb(**overrides) -> RSTCNN:
    """RST-CNN+(FB): L_theta=4 inter-rotation taps, ~1.6M params."""
    return _rst(rotation_taps=4, channels=(64, 127, 191))(**overrides)


@register_model
def rst_cnn_plus_sl(**overrides) -> RSTCNN:
    """RST-CNN+(SL): L_theta=4 inter-rotation taps, K=8 SL modes, ~1.6M params."""
    return _rst(
        basis=BasisFamily.STURM_LIOUVILLE, num_funcs=8, rotation_taps=4, channels=(78, 154, 233)
    )(**overrides)


# The speed-against-accuracy sweep over the basis size (``python -m train.k_sweep``): at ~500K
# parameters K sets the channel widths (mixing ~ Cin Cout K) and so the cost. Widths keep
# the ratio of rst_cnn_fb's (69, 135, 204). The rotation grid Nr sets the number of branches,
# so the cost at fixed parameters (the coefficients do not depend on Nr).


@register_model
def rst_cnn_fb_k6(**overrides) -> RSTCNN:
    """RST-CNN(FB) with the K=6 lowest FB modes (wider channels), ~500K params."""
    return _rst(num_funcs=6, channels=(95, 186, 281))(**overrides)


@register_model
def rst_cnn_fb_k9(**overrides) -> RSTCNN:
    """RST-CNN(FB) with the K=9 lowest FB modes, ~500K params."""
    return _rst(num_funcs=9, channels=(79, 155, 234))(**overrides)


@register_model
def rst_cnn_fb_k17(**overrides) -> RSTCNN:
    """RST-CNN(FB) at a 3 px smallest radius (kernels 5..17), all K=17 modes below Nyquist there, ~500K params."""
    return _rst(num_funcs=17, base_radius=3.0, channels=(59, 115, 174))(**overrides)


@register_model
def rst_cnn_fb_nr4(**overrides) -> RSTCNN:
    """RST-CNN(FB) on the quarter-turn rotation grid (Nr=4, exact on the pixel grid): half
    the (rotation, scale) branches of rst_cnn_fb, so half its cost, same ~500K params."""
    return _rst(rotations=4)(**overrides)


@register_model
def rst_cnn_fb_ref(**overrides) -> RSTCNN:
    """RST-CNN(FB) with the public code's basis (15 modes x 4 dilations, K=49), ~500K params."""
    return _rst(basis=BasisFamily.REFERENCE, num_funcs=49, channels=(35, 69, 104))(**overrides)


@register_model
def rot_cnn(**overrides) -> RSTCNN:
    """Rotation-only peer (Ns=1, like RDCF): Nr=8, one 7x7 scale, K=12 FB, ~500K params."""
    return _rst(num_scales=1, base_radius=3.5, channels=(69, 135, 204))(**overrides)


@register_model
def rdcf_plus(**overrides) -> RSTCNN:
    """Rotation-only peer with inter-rotation taps (Ns=1, L_theta=4, like RDCF+): Nr=8, one
    7x7 scale, K=12 FB, ~1.6M params (the widths of RST-CNN+(FB))."""
    return _rst(num_scales=1, base_radius=3.5, rotation_taps=4, channels=(64, 127, 191))(
        **overrides
    )


@register_model
def sesn(**overrides) -> RSTCNN:
    """Scale-only peer on SESN's Hermite-Gaussian basis (Nr=1, Ns=4): K=10 HG functions of
    degree <= 3, ~500K params."""
    return _rst(
        rotations=1, basis=BasisFamily.HERMITE_GAUSSIAN, num_funcs=10, channels=(75, 148, 223)
    )(**overrides)


@register_model
def scale_cnn(**overrides) -> RSTCNN:
    """Scale-only peer (Nr=1, like SDCF/SESN): Ns=4 scales, K=12 FB, ~500K params."""
    return _rst(rotations=1, channels=(69, 135, 204))(**overrides)
