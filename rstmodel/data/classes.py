"""The class names of each data set the project trains on, by data set name."""

from __future__ import annotations

from .rs import RSDataset

__all__ = ["CLASS_NAMES", "STL10"]

STL10 = "stl10"
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    RSDataset.MNIST.value: tuple(str(d) for d in range(10)),
    RSDataset.FASHION.value: (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    STL10: ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck"),
}
