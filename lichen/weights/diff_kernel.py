"""The compiled inner loop of xor delta encoding: diff, count, snapshot update and zstd sequence parse of one chunk
(numba; `available()` is False without it, and callers then use the numpy path, which gives the same bytes).

Why: the numpy pipeline makes ~10 passes over each chunk (xor, count, update, zero tests, edge search, byte masks,
row arithmetic) and costs ~0.6 CPU-s per GB of bf16 weights; these two loops cost ~0.25 (measured on a 0.5B
model's AdamW step), and the publish side of a delta sync is CPU-bound.

`diff_parse(d, o, update, w0, state, prev, rows, scratch)` works on the little-endian words d[0..m) (the new
bytes, in place becoming x = new ^ old) and o[0..m) (the old bytes; set to the new ones when `update`), which are
the words w0..w0+m of the whole array:
1. `xor_pass` (branch-free, vectorized): x, the snapshot update, the count of nonzero bytes (added to `changed`)
   and a flag per word (x != 0) in `scratch`;
2. `parse`: finds the edges of the zero-word runs eight flags at a time and appends to `rows` the ZSTD_Sequence
   rows (offset 1, litLength, matchLength, 0) of every maximal run of zero words [lo, hi) that ends in this chunk,
   exactly as lichen.weights.zstd_seq's parse does:
     ms = 8*(lo - 1) + k + 2 with k the highest nonzero byte of word lo - 1 (ms = 1 when lo = 0),
     me = 8*hi + j with j the lowest nonzero byte of word hi, litLength = ms - (the previous row's me),
     matchLength = me - ms.
State carried between chunks: state = int64[open_lo (first word of a zero run still open, or -1), prev_end (byte
where the last match ended), count (rows written), changed]; prev = uint64[1], the nonzero word before the open
run. `rows` needs room for count + m // 2 + 2 rows (a chunk ends at most that many runs).

The kernels compile on first use (a few seconds) and are cached on disk (numba's cache, next to this file or in
the user's cache directory); `warm()` does that ahead of time, and a self-test must pass before they are used.
LICHEN_NUMBA=0 turns them off.
"""

from __future__ import annotations

import os
import threading

import numpy as np

_kernel = None
_state = "unloaded"  # "unloaded" | "ok" | "unavailable: <why>"
_lock = threading.Lock()


def _build(cache: bool = True):
    import numba
    from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

    u = np.uint64
    low7, high1, zero, byte = u(0x7F7F7F7F7F7F7F7F), u(0x8080808080808080), u(0), u(255)
    lanes16 = u(0x00FF00FF00FF00FF)

    @numba.njit(nogil=True, cache=cache)
    def lane_sum(acc):
        return np.int64((acc & u(0xFFFF)) + ((acc >> u(16)) & u(0xFFFF)) + ((acc >> u(32)) & u(0xFFFF)) + (acc >> u(48)))

    @numba.njit(nogil=True, cache=cache)
    def xor_block(d, o, update, nz):
        """xor_pass on at most 65535 words. Loops run from 0 over whole arrays: numba then knows the indices are
        not negative, and LLVM vectorizes them (with range(a, b) it did not: 6x slower)."""
        even = zero  # 16-bit lanes: nonzero-byte counts of bytes 0, 2, 4, 6 (and 1, 3, 5, 7 in `odd`)
        odd = zero
        if update:
            for i in range(d.shape[0]):
                new = d[i]
                x = new ^ o[i]
                o[i] = new
                d[i] = x
                f = ((((x & low7) + low7) | x) & high1) >> u(7)
                even += f & lanes16
                odd += (f >> u(8)) & lanes16
                nz[i] = np.uint8(x != zero)
        else:
            for i in range(d.shape[0]):
                x = d[i] ^ o[i]
                d[i] = x
                f = ((((x & low7) + low7) | x) & high1) >> u(7)
                even += f & lanes16
                odd += (f >> u(8)) & lanes16
                nz[i] = np.uint8(x != zero)
        return lane_sum(even) + lane_sum(odd)

    @numba.njit(nogil=True, cache=cache)
    def xor_pass(d, o, update, nz):
        """d = d ^ o (o = the old d where `update`), nz[i] = (d[i] != 0); returns the count of nonzero bytes."""
        changed = np.int64(0)
        for b0 in range(0, d.shape[0], 65535):  # a 16-bit lane counts at most 65535 words
            b1 = min(b0 + 65535, d.shape[0])
            changed += xor_block(d[b0:b1], o[b0:b1], update, nz[b0:b1])
        return changed

    @numba.njit(nogil=True, cache=cache)
    def parse(d, nz, w0, state, prev, rows):
        """Rows of the zero-word runs, from the flags `nz` (padded with zeros to a multiple of 8 flags; edges are
        found eight words at a time)."""
        m = d.shape[0]
        flags = nz.view(np.uint64)
        open_lo, prev_end, count = state[0], state[1], state[2]
        last = prev[0]  # the nonzero word before the open run (word open_lo - 1)
        flag_prev = zero if open_lo >= 0 else u(1)  # the flag of the word before d[0]
        for q in range(flags.shape[0]):
            f = flags[q]
            g = 8 * q
            edges = f ^ ((f << u(8)) | flag_prev)
            n = m - g
            if n < 8:  # flags past the end must not look like edges
                edges &= (u(1) << u(8 * n)) - u(1)
                flag_prev = (f >> u(8 * (n - 1))) & byte
            else:
                flag_prev = f >> u(56)
            while edges != zero:
                i = g + (np.int64(trailing_zeros(edges)) >> 3)
                edges &= edges - u(1)
                if nz[i]:  # a zero run [open_lo, w0 + i) ends here
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

    @numba.njit(nogil=True, cache=cache)
    def diff_parse(d, o, update, w0, state, prev, rows, nz):
        m = d.shape[0]
        padded = (m + 7) // 8 * 8
        nz[m:padded] = 0
        state[3] += xor_pass(d, o, update, nz[:m])
        parse(d, nz[:padded], w0, state, prev, rows)

    return diff_parse


def _self_test(kernel) -> str | None:
    """Compile (or load) the kernel and check it on a small case against a plain-Python reading of the rule."""
    d = np.array([0, 0x0100, 0, 0, 0xFF00000000000000, 0x01], dtype=np.uint64)
    new = d.copy()
    o = np.zeros_like(d)
    state = np.array([-1, 0, 0, 0], np.int64)
    prev = np.zeros(1, np.uint64)
    rows = np.zeros((8, 4), np.uint32)
    kernel(d, o, True, 0, state, prev, rows, np.zeros(8, np.uint8))
    # runs: [0,1) -> ms 1, me 8+1 = 9; [2,4) -> word 1's highest byte 1: ms 8+1+2 = 11, me 32+7 = 39
    want = [(1, 8), (11 - 9, 39 - 11)]
    got = [(int(r[1]), int(r[2])) for r in rows[: state[2]]]
    if got != want or int(state[3]) != 3 or state[0] != -1 or not np.array_equal(o, new):
        return f"self-test gave rows {got}, changed {int(state[3])}"
    return None


def _load():
    global _kernel, _state
    with _lock:
        if _state != "unloaded":
            return _kernel
        if os.environ.get("LICHEN_NUMBA", "1") == "0":
            _state = "unavailable: LICHEN_NUMBA=0"
            return None
        try:
            try:
                kernel = _build()
                problem = _self_test(kernel)
            except RuntimeError as e:  # numba found no writable cache directory: compile in memory each run
                if "cannot cache" not in str(e):
                    raise
                kernel = _build(cache=False)
                problem = _self_test(kernel)
        except Exception as e:  # no numba, or it cannot compile here: the numpy path does the same work
            problem = f"{type(e).__name__}: {e}"
        if problem:
            _state = f"unavailable: {problem}"
            return None
        _kernel, _state = kernel, "ok"
        return _kernel


def available() -> bool:
    """Whether the compiled kernel can be used (compiles or loads it on first call)."""
    return _load() is not None


def status() -> str:
    """"ok" or "unavailable: <why>"."""
    _load()
    return _state


def warm() -> None:
    """Compile (or load from numba's cache) now, e.g. before a timed sync."""
    _load()


def diff_parse(d: np.ndarray, o: np.ndarray, update: bool, w0: int, state: np.ndarray, prev: np.ndarray,
               rows: np.ndarray, scratch: np.ndarray) -> None:
    """The kernel described in the module doc (call `available()` first); `scratch`: a uint8 array of at least
    d.size rounded up to a multiple of 8 elements (the per-word nonzero flags)."""
    _load()(d, o, update, w0, state, prev, rows, scratch)
