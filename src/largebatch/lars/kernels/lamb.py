"""The LAMB kernels: pass 1 (new moments; each chunk's sums of w^2 and u^2) and pass 2
(trust ratio, weights), after the optional pass 0 (``grad_check_kernel`` in
``common.py``: the global grad norm for ``max_grad_norm``). ``finish_kernel`` sums the
chunks after pass 0 and pass 1, and counts the step after pass 1."""

from __future__ import annotations

import triton
import triton.language as tl

from largebatch.lars.kernels.common import (
    COL_G,
    COL_GROUP,
    COL_P,
    COL_S0,
    COL_S1,
    COL_STEP,
    COL_W,
    GSQ,
    one_minus_pow,
    program_chunk,
    store_part,
    sum_of_squares,
    tensor_ptr,
    unscale_factor,
)
from largebatch.lars.spec import LAMB_SPEC

# Columns of the fp64 per-group table: LAMB_SPEC.columns, by name, then the grads' sign
# (-1 under maximize; plan._row).
_B1 = tl.constexpr(LAMB_SPEC.columns.index("b1"))
_B2 = tl.constexpr(LAMB_SPEC.columns.index("b2"))
_EPS = tl.constexpr(LAMB_SPEC.columns.index("eps"))
_WEIGHT_DECAY = tl.constexpr(LAMB_SPEC.columns.index("weight_decay"))
_BIAS_CORRECTION = tl.constexpr(LAMB_SPEC.columns.index("bias_correction"))
_TRUST_RATIO = tl.constexpr(LAMB_SPEC.columns.index("trust_ratio"))
_ADAM_W_MODE = tl.constexpr(LAMB_SPEC.columns.index("adam_w_mode"))
_GRAD_AVERAGING = tl.constexpr(LAMB_SPEC.columns.index("grad_averaging"))
_ADAPT_WITHOUT_DECAY = tl.constexpr(LAMB_SPEC.columns.index("adapt_without_decay"))
_FREEZE_STEP = tl.constexpr(LAMB_SPEC.columns.index("freeze_step"))  # 2**31 - 1: never
_SIGN = tl.constexpr(len(LAMB_SPEC.columns))
_LAMB_COLS = tl.constexpr(len(LAMB_SPEC.columns) + 1)


@triton.jit
def _lamb_direction(w, m, v, inv_bc1, inv_bc2, eps, wd):
    """u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w, in fp32; shared by passes 1 and 2."""
    return (m * inv_bc1) / (tl.sqrt(v * inv_bc2) + eps) + wd * w


@triton.jit
def _lamb_factors(hyper, row, group, COUNTED: tl.constexpr):
    """A tensor's LAMB scalars: its group's b1, b2 (fp64), eps, the weight decay that
    enters the moments (L2 mode) and the one that enters u (AdamW mode), the factor of g
    in m (1 - b1, or 1 without grad averaging), whether it takes the trust ratio,
    1 / bias corrections at its own step count t (the count + 1 before the step is
    counted, in pass 1; the count after, COUNTED, in pass 2), v's at min(t, freeze_step),
    and whether v is frozen (t > freeze_step)."""
    h = hyper + group * _LAMB_COLS
    b1 = tl.load(h + _B1)
    b2 = tl.load(h + _B2)
    eps = tl.load(h + _EPS).to(tl.float32)
    wd = tl.load(h + _WEIGHT_DECAY).to(tl.float32)
    corrected = tl.load(h + _BIAS_CORRECTION) != 0
    adam_w = tl.load(h + _ADAM_W_MODE) != 0
    wd_g = tl.where(adam_w, 0.0, wd)
    wd_u = tl.where(adam_w, wd, 0.0)
    b3 = tl.where(tl.load(h + _GRAD_AVERAGING) != 0, 1.0 - b1, 1.0)  # fp64, then fp32
    trust_ratio = (tl.load(h + _TRUST_RATIO) != 0) & ((tl.load(h + _ADAPT_WITHOUT_DECAY) != 0) | (wd != 0))
    step = tl.load(tl.load(row + COL_STEP).to(tl.pointer_type(tl.float32)))
    e = step.to(tl.int32)  # this step's t: the count after it is counted
    if not COUNTED:
        e += 1
    freeze = tl.load(h + _FREEZE_STEP).to(tl.int32)
    frozen = e > freeze
    inv_bc1 = tl.where(corrected, 1.0 / one_minus_pow(b1, e), 1.0)
    inv_bc2 = tl.where(corrected, 1.0 / one_minus_pow(b2, tl.minimum(e, freeze)), 1.0)
    return b1, b2, b3, eps, wd_g, wd_u, inv_bc1, inv_bc2, trust_ratio, frozen


@triton.jit
def _moment_tiles(
    w_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    start,
    limit,
    g_mul,
    b1,
    b2,
    b3,
    inv_bc1,
    inv_bc2,
    eps,
    wd_g,
    wd,
    frozen,
    W_DTYPE: tl.constexpr,
    P_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """New m, v on elements [start, limit) of a chunk, stored; sums of w^2 and u^2.
    ``wd_g`` enters the gradient (L2 mode; 0 otherwise), ``wd`` enters u; v stays as it
    is where ``frozen``."""
    one_b1 = b3.to(tl.float32)  # 1 - b in fp64, then fp32
    one_b2 = (1.0 - b2).to(tl.float32)
    b1 = b1.to(tl.float32)
    b2 = b2.to(tl.float32)
    w_sq = tl.full((), 0.0, tl.float64)
    u_sq = tl.full((), 0.0, tl.float64)
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * g_mul
        g = tl.where(wd_g != 0, g + wd_g * w, g)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Round to the stored dtype first, so that pass 2 recomputes exactly this u.
        m = (b1 * m + one_b1 * g).to(W_DTYPE)
        # Frozen: v as loaded, stored back unchanged (a store under a second predicate
        # costs registers that spill in some builds; compile_check.py).
        v = tl.where(frozen, v, b2 * v + one_b2 * g * g).to(W_DTYPE)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        u = _lamb_direction(w, m.to(tl.float32), v.to(tl.float32), inv_bc1, inv_bc2, eps, wd)
        w_sq += sum_of_squares(w)
        u_sq += sum_of_squares(tl.where(mask, u, 0.0))  # masked lanes: 0 / eps, or 0 / 0 when eps = 0
    return w_sq, u_sq


@triton.jit
def lamb_moments_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, chunk index in it) of each program's chunk
    meta,  # int64 [n_tensors, META_COLS]: addresses, numel, group and first slot of each tensor
    parts,  # fp64 [n_slots, 2]: each chunk's sums of w^2 and u^2, one slot a chunk
    ws,  # fp64 workspace: [GSQ] sum of squares of all grads
    hyper,  # fp64 [n_groups, _LAMB_COLS]: each group's LAMB_SPEC.row and grads' sign
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
    """Pass 1 of LAMB: m, v updated and stored; each chunk's sums of w^2 and u^2."""
    _, row, start, numel, slot = program_chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = tensor_ptr(row, COL_W, W_DTYPE, ALIGNED)
    g_ptr = tensor_ptr(row, COL_G, P_DTYPE, ALIGNED)
    m_ptr = tensor_ptr(row, COL_S0, W_DTYPE, ALIGNED)
    v_ptr = tensor_ptr(row, COL_S1, W_DTYPE, ALIGNED)
    group = tl.load(row + COL_GROUP)
    b1, b2, b3, eps, wd_g, wd, inv_bc1, inv_bc2, _, frozen = _lamb_factors(hyper, row, group, False)
    sign = tl.load(hyper + group * _LAMB_COLS + _SIGN).to(tl.float32)  # -1 under maximize
    g_mul = unscale_factor(grad_scale, HAS_SCALE) * sign
    if CLIP:
        # Compiled, a Python float argument is fp32 already; the interpreter passes it as
        # a Python constant, which is fp64 outside fp32's normal range. fp32 in both.
        clip_norm = tl.cast(max_grad_norm, tl.float32)
        over = tl.sqrt(tl.load(ws + GSQ)).to(tl.float32) / clip_norm
        g_mul = g_mul / tl.where(over < 1.0, 1.0, over)  # a NaN norm stays NaN, as in torch.clamp

    end = start + BLOCK * TILES
    if end <= numel:
        w_sq, u_sq = _moment_tiles(
            w_ptr,
            g_ptr,
            m_ptr,
            v_ptr,
            start,
            end,
            g_mul,
            b1,
            b2,
            b3,
            inv_bc1,
            inv_bc2,
            eps,
            wd_g,
            wd,
            frozen,
            W_DTYPE,
            P_DTYPE,
            BLOCK,
            TILES,
        )
    else:
        w_sq, u_sq = _moment_tiles(
            w_ptr,
            g_ptr,
            m_ptr,
            v_ptr,
            start,
            numel,
            g_mul,
            b1,
            b2,
            b3,
            inv_bc1,
            inv_bc2,
            eps,
            wd_g,
            wd,
            frozen,
            W_DTYPE,
            P_DTYPE,
            BLOCK,
            TILES,
        )
    store_part(parts, slot, w_sq, u_sq)


@triton.jit
def _lamb_tiles(
    w_ptr,
    p_ptr,
    m_ptr,
    v_ptr,
    start,
    limit,
    rate,
    inv_bc1,
    inv_bc2,
    eps,
    wd,
    W_DTYPE: tl.constexpr,
    P_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
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
def lamb_apply_kernel(
    chunks,  # int64 [n_chunks, 2]: (tensor index, chunk index in it) of each program's chunk
    meta,  # int64 [n_tensors, META_COLS]: addresses, numel and group of each tensor
    acc,  # fp64 [n_tensors, 2]: ||w||^2, ||u||^2, summed from pass 1
    hyper,  # fp64 [n_groups, _LAMB_COLS]: each group's LAMB_SPEC.row and grads' sign
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
    """Pass 2 of LAMB: w -= lr * ratio * u, with u recomputed from the new m and v."""
    t, row, start, numel, _ = program_chunk(chunks, meta, found_inf, HAS_FOUND_INF, BLOCK * TILES)
    w_ptr = tensor_ptr(row, COL_W, W_DTYPE, ALIGNED)
    p_ptr = tensor_ptr(row, COL_P, P_DTYPE, ALIGNED)
    m_ptr = tensor_ptr(row, COL_S0, W_DTYPE, ALIGNED)
    v_ptr = tensor_ptr(row, COL_S1, W_DTYPE, ALIGNED)
    group = tl.load(row + COL_GROUP)
    _, _, _, eps, _, wd, inv_bc1, inv_bc2, trust_ratio, _ = _lamb_factors(hyper, row, group, True)
    lr = tl.load(tl.load(gaddr + group).to(tl.pointer_type(tl.float32)))

    w_norm = tl.sqrt(tl.load(acc + 2 * t))
    u_norm = tl.sqrt(tl.load(acc + 2 * t + 1))
    nonzero = (w_norm > 0) & (u_norm > 0) & trust_ratio
    rate = lr * tl.where(nonzero, w_norm / tl.where(nonzero, u_norm, 1.0), 1.0).to(tl.float32)

    end = start + BLOCK * TILES
    if end <= numel:
        _lamb_tiles(
            w_ptr,
            p_ptr,
            m_ptr,
            v_ptr,
            start,
            end,
            rate,
            inv_bc1,
            inv_bc2,
            eps,
            wd,
            W_DTYPE,
            P_DTYPE,
            HAS_MASTER,
            BLOCK,
            TILES,
        )
    else:
        _lamb_tiles(
            w_ptr,
            p_ptr,
            m_ptr,
            v_ptr,
            start,
            numel,
            rate,
            inv_bc1,
            inv_bc2,
            eps,
            wd,
            W_DTYPE,
            P_DTYPE,
            HAS_MASTER,
            BLOCK,
            TILES,
        )
