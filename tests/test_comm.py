"""AdaComp: the float64 reference on hand-made bins, the error-feedback identity, the torch
compressor and the one-process simulation against the reference, and the DDP hook on 2
and 4 gloo processes (``comm_worker.py``): its contract, the reference, the simulation bit
for bit, real training, non-finite gradients, resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from devices import HostSyncs
from helpers import BAD_ADACOMP_OPTIONS

from largebatch.comm import reference as ref
from largebatch.comm.torch import AdaCompState, SimulatedWorkers, compress
from largebatch.comm.torch import _codec as codec
from largebatch.comm.torch._fused import MAX_BIN

WORKER = Path(__file__).with_name("comm_worker.py")
FORMS = ("allgather", "two_phase")


# ----------------------------------------------------------------------------- the reference


def _torch_compress(r, g, bin_len, **kwargs) -> ref.Compressed:
    c = compress(
        torch.tensor(r, dtype=torch.float64), torch.tensor(g, dtype=torch.float64), bin_len, **kwargs
    )
    return ref.Compressed(c.sent.numpy(), c.residual.numpy(), c.mask.numpy(), float(c.scale))


# the rules on hand-made bins hold for the reference and the torch compressor alike
IMPLS = pytest.mark.parametrize("impl", [ref.compress, _torch_compress], ids=["numpy", "torch"])


@IMPLS
def test_hand_made_bins(impl) -> None:
    """L_T = 4, no residual: G = g and H = 2g; bin 1 sends |H| >= 3, bin 2 is all zero and
    sends nothing, bin 3 sends its three 4s, the short last bin its one element; the scale
    is the mean |G| of the selected: (3 + 2 + 4 + 4 + 4 + 2) / 6."""
    g = np.array([1, -3, 2, 0.5, 0, 0, 0, 0, 4, 4, -4, 1, 2])
    c = impl(np.zeros(13), g, 4)
    want_mask = np.array([0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1], bool)
    np.testing.assert_array_equal(c.mask, want_mask)
    assert c.scale == 19 / 6
    np.testing.assert_array_equal(c.sent, np.where(want_mask, np.sign(g) * 19 / 6, 0))
    np.testing.assert_array_equal(c.residual, g - c.sent)


@IMPLS
def test_residual_is_sent_later_and_h_weighs_the_new_gradient(impl) -> None:
    """With no new gradient, H = G: each bin sends exactly its largest residual. With a new
    gradient, an element whose gradient pushes the same way as its residual is selected
    although its |G| is below the bin's maximum (the self-adjusting rule)."""
    r = np.array([0.5, -2.0, 1.0, 0.25, 3.0, -1.0])
    c = impl(r, np.zeros(6), 3)
    np.testing.assert_array_equal(c.mask, [False, True, False, False, True, False])
    g = np.array([0.0, 0.0, 0.6, 0.0, 0.0, 0.0])  # G = 1.6 < 2 = max, H = 2.2 >= 2
    c = impl(r, g, 3)
    np.testing.assert_array_equal(c.mask, [False, True, True, False, True, False])


def test_error_feedback_identity() -> None:
    """What is sent plus the new residual is the residual plus the gradient: unselected
    elements keep G bit for bit and send 0; a selected element's new residual is G - sent
    correctly rounded (checked in rational arithmetic), the only rounding there is."""
    rng = np.random.default_rng(0)
    r = np.zeros(1000)
    for _ in range(20):
        g = rng.normal(size=1000) * rng.choice([1e-3, 1.0, 1e3], size=1000)
        c = ref.compress(r, g, 50)
        big_g = r + g
        np.testing.assert_array_equal(c.residual[~c.mask], big_g[~c.mask])
        assert not c.sent[~c.mask].any()
        for i in np.flatnonzero(c.mask)[:200]:
            exact = Fraction(big_g[i]) - Fraction(c.sent[i])
            assert c.residual[i] == float(exact)  # float(Fraction) rounds correctly
            assert abs(Fraction(c.residual[i]) - exact) <= abs(Fraction(np.spacing(c.residual[i]))) / 2
        r = c.residual
    # the residual stays bounded: it is sent, it does not pile up
    assert np.abs(r).max() < 20 * 1e3


def test_everything_selected_and_exact_is_the_plain_average() -> None:
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=(8, 3, 3, 3)) for _ in range(4)]
    avg, res = ref.allgather_exchange([np.zeros(216)] * 4, grads, 50, select="all", values="exact")
    np.testing.assert_array_equal(avg, (((grads[0] + grads[1]) + grads[2]) + grads[3]).ravel() / 4)
    assert not any(r.any() for r in res)


def test_two_phase_chunks_are_whole_bins() -> None:
    for numel, bin_len, n in [(1000, 50, 4), (1001, 50, 4), (7, 50, 8), (0, 50, 2), (5000, 500, 3)]:
        b = ref.chunk_bounds(numel, bin_len, n)
        assert len(b) == n and b[0][0] == 0 and b[-1][1] == numel
        assert all((lo % bin_len == 0 or lo == numel) and lo <= hi for lo, hi in b)
        assert all(b[j][1] == b[j + 1][0] for j in range(n - 1))


def test_bin_lengths_by_layer_kind() -> None:
    assert ref.bin_length((64, 3, 7, 7)) == 50 and ref.bin_length((1000, 2048)) == 500
    assert ref.bin_length((64,)) is None and ref.bin_length(()) is None
    assert ref.bin_length((8, 4, 3), conv_bin=10) == 10


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_a_bin_longer_than_the_layer_costs_the_layers_memory() -> None:
    """One bin of L_T = 2e8 over a 1,000-element layer is the layer's one bin: the same
    result as L_T = 1,000, and no tensor larger than the layer (not 2e8 elements)."""
    assert ref.bin_length((10, 100), fc_bin=2 * 10**8) == 1000
    assert ref.bin_length((2, 5, 10, 10), conv_bin=2 * 10**8) == 1000
    rng = np.random.default_rng(0)
    r, g = rng.standard_normal(1000), rng.standard_normal(1000)
    with _LargestTensor() as seen:
        got = _torch_compress(r, g, 2 * 10**8)
    assert seen.largest <= 1000, seen.largest
    want = ref.compress(r, g, 1000)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(got.sent, want.sent, rtol=1e-15)
    np.testing.assert_array_equal(ref.compress(r, g, 2 * 10**8).mask, want.mask)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_reference_refuses_bad_bins(bad) -> None:
    message = f"Invalid bin length L_T: {bad!r} (must be an integer >= 1)"
    with pytest.raises(ValueError, match=re.escape(message)):
        ref.compress(np.zeros(3), np.ones(3), bad)


def test_reference_refuses_unknown_modes() -> None:
    with pytest.raises(ValueError, match=r"Invalid select: 'top' \(must be one of adacomp, all\)"):
        ref.compress(np.zeros(3), np.ones(3), 2, select="top")
    with pytest.raises(ValueError, match=r"Invalid values: 'int8' \(must be one of ternary, exact\)"):
        ref.compress(np.zeros(3), np.ones(3), 2, values="int8")


# ----------------------------------------------------------------------------- torch, one process


@pytest.mark.parametrize("numel,bin_len", [(1000, 50), (1234, 500), (7, 50), (50, 50), (0, 50)])
def test_torch_compress_equals_reference_float64(numel: int, bin_len: int) -> None:
    rng = np.random.default_rng(numel)
    r = np.zeros(numel)
    for _ in range(5):
        g = rng.normal(size=numel) * np.where(rng.random(numel) < 0.05, 10, 1)
        want = ref.compress(r, g, bin_len)
        got = compress(torch.tensor(r), torch.tensor(g), bin_len)
        np.testing.assert_array_equal(got.mask.numpy(), want.mask)
        # the scale is a mean over the selected: torch's summation order against math.fsum's
        # correctly rounded sum, a few ulps of the scale, in sent and residual alike
        ulps = 4 * np.spacing(want.scale)
        assert abs(float(got.scale) - want.scale) <= ulps
        np.testing.assert_allclose(got.sent.numpy(), want.sent, rtol=0, atol=ulps)
        np.testing.assert_allclose(got.residual.numpy(), want.residual, rtol=0, atol=ulps)
        r = want.residual


def _as_on_a_gpu(monkeypatch) -> None:
    """The exchange's code for a device the host waits for, on CPU tensors."""
    monkeypatch.setattr(codec, "host_waits", lambda device: True)


@pytest.mark.parametrize("form", FORMS)
def test_the_exchange_for_a_gpu_sends_the_same_messages(monkeypatch, form) -> None:
    shapes = [(8, 4, 3, 3), (8,), (10, 120), (2, 2, 3, 3)]
    runs = []
    for gpu in (False, True):
        if gpu:
            _as_on_a_gpu(monkeypatch)
        sim = SimulatedWorkers([f"p{i}" for i in range(len(shapes))], shapes, 3, form=form)
        runs.append([sim.exchange(step) for step in _grads(3, 3, shapes, seed=5)])
    for cpu_step, gpu_step in zip(*runs):
        assert all(torch.equal(a, b) for a, b in zip(cpu_step, gpu_step))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("form", FORMS)
def test_a_compressed_exchange_syncs_no_more_with_more_layers(monkeypatch, form, device) -> None:
    """The exchange took two host syncs per compressed layer (its ``nonzero`` and its
    count), and on a GPU each makes the host wait for the device: inside a DDP hook, the
    rest of the backward pass cannot be queued meanwhile. A bucket of 40 layers now waits
    as often as one of 4 (``HostSyncs``, the GPU's code on CPU tensors; on a GPU, torch's
    sync debug mode too)."""
    _as_on_a_gpu(monkeypatch)

    def syncs(layers: int) -> int:
        shapes = [(8, 4, 3, 3), (8,)] * (layers // 2)
        sim = SimulatedWorkers([f"p{i}" for i in range(layers)], shapes, 2, form=form)
        grads = [[[g.to(device) for g in w] for w in step] for step in _grads(2, 2, shapes)]
        sim.exchange(grads[0])
        with HostSyncs() as seen, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                sim.exchange(grads[1])
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        return len(seen.record) + len(warned)

    assert syncs(40) == syncs(4)


def _grads(n: int, steps: int, shapes, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        [[torch.randn(s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(n)]
        for _ in range(steps)
    ]


FUSED = pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])


@FUSED
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_simulation_equals_reference(form: str, n: int, fused: bool) -> None:
    """float64 simulation (messages encoded and decoded) against the reference exchange,
    on torch operations and on the kernels."""
    shapes = [(5, 3, 3, 3), (5,), (10, 120), (4, 4, 1, 1)]
    names = [f"p{i}" for i in range(len(shapes))]
    sim = SimulatedWorkers(names, shapes, n, form=form, dtype=torch.float64, fused=fused)
    res = {k: [np.zeros(int(np.prod(s)))] * n for k, s in zip(names, shapes)}
    server = {
        k: [np.zeros(hi - lo) for lo, hi in ref.chunk_bounds(int(np.prod(s)), ref.bin_length(s) or 1, n)]
        for k, s in zip(names, shapes)
    }
    for step in _grads(n, 4, shapes):
        got = sim.exchange(step)
        for i, (k, s) in enumerate(zip(names, shapes)):
            grads = [w[i].numpy().ravel() for w in step]
            b = ref.bin_length(s)
            if b is None:
                want = ref.allgather_exchange(res[k], [g / n for g in grads], None)[0] * n
            elif form == "allgather":
                want, res[k] = ref.allgather_exchange(res[k], grads, b)
            else:
                want, res[k], server[k] = ref.two_phase_exchange(res[k], server[k], grads, b)
            np.testing.assert_array_equal(got[i].numpy().ravel() != 0, want != 0)
            np.testing.assert_allclose(got[i].numpy().ravel(), want, rtol=1e-15, atol=1e-15)


@FUSED
@pytest.mark.parametrize("numel", [127, 128, 40_000])
def test_message_widths_round_trip(numel: int, fused: bool) -> None:
    """Indices are packed into as few bytes as twice the layer size needs (a sign bit): at
    127 one byte, at 128 two, at 40,000 three; every index survives, the last included."""
    n = 2
    sim = SimulatedWorkers(
        ["w"], [(numel, 1, 1)], n, conv_bin=1, select="all", values="exact", dtype=torch.float64, fused=fused
    )
    grads = [[torch.arange(1, numel + 1, dtype=torch.float64).view(numel, 1, 1) * (w + 1)] for w in range(n)]
    out = sim.exchange(grads)[0]
    torch.testing.assert_close(out, grads[0][0] * 1.5, rtol=0, atol=0)
    assert sim.layout.width == {127: 1, 128: 2, 40_000: 3}[numel]
    bins = min(numel, MAX_BIN) if fused else numel  # the kernels' bins are at most MAX_BIN
    ternary = SimulatedWorkers(["w"], [(numel, 1, 1)], 1, conv_bin=bins, fused=fused)
    g = torch.zeros(numel, 1, 1)
    g[-1] = -2.0
    torch.testing.assert_close(ternary.exchange([[g]])[0], g, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    BAD_ADACOMP_OPTIONS,
    ids=[next(iter(k)) + "=" + repr(next(iter(k.values()))) for k, _ in BAD_ADACOMP_OPTIONS],
)
def test_the_simulation_refuses_what_the_jax_transform_refuses(kwargs, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SimulatedWorkers(["w"], [(4, 50)], 2, **kwargs)


def test_simulation_warmup_and_nonfinite_are_plain_averages() -> None:
    sim = SimulatedWorkers(["w"], [(4, 50)], 2, warmup_steps=1)
    a, b = torch.randn(4, 50), torch.randn(4, 50)
    torch.testing.assert_close(sim.exchange([[a], [b]])[0], a / 2 + b / 2, rtol=0, atol=0)
    assert sim.workers[0].residuals == {}
    sim.exchange([[a], [b]])
    before = {k: v.clone() for k, v in sim.workers[0].residuals.items()}
    bad = b.clone()
    bad[0, 0] = float("nan")
    out = sim.exchange([[a], [bad]])[0]
    assert torch.isnan(out[0, 0])
    assert all(torch.equal(before[k], sim.workers[0].residuals[k]) for k in before)


def test_simulation_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=re.escape("Invalid workers: 0 (must be an integer >= 1)")):
        SimulatedWorkers(["w"], [(2, 2)], 0)
    with pytest.raises(ValueError, match=r"Invalid form: 'ring' \(must be one of allgather, two_phase\)"):
        SimulatedWorkers(["w"], [(2, 2)], 2, form="ring")
    with pytest.raises(ValueError, match=r"Invalid values: 'binary'"):
        SimulatedWorkers(["w"], [(2, 2)], 2, values="binary")
    with pytest.raises(ValueError, match="need gradients from 2 workers, got 1"):
        SimulatedWorkers(["w"], [(2, 2)], 2).exchange([[torch.zeros(2, 2)]])


def test_state_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(ValueError, match="needs an initialized process group"):
        AdaCompState(torch.nn.Linear(2, 2), form="allgather")


# ----------------------------------------------------------------------------- the hook, N processes


def _run_worker(tmp_path_factory, nproc: int, *extra: str):
    out = tmp_path_factory.mktemp(f"comm{nproc}") / "cases.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    found = {}
    if out.exists():
        found = {c["case"]: c for c in map(json.loads, out.read_text().splitlines())}

    class Cases(dict):
        def __missing__(self, case: str) -> dict:
            pytest.fail(f"the worker did not reach {case}: {proc.stderr[-3000:]}")

    return Cases(found)


@pytest.fixture(scope="module")
def two_torch(tmp_path_factory):
    return _run_worker(tmp_path_factory, 2, "full")


@pytest.fixture(scope="module")
def four_torch(tmp_path_factory):
    return _run_worker(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def two_fused(tmp_path_factory):
    return _run_worker(tmp_path_factory, 2, "full", "fused")


@pytest.fixture(params=["torch", "fused"])
def path(request) -> str:
    """The hook's path: torch operations per layer, or the Triton kernels (interpreted)."""
    return request.param


@pytest.fixture
def two(request, path):
    return request.getfixturevalue(f"two_{path}")


@pytest.fixture(params=[2, 4])
def world(request, path):
    """2 processes on either path; 4 on torch operations only. The kernels' exchange among
    more workers is test_simulation_equals_reference's (3 and 8 simulated workers, which
    test_hook_equals_simulation_bit_for_bit ties to the hook at 2); 4 interpreted
    processes would add half a minute on 2 cores for what those check."""
    if request.param == 4 and path == "fused":
        pytest.skip("4 processes run on torch operations; 3 and 8 simulated workers on the kernels")
    return request.param, request.getfixturevalue(f"{'two' if request.param == 2 else 'four'}_{path}")


def _took_path(case: dict, path: str) -> bool:
    """The hook's buckets went the way the run asked: every one on the kernels, or none."""
    return (case["fused_buckets"] > 0) == (path == "fused")


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_hook_with_everything_selected_equals_default_allreduce(world, path, form: str) -> None:
    """select="all", values="exact": the hook returns DDP's default all-reduce bit for bit
    (gradients are multiples of 2**-10, exact in any summation order), in every param's
    shape, over several small buckets."""
    n, cases = world
    c = cases[f"everything/{form}/{n}"]
    assert c["same"] and c["shapes_kept"] and c["compressed_steps"] == 3 and _took_path(c, path)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_hook_equals_reference(world, path, form: str) -> None:
    """float64 DDP with the hook against the NumPy reference for 4 compressed steps after a
    warm-up step: the same selection, values and residuals to 1e-15 (the scale's sum is
    taken in a different order)."""
    n, cases = world
    c = cases[f"reference/{form}/{n}"]
    assert c["masks_equal"] and c["compressed_steps"] == 4 and _took_path(c, path)
    assert c["worst"] < 1e-15 and c["residual_err"] < 1e-14


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_hook_equals_simulation_bit_for_bit(world, path, form: str) -> None:
    n, cases = world
    c = cases[f"simulation/{form}/{n}"]
    assert c["same"] and _took_path(c, path)
    assert 0 < c["sent_bytes"] < c["dense_bytes"] / 3
    assert c["rates"]["dense"] == 1.0 and c["rates"]["conv"] > 5 and c["rates"]["fc"] > 5


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_training_with_hook_equals_simulation(two, path, form: str) -> None:
    """A CNN with batch norm, SGD with momentum, 2 warm-up steps then 4 compressed: the
    2-process run and the one-process simulation end with the same params, buffers and
    residuals, bit for bit."""
    c = two[f"training/{form}/2"]
    assert c["same"] and c["moved"] and c["residuals_same"] and _took_path(c, path)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_nonfinite_gradient_reaches_everyone_and_keeps_residuals(two, form: str) -> None:
    c = two[f"nonfinite/{form}/2"]
    assert c["inf_seen"] and c["others_finite"] and c["kept"]


@pytest.mark.slow
def test_local_clip_hook_sums_each_ranks_clipped_gradients(two_torch) -> None:
    c = two_torch["local_clip/2"]
    assert c["bound"] and c["worst"] < 1e-6, c


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_channels_last_weights_are_binned_in_logical_order(two, form: str) -> None:
    c = two[f"channels_last/{form}/2"]
    assert c["strided"] and c["grads"] and c["residuals"] and c["loads"]


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_an_fp16_average_that_overflows_commits_no_residual(two, form: str) -> None:
    c = two[f"overflow/{form}/2"]
    assert c["dtype"] == "torch.float16" and c["finite_in"]
    assert c["inf_seen"] and c["kept"]


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_resume_is_bit_exact_and_refuses_other_settings(two, form: str) -> None:
    c = two[f"resume/{form}/2"]
    assert c["same"]
    assert "saved with different settings" in c["refused"] and "form: saved" in c["refused"]
    assert "expected a flat floating tensor of" in c["short"] and "got torch.float32 of shape (" in c["short"]
    assert "expected a flat floating tensor of" in c["folded"] and "of shape (1, " in c["folded"]
    assert c["untouched"]


def test_auto_form_is_the_cheaper_exchange_by_the_formulas() -> None:
    """n = 4, 5 us, 10 GB/s: all-gather 3(a + P/B) against two-phase 6(a + P/(4B)): equal
    at P = 2aB = 100,000 bytes (all-gather wins ties: one collective). Two workers: always
    all-gather (the same bytes, fewer messages)."""
    from largebatch.comm.torch import choose_model_form

    def model(bytes_: int) -> torch.nn.Module:
        return torch.nn.Linear(bytes_ // 4, 1, bias=False)  # float32: 4 bytes a param

    net = (5e-6, 10e9)
    assert choose_model_form(4, model(4_000_000), 40.0, net) == "allgather"  # P = 100,000
    assert choose_model_form(4, model(4_000_160), 40.0, net) == "two_phase"  # P = 100,004
    assert choose_model_form(2, model(400_000_000), 40.0, net) == "allgather"
    assert choose_model_form(64, model(4_000_000), 40.0, net) == "two_phase"


def test_the_torch_facade_exports_the_hooks_state() -> None:
    """``largebatch.torch.AdaCompState`` is the class ``adacomp_hook`` takes its state as."""
    import typing

    import largebatch.torch as lt
    from largebatch.comm.torch import _hook

    assert {"AdaCompState", "adacomp_hook"} <= set(lt.__all__)
    assert lt.AdaCompState is AdaCompState is _hook.AdaCompState
    assert lt.adacomp_hook is _hook.adacomp_hook
    assert typing.get_type_hints(lt.adacomp_hook)["state"] is lt.AdaCompState
