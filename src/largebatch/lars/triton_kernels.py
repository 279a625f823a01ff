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
    steps    list[Tensor]    one fp32 0-dim count per param (params may share one): steps
                             it took so far; LAMB's bias correction uses its own count;
                             +1 on the device unless the step is skipped
    lr       Tensor          fp32 0-dim; read by the kernels, so a schedule may change it
    hyper    dict            python numbers; LARS: momentum, weight_decay,
                             trust_coefficient, eps, nesterov, trust_clip, trust_ratio;
                             LAMB: beta1, beta2, eps, weight_decay, bias_correction,
                             trust_ratio. Missing keys take the DESIGN §2 defaults.

``fused_lars_step_(groups, *, grad_scale=None, found_inf=None, counter=None)`` and
``fused_lamb_step_(groups, *, max_grad_norm=None, grad_scale=None, found_inf=None,
counter=None)`` take one step on every group. ``grad_scale`` (fp32 device tensor)
divides every grad first; ``max_grad_norm`` (LAMB) divides all grads by ``max(1, ||all
grads|| / max_grad_norm)`` over every group. If ``found_inf`` (fp32 device tensor, as set
by ``torch.amp.GradScaler``) is nonzero, the step changes nothing: params, masters,
state and steps stay bitwise as they were. That is decided on the device; nothing here
reads a device value on the host. Without ``found_inf`` an inf/NaN gradient is applied,
as in every other path and in torch.optim. ``counter`` (fp32 0-dim, optional) counts
the applied steps, like the per-param counts.

Kernels and launches
--------------------
Tensors are bucketed by (param dtype, masters or not). Per bucket a ``meta`` table
holds each tensor's addresses (int64 ``data_ptr``), size and group, and a ``chunks``
table maps each program to (tensor, first element) of its chunk: BLOCK * TILES = 4096
elements, fewer when every tensor of the bucket is smaller. Small per-group tables hold
the hyperparameters (fp64, for an accurate 1 - beta**t) and the address of ``lr``.
Sums of squares are formed and accumulated in fp64 (``tl.atomic_add``) in one
workspace, which also holds LAMB's global grad sum of squares: no finite weight or
gradient can overflow them (an fp32 sum of squares does above ||x|| ~ 1.8e19), and on a
memory-bound kernel the fp64 adds cost no time. Full chunks run
without effective masks and, when every address of the bucket is 16-byte aligned, with
16-byte loads and stores; only each tensor's last chunk is masked.

    LARS  pass 1 _grad_check_kernel   ||w||^2, ||g||^2 per tensor
          pass 2 _lars_apply_kernel   trust ratio, momentum, w (and param from master)
    LAMB (pass 0 _grad_check_kernel   ||g||^2 of all groups: only with max_grad_norm)
          pass 1 _lamb_moments_kernel new m, v; ||w||^2, ||u||^2 per tensor
          pass 2 _lamb_apply_kernel   u again from the stored m, v; trust ratio; w

Every bucket's pass k runs before any bucket's pass k + 1, because the global norm spans
all buckets. Launches per step: one workspace memset, 2 per bucket (LAMB with
max_grad_norm: 3), and one ``_count_step_kernel`` (an fp32 model: 4; fp16 params with
masters plus fp32 norm layers: 6). Shapes and addresses are fixed and nothing syncs, so
the step can be captured in a CUDA graph once its plan exists.

Bytes moved per param, pass by pass (the roofline's numerator; LAMB with max_grad_norm
adds the grad read of pass 0: 4 B for fp32 grads, 2 B for fp16/bf16)::

    params                          LARS            LAMB
    fp32                            8 + 20 = 28     24 + 16 = 40
    fp16 / bf16, fp32 masters       6 + 20 = 26     22 + 18 = 40
    fp16 / bf16, state in that type 4 + 10 = 14     12 +  8 = 20

Pass 0 exists because clipping needs the global norm before any moment is written.
Pass 2 recomputes u from w, m and v; storing u in pass 1 and reading it
back would move as many bytes and need a model-sized buffer. fp16 state without
masters is a poor fit for LAMB: exp_avg_sq = (1 - beta2) g^2 underflows fp16 for
small grads.

Plan cache: the tables and the workspace are built once per distinct content (device,
and every tensor address, size, dtype and hyperparameter of the call) and kept in a
small LRU cache, so a changed tensor, a new grad allocation or a new hyperparameter
builds a new plan (a few small host-to-device copies) and nothing needs invalidating by
hand. Grads freed by ``zero_grad(set_to_none=True)`` usually come back at the same
addresses, and then the plan is reused. Changing ``lr`` or step values is free; new
``lr`` tensors cost one small copy of their address table (new step tensors, a new
plan). Keep one ``lr`` tensor per group and update it in place: that is also what a
CUDA graph needs.

Limits: all tensors of a call on one device; each tensor's grad, master and state
share its strides and are dense (contiguous in some memory format); steps count
exactly up to 2**24 (fp32 counters, as in torch.optim).
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
_STEP = tl.constexpr(5)  # the tensor's step count (fp32 scalar)
_NUMEL = tl.constexpr(6)
_GROUP = tl.constexpr(7)
_META_COLS = tl.constexpr(8)
# Workspace slots before the per-tensor sums of squares.
_GSQ = tl.constexpr(0)  # LAMB: sum of squares of all unscaled grads
_WS_HEAD = 1

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
def _chunk(chunks, meta, found_inf, HAS_FOUND_INF: tl.constexpr, CHUNK: tl.constexpr):
    """This program's tensor index, its meta row, first element and element count.

    The count is 0 when GradScaler's found_inf skips the step.
    """
    c = tl.program_id(0)
    t = tl.load(chunks + 2 * c)
    start = tl.multiple_of(tl.load(chunks + 2 * c + 1), CHUNK)
    row = meta + t * _META_COLS
    numel = tl.load(row + _NUMEL)
    if HAS_FOUND_INF:
        numel = tl.where(tl.load(found_inf) == 0, numel, 0)
    return t, row, start, numel


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
    """Sums of w^2 and of unscaled g^2 over a chunk, squared and added in fp64."""
    w_sq = tl.zeros([BLOCK], dtype=tl.float64)
    g_sq = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        g = (tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale).to(tl.float64)
        g_sq += g * g
        if W_SQ:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float64)
            w_sq += w * w
    return tl.sum(w_sq, axis=0), tl.sum(g_sq, axis=0)


@triton.jit
def _grad_check_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, first element) of each program's chunk
    meta,  # int64 [n_tensors, _META_COLS]: addresses, numel and group of each tensor
    acc,  # fp64 [n_tensors, 2]: this bucket's sums of squares (w^2, g^2), atomically added
    ws,  # fp64 workspace: [_GSQ] sum of squares of all grads
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
    """Pass 1: sums of squares of the unscaled grads (and weights)."""
    t, row, start, numel = _chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    g_ptr = _tensor_ptr(row, _G, P_DTYPE, ALIGNED)
    inv_scale = _unscale(grad_scale, HAS_SCALE)
    end = start + BLOCK * TILES
    if end <= numel:
        w_sq, g_sq = _check_tiles(w_ptr, g_ptr, start, end, inv_scale, W_SQ, BLOCK, TILES)
    else:
        w_sq, g_sq = _check_tiles(w_ptr, g_ptr, start, numel, inv_scale, W_SQ, BLOCK, TILES)
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
    acc,  # fp64 [n_tensors, 2]: ||w||^2, ||g||^2 from pass 1
    hyper,  # fp64 [n_groups, 7]: momentum, wd, tc, eps, nesterov, trust_clip, trust_ratio
    gaddr,  # int64 [n_groups]: address of each group's lr (fp32 scalar)
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
    t, row, start, numel = _chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
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
    lr = tl.load(tl.load(gaddr + group).to(tl.pointer_type(tl.float32)))
    inv_scale = _unscale(grad_scale, HAS_SCALE)

    # The norms come in fp64 (no overflow for any finite weights); the ratio goes to fp32.
    w_norm = tl.sqrt(tl.load(acc + 2 * t))
    g_norm = tl.sqrt(tl.load(acc + 2 * t + 1))
    nonzero = (w_norm > 0) & (g_norm > 0)
    ratio = tl.where(nonzero, tc * w_norm / tl.where(nonzero, g_norm + wd * w_norm + eps, 1.0), 1.0)
    ratio = ratio.to(tl.float32)
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
def _lamb_factors(hyper, row, group):
    """A tensor's LAMB scalars: its group's b1, b2 (fp64), eps, wd and trust_ratio flag,
    and 1 / bias corrections at its own step count."""
    h = hyper + group * _LAMB_HYPER
    b1 = tl.load(h + 0)
    b2 = tl.load(h + 1)
    eps = tl.load(h + 2).to(tl.float32)
    wd = tl.load(h + 3).to(tl.float32)
    corrected = tl.load(h + 4) != 0
    adapt = tl.load(h + 5) != 0
    step = tl.load(tl.load(row + _STEP).to(tl.pointer_type(tl.float32)))
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
    w_sq = tl.zeros([BLOCK], dtype=tl.float64)
    u_sq = tl.zeros([BLOCK], dtype=tl.float64)
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
        w64 = w.to(tl.float64)
        u64 = tl.where(mask, u, 0.0).to(tl.float64)  # masked lanes: 0 / eps, or 0 / 0 when eps = 0
        w_sq += w64 * w64
        u_sq += u64 * u64
    return tl.sum(w_sq, axis=0), tl.sum(u_sq, axis=0)


@triton.jit
def _lamb_moments_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, first element) of each program's chunk
    meta,  # int64 [n_tensors, _META_COLS]: addresses, numel and group of each tensor
    acc,  # fp64 [n_tensors, 2]: ||w||^2, ||u||^2 per tensor, atomically added
    ws,  # fp64 workspace: [_GSQ] sum of squares of all grads
    hyper,  # fp64 [n_groups, 6]: beta1, beta2, eps, wd, bias_correction, trust_ratio
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
    t, row, start, numel = _chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    g_ptr = _tensor_ptr(row, _G, P_DTYPE, ALIGNED)
    m_ptr = _tensor_ptr(row, _S0, W_DTYPE, ALIGNED)
    v_ptr = _tensor_ptr(row, _S1, W_DTYPE, ALIGNED)
    b1, b2, eps, wd, inv_bc1, inv_bc2, _ = _lamb_factors(hyper, row, tl.load(row + _GROUP))
    g_mul = _unscale(grad_scale, HAS_SCALE)
    if CLIP:
        # A Python float may come in as fp64 (Inductor passes fp64 scalars): the math is fp32.
        clip_norm = tl.cast(max_grad_norm, tl.float32)
        over = tl.sqrt(tl.load(ws + _GSQ)).to(tl.float32) / clip_norm
        g_mul = g_mul / tl.where(over < 1.0, 1.0, over)  # a NaN norm stays NaN, as in torch.clamp

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
    acc,  # fp64 [n_tensors, 2]: ||w||^2, ||u||^2 from pass 2
    hyper,  # fp64 [n_groups, 6]: beta1, beta2, eps, wd, bias_correction, trust_ratio
    gaddr,  # int64 [n_groups]: address of each group's lr (fp32 scalar)
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
    t, row, start, numel = _chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    p_ptr = _tensor_ptr(row, _P, P_DTYPE, ALIGNED)
    m_ptr = _tensor_ptr(row, _S0, W_DTYPE, ALIGNED)
    v_ptr = _tensor_ptr(row, _S1, W_DTYPE, ALIGNED)
    group = tl.load(row + _GROUP)
    _, _, eps, wd, inv_bc1, inv_bc2, adapt = _lamb_factors(hyper, row, group)
    lr = tl.load(tl.load(gaddr + group).to(tl.pointer_type(tl.float32)))

    w_norm = tl.sqrt(tl.load(acc + 2 * t))
    u_norm = tl.sqrt(tl.load(acc + 2 * t + 1))
    nonzero = (w_norm > 0) & (u_norm > 0) & adapt
    rate = lr * tl.where(nonzero, w_norm / tl.where(nonzero, u_norm, 1.0), 1.0).to(tl.float32)

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
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,  # counters per program, a power of two
):
    """count += 1 for every counter of this program's block, unless the step is skipped."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    limit = n_steps
    if HAS_FOUND_INF:
        limit = tl.where(tl.load(found_inf) == 0, n_steps, 0)
    mask = i < limit
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
    steps: list[torch.Tensor]
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
    ws: torch.Tensor  # fp64 workspace: global sum of squares, per-tensor sums
    steps: torch.Tensor  # int64 [n_steps]: distinct step addresses (tensors', then counter)
    gaddr: torch.Tensor | None = None  # int64 [n_groups]: lr addresses
    lrs: tuple = ()  # the lr addresses gaddr holds


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
    lists = {"grads": group.grads, "masters": group.masters or group.params, "steps": group.steps,
             **group.state}
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
        _check_scalar(f"group {i} steps[{j}]", group.steps[j], device)


def _check_scalar(name: str, x: torch.Tensor, device) -> None:
    if x.dtype != torch.float32 or x.numel() != 1 or x.device != device:
        raise ValueError(f"{name} must be one fp32 on {device}: {_describe(x)}")


def _master(group: FusedGroup, j: int) -> torch.Tensor | None:
    return None if group.masters is None else group.masters[j]


def _key(kind: str, groups: list[FusedGroup], defaults: dict, counter: torch.Tensor | None) -> tuple:
    """What a plan's tensor tables depend on: device, addresses, sizes, dtypes, hyperparameters.

    lr addresses are left out: when those tensors change, only their small table is
    refreshed (see _set_lrs).
    """
    key = [kind, groups[0].params[0].device, None if counter is None else counter.data_ptr()]
    for g in groups:
        names = tuple(g.state)
        key.append((_hyper_row(g.hyper, defaults), names))
        masters = [_master(g, j) for j in range(len(g.params))]
        for p, gr, m, st, *s in zip(g.params, g.grads, masters, g.steps, *(g.state[k] for k in names)):
            m_ptr = None if m is None else m.data_ptr()
            addresses = (p.data_ptr(), gr.data_ptr(), m_ptr, st.data_ptr(), *(x.data_ptr() for x in s))
            key.append((p.dtype, p.numel(), *addresses))
    return tuple(key)


def _launch_shape(max_numel: int) -> tuple[int, int]:
    """(BLOCK, TILES) of a bucket: 1024 x 4 elements per program, less for small tensors."""
    block = min(BLOCK, max(128, triton.next_power_of_2(max_numel)))
    return block, min(TILES, triton.cdiv(max_numel, block))


def _build(groups: list[FusedGroup], defaults: dict, state_names: tuple[str, ...],
           counter: torch.Tensor | None) -> _Plan:
    device = groups[0].params[0].device
    for i, g in enumerate(groups):
        _check_group(i, g, state_names, device)
    if counter is not None:
        _check_scalar("counter", counter, device)
    rows: dict[tuple, list[list[int]]] = {}  # (param dtype, has masters) -> meta rows
    for gi, g in enumerate(groups):
        for j, p in enumerate(g.params):
            m = _master(g, j)
            s = [g.state[k][j].data_ptr() for k in state_names] + [0] * (2 - len(state_names))
            row = [(p if m is None else m).data_ptr(), g.grads[j].data_ptr(), p.data_ptr(), *s]
            row += [g.steps[j].data_ptr(), p.numel(), gi]
            rows.setdefault((p.dtype, m is not None), []).append(row)

    n_tensors = sum(len(r) for r in rows.values())
    ws = torch.zeros(_WS_HEAD + 2 * n_tensors, dtype=torch.float64, device=device)
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
            ALIGNED=all(a % 16 == 0 for r in meta_rows for a in r[: _STEP.value]),
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
    # Every distinct counter once (tensors may share one), then the optimizer-wide counter.
    steps = [x.data_ptr() for g in groups for x in g.steps]
    steps = list(dict.fromkeys(steps + ([] if counter is None else [counter.data_ptr()])))
    return _Plan(
        buckets, torch.tensor(hyper, dtype=torch.float64, device=device), ws,
        steps=torch.tensor(steps, dtype=torch.int64, device=device),
    )


def _set_lrs(plan: _Plan, groups: list[FusedGroup]) -> None:
    """Point the plan at the groups' lr tensors (a no-op while they stay)."""
    lrs = tuple(g.lr.data_ptr() for g in groups)
    if lrs == plan.lrs:
        return
    for i, g in enumerate(groups):
        _check_scalar(f"group {i}: lr", g.lr, plan.ws.device)
    plan.gaddr = torch.tensor(lrs, dtype=torch.int64, device=plan.ws.device)
    plan.lrs = lrs


def _plan(kind: str, groups: list[FusedGroup], defaults: dict, state_names: tuple[str, ...],
          counter: torch.Tensor | None):
    """The cached plan for these groups, or None when there is nothing to update."""
    groups = [g for g in groups if g.params]
    if not groups:
        return None
    key = _key(kind, groups, defaults, counter)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _build(groups, defaults, state_names, counter)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    _set_lrs(plan, groups)
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
    block = min(BLOCK, triton.next_power_of_2(n))
    _count_step_kernel[(triton.cdiv(n, block),)](
        plan.steps, n, found_inf, HAS_FOUND_INF=has_found_inf, BLOCK=block,
    )  # fmt: skip


def fused_lars_step_(
    groups: list[FusedGroup],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
) -> None:
    """One LARS step on every group, in place (module docstring: semantics and launches)."""
    plan = _plan("lars", groups, LARS_DEFAULTS, ("momentum_buffer",), counter)
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
            b.chunks, b.meta, b.acc, plan.hyper, plan.gaddr, scale, inf,
            HAS_MASTER=b.has_master, **has, **b.consts,
        )  # fmt: skip
    _count_step(plan, inf, has["HAS_FOUND_INF"])


def fused_lamb_step_(
    groups: list[FusedGroup],
    *,
    max_grad_norm: float | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
) -> None:
    """One LAMB step on every group, in place (module docstring: semantics and launches)."""
    plan = _plan("lamb", groups, LAMB_DEFAULTS, ("exp_avg", "exp_avg_sq"), counter)
    if plan is None:
        return
    scale, inf, has = _scalars(plan, grad_scale, found_inf)
    clip = max_grad_norm is not None
    plan.ws.zero_()
    if clip:  # the global grad norm must be complete before any moment is formed
        for b in plan.buckets:
            _grad_check_kernel[b.grid](
                b.chunks, b.meta, b.acc, plan.ws, scale, inf, W_SQ=False, G_SQ=False,
                GLOBAL_SQ=True, **has, **b.consts,
            )  # fmt: skip
    for b in plan.buckets:
        _lamb_moments_kernel[b.grid](
            b.chunks, b.meta, b.acc, plan.ws, plan.hyper, scale, inf,
            float(max_grad_norm) if clip else 1.0, CLIP=clip, **has, **b.consts,
        )  # fmt: skip
    for b in plan.buckets:
        _lamb_apply_kernel[b.grid](
            b.chunks, b.meta, b.acc, plan.hyper, plan.gaddr, inf,
            HAS_MASTER=b.has_master, HAS_FOUND_INF=has["HAS_FOUND_INF"], **b.consts,
        )  # fmt: skip
    _count_step(plan, inf, has["HAS_FOUND_INF"])
