"""The LARS kernels: pass 2 (trust ratio, momentum, weights), after pass 1 formed each
tensor's ||w||^2 and ||g||^2: ``grad_check_kernel`` (``common.py``), or, when some group
has decayed_norm, ``lars_norms_kernel``, which forms ||g + wd * w||^2 in place of
||g||^2 for that group's tensors; ``finish_kernel`` sums each tensor's chunks."""

from __future__ import annotations

import triton
import triton.language as tl

from largebatch.lars.kernels.common import (
    COL_G,
    COL_GROUP,
    COL_P,
    COL_S0,
    COL_W,
    check_tiles,
    program_chunk,
    store_part,
    tensor_ptr,
    unscale_factor,
)
from largebatch.lars.spec import LARS_SPEC

# Columns of the fp64 per-group table: LARS_SPEC.columns, by name, then the grads' sign
# (-1 under maximize; plan._row).
_MOMENTUM = tl.constexpr(LARS_SPEC.columns.index("momentum"))
_WEIGHT_DECAY = tl.constexpr(LARS_SPEC.columns.index("weight_decay"))
_TRUST_COEFFICIENT = tl.constexpr(LARS_SPEC.columns.index("trust_coefficient"))
_EPS = tl.constexpr(LARS_SPEC.columns.index("eps"))
_NESTEROV = tl.constexpr(LARS_SPEC.columns.index("nesterov"))
_TRUST_CLIP = tl.constexpr(LARS_SPEC.columns.index("trust_clip"))
_TRUST_RATIO = tl.constexpr(LARS_SPEC.columns.index("trust_ratio"))
_LR_IN_MOMENTUM = tl.constexpr(LARS_SPEC.columns.index("lr_in_momentum"))
_ZERO_NORM_SKIP = tl.constexpr(LARS_SPEC.columns.index("zero_norm_skip"))
_DECAYED_NORM = tl.constexpr(LARS_SPEC.columns.index("decayed_norm"))
_SIGN = tl.constexpr(len(LARS_SPEC.columns))
_LARS_COLS = tl.constexpr(len(LARS_SPEC.columns) + 1)


@triton.jit
def lars_norms_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, chunk index in it) of each program's chunk
    meta,  # int64 [n_tensors, META_COLS]: addresses, numel, group and first slot of each tensor
    parts,  # fp64 [n_slots, 2]: each chunk's sums of squares, one slot a chunk
    hyper,  # fp64 [n_groups, _LARS_COLS]: each group's LARS_SPEC.row and grads' sign
    grad_scale,  # fp32 []: loss scale the grads carry (read only if HAS_SCALE)
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    P_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """Pass 1 of LARS when some group has decayed_norm: each chunk's sum of w^2, and of
    (g + wd * w)^2 (optax's lars) for a tensor of such a group, g^2 for the others
    (their decay read as wd times the flag's 0)."""
    _, row, start, numel, slot = program_chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = tensor_ptr(row, COL_W, W_DTYPE, ALIGNED)
    g_ptr = tensor_ptr(row, COL_G, P_DTYPE, ALIGNED)
    h = hyper + tl.load(row + COL_GROUP) * _LARS_COLS
    inv_scale = unscale_factor(grad_scale, HAS_SCALE) * tl.load(h + _SIGN).to(tl.float32)
    wd = (tl.load(h + _WEIGHT_DECAY) * tl.load(h + _DECAYED_NORM)).to(tl.float32)
    end = start + BLOCK * TILES
    if end <= numel:
        w_sq, g_sq = check_tiles(w_ptr, g_ptr, start, end, inv_scale, wd, True, True, BLOCK, TILES)
    else:
        w_sq, g_sq = check_tiles(w_ptr, g_ptr, start, numel, inv_scale, wd, True, True, BLOCK, TILES)
    store_part(parts, slot, w_sq, g_sq)


@triton.jit
def _lars_tiles(
    w_ptr,
    g_ptr,
    p_ptr,
    v_ptr,
    start,
    limit,
    inv_scale,
    rate,
    outer,
    wd,
    momentum,
    nesterov,
    W_DTYPE: tl.constexpr,
    P_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """LARS on elements [start, limit) of a chunk: v and w (and the param) written.
    ``rate`` scales the update into the buffer, ``outer`` the step out of it (1 with
    lr_in_momentum, else lr: an exact 1.0 leaves the default's bits as they were)."""
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        update = rate * (g + wd * w)
        v = momentum * v + update
        w = w - outer * tl.where(nesterov, momentum * v + update, v)
        tl.store(v_ptr + offs, v.to(W_DTYPE), mask=mask)
        tl.store(w_ptr + offs, w.to(W_DTYPE), mask=mask)
        if HAS_MASTER:
            tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


@triton.jit
def lars_apply_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, chunk index in it) of each program's chunk
    meta,  # int64 [n_tensors, META_COLS]: addresses, numel and group of each tensor
    acc,  # fp64 [n_tensors, 2]: ||w||^2, ||g||^2 (decayed_norm: ||g + wd * w||^2), summed
    hyper,  # fp64 [n_groups, _LARS_COLS]: each group's LARS_SPEC.row and grads' sign
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
    """Pass 2 of LARS: v = momentum * v + lr * ratio * (g + wd * w); w -= v (or nesterov);
    lr outside the buffer where the group's lr_in_momentum is 0."""
    t, row, start, numel, _ = program_chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = tensor_ptr(row, COL_W, W_DTYPE, ALIGNED)
    g_ptr = tensor_ptr(row, COL_G, P_DTYPE, ALIGNED)
    p_ptr = tensor_ptr(row, COL_P, P_DTYPE, ALIGNED)
    v_ptr = tensor_ptr(row, COL_S0, W_DTYPE, ALIGNED)
    group = tl.load(row + COL_GROUP)
    h = hyper + group * _LARS_COLS
    momentum = tl.load(h + _MOMENTUM).to(tl.float32)
    wd = tl.load(h + _WEIGHT_DECAY).to(tl.float32)
    tc = tl.load(h + _TRUST_COEFFICIENT).to(tl.float32)
    eps = tl.load(h + _EPS).to(tl.float32)
    nesterov = tl.load(h + _NESTEROV) != 0
    trust_clip = tl.load(h + _TRUST_CLIP) != 0
    trust_ratio = tl.load(h + _TRUST_RATIO) != 0
    lr_in_momentum = tl.load(h + _LR_IN_MOMENTUM) != 0
    zero_norm_skip = tl.load(h + _ZERO_NORM_SKIP) != 0
    decayed_norm = tl.load(h + _DECAYED_NORM) != 0
    lr = tl.load(tl.load(gaddr + group).to(tl.pointer_type(tl.float32)))
    inv_scale = unscale_factor(grad_scale, HAS_SCALE) * tl.load(h + _SIGN).to(tl.float32)

    # The norms come in fp64 (no overflow for any finite weights); the ratio goes to fp32.
    w_norm = tl.sqrt(tl.load(acc + 2 * t))
    g_norm = tl.sqrt(tl.load(acc + 2 * t + 1))  # with decayed_norm: ||g + wd * w|| (optax)
    nonzero = (w_norm > 0) & (g_norm > 0)
    denominator = tl.where(decayed_norm, g_norm + eps, g_norm + wd * w_norm + eps)
    ratio = tl.where(nonzero, tc * w_norm / tl.where(nonzero, denominator, 1.0), 1.0)
    ratio = ratio.to(tl.float32)
    ratio = tl.where(trust_clip, tl.minimum(ratio / lr, 1.0), ratio)
    # apex LARC's zero norms: the gradient as it is (ratio 1, no clip, no weight decay).
    skip = trust_ratio & zero_norm_skip & ~nonzero
    ratio = tl.where(trust_ratio & ~skip, ratio, 1.0)
    wd = tl.where(skip, 0.0, wd)
    rate = tl.where(lr_in_momentum, lr * ratio, ratio)
    outer = tl.where(lr_in_momentum, 1.0, lr)

    end = start + BLOCK * TILES
    if end <= numel:
        _lars_tiles(
            w_ptr,
            g_ptr,
            p_ptr,
            v_ptr,
            start,
            end,
            inv_scale,
            rate,
            outer,
            wd,
            momentum,
            nesterov,
            W_DTYPE,
            P_DTYPE,
            HAS_MASTER,
            BLOCK,
            TILES,
        )
    else:
        _lars_tiles(
            w_ptr,
            g_ptr,
            p_ptr,
            v_ptr,
            start,
            numel,
            inv_scale,
            rate,
            outer,
            wd,
            momentum,
            nesterov,
            W_DTYPE,
            P_DTYPE,
            HAS_MASTER,
            BLOCK,
            TILES,
        )
