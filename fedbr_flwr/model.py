"""Backbones with an explicit split: feature extractor phi (``features``) and linear classifier
omega (``classifier``). FedBR's projection head and DisTrans' double input wrap these two parts."""

from __future__ import annotations

import torch
from torch import nn


class SplitModel(nn.Module):
    """``classifier(features(x))`` with ``features`` returning flat (B, feature_dim) vectors."""

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.classifier = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def mnist_cnn_features(in_channels: int = 1) -> nn.Sequential:
    """4 conv layers 64, 128 (stride 2), 128, 128; each conv -> ReLU -> GroupNorm(8); avg pool."""
    layers: list[nn.Module] = []
    widths = [(in_channels, 64, 1), (64, 128, 2), (128, 128, 1), (128, 128, 1)]
    for c_in, c_out, stride in widths:
        layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.ReLU(), nn.GroupNorm(8, c_out)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers)


VGG11_LAYOUT = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def vgg11_features(in_channels: int = 3) -> nn.Sequential:
    """VGG11 conv stack without batch norm, then global average pooling to 512 features."""
    layers: list[nn.Module] = []
    c_in = in_channels
    for item in VGG11_LAYOUT:
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

    def __init__(self, in_channels: int = 3, image_size: int = 32, dim: int = 256, layers: int = 7,
                 heads: int = 4, mlp_ratio: int = 2):
        super().__init__()
        self.tokenizer = nn.Sequential(
            nn.Conv2d(in_channels, dim, 3, padding=1, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        tokens = ((image_size + 1) // 2) ** 2
        self.pos = nn.Parameter(torch.zeros(1, tokens, dim))
        nn.init.trunc_normal_(self.pos, std=0.2)
        block = nn.TransformerEncoderLayer(dim, heads, dim * mlp_ratio, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
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
    return nn.Sequential(net.conv1, net.bn1, net.relu, net.layer1, net.layer2, net.layer3, net.layer4,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


FEATURE_DIMS = {"cnn": 128, "vgg11": 512, "cct": 256, "resnet18": 512}


def build_model(name: str, num_classes: int, in_channels: int, image_size: int) -> SplitModel:
    if name == "cnn":
        features = mnist_cnn_features(in_channels)
    elif name == "vgg11":
        features = vgg11_features(in_channels)
    elif name == "cct":
        features = CCTFeatures(in_channels, image_size)
    elif name == "resnet18":
        features = resnet18_gn_features(in_channels)
    else:
        raise ValueError(f"unknown model '{name}'. Valid: {', '.join(FEATURE_DIMS)}")
    return SplitModel(features, FEATURE_DIMS[name], num_classes)


class ProjectionHead(nn.Module):
    """FedBR's projection head theta, used only in training: d -> hidden -> hidden -> out with ReLU
    between (SPEC: 128 -> 256 -> 256 -> 128 for the MNIST CNN)."""

    def __init__(self, feature_dim: int, hidden: int = 0, out: int = 0):
        super().__init__()
        hidden = hidden or 2 * feature_dim
        out = out or feature_dim
        self.net = nn.Sequential(nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, out))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class DoubleInputModel(nn.Module):
    """DisTrans' double-input-channel model (SPEC section 3): the SAME feature extractor on
    x1 = (1 - alpha) x + alpha t and x2 = (1 + alpha) x - alpha t, the two feature vectors
    concatenated, then one linear classifier over 2d features."""

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int, alpha: float):
        super().__init__()
        self.features = features
        self.feature_dim = 2 * feature_dim
        self.alpha = alpha
        self.classifier = nn.Linear(2 * feature_dim, num_classes)

    @classmethod
    def from_backbone(cls, backbone: SplitModel, alpha: float) -> "DoubleInputModel":
        """Reuses the backbone's feature extractor; the 2d -> C classifier is new (drawn from torch's RNG)."""
        return cls(backbone.features, backbone.feature_dim, backbone.classifier.out_features, alpha)

    def channels(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.alpha
        return (1 - a) * x + a * t, (1 + a) * x - a * t

    def double_features(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.channels(x, t)
        z1, z2 = self.features(torch.cat([x1, x2])).chunk(2)  # one pass; per-sample norms keep it exact
        return torch.cat([z1, z2], dim=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.double_features(x, t))


class Offset(nn.Module):
    """One client's DisTrans offset t, shaped like one input image; it broadcasts over a batch."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.t = nn.Parameter(torch.zeros(shape))


class WithOffset(nn.Module):
    """``model(x, t)`` as a one-input module, so that evaluation code need not know about offsets."""

    def __init__(self, model: DoubleInputModel, t: torch.Tensor):
        super().__init__()
        self.model = model
        self.t = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, self.t)


class OffsetGenerator(nn.Module):
    """DisTrans' server-side aggregation network h(e) -> offset: a small MLP on the class-share
    embedding e, then a generator of four conv layers (two transposed, stride 2) with a Tanh output,
    cropped to the input shape and mapped affinely from [-1, 1] onto [low, high] per channel."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int, width: int = 64,
                 low: torch.Tensor | None = None, high: torch.Tensor | None = None):
        super().__init__()
        self.base = -(-image_size // 4)  # ceil: two stride-2 upsamplings reach at least image_size
        self.width = width
        self.image_size = image_size
        self.mlp = nn.Sequential(nn.Linear(num_classes, 128), nn.ReLU(),
                                 nn.Linear(128, width * self.base * self.base), nn.ReLU())
        self.generator = nn.Sequential(
            nn.ConvTranspose2d(width, width // 2, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(width // 2, width // 4, 4, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width // 4, width // 4, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width // 4, in_channels, 3, padding=1), nn.Tanh(),
        )
        low = torch.full((in_channels, 1, 1), -1.0) if low is None else low.reshape(in_channels, 1, 1)
        high = torch.full((in_channels, 1, 1), 1.0) if high is None else high.reshape(in_channels, 1, 1)
        self.register_buffer("center", (high + low) / 2)
        self.register_buffer("half_range", (high - low) / 2)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        h = self.mlp(e).view(len(e), self.width, self.base, self.base)
        unit = self.generator(h)[..., :self.image_size, :self.image_size]
        return self.center + self.half_range * unit
