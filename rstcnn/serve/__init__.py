"""Inference on exported models (onnxruntime, numpy and Pillow; no torch): the
``Classifier`` API, and the web app and HTTP API built on it."""

from .classifier import MAX_PIXELS, Classifier, Prediction

__all__ = ["MAX_PIXELS", "Classifier", "Prediction"]
