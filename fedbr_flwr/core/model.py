"""Backbones with an explicit split: feature extractor phi (``features``) and linear classifier
omega (``classifier``). Algorithms build their own models around these two parts in their client
files (FedBR's projection head, DisTrans' double input, MOON's projection layers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .errors import ConfigError


class SplitModel(nn.Module):
    """``classifier(features(x))`` with ``features`` returning flat (B, feature_dim) vectors."""

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.classifier = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# (output channels, stride) of each 3x3 conv: the paper's MNIST CNN, and a CPU-sized one (about 1/50 of
# its FLOPs) for the main job
CNN_LAYERS = {"cnn": [(64, 1), (128, 2), (128, 1), (128, 1)], "cnn-small": [(16, 1), (32, 2), (32, 2)]}


def mnist_cnn_features(in_channels: int = 1, layers_spec: list[tuple[int, int]] = CNN_LAYERS["cnn"]) -> nn.Sequential:
    """Conv layers (the paper's: 64, 128 stride 2, 128, 128); each conv -> ReLU -> GroupNorm(8); avg pool."""
    layers: list[nn.Module] = []
    c_in = in_channels
    for c_out, stride in layers_spec:
        layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.ReLU(), nn.GroupNorm(8, c_out)]
        c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers)


def lenet_features(
    in_channels: int = 1,
    image_size: int = 28,
    widths: tuple[int, int] = (16, 32),
    hidden: int = 64,
    norm: bool = True,
) -> nn.Sequential:
    """Two 3x3 convs (16, 32 channels), each -> ReLU -> GroupNorm(8) (``norm``) -> 2x2 max pool, then a linear
    layer to ``hidden`` features with ReLU. Sized for a CPU: about 3/4 of cnn-small's FLOPs, and it learns
    RotatedMNIST centrally in a few hundred steps where cnn-small does not (tests/test_models.py). Without
    ``norm`` (model=lenet-nonorm) it is the plain conv-pool-conv-pool-FC(64) net, at the same cost."""
    layers: list[nn.Module] = []
    c_in = in_channels
    for c_out in widths:
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
        layers += [nn.GroupNorm(8, c_out)] if norm else []
        layers.append(nn.MaxPool2d(2))
        c_in = c_out
    side = image_size // 2 ** len(widths)
    layers += [nn.Flatten(), nn.Linear(c_in * side * side, hidden), nn.ReLU()]
    return nn.Sequential(*layers)


VGG11_LAYOUT = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def vgg11_features(in_channels: int = 3, layout: list = VGG11_LAYOUT) -> nn.Sequential:
    """VGG11 conv stack without batch norm, then global average pooling to 512 features (``layout``: channels
    and "M" for a max pool, VGG11's by default)."""
    layers: list[nn.Module] = []
    c_in = in_channels
    for item in layout:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c_in, item, 3, padding=1), nn.ReLU(inplace=True)]
            c_in = item
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers)


class CCTFeatures(nn.Module):
    """CCT-7/3x1: one 3x3 conv tokenizer + max pool, 7 pre-norm transformer layers (4 heads, MLP
    ratio 2), learnable positional embedding, and attention-based sequence pooling."""

    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 32,
        dim: int = 256,
        layers: int = 7,
        heads: int = 4,
        mlp_ratio: int = 2,
    ):
        super().__init__()
        self.tokenizer = nn.Sequential(
            nn.Conv2d(in_channels, dim, 3, padding=1, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        tokens = ((image_size + 1) // 2) ** 2
        self.pos = nn.Parameter(torch.zeros(1, tokens, dim))
        nn.init.trunc_normal_(self.pos, std=0.2)
        block = nn.TransformerEncoderLayer(
            dim, heads, dim * mlp_ratio, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.pool_logit = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.tokenizer(x).flatten(2).transpose(1, 2) + self.pos
        tokens = self.norm(self.encoder(tokens))
        weights = torch.softmax(self.pool_logit(tokens), dim=1)  # (B, T, 1)
        return (weights * tokens).sum(dim=1)


def resnet18_gn_features(in_channels: int = 3, groups: int = 2) -> nn.Sequential:
    """CIFAR-style ResNet18 (3x3 stem, no stem max pool) with GroupNorm instead of BatchNorm."""
    from torchvision.models import resnet18

    net = resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(groups, c))
    net.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    stages = [getattr(net, name) for name in ("conv1", "bn1", "relu", "layer1", "layer2", "layer3", "layer4")]
    return nn.Sequential(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten())


@dataclass(frozen=True)
class ModelInfo:
    """A backbone: ``features(in_channels, image_size)`` builds its feature extractor, which maps a batch
    (B, in_channels, image_size, image_size) to (B, ``feature_dim``) vectors; the classifier is added here."""

    feature_dim: int
    features: Callable[[int, int], nn.Module]


# every backbone ``model=`` accepts (``auto``: the dataset's default, config.resolved_model)
MODELS: dict[str, ModelInfo] = {
    "cnn": ModelInfo(128, lambda channels, size: mnist_cnn_features(channels, CNN_LAYERS["cnn"])),
    "cnn-small": ModelInfo(32, lambda channels, size: mnist_cnn_features(channels, CNN_LAYERS["cnn-small"])),
    "lenet": ModelInfo(64, lambda channels, size: lenet_features(channels, size, hidden=64)),
    "lenet-nonorm": ModelInfo(64, lambda channels, size: lenet_features(channels, size, hidden=64, norm=False)),
    "vgg11": ModelInfo(512, lambda channels, size: vgg11_features(channels)),
    "cct": ModelInfo(256, CCTFeatures),
    "resnet18": ModelInfo(512, lambda channels, size: resnet18_gn_features(channels)),
}


def build_model(name: str, num_classes: int, in_channels: int, image_size: int) -> SplitModel:
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'. Valid: {', '.join(MODELS)}")
    info = MODELS[name]
    features = info.features(in_channels, image_size)
    mixing = [n for n, m in features.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if mixing:  # DisTrans batches its two input channels together, and evaluation splits batches anywhere
        raise ConfigError(
            f"model '{name}' has BatchNorm ({', '.join(mixing)}), which mixes the samples of a batch: "
            "use GroupNorm or LayerNorm (docs/adding-a-model.md)"
        )
    return SplitModel(features, info.feature_dim, num_classes)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
