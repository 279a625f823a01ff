"""Models for the recipes: small ones for the embedded Fashion-MNIST data set.

The Fashion-MNIST recipes, ``largebatch study`` and the tests use :func:`small_cnn`, sized
so that the study's 161 ten-epoch runs fit in 1.5 hours on a 2-core CPU.
"""

from __future__ import annotations

from torch import nn

__all__ = ["small_cnn"]


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
