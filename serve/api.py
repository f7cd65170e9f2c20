"""HTTP API: health, models, classification and stability sweeps (FastAPI).

Every error is a 4xx JSON body ``{"detail": "<reason>"}``: 400 empty upload, 404 unknown
model, 413 upload over ``MAX_UPLOAD_BYTES`` or image over ``MAX_PIXELS``, 415 not an image,
422 damaged image or invalid form field. The classifiers are loaded once and shared by all
requests (one onnxruntime session per model; ``InferenceSession.run`` is thread-safe), and
the endpoints are plain functions, so FastAPI runs them on its worker threads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, HTTPException, UploadFile
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .stability import SweepSpec, measure_stability
from .uploads import MAX_PIXELS, MAX_UPLOAD_BYTES, UploadError, decode_image

__all__ = ["ModelSet", "BodyLimit", "create_router", "display_name"]

log = logging.getLogger(__name__)

_DISPLAY = {
    "cnn": "CNN",
    "rst_cnn_fb": "RST-CNN(FB)",
    "rst_cnn_sl": "RST-CNN(SL)",
    "rst_cnn_plus_fb": "RST-CNN+(FB)",
    "rst_cnn_plus_sl": "RST-CNN+(SL)",
    "rst_cnn_fb_ref": "RST-CNN(FB, ref. basis)",
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
        (415, "not an image"),
        (422, "damaged image or invalid field"),
    )
}

ImageField = Annotated[UploadFile, File(description="the image (PNG, JPEG, GIF, BMP, TIFF, ...)")]
InvertField = Annotated[
    bool, Form(description="dark object on a light background: invert before classifying")
]


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


def create_router(models: ModelSet, *, spec: SweepSpec | None = None) -> APIRouter:
    """The API routes over ``models``; ``spec`` sets the stability sweeps."""
    spec = spec or SweepSpec()
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
            "limits": {"max_upload_bytes": MAX_UPLOAD_BYTES, "max_pixels": MAX_PIXELS},
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
        sweeps; each model runs all of them as one batch."""
        chosen = [(model, models.get(model))] if model else list(models)  # [(name, classifier)]
        pixels = _decode(image, invert)
        report = _run(
            lambda: measure_stability(
                [clf for _, clf in chosen], pixels, spec=spec, names=[n for n, _ in chosen]
            )
        )
        return report.to_dict()

    return router


class BodyLimit:
    """ASGI middleware: request bodies to paths under ``prefix`` over ``limit`` bytes get
    413 JSON, by Content-Length up front or by counting a streamed body."""

    def __init__(self, app: ASGIApp, *, limit: int, prefix: str = "/v1/"):
        self.app = app
        self.limit = limit
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {"detail": f"the request is larger than the {self.limit / 2**20:g} MiB limit"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
