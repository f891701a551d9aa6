"""The numba functions of lichen.weights.diff_kernel (see its doc), at module level so that numba's on-disk cache
works across processes (closures that call each other are recompiled in every process). Imported only by
diff_kernel._load(): importing numba costs ~0.3 s and is not needed unless delta weights are encoded."""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

u = np.uint64
low7, high1, zero, byte = u(0x7F7F7F7F7F7F7F7F), u(0x8080808080808080), u(0), u(255)
lanes16 = u(0x00FF00FF00FF00FF)
gather = u(0x0102040810204080)  # byte i's bit 0 -> bit 56 + i (no carries)


def _jit(fn):
    """njit(nogil, cached on disk); compiled in memory where numba finds no writable cache directory."""
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError as e:
        if "cannot cache" not in str(e):
            raise
        return numba.njit(nogil=True)(fn)


@_jit
def lane_sum(acc):
    return np.int64((acc & u(0xFFFF)) + ((acc >> u(16)) & u(0xFFFF)) + ((acc >> u(32)) & u(0xFFFF)) + (acc >> u(48)))


@_jit
def xor_block(d, o, update, nz):
    """xor_pass on at most 65535 words. The loop runs from 0 over whole arrays: numba then knows the indices are
    not negative, and LLVM vectorizes it (with range(a, b) it did not: 6x slower; the `update` and `nz` tests are
    loop-invariant and hoisted). `nz` None: no flags (numba compiles that case separately)."""
    even = zero  # 16-bit lanes: nonzero-byte counts of bytes 0, 2, 4, 6 (and 1, 3, 5, 7 in `odd`)
    odd = zero
    for i in range(d.shape[0]):
        new = d[i]
        x = new ^ o[i]
        if update:
            o[i] = new
        d[i] = x
        f = ((((x & low7) + low7) | x) & high1) >> u(7)
        even += f & lanes16
        odd += (f >> u(8)) & lanes16
        if nz is not None:
            nz[i] = np.uint8(x != zero)
    return lane_sum(even) + lane_sum(odd)


@_jit
def xor_pass(d, o, update, nz):
    """d = d ^ o (o = the old d where `update`), nz[i] = (d[i] != 0) unless nz is None; returns the count of
    nonzero bytes."""
    changed = np.int64(0)
    for b0 in range(0, d.shape[0], 65535):  # a 16-bit lane counts at most 65535 words
        b1 = min(b0 + 65535, d.shape[0])
        changed += xor_block(d[b0:b1], o[b0:b1], update, None if nz is None else nz[b0:b1])
    return changed


@_jit
def xor_count(d8, o8, update):
    """xor_pass over bytes (any length, no flags): for the overwrite encoding's diff."""
    n_words = d8.shape[0] // 8
    changed = xor_pass(d8[: 8 * n_words].view(np.uint64), o8[: 8 * n_words].view(np.uint64), update, None)
    for i in range(8 * n_words, d8.shape[0]):
        x = d8[i] ^ o8[i]
        if update:
            o8[i] = d8[i]
        d8[i] = x
        changed += x != 0
    return changed


@_jit
def parse(d, nz, w0, state, prev, rows):
    """Rows of the zero-word runs, from the flags `nz` (padded with zeros to a multiple of 64 flags). Edges are
    found 64 words at a time in a bit mask (bit k: word k is nonzero), so the loops branch per edge, not per
    word."""
    m = d.shape[0]
    flags = nz.view(np.uint64)
    open_lo, prev_end, count = state[0], state[1], state[2]
    last = prev[0]  # the nonzero word before the open run (word open_lo - 1)
    bit_prev = zero if open_lo >= 0 else u(1)  # the flag of the word before d[0]
    for q in range(flags.shape[0] // 8):
        mask = zero
        for k in range(8):  # eight 0/1 flag bytes -> eight bits (a multiply gathers them into the top byte)
            mask |= ((flags[8 * q + k] * gather) >> u(56)) << u(8 * k)
        g = 64 * q
        edges = mask ^ ((mask << u(1)) | bit_prev)
        n = m - g
        if n < 64:  # flags past the end must not look like edges
            edges &= (u(1) << u(n)) - u(1)
            bit_prev = (mask >> u(n - 1)) & u(1)
        else:
            bit_prev = mask >> u(63)
        while edges != zero:
            k = np.int64(trailing_zeros(edges))
            edges &= edges - u(1)
            i = g + k
            if (mask >> u(k)) & u(1):  # a zero run [open_lo, w0 + i) ends here
                x = d[i]
                if open_lo == 0:
                    ms = np.int64(1)
                else:  # 8 * (open_lo - 1) + (highest nonzero byte of `last`) + 2
                    ms = 8 * open_lo + 1 - (np.int64(leading_zeros(last)) >> 3)
                me = 8 * (w0 + i) + (np.int64(trailing_zeros(x)) >> 3)
                rows[count, 1] = ms - prev_end
                rows[count, 2] = me - ms
                count += 1
                prev_end = me
                open_lo = -1
            else:  # a zero run starts at word w0 + i; the word before it is nonzero
                open_lo = w0 + i
                if i > 0:
                    last = d[i - 1]
    if open_lo < 0 and m > 0:
        last = d[m - 1]
    state[0], state[1], state[2] = open_lo, prev_end, count
    prev[0] = last


@_jit
def diff_parse(d, o, update, w0, state, prev, rows, nz):
    m = d.shape[0]
    padded = (m + 63) // 64 * 64
    nz[m:padded] = 0
    state[3] += xor_pass(d, o, update, nz[:m])
    parse(d, nz[:padded], w0, state, prev, rows)


@_jit
def row_totals(rows):
    """(sum of litLength + matchLength, smallest matchLength) of ZSTD_Sequence rows, in one pass (numpy's strided
    column sums cost 0.04 CPU-s per GB of weights)."""
    covered = np.int64(0)
    shortest = np.int64(1) << 40
    for i in range(rows.shape[0]):
        covered += np.int64(rows[i, 1]) + np.int64(rows[i, 2])
        shortest = min(shortest, np.int64(rows[i, 2]))
    return covered, shortest


@_jit
def changed_bytes(x, old, old_is_new, pos, val):
    """For the overwrite encoding: pos[c] = offset of the c-th nonzero byte of x (the xor bytes), val[c] = the new
    byte there (old[i] when old_is_new, else old[i] ^ x[i]); returns the count. Nonzero bytes are found inside
    nonzero 8-byte words only (a sparse delta has few)."""
    n = x.shape[0]
    n_words = n // 8
    words = x[: 8 * n_words].view(np.uint64)
    c = 0
    for w in range(n_words):
        v = words[w]
        while v != zero:
            i = 8 * w + (np.int64(trailing_zeros(v)) >> 3)
            v &= ~(byte << u(8 * (i - 8 * w)))
            pos[c] = i
            val[c] = old[i] if old_is_new else old[i] ^ x[i]
            c += 1
    for i in range(8 * n_words, n):
        if x[i] != 0:
            pos[c] = i
            val[c] = old[i] if old_is_new else old[i] ^ x[i]
            c += 1
    return c
