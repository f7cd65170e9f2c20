"""torch Datasets over prepared uint8 arrays."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate
from torchvision.transforms import InterpolationMode, v2

from .transforms import GRID_SAMPLE_MODES, RandomRST, rotate_scale

__all__ = ["ArrayDataset", "Batch", "RotatedScaledDataset", "VariantDataset", "collate"]


class Batch(tuple):
    """``(images [B, C, H, W], labels [B])`` made in one indexing operation: ``collate``
    passes it through as the DataLoader's batch."""


def collate(samples: list[tuple[Tensor, int]] | Batch) -> tuple[Tensor, Tensor]:
    """The DataLoader ``collate_fn`` for these datasets: a ``Batch`` from ``__getitems__``
    as it is, a list of samples as ``default_collate`` makes it."""
    if isinstance(samples, Batch):
        return samples[0], samples[1]
    return default_collate(samples)


class ArrayDataset(Dataset):
    """uint8 images ``[N, H, W]`` or ``[N, C, H, W]`` and labels ``[N]`` ->
    ``(float32 [C, H, W] in [0, 1], label)``, then ``transform`` on the image if given."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        transform: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(
                f"expected uint8 images [N, H, W] or [N, C, H, W], got {images.dtype} {images.shape}"
            )
        if labels.shape != (images.shape[0],):
            raise ValueError(f"{images.shape[0]} images but labels of shape {labels.shape}")
        self.images = torch.from_numpy(
            images if images.ndim == 4 else images[:, None]
        )  # [N, C, H, W]
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.transform = transform

    @property
    def batched(self) -> bool:
        """Whether a batch can be read with one indexing operation: the plain image reader
        and a transform made of normalisation and ``RandomRST`` (``RandomRST.each``)."""
        return self._batch_reader() is not None

    def _batch_reader(self) -> Callable[[Tensor], Tensor] | None:
        plain = type(self).image is ArrayDataset.image
        plain &= type(self).__getitem__ is ArrayDataset.__getitem__
        return _batch_transform(self.transform) if plain else None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def pixels(self, index: Tensor) -> Tensor:
        """uint8 ``[B, C, H, W]`` of the images at ``index`` (int64 [B])."""
        return self.images[index]

    def image(self, index: int) -> Tensor:
        """float32 [C, H, W] in [0, 1], before ``transform``."""
        return self.pixels(torch.tensor([index]))[0].to(torch.float32) / 255.0

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image = self.image(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    def __getitems__(self, indices: list[int]) -> Batch | list[tuple[Tensor, int]]:
        """What the DataLoader asks for: a whole batch at once where ``batched`` (the same
        values and random draws as stacking ``self[i]``, to float rounding; 6x the images/s
        of one loader process on a 2-core CPU, BENCHMARKS.md), else the items one by one."""
        reader = self._batch_reader()
        if reader is None:
            return [self[i] for i in indices]
        index = torch.as_tensor(indices, dtype=torch.long)
        images = reader(self.pixels(index).to(torch.float32) / 255.0)
        return Batch((images, self.labels[index]))


def _batch_transform(transform: Callable[[Tensor], Tensor] | None):
    """``transform`` applied image by image, as one call on a batch; None where unknown."""
    if transform is None:
        return lambda images: images
    if isinstance(transform, v2.Normalize):
        return transform
    if isinstance(transform, RandomRST):
        return transform.each if transform.interpolation in GRID_SAMPLE_MODES else None
    if isinstance(transform, v2.Compose):
        steps = [_batch_transform(t) for t in transform.transforms]
        if any(step is None for step in steps):
            return None

        def composed(images: Tensor) -> Tensor:
            for step in steps:
                images = step(images)
            return images

        return composed
    return None


class VariantDataset(ArrayDataset):
    """Several renderings of the same images (``variants`` uint8, each ``[N, H, W]`` or
    ``[N, C, H, W]``, one label each): every read takes one of them uniformly at random
    (torch's generator, so each loader process draws its own), e.g. the same poses made by
    different resampling pipelines. Batched reads as ``ArrayDataset``."""

    def __init__(
        self,
        variants: list[np.ndarray],
        labels: np.ndarray,
        transform: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        if not variants or any(v.shape != variants[0].shape for v in variants):
            shapes = [v.shape for v in variants]
            raise ValueError(f"need one or more variants of one shape, got {shapes}")
        super().__init__(variants[0], labels, transform)
        self.variants = torch.stack([ArrayDataset(v, labels).images for v in variants])

    def pixels(self, index: Tensor) -> Tensor:
        pick = torch.randint(len(self.variants), index.shape)
        return self.variants[pick, index]


class RotatedScaledDataset(ArrayDataset):
    """Image ``i`` rotated by ``angles[i]`` rad and scaled by ``scales[i]`` about the centre
    (e.g. the seeded STL-10 OOD test set). Same items as ``ArrayDataset``."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        angles: np.ndarray,
        scales: np.ndarray,
        *,
        interpolation: InterpolationMode = InterpolationMode.BILINEAR,
        transform: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__(images, labels, transform)
        if angles.shape != labels.shape or scales.shape != labels.shape:
            raise ValueError(
                f"need one angle and one scale per image: {labels.shape[0]} images, "
                f"angles {angles.shape}, scales {scales.shape}"
            )
        self.angles = angles
        self.scales = scales
        self.interpolation = interpolation

    def image(self, index: int) -> Tensor:
        plain = super().image(index)
        return rotate_scale(
            plain,
            float(self.angles[index]),
            float(self.scales[index]),
            interpolation=self.interpolation,
        )
