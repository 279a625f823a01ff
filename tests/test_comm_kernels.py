"""AdaComp's Triton kernels (run by Triton's interpreter on the CPU): the same messages,
results and residuals as the torch operations, bit for bit where the scale's sum is exact
(gradients on a grid of 2**-6); against the reference where it is not; the edge cases;
and the DDP hook's launches and host reads per bucket, which do not grow with its layers.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from devices import FUSED_DEVICES, HostSyncs
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from largebatch.comm import reference as ref
from largebatch.comm.torch import AdaCompState, SimulatedWorkers, _kernels, adacomp_hook
from largebatch.comm.torch import _codec as codec
from largebatch.comm.torch import _fused as fused_mod
from largebatch.comm.torch import _hook as hook_mod

FORMS = ("allgather", "two_phase")
MODES = [("adacomp", "ternary"), ("adacomp", "exact"), ("all", "exact"), ("all", "ternary")]
# Layers smaller than a bin (6 and 34 elements), a single element, bins across programs
# with a short last one (1,728 elements: 35 bins of 50, a program holds 32), fc bins of 500
# with a short last one (3,300), a dense layer, and a layer whose gradients are all zero.
EDGES = [(3, 2, 1, 1), (7,), (2, 17), (64, 3, 3, 3), (1, 1, 1, 1), (33, 100), (5, 5, 3, 3), (4, 2, 3, 3)]
ZERO = len(EDGES) - 1


def _grads(n, steps, shapes, seed=0, dyadic=True, dtype=torch.float64, device="cpu"):
    """Per step, per worker, per layer: gradients with a few large elements; on a grid of
    2**-6 with ``dyadic`` (every sum exact), the layer ``ZERO`` all zero."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(n):
            grads = []
            for i, s in enumerate(shapes):
                x = torch.randn(s, generator=g, dtype=torch.float64)
                x = x * torch.where(torch.rand(s, generator=g) < 0.05, 10.0, 1.0)
                if dyadic:
                    x = torch.round(x * 64) / 64
                if i == ZERO and len(shapes) == len(EDGES):
                    x = torch.zeros(s, dtype=torch.float64)
                grads.append(x.to(device, dtype))
            step.append(grads)
        out.append(step)
    return out


def _pair(shapes, n, **kwargs):
    names = [f"p{i}" for i in range(len(shapes))]
    return [SimulatedWorkers(names, shapes, n, fused=f, **kwargs) for f in (False, True)]


def _same_workers(a: SimulatedWorkers, b: SimulatedWorkers) -> bool:
    return all(
        set(getattr(x, part)) == set(getattr(y, part))
        and all(torch.equal(getattr(x, part)[k], getattr(y, part)[k]) for k in getattr(x, part))
        for x, y in zip(a.workers, b.workers)
        for part in ("residuals", "chunk_residuals")
    )


def _seed(sims, shapes, n, dtype=torch.float64, device="cpu") -> None:
    """The same residuals on a grid of 2**-8 for every worker of both simulations, as a
    previous step would have left them (chunk residuals too)."""
    g = torch.Generator().manual_seed(11)
    layout = sims[0].layout
    for w in range(n):
        for layer in layout.compressed:
            r = (torch.round(torch.randn(layer.numel, generator=g, dtype=torch.float64) * 64) / 256).to(dtype)
            lo, hi = ref.chunk_bounds(layer.numel, layer.bins, n)[w]
            c = (torch.round(torch.randn(hi - lo, generator=g, dtype=torch.float64) * 64) / 256).to(dtype)
            for sim in sims:
                sim.workers[w].residuals[layer.name] = r.to(device)
                sim.workers[w].chunk_residuals[layer.name] = c.to(device)


# Where the ternary scale's sum rounds, its order is the kernels' own (the torch path's is
# torch's). Bit for bit: values="exact" over 2 steps; the ternary all-gather over one step
# from residuals on a grid. The two-phase owners average what was sent (off the grid):
# their messages are compared byte for byte, the steps after them against the reference.
BITWISE = [
    (form, select, values)
    for form in FORMS
    for select, values in MODES
    if values == "exact" or form == "allgather"
]


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("form,select,values", BITWISE, ids=["-".join(c) for c in BITWISE])
def test_kernels_equal_the_torch_path_bit_for_bit(form, select, values, device) -> None:
    """Every edge layout, 3 workers (two-phase chunks of unequal sizes), residuals carried
    in: the same averages and the same residuals (per layer, and per owned chunk), the
    same byte counts and selections."""
    n = 3
    sims = _pair(EDGES, n, form=form, select=select, values=values, dtype=torch.float64)
    sims[1].fused = True  # CUDA tensors take the kernels by default; CPU ones need this
    _seed(sims, EDGES, n, device=device)
    exact = values == "exact"
    for step in _grads(n, 2 if exact else 1, EDGES, device=device):
        want, got = sims[0].exchange(step), sims[1].exchange(step)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert _same_workers(*sims)
    assert sims[0].stats == sims[1].stats
    if (select, values) == ("adacomp", "ternary"):
        assert 0 < sims[1].stats["conv"]["selected"] < sims[1].stats["conv"]["elements"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("values", ["ternary", "exact"])
def test_low_precision_gradients(dtype, values) -> None:
    """fp32, fp16 and bf16 gradients (compressed in fp32, as the hook does): the same
    results as the torch path, bit for bit."""
    sims = _pair(EDGES, 2, dtype=dtype, values=values)
    _seed(sims, EDGES, 2, torch.float32)
    for step in _grads(2, 3 if values == "exact" else 1, EDGES, dtype=dtype):
        want, got = sims[0].exchange(step), sims[1].exchange(step)
        assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(want, got))
    assert _same_workers(*sims)


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize(
    "form,select", [("allgather", "adacomp"), ("two_phase", "adacomp"), ("two_phase", "all")]
)
def test_kernels_equal_the_reference(form, select, device) -> None:
    """Gradients off any grid (the scale's sum rounds), residuals carried over 3 steps:
    the kernels' selection is the reference's, and their results are within the rounding
    bound of it. The reference sums a scale's |G| exactly (``math.fsum``); the kernels sum
    them in a tree whose order is the device's, and any order of m terms is within
    (m - 1) u of the exact sum (u = 2**-53; Higham, Accuracy and Stability of Numerical
    Algorithms, 2002, eq. 4.4); each result adds its average over n workers. On the CPU the
    error stays near 1e-15; on an H200 the tree's order gave 6.5e-15 on 3,300 elements."""
    n, shapes = 3, EDGES
    names = [f"p{i}" for i in range(len(shapes))]
    sim = SimulatedWorkers(names, shapes, n, form=form, select=select, dtype=torch.float64, fused=True)
    res = [[np.zeros(int(np.prod(s)))] * n for s in shapes]
    server = [
        [np.zeros(hi - lo) for lo, hi in ref.chunk_bounds(int(np.prod(s)), ref.bin_length(s) or 1, n)]
        for s in shapes
    ]
    for step in _grads(n, 3, shapes, seed=3, dyadic=False, device=device):
        got = [g.cpu() for g in sim.exchange(step)]
        for i, s in enumerate(shapes):
            grads = [w[i].cpu().numpy().ravel() for w in step]
            # every value sent is at most the largest |residual + grad| (or, in phase 2,
            # |chunk residual + average|)
            largest = max(
                float(np.abs(r).max(initial=0) + np.abs(g).max(initial=0)) for r, g in zip(res[i], grads)
            )
            largest += max(float(np.abs(r).max(initial=0)) for r in server[i])
            bound = (int(np.prod(s)) + n + 2) * 2.0**-53
            b = ref.bin_length(s)
            if b is None:
                want = ref.allgather_exchange(res[i], [g / n for g in grads], None)[0] * n
            elif form == "allgather":
                want, res[i] = ref.allgather_exchange(res[i], grads, b, select=select)
            else:
                want, res[i], server[i] = ref.two_phase_exchange(res[i], server[i], grads, b, select=select)
            np.testing.assert_array_equal(got[i].numpy().ravel() != 0, want != 0)
            np.testing.assert_allclose(got[i].numpy().ravel(), want, rtol=bound, atol=bound * largest)


@pytest.mark.parametrize("dests", [1, 3])
def test_the_same_messages_byte_for_byte(dests) -> None:
    """The kernels' messages are the torch codec's (all-gather: one; two-phase: one per
    owner), the codes' widths of 1 and 2 bytes included."""
    for shapes in (EDGES, [(8, 4, 3, 3), (10, 20)]):
        layout = codec.make_layout([f"p{i}" for i in range(len(shapes))], shapes, torch.float64, 50, 500)
        flat = torch.cat([g.reshape(-1) for g in _grads(1, 1, shapes, seed=7)[0][0]])
        torch_ex = codec.Exchange(layout, dests, "adacomp", "ternary")
        fused_ex = fused_mod.FusedExchange(layout, dests, "adacomp", "ternary")
        worker = codec.Worker()
        parts = torch_ex.compress(worker, flat)
        want = [torch_ex.message(parts, None if dests == 1 else j) for j in range(dests)]
        got, sizes = fused_ex.messages(fused_ex.compress(worker, flat), dests)
        assert sizes == [m.numel() for m in want]
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_loss_scale_multiplies_the_residuals_and_divides_the_new_ones() -> None:
    layout = codec.make_layout(["a", "b"], [(8, 4, 3, 3), (10, 20)], torch.float32, 50, 500)
    g = torch.Generator().manual_seed(1)
    flat = torch.round(torch.randn(layout.numel, generator=g) * 64) / 64 * 1024
    worker = codec.Worker(
        {"a": torch.round(torch.randn(288, generator=g) * 64) / 64, "b": torch.randn(200, generator=g)}
    )
    torch_ex = codec.Exchange(layout, 1, "adacomp", "ternary")
    fused_ex = fused_mod.FusedExchange(layout, 1, "adacomp", "ternary")
    parts = torch_ex.compress(worker, flat, 1024.0)
    batch = fused_ex.compress(worker, flat, 1024.0)
    fused_ex.messages(batch, 1)
    fused_ex.commit(worker, batch)
    assert all(torch.equal(parts[k].residual.div(1024.0), worker.residuals[k]) for k in parts)


def test_all_zero_and_non_finite_buckets() -> None:
    """A bucket of zeros (residuals too) selects nothing: counts 0, scales 0, a message of
    headers only, zero results. A non-finite bucket's sizes are -1 (the hook sends it
    uncompressed); the simulation averages it plainly on both paths."""
    layout = codec.make_layout(["a", "b"], [(8, 4, 3, 3), (10, 20)], torch.float32, 50, 500)
    ex = fused_mod.FusedExchange(layout, 1, "adacomp", "ternary")
    batch = ex.compress(codec.Worker(), torch.zeros(layout.numel))
    assert ex.sizes(batch, 1, torch.zeros(1, dtype=torch.bool)).tolist() == [-1]
    messages, sizes = ex.messages(batch, 1)
    assert sizes == [2 * (8 + 4)] and batch.counts.tolist() == [0, 0] and not batch.scales.any()
    assert not ex.decode_all(messages, sizes, torch.device("cpu")).any()
    torch_sim, fused_sim = _pair([(4, 50)], 2)
    a, b = _grads(2, 1, [(4, 50)], dtype=torch.float32)[0]
    for sim in (torch_sim, fused_sim):
        sim.exchange([a, b])
    bad = [b[0].clone()]
    bad[0][0, 0] = float("nan")
    out = [sim.exchange([a, bad])[0] for sim in (torch_sim, fused_sim)]
    assert torch.isnan(out[1][0, 0]) and torch.equal(out[0][0, 1:], out[1][0, 1:])
    assert _same_workers(torch_sim, fused_sim)


def test_resumed_residuals_are_gathered_again() -> None:
    """A restored state's residuals (new tensors, no longer views of the kernels' buffer)
    are taken up by the next step: the run goes on as the uninterrupted one."""
    shapes = [(8, 4, 3, 3), (6,), (10, 20)]
    steps = _grads(2, 4, shapes)
    names = [f"p{i}" for i in range(len(shapes))]
    runs = [
        SimulatedWorkers(names, shapes, 2, form="two_phase", dtype=torch.float64, fused=True) for _ in "ab"
    ]
    for k, step in enumerate(steps):
        if k == 2:
            runs[1].load_state_dict(runs[1].state_dict())
            assert runs[1].workers[0].residuals["p0"]._base is None  # no longer a view
        want, got = runs[0].exchange(step), runs[1].exchange(step)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert _same_workers(*runs)


def test_the_choice_of_path(monkeypatch) -> None:
    msg = "Invalid fused: 'yes' (must be True, False or None)"
    with pytest.raises(TypeError, match=re.escape(msg)):
        SimulatedWorkers(["w"], [(4, 50)], 2, fused="yes")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # None: CUDA only, never the interpreter; True: also the CPU under TRITON_INTERPRET=1
    assert not fused_mod.resolve_fused(None, cpu) and fused_mod.resolve_fused(True, cpu)
    assert not fused_mod.resolve_fused(False, cuda) and fused_mod.resolve_fused(None, cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fused_mod.resolve_fused(None, cpu)
    with pytest.raises(RuntimeError, match="needs CUDA gradients.*TRITON_INTERPRET=1"):
        fused_mod.resolve_fused(True, cpu)
    monkeypatch.setattr(fused_mod, "triton_available", lambda: False)
    assert not fused_mod.resolve_fused(None, cuda)
    with pytest.raises(RuntimeError, match="needs triton"):
        fused_mod.resolve_fused(True, cuda)


def test_bins_longer_than_the_kernels_take() -> None:
    """A bin over MAX_BIN: fused=None keeps the torch path, fused=True says why it cannot."""
    long = fused_mod.MAX_BIN + 1
    grads = _grads(1, 1, [(long + 3, 1, 1)], dtype=torch.float32)[0]
    plain = SimulatedWorkers(["w"], [(long + 3, 1, 1)], 1, conv_bin=long)
    plain.fused = None  # as on CUDA: the kernels where they apply
    plain.exchange(grads)
    with pytest.raises(
        ValueError, match=f"takes bins of up to {fused_mod.MAX_BIN} elements; this bucket has one of {long}"
    ):
        SimulatedWorkers(["w"], [(long + 3, 1, 1)], 1, conv_bin=long, fused=True).exchange(grads)


# ----------------------------------------------------------------------------- launches and host reads


_LARGEBATCH = os.path.dirname(os.path.abspath(fused_mod.__file__)).rsplit(os.sep, 2)[0] + os.sep
_TRITON = os.path.dirname(os.path.abspath(sys.modules["triton"].__file__)) + os.sep


class _Ops(TorchDispatchMode):
    """Counts the torch operations largebatch's code runs (not Triton's interpreter's):
    each is a kernel launch on a GPU, or less."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(_TRITON):
                break
            if path.startswith(_LARGEBATCH):
                self.ops.append(func._schema.name)
                break
            frame = frame.f_back
        return func(*args, **(kwargs or {}))


def _from_largebatch() -> bool:
    frame = sys._getframe(2)
    return frame is not None and frame.f_code.co_filename.startswith(_LARGEBATCH)


class _Reads:
    """HostSyncs (tests/devices.py) and the ``tolist()`` calls of largebatch's code, which
    the CPU's torch answers without its dispatcher: every read of the device's values."""

    def __init__(self) -> None:
        self.tolist: list[str] = []
        self.syncs = HostSyncs()

    def __enter__(self) -> _Reads:
        tolist = self.original = torch.Tensor.tolist

        def counted(t):
            if _from_largebatch():
                self.tolist.append("tolist()")
            return tolist(t)

        torch.Tensor.tolist = counted
        self.syncs.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.syncs.__exit__(*exc)
        torch.Tensor.tolist = self.original

    @property
    def record(self) -> list[str]:
        return self.syncs.record + self.tolist


class _Counted:
    """Stands for a ``@triton.jit`` function: counts ``kernel[grid](...)``, then launches."""

    def __init__(self, kernel, launches: list[str], name: str) -> None:
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(self.name)
            return self.kernel[grid](*args, **kwargs)

        return launch


class _Shapes(torch.nn.Module):
    def __init__(self, shapes) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, coefs):
        return torch.stack([(p * c).sum() for p, c in zip(self.weights, coefs)]).sum()


@pytest.fixture(params=FUSED_DEVICES)
def one_rank(request):
    """A one-process group for the hook (gloo; NCCL on CUDA), gone after the test; its
    device."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    device = torch.device(request.param)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _hook_counts(
    monkeypatch, layers: int, form: str, fused=True, extra=(), device=None, bucket_mb=100, **kwargs
) -> tuple[int, int, int, dict]:
    """Triton launches, torch operations and host reads of one iteration of a one-bucket
    DDP model of ``layers`` layers (half conv weights, half biases) after two (DDP orders
    its buckets anew after the first)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    shapes = [(8, 4, 3, 3), (8,)] * (layers // 2) + list(extra)
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    model = DDP(
        _Shapes(shapes).to(device),
        bucket_cap_mb=bucket_mb,
        gradient_as_bucket_view=True,
        device_ids=[device.index] if cuda else None,
    )
    state = AdaCompState(model, form=form, fused=fused, **kwargs)
    calls: list[int] = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return adacomp_hook(state, bucket)

    hook.__annotations__.update(adacomp_hook.__annotations__)
    model.register_comm_hook(state, hook)
    launches: list[str] = []
    for name in fused_mod.KERNELS:
        monkeypatch.setattr(_kernels, name, _Counted(getattr(_kernels, name), launches, name))
    coefs = [(torch.round(torch.randn(s) * 64) / 64).to(device) for s in shapes]
    for _ in range(2):
        model(coefs).backward()
    launches.clear()
    calls.clear()
    with _Reads() as reads, _Ops() as ops, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        if cuda:  # torch's own count of what makes the host wait for the device
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            model(coefs).backward()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    if bucket_mb == 100:
        assert calls == [0], f"one bucket expected, the hook saw {calls}"
    syncs = len(reads.record) + sum("synchroniz" in str(w.message) for w in warned)
    return len(launches), len(ops.ops), syncs, {**state.stats, "buckets": len(calls)}


@pytest.mark.parametrize("form", FORMS)
def test_a_bucket_launches_and_reads_as_often_whatever_its_layers(monkeypatch, one_rank, form) -> None:
    """The hook on the kernels: a bucket of 40 layers launches as many Triton kernels and
    torch operations, and reads the device from the host as often, as a bucket of 4: one
    read (the messages' sizes with the layers' counts), two for two-phase (the owner's
    message sizes too), and once an iteration whether the results were finite."""
    device = one_rank
    few = _hook_counts(monkeypatch, 4, form, device=device)
    many = _hook_counts(monkeypatch, 40, form, device=device)
    assert few[:3] == many[:3], (few[:3], many[:3])
    launches, _, reads, stats = many
    # select, finish, scan, header, encode (one kind of bin here) and decode (one rank)
    assert launches == (6 if form == "allgather" else 12), launches
    if device.type == "cpu":  # on CUDA, torch's sync debug mode counts each read too
        assert reads == (2 if form == "allgather" else 3), reads
    assert stats["fused_buckets"] == 3 and stats["compressed_steps"] == 3


@pytest.mark.parametrize("form", FORMS)
def test_one_read_a_bucket_and_one_an_iteration(monkeypatch, one_rank, form) -> None:
    """Buckets of about 4 KB: the host reads the message sizes once a bucket (twice for
    two-phase) and the results' finiteness once an iteration."""
    if one_rank.type == "cuda":
        pytest.skip("counted on the CPU (the CUDA case above counts torch's own syncs)")
    _, _, reads, stats = _hook_counts(monkeypatch, 40, form, bucket_mb=0.004)
    buckets = stats["buckets"]
    assert buckets > 2 and stats["fused_buckets"] > 2 * buckets
    assert reads == (1 if form == "allgather" else 2) * buckets + 1, (reads, buckets)


def test_the_hook_reports_its_path(monkeypatch, one_rank) -> None:
    if one_rank.type == "cuda":
        pytest.skip("the path's choice is the same on the CPU")
    """fused=False, and fused=None with bins longer than the kernels take: the torch
    path, its launches growing with the layers; a bad value is refused."""
    torch_path = _hook_counts(monkeypatch, 4, "allgather", fused=False)
    assert torch_path[0] == 0 and torch_path[3]["fused_buckets"] == 0
    assert _hook_counts(monkeypatch, 40, "allgather", fused=False)[1] > torch_path[1]
    # fused=None where the kernels run (the CPU taken for CUDA): a bin too long keeps the torch path
    monkeypatch.setattr(hook_mod, "resolve_fused", lambda fused, device: fused is not False)
    long = _hook_counts(
        monkeypatch,
        4,
        "allgather",
        fused=None,
        extra=[(fused_mod.MAX_BIN + 1, 1, 1)],
        conv_bin=fused_mod.MAX_BIN + 1,
    )
    assert long[3]["fused_buckets"] == 0
    assert _hook_counts(monkeypatch, 4, "allgather", fused=None)[3]["fused_buckets"] == 3  # 3 iterations
    with pytest.raises(TypeError, match=re.escape("Invalid fused: 1 (must be True, False or None)")):
        AdaCompState(torch.nn.Linear(2, 2), form="allgather", fused=1)


# ----------------------------------------------------------------------------- compiled


_COMPILE = """
import contextlib, inspect, io, os, re, sys
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from largebatch.comm.torch import _kernels as K
from largebatch.comm.torch._fused import DECODE_TILE, MAX_BIN, TILE

POINTERS = {"progs": "*i32", "bin_count": "*i32", "bin_sum": "*fp64", "finite": "*i1"}
POINTERS.update(out="*u8", msg="*u8", k="i64", codes="i64")
for name in ("segs", "bin_prefix", "seg_count", "table", "sizes", "bases", "targets"):
    POINTERS[name] = "*i64"
failed = 0
for dt, item in (("fp32", 4), ("fp64", 8)):
    cases = [
        (K.select_kernel, dict(HAS_SCALE=True, ALL=False, ROWS=TILE // 64, COLS=64)),
        (K.select_kernel, dict(HAS_SCALE=False, ALL=True, ROWS=TILE // 512, COLS=512)),
        (K.finish_kernel, dict(EXACT=False, BLOCK=1024)),
        (K.scan_kernel, dict(DESTS=4, WIDTH=3, ITEM=item, EXACT=True, KP=16)),
        (K.header_kernel, dict(ITEM=item, KP=16)),
        (K.encode_kernel, dict(DESTS=4, WIDTH=3, ITEM=item, HAS_SCALE=True, ALL=False, EXACT=False,
                               ROWS=TILE // 512, COLS=512)),
        (K.encode_kernel, dict(DESTS=1, WIDTH=3, ITEM=item, HAS_SCALE=False, ALL=False, EXACT=False,
                               ROWS=TILE // 64, COLS=64)),
        (K.encode_kernel, dict(DESTS=1, WIDTH=2, ITEM=item, HAS_SCALE=False, ALL=False, EXACT=True,
                               ROWS=TILE // 64, COLS=64)),
        (K.encode_kernel, dict(DESTS=4, WIDTH=3, ITEM=item, HAS_SCALE=True, ALL=False, EXACT=True,
                               ROWS=1, COLS=MAX_BIN)),
        (K.decode_kernel, dict(WIDTH=3, ITEM=item, EXACT=False, KP=64, BLOCK=DECODE_TILE // 64)),
        (K.decode_kernel, dict(WIDTH=1, ITEM=item, EXACT=True, KP=16, BLOCK=DECODE_TILE // 16)),
    ]
    for fn, consts in cases:
        names = list(inspect.signature(fn.fn).parameters)
        sig = {n: "constexpr" if n in consts else POINTERS.get(n, "*" + dt) for n in names}
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        log = io.StringIO()
        try:
            with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
                knobs.compilation.always_compile = True  # ptxas runs, and logs
                knobs.nvidia.dump_ptxas_log = True
                triton.compile(src, target=GPUTarget("cuda", 90, 32))
        except Exception as err:
            failed += 1
            print(fn.fn.__name__, dt, consts, type(err).__name__, str(err)[-2000:])
            continue
        spills = re.findall(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", log.getvalue())
        if not spills or any(int(a) or int(b) for a, b in spills):
            failed += 1
            print(fn.fn.__name__, dt, consts, "spills (or no ptxas log):", spills)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_the_kernels_compile_for_a_gpu(tmp_path) -> None:
    """Compiled for an H100/H200 (sm_90, no GPU needed), the launch shapes the plans make,
    with no register spilled: the interpreter runs Python, and takes code the compiler
    refuses (a global that is not a constexpr, for one)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
