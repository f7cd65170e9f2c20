"""The web app: classify an uploaded, drawn or sample image with the shipped models side by
side, and show how stable each prediction is under rotation, scaling and deformation.

    python serve/app.py [--model M.onnx ...] [--host 127.0.0.1] [--port 7860]
    python serve/app.py --model models/rst_cnn_fb.pt ...   (eager torch; opt-in, see serve.eager)

One server: the HTTP API (``serve.api``: /healthz, /v1/models, /v1/classify, /v1/stability,
OpenAPI docs at /docs) and the Gradio UI mounted at /. Nothing leaves the machine: Gradio's
analytics are off, its front end and fonts are served from the installed package, and the
server binds 127.0.0.1 unless told otherwise. Limits: uploads up to ``MAX_UPLOAD_BYTES``,
images up to ``MAX_PIXELS`` pixels (``serve.uploads``); the page's events read only files
its upload component wrote (or the gallery's); requests for another host name, slow
clients, oversized bodies and full queues are refused (``serve.guards``).
"""

# ruff: noqa: E402  (Gradio reads its settings from the environment when it is imported)
from __future__ import annotations

if __name__ == "__main__":  # re-exec with the retaining heap, then run as rstcnn.serve.app
    from rstcnn.cli import serve

    serve()

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# torch's OpenMP threads (a checkpoint served by eager torch, serve.eager) sleep when idle
# instead of spinning: spinning took the cores from onnxruntime's requests beside a sweep
# (soak p50 1.5 s against 0.35 s, BENCHMARKS.md). Read when torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gradio as gr
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline
from gradio.utils import get_upload_folder

from rstcnn.serve import Classifier
from rstcnn.serve.api import Limits, ModelSet, SweepCache, create_router, install_error_handlers
from rstcnn.serve.guards import (
    LOOPBACK_NAMES,
    BodyLimit,
    Busy,
    HostCheck,
    SecurityHeaders,
    allowed_hosts,
    server_config,
)
from rstcnn.serve.memory import release_free_memory, return_memory_to_the_system
from rstcnn.serve.preview import PageMeta
from rstcnn.serve.samples import GALLERY, Sample, write_samples
from rstcnn.serve.stability import (
    SWEEP_NAMES,
    StabilityReport,
    SweepSpec,
    join_reports,
    measure_stability,
    plot_report,
    thumbnails,
)
from rstcnn.serve.uploads import (
    MAX_PIXELS,
    MAX_UPLOAD_BYTES,
    UploadError,
    decode_image,
    read_uploaded,
)
from rstcnn.serve.variants import fastest_variants

__all__ = ["build_app", "build_ui", "main", "DEFAULT_MODELS"]

log = logging.getLogger("serve.app")

REPO_ROOT = Path(__file__).resolve().parents[2]
# the shipped int8 files: committed, and each passed its accuracy gate (models/README.md)
DEFAULT_MODELS = ("models/rst_cnn_fb.int8.onnx", "models/cnn.int8.onnx")


def _load(models: Sequence[str | Path | Any] | None, threads: int | None) -> list[Any]:
    """Classifiers from ONNX paths, checkpoint paths (``.pt``: eager torch, ``serve.eager``;
    relative ones against the working folder, then the repository) or ready objects."""
    out = []
    for item in models or DEFAULT_MODELS:
        if not isinstance(item, (str, Path)):
            out.append(item)
            continue
        path = Path(item)
        if not path.is_file() and not path.is_absolute() and (REPO_ROOT / path).is_file():
            path = REPO_ROOT / path
        if not path.is_file() and path.suffix == ".pt":
            raise FileNotFoundError(f"no checkpoint at {item}")
        if not path.is_file():
            raise FileNotFoundError(
                f"no model at {item}: export a checkpoint with "
                f"`python export/to_onnx.py {Path(item).with_suffix('.pt')} -o {item}`"
            )
        if path.suffix == ".pt":
            out.append(Classifier.from_checkpoint(path, threads=threads))
        else:
            out.append(Classifier.from_onnx(path, threads=threads))
    return out


def build_app(
    models: Sequence[str | Path | Any] | None = None,
    *,
    samples_dir: str | Path | None = None,
    spec: SweepSpec | None = None,
    threads: int | None = None,
    limits: Limits | None = None,
    hosts: Sequence[str] = LOOPBACK_NAMES,
    cors_origins: Sequence[str] = (),
) -> FastAPI:
    """The API and the Gradio UI on one FastAPI app.

    ``models``: ONNX paths or ``Classifier`` objects (default: the shipped RST-CNN and CNN);
    of several files of one checkpoint the fastest servable one is served (``serve.variants``);
    ``samples_dir``: the gallery's folder, written there when empty (default: the shipped
    ``serve/gallery``); ``threads``: onnxruntime intra-op threads per model; ``limits``: how
    many requests run and wait at once; ``hosts``: the host names it answers to ("*": any);
    ``cors_origins``: origins whose pages may call it (default: none).
    """
    spec = spec or SweepSpec()
    # several files of one checkpoint (float32 / int8 / float16): the fastest servable one
    served, _ = fastest_variants(_load(models, threads), spec.batch_size)
    if not served:
        raise ValueError(
            "no servable model: every file is a reduced-precision copy without a passing accuracy check"
        )
    model_set = ModelSet(served)
    limits = limits or Limits()
    folder = Path(samples_dir) if samples_dir else GALLERY
    samples = write_samples(folder)
    # /docs and /redoc from packaged Swagger UI and ReDoc files: they render offline
    app = FastAPIOffline(
        title="rstcnn",
        version="0.1.0",
        description="Roto-scale-translation equivariant CNNs: classification and prediction "
        "stability under rotation, scaling and deformation. The web app is at /.",
    )
    # outermost last: host check, security headers, CORS, body size, then the app
    app.add_middleware(PageMeta)  # the page's link-preview tags name this app
    app.add_middleware(BodyLimit, limit=MAX_UPLOAD_BYTES + 2**20)  # + multipart overhead
    app.add_middleware(  # present even when empty: Gradio then adds no CORS of its own
        CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"]
    )
    app.add_middleware(SecurityHeaders)
    app.add_middleware(HostCheck, allowed=hosts)
    install_error_handlers(app)
    cache = SweepCache(model_set, spec, limits.sweeps, yield_to=(limits.classify,))
    router = create_router(model_set, spec=spec, limits=limits, cache=cache)
    app.include_router(router)
    app.state.models = model_set
    app.state.samples = samples
    app.state.limits = limits
    app.state.sweep_cache = cache
    uploads = (get_upload_folder(), folder)
    blocks = build_ui(
        model_set,
        samples,
        spec=spec,
        limits=limits,
        folders=uploads,
        cache=cache,
        api=api_help(router, model_set),
    )
    app = gr.mount_gradio_app(
        app,
        blocks,
        path="/",
        max_file_size=MAX_UPLOAD_BYTES,
        allowed_paths=[str(folder.resolve())],
        footer_links=[],  # the page's own "Use via API" section lists the /v1 API
        show_error=True,
        theme=gr.themes.Default(),  # local fonts only
        css=PAGE_CSS,
    )
    # Gradio checks the files named in an event's payload (only those its upload
    # component wrote are taken, before anything opens them) once it counts as launched,
    # which mounting alone does not set. The event reads through read_uploaded as well.
    blocks.has_launched = True
    return app


# the gallery's 56x56 test images drawn with square pixels, as the model sees them; on
# narrow screens the stacked stability panel instead of the wide one
PAGE_CSS = """
#samples img { image-rendering: pixelated; }
#stability-plot-narrow { display: none !important; }
@media (max-width: 700px) {
  #stability-plot { display: none !important; }
  #stability-plot-narrow { display: block !important; }
  #summary table { display: block; overflow-x: auto; }
  #summary th, #summary td { white-space: nowrap; }
}
"""


# Gradio's sketchpad opens with no tool picked; this picks its brush once the Draw tab's
# toolbar is on the page (it is drawn when the tab opens), so a stroke draws at once
PICK_BRUSH = """() => {
  let tries = 0;
  const pick = () => {
    const brush = document.querySelector("#sketch button[aria-label='Brush']");
    if (brush) { if (!brush.classList.contains("highlight")) brush.click(); }
    else if (++tries < 40) setTimeout(pick, 50);
  };
  pick();
}"""


def api_help(router: Any, models: ModelSet) -> str:
    """The "Use via API" section: every route of ``router`` with its first docstring line,
    and a curl line for the two image routes."""
    rows = []
    for route in router.routes:
        methods = "/".join(sorted(route.methods - {"HEAD"}))
        what = (route.endpoint.__doc__ or "").strip().split("\n")[0]
        rows.append(f"| `{methods}` | `{route.path}` | {what} |")
    return (
        "The page runs on an HTTP API that programs can call directly; the interactive "
        "reference with every field is at [/docs](/docs) (also [/redoc](/redoc)).\n\n"
        "| method | path | what it answers |\n|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nFor example (the server's address as in your browser):\n\n"
        "```bash\n"
        "curl -F image=@shoe.png -F top_k=3 http://127.0.0.1:7860/v1/classify\n"
        f"curl -F image=@shoe.png -F model={models.default} "
        "http://127.0.0.1:7860/v1/stability\n"
        "```"
    )


def build_ui(
    models: ModelSet,
    samples: Sequence[Sample],
    *,
    spec: SweepSpec,
    limits: Limits,
    folders: Sequence[str | Path],
    cache: SweepCache | None = None,
    api: str = "",
) -> gr.Blocks:
    """The Gradio page over ``models``; ``samples`` fill the gallery; the event reads only
    files in ``folders`` (Gradio's upload folder and the gallery's); ``api``: the text of
    the "Use via API" section (``api_help``), none when empty."""
    default = models.get(None)
    with gr.Blocks(title="RST-CNN: prediction stability", analytics_enabled=False) as demo:
        gr.Markdown(_intro(models), elem_id="intro")
        with gr.Accordion("Details: the models, the sweeps and their limits", open=False):
            gr.Markdown(_details(models, spec), elem_id="details")
        if api:
            with gr.Accordion("Use via API", open=False, elem_id="api-help"):
                gr.Markdown(api, elem_id="api-routes")
        source = gr.State("upload")
        with gr.Row():
            with gr.Column(scale=2):
                with gr.Tabs() as tabs:
                    with gr.Tab("Upload", id="upload") as upload_tab:
                        image = gr.Image(
                            label="Image (light object on a dark background)",
                            type="filepath",
                            sources=["upload", "clipboard"],
                            height=280,
                            elem_id="input-image",
                        )
                    with gr.Tab("Draw", id="draw") as draw_tab:
                        sketch = gr.Sketchpad(
                            label="Draw dark on light (inverted for the models)",
                            canvas_size=(280, 280),
                            brush=gr.Brush(default_size=20, colors=["#000000"], color_mode="fixed"),
                            type="filepath",
                            elem_id="sketch",
                        )
                invert = gr.Checkbox(
                    label="Invert: my image shows a dark object on a light background",
                    value=False,
                    elem_id="invert",
                )
                top_k = gr.Slider(
                    1,
                    len(default.class_names),
                    value=min(3, len(default.class_names)),
                    step=1,
                    label="Top-k classes",
                    elem_id="top-k",
                )
                run = gr.Button("Classify and sweep", variant="primary", elem_id="run")
                picks = None
                if samples:  # the test images as the model sees them, true class below each
                    picks = gr.Gallery(
                        value=[(str(s.path), _class_name(default, s.label)) for s in samples],
                        label=f"Real test images ({samples[0].source}) with their true class: "
                        "click one to classify it (a link to the N-th: /?sample=N)",
                        columns=6,
                        height="auto",
                        allow_preview=False,
                        interactive=False,
                        object_fit="contain",
                        elem_id="samples",
                    )
            with gr.Column(scale=3):
                status = gr.Markdown(label="Status", elem_id="status")
                with gr.Row():
                    labels = [
                        gr.Label(label=models.display[name], elem_id=f"label-{i}")
                        for i, (name, _) in enumerate(models)
                    ]
                summary = gr.Markdown(label="Summary", elem_id="summary")
                download = gr.File(
                    label="This result as JSON (the API's /v1/stability answer)",
                    interactive=False,
                    elem_id="sweep-json",
                )
        plot = gr.Plot(label="Stability panel", format="png", elem_id="stability-plot")
        narrow_plot = gr.Plot(  # the same, stacked: shown instead on narrow screens (CSS)
            label="Stability panel", format="png", elem_id="stability-plot-narrow"
        )
        gallery = gr.Gallery(
            label="Transformed inputs; captions: top-1 of "
            + " | ".join(models.display[name] for name in models.names),
            columns=6,  # one row per sweep
            format="png",
            height=640,
            object_fit="contain",
            elem_id="sweep-gallery",
        )
        upload_tab.select(lambda: "upload", None, source, api_visibility="private")
        draw_tab.select(lambda: "draw", None, source, js=PICK_BRUSH, api_visibility="private")

        def analyse(
            picture: Any,
            drawing: Any,
            k: float,
            inverted: bool,
            tab: str,
            reports: list[StabilityReport] | None = None,
        ) -> Iterator[list[Any]]:
            try:
                yield from _analyse(
                    models,
                    spec,
                    picture,
                    drawing,
                    int(k),
                    bool(inverted),
                    tab,
                    folders,
                    limits=limits,
                    cache=cache,
                    reports=reports,
                )
            except Busy as err:
                raise gr.Error(str(err), title="Busy") from err

        classes = len(default.class_names)

        def analyse_on_page(
            picture: Any, drawing: Any, k: float, inverted: bool, tab: str
        ) -> Iterator[list[Any]]:
            """``analyse`` for the page: every class's probability is kept in ``scores``
            and each label shows the top k, so moving the slider re-ranks without a rerun
            (``show_top``); the button is busy while it runs; an error clears the old
            results and stays written where they were (a toast as well), instead of error
            badges over stale results."""
            busy, idle = gr.Button(interactive=False), gr.Button(interactive=True)
            reports: list[StabilityReport] = []
            try:
                for status_, *found, summary_, plot_, gallery_ in analyse(
                    picture, drawing, classes, inverted, tab, reports
                ):
                    outputs = [status_, *_top(found, k), summary_, plot_, gallery_]
                    yield [*outputs, busy, found, None, None]
            except gr.Error as err:
                gr.Warning(err.message, title=err.title)
                failed = f"**{err.title}:** {err.message}"
                yield [failed, *[None] * len(labels), "", None, None, idle, None, None, None]
                return
            stacked = plot_report(reports[-1], display_names=models.display, stacked=True)
            done = [idle, gr.skip(), _as_json(reports[-1]), stacked]
            yield [gr.skip()] * (len(labels) + 4) + done

        def _top(found: Sequence[dict[str, float]], k: float) -> list[dict[str, float]]:
            return [dict(sorted(f.items(), key=lambda kv: -kv[1])[: int(k)]) for f in found]

        def show_top(k: float, found: list[dict[str, float]] | None) -> list[Any]:
            return [gr.skip()] * len(labels) if not found else _top(found, k)

        scores = gr.State(None)
        top_k.change(show_top, [top_k, scores], labels, queue=False, api_visibility="private")
        run_inputs = [image, sketch, top_k, invert, source]
        run_outputs = [status, *labels, summary, plot, gallery]
        page_outputs = [*run_outputs, run, scores, download, narrow_plot]
        run.click(
            analyse_on_page,
            inputs=run_inputs,
            outputs=page_outputs,
            preprocess=False,  # uploads are decoded by serve.uploads, with its limits
            api_visibility="private",
            concurrency_limit=limits.sweeps.running,
            concurrency_id="sweeps",  # one limit for every way of running
        )
        # the same as an API endpoint, where errors stay errors for the client
        gr.Button(visible=False).click(
            analyse,
            inputs=run_inputs,
            outputs=run_outputs,
            preprocess=False,
            api_name="analyse",
            concurrency_limit=limits.sweeps.running,
            concurrency_id="sweeps",
        )
        if picks is not None:  # one click: show the image on the Upload tab and run it

            def pick(event: gr.SelectData) -> tuple[Any, Any, str]:
                return str(samples[event.index].path), gr.Tabs(selected="upload"), "upload"

            picks.select(
                pick, None, [image, tabs, source], queue=False, api_visibility="private"
            ).then(
                analyse_on_page,
                inputs=run_inputs,
                outputs=page_outputs,
                preprocess=False,
                concurrency_limit=limits.sweeps.running,
                concurrency_id="sweeps",
                api_visibility="private",
            )
        if picks is not None:  # a link to a gallery image: /?sample=N (1-based) runs it

            def from_link(request: gr.Request) -> list[Any]:
                wanted = request.query_params.get("sample") if request is not None else None
                index = int(wanted) - 1 if wanted and wanted.isdigit() else -1
                if not 0 <= index < len(samples):
                    return [gr.skip(), gr.skip(), gr.skip(), False]
                return [str(samples[index].path), gr.Tabs(selected="upload"), "upload", True]

            def run_if_linked(
                picture: Any, drawing: Any, k: float, inverted: bool, tab: str, linked: bool
            ) -> Iterator[list[Any]]:
                if linked:
                    yield from analyse_on_page(picture, drawing, k, inverted, tab)
                else:
                    yield [gr.skip()] * len(page_outputs)

            linked = gr.State(False)
            demo.load(
                from_link,
                None,
                [image, tabs, source, linked],
                queue=False,
                api_visibility="private",
            ).then(
                run_if_linked,
                inputs=[*run_inputs, linked],
                outputs=page_outputs,
                preprocess=False,
                concurrency_limit=limits.sweeps.running,
                concurrency_id="sweeps",
                api_visibility="private",
            )
    demo.queue(max_size=limits.sweeps.running + limits.sweeps.waiting)
    return demo


def _analyse(
    models: ModelSet,
    spec: SweepSpec,
    picture: Any,
    drawing: Any,
    top_k: int,
    invert: bool,
    tab: str,
    folders: Sequence[str | Path],
    *,
    limits: Limits | None = None,
    cache: SweepCache | None = None,
    reports: list[StabilityReport] | None = None,
) -> Iterator[list[Any]]:
    """One UI request: decode; the top-k of each model at once (one image per model);
    then the sweeps, rotation first, then scale, then deformation (one batch per model and
    sweep), the summary, plot and thumbnails growing with each. The final report is
    appended to ``reports`` when given."""
    drawn = tab == "draw"
    payload = (drawing or {}).get("composite") if drawn else picture
    path = payload.get("path") if isinstance(payload, dict) else payload
    if not path:
        what = "Draw something first" if drawn else "Upload an image or pick a sample first"
        raise gr.Error(f"{what}.", title="No image")
    try:
        pixels = decode_image(read_uploaded(path, folders), invert=invert or drawn)
    except UploadError as err:
        raise gr.Error(err.message, title="This file cannot be classified") from err
    height, width = pixels.shape[:2]
    described = (
        f"**Input** {width}x{height} {'grey' if pixels.ndim == 2 else 'colour'}"
        f"{' (inverted)' if invert or drawn else ''}, resized for each model"
    )
    if not (invert or drawn) and _light_border(pixels):
        described = (
            "**The background looks light**: the models expect a light object on a dark "
            "background; tick *Invert* if yours is dark on light. " + described
        )
    try:
        top = [clf.predict(pixels, top_k=top_k)[0] for _, clf in models]
    except ValueError as err:
        raise gr.Error(str(err), title="This image cannot be classified") from err
    labels = [{p.label: p.score for p in predictions} for predictions in top]
    yield [
        f"{described}; sweeping {spec.batch_size} images per model...",
        *labels,
        "",
        None,
        None,
    ]
    start = time.perf_counter()
    report = cache.get(pixels) if cache is not None else None
    if report is not None:
        when = "a gallery image: swept at start-up"
    else:
        with limits.sweeps.enter() if limits is not None else contextlib.nullcontext():
            done: list[StabilityReport] = []
            for stage, following in zip(SWEEP_NAMES, [*SWEEP_NAMES[1:], None], strict=True):
                # every model on this sweep (one batch each, the sweep's images built once)
                clfs = [clf for _, clf in models]
                done.append(
                    measure_stability(clfs, pixels, spec=spec, names=models.names, sweeps=[stage])
                )
                if following:
                    yield [
                        f"{described}; {', '.join(SWEEP_NAMES[: SWEEP_NAMES.index(stage) + 1])}"
                        f" swept ({time.perf_counter() - start:.1f} s), now {following}...",
                        *labels,
                        *_results(done, models),
                    ]
            report = join_reports(done)
        when = f"in {time.perf_counter() - start:.1f} s"
    if reports is not None:
        reports.append(report)
    yield [
        f"{described}; {len(models)} models x {spec.batch_size} images, one batch per model "
        f"and sweep, {when}.",
        *labels,
        *_results([report], models),
    ]


_JSON_FILES = 256  # the newest result files kept for download


@functools.cache
def _json_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="rstcnn-results-"))


def _as_json(report: StabilityReport) -> str:
    """The report as the API writes it, in a file under this process's temp folder (which
    Gradio serves back to the page); the oldest beyond the newest 256 are deleted."""
    text = json.dumps(report.to_dict(), indent=1)
    folder = _json_folder()
    path = folder / f"stability-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    path.write_text(text)
    old = sorted(folder.glob("stability-*.json"), key=lambda f: f.stat().st_mtime)
    for stale in old[:-_JSON_FILES]:
        stale.unlink(missing_ok=True)
    return str(path)


def _light_border(pixels: Any) -> bool:
    """Whether the image's outermost rows and columns are mostly light (mean over 0.5)."""
    grey = pixels.mean(axis=-1) if pixels.ndim == 3 else pixels
    edge = max(1, min(grey.shape) // 16)
    border = [grey[:edge], grey[-edge:], grey[:, :edge], grey[:, -edge:]]
    return float(sum(b.sum() for b in border) / sum(b.size for b in border)) > 0.5


def _results(reports: Sequence[StabilityReport], models: ModelSet) -> list[Any]:
    """Summary, plot and thumbnails of the models and sweeps done so far."""
    report = join_reports(reports)
    return [
        _summary(report, models.display),
        plot_report(report, display_names=models.display),
        thumbnails(report),
    ]


def _class_name(clf: Any, index: int) -> str:
    names = clf.class_names
    return names[index] if 0 <= index < len(names) else f"class {index}"


def _summary(report: StabilityReport, names: dict[str, str]) -> str:
    rows = [
        "| model | prediction | P | rotation | scale | deformation |",
        "|---|---|---|---|---|---|",
    ]
    for m in report.models:
        kept = [f"{m.sweeps[s].agreement:.0%}" if s in m.sweeps else "..." for s in SWEEP_NAMES]
        rows.append(f"| {names[m.model]} | **{m.label}** | {m.score:.2f} | {' | '.join(kept)} |")
    headline = ", ".join(f"{names[m.model]} **{m.stability:.0%}**" for m in report.models)
    turned = "; ".join(
        f"{names[m.model]}: {m.sweeps['rotation'].changes(m.label)}" for m in report.models
    )
    return (
        f"**Stability** (share of the 0-360 degree rotation sweep whose top-1 label is "
        f"unchanged): {headline}\n\n**Turned:** {turned}\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(
            f"- {names[m.model]}: "
            + "; ".join(
                f"{verb}, {m.sweeps[sweep].changes(m.label)}"
                for sweep, verb in (("scale", "rescaled"), ("deformation", "deformed"))
                if sweep in m.sweeps
            )
            for m in report.models
            if "scale" in m.sweeps
        )
        + "\n\nColumns rotation / scale / deformation: share of each sweep with the unchanged "
        "top-1 label."
    )


def _intro(models: ModelSet) -> str:
    """Plain words first: what the page does and what to give it."""
    shown = " and ".join(f"**{models.display[name]}**" for name in models.names)
    return (
        "# Does the prediction survive a turn?\n"
        f"Give the page a picture of a piece of clothing, a shoe or a bag: {shown} each "
        "name what they see, then the page turns the picture all the way round, shrinks and "
        "enlarges it, and bends it a little, and shows whether each model's answer stays the "
        "same. A model built to ignore rotation and size (RST-CNN) should keep its answer; an "
        "ordinary network (CNN) often does not. Pick one of the test images below, upload "
        "your own (a light object on a dark background works best; tick *Invert* for a dark "
        "object on white) or draw one. Programs can use the HTTP API: [/docs](/docs)."
    )


def _details(models: ModelSet, spec: SweepSpec) -> str:
    """The model card and the maths behind the sweeps."""
    cards = []
    for name, clf in models:
        size = "x".join(str(v) for v in clf.input_size)
        accuracy = _accuracy(clf.metadata.get("rstcnn.accuracy"))
        precision = clf.metadata.get("rstcnn.precision", "fp32")
        engine = (
            "eager torch" if any(p.startswith("torch") for p in clf.providers) else "onnxruntime"
        )
        cards.append(
            f"- **{models.display[name]}** (`{name}`): input {size} grey{accuracy}; "
            f"runs in {'float32' if precision == 'fp32' else precision} ({engine})"
        )
    low, high = spec.scale_range
    return (
        "**The models.** Trained on RS-Fashion: the ten Fashion-MNIST classes (T-shirt/top, "
        "Trouser, Pullover, Dress, Coat, Sandal, Shirt, Sneaker, Bag, Ankle boot), each image "
        "turned by a random angle and shrunk to 0.3-1 of its size, on a 56x56 grey canvas. "
        "Accuracy is on that data set's test images.\n\n"
        + "\n".join(cards)
        + "\n\n**RST-CNN** (roto-scale-translation equivariant CNN with a Fourier-Bessel "
        "filter basis, FB) computes every filter at 8 rotations and 4 sizes and takes the "
        "strongest response, so its answer cannot change when the input is turned by a "
        "quarter turn, and changes little for other angles and sizes. The **CNN** is a "
        "plain network of the same size.\n\n"
        "**Limits.** The models know only these ten classes, as grey silhouettes: a light "
        "object on a dark background, centred, filling at most the canvas. Colour is "
        "averaged to grey; other objects get one of the ten names anyway. When the border "
        "of an upload is light, the page says so: tick *Invert*. Uploads: at most "
        f"{MAX_UPLOAD_BYTES / 2**20:g} MiB and {MAX_PIXELS / 1e6:g} megapixels.\n\n"
        f"**The sweeps.** Rotation: 0-360 degrees in {spec.rotation_steps} steps. Scale: "
        f"x{low:g} to x{high:g} in {spec.scale_steps} log-spaced steps (training objects span "
        "0.3-1). Deformation: the image is resampled along a smooth random displacement "
        "field tau, D_tau x(u) = x(u - tau(u)), whose largest slope |grad tau|_inf goes from 0 "
        f"to {spec.max_deformation:g} in {spec.deformation_steps} steps; the paper bounds how "
        "much an RST-CNN's features can move under such a deformation. *Stability* is the "
        "share of the rotation sweep whose top-1 label is the unchanged image's."
    )


def _accuracy(value: Any) -> str:
    """``rstcnn.accuracy`` metadata (a number or ``{"test_acc": ..., ...}``) as text."""
    if isinstance(value, dict):
        parts = [
            f"{key.removesuffix('_acc').replace('_', ' ')} accuracy {_percent(v)}"
            for key, v in value.items()
            if key.endswith("acc") and isinstance(v, (int, float))
        ]
        return "".join(f", {part}" for part in parts)
    if isinstance(value, (int, float)):
        return f", accuracy {_percent(value)}"
    return ""


def _percent(number: float) -> str:
    return f"{number:.1%}" if number <= 1 else f"{number:.1f}%"


def _cannot_bind(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (the address in use, a port below
    1024 without the right, an unknown host), or None where it can."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as err:
        return err.strerror or str(err)
    return None


def warm_gallery(app: FastAPI) -> Any:
    """Sweep the gallery's images in the background (``SweepCache.warm``), so that the
    page and the API answer them at once; returns the thread."""
    images = []
    for sample in app.state.samples:
        try:
            images.append(decode_image(sample.path.read_bytes()))
        except (OSError, UploadError) as err:
            log.warning("gallery image %s not precomputed: %s", sample.path, err)
    return app.state.sweep_cache.warm(images)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        action="append",
        help=f"ONNX model to serve (repeatable; default: {' '.join(DEFAULT_MODELS)}), or a "
        "checkpoint (.pt) to serve by eager torch (int8 products, bfloat16 or int16 products "
        "where it has a passing train/precision_check.py --precision P --record); of several "
        "files of "
        "one checkpoint the fastest servable one is served",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="onnxruntime threads per model (torch's, for a .pt)",
    )
    parser.add_argument(
        "--samples-dir", default=None, help="gallery folder (default: the shipped serve/gallery)"
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name the server answers to (repeatable; '*' for any); by default "
        "the loopback names and the bind address (a wildcard bind: this machine's names)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin (https://example.org) whose pages may call the API (repeatable; "
        "default: none)",
    )
    parser.add_argument(
        "--max-sweeps", type=int, default=1, help="stability sweeps run at once (default 1)"
    )
    parser.add_argument(
        "--sweep-queue", type=int, default=8, help="sweeps waiting before 503 (default 8)"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0 .. 65535, got {args.port}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    busy = _cannot_bind(args.host, args.port)
    if busy:  # before the models load: that takes seconds
        parser.exit(
            2,
            f"error: cannot serve on {args.host}:{args.port} ({busy}); is another server (e.g. "
            "scripts/demo.sh) still running there? Stop it or pass --port N\n",
        )

    return_memory_to_the_system()
    try:
        app = build_app(
            args.model,
            samples_dir=args.samples_dir,
            threads=args.threads,
            limits=Limits(sweeps=args.max_sweeps, sweep_queue=args.sweep_queue),
            hosts=sorted(allowed_hosts(args.host, args.allowed_host)),
            cors_origins=args.cors_origin,
        )
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")

    import uvicorn

    release_free_memory()  # the start-up's checks and timings peak higher than serving
    warm_gallery(app)
    log.info("serving on http://%s:%d (API docs at /docs)", args.host, args.port)
    uvicorn.Server(server_config(app, host=args.host, port=args.port, log_level="warning")).run()
