"""FP16/BF16 with fp32 master weights, the torch.amp.GradScaler contract, skipped steps."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from cases import torch_paths

from largebatch.torch import LAMB, LARS, ScheduleLR, make_schedule, param_groups, to_half

PATHS = torch_paths("single_tensor", "foreach", "fused")
STATE_KEYS = {LARS: ("momentum_buffer",), LAMB: ("exp_avg", "exp_avg_sq")}


def _snapshot(params, opt):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def _assert_unchanged(params, opt, snapshot):
    before_params, before_state = snapshot
    for p, b in zip(params, before_params):
        assert torch.equal(p, b)
    after = opt.state_dict()["state"]
    assert after.keys() == before_state["state"].keys()
    for pid, entry in before_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(after[pid][key], value), (pid, key)


@pytest.mark.parametrize("path", PATHS)
def test_sub_ulp_updates_accumulate_in_the_masters(path):
    """An update of 1e-4 is below half an fp16 ulp at 1.0 (4.9e-4): fp16 alone loses it."""
    lost = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    kept = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    kw = dict(lr=1e-4, momentum=0.0, trust_ratio=False, **PATHS[path])
    plain, master = LARS([lost], **kw), LARS([kept], master_weights=True, **kw)
    for _ in range(100):
        lost.grad = torch.ones(4, dtype=torch.float16)
        kept.grad = torch.ones(4, dtype=torch.float16)
        plain.step()
        master.step()
    assert torch.all(lost == 1.0)
    np.testing.assert_allclose(master.state[kept]["master_param"].numpy(), 0.99, rtol=1e-5)
    assert torch.all(kept == torch.tensor(0.99, dtype=torch.float16))


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_norms_accumulate_in_fp32_without_masters(cls):
    """||w||^2 = 1024 * 300^2 overflows fp16 (max 65504); the ratio must still be right.

    (Grads stay away from zero: LAMB's second moment of a tiny fp16 grad underflows, which
    is what master_weights=True, with fp32 moments, is for.)"""
    w16 = torch.nn.Parameter(torch.full((1024,), 300.0, dtype=torch.float16))
    w32 = torch.nn.Parameter(w16.detach().float())
    g = torch.linspace(0.5, 1.0, 1024) * torch.tensor([1.0, -1.0]).repeat(512)
    opts = [cls([w], lr=0.5, weight_decay=1e-3) for w in (w16, w32)]
    w16.grad, w32.grad = g.half(), g.half().float()
    for opt in opts:
        opt.step()
    assert torch.isfinite(w16).all()
    torch.testing.assert_close(w16.float(), w32, rtol=2e-3, atol=0.0)
    assert not torch.equal(w16.float(), torch.full((1024,), 300.0))


# --------------------------------------------------------------------------- GradScaler


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model.to(dtype)


def _batches(n=4, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 8, generator=gen).to(dtype), torch.randint(0, 4, (32,), generator=gen))
        for _ in range(n)
    ]


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).float(), y)


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_grad_scaler_equals_unscaled_training(cls, path, unscale_first):
    """Power-of-two scales are exact: the scaled run equals the plain one bit for bit."""
    plain, scaled = _model(), _model()
    opt_plain = cls(param_groups(plain, 1e-4), lr=0.1, **PATHS[path])
    opt_scaled = cls(param_groups(scaled, 1e-4), lr=0.1, **PATHS[path])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for x, y in _batches():
        opt_plain.zero_grad()
        _loss(plain, x, y).backward()
        opt_plain.step()
        opt_scaled.zero_grad()
        scaler.scale(_loss(scaled, x, y)).backward()
        if unscale_first:
            scaler.unscale_(opt_scaled)
        scaler.step(opt_scaled)
        scaler.update()
    for a, b in zip(plain.parameters(), scaled.parameters()):
        assert torch.equal(a, b)
    assert opt_scaled.num_steps == 4


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_overflow_step_changes_nothing_but_the_scale(cls, path, bad):
    """fp16 params with masters; a real fp16 overflow (or a NaN) in one gradient."""
    model = _model(torch.float16)
    params = list(model.parameters())
    opt = cls(param_groups(model, 1e-4), lr=0.1, master_weights=True, **PATHS[path])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    batches = _batches(dtype=torch.float16)
    x, y = batches[0]
    scaler.scale(_loss(model, x, y)).backward()
    scaler.step(opt)  # fp16 grads: the scaler hands them to us without complaint
    scaler.update()
    snapshot = _snapshot(params, opt)
    opt.zero_grad()
    x, y = batches[1]
    if bad == float("inf"):
        scaler.update(new_scale=2.0**40)  # the scaled fp16 grads overflow past 65504
    scaler.scale(_loss(model, x, y)).backward()
    if bad != float("inf"):
        params[0].grad[0, 0] = bad
    assert not all(torch.isfinite(p.grad).all() for p in params)
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    _assert_unchanged(params, opt, snapshot)
    assert opt.num_steps == 1


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_scaler_near_float32_max_stays_exact(cls):
    """A scale of 2**127 (growth would overflow float32: pytorch#98828) still unscales exactly."""
    plain, scaled = _model(), _model()
    opt_plain, opt_scaled = cls(plain.parameters(), lr=0.05), cls(scaled.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=1)
    for x, y in _batches(3):
        for model, opt in ((plain, opt_plain), (scaled, opt_scaled)):
            opt.zero_grad()
            loss = _loss(model, x, y)
            if opt is opt_scaled:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        assert np.isfinite(scaler.get_scale())
    assert opt_scaled.num_steps == opt_plain.num_steps
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_schedule_follows_the_optimizer_over_skipped_steps():
    model = _model()
    opt = LARS(model.parameters(), lr=1.0)
    fn = make_schedule("poly", peak_lr=1.0, total_steps=10, warmup_steps=4)
    follow = ScheduleLR(opt, fn, follow_optimizer=True)
    for i, (x, y) in enumerate(_batches(4)):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.found_inf = torch.ones(()) if i == 1 else torch.zeros(())
        opt.step()
        del opt.found_inf
        follow.step()
    assert opt.num_steps == 3
    assert opt.param_groups[0]["lr"] == fn(3)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_resume_with_masters_is_exact(cls, path):
    def train(model, opt, scaler, batches):
        for x, y in batches:
            opt.zero_grad()
            scaler.scale(_loss(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()

    batches = _batches(6, torch.float16)
    build = lambda m: cls(param_groups(m, 1e-4), lr=0.1, master_weights=True, **PATHS[path])  # noqa: E731
    straight = _model(torch.float16)
    opt, scaler = build(straight), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    train(straight, opt, scaler, batches)

    model = _model(torch.float16)
    opt, scaler = build(model), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    train(model, opt, scaler, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer)
    resumed = _model(torch.float16, seed=5)
    resumed.load_state_dict(ckpt["model"])
    opt, scaler = build(resumed), torch.amp.GradScaler("cpu")
    opt.load_state_dict(ckpt["opt"])
    scaler.load_state_dict(ckpt["scaler"])
    master = opt.state[next(resumed.parameters())]["master_param"]
    assert master.dtype == torch.float32  # not cast down to the param's fp16
    train(resumed, opt, scaler, batches[3:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- to_half


def test_to_half_keeps_normalization_in_fp32_and_trains():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.LayerNorm(8 * 6 * 6),
        torch.nn.Linear(8 * 6 * 6, 3),
    )
    to_half(model, torch.float16)
    assert model[0].weight.dtype == torch.float16 and model[5].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    assert model[4].weight.dtype == torch.float32
    x = torch.randn(48, 1, 8, 8).half()
    y = (x.float().mean(dim=(1, 2, 3)) > 0).long() + (x.float()[:, 0, 0, 0] > 1).long()
    opt = LARS(param_groups(model, 1e-4), lr=2.0, master_weights=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        out = model(x)
        assert out.dtype == torch.float16
        loss = _loss(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_to_half_rejects_other_dtypes():
    with pytest.raises(ValueError, match="torch.float32"):
        to_half(torch.nn.Linear(2, 2), torch.float32)
