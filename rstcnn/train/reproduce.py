"""Paper Tables 1-2: every model on RS-MNIST or RS-Fashion, N_tr 2000 / 5000, with and without
RST augmentation, over trials; mean +- std beside the paper's numbers.

    python train/reproduce.py --data rs-fashion --budget reduced --jobs 2
    python train/reproduce.py --data rs-mnist --budget full --device cuda    # the paper's protocol
    python train/reproduce.py --data rs-fashion --budget smoke               # seconds (CI)

Models: cnn, rst_cnn_fb, rst_cnn_sl, rot_cnn, scale_cnn, rst_cnn_plus_fb, rst_cnn_plus_sl and the
peers rdcf_plus, sesn, sfcnn, sfcnn_plus, sevf (sfcnn and sfcnn_plus need the peers extra, e2cnn).
Budgets (``BUDGETS``):

- ``full``: the paper's protocol: the registered (~500K / 1.6M parameter) models, 56x56 images,
  60 epochs, Adam lr 0.01 with a tenfold decay after 30, batch 128, 2,000 validation images,
  every remaining image tested, 5 trials (trial i: realisation i, seed i). A GPU job.
- ``reduced``: what 2 CPU cores do in about half an hour per data set: every model shrunk to
  ~12K parameters (channels ~(c, 2c, 3c), FC 48), images reduced 2x (56 -> 28 by 2x2
  averaging, the resolution the RS data was made at, zero-padded to 32 so three 2x2 poolings
  stay exact), 6 / 3 epochs for N_tr 2000 / 5000 at batch 64, 500 validation and 3,000 test
  images, one trial. Its numbers rank the models under equal budgets; they are not the
  paper's numbers.
- ``smoke``: tiny widths, 64 training images, one epoch (CI).

Each run is a train/run.py trial in ``--out/<data>/<model>-<N_tr>[-aug]-t<trial>`` (metrics.jsonl,
best.pt, last.pt, summary.json); finished runs (summary.json) are skipped and unfinished ones
resume from last.pt, so the command can be stopped and started again. ``--jobs N`` trains N
runs at once, one torch thread each by default. Writes ``table.md`` (train/report.py's mean +-
std beside the paper), ``results.csv``, ``accuracy.png`` and ``protocol.md`` into
``--out/<data>``.
"""

# ruff: noqa: E402  (as a script it re-executes before its imports: rstcnn.cli)
from __future__ import annotations

if __name__ == "__main__":  # re-exec with the retaining heap, then run as rstcnn.train.reproduce
    from rstcnn.cli import reproduce

    reproduce()

import argparse
import concurrent.futures as futures
import contextlib
import json
import logging
import multiprocessing
import os
import shlex
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train import engine, report
from rstcnn.train.budgets import (
    ALL_MODELS,
    BUDGETS,
    MODELS,
    RELATIVE_COST,
    Budget,
    budget_config,
    load_data,
    train_trial,
)
from rstcnn.train.config import TrainConfig
from rstcnn.train.experiments import plt, write_csv
from rstcnn.train.runtime import user_errors
from rstmodel import create_model
from rstmodel.checkpoint import upgrade_record

log = logging.getLogger("reproduce")


@dataclass(frozen=True)
class RunSpec:
    model: str
    train_size: int
    augment: bool
    trial: int

    @property
    def name(self) -> str:
        aug = "-aug" if self.augment else ""
        return f"{self.model}-{self.train_size}{aug}-t{self.trial}"


# ---------------------------------------------------------------- runs


def plan(
    budget: Budget,
    models: list[str],
    augment: list[bool],
    trials: int,
    train_sizes: list[int] | None = None,
    first_trial: int = 0,
) -> list[RunSpec]:
    """Every run, in the order they are made: without augmentation first, the larger N_tr
    first, then trial by trial, the models in ``MODELS`` order; so a call cut off by its
    deadline has filled the most-wanted cells, and the next call goes on from there. Trials
    ``first_trial`` .. ``trials - 1``: a shard of the trials, so that processes side by side
    train different trials of one model."""
    sizes = sorted(train_sizes or budget.train_sizes, reverse=True)
    ranked = sorted(models, key=ALL_MODELS.index)
    return [
        RunSpec(m, n, a, t)
        for a in sorted(augment)
        for n in sizes
        for t in range(first_trial, trials)
        for m in ranked
    ]


def run_config(spec: RunSpec, budget: Budget, opts: dict[str, Any]) -> TrainConfig:
    """The training config of one run."""
    method = {"method": opts["method"]} if opts.get("method") and spec.model != "cnn" else {}
    return budget_config(
        spec.model,
        spec.train_size,
        budget,
        data=opts["data"],
        realisation=spec.trial,
        seed=spec.trial,
        out=opts["root"] / spec.name,
        device=opts["device"],
        data_root=opts["data_root"],
        augment=spec.augment,
        bf16=bool(opts.get("bf16")),
        model_args=method,
    )


def run_one(spec: RunSpec, budget: Budget, opts: dict[str, Any]) -> dict[str, Any]:
    """Train (or resume) one run and return its summary.json."""
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    args = run_config(spec, budget, opts)
    return train_trial(args, lambda: load_data(args, budget, opts["data_root"]))[1]


def run_cost(spec: RunSpec, budget: Budget) -> float:
    """Relative training cost, for the ETA."""
    epochs = budget.epochs[spec.train_size]
    images = epochs * (spec.train_size + budget.val_size / 2) + (budget.test_size or 50000) / 2
    return images * RELATIVE_COST.get(spec.model, 1.0)


def finished(root: Path, spec: RunSpec, results: Path | None = None) -> dict[str, Any] | None:
    """The run's summary, from its folder or from the committed results (``keep``)."""
    paths = [root / spec.name / "summary.json"]
    if results is not None:
        paths.append(results / "runs" / spec.name / "summary.json")
    for path in paths:
        if path.is_file():
            return upgrade_record(json.loads(path.read_text(encoding="utf-8")))
    return None


PARKED = ("metrics.jsonl", "best.pt", "last.pt")  # copied in this order: last.pt marks "resumable"


def _copy_run(src: Path, dest: Path, files: tuple[str, ...] = PARKED) -> None:
    """Those of ``files`` that ``src`` has, in order, each copied atomically into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for file in files:
        if (src / file).is_file():
            tmp = dest / f".{file}.tmp"
            shutil.copyfile(src / file, tmp)
            tmp.replace(dest / file)


def keep(root: Path, results: Path, name: str) -> None:
    """Copy a finished run's summary and per-epoch metrics from ``root/<name>/`` to
    ``results/runs/<name>/``, the committed record that later calls (and other machines)
    count as done; done as each run finishes, so a call cut off later loses none."""
    if (root / name / "summary.json").is_file():  # the summary last: it marks "done"
        _copy_run(root / name, results / "runs" / name, ("metrics.jsonl", "summary.json"))


def park(root: Path, results: Path, name: str) -> bool:
    """Copy an unfinished run's ``metrics.jsonl``, ``best.pt`` and ``last.pt`` from
    ``root/<name>/`` to ``results/unfinished/<name>/``: the record is committed, so a later
    call on a fresh clone or another machine resumes the run from its last completed epoch
    (``unpark``) instead of starting it again. True where something was parked."""
    folder = root / name
    if (folder / "summary.json").is_file() or not (folder / "last.pt").is_file():
        return False
    _copy_run(folder, results / "unfinished" / name)
    return True


def unpark(root: Path, results: Path, name: str) -> bool:
    """Before a run: where ``root/<name>/`` has no ``last.pt`` and the record has a parked
    one (``park``), copy it there so the run resumes from it. True where it did."""
    parked = results / "unfinished" / name
    if (root / name / "last.pt").is_file() or not (parked / "last.pt").is_file():
        return False
    _copy_run(parked, root / name)
    return True


@contextlib.contextmanager
def parked_on_leaving(
    todo: list[RunSpec], done: dict[RunSpec, Any], root: Path, results: Path | None
):
    """However ``run_all`` ends (all done, Ctrl-C, ``--deadline``, an error), every run of
    ``todo`` left unfinished with a ``last.pt`` is parked in the record (``park``)."""
    try:
        yield
    finally:
        if results is not None:
            for spec in todo:
                if done[spec] is None and park(root, results, spec.name):
                    log.warning(
                        "%s is unfinished: parked in %s (commit it; the same command resumes it "
                        "anywhere)",
                        spec.name,
                        results / "unfinished" / spec.name,
                    )


def run_all(specs: list[RunSpec], budget: Budget, opts: dict[str, Any], jobs: int) -> list[dict]:
    """Every run not finished yet, ``jobs`` at a time in plan order; an ETA bar. Ctrl-C (or
    ``--deadline``) stops the run in progress at a batch boundary (its last.pt holds the last
    completed epoch) and starts no other."""
    done = {s: finished(opts["root"], s, opts.get("results")) for s in specs}
    todo = [s for s in specs if done[s] is None]
    results = opts.get("results")
    if results is not None:
        for spec in todo:
            if unpark(opts["root"], results, spec.name):
                log.info("%s: resuming from the record's unfinished/", spec.name)
    if opts.get("resume_only"):  # only the runs begun elsewhere (e.g. carried from a GPU)
        todo = [s for s in todo if (opts["root"] / s.name / "last.pt").is_file()]
    log.info("%d runs: %d finished, %d to go", len(specs), len(specs) - len(todo), len(todo))
    total = sum(run_cost(s, budget) for s in todo)
    bar = tqdm(total=round(total), desc="runs (cost-weighted ETA)", unit="u", dynamic_ncols=True)
    began = time.perf_counter()

    def record(spec: RunSpec, summary: dict[str, Any]) -> None:
        done[spec] = summary
        if results is not None:
            keep(opts["root"], results, spec.name)
            shutil.rmtree(results / "unfinished" / spec.name, ignore_errors=True)
        bar.update(round(run_cost(spec, budget)))
        log.info(
            "%s: test %.2f %% (%.0f s); %d to go, %.0f s elapsed",
            spec.name,
            100 * summary["test_acc"],
            summary.get("session_seconds", 0.0),
            sum(v is None for v in done.values()),
            time.perf_counter() - began,
        )

    def failed(spec: RunSpec, err: BaseException) -> None:
        log.error(
            "%s failed: %s (its folder keeps what it finished; rerun to resume)", spec.name, err
        )

    with contextlib.closing(bar), parked_on_leaving(todo, done, opts["root"], results):
        if jobs <= 1:
            for spec in todo:
                try:
                    record(spec, run_one(spec, budget, opts))
                except (engine.SetupError, engine.TrainingError) as err:
                    failed(spec, err)
                except (engine.Interrupted, KeyboardInterrupt) as stop:
                    log.warning(
                        "%s stopped by %s; rerun the same command to resume", spec.name, stop
                    )
                    break
        else:
            context = multiprocessing.get_context("spawn")
            with futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
                running = {pool.submit(run_one, s, budget, opts): s for s in todo}
                for future in futures.as_completed(running):
                    try:
                        record(running[future], future.result())
                    except Exception as err:  # one failed run must not stop the others
                        failed(running[future], err)
    return [done[s] for s in specs if done[s] is not None]


def measure_throughput(budget: Budget, models: list[str], steps: int = 3) -> list[dict]:
    """Training and eval images per second of each model at the budget's size and widths
    (batch ``budget.batch_size``, the median of ``steps`` steps after a warm-up, random data)."""
    rows = []
    for name in tqdm(models, desc="throughput", unit="model"):
        overrides: dict[str, Any] = {"input_size": budget.image_size}
        if budget.widths is not None:
            overrides["channels"] = budget.widths[name]
        if budget.hidden is not None:
            overrides["hidden"] = budget.hidden
        torch.manual_seed(0)
        model = create_model(name, **overrides)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        x = torch.randn(budget.batch_size, 1, budget.image_size, budget.image_size)
        y = torch.randint(0, 10, (budget.batch_size,))
        model.train()
        times = []
        for _ in range(steps + 1):
            began = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - began)
        model.eval()
        evals = []
        with torch.inference_mode():
            for _ in range(steps + 1):
                began = time.perf_counter()
                model(x)
                evals.append(time.perf_counter() - began)
        rows.append(
            {
                "model": name,
                "params": sum(p.numel() for p in model.parameters()),
                "train_img_per_s": budget.batch_size / float(np.median(times[1:])),
                "eval_img_per_s": budget.batch_size / float(np.median(evals[1:])),
                "threads": torch.get_num_threads(),
            }
        )
    return rows


# ---------------------------------------------------------------- outputs


def results_rows(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in summaries:
        paper = report.paper_accuracy(s["model"], s["data"], s["train_size"], s["augment"], "test")
        rows.append(
            {
                "model": s["model"],
                "data": s["data"],
                "train_size": s["train_size"],
                "augment": s["augment"],
                "seed": s["seed"],
                "realisation": s["realisation"],
                "epochs": s["epochs"],
                "params": s["num_params"],
                "input_size": s["config"]["input_size"],
                "test_images": s.get("test_size"),
                "test_acc": 100 * s["test_acc"],
                "best_epoch": s["best_epoch"],
                "train_seconds": s["train_seconds"],
                "paper_acc": "" if paper is None else paper[0],
            }
        )
    return rows


def wide_table(rows: list[dict[str, Any]], data: str) -> str:
    """Markdown: one row per model, this code's mean +- std beside the paper's per setting
    (the layout of the paper's Tables 1-2)."""
    settings = sorted({(r["train_size"], r["augment"]) for r in rows}, key=lambda s: (s[1], s[0]))
    head = ["model", "params"]
    for size, aug in settings:
        name = f"N_tr {size}{' +aug' if aug else ''}"
        head += [name, "paper"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for model in [m for m in ALL_MODELS if any(r["model"] == m for r in rows)]:
        mine = [r for r in rows if r["model"] == model]
        cells = [model, f"{mine[0]['params']:,}"]
        for size, aug in settings:
            accs = [r["test_acc"] for r in mine if (r["train_size"], r["augment"]) == (size, aug)]
            cells.append(f"{report.mean_std(accs)} (n={len(accs)})" if accs else "-")
            paper = report.paper_accuracy(model, data, size, aug, "test")
            cells.append("-" if paper is None else f"{paper[0]:.2f} ± {paper[1]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], data: str, budget_name: str, path: Path) -> None:
    pyplot = plt()
    models = [m for m in ALL_MODELS if any(r["model"] == m for r in rows)]
    settings = sorted({(r["train_size"], r["augment"]) for r in rows})
    fig, ax = pyplot.subplots(figsize=(max(6.0, 1.3 * len(models) + 2), 4.2))
    width = 0.8 / max(len(settings), 1)
    for i, (size, aug) in enumerate(settings):
        accs, errs, papers = [], [], []
        for m in models:
            vals = [
                r["test_acc"]
                for r in rows
                if (r["model"], r["train_size"], r["augment"]) == (m, size, aug)
            ]
            accs.append(float(np.mean(vals)) if vals else np.nan)
            errs.append(float(np.std(vals)) if vals else 0.0)
            paper = report.paper_accuracy(m, data, size, aug, "test")
            papers.append(np.nan if paper is None else paper[0])
        xs = np.arange(len(models)) + (i - (len(settings) - 1) / 2) * width
        label = f"N_tr = {size}{', augmented' if aug else ''}"
        bars = ax.bar(xs, accs, width, yerr=errs, capsize=2, label=label)
        ax.plot(xs, papers, "_", color=bars.patches[0].get_facecolor(), markersize=12, mew=2)
    ax.plot([], [], "_", color="gray", markersize=12, mew=2, label="paper (same colour)")
    ax.set_xticks(np.arange(len(models)), models, rotation=20, ha="right")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{data}, budget '{budget_name}': test accuracy by model (bars: this code)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def protocol_text(
    args: argparse.Namespace,
    budget: Budget,
    argv: list[str] | None = None,
    models: list[str] | None = None,
) -> str:
    """The protocol of this call's runs, or (``models``: every model in the committed record)
    of a record that several calls, shards side by side, filled."""
    params = {}
    for m in models or args.models:
        overrides = {"input_size": budget.image_size}
        if budget.widths is not None:
            overrides["channels"] = budget.widths[m]
        if budget.hidden is not None:
            overrides["hidden"] = budget.hidden
        params[m] = sum(p.numel() for p in create_model(m, **overrides).parameters())
    lines = [
        f"# {args.data}, budget `{args.budget}`",
        "",
        ("Runs made by several calls (shards), the last: " if models else "Command: ")
        + f"`{shlex.join(['python', 'train/reproduce.py', *(argv or sys.argv[1:])])}`",
        "",
        "Each run's own command, device, precision and times are in its summary.json"
        + (" (`runs/`)." if args.results else "."),
        "",
        f"- images {budget.image_size}x{budget.image_size}"
        + (" (2x reduced to 28x28, zero-padded)" if budget.image_size != 56 else ""),
        f"- epochs per N_tr {budget.epochs}; Adam lr 0.01, tenfold decay after half; "
        f"batch {budget.batch_size}",
        f"- validation {budget.val_size} images (best epoch), test "
        + ("all remaining" if budget.test_size is None else f"{budget.test_size}")
        + (
            " images; trials and augmentation per cell in table.md"
            if models
            else f" images; trials {args.trials}; augmentation {args.augment}"
        ),
        "- parameters: " + ", ".join(f"{m} {n:,}" for m, n in params.items()),
    ]
    return "\n".join(lines) + "\n"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every runner of protocol runs (this command, train/k_sweep.py)."""
    parser.add_argument(
        "--bf16", action="store_true", help="train in bfloat16 autocast (train/run.py --bf16)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-root", type=Path, default=None, help="RS source files")
    parser.add_argument("--out", type=Path, default=Path("outputs/reproduce"))
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long as Ctrl-C does (the run in progress keeps its last "
        "completed epoch; the same command resumes)",
    )


def run_options(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """What ``run_all`` and ``run_one`` need of a runner's parsed options."""
    return {
        "data": args.data,
        "root": root,
        "device": args.device,
        "data_root": args.data_root,
        "threads": args.threads,
        "bf16": args.bf16,
        "method": getattr(args, "method", None),
        "results": args.results,
        "resume_only": getattr(args, "resume_only", False),
    }


@contextlib.contextmanager
def deadline(seconds: float | None):
    """After ``seconds`` (None: never) the process gets SIGINT, which stops the trial in
    progress at its next batch boundary as Ctrl-C does; disarmed on leaving."""
    if seconds is None:
        yield
        return
    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def record_summaries(budget: Budget, args: argparse.Namespace, root: Path) -> list[dict]:
    """Every finished run of the record (and of ``root``) in the space ``--report`` covers:
    the paper's models and this call's, both augmentation settings, the budget's N_tr, the
    budget's trials or this call's if more; in plan order."""
    models = list(dict.fromkeys([*MODELS, *args.models]))
    trials = max(args.trials, budget.trials)
    specs = plan(budget, models, [False, True], trials)
    done = (finished(root, spec, args.results) for spec in specs)
    return [summary for summary in done if summary is not None]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, choices=("rs-mnist", "rs-fashion"))
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="reduced")
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS),
        choices=ALL_MODELS,
        help="default: the paper's models (the basis-size sweep's are train/k_sweep.py's)",
    )
    parser.add_argument(
        "--augment",
        choices=("both", "no", "yes"),
        default="both",
        help="with and/or without RST augmentation",
    )
    parser.add_argument("--trials", type=int, default=None, help="trials (budget default)")
    parser.add_argument(
        "--first-trial",
        type=int,
        default=0,
        help="train only trials FIRST_TRIAL .. TRIALS-1 (processes side by side then train "
        "different trials of one model)",
    )
    parser.add_argument(
        "--train-sizes", nargs="+", type=int, default=None, help="N_tr values (budget default)"
    )
    parser.add_argument(
        "--method",
        choices=("auto", "direct", "fft", "tuned"),
        default=None,
        help="the RST models' convolution method (default: the models' own, auto)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    add_run_arguments(parser)
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="committed record: tables and each finished run's summary and metrics "
        "(default results/reproduce/<data>-<budget> for the full budget); runs found there "
        "count as done",
    )
    parser.add_argument(
        "--resume-only",
        action="store_true",
        help="train only the unfinished runs that have a last.pt in --out (e.g. carried from "
        "a GPU call); start no new run",
    )
    parser.add_argument(
        "--measure", action="store_true", help="only measure each model's throughput"
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="train nothing: write the tables from the runs already finished (in --out and "
        "--results), e.g. after several calls filled different cells",
    )
    args = parser.parse_args(argv)
    args.trials = args.trials or BUDGETS[args.budget].trials
    if args.jobs < 1 or args.trials < 1:
        parser.error("--jobs and --trials must be positive")
    if not 0 <= args.first_trial < args.trials:
        hint = ""
        if args.first_trial >= args.trials:
            hint = (
                f"; --trials counts all trials, so to train only trial {args.first_trial} pass "
                f"--trials {args.first_trial + 1} --first-trial {args.first_trial}"
            )
        parser.error(
            f"--first-trial must be in 0 .. {args.trials - 1} (--trials {args.trials}){hint}"
        )
    if args.threads is None:
        args.threads = 1 if args.jobs > 1 else None
    args.augment = {"both": [False, True], "no": [False], "yes": [True]}[args.augment]
    if args.results is None and args.budget == "full":
        args.results = Path("results") / "reproduce" / f"{args.data}-{args.budget}"
    if args.deadline is not None and (args.deadline <= 0 or args.jobs != 1):
        parser.error("--deadline takes a positive number of seconds and --jobs 1")
    sizes = BUDGETS[args.budget].train_sizes
    if args.train_sizes and not set(args.train_sizes) <= set(sizes):
        parser.error(f"--train-sizes: the {args.budget} budget has N_tr {sizes}")
    return args


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine.setup_cli()
    budget = BUDGETS[args.budget]
    root = args.out / args.data / args.budget
    root.mkdir(parents=True, exist_ok=True)
    if args.measure:
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = measure_throughput(budget, args.models)
        write_csv(root / "throughput.csv", rows)
        for r in rows:
            print(
                f"{r['model']:16s} {r['params']:>8,} params  train {r['train_img_per_s']:7.1f} "
                f"img/s  eval {r['eval_img_per_s']:7.1f} img/s  ({r['threads']} threads)"
            )
        return 0
    opts = run_options(args, root)
    specs = plan(budget, args.models, args.augment, args.trials, args.train_sizes, args.first_trial)
    if args.report:
        done = (finished(root, spec, args.results) for spec in specs)
        summaries = [summary for summary in done if summary is not None]
    else:
        (root / "protocol.md").write_text(protocol_text(args, budget, argv), encoding="utf-8")
        (root / "budget.json").write_text(
            json.dumps(asdict(budget), default=str, indent=2), "utf-8"
        )
        try:
            with deadline(args.deadline):  # as Ctrl-C: each trial stops at a batch boundary
                summaries = run_all(specs, budget, opts, args.jobs)
        except (engine.SetupError, engine.TrainingError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    if not summaries:
        print("error: no run finished", file=sys.stderr)
        return 1
    complete = len(summaries) == len(specs)
    if args.results and not args.report:
        # a shard trains some cells; the record's tables keep every cell finished so far
        summaries = record_summaries(budget, args, root)
    table = report.report(summaries)
    rows = results_rows(summaries)
    for folder in [root] + ([args.results] if args.results else []):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "table.md").write_text(table, encoding="utf-8")
        write_csv(folder / "results.csv", rows)
        (folder / "table_wide.md").write_text(wide_table(rows, args.data), encoding="utf-8")
        plot(rows, args.data, args.budget, folder / "accuracy.png")
        log.info("wrote %s", folder)
    if args.results and not args.report:
        for spec in specs:  # runs finished in --out by an earlier call, too
            keep(root, args.results, spec.name)
        recorded = {s["model"] for s in summaries}
        models = [m for m in ALL_MODELS if m in recorded]
        (args.results / "protocol.md").write_text(
            protocol_text(args, budget, argv, models), encoding="utf-8"
        )
    print(table, end="")
    return 0 if args.report or complete else 1
