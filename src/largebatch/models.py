"""The recipes' models: :func:`small_cnn`, :func:`fmnist_cnn` (the Fashion-MNIST recipes' and
the study's, chosen by measurement, docs/study.md), :func:`fmnist_alexnet_bn` and
:func:`small_resnet` for Fashion-MNIST, and the ImageNet models :func:`resnet50` and
:func:`alexnet_bn` (torchvision's, imported when built). ``recipes.build`` builds them by name.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from largebatch import checks

__all__ = [
    "BasicBlock",
    "alexnet_bn",
    "fmnist_alexnet_bn",
    "fmnist_cnn",
    "resnet50",
    "small_cnn",
    "small_resnet",
]


def _conv_block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    # No conv bias: batch norm's shift plays that role.
    return [
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    ]


def small_cnn(num_classes: int = 10, width: int = 8, in_channels: int = 1, hidden: int = 0) -> nn.Sequential:
    """A 3-conv CNN with batch norm for 28x28 inputs.

    A stride-2 conv stem (28 -> 14), conv (14x14), max pool (14 -> 7), conv (7x7); every
    conv is followed by batch norm and ReLU. The head is global average pooling and a
    linear layer (``hidden=0``: 6,274 parameters at width 8), or, with ``hidden > 0``, the
    flattened 7x7 features, a hidden linear layer with batch norm and ReLU, and a linear
    layer (208,194 parameters at width 8, ``hidden=128``). The stride-2 stem keeps an epoch
    near 8 seconds on one CPU core. Batch norm's params and the output bias are what
    ``param_groups`` excludes from weight decay and adaptation.
    """
    checks.integer("width", width, 1)
    checks.integer("hidden", hidden, 0)
    w = width
    if hidden:
        head = [
            nn.Flatten(),
            nn.Linear(4 * w * 7 * 7, hidden, bias=False),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        ]
    else:
        head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes)]
    return nn.Sequential(
        *_conv_block(in_channels, w, stride=2),
        *_conv_block(w, 2 * w),
        nn.MaxPool2d(2),
        *_conv_block(2 * w, 4 * w),
        *head,
    )


def fmnist_cnn(num_classes: int = 10) -> nn.Sequential:
    """The Fashion-MNIST recipes' model: :func:`small_cnn` at width 8 with a 128-unit hidden
    layer (208,194 parameters)."""
    return small_cnn(num_classes, width=8, hidden=128)


def fmnist_alexnet_bn(
    num_classes: int = 10, width: int = 8, hidden: int = 256, in_channels: int = 1
) -> nn.Sequential:
    """AlexNet-BN (You, Gitman, Ginsburg 2017: AlexNet with batch norm after every conv)
    scaled to 28x28: five 3x3 convs, batch norm and ReLU after each, no residuals, and a
    wide fully connected head, as in :func:`alexnet_bn`.

    Convs at ``width`` x (1, 3, 6, 4, 4) channels, AlexNet's 64-192-384-256-256 in
    proportion: a stride-2 stem (28 -> 14; AlexNet's stride-4 11x11 stem and pool), a
    conv and max pool (14 -> 7), three convs and max pool (7 -> 3), then two ``hidden``-unit
    linear layers with batch norm and ReLU, and a linear layer (178,354 parameters at width
    8, ``hidden=256``: four fifths of them in the head, as AlexNet's). No dropout (batch
    norm takes its place in AlexNet-BN)."""
    checks.integer("width", width, 1)
    checks.integer("hidden", hidden, 1)
    w = width
    return nn.Sequential(
        *_conv_block(in_channels, w, stride=2),
        *_conv_block(w, 3 * w),
        nn.MaxPool2d(2),
        *_conv_block(3 * w, 6 * w),
        *_conv_block(6 * w, 4 * w),
        *_conv_block(4 * w, 4 * w),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * w * 3 * 3, hidden, bias=False),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden, bias=False),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


class BasicBlock(nn.Module):
    """He et al.'s basic residual block; the last batch norm's scale starts at zero, so the
    block starts as its shortcut (Goyal et al. 2017, section 5.1)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        nn.init.zeros_(self.bn2.weight)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def small_resnet(
    num_classes: int = 10, width: int = 16, blocks: int = 1, in_channels: int = 1
) -> nn.Sequential:
    """A ResNet for 28x28 inputs: a stride-2 3x3 conv stem (28 -> 14), three stages of
    ``blocks`` basic blocks at ``width``, ``2 width`` and ``4 width`` channels (14x14,
    7x7, 4x4), global average pooling and a linear layer (77,754 parameters at width 16,
    one block per stage: 8 weight layers). Zero-init last BN scale in every block."""
    checks.integer("width", width, 1)
    checks.integer("blocks", blocks, 1)
    layers: list[nn.Module] = _conv_block(in_channels, width, stride=2)
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        for b in range(blocks):
            layers.append(BasicBlock(cin, cout, 2 if stage and not b else 1))
            cin = cout
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers, *head)


def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50 with the last batch-norm scale of each residual block
    initialised to zero (Goyal et al. 2017)."""
    from torchvision.models import resnet50 as torchvision_resnet50

    return torchvision_resnet50(num_classes=num_classes, zero_init_residual=True)


def alexnet_bn(num_classes: int = 1000) -> nn.Sequential:
    """torchvision's AlexNet layout with batch norm after every conv and hidden linear layer
    (conv and linear biases dropped where BN follows), as in You, Gitman, Ginsburg 2017."""
    from torchvision.models import alexnet

    base = alexnet(num_classes=num_classes)
    features: list[nn.Module] = []
    for m in base.features:
        if isinstance(m, nn.Conv2d):
            # A Conv2d holds kernel_size, stride and padding as pairs (padding: or a mode name).
            size = cast("tuple[int, int]", m.kernel_size)
            stride = cast("tuple[int, int]", m.stride)
            padding = cast("str | tuple[int, int]", m.padding)
            features += [
                nn.Conv2d(m.in_channels, m.out_channels, size, stride, padding, bias=False),
                nn.BatchNorm2d(m.out_channels),
            ]
        else:
            features.append(m)
    classifier: list[nn.Module] = []
    linears = [m for m in base.classifier if isinstance(m, nn.Linear)]
    for m in base.classifier:
        if isinstance(m, nn.Linear) and m is not linears[-1]:
            classifier += [
                nn.Linear(m.in_features, m.out_features, bias=False),
                nn.BatchNorm1d(m.out_features),
            ]
        else:
            classifier.append(m)
    return nn.Sequential(*features, base.avgpool, nn.Flatten(), *classifier)
