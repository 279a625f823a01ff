"""The host side of the fused step: FusedGroup and its checks, the launch plan (tables,
workspace, launch shapes) and its cache, the launches of one step on a plan, and the two
entry points, which find the plan and launch the kernels of ``common.py``, ``lars.py``
and ``lamb.py`` (docs/design.md §3)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

import torch
import triton
import triton.language as tl

from largebatch.lars.kernels.common import (
    COL_NUMEL,
    COL_STEP,
    GSQ,
    WS_HEAD,
    finish_kernel,
    grad_check_kernel,
)
from largebatch.lars.kernels.lamb import lamb_apply_kernel, lamb_moments_kernel
from largebatch.lars.kernels.lars import lars_apply_kernel, lars_norms_kernel
from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC, Hyperparams, LambHyperparams, OptimizerSpec

BLOCK = 1024  # elements a program handles at once (at most)
TILES = 4  # blocks per program (at most): a chunk is BLOCK * TILES elements


@dataclass
class FusedGroup:
    """One param group for the fused step, already filtered to params with grads.

    ``params``: fp32 / fp16 / bf16 model params, updated in place. ``grads``: their
    dtypes, never written. ``masters``: fp32 master copies (the math then runs on the
    master and the param is rewritten as its cast), None for the list or an entry: no
    master. ``state``: LARS ``{"momentum_buffer"}``, LAMB ``{"exp_avg", "exp_avg_sq"}``,
    fp32 for a param with a master, else its dtype. ``steps``: one fp32 0-dim count per
    param (params may share one), +1 on the device unless the step is skipped. ``lr``:
    fp32 0-dim, read by the kernels (a schedule may change it in place). ``hyper``: the
    group's hyperparameters, a ``LarsHyperparams`` or ``LambHyperparams``
    (``LARS_SPEC.make({...})``), checked when it was made. ``maximize``: the step ascends
    (the kernels take ``-grad``, as torch's ``maximize=True``)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    masters: list[torch.Tensor | None] | None
    state: dict[str, list[torch.Tensor]]
    steps: list[torch.Tensor]
    lr: torch.Tensor
    hyper: Hyperparams  # LarsHyperparams or LambHyperparams, as the entry point
    maximize: bool = False


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


@dataclass
class _Bucket:
    """The tensors of one (param dtype, masters) kind: tables and launch shape."""

    chunks: torch.Tensor  # int64 [n_chunks, 2]: (tensor, chunk index in it) per program
    meta: torch.Tensor  # int64 [n_tensors, META_COLS]
    acc: torch.Tensor  # fp64 [n_tensors, 2]: its tensors' sums, a view into the plan's workspace
    grid: tuple[int]  # one program per chunk
    has_master: bool
    consts: dict  # P_DTYPE, W_DTYPE, ALIGNED, BLOCK, TILES; num_warps (a launch option)


@dataclass
class Plan:
    """One set of groups' launches: device tables, workspace and launch shapes, built
    once (:func:`plan_for`) and run by :func:`launch_lars` / :func:`launch_lamb` at every
    step while the tensors stay where they were."""

    buckets: list[_Bucket]
    hyper: torch.Tensor  # fp64 [n_groups, len(spec.columns) + 1]: each group's row (below)
    ws: torch.Tensor  # fp64 workspace: the global sums ([GSQ]), then per-tensor sums
    parts: torch.Tensor  # fp64 [n_slots, 2]: each chunk's partial sums, one slot a chunk
    spans: torch.Tensor  # int64 [n_tensors, 2]: (first slot, slot count) of each tensor
    every_slot: torch.Tensor  # int64 [1, 2]: (0, n_slots), the global sum's span
    steps: torch.Tensor  # int64 [n_steps]: distinct step addresses (tensors', then counter)
    decayed: bool = False  # some LARS group has decayed_norm: pass 1 is lars_norms_kernel
    gaddr: torch.Tensor | None = None  # int64 [n_groups]: lr addresses
    lrs: tuple = ()  # the lr addresses gaddr holds
    # The host tables the device ones were copied from ("tables", "lrs"; pinned on CUDA),
    # kept while the plan lives: no asynchronous copy outlives its source. (A replaced
    # "lrs" source is safe too: torch's pinned-memory allocator reuses a block only after
    # the copies recorded on it have completed.)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)


_PLANS: OrderedDict[tuple, Plan] = OrderedDict()
_MAX_PLANS = 8


# ----------------------------------------------------------------------------- inputs


def check_fused(hyper: Hyperparams, i: int) -> None:
    """What the kernels need of group ``i``'s hyperparameters beyond the spec: LAMB's eps
    > 0 (compiled for a GPU, fp32 sqrt and division flush denormals to zero, so a v_hat
    below 2**-126 would give u = m / 0 = inf where the other paths give a finite u)."""
    if isinstance(hyper, LambHyperparams) and hyper.eps == 0:
        raise ValueError(
            f"Invalid group {i} eps: 0 (the fused LAMB kernels need eps > 0: on a "
            "GPU, sqrt(v_hat) of a denormal v_hat flushes to 0; use foreach=True "
            "for eps=0)"
        )


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}"


def _same_layout(x: torch.Tensor, p: torch.Tensor) -> bool:
    """``x``'s elements lie where ``p``'s do: the same shape and the same stride on every
    dim of more than one element. A dim of one element is never stepped over, so its
    stride is free: autograd may give a channels_last ``(C, 1, k, k)`` conv weight the
    contiguous strides, which order its elements the same way."""
    return x.shape == p.shape and all(a == b for a, b, n in zip(x.stride(), p.stride(), p.shape) if n > 1)


def _check_group(i: int, group: FusedGroup, state_names: tuple[str, ...], device: torch.device) -> None:
    if set(group.state) != set(state_names):
        raise ValueError(f"group {i}: state must hold {state_names}, got {sorted(group.state)}")
    lists = {
        "grads": group.grads,
        "masters": group.masters or group.params,
        "steps": group.steps,
        **group.state,
    }
    for name, xs in lists.items():
        if len(xs) != len(group.params):
            raise ValueError(f"group {i}: {len(xs)} {name} for {len(group.params)} params")
    for j, p in enumerate(group.params):
        if p.dtype not in _TL_DTYPES or not any(p.is_contiguous(memory_format=f) for f in _FORMATS):
            raise ValueError(f"group {i} param {j}: need dense fp32/fp16/bf16, got {_describe(p)}")
        master = _master(group, j)
        math_dtype = p.dtype if master is None else torch.float32
        expect = {"grads": (group.grads[j], p.dtype), "masters": (master, torch.float32)}
        expect.update({k: (group.state[k][j], math_dtype) for k in state_names})
        for name, (x, want) in expect.items():
            if x is None:
                continue
            if x.dtype != want or x.device != device or not _same_layout(x, p):
                raise ValueError(
                    f"group {i} {name}[{j}]: expected {want} like param {_describe(p)}, got {_describe(x)}"
                )
        _check_scalar(f"group {i} steps[{j}]", group.steps[j], device)


def _check_scalar(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.dtype != torch.float32 or x.numel() != 1 or x.device != device:
        raise ValueError(f"{name} must be one fp32 on {device}: {_describe(x)}")


def _master(group: FusedGroup, j: int) -> torch.Tensor | None:
    return None if group.masters is None else group.masters[j]


# ----------------------------------------------------------------------------- the plan


_DTYPE = attrgetter("dtype")


def _key(spec: OptimizerSpec, groups: list[FusedGroup], counter: torch.Tensor | None) -> tuple:
    """What a plan's tensor tables depend on: device, addresses, sizes, dtypes, hyperparameters.

    The Python work is per group; per tensor, each list is read by one C-level ``map``
    (its addresses; the params' dtypes and sizes), the least a key can read when grads
    may move at any step. lr addresses are left out: when those tensors change, only
    their small table is refreshed (see _set_lrs).
    """
    key: list[Any] = [spec.name, groups[0].params[0].device, None if counter is None else counter.data_ptr()]
    ptr = torch.Tensor.data_ptr
    for i, g in enumerate(groups):
        if type(g.hyper) is not spec.hyperparams:  # its values were checked when it was made
            raise TypeError(
                f"group {i}: hyper must be a {spec.hyperparams.__name__} (e.g. "
                f"{spec.name}_SPEC.make({{...}})), got {type(g.hyper).__name__}"
            )
        names = tuple(g.state)
        lists = (g.params, g.grads, g.steps, *(g.state[k] for k in names))
        masters = (
            None if g.masters is None else tuple([None if m is None else m.data_ptr() for m in g.masters])
        )
        key += [
            (g.hyper, bool(g.maximize), names, tuple(map(len, lists))),
            tuple(map(_DTYPE, g.params)),
            tuple(map(torch.Tensor.numel, g.params)),
            masters,
            tuple(map(ptr, chain.from_iterable(lists))),
        ]
    return tuple(key)


def _launch_shape(max_numel: int) -> tuple[int, int]:
    """(BLOCK, TILES) of a bucket: 1024 x 4 elements per program, less for small tensors."""
    block = min(BLOCK, max(128, triton.next_power_of_2(max_numel)))
    return block, min(TILES, triton.cdiv(max_numel, block))


def _num_warps(block: int, aligned: bool) -> int:
    """Warps per program: 4, or 8 for an unaligned bucket of 1024-element blocks. Its loads
    take one element each, each at its own address; at 8 elements a thread (4 warps) the
    sm_90 builds of lamb_moments_kernel used 168 registers (compile_check.py)."""
    return 8 if block >= 1024 and not aligned else 4


def _upload(tables: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """int64 host tables as views of one buffer on ``device``; returns (its host source,
    the views). One asynchronous copy: on CUDA from pinned memory, so the host does not
    wait (the source must live until the copy is done: the plan keeps it); on the CPU the
    views are of the host buffer itself. Each table starts 16-byte aligned."""
    offsets, at = [], 0
    for t in tables:
        offsets.append(at)
        at += t.numel() + t.numel() % 2
    host = torch.empty(at, dtype=torch.int64, pin_memory=device.type == "cuda")
    for t, o in zip(tables, offsets):
        host[o : o + t.numel()] = t.reshape(-1)
    buffer = host.to(device, non_blocking=True)
    return host, [buffer[o : o + t.numel()].view(t.shape) for t, o in zip(tables, offsets)]


def _build(spec: OptimizerSpec, groups: list[FusedGroup], counter: torch.Tensor | None) -> Plan:
    device = groups[0].params[0].device
    for i, g in enumerate(groups):
        _check_group(i, g, spec.state, device)
        check_fused(g.hyper, i)
    if counter is not None:
        _check_scalar("counter", counter, device)
    rows: dict[tuple, list[list[int]]] = {}  # (param dtype, has masters) -> meta rows
    for gi, g in enumerate(groups):
        for j, p in enumerate(g.params):
            m = _master(g, j)
            s = [g.state[k][j].data_ptr() for k in spec.state] + [0] * (2 - len(spec.state))
            row = [(p if m is None else m).data_ptr(), g.grads[j].data_ptr(), p.data_ptr(), *s]
            row += [g.steps[j].data_ptr(), p.numel(), gi]  # COL_PART is added below
            rows.setdefault((p.dtype, m is not None), []).append(row)

    # Every table is formed on the host from Python numbers (nothing here reads a device
    # value), then all go to the device in one asynchronous copy (_upload). Chunks take
    # slots of the partial-sums table in (bucket, tensor, chunk) order.
    n_tensors = sum(len(r) for r in rows.values())
    ws = torch.zeros(WS_HEAD + 2 * n_tensors, dtype=torch.float64, device=device)
    launches: list[tuple] = []  # per bucket: acc, programs, has_master, consts
    tables: list[torch.Tensor] = []  # per bucket: chunks, meta; then hyper, steps, spans
    spans: list[tuple[int, int]] = []  # per tensor: (first slot, slot count)
    offset, slots = WS_HEAD, 0
    for (dtype, has_master), meta_rows in rows.items():
        n = len(meta_rows)
        acc, offset = ws[offset : offset + 2 * n], offset + 2 * n
        numels = [r[COL_NUMEL.value] for r in meta_rows]
        if max(numels) == 0:  # only zero-size tensors: nothing to launch, sums of nothing
            spans += [(slots, 0)] * n
            continue
        block, tiles = _launch_shape(max(numels))
        counts = [triton.cdiv(x, block * tiles) for x in numels]
        n_chunks = sum(counts)
        for r, c in zip(meta_rows, counts):
            r.append(slots)  # the COL_PART column
            spans.append((slots, c))
            slots += c
        repeats = torch.tensor(counts, dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(n), repeats, output_size=n_chunks)
        tensor_first_chunk = torch.repeat_interleave(
            repeats.cumsum(0) - repeats, repeats, output_size=n_chunks
        )
        first = torch.arange(n_chunks) - tensor_first_chunk  # chunk index within its tensor
        tables += [torch.stack([tensor, first], dim=1), torch.tensor(meta_rows, dtype=torch.int64)]
        aligned = all(a % 16 == 0 for r in meta_rows for a in r[: COL_STEP.value])
        launches.append(
            (
                acc,
                n_chunks,
                has_master,
                dict(
                    P_DTYPE=_TL_DTYPES[dtype],
                    W_DTYPE=tl.float32 if has_master else _TL_DTYPES[dtype],
                    ALIGNED=aligned,
                    BLOCK=block,
                    TILES=tiles,
                    num_warps=_num_warps(block, aligned),
                ),
            )
        )

    hyper = [_row(g) for g in groups]
    # Every distinct counter once (tensors may share one), then the optimizer-wide counter.
    steps = [x.data_ptr() for g in groups for x in g.steps]
    steps = list(dict.fromkeys(steps + ([] if counter is None else [counter.data_ptr()])))
    decayed = "decayed_norm" in spec.columns and any(row[spec.columns.index("decayed_norm")] for row in hyper)
    tables += [
        torch.tensor(hyper, dtype=torch.float64).view(torch.int64),
        torch.tensor(steps, dtype=torch.int64),
        torch.tensor(spans + [(0, slots)], dtype=torch.int64),
    ]
    source, views = _upload(tables, device)
    buckets = [
        _Bucket(chunks=chunks, meta=meta, acc=acc, grid=(n_chunks,), has_master=has_master, consts=consts)
        for (acc, n_chunks, has_master, consts), chunks, meta in zip(launches, views[0:-3:2], views[1:-3:2])
    ]
    # Every slot is written by its chunk's program before any sum reads it.
    parts = torch.empty(max(1, slots), 2, dtype=torch.float64, device=device)
    return Plan(
        buckets,
        views[-3].view(torch.float64),
        ws,
        parts=parts,
        spans=views[-1][:-1],
        every_slot=views[-1][-1:],
        steps=views[-2],
        decayed=decayed,
        sources={"tables": source},
    )


def _row(group: FusedGroup) -> tuple[float, ...]:
    """A group's row of the kernels' fp64 table: its spec's columns (``hyper.row``), then
    the sign its grads take (-1 under ``maximize``), which multiplies the unscaling
    factor: exact, so an ascending step has the bits of a descending one on ``-grad``."""
    return (*group.hyper.row, -1.0 if group.maximize else 1.0)


def set_lrs(plan: Plan, lrs: list[torch.Tensor]) -> None:
    """Point the plan at its groups' lr tensors, one per group in order (a no-op while
    they stay)."""
    addresses = tuple([lr.data_ptr() for lr in lrs])
    if addresses == plan.lrs:
        return
    for i, lr in enumerate(lrs):
        _check_scalar(f"group {i}: lr", lr, plan.ws.device)
    source, (plan.gaddr,) = _upload([torch.tensor(addresses, dtype=torch.int64)], plan.ws.device)
    plan.sources["lrs"] = source
    plan.lrs = addresses


def plan_for(spec: OptimizerSpec, groups: list[FusedGroup], counter: torch.Tensor | None) -> Plan | None:
    """The plan for these groups, from the cache or built (its tables keyed by every
    tensor's address, dtype and size, and the groups' hyperparameters), pointed at their
    lr tensors; None when no group has params."""
    groups = [g for g in groups if g.params]
    if not groups:
        return None
    key = _key(spec, groups, counter)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _build(spec, groups, counter)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    set_lrs(plan, [g.lr for g in groups])
    return plan


def _scalars(plan: Plan, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> tuple:
    """Pointer arguments for the optional device scalars, and their flags.

    An absent one is replaced by the workspace: a valid pointer the kernels never read.
    """
    for name, x in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if x is not None and (x.dtype != torch.float32 or x.device != plan.ws.device):
            raise ValueError(f"{name} must be fp32 on {plan.ws.device}: {_describe(x)}")
    has = dict(HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None)
    scale = plan.ws if grad_scale is None else grad_scale
    return scale, plan.ws if found_inf is None else found_inf, has


def _finish(plan: Plan, found_inf: torch.Tensor, has_found_inf: bool, *, every_slot: bool = False) -> None:
    """One launch of finish_kernel: each tensor's sums from its chunks' partial sums
    (the pass's acc), the step counted after them; with ``every_slot``, the global sums
    of all chunks (ws[:WS_HEAD]) and nothing counted."""
    if every_slot:
        finish_kernel[(1,)](
            plan.parts,
            plan.every_slot,
            plan.ws,
            1,
            plan.steps,
            0,
            found_inf,
            HAS_FOUND_INF=False,
            STEPS_BLOCK=1,
        )
        return
    n_spans, n = len(plan.spans), len(plan.steps)
    block = min(BLOCK, triton.next_power_of_2(n))
    finish_kernel[(n_spans + triton.cdiv(n, block),)](
        plan.parts,
        plan.spans,
        plan.ws[WS_HEAD:],
        n_spans,
        plan.steps,
        n,
        found_inf,
        HAS_FOUND_INF=has_found_inf,
        STEPS_BLOCK=block,
    )


# ----------------------------------------------------------------------------- entry points and launches


def fused_lars_step_(
    groups: list[FusedGroup],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
    reduce_norms: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One LARS step on every group, in place (docs/design.md §3: semantics and launches)."""
    plan = plan_for(LARS_SPEC, groups, counter)
    if plan is not None:
        launch_lars(plan, grad_scale=grad_scale, found_inf=found_inf, reduce_norms=reduce_norms)


def fused_lamb_step_(
    groups: list[FusedGroup],
    *,
    max_grad_norm: float | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
    reduce_norms: Callable[[torch.Tensor], None] | None = None,
    reduce_global: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One LAMB step on every group, in place (docs/design.md §3: semantics and launches)."""
    plan = plan_for(LAMB_SPEC, groups, counter)
    if plan is not None:
        launch_lamb(
            plan,
            max_grad_norm=max_grad_norm,
            grad_scale=grad_scale,
            found_inf=found_inf,
            reduce_norms=reduce_norms,
            reduce_global=reduce_global,
        )


def launch_lars(
    plan: Plan,
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    reduce_norms: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One LARS step on ``plan``'s tensors: its kernels' launches, nothing read per tensor."""
    scale, inf, has = _scalars(plan, grad_scale, found_inf)
    for b in plan.buckets:
        if plan.decayed:  # some group's decayed_norm: ||g + wd * w||^2 for its tensors
            lars_norms_kernel[b.grid](
                b.chunks,
                b.meta,
                plan.parts,
                plan.hyper,
                scale,
                inf,
                **has,
                **b.consts,
            )
            continue
        grad_check_kernel[b.grid](
            b.chunks,
            b.meta,
            plan.parts,
            scale,
            inf,
            W_SQ=True,
            **has,
            **b.consts,
        )
    _finish(plan, inf, has["HAS_FOUND_INF"])
    if reduce_norms is not None:
        reduce_norms(plan.ws[WS_HEAD:])
    for b in plan.buckets:
        lars_apply_kernel[b.grid](
            b.chunks,
            b.meta,
            b.acc,
            plan.hyper,
            plan.gaddr,
            scale,
            inf,
            HAS_MASTER=b.has_master,
            **has,
            **b.consts,
        )


def launch_lamb(
    plan: Plan,
    *,
    max_grad_norm: float | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    reduce_norms: Callable[[torch.Tensor], None] | None = None,
    reduce_global: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One LAMB step on ``plan``'s tensors: its kernels' launches, nothing read per tensor."""
    scale, inf, has = _scalars(plan, grad_scale, found_inf)
    clip = max_grad_norm is not None
    if clip:  # the global grad norm must be complete before any moment is formed
        for b in plan.buckets:
            grad_check_kernel[b.grid](
                b.chunks,
                b.meta,
                plan.parts,
                scale,
                inf,
                W_SQ=False,
                **has,
                **b.consts,
            )
        _finish(plan, inf, False, every_slot=True)
        if reduce_global is not None:
            reduce_global(plan.ws[GSQ : GSQ + 1])
    for b in plan.buckets:
        lamb_moments_kernel[b.grid](
            b.chunks,
            b.meta,
            plan.parts,
            plan.ws,
            plan.hyper,
            scale,
            inf,
            float(max_grad_norm) if max_grad_norm is not None else 1.0,
            CLIP=clip,
            **has,
            **b.consts,
        )
    _finish(plan, inf, has["HAS_FOUND_INF"])  # pass 2 reads the counted steps
    if reduce_norms is not None:
        reduce_norms(plan.ws[WS_HEAD:])
    for b in plan.buckets:
        lamb_apply_kernel[b.grid](
            b.chunks,
            b.meta,
            b.acc,
            plan.hyper,
            plan.gaddr,
            inf,
            HAS_MASTER=b.has_master,
            HAS_FOUND_INF=has["HAS_FOUND_INF"],
            **b.consts,
        )
