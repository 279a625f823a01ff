"""What the LARS and LAMB kernels share: the per-tensor table's columns, the chunk and
pointer helpers, the sums-of-squares pass and the step counter (package docstring:
tables, passes and launches)."""

from __future__ import annotations

import triton
import triton.language as tl

# Columns of the int64 per-tensor ("meta") table.
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


# A tile's sum of squares is formed in fp32 and taken into fp64 once per tile. Outside
# [_SQ_MIN, _SQ_MAX] (an overflow to inf, a NaN, or a sum so small that squares may have
# underflowed) the tile is summed again, scaled by a power of two: by 2**-70 no finite
# fp32 tile of up to 2048 elements overflows (BLOCK is at most 1024); by 2**96 no square
# of a normal or subnormal fp32 underflows, and no tile whose sum is below 2**-80
# overflows. The sum is scaled back by multiplying in fp64 (an fp64 division compiles to
# a call, whose saved registers spill).
_SQ_MIN = tl.constexpr(2.0**-80)
_SQ_MAX = tl.constexpr(3.4028234663852886e38)  # the largest fp32
_SCALE_UP = tl.constexpr(2.0**96)
_SCALE_DOWN = tl.constexpr(2.0**-70)


@triton.jit
def _sum_sq(x):
    """The sum of squares of a tile of fp32 values (masked lanes 0), as an fp64 scalar:
    squared and added in fp32, then scaled back in fp64 if the tile had to be rescaled.
    inf and NaN elements give inf and NaN, as in fp64."""
    s = tl.sum(x * x, axis=0)
    if (s >= _SQ_MIN) & (s <= _SQ_MAX):
        total = s.to(tl.float64)
    else:
        up = s < _SQ_MIN
        y = x * tl.where(up, _SCALE_UP, _SCALE_DOWN)
        unscale = tl.where(up, 1.0 / _SCALE_UP, 1.0 / _SCALE_DOWN).to(tl.float64)  # exact
        total = tl.sum(y * y, axis=0).to(tl.float64) * unscale * unscale
    return total


@triton.jit
def _check_tiles(
    w_ptr, g_ptr, start, limit, inv_scale, wd,
    W_SQ: tl.constexpr, DECAYED: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Sums of w^2 and of unscaled g^2 over a chunk (``_sum_sq`` per tile, added in fp64);
    with DECAYED (and W_SQ), of (g + wd * w)^2 in place of g^2 (formed in fp32, as pass 2
    forms it)."""
    w_sq = tl.full((), 0.0, tl.float64)
    g_sq = tl.full((), 0.0, tl.float64)
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
        if W_SQ:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if DECAYED:
                g = g + wd * w
            w_sq += _sum_sq(w)
        g_sq += _sum_sq(g)
    return w_sq, g_sq


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
    """Pass 1 of LARS, pass 0 of LAMB: sums of squares of the unscaled grads (and weights).
    (LARS with a group's decayed_norm takes ``lars._lars_norms_kernel`` as pass 1.)"""
    t, row, start, numel = _chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = _tensor_ptr(row, _W, W_DTYPE, ALIGNED)
    g_ptr = _tensor_ptr(row, _G, P_DTYPE, ALIGNED)
    inv_scale = _unscale(grad_scale, HAS_SCALE)
    wd = tl.full((), 0.0, tl.float32)  # read only with DECAYED
    end = start + BLOCK * TILES
    if end <= numel:
        w_sq, g_sq = _check_tiles(w_ptr, g_ptr, start, end, inv_scale, wd, W_SQ, False, BLOCK, TILES)
    else:
        w_sq, g_sq = _check_tiles(w_ptr, g_ptr, start, numel, inv_scale, wd, W_SQ, False, BLOCK, TILES)
    if W_SQ:
        tl.atomic_add(acc + 2 * t, w_sq)
    if G_SQ:
        tl.atomic_add(acc + 2 * t + 1, g_sq)
    if GLOBAL_SQ:
        tl.atomic_add(ws + _GSQ, g_sq)


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
