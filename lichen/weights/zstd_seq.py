"""A fast zstd encoder for sparse byte strings (xor deltas): the sequences are found by us (numpy, or the compiled
pass of lichen.weights.diff_kernel through `Parser.diff`), only the entropy coding is left to libzstd
(`ZSTD_compressSequences`, through ctypes on the system's libzstd).

Why: zstd's own match finder spends ~90 ns per match on a xor delta of a bf16 model after one small optimizer
step (a nonzero byte every ~50 bytes), 0.5 GB/s per core; the delta's structure is known, so the matches are too.
The frame is an ordinary zstd frame (any zstd decoder reads it; content size in the header), so the on-disk
format (docs/weight-format.md#xor) does not change, and the frames decode faster (one simple match per zero run).

Parse, on the little-endian 8-byte words w[0..W) of the input x (n bytes, W = n // 8): every maximal run of zero
words [lo, hi) becomes one zstd sequence (literals x[prev_me : ms], then a match of offset 1 and length me - ms):
  ms = 8*(lo - 1) + k + 2, k = index (0..7) of the highest nonzero byte of w[lo - 1]
       (the match repeats the zero byte at ms - 1, so one zero literal follows the last nonzero byte); ms = 1
       when lo = 0;
  me = 8*hi + j, j = index of the lowest nonzero byte of w[hi]; me = 8*W when hi = W;
and prev_me is the previous sequence's me (0 first). An offset-1 match is an overlapping copy of the byte before
it, and every byte in [ms - 1, me) is zero, so the match reproduces the run. Runs are >= 8 bytes, so matches are
>= 7 bytes (zstd's minimum is 3). The bytes after the last match (the n % 8 tail included) are the frame's last
literals. libzstd splits sequences at its 128 KiB block boundaries itself (`ZSTD_sf_noBlockDelimiters`, the
default). k and j come from an exact byte mask of the word (no floating point).

The library is used only when it loads, is >= 1.5.0 and passes a round-trip self-test against python-zstandard's
decoder; otherwise `available()` is False and callers use python-zstandard's own compressor. The environment
variable LICHEN_ZSTD_SEQUENCES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np
import zstandard

from lichen.weights import diff_kernel
from lichen.weights.native import Native, Unavailable

_MIN_VERSION = 10500  # 1.5.0
_ZSTD_C_COMPRESSION_LEVEL = 100
_ZSTD_C_CONTENT_SIZE_FLAG = 200
_ZSTD_RESET_SESSION_ONLY = 1
_MAX_BYTES = (1 << 32) - 1  # ZSTD_Sequence lengths are unsigned 32-bit
_PARSE_CHUNK_WORDS = 1 << 17  # parse 1 MiB of input at a time (cache-sized temporaries)
_LOW7, _HIGH1 = np.uint64(0x7F7F7F7F7F7F7F7F), np.uint64(0x8080808080808080)
_GATHER = np.uint64(0x0102040810204080)  # bit 8i -> bit 56 + i, without collisions in the top byte
_HIGHEST = np.array([max(i for i in range(8) if m >> i & 1) if m else 0 for m in range(256)], dtype=np.int64)
_LOWEST = np.array([min(i for i in range(8) if m >> i & 1) if m else 0 for m in range(256)], dtype=np.int64)

_local = threading.local()


def _bind(lib) -> None:
    c_size, c_void = ctypes.c_size_t, ctypes.c_void_p
    lib.ZSTD_versionNumber.restype = ctypes.c_uint
    lib.ZSTD_createCCtx.restype = c_void
    lib.ZSTD_freeCCtx.argtypes = [c_void]
    lib.ZSTD_freeCCtx.restype = c_size
    lib.ZSTD_CCtx_setParameter.argtypes = [c_void, ctypes.c_int, ctypes.c_int]
    lib.ZSTD_CCtx_setParameter.restype = c_size
    lib.ZSTD_CCtx_reset.argtypes = [c_void, ctypes.c_int]
    lib.ZSTD_CCtx_reset.restype = c_size
    lib.ZSTD_compressSequences.argtypes = [c_void, c_void, c_size, c_void, c_size, c_void, c_size]
    lib.ZSTD_compressSequences.restype = c_size
    lib.ZSTD_compressBound.argtypes = [c_size]
    lib.ZSTD_compressBound.restype = c_size
    lib.ZSTD_isError.argtypes = [c_size]
    lib.ZSTD_isError.restype = ctypes.c_uint
    lib.ZSTD_getErrorName.argtypes = [c_size]
    lib.ZSTD_getErrorName.restype = ctypes.c_char_p


def _open_library():
    names = ["libzstd.so.1", ctypes.util.find_library("zstd"), "libzstd.dylib", "libzstd.1.dylib"]
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _self_test() -> str | None:
    """Round-trip awkward inputs (empty, tiny, dense, sparse, multi-block) through python-zstandard's decoder."""
    rng = np.random.default_rng(1234)
    cases = [
        np.zeros(0, np.uint8),
        np.zeros(5, np.uint8),
        np.arange(1, 12, dtype=np.uint8),
        np.zeros(300_001, np.uint8),
    ]
    for n, density in ((4099, 0.3), (300_003, 0.02), (300_000, 0.9), (200_000, 0.0005)):
        cases.append(((rng.random(n) < density) * rng.integers(1, 256, n)).astype(np.uint8))
    for x in cases:
        frame = _compress(x, 1)
        if zstandard.frame_content_size(frame) != x.size:
            return "the frame does not record its content size"
        back = zstandard.ZstdDecompressor().decompress(frame) if x.size else b""
        if back != x.tobytes():
            return "the self-test round trip differs"
    return None


def _load_library():
    lib = _open_library()
    if lib is None:
        raise Unavailable("no libzstd shared library found")
    try:
        _bind(lib)
        version = lib.ZSTD_versionNumber()
    except AttributeError as e:
        raise Unavailable(f"libzstd lacks {e}") from None
    if version < _MIN_VERSION:
        raise Unavailable(f"libzstd {version} is older than 1.5.0")
    return lib


_native = Native(_load_library, lambda lib: _self_test(), "LICHEN_ZSTD_SEQUENCES")


def available() -> bool:
    """Whether the sequence encoder can be used (loads and self-tests libzstd on first call)."""
    return _native.available()


def status() -> str:
    """ "ok" or "unavailable: <why>"."""
    return _native.status()


class _Context:
    """One ZSTD_CCtx and output buffer per thread (a CCtx is not thread-safe); freed with the thread."""

    def __init__(self, lib):
        self.lib = lib
        self.cctx = lib.ZSTD_createCCtx()
        if not self.cctx:
            raise MemoryError("ZSTD_createCCtx failed")
        self.level: int | None = None
        self.out = np.empty(0, np.uint8)

    def __del__(self):
        if getattr(self, "cctx", None):
            self.lib.ZSTD_freeCCtx(self.cctx)
            self.cctx = None


def _context(level: int) -> _Context:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = _local.ctx = _Context(_native.value)
    # a session left by the last call (done, or failed for a small buffer) must end before parameters change
    _check(ctx.lib.ZSTD_CCtx_reset(ctx.cctx, _ZSTD_RESET_SESSION_ONLY))
    if ctx.level != level:
        _check(ctx.lib.ZSTD_CCtx_setParameter(ctx.cctx, _ZSTD_C_COMPRESSION_LEVEL, level))
        _check(ctx.lib.ZSTD_CCtx_setParameter(ctx.cctx, _ZSTD_C_CONTENT_SIZE_FLAG, 1))
        ctx.level = level
    return ctx


def _check(code: int) -> int:
    lib = _native.value
    if lib.ZSTD_isError(code):
        raise RuntimeError(f"libzstd: {lib.ZSTD_getErrorName(code).decode(errors='replace')}")
    return code


def _byte_mask(words: np.ndarray) -> np.ndarray:
    """Per nonzero u64: an 8-bit mask whose bit i says byte i (little-endian) is nonzero (SWAR: set bit 7 of each
    nonzero byte without carries between bytes, then gather the eight bit-7s into the top byte by a multiply)."""
    flags = (((words & _LOW7) + _LOW7) | words) & _HIGH1
    return ((flags >> np.uint64(7)) * _GATHER) >> np.uint64(56)


class Parser:
    """The parse above, fed incrementally: `feed(w)` parses the words below w (call it as the bytes of x become
    final, e.g. chunk by chunk while they are still in cache), `finish()` returns the (n_seq, 4) uint32
    ZSTD_Sequence array (offset, litLength, matchLength, rep). Rows go straight into a per-thread array whose
    constant columns are filled once."""

    def __init__(self, x: np.ndarray):
        self.x = x
        self.n_words = x.size // 8
        self.words = x[: 8 * self.n_words].view(np.uint64)
        self.fed = 0  # words parsed so far
        self.count = 0  # rows written
        self.prev_end = 0  # byte where the last match ends (the next literals start there)
        self.open_lo = -1  # first word of a zero run that reached the end of the words parsed so far
        self.rows = getattr(_local, "rows", None)
        if self.rows is None:
            self.rows = _local.rows = _new_rows(1 << 14)
        self.kernel_state: np.ndarray | None = None  # diff(): [open_lo, prev_end, count, changed] of diff_kernel
        self.kernel_prev = np.zeros(1, np.uint64)

    def diff(self, start: int, stop: int, old: np.ndarray, update_old: bool) -> int:
        """With the compiled kernel (lichen.weights.diff_kernel; check `diff_kernel.available()`): x[start:stop]
        holds the new bytes, `old` the old bytes of the whole array; x[start:stop] becomes new ^ old, `old` takes
        the new bytes there (with `update_old`), and those bytes are parsed, all in one pass. Returns the count of
        changed bytes. Chunks go in order; `start` is a multiple of 8. Not to be mixed with `feed`."""
        if start % 8 or start != 8 * self.fed:
            raise ValueError(f"diff chunks go in order from word boundaries; got byte {start} after word {self.fed}")
        if self.kernel_state is None:
            self.kernel_state = np.array([self.open_lo, self.prev_end, self.count, 0], np.int64)
        w0, w1 = start // 8, min(stop // 8, self.n_words)
        changed = 0
        if w1 > w0:
            self._reserve(int(self.kernel_state[2]), (w1 - w0) // 2 + 2)
            before = int(self.kernel_state[3])
            flags = getattr(_local, "flags", None)
            if flags is None or flags.size < w1 - w0 + 64:
                flags = _local.flags = np.empty(max(w1 - w0 + 64, _PARSE_CHUNK_WORDS + 64), np.uint8)
            diff_kernel.diff_parse(
                self.words[w0:w1],
                old[8 * w0 : 8 * w1].view(np.uint64),
                update_old,
                w0,
                self.kernel_state,
                self.kernel_prev,
                self.rows,
                flags,
            )
            changed = int(self.kernel_state[3]) - before
            self.fed = w1
        if stop > 8 * w1:  # the last few bytes of x (not a whole word): literals at the end of the frame
            changed += diff_kernel.xor_count(self.x[8 * w1 : stop], old[8 * w1 : stop], update_old)
        return changed

    def _finish_kernel(self) -> None:
        """Close a zero run that reaches the last word (no nonzero word after it: it ends at byte 8 * n_words)."""
        st = self.kernel_state
        if self.fed != self.n_words:
            raise ValueError(f"diff() parsed {self.fed} of {self.n_words} words")
        self.open_lo, self.prev_end, self.count = int(st[0]), int(st[1]), int(st[2])
        self.kernel_state = None
        if self.open_lo < 0:
            return
        lo = self.open_lo
        last = int(self.kernel_prev[0])
        start = 1 if lo == 0 else 8 * (lo - 1) + max(i for i in range(8) if last >> (8 * i) & 255) + 2
        end = 8 * self.n_words
        self._reserve(self.count, 1)
        self.rows[self.count, 1:3] = (start - self.prev_end, end - start)
        self.count += 1
        self.prev_end, self.open_lo = end, -1

    def _reserve(self, used: int, more: int) -> None:
        """Room for `more` rows after the first `used` (kept), growing the per-thread array at least twofold."""
        if used + more > self.rows.shape[0]:
            grown = _new_rows(max(2 * self.rows.shape[0], used + more))
            grown[:used] = self.rows[:used]
            self.rows = _local.rows = grown

    def feed(self, upto_word: int) -> None:
        if self.kernel_state is not None:
            raise ValueError("this parser is fed by diff()")
        upto_word = min(upto_word, self.n_words)
        while self.fed < upto_word:
            w1 = min(self.fed + _PARSE_CHUNK_WORDS, upto_word)
            self._chunk(self.fed, w1)
            self.fed = w1

    def _chunk(self, w0: int, w1: int) -> None:
        zero = self.words[w0:w1] == 0
        change = np.flatnonzero(zero[1:] != zero[:-1])
        lead, trail = bool(zero[0]), bool(zero[-1])
        edges = np.empty(change.size + lead + trail, np.int64)
        if lead:
            edges[0] = w0
        np.add(change, w0 + 1, out=edges[lead : lead + change.size])
        if trail:
            edges[-1] = w1
        lo, hi = edges[0::2], edges[1::2]
        if self.open_lo >= 0:
            if lead:  # the open run continues into this chunk
                lo[0] = self.open_lo
            else:  # it ended exactly at the chunk edge
                lo, hi = np.concatenate(([self.open_lo], lo)), np.concatenate(([w0], hi))
            self.open_lo = -1
        if trail and w1 < self.n_words:  # may continue past the words parsed so far
            self.open_lo = int(lo[-1])
            lo, hi = lo[:-1], hi[:-1]
        if lo.size:
            self._rows(lo, hi)

    def _rows(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Rows for the zero-word runs [lo, hi) (absolute word indices, ascending, all parsed)."""
        words = self.words
        start = 8 * lo + _HIGHEST[_byte_mask(words[lo - 1])] - 6  # lo == 0 (only first) wraps; fixed below
        if lo[0] == 0:
            start[0] = 1
        end = 8 * hi
        if hi[-1] == self.n_words:  # only possible last: no word after it
            end[:-1] += _LOWEST[_byte_mask(words[hi[:-1]])]
        else:
            end += _LOWEST[_byte_mask(words[hi])]
        k, c = lo.size, self.count
        self._reserve(c, k)
        out = self.rows[c : c + k]
        out[0, 1] = start[0] - self.prev_end
        np.subtract(start[1:], end[:-1], out=out[1:, 1], casting="unsafe")
        np.subtract(end, start, out=out[:, 2], casting="unsafe")
        self.count += k
        self.prev_end = int(end[-1])

    def finish(self) -> np.ndarray:
        if self.kernel_state is not None:
            self._finish_kernel()
        else:
            self.feed(self.n_words)
        return self.rows[: self.count]


def _new_rows(n: int) -> np.ndarray:
    rows = np.empty((n, 4), np.uint32)
    rows[:, 0] = 1  # offset 1: repeat the previous (zero) byte
    rows[:, 3] = 0
    return rows


def _compress(x: np.ndarray, level: int, parser: Parser | None = None) -> bytes:
    ctx = _context(level)
    seqs = (parser or Parser(x)).finish()
    # libzstd trusts the sequences (no validation): never let a parse error read outside x
    if seqs.shape[0]:
        covered, shortest = (
            diff_kernel.row_totals(seqs)
            if diff_kernel.available()
            else (int(seqs[:, 1].sum(dtype=np.int64)) + int(seqs[:, 2].sum(dtype=np.int64)), int(seqs[:, 2].min()))
        )
        if covered > x.size or shortest < 3:
            raise AssertionError("zstd_seq: the parse does not fit the input")
    # A sparse input compresses to a few percent: start with an eighth of the worst case, retry with all of it.
    for cap in (min(ctx.lib.ZSTD_compressBound(x.size), (1 << 20) + x.size // 8), ctx.lib.ZSTD_compressBound(x.size)):
        if ctx.out.size < cap:
            ctx.out = np.empty(cap, np.uint8)
        _check(ctx.lib.ZSTD_CCtx_reset(ctx.cctx, _ZSTD_RESET_SESSION_ONLY))
        size = ctx.lib.ZSTD_compressSequences(
            ctx.cctx, ctx.out.ctypes.data, cap, seqs.ctypes.data, seqs.shape[0], x.ctypes.data, x.size
        )
        if not ctx.lib.ZSTD_isError(size):
            return ctx.out[:size].tobytes()
        if b"too small" not in ctx.lib.ZSTD_getErrorName(size):
            _check(size)
    return _check(size)  # unreachable: the worst-case bound always fits


def parser_for(x: np.ndarray) -> Parser | None:
    """A Parser to feed while `x` is being written, or None when compress_sparse would not use it."""
    if _native.get() is None or x.size > _MAX_BYTES:
        return None
    return Parser(x)


def compress_sparse(x: np.ndarray, level: int = 1, parser: Parser | None = None) -> bytes | None:
    """One zstd frame (content size recorded) holding the bytes of the 1-D contiguous uint8 array `x`, or None when
    the sequence encoder is unavailable or `x` is too large for it (the caller then compresses with
    python-zstandard). Fast when most 8-byte words of `x` are zero. `parser`: a Parser of `x` already fed some
    of it (see parser_for)."""
    if _native.get() is None or x.size > _MAX_BYTES:
        return None
    if x.dtype != np.uint8 or x.ndim != 1 or not x.flags.c_contiguous:
        raise TypeError("compress_sparse needs a 1-D contiguous uint8 array")
    if parser is not None and parser.x is not x:
        raise ValueError("the parser belongs to another array")
    return _compress(x, level, parser)
