"""The compact encoding of a block of values: one rank's values of several series over several steps,
exact (float64 bit for bit: NaN payloads, -0.0, Inf, subnormals), encoded and decoded with numpy
(issue 17: the chunk layout stores one such block per row instead of one row per value).

A block is `steps` (int64, strictly increasing, >= 0), `series` (int64 ids, one per row) and `values`
(float64, series x steps) with `present` (bool, same shape): a value not measured at a step (null in the
batch) is absent, which is not the same as a NaN that was measured. Encoded:

    zstd( VERSION | n_steps | n_series | steps | series | presence | modes | scales | planes )

- steps: the first, then each gap minus one, as unsigned LEB128 varints (consecutive steps: zero bytes);
- series: the first id, then zigzag deltas, varints;
- presence: one byte, 0 when every value is present, else 1 and the bitmap (`np.packbits`, row major);
- values, row by row, only the present ones, each row in the cheapest of three forms:
  - float32: every value survives a round trip through float32 bit for bit (the agent's losses, norms and
    amax are float32 tensors' `.item()`): 4 bytes a value;
  - decimal: every value is k / 10**d for one d <= MAX_DECIMALS, bit for bit as decoded (the agent's
    timings, milliseconds rounded to the microsecond; whole numbers with d = 0): the integers k, 8 bytes;
  - binary: every value is k / 2**e for one 1 <= e <= MAX_BINARY (the agent's memory in MiB, byte counts
    of the allocator's 512-byte granules: k / 2**11): the integers k, 8 bytes. As float64 words their
    significant bits straddle the byte planes wherever the exponent puts them;
  - float64: anything else, 8 bytes.
  A row takes the cheapest form it qualifies for. The mode byte of a row holds its width (4 or 8) and
  transform; its scale byte d + 1 for a decimal row, BINARY + e for a binary one, else 0 (version 1 has no
  scale bytes and no decimal rows, version 2 no binary rows; both are still decoded). Each word is XORed
  with the previous one of its row (Gorilla's idea: a repeated or close value leaves mostly zero bits)
  or differenced once or twice (zigzagged), whichever leaves the row fewest significant bytes, and the
  words of one form are split into byte planes (all first bytes, then all second bytes, ...), so that
  the nearly constant high bytes sit together for zstd.

Everything is one zstd frame (level `LEVEL`). Decoding inverts each step; a block that does not parse
raises `CorruptBlock` naming what is wrong.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

VERSION = 3  # 1: no decimal rows (no scale bytes), 2: no binary rows; both still decoded
VERSIONS = (1, 2, 3)
MAX_DECIMALS = 6  # a decimal row's values are k / 10**d, d <= 6 (microseconds of a time in seconds)
BINARY = 128  # a binary row's scale byte is BINARY + e: its values are k / 2**e
MAX_BINARY = 127
LEVEL = 3  # zstd: ~same ratio as 9 on these planes at a fraction of the CPU
_U64 = np.uint64
_ZSTD = threading.local()  # zstandard's (de)compressor objects are not thread-safe: one pair per thread


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_ZSTD, "pair", None)
    if pair is None:
        pair = _ZSTD.pair = (zstandard.ZstdCompressor(level=LEVEL), zstandard.ZstdDecompressor())
    return pair


MAX_BLOCK_BYTES = 256 * 1024 * 1024  # decoded size bound: a block is a batch's values at most (16 MiB)


class CorruptBlock(ValueError):
    """An encoded block that cannot be decoded."""


@dataclass(frozen=True, slots=True)
class Block:
    steps: np.ndarray  # int64 [n], strictly increasing, >= 0
    series: np.ndarray  # int64 [m]
    values: np.ndarray  # float64 [m, n]; where not `present` the value is 0.0 and means nothing
    present: np.ndarray  # bool [m, n]

    def __post_init__(self) -> None:
        n, m = self.steps.shape[0], self.series.shape[0]
        if self.values.shape != (m, n) or self.present.shape != (m, n):
            raise ValueError(f"block: values and present must be series x steps ({m} x {n})")
        if n and (self.steps[0] < 0 or (n > 1 and np.any(np.diff(self.steps) <= 0))):
            raise ValueError("block: steps must be non-negative and strictly increasing")


# -- varints ------------------------------------------------------------------------------------
def _varints(x: np.ndarray) -> bytes:
    """Unsigned LEB128 of each uint64 in `x`, vectorised: 7 bits a byte, high bit = more follow."""
    return _leb128(x)[0].tobytes()


def _leb128(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_varints` of `x` as uint8, and where each value's bytes end in it."""
    x = np.ascontiguousarray(x, dtype=_U64)
    if x.size == 0:
        return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.int64)
    nbytes = np.ones(x.shape, dtype=np.int64)
    for k in range(1, 10):
        nbytes += x >= (_U64(1) << _U64(7 * k))
    ends = np.cumsum(nbytes)
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    starts = ends - nbytes
    for k in range(10):  # byte k of every value that has one
        has = nbytes > k
        if not has.any():
            break
        chunk = ((x[has] >> _U64(7 * k)) & _U64(0x7F)).astype(np.uint8)
        more = (nbytes[has] > k + 1).astype(np.uint8) << np.uint8(7)
        out[starts[has] + k] = chunk | more
    return out, ends


_FEW_VARINTS = 16  # up to this many varints are read by a Python loop, cheaper than numpy's calls for so few
_U64_MASK = (1 << 64) - 1


def _read_varints(buf: np.ndarray, pos: int, count: int) -> tuple[np.ndarray, int]:
    """`count` varints from `buf` (uint8) at `pos`: (values as uint64, the position after them)."""
    if count <= _FEW_VARINTS:
        return _read_few_varints(buf, pos, count)
    # The common case, checked in two calls: the first varint of any length, each other one a byte (the
    # gaps of consecutive steps or ranks).
    first, at = _read_few_varints(buf, pos, 1)
    rest = buf[at : at + count - 1]
    if rest.size == count - 1 and rest.max() < 0x80:
        return np.concatenate([first, rest.astype(_U64)]), at + count - 1
    tail = buf[pos : pos + 10 * count]
    last = np.flatnonzero(tail < 0x80)  # a varint's last byte has the high bit clear
    if last.size < count:
        raise CorruptBlock(f"block: {count} varints expected, {last.size} found")
    ends = last[:count] + 1
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    if lengths.max() > 10:
        raise CorruptBlock("block: a varint longer than 10 bytes")
    out = np.zeros(count, dtype=_U64)
    for k in range(int(lengths.max())):
        has = lengths > k
        out[has] |= (tail[starts[has] + k].astype(_U64) & _U64(0x7F)) << _U64(7 * k)
    return out, pos + int(ends[-1])


def _read_few_varints(buf: np.ndarray, pos: int, count: int) -> tuple[np.ndarray, int]:
    """`_read_varints` of a few, one byte at a time."""
    values, end = _varint_list(buf[pos : pos + 10 * count].tobytes(), 0, count)
    return np.array(values, dtype=_U64), pos + end


def _varint_list(data: bytes, pos: int, count: int) -> tuple[list[int], int]:
    """`count` varints of `data` from `pos` as Python ints (bits past the 64th dropped, as numpy's shifts
    drop them), and the position after them."""
    out: list[int] = []
    i = pos
    for _ in range(count):
        value = 0
        for k in range(11):
            if k == 10:
                raise CorruptBlock("block: a varint longer than 10 bytes")
            if i >= len(data):
                raise CorruptBlock(f"block: {count} varints expected, {len(out)} found")
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << (7 * k)
            if byte < 0x80:
                break
        out.append(value & _U64_MASK)
    return out, i


def _zigzag(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.int64)
    return ((x << np.int64(1)) ^ (x >> np.int64(63))).view(_U64)


def _unzigzag(u: np.ndarray) -> np.ndarray:
    return (u >> _U64(1)).view(np.int64) ^ -(u & _U64(1)).view(np.int64)


# -- transforms of a row's words (XOR or difference with the previous one), over rows laid end to end ------
XOR, DELTA, DELTA2 = 0, 1, 2  # a row's transform: XOR with the previous word, its difference, twice that


def _previous(words: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each word's predecessor in its row (0 for a row's first)."""
    prev = np.empty_like(words)
    if words.size:
        prev[0] = 0
        prev[1:] = words[:-1]
        prev[starts[starts < words.size]] = 0
    return prev


def _undo_running(acc: np.ndarray, starts: np.ndarray, size: int, subtract: bool) -> np.ndarray:
    """Per row, `acc` (a running XOR or wrapping sum over all rows) minus what the rows before added."""
    base = np.zeros(len(starts), dtype=acc.dtype)
    inside = (starts > 0) & (starts <= size)
    base[inside] = acc[starts[inside] - 1]
    lengths = np.diff(np.concatenate([starts, [size]]))
    spread = np.repeat(base, lengths)
    return acc - spread if subtract else acc ^ spread


def _signed(words: np.ndarray) -> np.ndarray:
    return words.view(np.int32 if words.dtype == np.uint32 else np.int64)


def _zig(words: np.ndarray) -> np.ndarray:
    """Zigzag of the two's-complement words (small magnitudes of either sign -> small words)."""
    x = _signed(words)
    shift = 31 if x.dtype == np.int32 else 63
    return ((x << x.dtype.type(1)) ^ (x >> x.dtype.type(shift))).view(words.dtype)


def _unzig(words: np.ndarray) -> np.ndarray:
    one = words.dtype.type(1)
    return ((words >> one) ^ (np.zeros_like(words) - (words & one))).astype(words.dtype)


def _forward(words: np.ndarray, starts: np.ndarray, transform: int) -> np.ndarray:
    if transform == XOR:
        return words ^ _previous(words, starts)
    out = words
    for _ in range(transform):  # DELTA once, DELTA2 twice; wrapping arithmetic, exact both ways
        out = out - _previous(out, starts)
    return _zig(out)


def _backward(coded: np.ndarray, starts: np.ndarray, transform: int) -> np.ndarray:
    if coded.size == 0:
        return coded
    if transform == XOR:
        return _undo_running(np.bitwise_xor.accumulate(coded), starts, coded.size, subtract=False)
    out = _unzig(coded)
    for _ in range(transform):
        out = _undo_running(np.cumsum(out, dtype=out.dtype), starts, out.size, subtract=True)
    return out


def _sig_bytes(words: np.ndarray) -> np.ndarray:
    """Bytes each word needs, its leading zero bytes left out: the cost zstd mostly pays."""
    n = np.zeros(words.shape, dtype=np.int64)
    for k in range(words.dtype.itemsize):
        n += words >= words.dtype.type(1) << words.dtype.type(8 * k) if k else words > 0
    return n


def _starts(lengths: np.ndarray) -> np.ndarray:
    return (
        np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        if lengths.size
        else lengths.astype(np.int64)
    )


def _planes(words: np.ndarray) -> bytes:
    width = words.dtype.itemsize
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, width).T).tobytes()


def _unplanes(raw: np.ndarray, count: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    return np.ascontiguousarray(raw[: count * width].reshape(width, count).T).view(dtype).reshape(-1)


# -- the block ----------------------------------------------------------------------------------------
def _best(words: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows laid end to end (`lengths`), each coded with the transform that leaves it the fewest significant
    bytes: (the coded words, each row's transform, each row's cost in significant bytes)."""
    starts = _starts(lengths)
    coded = [_forward(words, starts, t) for t in (XOR, DELTA, DELTA2)]
    if not words.size:
        zeros = np.zeros(lengths.size, dtype=np.int64)
        return words, zeros.astype(np.uint8), zeros
    owner = np.repeat(np.arange(lengths.size), lengths)
    costs = np.stack([np.bincount(owner, _sig_bytes(c), minlength=lengths.size) for c in coded])
    best = np.argmin(costs, axis=0)
    return np.choose(best[owner], coded), best.astype(np.uint8), costs[best, np.arange(lengths.size)]


def _decimals(
    flat: np.ndarray, bits: np.ndarray, row_of: np.ndarray, per_row: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's smallest d (0..MAX_DECIMALS) for which every value is k / 10**d bit for bit, stored d + 1
    (0: none), and the integers k of the rows that have one (0 elsewhere)."""
    m = per_row.size
    scale = np.zeros(m, dtype=np.uint8)
    ints = np.zeros(flat.size, dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        for d in range(MAX_DECIMALS + 1):
            todo = (scale == 0) & (per_row > 0)
            if not todo.any():
                break
            power = 10.0**d
            scaled = flat * power
            k = np.rint(scaled)
            ok = np.abs(scaled) < 2.0**53  # NaN and Inf fail here
            k_int = np.where(ok, k, 0.0).astype(np.int64)
            ok &= (k_int / power).view(_U64) == bits  # as decoded: -0.0 fails (the integer 0 is +0.0)
            good = todo & (np.bincount(row_of, ~ok, minlength=m) == 0)
            if good.any():
                scale[good] = d + 1
                at = good[row_of]
                ints[at] = k_int[at]
    return scale, ints


def _binary(
    flat: np.ndarray, bits: np.ndarray, row_of: np.ndarray, per_row: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Of the rows `rows` (a mask), each one's smallest e (1..MAX_BINARY) for which every value is k / 2**e
    with |k| < 2**53, stored BINARY + e (0: none, and every other row), and the integers k of the rows that
    have one (0 elsewhere). -0.0, NaN and Inf have no such form; whole numbers (e = 0) are decimal rows."""
    scale = np.zeros(per_row.size, dtype=np.uint8)
    ints = np.zeros(flat.size, dtype=np.int64)
    rows = rows & (per_row > 0)
    if not rows.any():
        return scale, ints
    at = rows[row_of]
    values, starts = flat[at], _starts(per_row[rows])
    with np.errstate(over="ignore", invalid="ignore"):
        mantissa, exponent = np.frexp(values)  # values = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
        whole = np.abs(np.where(np.isfinite(values), mantissa, 0.0) * 2.0**53).astype(np.int64)
    low_bit = (whole & -whole).astype(np.float64)  # its lowest set bit, 2**(trailing zeros); 0 for 0.0
    trailing = np.log2(np.where(low_bit > 0, low_bit, 1.0)).astype(np.int64)
    need = np.where(whole > 0, 53 - exponent.astype(np.int64) - trailing, 0)  # each value's own e
    e = np.maximum.reduceat(need, starts)
    bad = ~np.isfinite(values) | (bits[at] == _U64(1 << 63))  # NaN, Inf, -0.0
    ok = (np.add.reduceat(bad, starts) == 0) & (e >= 1) & (e <= MAX_BINARY)
    with np.errstate(over="ignore", invalid="ignore"):
        k = np.ldexp(values, np.repeat(np.where(ok, e, 0), per_row[rows]))
    fits = np.abs(k) < 2.0**53
    ok &= np.add.reduceat(~fits, starts) == 0
    scale[rows] = np.where(ok, BINARY + e, 0)
    ints[at] = np.where(np.repeat(ok, per_row[rows]), k, 0.0).astype(np.int64)
    return scale, ints


def encode(block: Block) -> bytes:
    """The block's bytes (module docstring)."""
    return encode_many([block])[0]


def _varint_runs(x: np.ndarray, counts: Sequence[int]) -> list[bytes]:
    """`_varints` of consecutive runs of `x` (`counts` values each, at least one), encoded in one pass."""
    raw, ends = _leb128(x)
    cuts = [0, *ends[np.cumsum(counts) - 1].tolist()]
    data = raw.tobytes()
    return [data[a:b] for a, b in itertools.pairwise(cuts)]


def encode_many(blocks: Sequence[Block]) -> list[bytes]:
    """`encode` of each block. The forms and transforms of all the blocks' rows are chosen together
    (each row's choice is its own, so the bytes are those of each block encoded alone): a compaction
    pass or a rollup round encodes hundreds of small blocks, and numpy's cost per call, not per value,
    was most of the time of each."""
    if not blocks:
        return []
    heads, presences, per_rows, flats = [], [], [], []
    for block in blocks:
        m, n = block.values.shape
        steps, ids = block.steps.astype(np.int64), block.series.astype(np.int64)
        heads.append(np.array([n, m], dtype=_U64))
        if n:
            heads.append(np.concatenate([steps[:1], np.diff(steps) - 1]).astype(_U64))
        if m:
            heads.append(_zigzag(np.concatenate([ids[:1], np.diff(ids)])))
        present = np.ascontiguousarray(block.present, dtype=bool)
        presences.append(b"\x00" if present.all() else b"\x01" + np.packbits(present.reshape(-1)).tobytes())
        per_rows.append(present.sum(axis=1))
        flats.append(np.ascontiguousarray(block.values, dtype=np.float64)[present])  # row major
    head_bytes = _varint_runs(np.concatenate(heads), [2 + sum(b.values.shape) for b in blocks])
    per_row, flat = np.concatenate(per_rows), np.concatenate(flats)
    m = per_row.size
    bits = flat.view(_U64)
    with np.errstate(over="ignore", invalid="ignore"):  # a value beyond float32 becomes Inf: not exact
        narrow = flat.astype(np.float32)
    exact = narrow.astype(np.float64).view(_U64) == bits  # bit for bit, NaN payloads included
    row_of = np.repeat(np.arange(m), per_row)
    wide_rows = np.zeros(m, dtype=bool)
    np.logical_or.at(wide_rows, row_of, ~exact)
    # A row is written as floats (4 or 8 bytes) or as decimal integers, whichever costs it less.
    float_cost = np.zeros(m, dtype=np.int64)
    float_cost[~wide_rows] = _best(narrow.view(np.uint32)[~wide_rows[row_of]], per_row[~wide_rows])[2]
    float_cost[wide_rows] = _best(bits[wide_rows[row_of]], per_row[wide_rows])[2]
    scale, ints = np.zeros(m, dtype=np.uint8), np.zeros(flat.size, dtype=np.int64)
    best_cost = float_cost
    for their_scale, their_ints in (
        _decimals(flat, bits, row_of, per_row),
        _binary(flat, bits, row_of, per_row, wide_rows),  # a float32 row costs less as itself
    ):
        cost = np.full(m, np.iinfo(np.int64).max)
        has = their_scale > 0
        cost[has] = _best(their_ints.view(_U64)[has[row_of]], per_row[has])[2]
        better = cost < best_cost
        scale[better], best_cost = their_scale[better], np.minimum(cost, best_cost)
        ints[better[row_of]] = their_ints[better[row_of]]
    integer_rows = scale > 0  # decimal or binary: integer words either way
    wide_rows &= ~integer_rows
    narrow_rows = ~wide_rows & ~integer_rows
    transforms = np.zeros(m, dtype=np.uint8)
    row_ends = np.cumsum([p.shape[0] for p in per_rows]).tolist()
    row_starts = [0, *row_ends[:-1]]
    planes: list[list[bytes]] = [[] for _ in blocks]
    for words, rows in (
        (narrow.view(np.uint32), narrow_rows),
        (bits, wide_rows),
        (ints.view(_U64), integer_rows),
    ):
        out, best, _ = _best(words[rows[row_of]], per_row[rows])
        transforms[rows] = best
        # Each block's words of this form: its rows of the form, end to end, in `out`.
        before = np.concatenate([[0], np.cumsum(np.where(rows, per_row, 0))]).tolist()
        for i, (a, b) in enumerate(zip(row_starts, row_ends, strict=True)):
            lo, hi = before[a], before[b]
            planes[i].append(_planes(out[lo:hi]) if hi > lo else b"")
    width = np.where(narrow_rows, 4, 8)
    modes = (width | (transforms.astype(np.int64) << 4)).astype(np.uint8).tobytes()
    scales = scale.tobytes()
    compress = _zstd()[0].compress
    return [
        compress(b"".join([bytes([VERSION]), head, presence, modes[a:b], scales[a:b], *plane]))
        for head, presence, a, b, plane in zip(
            head_bytes, presences, row_starts, row_ends, planes, strict=True
        )
    ]


def decode(data: bytes) -> Block:
    """The block `encode` made; CorruptBlock when `data` is not one."""
    return decode_many([data])[0]


@dataclass(slots=True)
class _Parsed:
    """A block's header and its rows' coded words, per class of row (float32, float64, decimal), before the
    rows' transforms are undone (`_flat_values` undoes them for many blocks at once). The few per-row facts
    are Python lists: numpy's calls cost more than they save on a pack's five rows."""

    steps: np.ndarray
    series: np.ndarray
    present: np.ndarray | None  # None: every value present
    per_row: list[int]  # values present in each row
    rows: list[list[int]]  # per class: its rows, in order
    transforms: list[list[int]]  # per class: each of its rows' transform
    scales: list[int]  # each integer row's scale byte: decimal d + 1, binary BINARY + e
    coded: list[np.ndarray]  # per class: its rows' coded words, end to end


_CLASSES: tuple[type[np.unsignedinteger], ...] = (np.uint32, _U64, _U64)  # float32, float64, integer rows


_NO_WORDS = {dtype: np.zeros(0, dtype=dtype) for dtype in _CLASSES}
# 1 for a mode byte this version does not write: a width other than 4 or 8, or a transform past DELTA2.
_BAD_MODES = bytes(int((b & 0x0F) not in (4, 8) or (b >> 4) > DELTA2) for b in range(256))


def _read_series(raw: bytes, buf: np.ndarray, pos: int, m: int) -> tuple[np.ndarray, int]:
    """A block's `m` series ids (zigzag varints of their differences, the first from 0) at `pos`, and the
    position after them. A few (a pack's five rows) are read in Python: numpy's calls cost more there."""
    if m <= _FEW_VARINTS:
        words, end = _varint_list(raw, pos, m)
        with contextlib.suppress(OverflowError):  # ids near the ends of int64: numpy's wrapping, below
            ids = itertools.accumulate((u >> 1) ^ -(u & 1) for u in words)
            return np.fromiter(ids, dtype=np.int64, count=m), end
    deltas, pos = _read_varints(buf, pos, m)
    return np.cumsum(_unzigzag(deltas)), pos


def _parse(data: bytes) -> _Parsed:
    try:
        raw = _zstd()[1].decompress(data, max_output_size=MAX_BLOCK_BYTES)
    except zstandard.ZstdError as exc:
        raise CorruptBlock(f"block: not a zstd frame ({exc})") from None
    if not raw or raw[0] not in VERSIONS:
        raise CorruptBlock(f"block: version {raw[0] if raw else None}, expected one of {VERSIONS}")
    version = raw[0]
    buf = np.frombuffer(raw, dtype=np.uint8)
    (n, m), pos = _varint_list(raw, 1, 2)
    if m * n > 8 * len(raw):  # a value takes a bit of the bitmap at least
        raise CorruptBlock(f"block: {m} x {n} values in {len(raw)} bytes")
    steps = np.zeros(0, dtype=np.int64)
    if n:
        (first,), at = _varint_list(raw, pos, 1)
        gap = raw[at] if n > 1 and at < len(raw) else 0  # each gap was written minus one
        if gap < 0x80 and first < 2**62 and raw[at : at + n - 1] == bytes((gap,)) * (n - 1):
            # steps a fixed gap apart, written in one byte each: consecutive steps (the common case), or a
            # metric sampled every k-th step (the amax: its step rollup packs hold ~26 steps each)
            steps, pos = np.arange(first, first + n * (gap + 1), gap + 1, dtype=np.int64), at + n - 1
        else:
            gaps, pos = _read_varints(buf, pos, n)
            step_gaps = gaps.view(np.int64) + 1  # each gap was written minus one, the first step as it is
            step_gaps[0] -= 1
            steps = np.cumsum(step_gaps)
    series, pos = _read_series(raw, buf, pos, m)
    if pos >= len(raw):
        raise CorruptBlock("block: ends before its presence byte")
    present = None
    per_row = [n] * m
    if raw[pos]:
        size = (m * n + 7) // 8
        present = np.unpackbits(buf[pos + 1 : pos + 1 + size], count=m * n).astype(bool).reshape(m, n)
        per_row = present.sum(axis=1).tolist()
        pos += size
    pos += 1
    modes = raw[pos : pos + m]
    if len(modes) < m or modes.translate(_BAD_MODES).count(1):
        raise CorruptBlock("block: a row's mode is not one this version writes")
    pos += m
    scale = bytes(m)
    if version >= 2:
        scale = raw[pos : pos + m]
        top = BINARY + MAX_BINARY if version >= 3 else MAX_DECIMALS + 1
        if len(scale) < m or any(
            (MAX_DECIMALS + 1 < d <= BINARY or d > top) or (d and (b & 0x0F) != 8)
            for d, b in zip(scale, modes, strict=False)
        ):
            raise CorruptBlock("block: a row's scale is not one this version writes")
        pos += m
    rows: list[list[int]] = [[], [], []]
    for r, (b, d) in enumerate(zip(modes, scale, strict=True)):
        rows[0 if (b & 0x0F) == 4 else 2 if d else 1].append(r)
    coded = []
    for dtype, mine in zip(_CLASSES, rows, strict=True):
        if not mine:
            coded.append(_NO_WORDS[dtype])
            continue
        count = n * len(mine) if present is None else sum(per_row[r] for r in mine)
        width = np.dtype(dtype).itemsize
        if len(raw) < pos + count * width:
            raise CorruptBlock("block: ends inside its values")
        coded.append(_unplanes(buf[pos:], count, dtype))
        pos += count * width
    if pos != len(raw):
        raise CorruptBlock(f"block: {len(raw) - pos} bytes after its values")
    transforms = [[modes[r] >> 4 for r in mine] for mine in rows]
    return _Parsed(steps, series, present, per_row, rows, transforms, [scale[r] for r in rows[2]], coded)


@dataclass(frozen=True, slots=True)
class Flat:
    """Many blocks' present values as columns: block by block (`block`: its index among those decoded),
    each block's rows in their order, each row's values in step order; `sizes`: the values of each block
    (of the rows decoded), `rows` and `width`: each block's rows and steps (all of them)."""

    block: np.ndarray  # int64
    series: np.ndarray  # int64
    step: np.ndarray  # int64
    value: np.ndarray  # float64
    sizes: np.ndarray  # int64, one per block
    rows: np.ndarray  # int64, one per block
    width: np.ndarray  # int64, one per block


def decode_many(datas: Sequence[bytes]) -> list[Block]:
    """The blocks `encode` made, decoded together (`_flat_values`). CorruptBlock when one of `datas` is not
    a block."""
    parsed = [_parse(d) for d in datas]
    values, _ = _flat_values(parsed)
    out = []
    at = 0
    for p in parsed:
        m, n = len(p.per_row), p.steps.size
        count = sum(p.per_row)
        if p.present is None:
            present, block_values = np.ones((m, n), dtype=bool), values[at : at + count].reshape(m, n)
        else:  # the present values are row major, as the bitmap is
            present, block_values = p.present, np.zeros((m, n), dtype=np.float64)
            block_values[present] = values[at : at + count]
        out.append(Block(p.steps, p.series, block_values, present))
        at += count
    return out


def decode_flat(datas: Sequence[bytes], wanted: np.ndarray | None = None) -> Flat:
    """The present values of the blocks `encode` made, as columns (`Flat`), decoded together: no numpy call
    per block beyond reading its header (and one for a block with absent values). `wanted` (sorted series
    ids): only those series' rows are decoded past their header (a heatmap of one metric reads one row of
    each block). CorruptBlock when one of `datas` is not a block."""
    parsed = [_parse(d) for d in datas]
    row_series = np.concatenate([p.series for p in parsed]) if parsed else np.zeros(0, dtype=np.int64)
    keep = None if wanted is None else np.isin(row_series, wanted)
    values, row_len = _flat_values(parsed, keep)
    rows_of = np.array([len(p.per_row) for p in parsed], dtype=np.int64)
    first_row = _starts(rows_of)
    block_of_row = np.repeat(np.arange(len(parsed), dtype=np.int64), rows_of)
    sizes = np.bincount(block_of_row, weights=row_len, minlength=len(parsed)).astype(np.int64)
    width = np.array([p.steps.size for p in parsed], dtype=np.int64)
    if not values.size:
        none = np.zeros(0, dtype=np.int64)
        return Flat(none, none, none, values, sizes, rows_of, width)
    series = np.repeat(row_series, row_len)
    block = np.repeat(np.arange(len(parsed), dtype=np.int64), sizes)
    position = np.arange(values.size, dtype=np.int64) - np.repeat(_starts(row_len), row_len)  # in its row
    starts = _starts(sizes)
    for b, p in enumerate(parsed):
        if p.present is not None and sizes[b]:  # rows with absent values: the steps of their present ones
            rows = (
                p.present if keep is None else p.present[keep[first_row[b] : first_row[b] + len(p.per_row)]]
            )
            position[starts[b] : starts[b] + sizes[b]] = np.nonzero(rows)[1]
    steps = np.concatenate([p.steps for p in parsed])
    return Flat(block, series, steps[_starts(width)[block] + position], values, sizes, rows_of, width)


def _flat_values(parsed: Sequence[_Parsed], keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The blocks' present values, block by block, each block's rows in their order, each row's values in
    step order; and the values each row holds (every block's rows in that order). `keep` (one per row, in
    that order): only those rows are decoded, the others hold no value here. Each block's header is read on
    its own (`_parse`); the rows' transforms are undone for all the blocks at once, a few numpy calls a class
    of row for the lot, and each class's values put where their rows go."""
    coded_len = np.array([n for p in parsed for n in p.per_row], dtype=np.int64)
    row_len = coded_len if keep is None else np.where(keep, coded_len, 0)
    row_start = _starts(row_len)  # where each row's values go
    first_row = _starts(np.array([len(p.per_row) for p in parsed], dtype=np.int64))
    out = np.zeros(int(row_len.sum()), dtype=np.float64)
    for kind, dtype in enumerate(_CLASSES):
        mine_rows = np.array(
            [int(first_row[b]) + r for b, p in enumerate(parsed) for r in p.rows[kind]], dtype=np.int64
        )
        if not mine_rows.size:
            continue
        lengths = coded_len[mine_rows]
        coded = np.concatenate([p.coded[kind] for p in parsed])
        transforms = np.array([t for p in parsed for t in p.transforms[kind]], dtype=np.int64)
        taken = None if keep is None or keep[mine_rows].all() else keep[mine_rows]
        if taken is not None:
            coded, lengths = coded[np.repeat(taken, lengths)], lengths[taken]
            transforms, mine_rows = transforms[taken], mine_rows[taken]
            if not mine_rows.size:
                continue
        owner = np.repeat(np.arange(lengths.size), lengths)
        words = np.zeros(coded.size, dtype=dtype)
        for t in (XOR, DELTA, DELTA2):
            mine = transforms == t
            if mine.any():
                at = mine[owner]
                words[at] = _backward(coded[at], _starts(lengths[mine]), t)
        if kind == 0:
            values = words.view(np.float32).astype(np.float64)
        elif kind == 1:
            values = words.view(np.float64)
        else:  # k / 10**d (the float nearest the decimal, as the encoder checked) or k / 2**e (exact)
            scale = np.array([d for p in parsed for d in p.scales], dtype=np.int64)
            scale = (scale if taken is None else scale[taken])[owner]
            k = words.view(np.int64)
            binary = scale > BINARY
            values = k / 10.0 ** np.where(binary, 0, scale - 1)
            values[binary] = np.ldexp(k[binary].astype(np.float64), -(scale[binary] - BINARY))
        out[np.repeat(row_start[mine_rows] - _starts(lengths), lengths) + np.arange(coded.size)] = values
    return out, row_len
