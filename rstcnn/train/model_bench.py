"""``python -m rstcnn.train.model_bench``: RST models vs the plain CNN, measured in one run.

For each model: train step (forward + backward + Adam) at the training batch, eval time at
that batch, eval latency at batch 1 (median of repeats), and peak resident memory. Each
model runs in its own subprocess so peak memory is its own. Prints a markdown table and
the ratio of each model to the first one (the baseline, ``cnn`` by default).

``--against REV`` also measures every model at git revision REV (checked out into a
temporary worktree, each model run right after its current-code run) and prints
current / REV for each figure: old against new in one run.
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
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.runtime import use_retaining_allocator

REPO = Path(__file__).resolve().parents[2]


def _time(fn, repeats: int, device: torch.device) -> float:
    def run() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    run()  # warm-up: caches, allocator, oneDNN / cuDNN primitives
    return statistics.median(run() for _ in range(repeats))


def measure(
    name: str, batch: int, repeats: int, overrides: dict, device: torch.device, bf16: bool = False
) -> dict:
    """One model's figures; ``bf16``: every measurement in bfloat16 autocast."""
    from rstmodel import create_model

    torch.manual_seed(0)
    model = create_model(name, **overrides).to(device)
    cfg = model.config
    shape = (cfg.in_channels, cfg.input_size, cfg.input_size)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, cfg.num_classes, (batch,), device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    model.train()
    train = _time(train_step, repeats, device)
    model.eval()
    x1 = x[:1].clone()
    with torch.no_grad(), autocast:
        eval_batch = _time(lambda: model(x), repeats, device)
        eval_one = _time(lambda: model(x1), max(repeats, 5), device)
    if device.type == "cuda":
        peak_kib = torch.cuda.max_memory_allocated(device) / 1024
    else:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "train_s": train,
        "eval_s": eval_batch,
        "eval1_ms": eval_one * 1e3,
        "peak_gib": peak_kib / 2**20,
    }


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


def _measure_in(tree: Path, name: str, args: argparse.Namespace) -> dict:
    """One model's figures from a fresh process: this bench run in the checkout ``tree``,
    whose own code comes first on the path; an older revision's bench where it was then
    (``train.model_bench`` on 2026-11-27, ``rstmodel.bench`` before)."""
    module = next(
        name
        for name, path in (
            ("rstcnn.train.model_bench", "rstcnn/train/model_bench.py"),
            ("train.model_bench", "train/model_bench.py"),
            ("rstmodel.bench", "rstmodel/bench.py"),
        )
        if (tree / path).is_file()
    )
    cmd = [sys.executable, "-m", module, "--worker", name]
    cmd += ["--batch", str(args.batch), "--repeats", str(args.repeats), "--device", args.device]
    if args.method:
        cmd += ["--method", args.method]
    if args.bf16:
        cmd.append("--bf16")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["cnn", "rst_cnn_fb", "rst_cnn_fb_ref"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--method", default=None, help="override the RST conv method")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast throughout")
    parser.add_argument(
        "--against", metavar="REV", help="also measure at git revision REV; print current / REV"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.worker:
        overrides = {"method": args.method} if args.method and args.worker != "cnn" else {}
        row = measure(args.worker, args.batch, args.repeats, overrides, device, args.bf16)
        print(json.dumps(row))
        return
    rows, old_rows = [], []
    with _worktree(args.against) if args.against else contextlib.nullcontext() as tree:
        for name in args.models:
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            rows.append(_measure_in(REPO, name, args))
            if tree is not None:
                print(f"measuring {name} at {args.against} ...", file=sys.stderr, flush=True)
                old_rows.append(_measure_in(tree, name, args))
    base = rows[0]
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    memory = "peak GPU memory" if device.type == "cuda" else "peak RSS"
    precision = "bfloat16 autocast" if args.bf16 else "float32"
    print(
        f"\n{where}; torch {torch.__version__}; {precision}; batch {args.batch}; "
        f"median of {args.repeats}"
    )
    print(
        "\n| model | params | train step (s) | eval b{0} (s) | eval b1 (ms) | {2} (GiB) "
        "| train / {1} | eval b{0} / {1} | eval b1 / {1} |".format(
            args.batch, base["model"], memory
        )
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params']:,} | {r['train_s']:.3f} | {r['eval_s']:.3f} "
            f"| {r['eval1_ms']:.1f} | {r['peak_gib']:.2f} | {r['train_s'] / base['train_s']:.1f}x "
            f"| {r['eval_s'] / base['eval_s']:.1f}x | {r['eval1_ms'] / base['eval1_ms']:.1f}x |"
        )
    if old_rows:
        print(f"\ncurrent / {args.against} (below 1: the current code is faster or smaller)")
        print(f"\n| model | train step | eval b{args.batch} | eval b1 | {memory} |")
        print("|---|---|---|---|---|")
        for new, old in zip(rows, old_rows, strict=True):
            ratios = [new[k] / old[k] for k in ("train_s", "eval_s", "eval1_ms", "peak_gib")]
            print(f"| {new['model']} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    main()
