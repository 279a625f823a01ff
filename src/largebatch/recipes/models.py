"""The recipes' models: :func:`small_cnn` for the embedded Fashion-MNIST data set, and the
ImageNet models :func:`resnet50` and :func:`alexnet_bn` (torchvision's, imported when built).

The Fashion-MNIST recipes, ``largebatch study`` and the tests use :func:`small_cnn`, sized
so that the study's 161 ten-epoch runs fit in 1.5 hours on a 2-core CPU.
``largebatch.recipes.build.build_model`` builds any of them by its recipe name.
"""

from __future__ import annotations

from torch import nn

__all__ = ["alexnet_bn", "resnet50", "small_cnn"]


def _conv_block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    # No conv bias: batch norm's shift plays that role.
    return [
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    ]


def small_cnn(num_classes: int = 10, width: int = 8, in_channels: int = 1) -> nn.Sequential:
    """A 3-conv CNN with batch norm for 28x28 inputs (6,274 parameters at width 8).

    A stride-2 conv stem (28 -> 14), conv (14x14), max pool (14 -> 7), conv (7x7), global
    average pool, linear; every conv is followed by batch norm and ReLU. The stride-2
    stem keeps a 10-epoch run near one minute on one CPU core. Batch norm's params and
    the linear bias are what ``param_groups`` excludes from weight decay and adaptation.
    """
    if width < 1:
        raise ValueError(f"Invalid width: {width} (must be >= 1)")
    w = width
    return nn.Sequential(
        *_conv_block(in_channels, w, stride=2),
        *_conv_block(w, 2 * w),
        nn.MaxPool2d(2),
        *_conv_block(2 * w, 4 * w),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, num_classes),
    )


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
            features += [nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride,
                                   m.padding, bias=False), nn.BatchNorm2d(m.out_channels)]
        else:
            features.append(m)
    classifier: list[nn.Module] = []
    linears = [m for m in base.classifier if isinstance(m, nn.Linear)]
    for m in base.classifier:
        if isinstance(m, nn.Linear) and m is not linears[-1]:
            classifier += [nn.Linear(m.in_features, m.out_features, bias=False),
                           nn.BatchNorm1d(m.out_features)]
        else:
            classifier.append(m)
    return nn.Sequential(*features, base.avgpool, nn.Flatten(), *classifier)
