"""The wire format for data that crosses between actors or goes to disk: msgpack, never pickle.

A message is a frame::

    b"TRP1" | header length (uint32, little endian) | msgpack header | padding | tensor buffers

The header is ``[tree, body length]`` and the frame must be exactly that long. Each tensor in the
tree is a msgpack extension carrying its dtype, shape and the (offset, length) of its raw bytes
among the buffers that follow, each buffer aligned to 64 bytes, in the order the tensors appear
in the tree and never overlapping. Tuples are an extension too, so they come back as tuples.

Supported values: None, bool, int, float, str, bytes, list, tuple, dict (str or int keys) and
torch tensors of the dtypes in ``DTYPES``. Decoding checks every length against the frame and
the configured limits, accepts only those types (no other msgpack extension, such as
timestamps), refuses tensor references that overlap or go back, and raises ``WireFormatError``
naming what is wrong, for any input.

Memory: before the header is unpacked, ``_header_cost`` walks its bytes without building
anything and adds up what the Python objects would take (a one-byte empty list is a 56-byte
object and an 8-byte slot); a header that would take more than ``HEADER_BUDGET`` times its
frame's size (plus 4 MiB) is refused. The tree is then rewritten in place, not copied, so a
frame of n bytes decodes in a few times n at most.

Copies: ``encode_parts`` returns the header and views of the tensors' own memory (no copy for
contiguous CPU tensors), suitable for writing to a file part by part. ``decode`` of a writable
buffer (bytearray, writable memoryview) returns tensors that view that buffer without copying;
decoding immutable ``bytes`` copies each tensor once. ``load`` memory-maps a file on disk.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
from typing import Any, BinaryIO

import msgpack
import torch

MAGIC = b"TRP1"
_HEADER_LEN = struct.Struct("<I")
_PREFIX = len(MAGIC) + _HEADER_LEN.size
_ALIGN = 64
_EXT_TENSOR = 1
_EXT_TUPLE = 2

DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB per message
HEADER_BUDGET = 2  # a header's objects may take this many times the frame's bytes (+ 4 MiB)
DEFAULT_MAX_DEPTH = 64
MAX_DIMS = 32
MAX_DIM_SIZE = 1 << 48
_PLAIN = (type(None), bool, int, float, str, bytes)

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireFormatError(ValueError):
    """Raised for a message that is malformed, truncated, too large or too deeply nested."""


def _pad(n: int) -> int:
    return (-n) % _ALIGN


class _Encoder:
    def __init__(self, max_bytes: int, max_depth: int):
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self.buffers: list[memoryview] = []
        self.offset = 0  # bytes of tensor data so far, padding included

    def tree(self, obj: Any, depth: int = 0, where: str = "message") -> Any:
        if depth > self.max_depth:
            raise WireFormatError(f"{where}: nesting deeper than max_depth={self.max_depth}")
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, where)
        if isinstance(obj, tuple):
            items = [self.tree(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(obj)]
            return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
        if isinstance(obj, list):
            return [self.tree(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise WireFormatError(f"{where}: dict key {k!r} is not a str or int")
                out[k] = self.tree(v, depth + 1, f"{where}[{k!r}]")
            return out
        raise WireFormatError(
            f"{where}: cannot encode {type(obj).__name__}; supported are None, bool, int, float, "
            "str, bytes, list, tuple, dict and torch.Tensor"
        )

    def tensor(self, t: torch.Tensor, where: str) -> msgpack.ExtType:
        if t.dtype not in _DTYPE_NAMES:
            raise WireFormatError(f"{where}: tensor dtype {t.dtype} is not supported")
        if t.requires_grad:
            t = t.detach()
        t = t.cpu().contiguous()
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        start = self.offset
        self.offset += len(raw) + _pad(len(raw))
        if self.offset > self.max_bytes:
            raise WireFormatError(f"{where}: message exceeds max_bytes={self.max_bytes}")
        self.buffers.append(raw)
        meta = [_DTYPE_NAMES[t.dtype], list(t.shape), start, len(raw)]
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(meta))


def encode_parts(
    obj: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, max_depth: int = DEFAULT_MAX_DEPTH
) -> list[memoryview | bytes]:
    """Encode ``obj`` as a list of byte chunks whose concatenation is one frame."""
    enc = _Encoder(max_bytes, max_depth)
    tree = enc.tree(obj)
    header = msgpack.packb([tree, enc.offset], use_bin_type=True)
    head = MAGIC + _HEADER_LEN.pack(len(header)) + header
    parts: list[memoryview | bytes] = [head, bytes(_pad(len(head)))]
    if len(head) + enc.offset > max_bytes:
        raise WireFormatError(f"message exceeds max_bytes={max_bytes}")
    for raw in enc.buffers:
        parts += [raw, bytes(_pad(len(raw)))]
    return parts


def encode(obj: Any, **limits: int) -> bytes:
    """Encode ``obj`` into one frame (see module docstring)."""
    return b"".join(encode_parts(obj, **limits))


def dump(obj: Any, f: BinaryIO, **limits: int) -> int:
    """Write ``obj`` to a binary file without joining its parts; returns bytes written."""
    n = 0
    for part in encode_parts(obj, **limits):
        n += f.write(part)
    return n


class _Decoder:
    def __init__(self, data: memoryview, body_start: int, max_depth: int, copy: bool):
        self.data = data
        self.body_start = body_start
        self.max_depth = max_depth
        self.copy = copy
        self.next_free = 0  # body offset where the next tensor's bytes may start

    def unpack(self, raw: bytes, depth: int) -> Any:
        if depth > self.max_depth:
            raise WireFormatError(f"nesting deeper than max_depth={self.max_depth}")
        try:
            tree = msgpack.unpackb(
                raw, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType, timestamp=0,
                max_bin_len=len(raw), max_str_len=len(raw), max_ext_len=len(raw),
                max_array_len=len(raw), max_map_len=len(raw),
            )
        except WireFormatError:
            raise
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise WireFormatError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
        return self.walk(tree, depth)

    def walk(self, obj: Any, depth: int) -> Any:
        """``obj`` with its extensions decoded; lists and dicts are rewritten in place."""
        if depth > self.max_depth:
            raise WireFormatError(f"nesting deeper than max_depth={self.max_depth}")
        if isinstance(obj, msgpack.ExtType):
            if obj.code == _EXT_TENSOR:
                return self.tensor(obj.data)
            if obj.code == _EXT_TUPLE:
                items = self.unpack(obj.data, depth + 1)
                if not isinstance(items, list):
                    raise WireFormatError("tuple extension does not hold an array")
                return tuple(items)
            raise WireFormatError(f"unknown extension type {obj.code}")
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                obj[i] = self.walk(v, depth + 1)
            return obj
        if isinstance(obj, dict):
            bad = [k for k in obj if type(k) not in (str, int)]
            if bad:
                raise WireFormatError(f"dict key {bad[0]!r} is not a str or int")
            for k, v in obj.items():
                obj[k] = self.walk(v, depth + 1)
            return obj
        if not isinstance(obj, _PLAIN):
            raise WireFormatError(f"a value of type {type(obj).__name__} is not part of the "
                                  "format")
        return obj

    def tensor(self, meta_raw: bytes) -> torch.Tensor:
        try:
            dtype_name, shape, offset, nbytes = msgpack.unpackb(meta_raw, max_array_len=64)
        except Exception:
            raise WireFormatError("tensor descriptor is malformed") from None
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise WireFormatError(f"tensor dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(
                type(d) is int and 0 <= d < MAX_DIM_SIZE for d in shape)):
            raise WireFormatError(f"tensor shape {shape!r} is not a list of at most {MAX_DIMS} "
                                  f"ints in [0, 2**48)")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()  # host: a size query
        if not (isinstance(offset, int) and isinstance(nbytes, int)) or nbytes != numel * itemsize:
            raise WireFormatError(
                f"tensor of shape {shape} and dtype {dtype_name} needs {numel * itemsize} bytes, "
                f"descriptor says {nbytes!r}"
            )
        start = self.body_start + offset
        if offset < self.next_free:
            raise WireFormatError(f"tensor data at body offset {offset} overlaps or precedes the "
                                  f"previous tensor's (which ends at {self.next_free})")
        if start + nbytes > len(self.data):
            raise WireFormatError(
                f"truncated: tensor data at bytes [{start}, {start + nbytes}) but the frame "
                f"has {len(self.data)} bytes"
            )
        self.next_free = offset + nbytes
        try:
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)  # host: wire data lands in host memory
            view = self.data[start : start + nbytes]
            buf = bytearray(view) if self.copy else view
            t = torch.frombuffer(buf, dtype=torch.uint8)
            if dtype == torch.bool and bool((t > 1).any()):
                raise WireFormatError("bool tensor holds bytes other than 0 and 1")
            return t.view(dtype).reshape(shape)
        except WireFormatError:
            raise
        except Exception as e:  # torch refusing the shape or the buffer
            raise WireFormatError(f"tensor of shape {shape} and dtype {dtype_name}: {e}") from None


# bytes of length that follow a msgpack type byte: str, bin, ext (and its type byte), array, map
_LEN = {0xd9: 1, 0xda: 2, 0xdb: 4, 0xc4: 1, 0xc5: 2, 0xc6: 4, 0xc7: 1, 0xc8: 2, 0xc9: 4,
        0xdc: 2, 0xdd: 4, 0xde: 2, 0xdf: 4}
_FIXED = {0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4,
          0xd3: 8}  # floats and ints: payload bytes
_FIXEXT = {0xd4: 1, 0xd5: 2, 0xd6: 4, 0xd7: 8, 0xd8: 16}
_SLOT, _LIST, _DICT, _ENTRY, _STR, _NUMBER, _TENSOR = 8, 64, 64, 48, 56, 32, 512


def _header_cost(raw: bytes, max_depth: int, budget: int, depth: int = 0) -> int:
    """About how many bytes of Python objects unpacking the msgpack ``raw`` makes (CPython's
    sizes, rounded up; a tensor counts 512 bytes), found without building them; stops counting
    once past ``budget``. Malformed bytes are left to msgpack to report."""
    pos, cost, left, n = 0, 0, [1], len(raw)
    while left and cost <= budget and pos < n:
        if left[-1] == 0:
            left.pop()
            continue
        left[-1] -= 1
        b, pos = raw[pos], pos + 1
        cost += _SLOT
        if b <= 0x7f or b >= 0xe0 or b in (0xc0, 0xc2, 0xc3):  # small int, nil, bool
            continue
        if b in _FIXED:
            pos, cost = pos + _FIXED[b], cost + _NUMBER
            continue
        if 0x80 <= b <= 0x9f or b in (0xdc, 0xdd, 0xde, 0xdf):  # a container
            if 0x80 <= b <= 0x9f:
                count = b & 0x0f
            else:
                count = int.from_bytes(raw[pos:pos + _LEN[b]], "big")
                pos += _LEN[b]
            is_map = b <= 0x8f or b >= 0xde
            if len(left) + depth > max_depth:
                raise WireFormatError(f"nesting deeper than max_depth={max_depth}")
            cost += (_DICT + _ENTRY * count) if is_map else (_LIST + _SLOT * count)
            left.append(2 * count if is_map else count)
            continue
        if 0xa0 <= b <= 0xbf:
            size = b & 0x1f
        elif b in _FIXEXT or b in (0xc7, 0xc8, 0xc9):
            if b in _FIXEXT:
                size = _FIXEXT[b]
            else:
                size = int.from_bytes(raw[pos:pos + _LEN[b]], "big")
                pos += _LEN[b]
            code, pos = (raw[pos] if pos < n else -1), pos + 1
            if code == _EXT_TUPLE:
                cost += _LIST + _header_cost(raw[pos:pos + size], max_depth, budget - cost,
                                             depth + len(left))
            cost += _TENSOR if code == _EXT_TENSOR else 0
        elif b in _LEN:
            size = int.from_bytes(raw[pos:pos + _LEN[b]], "big")
            pos += _LEN[b]
        else:  # 0xc1, never used: msgpack will say so
            return cost
        pos, cost = pos + size, cost + _STR + size
    return cost


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """Decode one frame made by ``encode``; raises WireFormatError for any malformed input."""
    mv = memoryview(data).cast("B")
    if len(mv) > max_bytes:
        raise WireFormatError(f"message of {len(mv)} bytes exceeds max_bytes={max_bytes}")
    if len(mv) < _PREFIX or bytes(mv[: len(MAGIC)]) != MAGIC:
        raise WireFormatError(f"not a troupe message: expected it to start with {MAGIC!r}")
    (header_len,) = _HEADER_LEN.unpack(mv[len(MAGIC) : _PREFIX])
    head_end = _PREFIX + header_len
    if head_end > len(mv):
        raise WireFormatError(
            f"truncated: header of {header_len} bytes but only {len(mv) - _PREFIX} follow"
        )
    body_start = head_end + _pad(head_end)
    raw = bytes(mv[_PREFIX:head_end])
    budget = HEADER_BUDGET * len(mv) + (4 << 20)
    cost = _header_cost(raw, max_depth, budget)
    if cost > budget:
        raise WireFormatError(f"header of {len(raw)} bytes would decode into about {cost} bytes "
                              f"of objects, more than {HEADER_BUDGET}x the {len(mv)}-byte frame")
    decoder = _Decoder(mv, body_start, max_depth, copy=mv.readonly)
    header = decoder.unpack(raw, 0)
    if not (isinstance(header, list) and len(header) == 2 and isinstance(header[1], int)):
        raise WireFormatError("header is not [tree, body length]")
    tree, body_len = header
    if body_start + body_len != len(mv):
        raise WireFormatError(
            f"frame should be {body_start + body_len} bytes long but is {len(mv)} "
            f"({'truncated' if len(mv) < body_start + body_len else 'trailing bytes'})"
        )
    return tree


def load(f: BinaryIO, **limits: int) -> Any:
    """Read one frame from the rest of a binary file. A file on disk is memory-mapped
    copy-on-write: the tensors view its pages, which are read as they are touched, and no copy
    of the file is made; another stream (a remote store's) is read into one buffer, which the
    tensors view."""
    max_bytes = limits.get("max_bytes", DEFAULT_MAX_BYTES)
    try:
        fileno = f.fileno()
        start, size = f.tell(), os.fstat(fileno).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):
        fileno = None
    if fileno is not None and size > start:
        if size - start > max_bytes:
            raise WireFormatError(f"message of {size - start} bytes exceeds "
                                  f"max_bytes={max_bytes}")
        mapped = mmap.mmap(fileno, 0, access=mmap.ACCESS_COPY)
        return decode(memoryview(mapped)[start:], **limits)
    buf = bytearray(f.read(max_bytes + 1))
    return decode(buf, **limits)
