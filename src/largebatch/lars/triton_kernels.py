"""Fused multi-tensor Triton kernels for LARS and LAMB: the engine of the torch fused path.

The update rules are those of ``largebatch.lars.reference`` (DESIGN §2); this module
only changes where they run. A whole model's step is a constant number of launches,
whatever its tensor count.

Host API
--------
``FusedGroup``: one optimizer param group, already filtered to params with grads::

    params   list[Tensor]    fp32 / fp16 / bf16 model params, updated in place
    grads    list[Tensor]    same dtypes as params; never written
    masters  list[Tensor | None] | None
                             fp32 master copies of the params: the math then runs on the
                             master and the param is rewritten as its cast. None (for the
                             list or one entry): no master, the math runs on the param
    state    dict[str, list[Tensor]]
                             LARS {"momentum_buffer"}, LAMB {"exp_avg", "exp_avg_sq"};
                             fp32 for a param with a master, else the param dtype
    step     Tensor          fp32 0-dim: steps taken so far; +1 on the device unless skipped
    lr       Tensor          fp32 0-dim; read by the kernels, so a schedule may change it
    hyper    dict            python numbers; LARS: momentum, weight_decay,
                             trust_coefficient, eps, nesterov, trust_clip, trust_ratio;
                             LAMB: beta1, beta2, eps, weight_decay, bias_correction,
                             trust_ratio. Missing keys take the DESIGN §2 defaults.

``fused_lars_step_(groups, *, grad_scale=None, found_inf=None)`` and
``fused_lamb_step_(groups, *, max_grad_norm=None, grad_scale=None, found_inf=None)``
take one step on every group. ``grad_scale`` (fp32 device tensor) divides every grad
first; ``max_grad_norm`` (LAMB) divides all grads by ``max(1, ||all grads|| /
max_grad_norm)`` over every group. If ``found_inf`` (fp32 device tensor, as set by
``torch.amp.GradScaler``) is nonzero, or any unscaled grad element in any group is inf
or NaN, the step changes nothing: params, masters, state and step stay bitwise as they
were. That is decided on the device; nothing here reads a device value on the host.

Kernels and launches
--------------------
Tensors are bucketed by (param dtype, masters or not). Per bucket a ``meta`` table
holds each tensor's addresses (int64 ``data_ptr``), size and group, and a ``chunks``
table maps each program to (tensor, first element) of its chunk: BLOCK * TILES = 4096
elements, fewer when every tensor of the bucket is smaller. Small per-group tables hold
the hyperparameters (fp64, for an accurate 1 - beta**t) and the addresses of ``lr``
and ``step``. Norms accumulate in fp32 with ``tl.atomic_add`` into one workspace, which
also holds the skip flag and LAMB's global grad sum of squares. Full chunks run
without effective masks and, when every address of the bucket is 16-byte aligned, with
16-byte loads and stores; only each tensor's last chunk is masked.

    LARS  pass 1 _grad_check_kernel   ||w||^2, ||g||^2 per tensor; inf/NaN -> skip flag
          pass 2 _lars_apply_kernel   trust ratio, momentum, w (and param from master)
    LAMB  pass 1 _grad_check_kernel   inf/NaN -> skip flag; ||g||^2 of all groups (clipping)
          pass 2 _lamb_moments_kernel new m, v; ||w||^2, ||u||^2 per tensor
          pass 3 _lamb_apply_kernel   u again from the stored m, v; trust ratio; w

Every bucket's pass k runs before any bucket's pass k + 1, because the skip flag and
the global norm span all buckets. Launches per step: one workspace memset, 2 (LARS) or
3 (LAMB) per bucket, and one ``_count_step_kernel`` (an fp32 model: 4 or 5; fp16 params
with masters plus fp32 norm layers: 6 or 8). Shapes and addresses are fixed and nothing
syncs, so the step can be captured in a CUDA graph once its plan exists.

Bytes moved per param, pass by pass (the roofline's numerator)::

    params                          LARS            LAMB
    fp32                            8 + 20 = 28     4 + 24 + 16 = 44
    fp16 / bf16, fp32 masters       6 + 20 = 26     2 + 22 + 18 = 42
    fp16 / bf16, state in that type 4 + 10 = 14     2 + 12 +  8 = 22

LAMB's pass 1 is the price of the overflow check, which must finish before any moment
is written. Pass 3 recomputes u from w, m and v; storing u in pass 2 and reading it
back would move as many bytes and need a model-sized buffer. fp16 state without
masters is a poor fit for LAMB: exp_avg_sq = (1 - beta2) g^2 underflows fp16 for
small grads.

Plan cache: the tables and the workspace are built once per distinct content (device,
and every tensor address, size, dtype and hyperparameter of the call) and kept in a
small LRU cache, so a changed tensor, a new grad allocation or a new hyperparameter
builds a new plan (a few small host-to-device copies) and nothing needs invalidating by
hand. Grads freed by ``zero_grad(set_to_none=True)`` usually come back at the same
addresses, and then the plan is reused. Changing ``lr`` or ``step`` values is free;
new ``lr`` or ``step`` tensors cost one small copy of their address table. Keep one
``lr`` tensor per group and update it in place: that is also what a CUDA graph needs.

Limits: all tensors of a call on one device; each tensor's grad, master and state
share its strides and are dense (contiguous in some memory format); ``step`` counts
exactly up to 2**24 (an fp32 counter, as in torch.optim).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["FusedGroup", "fused_lars_step_", "fused_lamb_step_"]

BLOCK = 1024  # elements a program handles at once (at most)
TILES = 4  # blocks per program (at most): a chunk is BLOCK * TILES elements

# Columns of the int64 per-tensor table.
_W = tl.constexpr(0)  # weights the math runs on: the master, else the param
_G = tl.constexpr(1)  # grad
_P = tl.constexpr(2)  # param, rewritten from the master (masters only)
_S0 = tl.constexpr(3)  # momentum_buffer (LARS) / exp_avg (LAMB)
_S1 = tl.constexpr(4)  # exp_avg_sq (LAMB)
_NUMEL = tl.constexpr(5)
_GROUP = tl.constexpr(6)
_META_COLS = tl.constexpr(7)
# Workspace slots before the per-tensor sums of squares.
_FLAG = tl.constexpr(0)  # nonzero: some unscaled grad is inf/NaN, skip the step
_GSQ = tl.constexpr(1)  # LAMB: sum of squares of all unscaled grads
_WS_HEAD = 2

LARS_DEFAULTS = dict(
    momentum=0.9,
    weight_decay=0.0,
    trust_coefficient=0.001,
    eps=0.0,
    nesterov=False,
    trust_clip=False,
    trust_ratio=True,
)
LAMB_DEFAULTS = dict(
    beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, bias_correction=True, trust_ratio=True
)
# Columns of the fp64 per-group tables: the keys of the defaults, in their order.
_LARS_HYPER = tl.constexpr(len(LARS_DEFAULTS))
_LAMB_HYPER = tl.constexpr(len(LAMB_DEFAULTS))


# ----------------------------------------------------------------------------- kernels
# Every kernel gets one CHUNK = BLOCK * TILES elements of one tensor. A full chunk calls
# its tile loop with limit = start + CHUNK: masks the compiler sees are all true, so with
# ALIGNED addresses loads and stores become 16-byte accesses. The tail chunk of each
# tensor calls it with limit = numel. A skipped step has numel 0: nothing moves.


@triton.jit
def _tensor_ptr(row, col, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The typed pointer stored at ``row[col]`` of the meta table (16-byte aligned if ALIGNED)."""
    ptr = tl.load(row + col).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _chunk(chunks, meta, ws, found_inf, HAS_FOUND_INF: tl.constexpr, CHUNK: tl.constexpr):
    """This program's tensor index, its meta row, first element and element count.

    The count is 0 when the step is skipped (the kernels' flag or GradScaler's found_inf).
    In pass 1 the flag may rise while programs run; those that see it skip work whose
    results the skipped step never uses.
    """
    c = tl.program_id(0)
    t = tl.load(chunks + 2 * c)
    start = tl.multiple_of(tl.load(chunks + 2 * c + 1), CHUNK)
    row = meta + t * _META_COLS
    live = tl.load(ws + _FLAG) == 0
    if HAS_FOUND_INF:
        live = live & (tl.load(found_inf) == 0)
    return t, row, start, tl.where(live, tl.load(row + _NUMEL), 0)


@triton.jit
def _unscale(grad_scale, HAS_SCALE: tl.constexpr):
    """The factor that unscales grads: 1 / grad_scale (a reciprocal, as GradScaler does)."""
    if HAS_SCALE:
        inv = 1.0 / tl.load(grad_scale).to(tl.float32)
    else:
        inv = tl.full((), 1.0, tl.float32)
    return inv


@triton.jit
def _one_minus_pow(b, e):
    """1 - b**e for a fp64 scalar b and an int32 e >= 0, by binary powers in fp64.

    In fp32, 1 - 0.999**t would keep only a few digits of the bias correction.
    """
    p = b * 0.0 + 1.0
    while e > 0:
        p = tl.where((e & 1) != 0, p * b, p)
        b = b * b
        e = e >> 1
    return (1.0 - p).to(tl.float32)


@triton.jit
def _lamb_direction(w, m, v, inv_bc1, inv_bc2, eps, wd):
    """u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w, in fp32; shared by passes 2 and 3."""
    return (m * inv_bc1) / (tl.sqrt(v * inv_bc2) + eps) + wd * w


@triton.jit
def _check_tiles(
    w_ptr, g_ptr, start, limit, inv_scale,
    W_SQ: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Sums of w^2 and of unscaled g^2 over a chunk, and its count of inf/NaN grads."""
    w_sq = tl.zeros([BLOCK], dtype=tl.float32)
    g_sq = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
        bad += ((g != g) | (tl.abs(g) == float("inf"))).to(tl.int32)
        g_sq += g * g
        if W_SQ:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w_sq += w * w
    return tl.sum(w_sq, axis=0), tl.sum(g_sq, axis=0), tl.sum(bad, axis=0)


@triton.jit
def _grad_check_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, first element) of each program's chunk
    meta,  # int64 [n_tensors, _META_COLS]: addresses, numel and group of each tensor
    acc,  # fp32 [n_tensors, 2]: this bucket's sums of squares (w^2, g^2), atomically added
    ws,  # fp32 workspace: [_FLAG] skip flag, [_GSQ] sum of squares of all grads
    grad_scale,  # fp32 []: loss scale the grads carry (read only if HAS_SCALE)
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    P_DTYPE: tl.constexpr,  # dtype of params and grads
    W_DTYPE: tl.constexpr,  # dtype of the weights the math runs on (fp32 with masters)
    W_SQ: tl.constexpr,  # add ||w||^2 per tensor to acc[:, 0] (LARS)
    G_SQ: tl.constexpr,  # add ||g||^2 per tensor to acc[:, 1] (LARS)
    GLOBAL_SQ: tl.constexpr,  # add ||g||^2 to ws[_GSQ] (LAMB with max_grad_norm)
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address is 16-byte aligned
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """Pass 1: sums of squares of the unscaled grads (and weights), and the inf/NaN check."""
    t, row, start, numel = _chunk(chunks, meta, ws, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    g_ptr = _tensor_ptr(row, _G, P_DTYPE, ALIGNED)
    inv_scale = _unscale(grad_scale, HAS_SCALE)
    end = start + BLOCK * TILES
    if end <= numel:
        w_sq, g_sq, bad = _check_tiles(w_ptr, g_ptr, start, end, inv_scale, W_SQ, BLOCK, TILES)
    else:
        w_sq, g_sq, bad = _check_tiles(w_ptr, g_ptr, start, numel, inv_scale, W_SQ, BLOCK, TILES)
    tl.store(ws + _FLAG, 1.0, mask=bad > 0)
    if W_SQ:
        tl.atomic_add(acc + 2 * t, w_sq)
    if G_SQ:
        tl.atomic_add(acc + 2 * t + 1, g_sq)
    if GLOBAL_SQ:
        tl.atomic_add(ws + _GSQ, g_sq)


@triton.jit
def _lars_tiles(
    w_ptr, g_ptr, p_ptr, v_ptr, start, limit, inv_scale, rate, wd, momentum, nesterov,
    W_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
    BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """LARS on elements [start, limit) of a chunk: v and w (and the param) written."""
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        update = rate * (g + wd * w)
        v = momentum * v + update
        w = w - tl.where(nesterov, momentum * v + update, v)
        tl.store(v_ptr + offs, v.to(W_DTYPE), mask=mask)
        tl.store(w_ptr + offs, w.to(W_DTYPE), mask=mask)
        if HAS_MASTER:
            tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


@triton.jit
def _lars_apply_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, first element) of each program's chunk
    meta,  # int64 [n_tensors, _META_COLS]: addresses, numel and group of each tensor
    acc,  # fp32 [n_tensors, 2]: ||w||^2, ||g||^2 from pass 1
    ws,  # fp32 workspace: [_FLAG] skip flag
    hyper,  # fp64 [n_groups, 7]: momentum, wd, tc, eps, nesterov, trust_clip, trust_ratio
    gaddr,  # int64 [n_groups, 2]: addresses of each group's lr and step (fp32 scalars)
    grad_scale,  # fp32 []: loss scale (read only if HAS_SCALE)
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    P_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,  # also write params = masters cast to P_DTYPE
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """Pass 2 of LARS: v = momentum * v + lr * ratio * (g + wd * w); w -= v (or nesterov)."""
    t, row, start, numel = _chunk(chunks, meta, ws, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    g_ptr = _tensor_ptr(row, _G, P_DTYPE, ALIGNED)
    p_ptr = _tensor_ptr(row, _P, P_DTYPE, ALIGNED)
    v_ptr = _tensor_ptr(row, _S0, W_DTYPE, ALIGNED)
    group = tl.load(row + _GROUP)
    h = hyper + group * _LARS_HYPER
    momentum = tl.load(h + 0).to(tl.float32)
    wd = tl.load(h + 1).to(tl.float32)
    tc = tl.load(h + 2).to(tl.float32)
    eps = tl.load(h + 3).to(tl.float32)
    nesterov = tl.load(h + 4) != 0
    trust_clip = tl.load(h + 5) != 0
    adapt = tl.load(h + 6) != 0
    lr = tl.load(tl.load(gaddr + 2 * group).to(tl.pointer_type(tl.float32)))
    inv_scale = _unscale(grad_scale, HAS_SCALE)

    w_norm = tl.sqrt(tl.load(acc + 2 * t))
    g_norm = tl.sqrt(tl.load(acc + 2 * t + 1))
    nonzero = (w_norm > 0) & (g_norm > 0)
    ratio = tl.where(nonzero, tc * w_norm / tl.where(nonzero, g_norm + wd * w_norm + eps, 1.0), 1.0)
    ratio = tl.where(trust_clip, tl.minimum(ratio / lr, 1.0), ratio)
    rate = lr * tl.where(adapt, ratio, 1.0)

    end = start + BLOCK * TILES
    if end <= numel:
        _lars_tiles(
            w_ptr, g_ptr, p_ptr, v_ptr, start, end, inv_scale, rate, wd, momentum, nesterov,
            W_DTYPE, P_DTYPE, HAS_MASTER, BLOCK, TILES,
        )  # fmt: skip
    else:
        _lars_tiles(
            w_ptr, g_ptr, p_ptr, v_ptr, start, numel, inv_scale, rate, wd, momentum, nesterov,
            W_DTYPE, P_DTYPE, HAS_MASTER, BLOCK, TILES,
        )  # fmt: skip


@triton.jit
def _lamb_factors(hyper, gaddr, group):
    """A group's LAMB scalars: b1, b2 (fp64), eps, wd, 1 / bias corrections, trust_ratio flag."""
    h = hyper + group * _LAMB_HYPER
    b1 = tl.load(h + 0)
    b2 = tl.load(h + 1)
    eps = tl.load(h + 2).to(tl.float32)
    wd = tl.load(h + 3).to(tl.float32)
    corrected = tl.load(h + 4) != 0
    adapt = tl.load(h + 5) != 0
    step = tl.load(tl.load(gaddr + 2 * group + 1).to(tl.pointer_type(tl.float32)))
    e = step.to(tl.int32) + 1  # this is step t = step + 1
    inv_bc1 = tl.where(corrected, 1.0 / _one_minus_pow(b1, e), 1.0)
    inv_bc2 = tl.where(corrected, 1.0 / _one_minus_pow(b2, e), 1.0)
    return b1, b2, eps, wd, inv_bc1, inv_bc2, adapt


@triton.jit
def _moment_tiles(
    w_ptr, g_ptr, m_ptr, v_ptr, start, limit, g_mul, b1, b2, inv_bc1, inv_bc2, eps, wd,
    W_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """New m, v on elements [start, limit) of a chunk, stored; sums of w^2 and u^2."""
    one_b1 = (1.0 - b1).to(tl.float32)  # 1 - b in fp64, then fp32
    one_b2 = (1.0 - b2).to(tl.float32)
    b1 = b1.to(tl.float32)
    b2 = b2.to(tl.float32)
    w_sq = tl.zeros([BLOCK], dtype=tl.float32)
    u_sq = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * g_mul
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Round to the stored dtype first, so that pass 3 recomputes exactly this u.
        m = (b1 * m + one_b1 * g).to(W_DTYPE)
        v = (b2 * v + one_b2 * g * g).to(W_DTYPE)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        u = _lamb_direction(w, m.to(tl.float32), v.to(tl.float32), inv_bc1, inv_bc2, eps, wd)
        w_sq += w * w
        u_sq += tl.where(mask, u * u, 0.0)  # masked lanes: 0 / eps, or 0 / 0 when eps = 0
    return tl.sum(w_sq, axis=0), tl.sum(u_sq, axis=0)


@triton.jit
def _lamb_moments_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, first element) of each program's chunk
    meta,  # int64 [n_tensors, _META_COLS]: addresses, numel and group of each tensor
    acc,  # fp32 [n_tensors, 2]: ||w||^2, ||u||^2 per tensor, atomically added
    ws,  # fp32 workspace: [_FLAG] skip flag, [_GSQ] sum of squares of all grads
    hyper,  # fp64 [n_groups, 6]: beta1, beta2, eps, wd, bias_correction, trust_ratio
    gaddr,  # int64 [n_groups, 2]: addresses of each group's lr and step (fp32 scalars)
    grad_scale,  # fp32 []: loss scale (read only if HAS_SCALE)
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    max_grad_norm,  # float: global clipping threshold (used only if CLIP)
    P_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr,
    CLIP: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """Pass 2 of LAMB: m, v updated and stored; ||w||^2 and ||u||^2 per tensor."""
    t, row, start, numel = _chunk(chunks, meta, ws, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    g_ptr = _tensor_ptr(row, _G, P_DTYPE, ALIGNED)
    m_ptr = _tensor_ptr(row, _S0, W_DTYPE, ALIGNED)
    v_ptr = _tensor_ptr(row, _S1, W_DTYPE, ALIGNED)
    b1, b2, eps, wd, inv_bc1, inv_bc2, _ = _lamb_factors(hyper, gaddr, tl.load(row + _GROUP))
    g_mul = _unscale(grad_scale, HAS_SCALE)
    if CLIP:
        # A Python float may come in as fp64 (Inductor passes fp64 scalars): the math is fp32.
        clip_norm = tl.cast(max_grad_norm, tl.float32)
        g_mul = g_mul / tl.maximum(tl.sqrt(tl.load(ws + _GSQ)) / clip_norm, 1.0)

    end = start + BLOCK * TILES
    if end <= numel:
        w_sq, u_sq = _moment_tiles(
            w_ptr, g_ptr, m_ptr, v_ptr, start, end, g_mul, b1, b2, inv_bc1, inv_bc2, eps, wd,
            W_DTYPE, P_DTYPE, BLOCK, TILES,
        )  # fmt: skip
    else:
        w_sq, u_sq = _moment_tiles(
            w_ptr, g_ptr, m_ptr, v_ptr, start, numel, g_mul, b1, b2, inv_bc1, inv_bc2, eps, wd,
            W_DTYPE, P_DTYPE, BLOCK, TILES,
        )  # fmt: skip
    tl.atomic_add(acc + 2 * t, w_sq)
    tl.atomic_add(acc + 2 * t + 1, u_sq)


@triton.jit
def _lamb_tiles(
    w_ptr, p_ptr, m_ptr, v_ptr, start, limit, rate, inv_bc1, inv_bc2, eps, wd,
    W_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
    BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """w -= rate * u on elements [start, limit) of a chunk (and the param rewritten)."""
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = w - rate * _lamb_direction(w, m, v, inv_bc1, inv_bc2, eps, wd)
        tl.store(w_ptr + offs, w.to(W_DTYPE), mask=mask)
        if HAS_MASTER:
            tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


@triton.jit
def _lamb_apply_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, first element) of each program's chunk
    meta,  # int64 [n_tensors, _META_COLS]: addresses, numel and group of each tensor
    acc,  # fp32 [n_tensors, 2]: ||w||^2, ||u||^2 from pass 2
    ws,  # fp32 workspace: [_FLAG] skip flag
    hyper,  # fp64 [n_groups, 6]: beta1, beta2, eps, wd, bias_correction, trust_ratio
    gaddr,  # int64 [n_groups, 2]: addresses of each group's lr and step (fp32 scalars)
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    P_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,  # also write params = masters cast to P_DTYPE
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """Pass 3 of LAMB: w -= lr * ratio * u, with u recomputed from the new m and v."""
    t, row, start, numel = _chunk(chunks, meta, ws, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    p_ptr = _tensor_ptr(row, _P, P_DTYPE, ALIGNED)
    m_ptr = _tensor_ptr(row, _S0, W_DTYPE, ALIGNED)
    v_ptr = _tensor_ptr(row, _S1, W_DTYPE, ALIGNED)
    group = tl.load(row + _GROUP)
    _, _, eps, wd, inv_bc1, inv_bc2, adapt = _lamb_factors(hyper, gaddr, group)
    lr = tl.load(tl.load(gaddr + 2 * group).to(tl.pointer_type(tl.float32)))

    w_norm = tl.sqrt(tl.load(acc + 2 * t))
    u_norm = tl.sqrt(tl.load(acc + 2 * t + 1))
    nonzero = (w_norm > 0) & (u_norm > 0) & adapt
    rate = lr * tl.where(nonzero, w_norm / tl.where(nonzero, u_norm, 1.0), 1.0)

    end = start + BLOCK * TILES
    if end <= numel:
        _lamb_tiles(
            w_ptr, p_ptr, m_ptr, v_ptr, start, end, rate, inv_bc1, inv_bc2, eps, wd,
            W_DTYPE, P_DTYPE, HAS_MASTER, BLOCK, TILES,
        )  # fmt: skip
    else:
        _lamb_tiles(
            w_ptr, p_ptr, m_ptr, v_ptr, start, numel, rate, inv_bc1, inv_bc2, eps, wd,
            W_DTYPE, P_DTYPE, HAS_MASTER, BLOCK, TILES,
        )  # fmt: skip


@triton.jit
def _count_step_kernel(
    steps,  # int64 [n_steps]: addresses of the distinct step counters (fp32 scalars)
    n_steps,  # int: their number
    ws,  # fp32 workspace: [_FLAG] skip flag
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,  # a power of two >= n_steps
):
    """step += 1 for every group, unless the step was skipped."""
    live = tl.load(ws + _FLAG) == 0
    if HAS_FOUND_INF:
        live = live & (tl.load(found_inf) == 0)
    i = tl.arange(0, BLOCK)
    mask = i < tl.where(live, n_steps, 0)
    ptrs = tl.load(steps + i, mask=mask, other=0).to(tl.pointer_type(tl.float32))
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + 1.0, mask=mask)


# ----------------------------------------------------------------------------- host side


@dataclass
class FusedGroup:
    """One param group for the fused step (see the module docstring for each field)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    masters: list[torch.Tensor | None] | None
    state: dict[str, list[torch.Tensor]]
    step: torch.Tensor
    lr: torch.Tensor
    hyper: dict


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


@dataclass
class _Bucket:
    """The tensors of one (param dtype, masters) kind: tables and launch shape."""

    chunks: torch.Tensor  # int64 [n_chunks, 2]
    meta: torch.Tensor  # int64 [n_tensors, _META_COLS]
    acc: torch.Tensor  # fp32 [n_tensors, 2], a view into the plan's workspace
    grid: tuple[int]  # one program per chunk
    has_master: bool
    consts: dict  # P_DTYPE, W_DTYPE, ALIGNED, BLOCK, TILES


@dataclass
class _Plan:
    buckets: list[_Bucket]
    hyper: torch.Tensor  # fp64 [n_groups, n_hyper]
    ws: torch.Tensor  # fp32 workspace: flag, global sum of squares, per-tensor sums
    gaddr: torch.Tensor | None = None  # int64 [n_groups, 2]: lr and step addresses
    steps: torch.Tensor | None = None  # int64 [n_steps]: distinct step addresses
    scalars: tuple = ()  # the (lr, step) addresses these two tables hold


_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()
_MAX_PLANS = 8


def _hyper_row(hyper: dict, defaults: dict) -> tuple[float, ...]:
    unknown = set(hyper) - set(defaults)
    if unknown:
        raise ValueError(f"Unknown hyperparameters {sorted(unknown)}; expected {list(defaults)}")
    h = {**defaults, **hyper}
    if not h["trust_ratio"]:
        h["weight_decay"] = 0.0  # excluded tensors: ratio 1 and no weight decay
    return tuple(float(h[k]) for k in defaults)


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}"


def _check_group(i: int, group: FusedGroup, state_names: tuple[str, ...], device) -> None:
    if set(group.state) != set(state_names):
        raise ValueError(f"group {i}: state must hold {state_names}, got {sorted(group.state)}")
    lists = {"grads": group.grads, "masters": group.masters or group.params, **group.state}
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
            if (x.dtype, x.shape, x.stride(), x.device) != (want, p.shape, p.stride(), device):
                raise ValueError(
                    f"group {i} {name}[{j}]: expected {want} like param {_describe(p)},"
                    f" got {_describe(x)}"
                )


def _master(group: FusedGroup, j: int) -> torch.Tensor | None:
    return None if group.masters is None else group.masters[j]


def _key(kind: str, groups: list[FusedGroup], defaults: dict) -> tuple:
    """What a plan's tensor tables depend on: device, addresses, sizes, dtypes, hyperparameters.

    lr and step addresses are left out: when those tensors change, only their small table
    is refreshed (see _set_scalars).
    """
    key = [kind, groups[0].params[0].device]
    for g in groups:
        names = tuple(g.state)
        key.append((_hyper_row(g.hyper, defaults), names))
        masters = [_master(g, j) for j in range(len(g.params))]
        for p, gr, m, *s in zip(g.params, g.grads, masters, *(g.state[k] for k in names)):
            m_ptr = None if m is None else m.data_ptr()
            addresses = (p.data_ptr(), gr.data_ptr(), m_ptr, *(x.data_ptr() for x in s))
            key.append((p.dtype, p.numel(), *addresses))
    return tuple(key)


def _launch_shape(max_numel: int) -> tuple[int, int]:
    """(BLOCK, TILES) of a bucket: 1024 x 4 elements per program, less for small tensors."""
    block = min(BLOCK, max(128, triton.next_power_of_2(max_numel)))
    return block, min(TILES, triton.cdiv(max_numel, block))


def _build(groups: list[FusedGroup], defaults: dict, state_names: tuple[str, ...]) -> _Plan:
    device = groups[0].params[0].device
    for i, g in enumerate(groups):
        _check_group(i, g, state_names, device)
    rows: dict[tuple, list[list[int]]] = {}  # (param dtype, has masters) -> meta rows
    for gi, g in enumerate(groups):
        for j, p in enumerate(g.params):
            m = _master(g, j)
            s = [g.state[k][j].data_ptr() for k in state_names] + [0] * (2 - len(state_names))
            row = [(p if m is None else m).data_ptr(), g.grads[j].data_ptr(), p.data_ptr(), *s]
            rows.setdefault((p.dtype, m is not None), []).append(row + [p.numel(), gi])

    n_tensors = sum(len(r) for r in rows.values())
    ws = torch.zeros(_WS_HEAD + 2 * n_tensors, dtype=torch.float32, device=device)
    buckets, offset = [], _WS_HEAD
    for (dtype, has_master), meta_rows in rows.items():
        n = len(meta_rows)
        acc, offset = ws[offset : offset + 2 * n], offset + 2 * n
        numel = torch.tensor([r[_NUMEL.value] for r in meta_rows], dtype=torch.int64)
        block, tiles = _launch_shape(int(numel.max()))
        counts = triton.cdiv(numel, block * tiles)
        if counts.sum() == 0:  # only zero-size tensors: nothing to launch
            continue
        tensor = torch.repeat_interleave(torch.arange(n), counts)
        tensor_first_chunk = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        first = torch.arange(len(tensor)) - tensor_first_chunk  # chunk index within its tensor
        consts = dict(
            P_DTYPE=_TL_DTYPES[dtype],
            W_DTYPE=tl.float32 if has_master else _TL_DTYPES[dtype],
            ALIGNED=all(a % 16 == 0 for r in meta_rows for a in r[: _NUMEL.value]),
            BLOCK=block,
            TILES=tiles,
        )
        buckets.append(
            _Bucket(
                chunks=torch.stack([tensor, first * block * tiles], dim=1).to(device),
                meta=torch.tensor(meta_rows, dtype=torch.int64, device=device),
                acc=acc,
                grid=(len(tensor),),
                has_master=has_master,
                consts=consts,
            )
        )

    hyper = [_hyper_row(g.hyper, defaults) for g in groups]
    return _Plan(buckets, torch.tensor(hyper, dtype=torch.float64, device=device), ws)


def _set_scalars(plan: _Plan, groups: list[FusedGroup]) -> None:
    """Point the plan at the groups' lr and step tensors (a no-op while they stay)."""
    scalars = tuple((g.lr.data_ptr(), g.step.data_ptr()) for g in groups)
    if scalars == plan.scalars:
        return
    device = plan.ws.device
    for i, g in enumerate(groups):
        for name, x in (("step", g.step), ("lr", g.lr)):
            if x.dtype != torch.float32 or x.numel() != 1 or x.device != device:
                raise ValueError(f"group {i}: {name} must be one fp32 on {device}: {_describe(x)}")
    steps = list(dict.fromkeys(step for _, step in scalars))  # a shared counter counts once
    plan.gaddr = torch.tensor(scalars, dtype=torch.int64, device=device)
    plan.steps = torch.tensor(steps, dtype=torch.int64, device=device)
    plan.scalars = scalars


def _plan(kind: str, groups: list[FusedGroup], defaults: dict, state_names: tuple[str, ...]):
    """The cached plan for these groups, or None when there is nothing to update."""
    groups = [g for g in groups if g.params]
    if not groups:
        return None
    key = _key(kind, groups, defaults)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _build(groups, defaults, state_names)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    _set_scalars(plan, groups)
    return plan


def _scalars(plan: _Plan, grad_scale, found_inf) -> tuple:
    """Pointer arguments for the optional device scalars, and their flags.

    An absent one is replaced by the workspace: a valid pointer the kernels never read.
    """
    for name, x in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if x is not None and (x.dtype != torch.float32 or x.device != plan.ws.device):
            raise ValueError(f"{name} must be fp32 on {plan.ws.device}: {_describe(x)}")
    has = dict(HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None)
    scale = plan.ws if grad_scale is None else grad_scale
    return scale, plan.ws if found_inf is None else found_inf, has


def _count_step(plan: _Plan, found_inf: torch.Tensor, has_found_inf: bool) -> None:
    n = len(plan.steps)
    _count_step_kernel[(1,)](
        plan.steps, n, plan.ws, found_inf, HAS_FOUND_INF=has_found_inf,
        BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip


def fused_lars_step_(
    groups: list[FusedGroup],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One LARS step on every group, in place (module docstring: semantics and launches)."""
    plan = _plan("lars", groups, LARS_DEFAULTS, ("momentum_buffer",))
    if plan is None:
        return
    scale, inf, has = _scalars(plan, grad_scale, found_inf)
    plan.ws.zero_()
    for b in plan.buckets:
        _grad_check_kernel[b.grid](
            b.chunks, b.meta, b.acc, plan.ws, scale, inf, W_SQ=True, G_SQ=True, GLOBAL_SQ=False,
            **has, **b.consts,
        )  # fmt: skip
    for b in plan.buckets:
        _lars_apply_kernel[b.grid](
            b.chunks, b.meta, b.acc, plan.ws, plan.hyper, plan.gaddr, scale, inf,
            HAS_MASTER=b.has_master, **has, **b.consts,
        )  # fmt: skip
    _count_step(plan, inf, has["HAS_FOUND_INF"])


def fused_lamb_step_(
    groups: list[FusedGroup],
    *,
    max_grad_norm: float | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One LAMB step on every group, in place (module docstring: semantics and launches)."""
    plan = _plan("lamb", groups, LAMB_DEFAULTS, ("exp_avg", "exp_avg_sq"))
    if plan is None:
        return
    scale, inf, has = _scalars(plan, grad_scale, found_inf)
    clip = max_grad_norm is not None
    plan.ws.zero_()
    for b in plan.buckets:
        _grad_check_kernel[b.grid](
            b.chunks, b.meta, b.acc, plan.ws, scale, inf, W_SQ=False, G_SQ=False, GLOBAL_SQ=clip,
            **has, **b.consts,
        )  # fmt: skip
    for b in plan.buckets:
        _lamb_moments_kernel[b.grid](
            b.chunks, b.meta, b.acc, plan.ws, plan.hyper, plan.gaddr, scale, inf,
            float(max_grad_norm) if clip else 1.0, CLIP=clip, **has, **b.consts,
        )  # fmt: skip
    for b in plan.buckets:
        _lamb_apply_kernel[b.grid](
            b.chunks, b.meta, b.acc, plan.ws, plan.hyper, plan.gaddr, inf,
            HAS_MASTER=b.has_master, HAS_FOUND_INF=has["HAS_FOUND_INF"], **b.consts,
        )  # fmt: skip
    _count_step(plan, inf, has["HAS_FOUND_INF"])
