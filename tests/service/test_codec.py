"""The block codec (storage/codec.py): every value back bit for bit, whatever it is and whatever is absent,
and a block that is not one refused by name."""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import pytest

from stepwatch_server.storage.codec import (
    Block,
    CorruptBlock,
    decode,
    decode_flat,
    decode_many,
    encode,
    encode_many,
)
from tests.conftest import require_module
from tests.service.conftest import generated

hypothesis = require_module("hypothesis")
st = require_module("hypothesis.strategies")

# Values the float64 format can hold that a careless codec loses: signed zeros, NaN payloads (quiet and
# signalling, both signs), infinities, subnormals, the extremes, float32-exact values and their neighbours.
SPECIAL = [
    0.0,
    -0.0,
    float("inf"),
    float("-inf"),
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    1.7976931358623157e308,
    struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0],  # quiet NaN with a payload
    struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0],  # signalling NaN
    struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0],  # negative NaN
    float(np.float32(2.3456789)),
    float(np.nextafter(np.float32(2.3456789), np.float32(3))) + 1e-12,
    3.4028234663852886e38,
    3.5e38,
    1e-45,
    0.1,
]


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)


def _assert_same(block: Block, back: Block) -> None:
    np.testing.assert_array_equal(back.steps, block.steps)
    np.testing.assert_array_equal(back.series, block.series)
    np.testing.assert_array_equal(back.present, block.present)
    np.testing.assert_array_equal(_bits(back.values)[block.present], _bits(block.values)[block.present])


@st.composite
def blocks(draw: st.DrawFn) -> Block:
    n = draw(st.integers(0, 40))
    m = draw(st.integers(0, 12))
    first = draw(st.integers(0, 2**62 - 50 * 1000))
    gaps = draw(st.lists(st.integers(1, 1000), min_size=max(0, n - 1), max_size=max(0, n - 1)))
    steps = np.cumsum([first, *gaps]).astype(np.int64)[:n]
    series = np.array(draw(st.lists(st.integers(-(2**40), 2**40), min_size=m, max_size=m)), dtype=np.int64)
    decimals = st.tuples(st.integers(-(2**53), 2**53), st.integers(0, 7)).map(lambda kd: kd[0] / 10 ** kd[1])
    binary = st.tuples(st.integers(-(2**53), 2**53), st.integers(0, 1100)).map(
        lambda ke: math.ldexp(ke[0], -ke[1])
    )
    floats = st.one_of(
        st.sampled_from(SPECIAL),
        st.floats(allow_nan=True, allow_infinity=True, width=64),
        st.floats(width=32).map(float),
        st.integers(-(2**53), 2**53).map(float),
        decimals,
    )
    pick = draw(st.integers(0, 3))
    if pick == 1:  # rows of decimals only, as rounded timings are (and their near misses)
        floats = st.one_of(decimals, decimals.map(lambda v: float(np.nextafter(v, np.inf))))
    elif pick == 2:  # rows of binary fractions only, as memory in MiB is (and their near misses)
        floats = st.one_of(binary, binary.map(lambda v: float(np.nextafter(v, np.inf))))
    values = np.array(draw(st.lists(floats, min_size=m * n, max_size=m * n)), dtype=np.float64).reshape(m, n)
    present = np.array(draw(st.lists(st.booleans(), min_size=m * n, max_size=m * n)), dtype=bool).reshape(
        m, n
    )
    if draw(st.booleans()):
        present[:] = True
    return Block(steps, series, np.where(present, values, 0.0), present)


@generated(300)
@hypothesis.given(block=blocks())
def test_every_present_value_comes_back_bit_for_bit(block: Block) -> None:
    _assert_same(block, decode(encode(block)))


@generated(100)
@hypothesis.given(many=st.lists(blocks(), max_size=6))
def test_blocks_decoded_together_come_back_as_each_alone(many: list[Block]) -> None:
    """`decode_many` undoes the rows' transforms of all its blocks at once: each block back bit for bit."""
    back = decode_many([encode(block) for block in many])
    assert len(back) == len(many)
    for block, got in zip(many, back, strict=True):
        _assert_same(block, got)
    with pytest.raises(CorruptBlock):
        decode_many([encode(block) for block in many] + [b"not a block"])


@generated(100)
@hypothesis.given(many=st.lists(blocks(), max_size=6))
def test_blocks_encoded_together_are_the_bytes_of_each_alone(many: list[Block]) -> None:
    """`encode_many` chooses the rows' forms and transforms for all its blocks at once: each block's bytes
    are those it has alone (no row's choice leaks into a neighbour's, across blocks or rows)."""
    assert encode_many(many) == [encode(block) for block in many]
    assert encode_many(many + many[:1]) == [encode(block) for block in many + many[:1]]


@generated(100)
@hypothesis.given(many=st.lists(blocks(), max_size=6), picks=st.lists(st.integers(0, 11), max_size=4))
def test_blocks_decoded_as_columns_hold_each_present_value_at_its_series_and_step(
    many: list[Block], picks: list[int]
) -> None:
    """`decode_flat`: every present value of every block (or of the series asked for), bit for bit, with its
    block, series and step, block by block, each block's rows in their order and each row in step order;
    nothing for an absent value."""
    ids = sorted({int(b.series[i]) for b in many for i in picks if i < b.series.size})
    for wanted in (None, np.array(ids, dtype=np.int64)):
        flat = decode_flat([encode(block) for block in many], wanted)
        expected = [
            (b, int(block.series[r]), int(block.steps[c]), int(_bits(block.values[r, c : c + 1])[0]))
            for b, block in enumerate(many)
            for r, c in zip(*np.nonzero(block.present), strict=True)
            if wanted is None or int(block.series[r]) in ids
        ]
        columns = (flat.block, flat.series, flat.step, _bits(flat.value))
        assert list(zip(*(c.tolist() for c in columns), strict=True)) == expected
        assert flat.sizes.tolist() == [sum(1 for e in expected if e[0] == b) for b in range(len(many))]
        assert flat.rows.tolist() == [b.series.size for b in many]  # every row's, decoded or not
        assert flat.width.tolist() == [b.steps.size for b in many]
    with pytest.raises(CorruptBlock):
        decode_flat([encode(block) for block in many] + [b"not a block"])


def test_series_ids_at_the_ends_of_int64_come_back() -> None:
    """A block's few series ids are read in Python (`_read_series`); their differences past int64 wrap as the
    encoder's do, so every int64 id comes back."""
    for ids in ([-(2**63), 2**63 - 1], [2**63 - 1, -(2**63), 0], [5, -(2**63) + 1, 2**62]):
        block = Block(
            np.arange(3), np.array(ids, dtype=np.int64), np.zeros((len(ids), 3)), np.ones((len(ids), 3), bool)
        )
        assert decode(encode(block)).series.tolist() == ids
        assert decode_flat([encode(block)]).series.tolist() == [i for i in ids for _ in range(3)]


def test_steps_a_fixed_gap_apart_come_back() -> None:
    """Steps a fixed gap apart, each gap written in one byte, are read without decoding each varint (a
    metric sampled every k-th step, as the amax is): every gap that takes one byte and two, a gap that
    changes at the last step, and first steps up to 2**62 (larger ones are read step by step)."""
    for first in (0, 7, 2**62 - 1, 2**62, 2**63 - 1000):
        for gap in (1, 2, 10, 128, 129, 1000):
            for n in (1, 2, 26):
                steps = first + gap * np.arange(n, dtype=np.int64)
                if steps[-1] < first:  # past int64
                    continue
                varied = steps.copy()
                varied[-1] += 1 if n > 1 else 0
                for s in (steps, varied):
                    block = Block(s, np.array([3, 4]), np.ones((2, n)), np.ones((2, n), bool))
                    _assert_same(block, decode(encode(block)))
                    assert decode_flat([encode(block)] * 2).step.tolist() == s.tolist() * 4


def test_the_special_values_in_rows_of_each_width_come_back() -> None:
    special = np.array(SPECIAL * 3, dtype=np.float64)
    narrow = special[np.isfinite(special) & (np.abs(special) < 3e38)].astype(np.float32).astype(np.float64)
    steps = np.arange(special.size, dtype=np.int64) * 7 + 3
    values = np.zeros((3, special.size))
    values[0] = special  # a row of any values: 8 bytes each
    values[1, : narrow.size] = narrow  # a row of float32-exact values: 4 bytes each
    values[2] = 1.0  # constant
    present = np.ones_like(values, dtype=bool)
    present[1, narrow.size :] = False
    block = Block(steps, np.array([7, 3, 11]), values, present)
    _assert_same(block, decode(encode(block)))


def test_a_block_costs_what_its_values_hold() -> None:
    """64 steps as the agent sends them: float32 losses (4 bytes a value before zstd), a constant learning
    rate and a smooth schedule (next to nothing), integer byte counts, and noisy float64 timings (their
    mantissa is noise: the most expensive). Measured when written: 3.9 bytes a value in all."""
    rng = np.random.default_rng(0)
    steps = np.arange(1000, 1064, dtype=np.int64)

    def cost(rows: list[np.ndarray]) -> float:
        values = np.array(rows)
        block = Block(steps, np.arange(len(rows)), values, np.ones_like(values, dtype=bool))
        data = encode(block)
        _assert_same(block, decode(data))
        return len(data) / values.size

    losses = [np.float32(3.0 - 0.001 * steps + rng.normal(0, 0.01, 64)).astype(np.float64) for _ in range(10)]
    flat = [np.full(64, 3e-4) for _ in range(5)] + [
        np.round(2e9 + 1e3 * steps.astype(np.float64)) for _ in range(5)
    ]
    timings = [12.0 + rng.normal(0, 0.3, 64) for _ in range(10)]
    assert cost(flat) < 0.5
    assert cost(losses) < 3.5
    assert cost(timings) < 7.0
    assert cost(losses + flat + timings) < 4.0
    assert cost(timings[:1] * 10) < 1.5  # the same row ten times: zstd finds the repeats


def test_decimal_rows_cost_what_their_digits_hold() -> None:
    """Timings the agent rounds to the microsecond (ms with 3 decimals): stored as integers, not as
    float64 words whose mantissa is the decimal's binary expansion. Measured when written: 1.8 bytes a
    value rounded (6.6 as the first version's float words), 6.8 as they came; a value one ulp off the
    decimal keeps its row exact as floats."""
    rng = np.random.default_rng(1)
    steps = np.arange(64, dtype=np.int64)
    timings = np.array([12.0 + rng.normal(0, 0.3, 64) for _ in range(10)])
    rounded = np.round(timings, 3)
    for rows, bound in ((timings, 7.5), (rounded, 2.2)):
        block = Block(steps, np.arange(10), rows, np.ones_like(rows, dtype=bool))
        data = encode(block)
        _assert_same(block, decode(data))
        assert len(data) / rows.size < bound
    off = rounded.copy()
    off[3, 17] = np.nextafter(off[3, 17], np.inf)
    block = Block(steps, np.arange(10), off, np.ones_like(off, dtype=bool))
    _assert_same(block, decode(encode(block)))


def test_binary_fraction_rows_cost_what_their_bits_hold() -> None:
    """Memory the agent sends in MiB from the allocator's byte counts (512-byte granules: k / 2**11): stored
    as the integers k, not as float64 words whose significant bits straddle the byte planes. Measured when
    written, a real run's allocated memory (~30 GB, moving a few MB a step): 2.1 bytes a value as integers,
    2.6 as float words; a value one ulp off keeps its row exact as floats; subnormals and huge scales come
    back too."""
    rng = np.random.default_rng(2)
    steps = np.arange(256, dtype=np.int64)
    granules = np.round(30_013 * 2048 + rng.normal(0, 2048, (4, 256)))
    rows = granules / 2048
    costs = []
    for values in (rows, rows * 2.0**-1000, rows * 2.0**-1060, rows * 2.0**900):
        block = Block(steps, np.arange(4), values, np.ones_like(values, dtype=bool))
        data = encode(block)
        _assert_same(block, decode(data))
        costs.append(len(data) / values.size)
    assert costs[0] < 2.3
    off = rows.copy()
    off[1, 17] = np.nextafter(off[1, 17], np.inf)
    block = Block(steps, np.arange(4), off, np.ones_like(off, dtype=bool))
    _assert_same(block, decode(encode(block)))


# Blocks written by earlier versions of the codec: steps [3, 10, 17, 30]; a float32 row, a row of float64
# specials (-0.0, a NaN payload, Inf) and a row with a missing value, series [2, 5, 9]. Version 1: no
# decimal rows. Version 2: no binary rows; a fourth row, series 11, of memory in MiB (multiples of 2**-11)
# kept as float64 words.
VERSION_1_BLOCK = bytes.fromhex(
    "28b52ffd20589d020084040104030306060c04060801ffd0142808000065990000669980a086197f0004fb3498c903718ffe33"
    "99cc003de9d40a7278d73ee9a38526b001b173199c002800347f0180004000000404016080018655ca"
)
VERSION_2_BLOCK = bytes.fromhex(
    "28b52ffd207e1d030054050204040306060c0406080401ffdf1428081800000400000065990000669980a086197f0004fb3498c9"
    "0300ff00ff3399cc00a05fa05f9462b6f89e00000073199c00ba0000007f0180008100000039036230002b000400e36600ce6025"
    "32a44001"
)
_NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
_EARLIER_ROWS = [
    [1.5, 2.25, float(np.float32(0.1)), -3.0],
    [0.1, -0.0, _NAN_PAYLOAD, np.inf],
    [12.345, 12.346, 0.0, 7.0],
    [30013.1611328125, 30012.392578125, 30013.8193359375, 30011.87890625],
]


@pytest.mark.parametrize(("data", "rows"), [(VERSION_1_BLOCK, 3), (VERSION_2_BLOCK, 4)], ids=["v1", "v2"])
def test_a_block_of_an_earlier_version_still_decodes(data: bytes, rows: int) -> None:
    values = np.array(_EARLIER_ROWS[:rows])
    present = np.ones_like(values, dtype=bool)
    present[2, 2] = False
    series = np.array([2, 5, 9, 11][:rows])
    _assert_same(Block(np.array([3, 10, 17, 30]), series, values, present), decode(data))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not zstd", "not a zstd frame"),
        (__import__("zstandard").ZstdCompressor().compress(b"\x09\x00\x00"), "version"),
        (__import__("zstandard").ZstdCompressor().compress(b"\x01\x05\x02"), "varints"),
        (__import__("zstandard").ZstdCompressor().compress(b"\x02\xe8\x07\xe8\x07"), "1000 x 1000 values"),
    ],
)
def test_what_is_not_a_block_is_refused_by_name(data: bytes, message: str) -> None:
    with pytest.raises(CorruptBlock, match=message):
        decode(data)


def test_a_truncated_or_padded_block_is_refused() -> None:
    import zstandard

    block = Block(np.arange(4), np.arange(2), np.ones((2, 4)) * 0.1, np.ones((2, 4), dtype=bool))
    raw = zstandard.ZstdDecompressor().decompress(encode(block))
    for bad in (raw[:-3], raw + b"\x00"):
        with pytest.raises(CorruptBlock):
            decode(zstandard.ZstdCompressor().compress(bad))
    modes = 1 + 2 + 4 + 2 + 1  # version, n and m, four steps, two series, the presence byte
    for mode in (0x05, 0x38):  # a width of 5 bytes; a transform past DELTA2
        bad = raw[:modes] + bytes([mode]) + raw[modes + 1 :]
        with pytest.raises(CorruptBlock, match="mode"):
            decode(zstandard.ZstdCompressor().compress(bad))


def test_threads_encode_and_decode_at_once() -> None:
    """The collector decodes blocks on its request threads at the same time (a run page's calls); each
    thread gets its own values back (zstandard's objects are not thread-safe, so each thread has its own)."""
    rng = np.random.default_rng(7)
    made = []
    for i in range(8):
        values = rng.standard_normal((20, 64 * (i + 1)))
        made.append(
            Block(np.arange(values.shape[1]), np.arange(20), values, np.ones(values.shape, dtype=bool))
        )
    encoded = [encode(b) for b in made]
    failures: list[str] = []

    def work(i: int) -> None:
        for _ in range(150):
            try:
                _assert_same(made[i], decode(encoded[i]))
                assert encode(made[i]) == encoded[i]
            except Exception as exc:  # collected: an assertion in a thread would not fail the test
                failures.append(f"thread {i}: {type(exc).__name__}: {exc}")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:3]
