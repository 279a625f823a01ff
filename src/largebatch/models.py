"""The recipes' models: :func:`small_cnn`, :func:`fmnist_cnn` (the Fashion-MNIST recipes' and
the study's, chosen by measurement, docs/study.md), :func:`fmnist_alexnet_bn` and
:func:`small_resnet` for Fashion-MNIST, and the ImageNet models :func:`resnet50` and
:func:`alexnet_bn` (torchvision's, imported when built). ``recipes.build`` builds them by name.
:func:`ghost_batch_norm` turns any model's batch norms into ghost batch norms
(:class:`GhostBatchNorm1d`, :class:`GhostBatchNorm2d`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from largebatch import checks

__all__ = [
    "BasicBlock",
    "GhostBatchNorm1d",
    "GhostBatchNorm2d",
    "alexnet_bn",
    "fmnist_alexnet_bn",
    "fmnist_cnn",
    "ghost_batch_norm",
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


class _GhostBatchNorm(_BatchNorm):
    """Batch norm over chunks of ``ghost_batch`` samples: the forward of
    :class:`GhostBatchNorm1d` and :class:`GhostBatchNorm2d`."""

    ghost_batch: int

    def __init__(self, num_features: int, ghost_batch: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.ghost_batch = checks.integer("ghost_batch", ghost_batch, 1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ghost_batch={self.ghost_batch}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        n, g = input.shape[0], self.ghost_batch
        if not self.training or n <= g:
            return super().forward(input)
        self._check_input_dim(input)
        if n % g:
            raise ValueError(f"batch {n} is not a multiple of ghost_batch {g}")
        k, c = n // g, self.num_features
        # nn.BatchNorm's momentum rule: with momentum None, a cumulative average.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        # The k chunks side by side as k C channels of one batch of g: one batch_norm call
        # gives each chunk its own statistics, and updates k copies of the running buffers.
        running = None
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            running = (
                self.running_mean,
                self.running_var,
                self.running_mean.repeat(k),
                self.running_var.repeat(k),
            )
        last = _channels_last(input)
        out = F.batch_norm(
            _to_chunks(input, k, last),
            None if running is None else running[2],
            None if running is None else running[3],
            None if self.weight is None else self.weight.repeat(k),
            None if self.bias is None else self.bias.repeat(k),
            True,
            factor,
            self.eps,
        )
        if running is not None:
            # Each chunk's update of its own copy, the copies averaged: one update with the
            # chunks' mean statistics, as workers averaging their running buffers would get.
            running_mean, running_var, means, variances = running
            with torch.no_grad():
                running_mean.copy_(means.view(k, c).mean(0))
                running_var.copy_(variances.view(k, c).mean(0))
        return _from_chunks(out, k, last)


def _channels_last(x: torch.Tensor) -> bool:
    """Whether a 4-d ``x`` is laid out channels-last (and not also contiguous)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _to_chunks(x: torch.Tensor, k: int, last: bool) -> torch.Tensor:
    """``x`` (k g, C, ...) as (g, k C, ...): channel j C + c holds chunk j's channel c; a
    copy, channels-last when ``last``."""
    n, c, *rest = x.shape
    g = n // k
    if last:  # (N, H, W, C) in memory: chunks moved next to the channels
        h, w = rest
        y = x.permute(0, 2, 3, 1).reshape(k, g, h, w, c).permute(1, 2, 3, 0, 4).reshape(g, h, w, k * c)
        return y.permute(0, 3, 1, 2)
    return x.reshape(k, g, c, *rest).transpose(0, 1).reshape(g, k * c, *rest)


def _from_chunks(y: torch.Tensor, k: int, last: bool) -> torch.Tensor:
    """The inverse of :func:`_to_chunks`: (g, k C, ...) back to (k g, C, ...)."""
    g, kc, *rest = y.shape
    c = kc // k
    if last:
        h, w = rest
        x = y.permute(0, 2, 3, 1).reshape(g, h, w, k, c).permute(3, 0, 1, 2, 4).reshape(k * g, h, w, c)
        return x.permute(0, 3, 1, 2)
    return y.reshape(g, k, c, *rest).transpose(0, 1).reshape(k * g, c, *rest)


class GhostBatchNorm1d(_GhostBatchNorm, nn.BatchNorm1d):
    """:class:`torch.nn.BatchNorm1d` with ghost batches (Hoffer, Hubara, Soudry 2017,
    "Train longer, generalize better", section 4): in training, a batch of N >
    ``ghost_batch`` samples is normalized in N / ``ghost_batch`` chunks of consecutive
    samples, each with its own mean and biased variance, the affine scale and shift shared;
    N must be a multiple of ``ghost_batch`` (a ValueError names both). This is what each
    worker's batch norm computes in data-parallel training on ``ghost_batch`` samples a
    worker. The running statistics take one update with the mean over the chunks of
    their statistics (the unbiased variance, as torch's), which equals each chunk updating
    its own copy of the buffers and the copies averaged, as ``largebatch train`` averages
    its processes' buffers. ``num_batches_tracked`` counts forwards, ``momentum=None``
    is the cumulative average; a batch of at most ``ghost_batch`` samples and evaluation
    are plain batch norm. The parameters and buffers are batch norm's: state dicts load
    either way."""

    def __init__(
        self,
        num_features: int,
        ghost_batch: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, ghost_batch, eps, momentum, affine, track_running_stats, device, dtype)


class GhostBatchNorm2d(_GhostBatchNorm, nn.BatchNorm2d):
    """:class:`torch.nn.BatchNorm2d` with ghost batches, as :class:`GhostBatchNorm1d`; the
    output keeps the input's memory format (channels-last or contiguous)."""

    def __init__(
        self,
        num_features: int,
        ghost_batch: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, ghost_batch, eps, momentum, affine, track_running_stats, device, dtype)


_GHOSTS: dict[type[nn.Module], type[_GhostBatchNorm]] = {
    nn.BatchNorm1d: GhostBatchNorm1d,
    nn.BatchNorm2d: GhostBatchNorm2d,
}


def ghost_batch_norm(model: nn.Module, size: int) -> nn.Module:
    """``model`` with every :class:`torch.nn.BatchNorm1d` and :class:`torch.nn.BatchNorm2d`
    replaced, in place, by a :class:`GhostBatchNorm1d` or :class:`GhostBatchNorm2d` of
    ``ghost_batch=size`` holding the same parameter and buffer tensors (an optimizer built
    on the model still holds its parameters; the state dict's keys and values are
    unchanged, so checkpoints load either way). Ghost batch norms already there take the
    new size. Returns ``model``, or, when ``model`` is itself a batch norm, its ghost."""
    size = checks.integer("ghost_batch", size, 1)
    if isinstance(model, _GhostBatchNorm):
        model.ghost_batch = size
        return model
    ghost_class = _GHOSTS.get(type(model))
    if ghost_class is not None:
        bn = cast("_BatchNorm", model)
        ghost = ghost_class(bn.num_features, size, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        for name, param in bn.named_parameters(recurse=False):
            setattr(ghost, name, param)
        for name, buffer in bn.named_buffers(recurse=False):
            setattr(ghost, name, buffer)
        return ghost.train(bn.training)
    for name, child in model.named_children():
        new = ghost_batch_norm(child, size)
        if new is not child:
            setattr(model, name, new)
    return model
