"""Deformation stability of the equivariant representation (paper Theorem 1, eq. 12).

    python train/stability.py runs/ship/rst_cnn_fb/best.pt
    python train/stability.py CHECKPOINT --budget smoke
    python train/stability.py CHECKPOINT --compare-k 3 6 12 --elements "0,0" "pi/2,0" "-pi/2,-0.528"

For smooth random displacement fields tau with |grad tau|_inf = t (``rstmodel.data.deform``,
t up to 0.2, assumption A3 asks for < 1/5) and several group elements g, it measures the left
side of eq. 12 on the last equivariant layer x^(L) of the checkpoint's RST-CNN,

    || x^(L)[D_g D_tau x] - D_g x^(L)[x] ||  /  ||x||,

with the paper's norms (eq. 11: mean over channels, normalised integral over rotations, L2
over space in input pixels, sup over scales; images in [0, 1]; for beta != 0 the sup runs over
the scales that D_g does not zero-fill, since the scale axis is truncated), beside the theorem's bound
divided by ||x||, ``2**(beta + 1) (4 L t + 2**(-j_L) |tau|_inf)`` (2**j_L: the radius of the
layer-L filters at the smallest scale, in input pixels). It also reports the relative error
(divided by ||D_g x^(L)[x]||, scale-free), and whether assumption A2 holds: the filter bounds
A_l computed from the model's own coefficients (see ``filter_bounds``).

``--compare-k``: the same architecture with K FB modes and random coefficients (several
initialisations), and ``--also``: more trained checkpoints (other K), to test the paper's
claim that fewer low-frequency modes are more robust; their relative errors at the first
element go beside the trained model's. Writes ``stability.csv``,
``stability_bounds.json`` (A_l, j_L), ``stability.png`` and ``stability.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
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
    stages_of,
    write_csv,
    write_json,
)
from rstcnn.train.runtime import use_retaining_allocator, user_errors
from rstmodel import (
    GroupRSTConv,
    LiftingRSTConv,
    RSTBatchNorm,
    RSTElement,
    act_on_features,
    act_on_image,
    create_model,
)
from rstmodel.basis import BasisFamily
from rstmodel.data import deform, jacobian_sup_norm

log = logging.getLogger("stability")


# ---------------------------------------------------------------- norms and bounds


def input_norm(x: Tensor) -> Tensor:
    """Eq. 11 for images [B, C, N, N]: (1/C) sum_c int |x|^2 du, pixel area 1. -> [B]"""
    return x.pow(2).sum(dim=(-2, -1)).mean(1).sqrt()


def feature_norm(x: Tensor, input_size: int, scales: slice = slice(None)) -> Tensor:
    """Eq. 11 for feature maps [B, C, R, S, H, W]: sup over the ``scales`` of (1/C) sum_c of
    the normalised rotation integral of int |x|^2 du, du in input pixels. -> [B]"""
    area = (input_size / x.shape[-1]) ** 2
    per_scale = x.pow(2).sum(dim=(-2, -1)).mean(dim=2).mean(dim=1) * area  # [B, S]
    return per_scale[:, scales].amax(dim=1).sqrt()


def defined_scales(g: RSTElement, num_scales: int, scale_step: float) -> slice:
    """The scales where D_g of a truncated feature map is known: a shift by n = beta / step
    zero-fills n scales at one end, and those hold no information to compare against."""
    n = round(g.log2_scale / scale_step) if scale_step else 0
    if abs(n) >= num_scales:
        raise ValueError(f"beta = {g.log2_scale:g} shifts all {num_scales} scales out of range")
    return slice(n, None) if n >= 0 else slice(0, num_scales + n)


def _channel_scales(bn: RSTBatchNorm) -> Tensor:
    """|gamma| / sqrt(running var + eps): what eval-mode batch norm multiplies channels by."""
    scale = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight
    return scale.abs().detach()


def filter_bounds(model: nn.Module, input_std: float = 1.0) -> list[float]:
    """A_l of assumption A2 for an FB RST-CNN (paper, before eq. 13).

    The code's coefficients a[out, in, (taps,) k] map to the paper's as follows: a sampled
    basis function is ``psi_k(u / rho_0) / rho_0`` at the smallest scale and a convolution
    sums over map pixels, so the paper's coefficient is ``rho_0 a``; the L_theta rotation taps
    sample the normalised S^1 integral, so the FB norm over (k, m) of one scale tap is
    ``rho_0 sqrt(L_theta sum_{k, t} mu_k a[k, t]**2)``; scale taps play the role of n. Eval-mode
    batch norm after a layer scales its output channels by |gamma| / sqrt(var + eps) (folded
    into a[out]), and the input normalisation scales layer 1 by 1 / std."""
    spec = model.spec
    if spec.family is not BasisFamily.FOURIER_BESSEL:
        raise ValueError("assumption A2 is stated for Fourier-Bessel coefficients (eq. 13)")
    mu = torch.tensor(spec.eigenvalues(), dtype=torch.float64)
    rho0 = spec.scales[0]
    bounds = []
    for index, block in enumerate(model.blocks):
        conv, bn = block[0], block[2]
        a = conv.weight.detach().to(torch.float64) * rho0  # [out, in, (T,) K]
        a = a * _channel_scales(bn).to(torch.float64).view(-1, *([1] * (a.dim() - 1)))
        if isinstance(conv, LiftingRSTConv):
            a = a / input_std
            norms = (a.pow(2) * mu).sum(-1).sqrt()  # [out, in]
            m_in, m_out = conv.in_channels, conv.out_channels
            bound = max(norms.sum(1).max().item(), m_in / m_out * norms.sum(0).max().item())
        elif isinstance(conv, GroupRSTConv):
            lt, la = conv.rotation_taps, conv.scale_taps
            a = a.unflatten(2, (lt, la))  # [out, in, L_theta, L_alpha, K]
            norms = (lt * (a.pow(2) * mu).sum(-1).sum(2)).sqrt()  # [out, in, n]
            m_in, m_out = conv.in_channels, conv.out_channels
            first = norms.sum(dim=(1, 2)).max().item()
            second = 2 * m_in / m_out * norms.sum(0).amax(0).sum().item()
            bound = max(first, second)
        else:
            raise ValueError(f"block {index} starts with {type(conv).__name__}, not an RST conv")
        bounds.append(math.pi * bound)
    return bounds


def last_filter_radius(model: nn.Module) -> float:
    """2**j_L: the support radius of the last layer's filters at the smallest scale, in input
    pixels (every block before it halves the grid)."""
    return model.spec.scales[0] * 2 ** (len(model.blocks) - 1)


def theorem_bound(beta: float, layers: int, grad_tau: float, tau_sup: float, radius: float):
    """Right side of eq. 12 divided by ||x||."""
    return 2 ** (beta + 1) * (4 * layers * grad_tau + tau_sup / radius)


# ---------------------------------------------------------------- measurement


@torch.no_grad()
def stability_errors(
    stages: Stages,
    images: Tensor,
    g: RSTElement,
    grad_tau: float,
    generator: torch.Generator,
    *,
    mode: str = "bilinear",
) -> dict[str, Tensor]:
    """Eq. 12's left side for one g and |grad tau|_inf per image. images [B, C, N, N] in
    [0, 1] -> {"lhs": LHS / ||x||, "relative": LHS / ||D_g x^(L)[x]||, "tau_sup": |tau|_inf,
    "grad_tau": measured |grad tau|_inf}, each [B]."""
    warped, tau = deform(images, grad_tau, generator)
    last = stage_outputs(stages, images)[-1]
    moved = stage_outputs(stages, act_on_image(warped, g, mode=mode))[-1]
    black = stage_outputs(stages, torch.zeros_like(images[:1]))[-1]
    g_map = element_on_map(g, last.shape[-1], stages.input_size)
    # D_g moves the response to the image, not that of the black background (see
    # train/equivariance.py)
    target = act_on_features(last - black, g_map, scale_step=stages.scale_step, mode=mode) + black
    valid = defined_scales(g, last.shape[3], stages.scale_step)
    diff = feature_norm(moved - target, stages.input_size, valid)
    return {
        "lhs": diff / input_norm(images),
        "relative": diff / feature_norm(target, stages.input_size, valid),
        "tau_sup": tau.norm(dim=1).flatten(1).amax(1),
        "grad_tau": jacobian_sup_norm(tau),
    }


# ---------------------------------------------------------------- command line

BUDGETS = {
    # name: (images, gradient sizes, random initialisations per K)
    "smoke": (2, (0.0, 0.2), 1),
    "reduced": (32, (0.0, 0.025, 0.05, 0.1, 0.15, 0.2), 2),
    "full": (200, (0.0, 0.0125, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2), 5),
}


def peer_config(config) -> dict:
    """The fields of an RST-CNN config that fix its feature layers, but for K."""
    fields = ("channels", "rotations", "num_scales", "base_radius", "scale_ratio")
    fields += ("rotation_taps", "scale_taps", "tap_mode")
    return {f: getattr(config, f) for f in fields}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="a trained FB RST-CNN (best.pt)")
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="reduced")
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--grad-tau", type=float, nargs="+", default=None, help="|grad tau|_inf")
    parser.add_argument(
        "--elements",
        nargs="+",
        default=None,
        help='group elements "ETA,BETA[,VX,VY]" (default: identity, a quarter turn, '
        "(-pi/2, -scale step))",
    )
    parser.add_argument(
        "--also",
        type=Path,
        nargs="*",
        default=[],
        help="more trained checkpoints (e.g. other K), measured at the first element",
    )
    parser.add_argument("--compare-k", type=int, nargs="*", default=None, help="K of random peers")
    parser.add_argument("--inits", type=int, default=None, help="random peers per K")
    parser.add_argument(
        "--data",
        default=None,
        help="rs-mnist, rs-fashion or synthetic (default: the checkpoint's data set)",
    )
    parser.add_argument("--interpolation", default="bilinear", choices=("bilinear", "bicubic"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("outputs/stability"))
    args = parser.parse_args(argv)
    images, grads, inits = BUDGETS[args.budget]
    args.images = args.images or images
    args.grad_tau = args.grad_tau or list(grads)
    args.inits = args.inits or inits
    if args.compare_k is None:
        args.compare_k = [3] if args.budget == "smoke" else [3, 6, 12]
    if any(not 0 <= t < 1 for t in args.grad_tau):
        parser.error("--grad-tau values must lie in [0, 1)")
    return args


def measure(
    name: str,
    stages: Stages,
    images: Tensor,
    elements: list[RSTElement],
    args: argparse.Namespace,
    bar: tqdm,
    *,
    init: int = 0,
) -> list[dict]:
    rows = []
    for g in elements:
        for t in args.grad_tau:
            generator = torch.Generator().manual_seed(args.seed + round(1e6 * t))
            parts = [
                stability_errors(stages, part, g, t, generator, mode=args.interpolation)
                for part in images.split(8)  # bounded memory
            ]
            out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            for i in range(images.shape[0]):
                rows.append(
                    {
                        "model": name,
                        "init": init,
                        "element": format_element(g),
                        "beta": g.log2_scale,
                        "grad_tau": t,
                        "image": i,
                        **{k: v[i].item() for k, v in out.items() if k != "grad_tau"},
                    }
                )
            bar.update(1)
    return rows


def aggregate(rows: list[dict], shapes: dict[str, tuple[int, float]]) -> list[dict]:
    """Mean / max per (model, element, |grad tau|) with the bound of eq. 12; ``shapes``:
    model name -> (L, 2**j_L)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["element"], r["beta"], r["grad_tau"]), []).append(r)
    out = []
    for (model, element, beta, t), rs in sorted(groups.items()):
        lhs = torch.tensor([r["lhs"] for r in rs], dtype=torch.float64)
        rel = torch.tensor([r["relative"] for r in rs], dtype=torch.float64)
        tau = torch.tensor([r["tau_sup"] for r in rs], dtype=torch.float64)
        layers, radius = shapes[model]
        bound = theorem_bound(beta, layers, t, tau, radius)
        out.append(
            {
                "model": model,
                "element": element,
                "beta": beta,
                "grad_tau": t,
                "n": len(rs),
                "lhs_mean": lhs.mean().item(),
                "lhs_max": lhs.max().item(),
                "relative_mean": rel.mean().item(),
                "relative_std": rel.std(correction=0).item(),
                "tau_sup_mean": tau.mean().item(),
                "bound_mean": bound.mean().item(),
                "lhs_over_bound_max": (lhs / bound.clamp_min(1e-12)).max().item()
                if t > 0
                else float("nan"),
            }
        )
    return out


def _by_k(model: str) -> tuple[bool, int, str]:
    """Random peers first, each group by K."""
    k = model.partition("K=")[2].split(",")[0].split(")")[0]
    return ("random" not in model, int(k) if k.isdigit() else 0, model)


def plot(summary: list[dict], trained: str, elements: list[str], path: Path, title: str) -> None:
    """Left: the trained model's eq. 12 sides per element; right: relative errors at the
    first element, trained model and random peers."""
    pyplot = plt()
    fig, (left, right) = pyplot.subplots(1, 2, figsize=(12, 4.4))
    colors = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, element in zip(colors, elements, strict=False):
        pts = [r for r in summary if (r["model"], r["element"]) == (trained, element)]
        left.plot(
            [r["grad_tau"] for r in pts],
            [r["lhs_mean"] for r in pts],
            "o-",
            color=color,
            label=f"measured, g = {element}",
        )
        deformed = [r for r in pts if r["grad_tau"] > 0]  # the bound is 0 without tau
        left.plot(
            [r["grad_tau"] for r in deformed],
            [r["bound_mean"] for r in deformed],
            "x--",
            color=color,
            label="Theorem 1 bound",
        )
    left.set_yscale("log")
    left.set_xlabel(r"$|\nabla\tau|_\infty$ (pixels / pixel)")
    left.set_ylabel(r"$\|x^{(L)}[D_g D_\tau x] - D_g x^{(L)}[x]\| \,/\, \|x\|$")
    left.set_title(f"trained {trained}: eq. 12, left vs right side", fontsize=10)
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=7)
    first = elements[0]
    for model in sorted({r["model"] for r in summary}, key=_by_k):
        pts = [r for r in summary if (r["model"], r["element"]) == (model, first)]
        right.errorbar(
            [r["grad_tau"] for r in pts],
            [r["relative_mean"] for r in pts],
            yerr=[r["relative_std"] for r in pts],
            marker="o",
            capsize=3,
            label=model,
        )
    right.set_xlabel(r"$|\nabla\tau|_\infty$ (pixels / pixel)")
    right.set_ylabel(r"relative error $/\,\|D_g x^{(L)}[x]\|$")
    right.set_title(f"g = {first}: trained vs random-coefficient K", fontsize=10)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def markdown(summary: list[dict], bounds: dict, trained: str, seconds: float) -> str:
    holds = all(a <= 1 for a in bounds["A"])
    lines = [
        "# Deformation stability (Theorem 1, eq. 12)",
        "",
        f"Trained model `{trained}`: filter bounds A_l = "
        + ", ".join(f"{a:.3g}" for a in bounds["A"])
        + f" -> assumption A2 (A_l <= 1) {'holds' if holds else 'does NOT hold'}; "
        f"L = {bounds['L']}, 2^j_L = {bounds['radius']:g} px. {seconds:.0f} s.",
        "",
        "| model | g | grad tau | LHS / ‖x‖ (mean, max) | bound / ‖x‖ | relative error |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['model']} | {r['element']} | {r['grad_tau']:g} | {r['lhs_mean']:.3g}, "
            f"{r['lhs_max']:.3g} | {r['bound_mean']:.3g} | "
            f"{r['relative_mean']:.3g} ± {r['relative_std']:.2g} |"
        )
    return "\n".join(lines) + "\n"


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_cli(args.threads)
    started = time.perf_counter()
    stages, model, meta = load_stages(args.checkpoint)
    data = args.data or meta.extra.get("run", {}).get("data", SYNTHETIC)
    images = load_images(data, args.images, seed=args.seed)
    step = stages.scale_step
    texts = args.elements or ["0,0", "pi/2,0", f"-pi/2,{-step!r}"]
    elements = [parse_element(t) for t in texts]
    bounds = {
        "A": filter_bounds(model, meta.std[0]),
        "L": len(model.blocks),
        "radius": last_filter_radius(model),
        "model": meta.model_name,
        "checkpoint": str(args.checkpoint),
    }
    log.info("A_l = %s", bounds["A"])
    steps = len(elements) + len(args.also) + len(args.compare_k) * args.inits
    trained = f"{meta.model_name} (trained, K={model.spec.num_funcs})"
    shape = (bounds["L"], bounds["radius"])
    shapes = {trained: shape}
    bar = tqdm(total=steps * len(args.grad_tau), desc="stability", unit="point")
    with bar:
        rows = measure(trained, stages, images, elements, args, bar)
        for path in args.also:
            other_stages, other, other_meta = load_stages(path)
            name = (
                f"{other_meta.model_name} (trained, K={other.spec.num_funcs}, {path.parent.name})"
            )
            shapes[name] = (len(other.blocks), last_filter_radius(other))
            bounds.setdefault("also", {})[str(path)] = filter_bounds(other, other_meta.std[0])
            rows += measure(name, other_stages, images, elements[:1], args, bar)
        config = model.config  # peers: same architecture, K modes, random coefficients
        for k in args.compare_k:
            shapes[f"random, K={k}"] = shape
            for init in range(args.inits):
                torch.manual_seed(args.seed + init)
                peer = create_model(meta.model_name, **peer_config(config), num_funcs=k).eval()
                peer_stages = stages_of(peer, (meta.mean, meta.std))
                rows += measure(
                    f"random, K={k}", peer_stages, images, elements[:1], args, bar, init=init
                )
    summary = aggregate(rows, shapes)
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "stability_samples.csv", rows)
    write_csv(args.out / "stability.csv", summary)
    write_json(args.out / "stability_bounds.json", bounds)
    title = f"Deformation stability, {args.images} {data} images, checkpoint {args.checkpoint}"
    plot(summary, trained, [format_element(g) for g in elements], args.out / "stability.png", title)
    text = markdown(summary, bounds, trained, seconds)
    (args.out / "stability.md").write_text(text, "utf-8")
    print(text, end="")
    log.info("wrote %s (%.0f s)", args.out, seconds)
    return 0


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
