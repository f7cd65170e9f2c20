"""``python -m rstcnn.train.model_bench``: RST models vs the plain CNN, measured in one run.

For each model: train step (forward + backward + Adam) at the training batch, eval time at
that batch, eval latency at batch 1, and peak resident memory. Prints a markdown table and
the ratio of each model to the first one (the baseline, ``cnn`` by default).

The models take turns: each lives in its own worker process (built once), and every round
times each model once, one after another, so a ratio compares two figures taken seconds
apart. A shared 2-core machine drifts by 1.3x over minutes; a ratio of two medians taken
minutes apart carries that drift, the median of the per-round ratios does not. Peak memory
comes from a separate short process per model (one step of each kind), so it is the model's
own.

``--against REV`` also builds every model from git revision REV (checked out into a
temporary worktree; its library, this bench) and prints current / REV, the two revisions
taking turns in each round. On the CPU both revisions of a model share one worker process
(two processes would each keep a retained heap of the model's size); on CUDA each has its
own (the library's Triton operators are registered per process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.runtime import use_retaining_allocator

REPO = Path(__file__).resolve().parents[2]
FIGURES = ("train", "eval", "eval1")
# A figure shorter than this is called again within its turn, and the first call dropped:
# the turn's first call pays for waking the cores (on this project's 2-core VM, a batch-1
# CNN forward takes 2 ms back to back and 14 ms after 50 ms idle) and for the other
# process's OpenMP threads still spinning after its turn.
SHORT_S = 0.1


def _load_model(name: str, tree: Path, overrides: dict) -> torch.nn.Module:
    """``name`` built by the library of checkout ``tree`` (any ``rstmodel`` imported before
    is dropped from ``sys.modules`` first, so two checkouts can live in one process)."""
    for module in [m for m in sys.modules if m == "rstmodel" or m.startswith("rstmodel.")]:
        del sys.modules[module]
    sys.path.insert(0, str(tree))
    try:
        from rstmodel import create_model
    finally:
        sys.path.remove(str(tree))
    torch.manual_seed(0)
    return create_model(name, **overrides)


class _Case:
    """One model from one checkout, with its inputs and optimiser: ``run(figure)`` times
    one train step, one eval at the batch, or one eval at batch 1."""

    def __init__(self, name: str, tree: Path, args: argparse.Namespace, device: torch.device):
        overrides = {"method": args.method} if args.method and name != "cnn" else {}
        self.model = _load_model(name, tree, overrides).to(device)
        self.file = type(self.model).forward.__code__.co_filename
        cfg = self.model.config
        shape = (cfg.in_channels, cfg.input_size, cfg.input_size)
        self.x = torch.randn(args.batch, *shape, device=device)
        self.x1 = self.x[:1].clone()
        self.y = torch.randint(0, cfg.num_classes, (args.batch,), device=device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.device = device
        self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def _mode(self, training: bool) -> None:
        if self.model.training != training:  # train() drops the eval-mode filter cache
            self.model.train(training)

    def _train(self) -> None:
        self._mode(True)
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def _eval(self, x: torch.Tensor) -> None:
        self._mode(False)
        with torch.no_grad(), self.autocast():
            self.model(x)

    def _call(self, fn) -> float:
        start = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def run(self, figure: str) -> float:
        """One turn: the figure's time; a figure under ``SHORT_S`` is called until twice
        that has passed, and the median of the calls after the first is its time."""
        fn = {
            "train": self._train,
            "eval": lambda: self._eval(self.x),
            "eval1": lambda: self._eval(self.x1),
        }[figure]
        first = self._call(fn)
        if first >= SHORT_S:
            return first
        times, spent = [], first
        while spent < 2 * SHORT_S or not times:
            times.append(self._call(fn))
            spent += times[-1]
        return statistics.median(times)

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _serve(names: list[str], trees: list[Path], args: argparse.Namespace) -> None:
    """Worker: build one case per (name, tree), then answer ``{"case": i, "figure": f}``
    lines on stdin with ``{"s": seconds}``; ``{"peak": true}``: run each figure once and
    answer the peak memory."""
    device = torch.device(args.device)
    cases = [_Case(name, tree, args, device) for name, tree in zip(names, trees, strict=True)]
    print(json.dumps([{"file": c.file, "params": c.params()} for c in cases]), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("peak"):
            for figure in FIGURES:
                cases[0].run(figure)
            print(json.dumps({"peak_gib": _peak_gib(device)}), flush=True)
        else:
            print(json.dumps({"s": cases[ask["case"]].run(ask["figure"])}), flush=True)


class _Worker:
    """A worker process holding the cases ``[(name, tree), ...]``."""

    def __init__(self, cases: list[tuple[str, Path]], args: argparse.Namespace):
        cmd = [sys.executable, "-m", "rstcnn.train.model_bench", "--serve"]
        for name, tree in cases:
            cmd += ["--case", name, str(tree)]
        cmd += ["--batch", str(args.batch), "--device", args.device]
        if args.method:
            cmd += ["--method", args.method]
        if args.bf16:
            cmd.append("--bf16")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.info = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"model_bench worker {self.proc.args} exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, **ask) -> dict:
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


@dataclass
class _Row:
    model: str
    tree: Path
    worker: _Worker = None
    index: int = 0
    params: int = 0
    file: str = ""
    times: dict = field(default_factory=lambda: {f: [] for f in FIGURES})
    peak_gib: float = 0.0

    def median(self, figure: str) -> float:
        return statistics.median(self.times[figure])


def _per_round_ratio(a: _Row, b: _Row, figure: str) -> float:
    """Median over rounds of a's time over b's time in the same round."""
    return statistics.median(x / y for x, y in zip(a.times[figure], b.times[figure], strict=True))


def measure(rows: list[_Row], args: argparse.Namespace) -> None:
    """Fill in every row's times (warm-up turn, then ``repeats`` rounds of turns; batch 1
    at least 5 rounds), parameters and peak memory."""
    by_worker: dict[tuple, list[_Row]] = {}
    for row in rows:
        key = (row.model,) if args.device == "cpu" else (row.model, row.tree)
        by_worker.setdefault(key, []).append(row)
    for group in by_worker.values():
        print(f"building {group[0].model} ...", file=sys.stderr)
        worker = _Worker([(r.model, r.tree) for r in group], args)
        for index, (row, info) in enumerate(zip(group, worker.info, strict=True)):
            row.worker, row.index, row.params, row.file = (
                worker,
                index,
                info["params"],
                info["file"],
            )
    rounds = {"train": args.repeats, "eval": args.repeats, "eval1": max(args.repeats, 5)}
    total = sum((n + 1) * len(rows) for n in rounds.values())
    with tqdm(total=total, desc="turns", unit="turn", file=sys.stderr) as bar:
        for figure, n in rounds.items():
            for turn in range(n + 1):  # turn 0: warm-up (caches, allocator, primitives)
                for row in rows:
                    seconds = row.worker.ask(case=row.index, figure=figure)["s"]
                    if turn:
                        row.times[figure].append(seconds)
                    bar.update()
    for worker in {id(r.worker): r.worker for r in rows}.values():
        worker.close()
    for row in rows:  # peak memory: a fresh process per row
        print(f"peak memory of {row.model} ({row.tree}) ...", file=sys.stderr)
        worker = _Worker([(row.model, row.tree)], args)
        row.peak_gib = worker.ask(peak=True)["peak_gib"]
        worker.close()


@contextlib.contextmanager
def _worktree(rev: str):
    """A temporary detached git worktree of this repository at ``rev``."""
    with tempfile.TemporaryDirectory(prefix="rstcnn-bench-") as tmp:
        path = Path(tmp) / "tree"
        git = ["git", "-C", str(REPO)]
        done = subprocess.run(
            [*git, "worktree", "add", "--detach", str(path), rev], capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(f"--against {rev}: git worktree add failed: {done.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(path)], check=False)


def _report(rows: list[_Row], old_rows: list[_Row], args: argparse.Namespace) -> None:
    from rstmodel.layers import native  # this tree's: which kernels the CPU runs

    device = torch.device(args.device)
    base = rows[0]
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()} ({native.build_name()}), "
        f"{torch.get_num_threads()} threads"
    )
    memory = "peak GPU memory" if device.type == "cuda" else "peak RSS"
    precision = "bfloat16 autocast" if args.bf16 else "float32"
    print(
        f"\n{where}; torch {torch.__version__}; {precision}; batch {args.batch}; "
        f"median of {args.repeats} rounds (batch 1: {max(args.repeats, 5)}), the models "
        f"taking turns; each ratio the median of the per-round ratios"
    )
    b, over = args.batch, f" / {base.model}"
    print(
        f"\n| model | params | train step (s) | eval b{b} (s) | eval b1 (ms) | {memory} (GiB) "
        f"| train{over} | eval b{b}{over} | eval b1{over} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratios = " | ".join(f"{_per_round_ratio(r, base, f):.1f}x" for f in FIGURES)
        print(
            f"| {r.model} | {r.params:,} | {r.median('train'):.3f} | {r.median('eval'):.3f} "
            f"| {r.median('eval1') * 1e3:.1f} | {r.peak_gib:.2f} | {ratios} |"
        )
    if old_rows:
        print(f"\ncurrent / {args.against} (below 1: the current code is faster or smaller)")
        print(f"\n| model | train step | eval b{args.batch} | eval b1 | {memory} |")
        print("|---|---|---|---|---|")
        for new, old in zip(rows, old_rows, strict=True):
            ratios = [_per_round_ratio(new, old, f) for f in FIGURES]
            ratios.append(new.peak_gib / old.peak_gib)
            print(f"| {new.model} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["cnn", "rst_cnn_fb", "rst_cnn_fb_ref"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of turns per figure")
    parser.add_argument("--method", default=None, help="override the RST conv method")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast throughout")
    parser.add_argument(
        "--against", metavar="REV", help="also measure at git revision REV; print current / REV"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", nargs=2, action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.serve:
        _serve([n for n, _ in args.case], [Path(t) for _, t in args.case], args)
        return
    with _worktree(args.against) if args.against else contextlib.nullcontext() as tree:
        rows = [_Row(name, REPO) for name in args.models]
        old_rows = [_Row(name, tree) for name in args.models] if tree is not None else []
        turns = [r for pair in zip(rows, old_rows, strict=True) for r in pair] if old_rows else rows
        measure(turns, args)
        for old in old_rows:  # the old library, not this checkout's, built the model
            if not Path(old.file).is_relative_to(tree):
                raise SystemExit(f"--against: {old.model} came from {old.file}, not {tree}")
    _report(rows, old_rows, args)


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    main()
