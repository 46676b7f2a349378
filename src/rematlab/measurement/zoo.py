"""The original study's six architectures, each an `nn.Sequential` of blocks.

Strategies act on blocks, so every model here is a chain: the top-level children are the
blocks, and a block boundary carries a single tensor. Shape comments are per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from rematlab.core.checks import load_object, user_code
from rematlab.exceptions import ConfigError


def _block(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


def mlp(depth: int, in_features: int = 784, width: int = 1024, classes: int = 10) -> nn.Sequential:
    """A ReLU MLP with `depth` linear layers; each block is Linear(+ReLU)."""
    dims = [in_features] + [width] * (depth - 1) + [classes]
    blocks: list[nn.Module] = []
    for i in range(depth):
        layers: list[nn.Module] = [nn.Flatten()] if i == 0 else []
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < depth - 1:
            layers.append(nn.ReLU())
        blocks.append(_block(*layers))  # (width,)
    return nn.Sequential(*blocks)


def lenet5(in_channels: int = 1, classes: int = 10) -> nn.Sequential:
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling, 61,706 parameters on 1x32x32."""
    return nn.Sequential(
        _block(nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2)),  # (6, 14, 14)
        _block(nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)),  # (16, 5, 5)
        _block(nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU()),  # (120,)
        _block(nn.Linear(120, 84), nn.ReLU()),  # (84,)
        _block(nn.Linear(84, classes)),  # (classes,)
    )


def alexnet(scale: str = "imagenet", classes: int | None = None) -> nn.Sequential:
    """AlexNet as in torchvision (61,100,840 parameters on ImageNet) or its CIFAR variant."""
    if scale == "imagenet":
        classes = classes or 1000
        return nn.Sequential(
            _block(nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2)),  # (64, 27, 27)
            _block(nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2)),  # (192,13,13)
            _block(nn.Conv2d(192, 384, 3, padding=1), nn.ReLU()),  # (384, 13, 13)
            _block(nn.Conv2d(384, 256, 3, padding=1), nn.ReLU()),  # (256, 13, 13)
            _block(nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2)),  # (256,6,6)
            _block(nn.AdaptiveAvgPool2d(6), nn.Flatten(), nn.Dropout(),
                   nn.Linear(256 * 36, 4096), nn.ReLU()),  # (4096,)
            _block(nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU()),  # (4096,)
            _block(nn.Linear(4096, classes)),  # (classes,)
        )
    classes = classes or 10
    return nn.Sequential(
        _block(nn.Conv2d(3, 64, 3, 2, 1), nn.ReLU(), nn.MaxPool2d(2)),  # (64, 8, 8)
        _block(nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),  # (192, 4, 4)
        _block(nn.Conv2d(192, 384, 3, padding=1), nn.ReLU()),  # (384, 4, 4)
        _block(nn.Conv2d(384, 256, 3, padding=1), nn.ReLU()),  # (256, 4, 4)
        _block(nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),  # (256, 2, 2)
        _block(nn.Flatten(), nn.Dropout(), nn.Linear(256 * 4, 4096), nn.ReLU()),  # (4096,)
        _block(nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU()),  # (4096,)
        _block(nn.Linear(4096, classes)),  # (classes,)
    )


_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16(scale: str = "imagenet", classes: int | None = None) -> nn.Sequential:
    """VGG-16 (configuration D): 138,357,544 parameters on ImageNet; CIFAR head 512-512-10."""
    blocks: list[nn.Module] = []
    in_ch = 3
    for i, v in enumerate(_VGG16):
        if v == "M":
            continue
        layers: list[nn.Module] = [nn.Conv2d(in_ch, int(v), 3, padding=1), nn.ReLU()]
        if i + 1 < len(_VGG16) and _VGG16[i + 1] == "M":
            layers.append(nn.MaxPool2d(2))
        blocks.append(_block(*layers))  # (v, H/2^k, W/2^k)
        in_ch = int(v)
    if scale == "imagenet":
        classes = classes or 1000
        blocks += [
            _block(nn.AdaptiveAvgPool2d(7), nn.Flatten(), nn.Linear(512 * 49, 4096), nn.ReLU(),
                   nn.Dropout()),  # (4096,)
            _block(nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout()),  # (4096,)
            _block(nn.Linear(4096, classes)),  # (classes,)
        ]
    else:
        classes = classes or 10
        blocks += [
            _block(nn.Flatten(), nn.Dropout(), nn.Linear(512, 512), nn.ReLU()),  # (512,)
            _block(nn.Dropout(), nn.Linear(512, 512), nn.ReLU()),  # (512,)
            _block(nn.Linear(512, classes)),  # (classes,)
        ]
    return nn.Sequential(*blocks)


@dataclass(frozen=True)
class ModelInfo:
    """A zoo entry: how to build the model for an input scale, and that scale's input shape."""

    name: str
    scales: dict[str, tuple[int, ...]]
    build: Callable[[str], nn.Module]

    @property
    def default_scale(self) -> str:
        return next(iter(self.scales))


_MNIST = {"mnist": (1, 28, 28)}
_IMAGES = {"cifar": (3, 32, 32), "imagenet": (3, 224, 224)}

REGISTRY: dict[str, ModelInfo] = {
    "mlp3": ModelInfo("mlp3", _MNIST, lambda s: mlp(3)),
    "mlp5": ModelInfo("mlp5", _MNIST, lambda s: mlp(5)),
    "mlp7": ModelInfo("mlp7", _MNIST, lambda s: mlp(7)),
    "lenet5": ModelInfo("lenet5", {"mnist": (1, 32, 32)}, lambda s: lenet5()),
    "alexnet": ModelInfo("alexnet", _IMAGES, alexnet),
    "vgg16": ModelInfo("vgg16", _IMAGES, vgg16),
}


_MAX_DIM = 2**31 - 1


def parse_shape(text: str) -> tuple[int, ...]:
    """'3,224,224' -> (3, 224, 224); a clear error otherwise."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(","))
    except ValueError:
        raise ConfigError(f"input shape {text!r} is not a comma-separated list of sizes") from None
    if not shape or any(d <= 0 or d > _MAX_DIM for d in shape) or len(shape) > 8:
        raise ConfigError(f"input shape {text!r} must list up to 8 positive sizes (each at "
                          f"most {_MAX_DIM}), e.g. 3,32,32")
    return shape


def scale_of(model: str, scale: str | None) -> str:
    """The input scale of a zoo model: `scale`, or its default; a `ConfigError` naming the
    available ones otherwise."""
    info = REGISTRY[model]
    scale = scale or info.default_scale
    if scale not in info.scales:
        raise ConfigError(f"input {scale!r} is not available for {model}; choose one of "
                          f"{sorted(info.scales)}")
    return scale


def resolve(
    model: str, scale: str | None = None, input_shape: tuple[int, ...] | None = None
) -> tuple[nn.Module, tuple[int, ...], str]:
    """Build a zoo model or a user's `module.path:factory`; return it, its sample shape
    (`input_shape`, per sample, for a user model: None when its batches come from a factory),
    and the scale."""
    if model in REGISTRY:
        scale = scale_of(model, scale)
        return REGISTRY[model].build(scale), input_shape or REGISTRY[model].scales[scale], scale
    if ":" not in model:
        raise ConfigError(
            f"unknown model {model!r}; choose one of {sorted(REGISTRY)} or give module.path:factory"
        )
    factory = load_object(model, "model factory")
    with user_code(f"model factory {model!r} failed"):
        built = factory()
    if not isinstance(built, nn.Module):
        raise ConfigError(f"model factory {model!r} returned {type(built).__name__}, not nn.Module")
    return built, input_shape, scale or "custom"
