"""The compiled inner loops of delta encoding: for xor, diff, count, snapshot update and zstd sequence parse of one
chunk; for overwrite, the offsets and new values of the changed bytes (`changed_bytes`). numba; `available()` is
False without it, and callers then use the numpy path, which gives the same bytes.

Why: the numpy pipeline makes ~10 passes over each chunk (xor, count, update, zero tests, edge search, byte masks,
row arithmetic) and costs ~0.6 CPU-s per GB of bf16 weights; these two loops cost ~0.17 (measured on a 0.5B
model's AdamW step), and the publish side of a delta sync is CPU-bound.

`diff_parse(d, o, update, w0, state, prev, rows, scratch)` works on the little-endian words d[0..m) (the new
bytes, in place becoming x = new ^ old) and o[0..m) (the old bytes; set to the new ones when `update`), which are
the words w0..w0+m of the whole array:
1. `xor_pass` (branch-free, vectorized): x, the snapshot update, the count of nonzero bytes (added to `changed`)
   and a flag per word (x != 0) in `scratch`;
2. `parse`: finds the edges of the zero-word runs 64 flags at a time (a bit mask) and appends to `rows` the
   ZSTD_Sequence rows (offset 1, litLength, matchLength, 0) of every maximal run of zero words [lo, hi) that
   ends in this chunk, exactly as lichen.weights.zstd_seq's parse does:
     ms = 8*(lo - 1) + k + 2 with k the highest nonzero byte of word lo - 1 (ms = 1 when lo = 0),
     me = 8*hi + j with j the lowest nonzero byte of word hi, litLength = ms - (the previous row's me),
     matchLength = me - ms.
State carried between chunks: state = int64[open_lo (first word of a zero run still open, or -1), prev_end (byte
where the last match ended), count (rows written), changed]; prev = uint64[1], the nonzero word before the open
run. `rows` needs room for count + m // 2 + 2 rows (a chunk ends at most that many runs).

The numba functions live in lichen.weights._diff_kernel_jit, imported on first use; they compile then (a few
seconds) and are cached on disk (numba's cache, next to that file or in the user's cache directory; compiled in
memory where neither is writable), so later processes load them in ~2 s, most of it numba's own start-up.
`warm()` does that ahead of time, and a self-test must pass before they are used. LICHEN_NUMBA=0 turns them off.
"""

from __future__ import annotations

import numpy as np

from lichen.weights.native import Native


def _build():
    from lichen.weights import _diff_kernel_jit

    return _diff_kernel_jit


def _self_test(kernel) -> str | None:
    """Compile (or load) the kernel and check it on a small case against a plain-Python reading of the rule."""
    d = np.array([0, 0x0100, 0, 0, 0xFF00000000000000, 0x01], dtype=np.uint64)
    new = d.copy()
    o = np.zeros_like(d)
    state = np.array([-1, 0, 0, 0], np.int64)
    prev = np.zeros(1, np.uint64)
    rows = np.zeros((8, 4), np.uint32)
    kernel.diff_parse(d, o, True, 0, state, prev, rows, np.zeros(64, np.uint8))
    # runs: [0,1) -> ms 1, me 8+1 = 9; [2,4) -> word 1's highest byte 1: ms 8+1+2 = 11, me 32+7 = 39
    want = [(1, 8), (11 - 9, 39 - 11)]
    got = [(int(r[1]), int(r[2])) for r in rows[: state[2]]]
    if got != want or int(state[3]) != 3 or state[0] != -1 or not np.array_equal(o, new):
        return f"self-test gave rows {got}, changed {int(state[3])}"
    if kernel.row_totals(rows[: state[2]]) != (39, 8):
        return "row_totals self-test failed"
    return None


_native = Native(_build, _self_test, "LICHEN_NUMBA")  # without numba: "unavailable: ModuleNotFoundError: ..."


def available() -> bool:
    """Whether the compiled kernels can be used (compiles or loads them on first call)."""
    return _native.available()


def status() -> str:
    """ "ok" or "unavailable: <why>"."""
    return _native.status()


def warm() -> None:
    """Compile (or load from numba's cache) now, e.g. before a timed sync."""
    _native.get()


def diff_parse(
    d: np.ndarray,
    o: np.ndarray,
    update: bool,
    w0: int,
    state: np.ndarray,
    prev: np.ndarray,
    rows: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """The kernel described in the module doc (call `available()` first); `scratch`: a uint8 array of at least
    d.size rounded up to a multiple of 64 elements (the per-word nonzero flags)."""
    _native.value.diff_parse(d, o, update, w0, state, prev, rows, scratch)


def row_totals(rows: np.ndarray) -> tuple[int, int]:
    """(sum of litLength + matchLength, smallest matchLength) of (n >= 1, 4) uint32 ZSTD_Sequence rows."""
    covered, shortest = _native.value.row_totals(rows)
    return int(covered), int(shortest)


def changed_bytes(x: np.ndarray, old: np.ndarray, old_is_new: bool, pos: np.ndarray, val: np.ndarray) -> int:
    """Offsets (into `pos`, uint32) and new values (into `val`, uint8) of the nonzero bytes of the xor bytes `x`;
    returns their count (the arrays need room for all of them). Call `available()` first."""
    return int(_native.value.changed_bytes(x, old, old_is_new, pos, val))


def xor_count(d: np.ndarray, o: np.ndarray, update: bool) -> int:
    """d = d ^ o over uint8 arrays of equal length (o = the old d where `update`); returns the count of nonzero
    bytes of the result. Call `available()` first."""
    return int(_native.value.xor_count(d, o, update))
