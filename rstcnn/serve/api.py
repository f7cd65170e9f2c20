"""HTTP API: health, models, classification and stability sweeps (FastAPI).

Every error is a JSON body ``{"detail": "<reason>"}`` with a string reason: 400 empty
upload (or a request for another host), 403 a file the page did not upload, 404 unknown
model, 408 a client too slow to send its request, 413 upload over ``MAX_UPLOAD_BYTES`` or
image over ``MAX_PIXELS``, 415 not an image in an accepted format, 422 damaged image or
invalid form field, 503 too many requests queued (with ``Retry-After``). The classifiers are
loaded once and shared by all requests (one onnxruntime session per model;
``InferenceSession.run`` is thread-safe), and the endpoints are plain functions, so FastAPI
runs them on its worker threads. Each request runs inside a ``Gate``: classification and
sweeps have their own bounds on how many run and wait at once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from .guards import Busy, Gate
from .memory import release_free_memory
from .stability import StabilityReport, SweepSpec, measure_stability
from .uploads import MAX_PIXELS, MAX_UPLOAD_BYTES, UploadError, decode_image

__all__ = [
    "ModelSet",
    "Limits",
    "SweepCache",
    "create_router",
    "display_name",
    "install_error_handlers",
]

log = logging.getLogger(__name__)

_DISPLAY = {
    "cnn": "CNN",
    "rst_cnn_fb": "RST-CNN(FB)",
    "rst_cnn_sl": "RST-CNN(SL)",
    "rst_cnn_plus_fb": "RST-CNN+(FB)",
    "rst_cnn_plus_sl": "RST-CNN+(SL)",
    "rst_cnn_fb_ref": "RST-CNN(FB, ref. basis)",
    "rst_cnn_fb_nr4": "RST-CNN(FB, Nr=4)",
    "rot_cnn": "rotation-only CNN",
    "scale_cnn": "scale-only CNN",
}


def display_name(classifier: Any) -> str:
    """The paper's name of the classifier's architecture, else its own name."""
    model = str(classifier.metadata.get("rstcnn.model", classifier.name))
    return _DISPLAY.get(model, classifier.name)


class ModelSet:
    """The served classifiers by unique name (a repeated name gets ``-2``, ``-3``, ...);
    the first one is the default."""

    def __init__(self, classifiers: Sequence[Any]):
        if not classifiers:
            raise ValueError("serve at least one model")
        self._by_name: dict[str, Any] = {}
        self.display: dict[str, str] = {}
        for clf in classifiers:
            name, n = clf.name, 1
            while name in self._by_name:
                n += 1
                name = f"{clf.name}-{n}"
            self._by_name[name] = clf
            self.display[name] = display_name(clf)
        if len(set(self.display.values())) < len(self.display):
            self.display = {name: f"{shown} [{name}]" for name, shown in self.display.items()}

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def default(self) -> str:
        return self.names[0]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._by_name.items())

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str | None) -> Any:
        """The classifier called ``name`` (the default for None); 404 if unknown."""
        key = name or self.default
        if key not in self._by_name:
            raise HTTPException(404, f"unknown model {key!r}; served: {', '.join(self.names)}")
        return self._by_name[key]

    def info(self, name: str) -> dict[str, Any]:
        clf = self._by_name[name]
        meta = clf.metadata
        return {
            "name": name,
            "display_name": self.display[name],
            "architecture": meta.get("rstcnn.model"),
            "classes": list(clf.class_names),
            "input_size": list(clf.input_size),
            "accuracy": meta.get("rstcnn.accuracy"),
            "providers": list(clf.providers),
        }


class PredictionOut(BaseModel):
    label: str
    index: int
    score: float = Field(description="softmax probability")


class ClassifyResponse(BaseModel):
    model: str
    predictions: list[PredictionOut]


class SweepOut(BaseModel):
    unit: str
    values: list[float]
    probability: list[float] = Field(description="P(unperturbed top-1 class) per step")
    top1: list[str]
    agreement: float = Field(description="fraction of steps with the unperturbed top-1")


class ModelStabilityOut(BaseModel):
    model: str
    label: str
    index: int
    score: float
    stability: float = Field(description="rotation agreement")
    sweeps: dict[str, SweepOut]
    changes: dict[str, str] = Field(
        description="per sweep, where the top-1 label differs, in words "
        '(e.g. "Dress at 150 deg, Trouser at 285-300 deg")'
    )


class StabilityResponse(BaseModel):
    stability_definition: str
    batch_size: int = Field(description="images per model, run as one batch")
    deformation_seed: int
    models: list[ModelStabilityOut]


class ErrorResponse(BaseModel):
    detail: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in (
        (400, "empty upload"),
        (404, "unknown model"),
        (413, f"file over {MAX_UPLOAD_BYTES} bytes or image over {MAX_PIXELS} pixels"),
        (415, "not an image in an accepted format"),
        (422, "damaged image or invalid field"),
        (503, "too many requests queued; retry after Retry-After seconds"),
    )
}

ImageField = Annotated[UploadFile, File(description="the image (PNG, JPEG, GIF, BMP, TIFF, ...)")]
InvertField = Annotated[
    bool, Form(description="dark object on a light background: invert before classifying")
]


class Limits:
    """How many requests of each kind run and wait at once (``Gate``). A sweep costs
    ~1 GB for the shipped RST-CNN in onnxruntime and both cores for seconds, so one runs
    at a time by default; classification is cheap."""

    def __init__(
        self,
        *,
        sweeps: int = 1,
        sweep_queue: int = 8,
        classify: int = 8,
        classify_queue: int = 24,
        wait: float = 120.0,
    ):
        self.sweeps = Gate("stability", running=sweeps, waiting=sweep_queue, wait=wait)
        self.classify = Gate("classify", running=classify, waiting=classify_queue, wait=wait)

    def describe(self) -> dict[str, int]:
        return {
            "sweeps_running": self.sweeps.running,
            "sweeps_waiting": self.sweeps.waiting,
            "classify_running": self.classify.running,
            "classify_waiting": self.classify.waiting,
        }


class SweepCache:
    """Stability reports of the gallery's images, computed once in the background after
    start-up (``warm``) and keyed by the decoded pixels, so a request with one of those
    images is answered at once, whatever file it came in. Only the gallery is stored: the
    cache's size is fixed by it. ``gate``: the sweeps'; ``yield_to``: gates of other
    requests (classifications) whose load the background sweeps wait out."""

    def __init__(
        self, models: ModelSet, spec: SweepSpec, gate: Gate, yield_to: Sequence[Gate] = ()
    ):
        self.models, self.spec, self.gate = models, spec, gate
        self.yield_to = tuple(yield_to)
        self._reports: dict[str, StabilityReport] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(pixels: np.ndarray) -> str:
        digest = hashlib.sha256(f"{pixels.shape}{pixels.dtype}".encode())
        digest.update(np.ascontiguousarray(pixels).tobytes())
        return digest.hexdigest()

    def __len__(self) -> int:
        return len(self._reports)

    def get(self, pixels: np.ndarray, model: str | None = None) -> StabilityReport | None:
        """The stored report of ``pixels`` (for one ``model``, or all), or None."""
        with self._lock:
            report = self._reports.get(self.key(pixels))
        if report is None or model is None:
            return report
        kept = [m for m in report.models if m.model == model]
        return StabilityReport(report.spec, kept, report.sweeps) if kept else None

    def warm(self, images: Sequence[np.ndarray], pause: float = 0.5) -> threading.Thread:
        """Sweep ``images`` (decoded, as ``decode_image`` returns them) in a daemon thread,
        each only while no request is sweeping or waiting to (``Gate.enter_if_idle``) and
        no other request has run for ``pause`` s (``yield_to``; checked every ``pause`` s),
        so a request waits at most for one of these sweeps and a load of classifications
        does not share the cores with them; returns the thread."""

        def sweep(pixels: np.ndarray) -> StabilityReport:
            while True:
                if not all(gate.quiet_for(pause) for gate in self.yield_to):
                    time.sleep(pause)
                    continue
                try:
                    with self.gate.enter_if_idle():
                        return measure_stability(
                            [clf for _, clf in self.models],
                            pixels,
                            spec=self.spec,
                            names=self.models.names,
                        )
                except Busy:
                    time.sleep(pause)

        def run() -> None:
            for pixels in images:
                try:
                    report = sweep(pixels)
                except Exception:  # a bad file: that image is swept on demand
                    log.exception("could not precompute a gallery sweep")
                    continue
                with self._lock:
                    self._reports[self.key(pixels)] = report
            # the start-up's peaks (variant timing, these sweeps) are not the steady state's
            release_free_memory()

        thread = threading.Thread(target=run, name="gallery-sweeps", daemon=True)
        thread.start()
        return thread


@contextmanager
def _admitted(gate: Gate) -> Iterator[None]:
    """``gate.enter()``, a full gate answered with 503 and ``Retry-After``."""
    try:
        with gate.enter():
            yield
    except Busy as err:
        raise HTTPException(503, str(err), headers={"Retry-After": str(err.retry_after)}) from err


def install_error_handlers(app: FastAPI) -> None:
    """Invalid fields get 422 with a string ``detail`` ("top_k: Input should be ..."),
    like every other error."""

    @app.exception_handler(RequestValidationError)
    async def invalid_field(request: Request, err: RequestValidationError) -> JSONResponse:
        parts = []
        for error in err.errors():
            where = ".".join(
                str(p) for p in error.get("loc", ()) if p not in ("body", "query", "path")
            )
            parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else error["msg"])
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)


def _decode(upload: UploadFile, invert: bool) -> Any:
    data = upload.file.read(MAX_UPLOAD_BYTES + 1)
    try:
        return decode_image(data, invert=invert)
    except UploadError as err:
        raise HTTPException(err.status, err.message) from err


def _run(action: Any) -> Any:
    """Classifier input errors (NaN, wrong shape, ...) are the client's: 422."""
    try:
        return action()
    except ValueError as err:
        raise HTTPException(422, str(err)) from err


def create_router(
    models: ModelSet,
    *,
    spec: SweepSpec | None = None,
    limits: Limits | None = None,
    cache: SweepCache | None = None,
) -> APIRouter:
    """The API routes over ``models``; ``spec`` sets the stability sweeps, ``limits`` how
    many requests run at once; ``cache`` answers the gallery's images."""
    spec = spec or SweepSpec()
    limits = limits or Limits()
    router = APIRouter()

    @router.get("/healthz", tags=["service"])
    def healthz() -> dict[str, Any]:
        """Liveness: the served model names."""
        return {"status": "ok", "models": models.names}

    @router.get("/v1/models", tags=["models"])
    def list_models() -> dict[str, Any]:
        """The served models: classes, input size, accuracy (from the ONNX metadata)."""
        return {
            "default": models.default,
            "models": [models.info(name) for name in models.names],
            "limits": {
                "max_upload_bytes": MAX_UPLOAD_BYTES,
                "max_pixels": MAX_PIXELS,
                **limits.describe(),
            },
        }

    @router.post(
        "/v1/classify", response_model=ClassifyResponse, responses=_ERRORS, tags=["models"]
    )
    def classify(
        image: ImageField,
        top_k: Annotated[int, Form(ge=1, le=1000, description="how many classes")] = 5,
        model: Annotated[str | None, Form(description="model name; default: the first")] = None,
        invert: InvertField = False,
    ) -> dict[str, Any]:
        """Top-k classes of one image."""
        clf = models.get(model)
        with _admitted(limits.classify):
            pixels = _decode(image, invert)
            k = min(top_k, len(clf.class_names))
            predictions = _run(lambda: clf.predict(pixels, top_k=k)[0])
        return {
            "model": model or models.default,
            "predictions": [
                {"label": p.label, "index": int(p.index), "score": float(p.score)}
                for p in predictions
            ],
        }

    @router.post(
        "/v1/stability", response_model=StabilityResponse, responses=_ERRORS, tags=["models"]
    )
    def stability(
        image: ImageField,
        model: Annotated[
            str | None, Form(description="model name; default: every served model")
        ] = None,
        invert: InvertField = False,
    ) -> dict[str, Any]:
        """Probability of the unperturbed top-1 class and the top-1 label along rotation
        (0-360 degrees), scale (log-spaced factors) and deformation (|grad tau|_inf 0-0.2)
        sweeps; each model runs the distinct ones of them as one batch."""
        chosen = [(model, models.get(model))] if model else list(models)  # [(name, classifier)]
        with _admitted(limits.classify):
            pixels = _decode(image, invert)
        report = cache.get(pixels, model) if cache is not None else None
        if report is None:
            with _admitted(limits.sweeps):
                report = _run(
                    lambda: measure_stability(
                        [clf for _, clf in chosen], pixels, spec=spec, names=[n for n, _ in chosen]
                    )
                )
        return report.to_dict()

    return router
