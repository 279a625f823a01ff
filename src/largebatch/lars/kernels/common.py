"""What the LARS and LAMB kernels share: the per-tensor table's columns, the chunk and
pointer helpers, the sums-of-squares pass, and the kernel that sums each tensor's
per-chunk partial sums in order and counts the step (docs/design.md §3: tables, passes
and launches)."""

from __future__ import annotations

import triton
import triton.language as tl

# Columns of the int64 per-tensor ("meta") table.
COL_W = tl.constexpr(0)  # weights the math runs on: the master, else the param
COL_G = tl.constexpr(1)  # grad
COL_P = tl.constexpr(2)  # param, rewritten from the master (masters only)
COL_S0 = tl.constexpr(3)  # momentum_buffer (LARS) / exp_avg (LAMB)
COL_S1 = tl.constexpr(4)  # exp_avg_sq (LAMB)
COL_STEP = tl.constexpr(5)  # the tensor's step count (fp32 scalar)
COL_NUMEL = tl.constexpr(6)
COL_GROUP = tl.constexpr(7)
COL_PART = tl.constexpr(8)  # the slot of the tensor's first chunk in the partial-sums table
META_COLS = tl.constexpr(9)
# Workspace slots before the per-tensor sums of squares: the global pass's two sums.
GSQ = tl.constexpr(1)  # LAMB: sum of squares of all unscaled grads (slot 0: unused, 0)
WS_HEAD = 2
# Partial sums summed at once by each program of finish_kernel.
_PARTS = tl.constexpr(256)

# Every kernel gets one CHUNK = BLOCK * TILES elements of one tensor. A full chunk calls
# its tile loop with limit = start + CHUNK: masks the compiler sees are all true, so with
# ALIGNED addresses loads and stores become 16-byte accesses. The tail chunk of each
# tensor calls it with limit = numel. A skipped step has numel 0: nothing moves.


@triton.jit
def tensor_ptr(row, col, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The typed pointer stored at ``row[col]`` of the meta table (16-byte aligned if ALIGNED)."""
    ptr = tl.load(row + col).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def program_chunk(chunks, meta, found_inf, HAS_FOUND_INF: tl.constexpr, CHUNK: tl.constexpr):
    """This program's tensor index, its meta row, first element, element count, and the
    chunk's slot in the partial-sums table (the tensor's first slot plus the chunk's
    index: it depends on the chunk, not on the program that runs it, or when).

    The count is 0 when GradScaler's found_inf skips the step.
    """
    c = tl.program_id(0)
    t = tl.load(chunks + 2 * c)
    k = tl.load(chunks + 2 * c + 1)  # the chunk's index within its tensor
    start = k * CHUNK
    row = meta + t * META_COLS
    numel = tl.load(row + COL_NUMEL)
    if HAS_FOUND_INF:
        numel = tl.where(tl.load(found_inf) == 0, numel, 0)
    return t, row, start, numel, tl.load(row + COL_PART) + k


@triton.jit
def unscale_factor(grad_scale, HAS_SCALE: tl.constexpr):
    """The factor that unscales grads: 1 / grad_scale (a reciprocal, as GradScaler does)."""
    if HAS_SCALE:
        inv = 1.0 / tl.load(grad_scale).to(tl.float32)
    else:
        inv = tl.full((), 1.0, tl.float32)
    return inv


@triton.jit
def store_part(parts, slot, a, b):
    """Store a chunk's two fp64 sums in its slot of the partial-sums table."""
    tl.store(parts + 2 * slot, a)
    tl.store(parts + 2 * slot + 1, b)


@triton.jit
def one_minus_pow(b, e):
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
def sum_of_squares(x):
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
def check_tiles(
    w_ptr,
    g_ptr,
    start,
    limit,
    inv_scale,
    wd,
    W_SQ: tl.constexpr,
    DECAYED: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """Sums of w^2 and of unscaled g^2 over a chunk (``sum_of_squares`` per tile, added in fp64);
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
            w_sq += sum_of_squares(w)
        g_sq += sum_of_squares(g)
    return w_sq, g_sq


@triton.jit
def grad_check_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, chunk index in it) of each program's chunk
    meta,  # int64 [n_tensors, META_COLS]: addresses, numel, group and first slot of each tensor
    parts,  # fp64 [n_slots, 2]: each chunk's sums of squares (w^2, g^2), one slot a chunk
    grad_scale,  # fp32 []: loss scale the grads carry (read only if HAS_SCALE)
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    P_DTYPE: tl.constexpr,  # dtype of params and grads
    W_DTYPE: tl.constexpr,  # dtype of the weights the math runs on (fp32 with masters)
    W_SQ: tl.constexpr,  # also sum w^2 (LARS; else the slot's first sum is 0)
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address is 16-byte aligned
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """Pass 1 of LARS, pass 0 of LAMB: each chunk's sums of squares of the unscaled grads
    (and weights). (LARS with a group's decayed_norm takes ``lars.lars_norms_kernel`` as
    pass 1.)"""
    _, row, start, numel, slot = program_chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = tensor_ptr(row, COL_W, W_DTYPE, ALIGNED)
    g_ptr = tensor_ptr(row, COL_G, P_DTYPE, ALIGNED)
    inv_scale = unscale_factor(grad_scale, HAS_SCALE)
    wd = tl.full((), 0.0, tl.float32)  # read only with DECAYED
    end = start + BLOCK * TILES
    if end <= numel:
        w_sq, g_sq = check_tiles(w_ptr, g_ptr, start, end, inv_scale, wd, W_SQ, False, BLOCK, TILES)
    else:
        w_sq, g_sq = check_tiles(w_ptr, g_ptr, start, numel, inv_scale, wd, W_SQ, False, BLOCK, TILES)
    store_part(parts, slot, w_sq, g_sq)


@triton.jit
def finish_kernel(
    parts,  # fp64 [n_slots, 2]: the chunks' partial sums, from the pass before
    spans,  # int64 [n_spans, 2]: (first slot, slot count) of each sum to form
    out,  # fp64 [n_spans, 2]: the sums, written (not added to)
    n_spans,  # int: programs [0, n_spans) form one sum each
    steps,  # int64 [n_steps]: addresses of the distinct step counters (fp32 scalars)
    n_steps,  # int: their number; the programs after the sums count them
    found_inf,  # fp32 []: GradScaler's overflow flag (read only if HAS_FOUND_INF)
    HAS_FOUND_INF: tl.constexpr,
    STEPS_BLOCK: tl.constexpr,  # counters per counting program, a power of two
):
    """The sums of squares from the partial sums, and the step counted.

    A sum program adds its span's slots in slot order, _PARTS lanes at a time, then
    across the lanes in a fixed tree (``tl.sum``): the same bits on every run, whatever
    order the programs of the pass before ran in. The programs after the sums count the
    step: count += 1 for every counter of their block, unless the step is skipped.
    """
    pid = tl.program_id(0)
    if pid < n_spans:
        first = tl.load(spans + 2 * pid)
        count = tl.load(spans + 2 * pid + 1)
        lanes = tl.arange(0, _PARTS)
        pair = tl.arange(0, 2)
        total = tl.zeros((_PARTS, 2), tl.float64)
        for i in range(0, count, _PARTS):
            slot = first + i + lanes
            mask = (i + lanes < count)[:, None]
            total += tl.load(parts + 2 * slot[:, None] + pair[None, :], mask=mask, other=0.0)
        tl.store(out + 2 * pid + pair, tl.sum(total, axis=0))
    else:
        # (Names apart from the other branch's: triton types a name across both.)
        counters = (pid - n_spans) * STEPS_BLOCK + tl.arange(0, STEPS_BLOCK)
        limit = n_steps
        if HAS_FOUND_INF:
            limit = tl.where(tl.load(found_inf) == 0, n_steps, 0)
        counted = counters < limit
        ptrs = tl.load(steps + counters, mask=counted, other=0).to(tl.pointer_type(tl.float32))
        tl.store(ptrs, tl.load(ptrs, mask=counted, other=0.0) + 1.0, mask=counted)
