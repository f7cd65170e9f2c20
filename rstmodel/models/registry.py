"""Model registry: ``create_model(name, **overrides)`` and ``list_models()``."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

__all__ = ["register_model", "create_model", "list_models", "model_description", "check_images"]

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register a factory under its function name; a duplicate name raises."""
    name = fn.__name__
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is already registered")
    _REGISTRY[name] = fn
    return fn


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def model_description(name: str) -> str:
    doc = (_REGISTRY[name].__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def create_model(name: str, **overrides) -> nn.Module:
    """Build a registered model; ``overrides`` replace fields of its config."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}") from None
    return factory(**overrides)


def check_images(x: Tensor, channels: int, size: int) -> None:
    """Refuse anything but a batch of images ``[B, channels, size, size]``, naming it."""
    if x.dim() != 4 or tuple(x.shape[1:]) != (channels, size, size):
        raise ValueError(
            f"expected input [B, {channels}, {size}, {size}], got shape {tuple(x.shape)}"
        )
