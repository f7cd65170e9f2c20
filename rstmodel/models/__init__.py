"""Model registry and the paper's models; importing this registers them all."""

from . import cnn, resnet, rst_cnn, sevf, sfcnn  # noqa: F401  (registration side effects)
from .cnn import CNN, CNNConfig
from .registry import create_model, list_models, model_description, register_model
from .resnet import ResNet16, ResNetConfig, RSTResNet16
from .rst_cnn import RSTCNN, RSTCNNConfig
from .sfcnn import SFCNN, SFCNNConfig

__all__ = [
    "CNN",
    "CNNConfig",
    "RSTCNN",
    "RSTCNNConfig",
    "SFCNN",
    "SFCNNConfig",
    "ResNet16",
    "RSTResNet16",
    "ResNetConfig",
    "create_model",
    "list_models",
    "model_description",
    "register_model",
]
