"""Training throughput (images/s) of train/run.py's training step, measured in one run.

    python train/bench.py                                  # cnn and rst_cnn_fb
    python train/bench.py --models cnn --steps 5 --batch cnn=256
    python train/bench.py --models rst_cnn_fb --model-arg rst_cnn_fb:channels=(4,6,8)

For each model, the same step (forward, cross-entropy, backward, Adam) three ways:

* compute-only: one pre-made batch already on the device, fed again every step;
* pipeline: the batches of train/run.py's DataLoader over the prepared RS-Fashion
  (``python train/prepare_data.py``; ``$RSTCNN_DATA`` or ``--data-root``), without and with
  ``--augment``; the time to fetch each batch counts. The ratio pipeline / compute-only says
  how much of the step the data loading costs (target: at least 95 %).

Then, for ``cnn`` (``--ddp-models``), 1 process against N processes under torchrun (gloo on the
CPU): the same global batch, each process a share of it and of the CPU threads, real data
pipeline without augmentation. Each count is ``--steps`` timed steps after ``--warmup``
untimed ones. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: python train/bench.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train import engine  # noqa: E402
from rstcnn.train.config import TrainConfig, parse_model_arg  # noqa: E402
from rstcnn.train.runtime import use_retaining_allocator

DEFAULT_BATCH = {"cnn": 128, "rst_cnn_fb": 32}
RESULT = "BENCH_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["cnn", "rst_cnn_fb"])
    parser.add_argument(
        "--batch",
        action="append",
        default=[],
        metavar="MODEL=N",
        help=f"global batch per model (default {DEFAULT_BATCH}, others 64)",
    )
    parser.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="MODEL:KEY=VALUE",
        help="config override of one model, as train/run.py's --model-arg",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    parser.add_argument("--workers", type=int, default=None, help="loader processes (as run.py)")
    parser.add_argument("--data-root", type=Path, default=None)
    parser.add_argument("--bf16", action="store_true", help="train in bfloat16 autocast")
    parser.add_argument("--ddp-models", nargs="*", default=["cnn"], help="1 vs N processes")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the DDP comparison")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # DDP child: model
    args = parser.parse_args(argv)
    args.batches = dict(DEFAULT_BATCH)
    for item in args.batch:
        name, _, value = item.partition("=")
        args.batches[name] = int(value)
    args.overrides = {}
    for item in args.model_arg:
        name, sep, rest = item.partition(":")
        if not sep:
            parser.error(f"--model-arg wants MODEL:KEY=VALUE, got {item!r}")
        args.overrides.setdefault(name, []).append(rest)
    args.threads = args.threads or torch.get_num_threads()
    return args


def run_config(args: argparse.Namespace, model: str, augment: bool, batch: int) -> TrainConfig:
    """The training config for ``model`` (only its data and model path is used)."""
    return TrainConfig(
        model=model,
        data="rs-fashion",
        batch_size=batch,
        device=args.device,
        limit_test=1,
        out=Path(tempfile.gettempdir()),
        data_root=args.data_root,
        workers=args.workers,
        bf16=args.bf16,
        augment=augment,
        model_args=dict(parse_model_arg(o) for o in args.overrides.get(model, [])),
    )


def make_trial(config: TrainConfig, procs: engine.Distributed | None = None) -> engine.Trial:
    device = engine.pick_device(config.device, procs)
    engine.use_tf32(device, config.tf32)  # the same step as train/run.py
    if procs is not None:
        procs.init(device)
    data = engine.load_data(config)
    return engine.Trial(
        config, data, seed=0, out=config.out, device=device, stop=engine.StopRequest(), procs=procs
    )


def time_steps(trial: engine.Trial, batches: Any, warmup: int, steps: int) -> float:
    """Seconds for ``steps`` training steps over ``batches`` after ``warmup`` untimed ones;
    fetching each batch and moving it to the device are part of the step."""
    device, model, optimizer = trial.device, trial.train_model, trial.optimizer
    model.train()
    batches = iter(batches)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        trial.procs.barrier()

    def step() -> None:
        images, labels = next(batches)
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        _, loss = trial.forward_loss(images, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()

    for _ in range(warmup):
        step()
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - began


def loader_batches(trial: engine.Trial) -> Any:
    """The training loader's batches, epoch after epoch (epochs reseeded as run.py does)."""
    for epoch in itertools.count(1):
        trial.generator.manual_seed(engine.epoch_seed(0, epoch))
        if trial.sampler is not None:
            trial.sampler.set_seed(engine.epoch_seed(0, epoch))
        yield from trial.train_loader


def measure_model(args: argparse.Namespace, model: str) -> dict[str, Any]:
    batch = args.batches.get(model, 64)
    row: dict[str, Any] = {"model": model, "batch": batch}
    for augment in (False, True):
        trial = make_trial(run_config(args, model, augment, batch))
        seconds = time_steps(trial, loader_batches(trial), args.warmup, args.steps)
        row["augment" if augment else "pipeline"] = batch * args.steps / seconds
        if not augment:  # after the pipeline, on the same (warm) model and optimizer
            data = trial.data
            x = torch.randn(batch, data.in_channels, data.input_size, data.input_size)
            y = torch.randint(0, len(data.class_names), (batch,))
            fixed = itertools.repeat((x.to(trial.device), y.to(trial.device)))
            seconds = time_steps(trial, fixed, args.warmup, args.steps)
            row["compute"] = batch * args.steps / seconds
            row["workers"] = trial.workers
        print(f"  {model} {'augment' if augment else 'pipeline'} done", file=sys.stderr)
    return row


def ddp_worker(args: argparse.Namespace) -> None:
    """One process of the 1-vs-N comparison (under torchrun or alone); rank 0 prints."""
    procs = engine.Distributed.from_env()
    batch = args.batches.get(args.worker, 64)
    trial = make_trial(run_config(args, args.worker, False, batch), procs)
    seconds = time_steps(trial, loader_batches(trial), args.warmup, args.steps)
    if procs.main:
        print(RESULT + json.dumps({"images_per_s": batch * args.steps / seconds}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def measure_ddp(args: argparse.Namespace, model: str, nproc: int) -> dict[str, Any]:
    threads = max(1, args.threads // nproc)
    script = [str(Path(__file__).resolve()), "--worker", model, "--threads", str(threads)]
    script += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--device", args.device]
    script += [f"--batch={model}={args.batches.get(model, 64)}"]
    script += [f"--model-arg={model}:{o}" for o in args.overrides.get(model, [])]
    if args.data_root is not None:
        script += ["--data-root", str(args.data_root)]
    if args.workers is not None:
        script += ["--workers", str(args.workers)]
    if nproc == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={nproc}", *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(lines[0][len(RESULT) :])
    batch = args.batches.get(model, 64)
    return {"model": model, "nproc": nproc, "threads": threads, "batch": batch, **result}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker is not None:
        ddp_worker(args)
        return 0
    rows = [measure_model(args, model) for model in args.models]
    print(
        f"\ntorch {torch.__version__}, device {args.device}, {args.threads} threads, "
        f"{args.warmup} warm-up + {args.steps} timed steps\n"
    )
    print(
        "| model | batch | workers | compute-only img/s | pipeline img/s | pipeline / compute "
        "| pipeline + augment img/s | augment / compute |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['batch']} | {r['workers']} | {r['compute']:.1f} | "
            f"{r['pipeline']:.1f} | {100 * r['pipeline'] / r['compute']:.1f} % | "
            f"{r['augment']:.1f} | {100 * r['augment'] / r['compute']:.1f} % |"
        )
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else args.nproc
    if args.ddp_models and args.nproc > 1 and gpus < args.nproc:
        print(
            f"\n{args.nproc}-process comparison skipped: it needs {args.nproc} GPUs, this machine has {gpus}"
        )
    elif args.ddp_models and args.nproc > 1:
        ddp = []
        for model in args.ddp_models:
            ddp += [measure_ddp(args, model, 1), measure_ddp(args, model, args.nproc)]
        print("\n| model | processes | threads each | global batch | img/s | vs 1 process |")
        print("|---|---|---|---|---|---|")
        for r in ddp:
            base = next(b for b in ddp if b["model"] == r["model"] and b["nproc"] == 1)
            print(
                f"| {r['model']} | {r['nproc']} | {r['threads']} | {r['batch']} | "
                f"{r['images_per_s']:.1f} | {r['images_per_s'] / base['images_per_s']:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
