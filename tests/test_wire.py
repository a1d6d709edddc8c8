import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from troupe import wire
from troupe.wire import WireFormatError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]


def _random_tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype)
                                 .element_size(),), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaNs and infinities included


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 5), max_size=4),
       seed=st.integers(0, 2**31))
def test_tensor_round_trip_is_bit_exact(dtype, shape, seed):
    t = _random_tensor(dtype, shape, seed)
    for buf in (wire.encode(t), bytearray(wire.encode(t))):
        out = wire.decode(buf)
        assert out.dtype == dtype and list(out.shape) == shape
        assert _bits(out) == _bits(t)


def test_nested_containers_round_trip():
    msg = {"step": 3, "ok": True, "name": "policy", 7: None, "blob": b"\x00\x01",
           "pair": (torch.arange(3), [1.5, {"deep": torch.ones(2, 2, dtype=torch.bfloat16)}])}
    out = wire.decode(wire.encode(msg))
    assert out["step"] == 3 and out[7] is None and out["blob"] == b"\x00\x01"
    assert isinstance(out["pair"], tuple) and torch.equal(out["pair"][0], torch.arange(3))
    assert torch.equal(out["pair"][1][1]["deep"], torch.ones(2, 2, dtype=torch.bfloat16))


def test_noncontiguous_and_writable_views():
    t = torch.arange(12.0).reshape(3, 4).t()
    buf = bytearray(wire.encode(t))
    out = wire.decode(buf)
    assert torch.equal(out, t)
    out[0, 0] = 99.0  # decoded from a bytearray: the tensor views the buffer, no copy
    assert wire.decode(buf)[0, 0] == 99.0


def test_file_dump_and_load(tmp_path):
    msg = {"w": torch.randn(5, 3), "step": 11}
    path = tmp_path / "m.trp"
    with open(path, "wb") as f:
        n = wire.dump(msg, f)
    assert n == path.stat().st_size
    with open(path, "rb") as f:
        out = wire.load(f)
    assert torch.equal(out["w"], msg["w"]) and out["step"] == 11


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 10_000), seed=st.integers(0, 100))
def test_truncated_input_is_rejected(cut, seed):
    data = wire.encode({"a": _random_tensor(torch.float32, [7, 3], seed), "b": [1, "x"]})
    cut = cut % len(data)
    with pytest.raises(WireFormatError):
        wire.decode(data[:cut])


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, 10_000), byte=st.integers(0, 255), seed=st.integers(0, 100))
def test_garbled_input_is_rejected_or_decodes_cleanly(pos, byte, seed):
    """A flipped byte either still decodes into well-formed values or raises WireFormatError;
    never another exception, a crash, or a tensor that disagrees with its own descriptor."""
    data = bytearray(wire.encode({"t": _random_tensor(torch.int32, [4, 2], seed), "k": (1, 2)}))
    pos %= len(data)
    data[pos] = byte
    try:
        out = wire.decode(data)
    except WireFormatError:
        return
    assert isinstance(out, dict)


@settings(max_examples=100, deadline=None)
@given(junk=st.binary(max_size=300))
def test_random_bytes_are_rejected(junk):
    with pytest.raises(WireFormatError):
        wire.decode(junk)
    with pytest.raises(WireFormatError):
        wire.decode(wire.MAGIC + junk)


def test_size_and_depth_limits():
    big = torch.zeros(1000)
    with pytest.raises(WireFormatError, match="max_bytes"):
        wire.encode(big, max_bytes=1000)
    data = wire.encode(big)
    with pytest.raises(WireFormatError, match="max_bytes"):
        wire.decode(data, max_bytes=1000)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(WireFormatError, match="max_depth"):
        wire.encode(deep)
    data = wire.encode(deep, max_depth=200)
    with pytest.raises(WireFormatError, match="max_depth"):
        wire.decode(data)


def test_unsupported_values_name_the_place():
    with pytest.raises(WireFormatError, match=r"message\['x'\]\[1\].*set"):
        wire.encode({"x": [1, {2}]})
    with pytest.raises(WireFormatError, match="dict key"):
        wire.encode({(1, 2): 3})


def test_no_pickle_anywhere():
    import inspect
    src = inspect.getsource(wire)
    assert "pickle" not in src.replace("never pickle", "")


def _frame(tree, body: bytes) -> bytes:
    """A frame with a hand-made header (what a hostile sender could write)."""
    import msgpack
    header = msgpack.packb([tree, len(body)], use_bin_type=True)
    head = wire.MAGIC + wire._HEADER_LEN.pack(len(header)) + header
    return head + bytes(wire._pad(len(head))) + body


def _tensor_ref(dtype: str, shape, offset: int, nbytes: int):
    import msgpack
    return msgpack.ExtType(wire._EXT_TENSOR, msgpack.packb([dtype, shape, offset, nbytes]))


def test_aliasing_references_cannot_blow_up_memory():
    """4000 tensors pointing at the same 256 KiB of a 0.33 MiB frame would decode to 1 GiB."""
    body = bytes(256 * 1024)
    ref = _tensor_ref("uint8", [len(body)], 0, len(body))
    with pytest.raises(WireFormatError, match="overlaps or precedes"):
        wire.decode(_frame([ref] * 4000, body))
    with pytest.raises(WireFormatError, match="overlaps or precedes"):  # partial overlap
        wire.decode(_frame([_tensor_ref("uint8", [128], 0, 128),
                            _tensor_ref("uint8", [128], 64, 128)], bytes(192)))
    ok = wire.decode(_frame([_tensor_ref("uint8", [64], 0, 64),
                             _tensor_ref("uint8", [64], 64, 64)], bytes(128)))
    assert [t.numel() for t in ok] == [64, 64]


@pytest.mark.parametrize("shape", [[0, 2 ** 63], [True, True], [-1], [1] * 40, [2 ** 50, 0]])
def test_odd_shapes_are_format_errors(shape):
    with pytest.raises(WireFormatError, match="tensor shape"):
        wire.decode(_frame(_tensor_ref("float32", shape, 0, 0), b""))


def test_only_the_documented_types_decode():
    import datetime

    import msgpack
    stamp = msgpack.Timestamp.from_datetime(datetime.datetime(2026, 1, 1,
                                                              tzinfo=datetime.timezone.utc))
    with pytest.raises(WireFormatError, match="Timestamp is not part of the format"):
        wire.decode(_frame({"t": stamp}, b""))
    with pytest.raises(WireFormatError, match="unknown extension type 9"):
        wire.decode(_frame([msgpack.ExtType(9, b"x")], b""))
    with pytest.raises(WireFormatError, match="dict key 1.5"):
        wire.decode(_frame({1.5: 2}, b""))


def _raw_frame(header_tree_bytes: bytes) -> bytes:
    """A frame whose header is ``[<these msgpack bytes>, 0]``, written byte by byte."""
    header = b"\x92" + header_tree_bytes + b"\x00"
    head = wire.MAGIC + wire._HEADER_LEN.pack(len(header)) + header
    return head + bytes(wire._pad(len(head)))


def _array32(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


TEN_MB = 10 << 20


@pytest.mark.parametrize("what, frame", [
    ("10 M empty lists", lambda: _raw_frame(_array32(TEN_MB - 16, b"\x90"))),
    ("10 M nils", lambda: _raw_frame(_array32(TEN_MB - 16, b"\xc0"))),
    ("5 M one-entry dicts", lambda: _raw_frame(_array32(TEN_MB // 3, b"\x81\x00\xc0"))),
    ("3 M large ints", lambda: _raw_frame(_array32(TEN_MB // 3, b"\xcd\x12\x34"))),
    ("60 nested tuples of 1 M nils", lambda: _frame(_nested_tuples(60, [None] * (1 << 20)), b"")),
    ("60 nested tuples of 150 k nils", lambda: _frame(_nested_tuples(60, [None] * 150_000), b"")),
    ("a 10 MB tensor, immutable bytes", lambda: wire.encode(torch.ones(TEN_MB // 4))),
])
def test_decoding_a_10_mb_frame_peaks_under_40_mb(what, frame):
    """Hostile headers (one byte that becomes a 56-byte object, ...) are refused before they
    are built, and the tree is not copied: decoding peaks at a few times the frame."""
    import tracemalloc
    data = frame()
    assert len(data) <= TEN_MB + (1 << 20), what
    tracemalloc.start()
    try:
        wire.decode(data)
    except WireFormatError as e:
        assert "would decode into about" in str(e) or "deeper than" in str(e), what
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 40 << 20, f"{what}: {peak / 2**20:.0f} MiB"


def _nested_tuples(depth: int, leaf):
    import msgpack
    tree = leaf
    for _ in range(depth):
        tree = msgpack.ExtType(wire._EXT_TUPLE, msgpack.packb([tree], use_bin_type=True))
    return tree


def test_a_file_loads_by_memory_map_without_a_copy(tmp_path):
    import tracemalloc
    state = {"w": torch.randn(15 << 18), "b": torch.arange(7)}  # 15 MiB
    path = tmp_path / "model.trp"
    with open(path, "wb") as f:
        wire.dump(state, f)
    tracemalloc.start()
    with open(path, "rb") as f:
        got = wire.load(f)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB"  # reading it would be 15 MiB (30 copied)
    got["w"][0] = 1.0  # copy-on-write: the file is not changed
    with open(path, "rb") as f:
        assert wire.load(f)["w"][0] == state["w"][0]
