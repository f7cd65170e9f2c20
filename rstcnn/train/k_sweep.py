"""Speed against accuracy over the basis size K and the rotation grid, at the paper's
parameter count.

    python train/k_sweep.py --budget full --device cuda --bf16 [--deadline S]   # a GPU job
    python train/k_sweep.py --budget reduced                                      # 2 CPU cores
    python train/k_sweep.py --budget full --report      # from the record only, no training

At ~500K parameters K sets the channel widths (the mixing costs ~ Cin Cout K per output, the
parameters ~ Cin Cout K too, so a smaller K buys wider channels) and so the cost. The sweep's
models (``budgets.SWEEP_MODELS``): ``rst_cnn_fb_k6`` and ``rst_cnn_fb_k9`` (the K lowest FB
modes at the 2.5 px smallest radius), ``rst_cnn_fb`` (K = 12: every mode below Nyquist there),
``rst_cnn_fb_k17`` (a 3 px smallest radius, which holds 17 modes below Nyquist; kernels 5..17),
``rst_cnn_fb_ref`` (the public code's K = 49 basis) and ``rst_cnn_fb_nr4`` (K = 12 on Nr = 4
rotations instead of 8: the quarter turns only, exact on the pixel grid, half the branches
and so half the cost at the same parameters).

1. Trains ``--models`` (default all) on RS-Fashion at one N_tr (default 5000) without
   augmentation, ``--trials`` trials (default 3), as ``train/reproduce.py`` runs (same
   folders, resumable). Each finished run goes into a committed record at once: at the full
   budget the protocol's own, so ``rst_cnn_fb``'s protocol runs count for both; at the others
   ``--sweep-out/runs``.
2. Reports every sweep model, whichever were trained in this call: its accuracy over every
   finished trial in ``--out`` or the record, and its evaluation timed on this machine at the
   budget's widths and image size (ms per image at batch ``--time-batch``, default the
   budget's batch, and at batch 1). So a call that trains one model rewrites the report
   without dropping the others' rows.
3. Writes ``--sweep-out`` (default ``results/k-sweep/<data>-<budget>``): ``sweep.md``,
   ``sweep.json`` and ``accuracy-vs-time.png``, and says which setting is the cheapest whose
   accuracy is at least ``rst_cnn_fb``'s (the default) within the trials' spread: its mean
   no lower than the default's less the larger of the two standard deviations, each from at
   least 3 trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train import engine, reproduce
from rstcnn.train.budgets import BUDGETS, SWEEP_MODELS, Budget, budget_config
from rstcnn.train.experiments import plt
from rstcnn.train.runtime import use_retaining_allocator, user_errors
from rstmodel import create_model
from rstmodel.layers import native

DEFAULT = "rst_cnn_fb"
MIN_TRIALS = 3  # trials each side needs before a cheaper setting may replace the default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python train/k_sweep.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", default="rs-fashion", choices=("rs-fashion", "rs-mnist"))
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="reduced")
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(SWEEP_MODELS),
        choices=SWEEP_MODELS,
        help="the models to train (the report covers every sweep model)",
    )
    parser.add_argument("--train-size", type=int, default=None, help="N_tr (default 5000)")
    parser.add_argument("--trials", type=int, default=MIN_TRIALS)
    reproduce.add_run_arguments(parser)
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="committed record of finished runs (default: the protocol's, "
        "results/reproduce/<data>-full, for the full budget; else --sweep-out)",
    )
    parser.add_argument("--sweep-out", type=Path, default=None)
    parser.add_argument("--report", action="store_true", help="train nothing")
    parser.add_argument("--time-batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch size")
    args = parser.parse_args(argv)
    budget = BUDGETS[args.budget]
    if args.train_size is None:
        args.train_size = 5000 if 5000 in budget.train_sizes else max(budget.train_sizes)
    if args.train_size not in budget.train_sizes:
        parser.error(f"--train-size: the {args.budget} budget has N_tr {budget.train_sizes}")
    if args.trials < 1 or args.repeats < 1:
        parser.error("--trials and --repeats must be positive")
    if args.deadline is not None and args.deadline <= 0:
        parser.error("--deadline takes a positive number of seconds")
    if args.sweep_out is None:
        args.sweep_out = Path("results") / "k-sweep" / f"{args.data}-{args.budget}"
    if args.results is None:  # the full budget shares the protocol's record
        full = Path("results") / "reproduce" / f"{args.data}-full"
        args.results = full if args.budget == "full" else args.sweep_out
    args.time_batch = args.time_batch or budget.batch_size
    return args


def build(model: str, budget: Budget, train_size: int) -> torch.nn.Module:
    """The model exactly as the sweep trains it (the budget's widths and image size)."""
    config = budget_config(model, train_size, budget)
    return create_model(model, input_size=budget.image_size, **config.model_args)


def eval_ms(model: torch.nn.Module, batch: int, size: int, repeats: int, device) -> float:
    """Median ms per image of an eval-mode forward pass at ``batch`` (after one warm-up)."""
    model = model.to(device).eval()
    x = torch.randn(batch, 1, size, size, device=device)
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times) / batch


def setting(row: dict[str, Any]) -> str:
    """A sweep row's structure in words: "K = 12", or "K = 12, Nr = 4" off the paper's Nr."""
    nr = row.get("Nr", 8)  # records written before the rotation grid was swept hold no Nr
    return f"K = {row['K']}" + (f", Nr = {nr}" if nr != 8 else "")


def spread_verdict(rows: list[dict[str, Any]]) -> str:
    """Which setting is cheapest at the default's accuracy (module docstring), in words."""
    default = next((r for r in rows if r["model"] == DEFAULT), None)
    if default is None or default["trials"] == 0:
        return f"no verdict: {DEFAULT} has no finished trial"
    if default["trials"] < MIN_TRIALS:
        return f"no verdict yet: fewer than {MIN_TRIALS} trials of {DEFAULT}"
    cheaper = sorted(
        (r for r in rows if r["trials"] and r["eval_ms"] < default["eval_ms"]),
        key=lambda r: r["eval_ms"],
    )
    for row in cheaper:
        if row["trials"] < MIN_TRIALS:
            return (
                f"no verdict yet: fewer than {MIN_TRIALS} trials of {row['model']}, the "
                f"cheapest candidate ({row['eval_ms']:.3g} against {default['eval_ms']:.3g} ms/img)"
            )
        spread = max(row["std"], default["std"])
        if row["mean"] >= default["mean"] - spread:  # as accurate within the spread, or more
            return (
                f"{row['model']} ({setting(row)}) is at least as accurate as {DEFAULT} within "
                f"the trials' spread ({row['mean']:.2f} against {default['mean']:.2f} %, spread "
                f"{spread:.2f}) at {default['eval_ms'] / row['eval_ms']:.2f}x less eval time "
                "per image"
            )
    return f"{DEFAULT} stays: no cheaper setting is within the trials' spread of its accuracy"


def finished_trials(results: Path, model: str, train_size: int) -> list[dict]:
    """The summaries of every finished trial of ``model`` at ``train_size`` without
    augmentation in the committed record ``results`` (``main`` keeps ``--out``'s runs there
    first), in trial order."""
    paths = results.glob(f"runs/{model}-{train_size}-t*/summary.json")
    trials = sorted(int(t) for p in paths if (t := p.parent.name.rpartition("-t")[2]).isdigit())
    specs = (reproduce.RunSpec(model, train_size, False, t) for t in trials)
    return [d for d in (reproduce.finished(results / "runs", s) for s in specs) if d is not None]


def sweep_rows(
    args: argparse.Namespace, budget: Budget, device: torch.device
) -> list[dict[str, Any]]:
    rows = []
    for model in SWEEP_MODELS:
        done = finished_trials(args.results, model, args.train_size)
        accs = [100 * d["test_acc"] for d in done]
        net = build(model, budget, args.train_size)
        spec = net.config.basis_spec()
        rows.append(
            {
                "model": model,
                "K": net.config.num_funcs,
                "Nr": net.config.rotations,
                "base_radius": float(spec.scales[0]),
                "kernels": list(spec.kernel_sizes),
                "channels": list(net.config.channels),
                "params": sum(p.numel() for p in net.parameters()),
                "trials": len(accs),
                "accuracies": [round(a, 2) for a in accs],
                "mean": statistics.fmean(accs) if accs else float("nan"),
                "std": statistics.pstdev(accs) if accs else 0.0,  # ddof=0, as report.mean_std
                "eval_ms": eval_ms(net, args.time_batch, budget.image_size, args.repeats, device),
                "eval_ms_b1": eval_ms(net, 1, budget.image_size, args.repeats, device),
            }
        )
        print(f"{model}: {len(accs)} trials, eval {rows[-1]['eval_ms']:.3g} ms/img", flush=True)
    return rows


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({native.build_name()}), {torch.get_num_threads()} threads"


def write(rows: list[dict[str, Any]], args: argparse.Namespace, where: str) -> str:
    out = args.sweep_out
    out.mkdir(parents=True, exist_ok=True)
    verdict = spread_verdict(rows)
    lines = [
        f"# Basis size K and rotations Nr against accuracy and speed: {args.data}, "
        f"{args.budget} budget, N_tr {args.train_size}, no augmentation",
        "",
        f"Eval time measured on {where} (torch {torch.__version__}), float32, eval mode, "
        f"median of {args.repeats}; accuracy: test accuracy over the finished trials.",
        "",
        f"| model | K | Nr | smallest radius (px) | kernels | channels | params | trials "
        f"| test accuracy (%) | eval ms/img (batch {args.time_batch}) | eval ms (batch 1) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "-" if not r["trials"] else f"{r['mean']:.2f} ± {r['std']:.2f}"
        lines.append(
            f"| {r['model']} | {r['K']} | {r['Nr']} | {r['base_radius']:g} | {r['kernels']} | "
            f"{tuple(r['channels'])} | {r['params']:,} | {r['trials']} | {acc} | "
            f"{r['eval_ms']:.3g} | {r['eval_ms_b1']:.3g} |"
        )
    lines += ["", f"Verdict: {verdict}.", ""]
    text = "\n".join(lines)
    (out / "sweep.md").write_text(text, encoding="utf-8")
    record = {"machine": where, "verdict": verdict, "args": vars(args), "rows": rows}
    (out / "sweep.json").write_text(json.dumps(record, indent=2, default=str) + "\n", "utf-8")
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6.4, 4.2))
    for r in (r for r in rows if r["trials"]):
        ax.errorbar(r["eval_ms"], r["mean"], yerr=r["std"], fmt="o", capsize=4)
        ax.annotate(
            f"{setting(r).replace(' = ', '=')} ({r['trials']})",
            (r["eval_ms"], r["mean"]),
            xytext=(6, 4),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"eval time per image, ms (batch {args.time_batch}, {where})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(
        f"{args.data}, {args.budget} budget, N_tr {args.train_size}: K, Nr against speed (trials)"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "accuracy-vs-time.png", dpi=110)
    pyplot.close(fig)
    return text


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine.setup_cli(args.threads)
    budget = BUDGETS[args.budget]
    root = args.out / args.data / args.budget
    root.mkdir(parents=True, exist_ok=True)
    # trial by trial (plan's order): a call cut off by its deadline has one more trial of
    # every model before the next trial of any
    specs = reproduce.plan(budget, args.models, [False], args.trials, [args.train_size])
    if not args.report:
        try:
            with reproduce.deadline(args.deadline):
                reproduce.run_all(specs, budget, reproduce.run_options(args, root), jobs=1)
        except (engine.SetupError, engine.TrainingError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    for model in SWEEP_MODELS:  # runs an earlier call left in --out go into the record
        for folder in sorted(root.glob(f"{model}-{args.train_size}-t*")):
            reproduce.keep(root, args.results, folder.name)
    device = engine.pick_device(args.device)
    rows = sweep_rows(args, budget, device)
    print(write(rows, args, machine(device)), end="")
    return 0


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
