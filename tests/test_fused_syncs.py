"""The fused step never makes the host wait for the device, even when it builds a plan.

Grads freed by ``zero_grad(set_to_none=True)`` may come back at new addresses on any step,
and each new address builds a new launch plan: that build must upload its tables without
blocking, and no step may read a device value on the host (a step with no grads at all
included). :class:`devices.HostSyncs` records every operation of largebatch's code that
would sync on CUDA; on a GPU (``gpu`` cases) torch's sync debug mode checks the same.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from devices import FUSED_DEVICES, HostSyncs

from largebatch.lars.kernels import FusedGroup, fused_lamb_step_, fused_lars_step_
from largebatch.lars.kernels import plan as kplan
from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC
from largebatch.torch import LAMB, LARS

SHAPES = [(33, 7), (5,), (1025,), (4, 3, 3, 2)]
STEPS = 4


def _no_syncs_on_cuda(device: str, step: int) -> contextlib.AbstractContextManager:
    """On CUDA after the first step (which compiles the kernels), torch raises at any
    synchronizing call; elsewhere nothing."""
    if device != "cuda" or step == 0:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def mode():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return mode()


def _group(kind: str, device: str, dtype: torch.dtype, masters: bool) -> FusedGroup:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(device, dtype) for s in SHAPES]
    math = torch.float32 if masters else dtype
    names = ("momentum_buffer",) if kind == "lars" else ("exp_avg", "exp_avg_sq")
    return FusedGroup(
        params=params,
        grads=[torch.zeros_like(p) for p in params],
        masters=[p.float() for p in params] if masters else None,
        state={k: [torch.zeros_like(p, dtype=math) for p in params] for k in names},
        steps=[torch.zeros((), device=device) for _ in params],
        lr=torch.tensor(0.1, device=device),
        hyper=(LARS_SPEC if kind == "lars" else LAMB_SPEC).make({}),
    )


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_kernels_build_plans_without_syncs(kind, device):
    """New grad tensors at every step (each a new plan), GradScaler's scale and found_inf,
    LAMB's global clipping: nothing syncs, plan builds included."""
    groups = [_group(kind, device, torch.float16, True), _group(kind, device, torch.float32, False)]
    step = fused_lars_step_ if kind == "lars" else fused_lamb_step_
    extra = {} if kind == "lars" else {"max_grad_norm": 1.0}
    scale, found_inf = torch.tensor(8.0, device=device), torch.zeros(1, device=device)
    counter = torch.zeros((), device=device)
    kept, plans, syncs = [], [], []
    for k in range(STEPS):
        for g in groups:  # the old grads stay alive: the new ones cannot take their place
            kept.append(g.grads)
            g.grads = [torch.full_like(p, 0.5 + k) for p in g.params]
        found_inf.fill_(float(k == 2))  # one overflowing step
        with HostSyncs() as record, _no_syncs_on_cuda(device, k):
            step(groups, grad_scale=scale, found_inf=found_inf, counter=counter, **extra)
        syncs.append(record.record)
        plans.append(next(reversed(kplan._PLANS.values())))
    assert len({id(p) for p in plans}) == STEPS, "each step should have built a plan"
    assert syncs[1:] == [[]] * (STEPS - 1), syncs
    assert float(counter) == STEPS - 1
    assert [float(s) for s in groups[0].steps] == [STEPS - 1] * len(SHAPES)


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_optimizer_steps_without_syncs(cls, device):
    """The optimizers with ``zero_grad(set_to_none=True)``, grads at new addresses every
    step, GradScaler's inputs, an overflowing step and a step without any grads."""
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.LayerNorm(17), torch.nn.Linear(17, 3))
    model.to(device)
    extra = {} if cls is LARS else {"max_grad_norm": 1.0}
    opt = cls(model.parameters(), lr=0.1, weight_decay=1e-2, fused=True, **extra)
    opt.grad_scale = torch.tensor(4.0, device=device)  # what torch.amp.GradScaler.step sets
    opt.found_inf = torch.zeros(1, device=device)
    kept, syncs = [], []
    x = torch.randn(8, 9, device=device)
    for k in range(STEPS + 1):
        opt.zero_grad(set_to_none=True)
        if k != 3:  # step 3: no param has a grad
            (model(x).square().sum() * 4.0).backward()
            kept.append([p.grad for p in model.parameters()])
        opt.found_inf.fill_(float(k == 2))
        with HostSyncs() as record, _no_syncs_on_cuda(device, k):
            opt.step()
        syncs.append(record.record)
    assert syncs[1:] == [[]] * STEPS, syncs
    assert opt.num_steps == STEPS  # step 2 was skipped; step 3 (no grads) counts
