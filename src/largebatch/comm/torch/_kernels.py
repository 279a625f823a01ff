"""The Triton kernels of the fused AdaComp exchange: selection and per-bin sums, per-layer
counts and scales, the message tables, the encoder (codes, values and new residuals) and
the decoder, each over every compressed layer of a bucket at once (docs/design.md,
"AdaComp's kernels"; the host side is ``_fused.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

# Columns of the int64 per-segment table (a segment: a compressed layer, or one owner's
# chunk of it).
SEG_OFF = tl.constexpr(0)  # first element in the input (gradient) buffer
SEG_ROFF = tl.constexpr(1)  # first element in the residual buffers
SEG_NUMEL = tl.constexpr(2)
SEG_BIN = tl.constexpr(3)  # L_T, fitted to the segment
SEG_NBINS = tl.constexpr(4)
SEG_BIN0 = tl.constexpr(5)  # the segment's first slot in the per-bin arrays
SEG_COLS = tl.constexpr(6)
# Columns of the int64 per-(message, segment) table the scan writes.
MSG_COUNT = tl.constexpr(0)  # codes of the segment in the message
MSG_CODE = tl.constexpr(1)  # byte of its code 0, less WIDTH times its first bin's prefix
MSG_VALUE = tl.constexpr(2)  # the same for its values (values="exact")
MSG_COLS = tl.constexpr(3)


@triton.jit
def _bins(
    progs,
    segs,
    g_ptr,
    r_ptr,
    rscale,
    HAS_SCALE: tl.constexpr,
    ALL: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """This program's bins: the segment, its row, the bins' indices in it, each element's
    index in the segment, the lanes in use, G = residual (times the loss scale) + g, and
    the selection (``ALL``: every G != 0; else |G + g| >= the bin's max |G|, G != 0)."""
    p = tl.program_id(0)
    t = tl.load(progs + 2 * p).to(tl.int64)
    first = tl.load(progs + 2 * p + 1).to(tl.int64)
    row = segs + t * SEG_COLS
    numel = tl.load(row + SEG_NUMEL)
    blen = tl.load(row + SEG_BIN)
    nbins = tl.load(row + SEG_NBINS)
    bins = first + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, COLS).to(tl.int64)
    idx = bins[:, None] * blen + cols[None, :]
    lanes = (bins[:, None] < nbins) & (cols[None, :] < blen) & (idx < numel)
    g = tl.load(g_ptr + tl.load(row + SEG_OFF) + idx, mask=lanes, other=0.0)
    r = tl.load(r_ptr + tl.load(row + SEG_ROFF) + idx, mask=lanes, other=0.0)
    if HAS_SCALE:
        # the product rounded on its own (in fp64, exact for fp32 inputs), never fused
        # with the sum into one rounding
        r = (r.to(tl.float64) * tl.load(rscale).to(tl.float64)).to(g.dtype)
    big = r + g
    if ALL:
        sel = lanes & (big != 0)
    else:
        top = tl.max(tl.where(lanes, tl.abs(big), 0.0), axis=1)
        sel = lanes & (tl.abs(big + g) >= top[:, None]) & (big != 0)
    return t, row, bins, idx, lanes, big, sel


@triton.jit
def select_kernel(
    progs,  # int32 [n_programs, 2]: (segment, first bin) of each program's ROWS bins
    segs,  # int64 [n_segments, SEG_COLS]
    g_ptr,  # the gradients (compute dtype)
    r_ptr,  # the residuals (compute dtype)
    rscale,  # the loss scale (compute dtype, [1]; read only if HAS_SCALE)
    bin_count,  # int32 [n_bins]: out, each bin's selected count
    bin_sum,  # fp64 [n_bins]: out, each bin's sum of |G| over the selected
    HAS_SCALE: tl.constexpr,
    ALL: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Pass 1: each bin's selected count and sum of |G| (fp64)."""
    _, row, bins, _, _, big, sel = _bins(progs, segs, g_ptr, r_ptr, rscale, HAS_SCALE, ALL, ROWS, COLS)
    slots = tl.load(row + SEG_BIN0) + bins
    ok = bins < tl.load(row + SEG_NBINS)
    tl.store(bin_count + slots, tl.sum(sel.to(tl.int32), axis=1), mask=ok)
    tl.store(bin_sum + slots, tl.sum(tl.where(sel, tl.abs(big), 0.0).to(tl.float64), axis=1), mask=ok)


@triton.jit
def finish_kernel(
    segs,  # int64 [n_segments, SEG_COLS]
    bin_count,  # int32 [n_bins]
    bin_sum,  # fp64 [n_bins]
    bin_prefix,  # int64 [n_bins]: out, selected in the segment's bins before each bin
    seg_count,  # int64 [n_segments]: out
    seg_scale,  # compute dtype [n_segments]: out, the ternary scale (0: values="exact")
    EXACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 2, one program a segment: its bins' counts and sums added in bin order, the
    scale (sum / max(count, 1), in fp64, then rounded once), each bin's prefix."""
    t = tl.program_id(0).to(tl.int64)
    row = segs + t * SEG_COLS
    nbins = tl.load(row + SEG_NBINS)
    bin0 = tl.load(row + SEG_BIN0)
    count = tl.full((), 0, tl.int64)
    total = tl.full((), 0.0, tl.float64)
    for start in range(0, nbins, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < nbins
        c = tl.load(bin_count + bin0 + offs, mask=ok, other=0).to(tl.int64)
        tl.store(bin_prefix + bin0 + offs, count + tl.cumsum(c, axis=0) - c, mask=ok)
        count += tl.sum(c, axis=0)
        total += tl.sum(tl.load(bin_sum + bin0 + offs, mask=ok, other=0.0), axis=0)
    tl.store(seg_count + t, count)
    if EXACT:
        scale = tl.full((), 0.0, tl.float64)
    else:
        scale = total / tl.maximum(count, 1).to(tl.float64)
    tl.store(seg_scale + t, scale.to(seg_scale.dtype.element_ty))


@triton.jit
def _prefix_at(bin_prefix, seg_count, bin0, nbins, at, tmask):
    """The selected count before bin ``at`` of each segment (``at`` up to its ``nbins``)."""
    inside = tmask & (at < nbins)
    return tl.where(
        inside, tl.load(bin_prefix + bin0 + at, mask=inside, other=0), tl.where(tmask, seg_count, 0)
    )


@triton.jit
def scan_kernel(
    segs,  # int64 [n_segments, SEG_COLS]
    bin_prefix,  # int64 [n_bins]
    seg_count,  # int64 [n_segments]
    finite,  # bool [1]: the bucket is finite (else every size is -1)
    table,  # int64 [dests, n_segments, MSG_COLS]: out
    sizes,  # int64 [dests]: out, each message's bytes
    bases,  # int64 [dests]: out, each message's first byte in the send buffer
    k,  # segments
    DESTS: tl.constexpr,  # messages: 1 (every bin), or one per owner of whole-bin chunks
    WIDTH: tl.constexpr,  # bytes a code
    ITEM: tl.constexpr,  # bytes a scale or value
    EXACT: tl.constexpr,
    KP: tl.constexpr,  # k rounded up to a power of two
):
    """One program: each message's per-segment counts, its size and place, and where each
    segment's codes (and values) go in it."""
    ts = tl.arange(0, KP)
    tmask = ts < k
    nbins = tl.load(segs + ts * SEG_COLS + SEG_NBINS, mask=tmask, other=0)
    bin0 = tl.load(segs + ts * SEG_COLS + SEG_BIN0, mask=tmask, other=0)
    counts = tl.load(seg_count + ts, mask=tmask, other=0)
    per = (nbins + DESTS - 1) // DESTS  # bins in each owner's chunk
    ok = tl.load(finite) != 0
    head = k * (8 + ITEM)
    base = tl.full((), 0, tl.int64)
    for j in range(DESTS):
        lo = _prefix_at(bin_prefix, counts, bin0, nbins, tl.minimum(j * per, nbins), tmask)
        hi = _prefix_at(bin_prefix, counts, bin0, nbins, tl.minimum((j + 1) * per, nbins), tmask)
        n = tl.where(tmask, hi - lo, 0)
        before = tl.cumsum(n, axis=0) - n
        total = tl.sum(n, axis=0)
        out = table + (j * k + ts) * MSG_COLS
        tl.store(out + MSG_COUNT, n, mask=tmask)
        tl.store(out + MSG_CODE, base + head + WIDTH * (before - lo), mask=tmask)
        tl.store(out + MSG_VALUE, base + head + WIDTH * total + ITEM * (before - lo), mask=tmask)
        size = head + WIDTH * total
        if EXACT:
            size += ITEM * total
        tl.store(sizes + j, tl.where(ok, size, -1))
        tl.store(bases + j, base)
        base += size


@triton.jit
def _store_bytes(ptr, pos, bits, mask, N: tl.constexpr):
    """The low N bytes of int64 ``bits`` at ``ptr + pos``, little-endian."""
    for b in tl.static_range(N):
        tl.store(ptr + pos + b, ((bits >> (8 * b)) & 255).to(tl.uint8), mask=mask)


@triton.jit
def _load_bytes(ptr, pos, mask, N: tl.constexpr):
    """The int64 whose low N bytes are at ``ptr + pos``, little-endian."""
    bits = tl.load(ptr + pos, mask=mask, other=0).to(tl.int64)
    for b in tl.static_range(1, N):
        bits |= tl.load(ptr + pos + b, mask=mask, other=0).to(tl.int64) << (8 * b)
    return bits


@triton.jit
def _float_bits(x, ITEM: tl.constexpr):
    if ITEM == 8:
        bits = x.to(tl.int64, bitcast=True)
    else:
        bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return bits


@triton.jit
def _bits_float(bits, ITEM: tl.constexpr):
    if ITEM == 8:
        x = bits.to(tl.float64, bitcast=True)
    else:
        x = bits.to(tl.int32).to(tl.float32, bitcast=True)
    return x


@triton.jit
def header_kernel(
    out,  # uint8: the send buffer
    table,  # int64 [dests, n_segments, MSG_COLS]
    bases,  # int64 [dests]
    seg_scale,  # compute dtype [n_segments]
    k,
    ITEM: tl.constexpr,
    KP: tl.constexpr,
):
    """One program a message: its counts (int64) and its scales."""
    j = tl.program_id(0).to(tl.int64)
    ts = tl.arange(0, KP)
    tmask = ts < k
    base = tl.load(bases + j)
    counts = tl.load(table + (j * k + ts) * MSG_COLS + MSG_COUNT, mask=tmask, other=0)
    _store_bytes(out, base + 8 * ts, counts, tmask, 8)
    scales = tl.load(seg_scale + ts, mask=tmask, other=0.0)
    _store_bytes(out, base + 8 * k + ITEM * ts, _float_bits(scales, ITEM), tmask, ITEM)


@triton.jit
def encode_kernel(
    progs,  # int32 [n_programs, 2]
    segs,  # int64 [n_segments, SEG_COLS]
    g_ptr,
    r_ptr,
    rscale,  # the loss scale (compute dtype, [1]; read only if HAS_SCALE)
    bin_prefix,  # int64 [n_bins]
    seg_scale,  # compute dtype [n_segments]
    table,  # int64 [dests, n_segments, MSG_COLS]
    out,  # uint8: the send buffer
    residual,  # compute dtype: out, the new residuals (divided by the loss scale)
    k,
    DESTS: tl.constexpr,
    WIDTH: tl.constexpr,
    ITEM: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ALL: tl.constexpr,
    EXACT: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Pass 3: the selection again, each selected element's code (its index in its
    owner's chunk times 2, plus 1 if negative; values="exact": the index, and the value)
    at its place in its message, and each element's new residual G - sent."""
    t, row, bins, idx, lanes, big, sel = _bins(progs, segs, g_ptr, r_ptr, rscale, HAS_SCALE, ALL, ROWS, COLS)
    if EXACT:
        sent = tl.where(sel, big, 0.0)
    else:
        scale = tl.load(seg_scale + t)
        sign = tl.where(big > 0, 1.0, tl.where(big < 0, -1.0, 0.0)).to(big.dtype)
        sent = tl.where(sel, sign * scale, 0.0)
    new = big - sent
    if HAS_SCALE:
        new = (new.to(tl.float64) / tl.load(rscale).to(tl.float64)).to(big.dtype)
    tl.store(residual + tl.load(row + SEG_ROFF) + idx, new, mask=lanes)
    nbins = tl.load(row + SEG_NBINS)
    per = (nbins + DESTS - 1) // DESTS
    j = bins // per
    ok = bins < nbins
    msg = table + (j * k + t) * MSG_COLS
    prefix = tl.load(bin_prefix + tl.load(row + SEG_BIN0) + bins, mask=ok, other=0)
    rank = tl.cumsum(sel.to(tl.int64), axis=1) - sel.to(tl.int64)
    place = prefix[:, None] + rank
    local = idx - (j * per * tl.load(row + SEG_BIN))[:, None]
    code_at = tl.load(msg + MSG_CODE, mask=ok, other=0)[:, None] + WIDTH * place
    if EXACT:
        _store_bytes(out, code_at, local, sel, WIDTH)
        value_at = tl.load(msg + MSG_VALUE, mask=ok, other=0)[:, None] + ITEM * place
        _store_bytes(out, value_at, _float_bits(big, ITEM), sel, ITEM)
    else:
        _store_bytes(out, code_at, local * 2 + (sent < 0).to(tl.int64), sel, WIDTH)


@triton.jit
def decode_kernel(
    msg,  # uint8: one message
    targets,  # int64 [n_segments]: each segment's element 0 in ``dst``
    dst,  # compute dtype: the decoded values are added to it
    k,
    codes,  # codes in the message
    WIDTH: tl.constexpr,
    ITEM: tl.constexpr,
    EXACT: tl.constexpr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A message's codes added to ``dst``, BLOCK codes a program (a message holds each
    element at most once: no two programs touch one element)."""
    ts = tl.arange(0, KP)
    tmask = ts < k
    counts = _load_bytes(msg, 8 * ts, tmask, 8)
    ends = tl.cumsum(counts, axis=0)
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = q < codes
    t = tl.sum((ends[None, :] <= q[:, None]).to(tl.int64), axis=1)
    t = tl.minimum(t, k - 1)
    head = k * (8 + ITEM)
    code = _load_bytes(msg, head + WIDTH * q, live, WIDTH)
    if EXACT:
        at = code
        value = _bits_float(_load_bytes(msg, head + WIDTH * codes + ITEM * q, live, ITEM), ITEM)
    else:
        at = code >> 1
        scale = _bits_float(_load_bytes(msg, 8 * k + ITEM * t, live, ITEM), ITEM)
        value = tl.where((code & 1) != 0, -scale, scale)
    ptr = dst + tl.load(targets + t, mask=live, other=0) + at
    tl.store(ptr, tl.load(ptr, mask=live, other=0.0) + value.to(dst.dtype.element_ty), mask=live)
