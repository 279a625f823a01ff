"""A fused step whose params, grads and state have not moved runs on the last step's plan;
one whose grads alone are new tensors reuses the last step's groups.

One schedule of events runs twice: with the optimizer's memory of its last step, and
with it turned off (every step in full). The two must agree bit for bit, each step must
have reused exactly what did not move, and a replayed step must do the same host work
whatever the number of tensors.
"""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch

pytest.importorskip("triton")

from devices import FUSED_DEVICES, HostSyncs

from largebatch.lars.kernels import plan as kplan
from largebatch.lars.torch._fused import FULL, NEW_GRADS, REPLAY
from largebatch.torch import LAMB, LARS

SHAPES = [(33, 7), (5,), (1025,), (4, 3, 3, 2), (17,)]


def _grad(shape: tuple[int, ...], k: int, i: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * k + i)
    return torch.randn(shape, generator=gen).to(device)


class _Run:
    """One optimizer over SHAPES in two groups, with GradScaler's inputs, its grads
    written in place at every step; records what each step reused."""

    def __init__(self, cls, dtype: torch.dtype, device: str, replay: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.device = device
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SHAPES]
        extra = {} if cls is LARS else {"max_grad_norm": 1.0}
        groups = [
            {"params": self.params[:2]},
            {"params": self.params[2:4], "weight_decay": 0.0, "lr": torch.tensor(0.05, device=device)},
        ]
        self.opt = cls(
            groups, lr=0.1, weight_decay=1e-2, fused=True, master_weights=dtype != torch.float32, **extra
        )
        self.opt.grad_scale = torch.tensor(4.0, device=device)  # what torch.amp.GradScaler sets
        self.opt.found_inf = torch.zeros(1, device=device)
        self.reused: list[str] = []
        self.syncs: list[list] = []
        memo = self.opt._replay
        if not replay:
            memo.check = lambda *args: FULL
        self._check = memo.check

    def step(self, k: int) -> None:
        for i, p in enumerate(self.params):
            if p.grad is not None:
                p.grad.copy_(_grad(p.shape, k, i, self.device).to(p.dtype))
        seen: list[str] = []

        def check(*args):
            seen.append(self._check(*args))
            return seen[-1]

        self.opt._replay.check = check
        with HostSyncs() as record:
            self.opt.step()
        assert len(seen) == 1
        self.reused.append(seen[0])
        self.syncs.append(record.record)

    def snapshot(self) -> list[torch.Tensor]:
        state = [t for p in self.params for t in self.opt.state[p].values()]
        return [p.detach().clone() for p in self.params] + [t.clone() for t in state]


def _event(run: _Run, k: int) -> None:
    """What happens before step ``k``: each an everyday habit or a move the replay must see."""
    p, opt = run.params, run.opt
    if k == 0:
        for i, q in enumerate(p[:4]):
            q.grad = _grad(q.shape, 0, i, run.device).to(q.dtype)
    elif k == 3:  # a schedule writes both lrs: a float, and a new lr tensor
        opt.param_groups[0]["lr"] = 0.07
        opt.param_groups[1]["lr"] = torch.tensor(0.02, device=run.device)
    elif k == 4:  # a changed hyperparameter: new tables
        opt.param_groups[0]["weight_decay"] = 3e-2
    elif k == 5:  # a grad replaced by another tensor
        p[0].grad = torch.zeros_like(p[0])
    elif k == 6:  # a param's storage moved
        p[1].data = p[1].data.clone()
    elif k == 7:  # a param without a grad this step
        p[2].grad = None
    elif k == 9:  # ... and with one again
        p[2].grad = torch.zeros_like(p[2])
    elif k == 10:  # zero_grad's default: every grad a new tensor
        opt.zero_grad()
        for q in p[:4]:
            q.grad = torch.zeros_like(q)
    elif k == 11:  # GradScaler found an inf: skipped on the device
        opt.found_inf.fill_(1.0)
    elif k == 12:
        opt.found_inf.fill_(0.0)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif k == 13:
        p[4].grad = torch.zeros_like(p[4])
        opt.add_param_group({"params": [p[4]]})


R, G, F = REPLAY, NEW_GRADS, FULL
# Step:  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
REUSED = [F, R, R, R, F, G, G, F, R, F, G, G, F, F, R]


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16-masters"])
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_replay_is_the_full_step_and_sees_every_move(cls, dtype, device):
    runs = [_Run(cls, dtype, device, replay) for replay in (True, False)]
    for k in range(len(REUSED)):
        for run in runs:
            _event(run, k)
            run.step(k)
    reusing, full = runs
    assert reusing.reused == REUSED
    assert full.reused == [FULL] * len(REUSED)
    for a, b in zip(reusing.snapshot(), full.snapshot(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert reusing.opt.num_steps == full.opt.num_steps == len(REUSED) - 1  # step 11 skipped
    assert reusing.syncs[1:] == [[]] * (len(REUSED) - 1)


def test_a_moved_param_is_updated_where_it_now_lives():
    """After ``p.data = ...`` the step writes the new storage, not the old one."""
    p = torch.nn.Parameter(torch.ones(40))
    p.grad = torch.ones(40)
    opt = LARS([p], lr=0.1, fused=True)
    opt.step()
    old = p.data
    p.data = old.clone()
    before = old.clone()
    opt.step()
    assert torch.equal(old, before)  # the old storage is no longer the param's
    assert not torch.equal(p.detach(), before)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _calls_of_a_step(cls, habit: str, n_tensors: int, monkeypatch) -> tuple[int, int]:
    """(Python calls, C calls) the profiler sees in one step, kernels launching nothing,
    after warm-up steps: with grads written in place ("static") or new grad tensors at
    every step, two sets in turn, whose plans are both cached ("moved")."""
    for name in [n for n in dir(kplan) if n.endswith("_kernel")]:
        monkeypatch.setattr(kplan, name, _NoLaunch())
    params = [torch.nn.Parameter(torch.zeros(3 + i % 5)) for i in range(n_tensors)]
    sets = [[torch.zeros_like(p) for p in params] for _ in range(2 if habit == "moved" else 1)]
    opt = cls([{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}], lr=0.1, fused=True)
    counts = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in counts:
            counts[event] += 1

    for k in range(5):
        for p, g in zip(params, sets[k % len(sets)]):
            p.grad = g
        if k == 4:
            # The garbage collector runs when it likes, and may call other objects'
            # finalizers inside the step: none of the step's work, so not counted.
            gc.collect()
            gc.disable()
            sys.setprofile(profile)
        try:
            opt.step()
        finally:
            sys.setprofile(None)
            gc.enable()
    return counts["call"], counts["c_call"]


@pytest.mark.parametrize("habit", ["static", "moved"])
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_a_step_on_known_tensors_does_the_same_host_work_for_any_tensor_count(cls, habit, monkeypatch):
    """No Python loop over the tensors when nothing but the grads moved: the checks and the
    plan's lookup are C-level passes, the rest is per group and per bucket."""
    few, many = (_calls_of_a_step(cls, habit, n, monkeypatch) for n in (8, 64))
    assert few == many


def test_a_deep_copy_steps_on_its_own_tensors():
    params = [torch.nn.Parameter(torch.randn(10)) for _ in range(3)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = LAMB(params, lr=0.1, fused=True)
    opt.step()
    opt.step()  # replayed: the memo holds a plan on these tensors
    twin_params, twin = copy.deepcopy((params, opt))
    for p in twin_params:  # a Parameter's deep copy has no grad
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    twin.step()
    twin.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert not any(torch.equal(p, b) for p, b in zip(twin_params, before))


@pytest.mark.parametrize("habit", ["static", "moved"])
def test_the_memory_of_a_step_keeps_no_grad_alive(habit):
    """``zero_grad()`` frees the grads before the next backward: the optimizer's memory of
    its last step must not hold them (a model's worth of memory)."""
    import gc
    import weakref

    params = [torch.nn.Parameter(torch.randn(30)) for _ in range(3)]
    opt = LAMB(params, lr=0.1, fused=True)
    refs = []
    for k in range(3):
        if habit == "moved" or k == 0:
            for p in params:
                p.grad = torch.ones_like(p)
        refs += [weakref.ref(p.grad) for p in params]
        opt.step()
    opt.zero_grad()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
