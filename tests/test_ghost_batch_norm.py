"""Ghost batch norm (``largebatch.models``): one batch_norm call over the chunks equals a
plain batch norm run on each chunk, in outputs, gradients and running statistics."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from largebatch.models import GhostBatchNorm1d, GhostBatchNorm2d, ghost_batch_norm
from largebatch.recipes.build import build_model

G = 3  # samples a chunk
C = 5  # channels


def _plain(dims: int, momentum: float | None) -> nn.Module:
    """A batch norm with non-trivial params and running buffers."""
    bn = (nn.BatchNorm1d if dims < 4 else nn.BatchNorm2d)(C, momentum=momentum)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=gen))
        bn.running_mean.copy_(torch.randn(C, generator=gen))
        bn.running_var.copy_(torch.rand(C, generator=gen) + 0.5)
        bn.num_batches_tracked.fill_(3)
    return bn


def _input(dims: int, k: int, channels_last: bool) -> torch.Tensor:
    shape = {2: (k * G, C), 3: (k * G, C, 4), 4: (k * G, C, 4, 3)}[dims]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 2 + 1
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _reference(bn: nn.Module, x: torch.Tensor, k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each chunk through its own copy of ``bn`` on the shared weights (the running
    buffers of each copy start from ``bn``'s), and the copies' buffers averaged."""
    outs, buffers = [], []
    for chunk in x.chunk(k):
        copied = copy.deepcopy(bn)
        copied.weight, copied.bias = bn.weight, bn.bias  # one set of params: gradients sum
        outs.append(copied(chunk))
        buffers.append((copied.running_mean, copied.running_var))
    means = torch.stack([m for m, _ in buffers]).mean(0)
    variances = torch.stack([v for _, v in buffers]).mean(0)
    tracked = bn.num_batches_tracked + 1
    return torch.cat(outs), {"running_mean": means, "running_var": variances, "num_batches_tracked": tracked}


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize(("dims", "channels_last"), [(2, False), (3, False), (4, False), (4, True)])
def test_ghost_batch_norm_equals_a_batch_norm_per_chunk(dims, channels_last, momentum, k):
    plain = _plain(dims, momentum)
    ghost = ghost_batch_norm(copy.deepcopy(plain), G)
    assert isinstance(ghost, GhostBatchNorm1d if dims < 4 else GhostBatchNorm2d)
    x = _input(dims, k, channels_last)
    x_ref, x_ghost = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, buffers = _reference(plain, x_ref, k)
    got = ghost(x_ghost)
    torch.testing.assert_close(got, expected)
    if channels_last:
        assert got.is_contiguous(memory_format=torch.channels_last) and not got.is_contiguous()
    else:
        assert got.is_contiguous()
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(x_ghost.grad, x_ref.grad)
    torch.testing.assert_close(ghost.weight.grad, plain.weight.grad)
    torch.testing.assert_close(ghost.bias.grad, plain.bias.grad)
    for name, value in buffers.items():
        torch.testing.assert_close(getattr(ghost, name), value, msg=name)


def test_eval_mode_and_a_small_batch_are_plain_batch_norm():
    plain = _plain(4, 0.1)
    ghost = ghost_batch_norm(copy.deepcopy(plain), G)
    x = _input(4, 4, False)
    torch.testing.assert_close(ghost.eval()(x), plain.eval()(x))
    plain.train(), ghost.train()
    small = x[:2]
    torch.testing.assert_close(ghost(small), plain(small))
    torch.testing.assert_close(ghost.running_mean, plain.running_mean)


def test_without_running_stats():
    plain = nn.BatchNorm2d(C, track_running_stats=False)
    ghost = ghost_batch_norm(copy.deepcopy(plain), G)
    x = _input(4, 2, True)
    torch.testing.assert_close(ghost(x), torch.cat([plain(chunk) for chunk in x.chunk(2)]))
    assert ghost.running_mean is None and ghost.num_batches_tracked is None


def test_a_batch_not_a_multiple_of_the_ghost_batch_is_refused():
    ghost = GhostBatchNorm2d(C, ghost_batch=4)
    with pytest.raises(ValueError, match=re.escape("batch 10 is not a multiple of ghost_batch 4")):
        ghost(torch.randn(10, C, 2, 2))
    with pytest.raises(ValueError, match=re.escape("Invalid ghost_batch: 0 (must be an integer >= 1)")):
        ghost_batch_norm(nn.Sequential(nn.BatchNorm1d(C)), 0)


def test_state_dicts_load_either_way_and_the_params_stay_the_same_tensors():
    plain = build_model("small_resnet", 10)
    params = dict(plain.named_parameters())
    state = copy.deepcopy(plain.state_dict())
    ghost = ghost_batch_norm(plain, 8)
    assert ghost is plain
    assert all(p is params[name] for name, p in ghost.named_parameters())
    assert list(ghost.state_dict()) == list(state)
    assert all(torch.equal(ghost.state_dict()[name], value) for name, value in state.items())
    fresh = build_model("small_resnet", 10)
    fresh.load_state_dict(ghost.state_dict())  # ghost -> plain
    ghost.load_state_dict(fresh.state_dict())  # plain -> ghost


@pytest.mark.parametrize("name", ["fmnist_cnn", "fmnist_alexnet_bn", "small_resnet"])
def test_build_model_with_a_ghost_batch(name):
    torch.manual_seed(0)
    plain = build_model(name, 10)
    torch.manual_seed(0)
    model = build_model(name, 10, ghost_batch=4)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, (GhostBatchNorm1d, GhostBatchNorm2d)) for m in norms)
    assert all(m.ghost_batch == 4 for m in norms)
    x = torch.randn(8, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    model.to(memory_format=torch.channels_last), plain.to(memory_format=torch.channels_last)
    # Eval: the same model; training on 8 images: two chunks, not one batch.
    torch.testing.assert_close(model.eval()(x), plain.eval()(x))
    assert not torch.allclose(model.train()(x), plain.train()(x))
    ghost_batch_norm(model, 8)
    torch.testing.assert_close(model(x), plain(x))


# ``largebatch train --ghost-batch``: 256 images, batch 128, 2 steps.
SHORT = ["train", "--recipe", "fmnist-sgd-128", "--subset", "256", "--epochs", "1"]


def _trained(out, *flags: str) -> dict[str, torch.Tensor]:
    from largebatch.cli import main as cli

    assert cli([*SHORT, *flags, "--out", str(out)]) == 0
    return torch.load(out / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_train_ghost_batch_flag(tmp_path, capsys):
    plain = _trained(tmp_path / "plain")
    ghost = _trained(tmp_path / "ghost", "--ghost-batch", "32")
    whole = _trained(tmp_path / "whole", "--ghost-batch", "128")  # one chunk: plain batch norm
    assert list(ghost) == list(plain)  # a plain model loads the checkpoint
    assert any(not torch.equal(plain[k], ghost[k]) for k in plain)
    assert all(torch.equal(plain[k], whole[k]) for k in plain)
    settings = torch.load(tmp_path / "ghost" / "checkpoint.pt", weights_only=False)["settings"]
    assert settings["ghost_batch"] == 32


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ghost-batch", "0"], "invalid --ghost-batch 0 (must be >= 1)"),
        (["--ghost-batch", "48"], "--ghost-batch 48 must divide the per-process micro-batch 128"),
        (
            ["--micro-batch", "64", "--ghost-batch", "128"],
            "--ghost-batch 128 must divide the per-process micro-batch 64",
        ),
    ],
)
def test_train_refuses_a_ghost_batch_that_does_not_divide_the_micro_batch(tmp_path, capsys, flags, message):
    from helpers import user_error

    assert message in user_error([*SHORT, *flags, "--out", str(tmp_path)], capsys)
