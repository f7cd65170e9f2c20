"""Layer-wise RST equivariance error (paper Section 5.2, eq. 14, Figure 3).

    python train/equivariance.py                                  # Figure 3: K 5/10, L_alpha 1-3
    python train/equivariance.py --budget smoke                   # seconds (CI)
    python train/equivariance.py --checkpoint runs/x/best.pt --element "-pi/2,-0.528,0,0"
    python train/equivariance.py --element "pi/2,0,0,0" --dtype float64   # grid-exact: ~1e-12

Figure 3's model: a 5-layer RST-CNN (a lifting layer, then four joint group convolutions,
ReLU after each, no spatial pooling, no batch norm) with random FB coefficients, K in {5, 10}
modes, Nr = 8 rotations, Ns = 9 scales uniform in alpha on [-1, 1] (step 0.25; support
radius 2.5 * 2**(alpha + 1) px, so alpha = 0 is 5 px), L_theta = 4 rotation taps on the coarse
grid and L_alpha in {1, 2, 3} scale taps, on RS-MNIST test images (56x56). For
g = (eta, beta, v) the error of layer l is eq. 14,

    || x^(l)[D_g x] - D_g x^(l)[x] ||  /  || D_g x^(l)[x] ||      at theta = 0, alpha = 0,

L2 over channels and space, per image, then mean and std over images and random
initialisations. ``D_g`` of a feature map is the spatial warp, the cyclic rotation shift and
the truncated scale shift of ``rstmodel.act_on_features`` (beta = -0.5 is 2 scale steps);
the image warp and the feature warp interpolate (``--interpolation``) except for quarter turns,
which are exact pixel permutations. Where biases make the response to a black image b = x^(l)[0]
nonzero (trained models), D_g acts on x^(l) - b and b is added back: the zero fill of a warp
stands for black input, whose features are b, not 0 (b = 0 for Figure 3's bias-free model).

With ``--checkpoint`` the layers are a trained RST-CNN's blocks (conv -> pool+ReLU -> BN, its
input normalisation in front); its scale step is its own (0.528 for the registered models),
so the default element is then (-pi/2, -step, 0, 0), measured at theta = 0 and the smallest
scale. Writes ``equivariance.csv`` (mean, std per configuration and layer),
``equivariance_samples.csv`` (every image), ``equivariance.png`` and ``equivariance.md``
into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.engine import setup_cli
from rstcnn.train.experiments import (
    SYNTHETIC,
    Stages,
    element_on_map,
    format_element,
    load_images,
    load_stages,
    parse_element,
    plt,
    stage_outputs,
    write_csv,
)
from rstcnn.train.runtime import use_retaining_allocator, user_errors
from rstmodel import (
    BasisSpec,
    GroupRSTConv,
    LiftingRSTConv,
    RSTElement,
    act_on_features,
    act_on_image,
)
from rstmodel.basis import BasisFamily

log = logging.getLogger("equivariance")

PAPER_ELEMENT = RSTElement(-math.pi / 2, -0.5, (0.0, 0.0))
FeatureAction = Callable[[Tensor, RSTElement, float], Tensor]


@dataclass(frozen=True)
class StackConfig:
    """Figure 3's random RST-CNN: lifting + (layers - 1) joint convolutions, ReLU, no pooling."""

    num_funcs: int = 5  # K
    scale_taps: int = 1  # L_alpha
    rotation_taps: int = 4  # L_theta (coarse grid)
    rotations: int = 8  # Nr
    num_scales: int = 9  # Ns, uniform in alpha on [-alpha_max, alpha_max]
    alpha_max: float = 1.0
    radius_at_zero: float = 5.0  # support radius (px) at alpha = 0
    channels: int = 8  # unstructured channels of every layer
    layers: int = 5

    def __post_init__(self) -> None:
        if self.num_scales < 2 or self.num_scales % 2 == 0:
            raise ValueError(
                f"num_scales must be odd and >= 3 (alpha = 0 in the middle), got {self.num_scales}"
            )
        if self.layers < 1 or self.channels < 1:
            raise ValueError("layers and channels must be positive")

    @property
    def scale_step(self) -> float:
        return 2 * self.alpha_max / (self.num_scales - 1)

    @property
    def zero_index(self) -> int:
        """Index of alpha = 0 on the scale axis."""
        return (self.num_scales - 1) // 2

    def basis_spec(self) -> BasisSpec:
        alphas = [-self.alpha_max + s * self.scale_step for s in range(self.num_scales)]
        radii = tuple(self.radius_at_zero * 2**a for a in alphas)
        return BasisSpec(BasisFamily.FOURIER_BESSEL, self.num_funcs, self.rotations, radii)


def random_stack(config: StackConfig, *, seed: int, input_size: int = 56) -> Stages:
    """Figure 3's model with coefficients drawn from the layers' default (He-like) init
    under ``seed``: ``stages[0]`` lifts, the others are joint convolutions; ReLU after each."""
    spec = config.basis_spec()
    torch.manual_seed(seed)
    stages: list[nn.Module] = [nn.Sequential(LiftingRSTConv(1, config.channels, spec), nn.ReLU())]
    for _ in range(config.layers - 1):
        conv = GroupRSTConv(
            config.channels,
            config.channels,
            spec,
            rotation_taps=config.rotation_taps,
            scale_taps=config.scale_taps,
        )
        stages.append(nn.Sequential(conv, nn.ReLU()))
    # no batch norm or dropout: train mode only keeps the layers from caching filter spectra
    # (~1 GB per layer at 9 scales and L_alpha = 3)
    return Stages(stages, scale_step=config.scale_step, input_size=input_size).train()


def transform_features(x: Tensor, g: RSTElement, scale_step: float, *, mode: str) -> Tensor:
    """D_g of a feature map [B, C, R, S, H, W] (the regular representation)."""
    return act_on_features(x, g, scale_step=scale_step, mode=mode)


@torch.no_grad()
def equivariance_errors(
    stages: Stages,
    images: Tensor,
    g: RSTElement,
    *,
    rotation_index: int = 0,
    scale_index: int = 0,
    mode: str = "bilinear",
    feature_action: FeatureAction | None = None,
    batch_size: int = 2,
) -> Tensor:
    """Eq. 14 per layer and image at (theta index, alpha index), ``batch_size`` images at a
    time (Figure 3's unpooled maps take ~1 GB per image).

    images [B, Cin, N, N] -> relative errors [L, B]. ``feature_action(x, g_l, scale_step)``
    replaces D_g on the feature maps (a test hook for a deliberately wrong action)."""
    chunks = [
        _errors(stages, part, g, rotation_index, scale_index, mode, feature_action)
        for part in images.split(batch_size)
    ]
    return torch.cat(chunks, dim=1)


def _errors(
    stages: Stages,
    images: Tensor,
    g: RSTElement,
    rotation_index: int,
    scale_index: int,
    mode: str,
    feature_action: FeatureAction | None,
) -> Tensor:
    act = feature_action or (lambda x, h, step: transform_features(x, h, step, mode=mode))
    plain = stage_outputs(stages, images)
    moved = stage_outputs(stages, act_on_image(images, g, mode=mode))
    black = stage_outputs(stages, torch.zeros_like(images[:1]))
    errors = []
    for feat, feat_g, bg in zip(plain, moved, black, strict=True):
        g_l = element_on_map(g, feat.shape[-1], stages.input_size)
        # D_g moves the response to the image and leaves that of the black background
        target = act(feat - bg, g_l, stages.scale_step) + bg
        target = target[:, :, rotation_index, scale_index]  # [B, C, H, W]
        got = feat_g[:, :, rotation_index, scale_index]
        diff = (got - target).flatten(1).norm(dim=1)
        errors.append(diff / target.flatten(1).norm(dim=1).clamp_min(torch.finfo(diff.dtype).tiny))
    return torch.stack(errors)  # [L, B]


# ---------------------------------------------------------------- command line

BUDGETS = {
    # name: (images, initialisations, channels)
    "smoke": (2, 1, 2),
    "reduced": (8, 3, 8),
    "full": (32, 5, 16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, default=None, help="a trained RST-CNN (best.pt)")
    parser.add_argument(
        "--element",
        default=None,
        help="ETA,BETA,VX,VY: rad, log2 scale, input pixels (default -pi/2,-0.5,0,0; "
        "with --checkpoint -pi/2,-step,0,0)",
    )
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="reduced")
    parser.add_argument("--images", type=int, default=None, help="test images (budget default)")
    parser.add_argument("--inits", type=int, default=None, help="random initialisations")
    parser.add_argument("--channels", type=int, default=None, help="channels of every layer")
    parser.add_argument("--num-funcs", type=int, nargs="+", default=[5, 10], help="K values")
    parser.add_argument("--scale-taps", type=int, nargs="+", default=[1, 2, 3], help="L_alpha")
    parser.add_argument("--rotation-taps", type=int, default=4, help="L_theta")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--rotation-index", type=int, default=0, help="theta index measured")
    parser.add_argument(
        "--scale-index", type=int, default=None, help="alpha index measured (default alpha = 0)"
    )
    parser.add_argument("--data", default="rs-mnist", choices=("rs-mnist", "rs-fashion", SYNTHETIC))
    parser.add_argument("--interpolation", default="bilinear", choices=("bilinear", "bicubic"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("outputs/equivariance"))
    args = parser.parse_args(argv)
    images, inits, channels = BUDGETS[args.budget]
    args.images = args.images or images
    args.inits = args.inits or inits
    args.channels = args.channels or channels
    if min(args.images, args.inits, args.channels, args.layers) < 1:
        parser.error("--images, --inits, --channels and --layers must be positive")
    return args


def run_random(args: argparse.Namespace, images: Tensor, g: RSTElement, dtype) -> list[dict]:
    """Figure 3: every (K, L_alpha, initialisation); one row per image and layer."""
    jobs = [(k, la, i) for k in args.num_funcs for la in args.scale_taps for i in range(args.inits)]
    rows = []
    for k, la, init in tqdm(jobs, desc="K, L_alpha, init", unit="model", dynamic_ncols=True):
        config = StackConfig(
            num_funcs=k,
            scale_taps=la,
            rotation_taps=args.rotation_taps,
            channels=args.channels,
            layers=args.layers,
        )
        stages = random_stack(config, seed=args.seed + init).to(dtype)
        scale = config.zero_index if args.scale_index is None else args.scale_index
        errors = equivariance_errors(
            stages,
            images.to(dtype),
            g,
            rotation_index=args.rotation_index,
            scale_index=scale,
            mode=args.interpolation,
        )
        for layer, per_image in enumerate(errors.tolist(), start=1):
            for image, error in enumerate(per_image):
                rows.append(
                    {
                        "model": f"K={k}",
                        "K": k,
                        "L_alpha": la,
                        "init": init,
                        "image": image,
                        "layer": layer,
                        "error": error,
                    }
                )
    return rows


def run_checkpoint(args: argparse.Namespace, images: Tensor, g: RSTElement, dtype) -> list[dict]:
    stages, model, meta = load_stages(args.checkpoint)
    stages = stages.to(dtype)
    errors = equivariance_errors(
        stages,
        images.to(dtype),
        g,
        rotation_index=args.rotation_index,
        scale_index=args.scale_index or 0,
        mode=args.interpolation,
    )
    k, la = model.spec.num_funcs, model.config.scale_taps
    return [
        {
            "model": meta.model_name,
            "K": k,
            "L_alpha": la,
            "init": 0,
            "image": image,
            "layer": layer,
            "error": error,
        }
        for layer, per_image in enumerate(errors.tolist(), start=1)
        for image, error in enumerate(per_image)
    ]


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean, std (over images and initialisations) and count per (model, K, L_alpha, layer)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["K"], r["L_alpha"], r["layer"]), []).append(r["error"])
    out = []
    for (model, k, la, layer), errors in sorted(groups.items()):
        t = torch.tensor(errors, dtype=torch.float64)
        out.append(
            {
                "model": model,
                "K": k,
                "L_alpha": la,
                "layer": layer,
                "mean": t.mean().item(),
                "std": t.std(correction=0).item(),
                "n": len(errors),
            }
        )
    return out


def plot(summary: list[dict], path: Path, title: str) -> None:
    pyplot = plt()
    panels = sorted({(r["model"], r["K"]) for r in summary}, key=lambda p: (p[1], p[0]))
    fig, axes = pyplot.subplots(
        1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False, sharey=True
    )
    for ax, (model, k) in zip(axes[0], panels, strict=True):
        for la in sorted({r["L_alpha"] for r in summary if r["K"] == k and r["model"] == model}):
            pts = [r for r in summary if (r["model"], r["K"], r["L_alpha"]) == (model, k, la)]
            ax.errorbar(
                [r["layer"] for r in pts],
                [r["mean"] for r in pts],
                yerr=[r["std"] for r in pts],
                marker="o",
                capsize=3,
                label=f"$L_\\alpha$ = {la}",
            )
        ax.set_title(f"{model}" if model != f"K={k}" else f"K = {k} FB modes")
        ax.set_xlabel("layer l")
        ax.set_yscale("log")
        ax.set_ylabel("relative equivariance error (eq. 14)")
        ax.set_xticks(sorted({r["layer"] for r in summary}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def markdown(args: argparse.Namespace, summary: list[dict], g: RSTElement, seconds: float) -> str:
    lines = [
        "# Layer-wise equivariance error (eq. 14)",
        "",
        f"Element g = {format_element(g)}; measured at theta index {args.rotation_index}; "
        f"{args.images} {args.data} images x {args.inits if args.checkpoint is None else 1} "
        f"initialisation(s); {args.dtype}; interpolation {args.interpolation}; "
        f"{seconds:.0f} s.",
        "",
        "| model | L_alpha | " + " | ".join(f"layer {i}" for i in range(1, args.layers + 1)) + " |",
        "|---|---|" + "---|" * args.layers,
    ]
    keys = sorted({(r["model"], r["L_alpha"]) for r in summary})
    for model, la in keys:
        cells = [
            f"{r['mean']:.3g} ± {r['std']:.2g}"
            for r in summary
            if (r["model"], r["L_alpha"]) == (model, la)
        ]
        lines.append(f"| {model} | {la} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_cli(args.threads)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    started = time.perf_counter()
    images = load_images(args.data, args.images, seed=args.seed)
    if args.checkpoint is not None:
        stages, _, _ = load_stages(args.checkpoint)
        step = stages.scale_step
        g = parse_element(args.element) if args.element else RSTElement(-math.pi / 2, -step)
        args.layers = len(stages)
        rows = run_checkpoint(args, images, g, dtype)
    else:
        g = parse_element(args.element) if args.element else PAPER_ELEMENT
        rows = run_random(args, images, g, dtype)
    summary = aggregate(rows)
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "equivariance_samples.csv", rows)
    write_csv(args.out / "equivariance.csv", summary)
    title = (
        f"RST equivariance error, g = {format_element(g)}, theta = 0, "
        + ("alpha = 0" if args.checkpoint is None else "smallest scale")
        + f" ({args.images} images x {args.inits if args.checkpoint is None else 1} inits)"
    )
    plot(summary, args.out / "equivariance.png", title)
    (args.out / "equivariance.md").write_text(markdown(args, summary, g, seconds), "utf-8")
    print(markdown(args, summary, g, seconds), end="")
    log.info("wrote %s (%.0f s)", args.out, seconds)
    return 0


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
