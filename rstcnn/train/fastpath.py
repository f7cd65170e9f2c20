"""Which way of running the RST model is fastest on this device? Measured, in one process.

    python train/fastpath.py --device cuda --out results/bench/fastpath-h200
    python train/fastpath.py --device cpu --model-arg "channels=(4,6,8)" --steps 2   # a dry run

For ``--model`` (default rst_cnn_fb) and the plain ``cnn`` baseline: the training step
(forward, backward, Adam) at the training batch and evaluation at that batch and at batch 1,
for each setting in ``TRAIN_SETTINGS`` / ``EVAL_SETTINGS``: float32, TF32 matrix products,
bfloat16 autocast, the fast paths' fused Triton kernels (the default on CUDA) against
torch's operators (``bf16 torch``), and the convolution method (the automatic choice by
multiply-adds, the per-scale direct form on cuDNN / oneDNN, TUNED: each layer times its
forms on the first call). A setting that fails is recorded with its error and the grid goes
on. ``--settings`` picks some of them (default: all). ``--profile`` then profiles the
fastest training setting's step (torch.profiler: the GPU's busy fraction, kernel launches
per step, the kernels and operators that take the time) into ``profile.md``. ``--compile``
also times ``torch.compile`` of that training step and of the fastest eval setting.
``--align-probe`` times each RST convolution of the model alone (forward and backward at the
training batch, in the fastest training setting's precision and method) at its channel
widths and at the widths rounded up to multiples of 8, into ``align.md``: whether padding
the channels inside the layers (so that matrix products can use 16-byte-aligned tensor-core
kernels) would pay for its extra multiply-adds. Prints a markdown table with the ratio of
each figure to the CNN in the same setting, writes it and a JSON copy to ``--out``, and
prints the fastest training setting as train/run.py flags (``FLAGS: ...``) and, on the last
line, the environment it needs (``ENV: ...``, e.g. ``RSTCNN_KERNELS=torch``), which
scripts/gpu_session.sh passes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.config import add_model_arg
from rstcnn.train.engine import use_tf32
from rstmodel import create_model
from rstmodel.layers import ConvMethod, GroupRSTConv, LiftingRSTConv, triton_ops


@dataclass(frozen=True)
class Setting:
    name: str
    precision: str  # fp32, tf32 (TF32 tensor cores for float32 products), bf16 (autocast)
    method: ConvMethod = ConvMethod.AUTO
    # the fast paths' fused kernels (RSTCNN_KERNELS: auto, triton, torch); None: as the
    # environment this process started with says
    kernels: str | None = None

    @property
    def flags(self) -> list[str]:
        """train/run.py's flags for this setting."""
        out = {"fp32": ["--no-tf32"], "tf32": [], "bf16": ["--bf16"]}[self.precision]
        if self.method is not ConvMethod.AUTO:
            out += ["--model-arg", f"method={self.method.value!r}"]
        return out

    @property
    def env(self) -> dict[str, str]:
        """The environment train/run.py needs beside ``flags`` for this setting."""
        return {} if self.kernels is None else {triton_ops.ENV: self.kernels}


_STARTED_WITH = os.environ.get(triton_ops.ENV)

TRAIN_SETTINGS = (
    Setting("fp32", "fp32"),
    Setting("tf32", "tf32"),
    Setting("bf16", "bf16"),
    # the fast paths in torch operators (cuBLAS products) instead of fused Triton kernels
    Setting("bf16 torch", "bf16", kernels="torch"),
    Setting("tf32 direct", "tf32", ConvMethod.DIRECT),
    Setting("bf16 direct", "bf16", ConvMethod.DIRECT),
)
EVAL_SETTINGS = TRAIN_SETTINGS + (
    Setting("tf32 tuned", "tf32", ConvMethod.TUNED),
    Setting("bf16 tuned", "bf16", ConvMethod.TUNED),
)


def _timed(fn, device: torch.device, warmup: int, steps: int) -> float:
    """Median seconds of ``fn`` over ``steps`` calls after ``warmup`` untimed ones."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(name: str, setting: Setting, overrides: dict, device: torch.device):
    """A fresh model for ``setting``; sets the process's kernels to the setting's."""
    kernels = setting.kernels or _STARTED_WITH
    if kernels is None:
        os.environ.pop(triton_ops.ENV, None)
    else:
        os.environ[triton_ops.ENV] = kernels
    torch.manual_seed(0)
    kwargs = dict(overrides)
    if name != "cnn":
        kwargs["method"] = setting.method
    return create_model(name, **kwargs).to(device)


def train_step(name, setting, overrides, device, batch, compiled=False):
    """One training step (forward, backward, Adam) of a fresh model on a random batch."""
    model = build(name, setting, overrides, device).train()
    cfg = model.config
    forward = torch.compile(model) if compiled else model
    x = torch.randn(batch, cfg.in_channels, cfg.input_size, cfg.input_size, device=device)
    y = torch.randint(0, cfg.num_classes, (batch,), device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=setting.precision == "bf16"
    )

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()

    return step


def measure_train(name, setting, overrides, device, batch, warmup, steps, compiled=False):
    step = train_step(name, setting, overrides, device, batch, compiled)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = _timed(step, device, warmup, steps)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"train_s": seconds, "train_img_s": batch / seconds, "train_peak_gib": peak}


def measure_eval(name, setting, overrides, device, batch, warmup, steps, compiled=False) -> dict:
    model = build(name, setting, overrides, device).eval()
    if compiled:
        model = torch.compile(model)
    cfg = model.config if not compiled else model._orig_mod.config
    x = torch.randn(batch, cfg.in_channels, cfg.input_size, cfg.input_size, device=device)
    x1 = x[:1].clone()
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=setting.precision == "bf16"
    )
    with torch.inference_mode(), autocast:
        many = _timed(lambda: model(x), device, warmup, steps)
        one = _timed(lambda: model(x1), device, warmup, max(steps, 10))
    return {"eval_s": many, "eval_img_s": batch / many, "eval1_ms": one * 1e3}


def run_grid(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for setting in EVAL_SETTINGS:
        if args.settings and setting.name not in args.settings:
            continue
        use_tf32(device, setting.precision != "fp32")
        for name in dict.fromkeys(["cnn", args.model]):
            if name == "cnn" and setting.method is not ConvMethod.AUTO:
                continue  # the CNN has no method to choose
            over = args.model_args if name == args.model else {}
            row = {"model": name, "setting": setting.name, "flags": setting.flags}
            row["env"] = setting.env
            try:
                if setting in TRAIN_SETTINGS:
                    row |= measure_train(name, setting, over, device, args.batch, 2, args.steps)
                row |= measure_eval(name, setting, over, device, args.batch, 2, args.steps)
            except Exception as err:  # one setting failing (a kernel, memory) is a finding
                row["error"] = repr(err)[:300]
                print(f"{name}, {setting.name} failed: {err!r}", flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def setting_of(row: dict) -> Setting:
    return next(s for s in EVAL_SETTINGS if s.name == row["setting"])


def run_compiled(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """``torch.compile`` of the fastest training setting's step and of the fastest eval
    setting; the seconds the first calls took (compilation) are recorded beside each."""
    device = torch.device(args.device)
    out = []
    evals = [r for r in rows if r["model"] == args.model and r.get("eval1_ms") is not None]
    jobs = [("train", setting_of(fastest_training(rows, args.model)))]
    jobs += [("eval", setting_of(min(evals, key=lambda r: r["eval1_ms"])))] if evals else []
    for kind, setting in jobs:
        use_tf32(device, setting.precision != "fp32")
        row = {"model": args.model, "setting": f"{setting.name} compiled", "flags": []}
        started = time.perf_counter()
        try:
            if kind == "train":
                row |= measure_train(
                    args.model, setting, args.model_args, device, args.batch, 2, args.steps, True
                )
            else:
                row |= measure_eval(
                    args.model, setting, args.model_args, device, args.batch, 2, args.steps, True
                )
        except Exception as err:  # a compiler failure is a finding, not a crash
            elapsed = time.perf_counter() - started
            print(f"torch.compile ({kind}) failed after {elapsed:.0f} s: {err!r}", flush=True)
            continue
        row[f"{kind}_compile_s"] = time.perf_counter() - started
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _merged_us(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of ``(start, end)`` spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def profile_training(args: argparse.Namespace, row: dict, steps: int = 3) -> str:
    """torch.profiler over ``steps`` training steps of one setting: wall time per step, the
    time the device was busy (the union of its kernels' spans), kernel launches per step,
    and the kernels and operators that take the device's time, as markdown."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    setting = setting_of(row)
    use_tf32(device, setting.precision != "fp32")
    step = train_step(args.model, setting, args.model_args, device, args.batch)
    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - started) * 1e6 / steps
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = _merged_us([(e.time_range.start, e.time_range.end) for e in kernels]) / steps
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    lines = [
        f"# Profile: {args.model}, {setting.name}, training step at batch {args.batch}",
        "",
        f"- wall time per step: {wall_us / 1e3:.2f} ms",
        f"- device busy per step: {busy_us / 1e3:.2f} ms ({busy_us / wall_us:.0%} of the wall)",
        f"- kernel launches per step: {len(kernels) / steps:.0f}",
        "",
        "| kernel | launches / step | ms / step | share of busy |",
        "|---|---|---|---|",
    ]
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    for name, spans in ranked[:25]:
        ms = sum(spans) / steps / 1e3
        share = f"{sum(spans) / steps / busy_us:.1%}" if busy_us else ""
        lines.append(f"| `{name}` | {len(spans) / steps:.0f} | {ms:.3f} | {share} |")
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ops = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
    lines += ["", f"| operator | calls / step | {key} ms / step |", "|---|---|---|"]
    for e in ops[:25]:
        ms = getattr(e, key) / steps / 1e3
        lines.append(f"| `{e.key[:90]}` | {e.count / steps:.0f} | {ms:.3f} |")
    return "\n".join(lines) + "\n"


def _round_up(n: int, multiple: int = 8) -> int:
    return -(-n // multiple) * multiple


def layer_inputs(model: torch.nn.Module, device: torch.device) -> dict[str, tuple[int, ...]]:
    """The input shape of every RST convolution of ``model`` (at batch 2), by module name."""
    shapes: dict[str, tuple[int, ...]] = {}

    def remember(name: str):
        def hook(module, inputs) -> None:  # returns None: the inputs stay as they are
            shapes.setdefault(name, tuple(inputs[0].shape))

        return hook

    hooks = [
        module.register_forward_pre_hook(remember(name))
        for name, module in model.named_modules()
        if isinstance(module, (LiftingRSTConv, GroupRSTConv))
    ]
    cfg = model.config
    with torch.no_grad():
        model(torch.zeros(2, cfg.in_channels, cfg.input_size, cfg.input_size, device=device))
    for hook in hooks:
        hook.remove()
    return shapes


def align_probe(args: argparse.Namespace, row: dict) -> str:
    """Markdown: each RST convolution of ``args.model`` alone, at its widths and at the
    widths rounded up to multiples of 8 (module docstring)."""
    setting, device = setting_of(row), torch.device(args.device)
    model = build(args.model, setting, args.model_args, device).eval()
    shapes = layer_inputs(model, device)
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=setting.precision == "bf16"
    )
    lines = [
        f"# Channel alignment probe: {args.model}, {setting.name}, batch {args.batch}",
        "",
        "| layer | widths | ms (forward + backward) | widths rounded up to 8 | ms | time ratio | "
        "time per multiply-add ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, shape in shapes.items():
        layer = model.get_submodule(name)
        widths = (layer.in_channels, layer.out_channels)
        padded = tuple(_round_up(c) for c in widths)
        if isinstance(layer, LiftingRSTConv):
            padded = (widths[0], padded[1])  # the image's channels stay
        times = []
        for cin, cout in (widths, padded):
            torch.manual_seed(0)
            kwargs = (
                {}
                if isinstance(layer, LiftingRSTConv)
                else {
                    "rotation_taps": layer.rotation_taps,
                    "scale_taps": layer.scale_taps,
                    "tap_mode": layer.tap_mode,
                }
            )
            probe = type(layer)(cin, cout, layer.spec, method=layer.method, **kwargs).to(device)
            x = torch.randn(args.batch, cin, *shape[2:], device=device, requires_grad=True)

            def step(probe=probe, x=x) -> None:
                with autocast:
                    y = probe(x)
                y.float().sum().backward()

            times.append(_timed(step, device, 1, args.steps))
        work = (padded[0] * padded[1]) / (widths[0] * widths[1])
        lines.append(
            f"| {name} | {widths} | {1e3 * times[0]:.2f} | {padded} | {1e3 * times[1]:.2f} | "
            f"{times[1] / times[0]:.2f} | {times[1] / times[0] / work:.2f} |"
        )
    return "\n".join(lines) + "\n"


def table(rows: list[dict], model: str) -> str:
    cnn = {r["setting"]: r for r in rows if r["model"] == "cnn"}
    head = "| model | setting | train step (s) | train img/s | peak GiB | eval b (s) | eval b1 (ms) | train / cnn | eval / cnn | eval b1 / cnn |"
    lines = [head, "|" + "---|" * 10]

    def fmt(v, spec):
        return "" if v is None else format(v, spec)

    def ratio(r, key):
        base = cnn.get(r["setting"].split()[0])
        if r["model"] == "cnn" or base is None or r.get(key) is None or base.get(key) is None:
            return ""
        return f"{r[key] / base[key]:.1f}x"

    for r in rows:
        lines.append(
            f"| {r['model']} | {r['setting']} | {fmt(r.get('train_s'), '.4f')} | "
            f"{fmt(r.get('train_img_s'), ',.0f')} | {fmt(r.get('train_peak_gib'), '.2f')} | "
            f"{fmt(r.get('eval_s'), '.4f')} | {fmt(r.get('eval1_ms'), '.2f')} | "
            f"{ratio(r, 'train_s')} | {ratio(r, 'eval_s')} | {ratio(r, 'eval1_ms')} |"
        )
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['model']}, {r['setting']}: failed: {r['error']}")
        for kind in ("train", "eval"):
            if f"{kind}_compile_s" in r:
                lines.append(
                    f"\n{r['setting']} ({kind}): the first calls (compilation) took "
                    f"{r[f'{kind}_compile_s']:.0f} s"
                )
    return "\n".join(lines) + "\n"


def fastest_training(rows: list[dict], model: str) -> dict:
    trained = [r for r in rows if r["model"] == model and r.get("train_s") is not None]
    return min(trained, key=lambda r: r["train_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="rst_cnn_fb")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed calls per figure")
    add_model_arg(parser, "config override of --model, a Python literal")
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=[s.name for s in EVAL_SETTINGS],
        metavar="NAME",
        help="measure only these settings (default: all): "
        + ", ".join(repr(s.name) for s in EVAL_SETTINGS),
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile the fastest training setting's step"
    )
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument(
        "--align-probe",
        action="store_true",
        help="time each RST conv at its widths and at widths rounded up to multiples of 8",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.model_args = dict(args.model_args)
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch must be positive")
    if args.settings and not any(s.name in args.settings for s in TRAIN_SETTINGS):
        parser.error("--settings needs at least one training setting: fp32, tf32, bf16, ...")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"

    def write(rows: list[dict]) -> dict:
        """Print and save the table so far (a later stage may be cut off by a timeout)."""
        best = fastest_training(rows, args.model)
        text = f"{device}, torch {torch.__version__}, batch {args.batch}"
        text += "".join(f", {args.model} {k}={v!r}" for k, v in args.model_args.items()) + "\n\n"
        text += table(rows, args.model)
        text += (
            f"\nfastest training setting: {best['setting']} ({best['train_s']:.4f} s per step)\n"
        )
        print(text, end="", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "fastpath.md").write_text(text, encoding="utf-8")
            (args.out / "fastpath.json").write_text(json.dumps(rows, indent=2) + "\n", "utf-8")
        return best

    rows = run_grid(args)
    best = write(rows)
    print("FLAGS: " + " ".join(best["flags"]), flush=True)
    print("ENV: " + " ".join(f"{k}={v}" for k, v in best.get("env", {}).items()), flush=True)
    if args.profile:
        text = profile_training(args, best)
        print(text, end="", flush=True)
        if args.out is not None:
            (args.out / "profile.md").write_text(text, encoding="utf-8")
    if args.align_probe:
        text = align_probe(args, best)
        print(text, end="", flush=True)
        if args.out is not None:
            (args.out / "align.md").write_text(text, encoding="utf-8")
    if args.compile:
        write(rows + run_compiled(args, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
