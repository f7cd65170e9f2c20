"""Train a model of the paper (Section 5) on RS-MNIST, RS-Fashion or STL-10: the command
line over ``train.config.TrainConfig`` and ``train.engine``.

    python train/run.py --model rst_cnn_fb --data rs-fashion --train-size 5000
    python train/run.py --model cnn --data rs-mnist --train-size 2000 --augment --trials 5
    python train/run.py --model rst_resnet16 --data stl10 --stl10-root ~/datasets/stl10
    python train/run.py --model cnn --data rs-fashion --resume   # after Ctrl-C or a crash

Recipes (paper, Section 5): RS data: Adam, lr 0.01, tenfold decay after half the epochs,
60 epochs, batch 128, N_tr train / 2,000 validation / the rest test images. STL-10: SGD with
Nesterov momentum 0.9 and weight decay 5e-4, lr 0.1, tenfold decays at 30/40/60/80 % of the
epochs (1000), batch 64, crop + flip + Cutout, all 5,000 training images (no validation split
unless --val-size; the last epoch is then the best), ID and OOD test accuracy.

Written to --out DIR: metrics.jsonl (one line per epoch), best.pt (best validation accuracy),
last.pt (the last completed epoch with optimizer, scheduler and RNG states), train.log and,
at the end, summary.json (best.pt evaluated on the test split). Checkpoints are written only
after an epoch completes, atomically; every epoch reseeds all random streams from
(seed, epoch), so a run stopped at any point (Ctrl-C, SIGTERM, SIGKILL) and resumed with
--resume ends with the same weights, bit for bit on the same device and thread count, as one
that ran through. Ctrl-C / SIGTERM stop at the next batch; the partial epoch is dropped.

Several processes (DistributedDataParallel; gloo on the CPU, nccl on CUDA, one GPU each):

    torchrun --standalone --nproc_per_node=2 train/run.py --model cnn --data rs-fashion

Every rank trains on its share (rank, rank + N, ...) of each epoch's seeded permutation of
the training set (padded by wrapping round to a multiple of N, as DistributedSampler does);
--batch-size stays the global batch and each process takes --batch-size / N of it (it must
divide); DDP averages the gradients. Validation and test accuracy cover the whole split
(each rank evaluates a share, the counts are summed). Only rank 0 writes the run folder (the
same files as one process) and shows progress; --resume loads last.pt on every rank.
"""

# ruff: noqa: E402  (as a script it re-executes before its imports: rstcnn.cli)
from __future__ import annotations

if __name__ == "__main__":  # re-exec with the retaining heap, then run as rstcnn.train.run
    from rstcnn.cli import train

    train()

import argparse
import logging
import shlex
import sys
from pathlib import Path

import numpy as np
from torch import distributed as dist
from tqdm.contrib.logging import logging_redirect_tqdm

from rstcnn.train.config import DATA_CHOICES, TrainConfig, add_model_arg
from rstcnn.train.engine import (
    Distributed,
    Interrupted,
    SetupError,
    StopRequest,
    TrainingError,
    describe_os_error,
    run_trials,
    setup_cli,
)
from rstmodel import list_models
from rstmodel.data import NUM_VAL, RESAMPLINGS, RSDataset

EXIT_ERROR, EXIT_SETUP = 1, 2
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a ``TrainConfig`` (a bad value exits with the usage line)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="rst_cnn_fb", choices=list_models())
    parser.add_argument("--data", default=RSDataset.FASHION.value, choices=DATA_CHOICES)
    parser.add_argument(
        "--train-size", type=int, default=None, help="N_tr (RS default 5000; STL-10: all)"
    )
    parser.add_argument(
        "--val-size", type=int, default=None, help=f"validation images (RS {NUM_VAL}, STL-10 0)"
    )
    parser.add_argument(
        "--realisation", "--realization", type=int, default=0, help="RS data realisation"
    )
    parser.add_argument("--epochs", type=int, default=None, help="RS 60, STL-10 1000")
    parser.add_argument("--batch-size", type=int, default=None, help="RS 128, STL-10 64")
    parser.add_argument("--lr", type=float, default=None, help="RS 0.01 (Adam), STL-10 0.1 (SGD)")
    parser.add_argument("--seed", type=int, default=0, help="training seed (first of --trials)")
    parser.add_argument(
        "--augment", action="store_true", help='random RST augmentation (the paper\'s "+" data)'
    )
    parser.add_argument(
        "--train-resampling",
        nargs="+",
        default=["bicubic"],
        choices=list(RESAMPLINGS),
        metavar="NAME",
        help="RS data: render the training images with these pipelines and read each image "
        "from one of them at random every epoch (rstmodel.data.RESAMPLINGS; default: the "
        "paper's bicubic)",
    )
    parser.add_argument(
        "--test-resampling",
        nargs="*",
        default=[],
        choices=list(RESAMPLINGS),
        metavar="NAME",
        help="RS data: also test best.pt on the same test images rendered by these pipelines "
        "(results test_<NAME>_acc), e.g. the held-out 'pillow'",
    )
    parser.add_argument(
        "--init",
        type=Path,
        default=None,
        help="start from this checkpoint's weights (same model and settings; fine-tuning)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="run folder (default runs/<model>-<data>-...)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from --out/last.pt")
    parser.add_argument(
        "--trials", type=int, default=1, help="N runs with seeds seed..seed+N-1 in out/trial<i>"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda:0")
    parser.add_argument(
        "--data-root", type=Path, default=None, help="folder of RS source files (IDX etc.)"
    )
    parser.add_argument("--stl10-root", type=Path, default=None, help="folder of stl10_binary/")
    add_model_arg(
        parser, "config override, a Python literal (repeatable): --model-arg channels=(4,6,8)"
    )
    parser.add_argument("--limit-train", type=int, default=None, help="use N training images")
    parser.add_argument(
        "--limit-test", type=int, default=None, help="evaluate N validation and N test images"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="data loader processes (cpu 0, cuda 8)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="train in bfloat16 autocast (CPUs with AVX512-BF16/AMX and GPUs); evaluation "
        "stays float32",
    )
    parser.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, TF32 tensor cores for float32 matrix products (default on)",
    )
    args = parser.parse_args(argv)
    if args.init is not None and not args.init.is_file():
        parser.error(f"--init {args.init}: no such checkpoint")
    values = vars(args) | {
        "model_args": dict(args.model_args),
        "train_resampling": tuple(args.train_resampling),
        "test_resampling": tuple(args.test_resampling),
    }
    try:
        return TrainConfig(**values)
    except ValueError as err:  # the config names the field; the flag is its dashed form
        message, field = str(err), str(err).split(" ", 1)[0]
        if field in values:
            message = "--" + field.replace("_", "-") + message[len(field) :]
        parser.error(message)


def resume_command() -> str:
    argv = list(sys.argv)
    if "--resume" not in argv:
        argv.append("--resume")
    return shlex.join(["python", *argv])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_cli(args.threads)
    procs = Distributed.from_env()
    if not procs.main:  # rank 0 reports; the others only their warnings
        logging.getLogger().setLevel(logging.WARNING)
    stop = StopRequest()
    try:
        with stop.installed(), logging_redirect_tqdm():
            summaries = run_trials(args, stop, procs)
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_SETUP
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as err:  # a full disk, a read-only or missing folder: one line, no trace
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        return EXIT_ERROR
    except (Interrupted, KeyboardInterrupt) as err:
        name = err.signal_name if isinstance(err, Interrupted) else "SIGINT"
        print(
            f"\nstopped by {name}; the unfinished epoch was dropped and each trial's last.pt "
            f"holds its last completed epoch. Resume with:\n  {resume_command()}",
            file=sys.stderr,
        )
        return EXIT_SIGNAL.get(name, EXIT_ERROR)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not procs.main:
        return 0
    accuracies = [s["test_acc"] for s in summaries]
    if len(accuracies) > 1:
        print(
            f"test accuracy over {len(accuracies)} trials: "
            f"{100 * np.mean(accuracies):.2f} +- {100 * np.std(accuracies):.2f} %"
        )
    else:
        print(f"test accuracy: {100 * accuracies[0]:.2f} %  ({args.out / 'summary.json'})")
    return 0
