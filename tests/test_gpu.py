"""The fused path on a CUDA GPU, with the kernels compiled by Triton (no interpreter).

Run in the suite's CUDA mode: ``LARGEBATCH_CUDA_TESTS=1 pytest -m gpu tests`` (``make
gpu-check`` does); skipped elsewhere (tests/conftest.py). Every case is small: together
they take well under a minute once the kernels are compiled.

- the optimizers on every path against the float64 spec (tests/cases.py), at each path's
  GPU tolerance (``cases.tolerance``): the fused path in fp32, bf16, and fp16 / bf16 with
  fp32 masters, the others in fp32 and bf16 with masters (the compiled path in fp32);
- every path bitwise the same from run to run, with tensors of many chunks;
- a whole step captured in a CUDA graph (lr a device tensor, GradScaler's inputs) and
  replayed 100 steps, one of them overflowing, against the same steps run eagerly;
- a state dict saved mid-run and loaded into a fresh optimizer continues as the run does;
- FSDP2 (``fully_shard``, NCCL, one rank) on the fused path against an unsharded model.

tests/test_fused_syncs.py has the ``gpu`` cases of the no-host-sync checks.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("triton")

import numpy as np
from cases import (
    CASE_IDS,
    CASES,
    TORCH_PATHS,
    assert_matches,
    make_problem,
    run_reference,
    run_torch,
    tolerance,
)

from largebatch.torch import LAMB, LARS

pytestmark = pytest.mark.gpu

# (param dtype, fp32 masters, the tolerance the result is held to), as test_reference_paths.
PRECISIONS = {
    "fp32": (torch.float32, False, "float32"),
    "bf16": (torch.bfloat16, False, "bfloat16"),
    "bf16-masters": (torch.bfloat16, True, "float32"),
    "fp16-masters": (torch.float16, True, "float32"),
}


# The precisions each path runs in here; the compiled path, whose every case costs
# compiles, in four cases (the CPU suite runs it in all).
RUNS = {
    "fused": list(PRECISIONS),
    "single_tensor": ["fp32", "bf16-masters"],
    "foreach": ["fp32", "bf16-masters"],
    "compiled": ["fp32"],
}
COMPILED_CASES = ("lars-defaults", "lars-larc", "lamb-defaults", "lamb-max-grad-norm")
GPU_RUNS = [
    (case, path, precision)
    for case, name in zip(CASES, CASE_IDS)
    for path, ps in RUNS.items()
    for precision in ps
    if path != "compiled" or name in COMPILED_CASES
]


@pytest.mark.parametrize("case,path,precision", GPU_RUNS, ids=[f"{c.id}-{p}-{q}" for c, p, q in GPU_RUNS])
def test_every_path_matches_the_spec_on_cuda(case, path, precision):
    dtype, masters, name = PRECISIONS[precision]
    params, grads = make_problem(dtype)
    run = dict(dtype=dtype, masters=masters, device="cuda", **TORCH_PATHS[path])
    if path == "fused" and case.optimizer == "lamb" and 0.0 in (g["eps"] for g in case.groups()):
        with pytest.raises(ValueError, match="the fused LAMB kernels need eps > 0"):
            run_torch(case, params, grads, **run)
        return
    assert_matches(
        run_torch(case, params, grads, **run),
        run_reference(case, params, grads),
        name,
        start=params,
        rtol=tolerance(name, path, "cuda"),
    )


# Tensors of many chunks (the fused path's 4,096 elements), one off every block.
BIG = [(1000, 1000), (4099,), (64, 33), (3,)]


@pytest.mark.parametrize("path", TORCH_PATHS)
@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.id in ("lars-defaults", "lamb-max-grad-norm")],
    ids=["lars", "lamb-max-grad-norm"],
)
def test_every_path_is_bitwise_reproducible_on_cuda(case, path):
    """The same inputs give the same bits on every run: no sum is formed in an order the
    GPU's scheduling decides (the fused path's atomics were: docs/design.md §3)."""
    params, grads = make_problem(np.float32, shapes=BIG, seed=3)
    run = dict(dtype=torch.float32, device="cuda", split=2, **TORCH_PATHS[path])
    first, second = (run_torch(case, params, grads, **run) for _ in range(2))
    for name in ["params", *first.state]:
        a = first.params if name == "params" else first.state[name]
        b = second.params if name == "params" else second.state[name]
        assert all(np.array_equal(x, y) for x, y in zip(a, b)), name


SHAPES = [(64, 33), (33,), (7, 5, 3, 3), (1025,), (3,)]
REPLAYS, OVERFLOW = 100, 37  # steps, and the one whose found_inf is set
SCALE = 1024.0  # the loss scale the grads carry


def _setup(cls):
    """Params (the same every call), an lr tensor, the optimizer with GradScaler's inputs."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in SHAPES]
    lr = torch.tensor(0.1, device="cuda")
    extra = {} if cls is LARS else {"max_grad_norm": 1.0}
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    opt = cls(groups, lr=lr, weight_decay=1e-2, fused=True, **extra)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.grad_scale = torch.tensor(SCALE, device="cuda")  # what GradScaler.step sets
    opt.found_inf = torch.zeros(1, device="cuda")
    return params, lr, opt


def _inputs():
    """Each step's grads (scaled; one inf at the overflowing step) and lr."""
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(s, generator=gen).cuda() * SCALE for s in SHAPES] for _ in range(REPLAYS)]
    grads[OVERFLOW][1][5] = float("inf")
    return grads, [0.1 * (1 + k % 7) / 7 for k in range(REPLAYS)]


def _feed(params, lr, opt, grads, lrs, k):
    for p, g in zip(params, grads[k]):
        p.grad.copy_(g)
    lr.fill_(lrs[k])
    opt.found_inf.fill_(float(k == OVERFLOW))


def _tensors(params, opt):
    state = [t for p in params for t in opt.state[p].values()]
    return [p.detach().clone() for p in params] + [t.clone() for t in state]


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_a_captured_step_replays_like_eager(cls):
    grads, lrs = _inputs()
    eager, graphed = _setup(cls), _setup(cls)
    for _, _, opt in (eager, graphed):  # warm-up: state, plan, compiled kernels
        opt.found_inf.fill_(1.0)  # skipped: nothing changes
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                opt.step()
        torch.cuda.current_stream().wait_stream(side)

    params, lr, opt = eager
    for k in range(REPLAYS):
        _feed(params, lr, opt, grads, lrs, k)
        opt.step()

    params, lr, opt = graphed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(REPLAYS):
        _feed(params, lr, opt, grads, lrs, k)
        before = _tensors(params, opt) if k == OVERFLOW else None
        graph.replay()
        if before is not None:
            after = _tensors(params, opt)
            changed = [i for i, (a, b) in enumerate(zip(before, after)) if not torch.equal(a, b)]
            assert not changed, f"the overflow step changed tensors {changed}"
    torch.cuda.synchronize()

    assert eager[2].num_steps == graphed[2].num_steps == REPLAYS - 1
    for a, b in zip(_tensors(*eager[::2]), _tensors(*graphed[::2])):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        opt.step()


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_a_state_dict_resumes_on_cuda(cls):
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda().half()) for s in SHAPES]
    extra = {} if cls is LARS else {"max_grad_norm": 1.0}
    opt = cls(params, lr=0.1, weight_decay=1e-2, fused=True, master_weights=True, **extra)
    _train(opt, params, 3, seed=3)
    saved = io.BytesIO()
    torch.save({"params": params, "opt": opt.state_dict()}, saved)
    _train(opt, params, 2, seed=4)

    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    params2 = [torch.nn.Parameter(p.detach()) for p in loaded["params"]]
    opt2 = cls(params2, lr=0.1, weight_decay=1e-2, fused=True, master_weights=True, **extra)
    opt2.load_state_dict(loaded["opt"])
    _train(opt2, params2, 2, seed=4)
    assert opt2.num_steps == opt.num_steps == 5
    for a, b in zip(params, params2):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)  # fp16 params
        torch.testing.assert_close(opt2.state[b]["master_param"], opt.state[a]["master_param"])


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_fsdp2_on_the_fused_path(cls):
    """One NCCL rank: the params are DTensors, the norms go through the all-reduce hooks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    try:
        torch.manual_seed(5)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
        ).cuda()
        plain = copy.deepcopy(model)
        fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
        opts = [cls(m.parameters(), lr=0.1, weight_decay=1e-2, fused=True) for m in (model, plain)]
        x = torch.randn(8, 16, device="cuda")
        for _ in range(3):
            for m, opt in zip((model, plain), opts):
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        for a, b in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(a.full_tensor(), b.detach())
    finally:
        dist.destroy_process_group()
