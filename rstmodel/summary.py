"""``python -m rstmodel.summary``: every registered model's size and group configuration."""

from __future__ import annotations

import argparse

from .models import create_model, list_models, model_description


def describe(name: str) -> dict[str, str]:
    model = create_model(name)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {
        "model": name,
        "params": f"{params:,}",
        "input": f"[B, {cfg.in_channels}, {cfg.input_size}, {cfg.input_size}]",
    }
    spec = getattr(model, "spec", None)  # RST models keep their basis spec
    if spec is not None:
        row.update(
            basis=f"{spec.family.value} K={spec.num_funcs}",
            group=f"Nr={spec.rotations} Ns={spec.num_scales}",
            taps=f"L_theta={getattr(cfg, 'rotation_taps', 1)} L_alpha={getattr(cfg, 'scale_taps', 1)}",
            kernels="/".join(str(k) for k in spec.kernel_sizes),
        )
    elif hasattr(cfg, "rotations"):  # the e2cnn peers: regular fields of the cyclic group
        row.update(
            basis="e2cnn steerable",
            group=f"C{cfg.rotations} regular",
            taps=f"L_theta={cfg.rotations}",
            kernels=str(cfg.kernel_size),
        )
    row["about"] = model_description(name)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", help="model names (default: all registered)")
    args = parser.parse_args(argv)
    names = args.models or list_models()
    rows = [describe(n) for n in names]
    cols = ["model", "params", "input", "basis", "group", "taps", "kernels", "about"]
    widths = {c: max(len(c), *(len(r.get(c, "-")) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(r.get(c, "-").ljust(widths[c]) for c in cols))


if __name__ == "__main__":
    main()
