"""Communicator on NCCL through cupy.cuda.nccl, for CUDA tensors.

Tensors are handed to NCCL by pointer through DLPack views (no copies) and every operation is
enqueued on the tensor's current torch CUDA stream, so it orders with the surrounding torch work.
"""

from __future__ import annotations

from typing import Sequence

import torch

from troupe.collectives.base import (
    ReduceOp,
    check_op,
    even_splits,
    gather_output,
    reduce_in_place,
    resolve_splits,
)


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError("backend 'nccl' needs cupy with NCCL: pip install 'troupe[gpu]'") from e
    return nccl


def new_unique_id() -> bytes:
    """An NCCL unique id (made by rank 0 and shared with the others through the store)."""
    return bytes(b & 0xFF for b in _nccl().get_unique_id())


def _dtype(t: torch.Tensor) -> int:
    nccl = _nccl()
    table = {
        torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16,
        torch.float64: nccl.NCCL_FLOAT64, torch.int8: nccl.NCCL_INT8,
        torch.uint8: nccl.NCCL_UINT8, torch.int32: nccl.NCCL_INT32,
        torch.int64: nccl.NCCL_INT64, torch.bool: nccl.NCCL_UINT8,
    }
    if hasattr(nccl, "NCCL_BFLOAT16"):
        table[torch.bfloat16] = nccl.NCCL_BFLOAT16
    if t.dtype not in table:
        raise ValueError(f"NCCL cannot carry dtype {t.dtype}")
    return table[t.dtype]


def _op(op: str) -> int:
    nccl = _nccl()
    return {"sum": nccl.NCCL_SUM, "mean": nccl.NCCL_SUM, "max": nccl.NCCL_MAX,
            "min": nccl.NCCL_MIN, "prod": nccl.NCCL_PROD}[op]


class NcclCommunicator:
    """Communicator over an NCCL communicator (see base.Communicator); CUDA tensors only."""

    backend = "nccl"

    def __init__(self, name: str, unique_id: bytes, rank: int, world_size: int):
        nccl = _nccl()
        self.name, self.rank, self.world_size = name, rank, world_size
        uid = tuple(b if b < 128 else b - 256 for b in unique_id)  # cupy wants signed chars
        self.comm = nccl.NcclCommunicator(world_size, uid, rank)

    @staticmethod
    def _ptr(t: torch.Tensor) -> int:
        if not t.is_cuda:
            raise ValueError(f"the nccl backend needs CUDA tensors, got one on {t.device}")
        return t.data_ptr()

    @staticmethod
    def _stream(t: torch.Tensor) -> int:
        return torch.cuda.current_stream(t.device).cuda_stream

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        def reduce(buf: torch.Tensor) -> None:
            self.comm.allReduce(self._ptr(buf), self._ptr(buf), buf.numel(), _dtype(buf),
                                _op(op), self._stream(buf))
        return reduce_in_place(x, op, self.world_size, reduce)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        check_op(op)
        even_splits(x.shape[0], self.world_size)
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        self.comm.reduceScatter(self._ptr(x), self._ptr(out), out.numel(), _dtype(x), _op(op),
                                self._stream(x))
        if op == "mean":
            out.div_(self.world_size)
        return out

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        out = gather_output(x, out, self.world_size)
        self.comm.allGather(self._ptr(x), self._ptr(out), x.numel(), _dtype(x), self._stream(x))
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        buf = x if x.is_contiguous() else x.contiguous()
        self.comm.broadcast(self._ptr(buf), self._ptr(buf), buf.numel(), _dtype(buf), src,
                            self._stream(buf))
        if buf is not x:
            x.copy_(buf)
        return x

    def all_to_all(self, x: torch.Tensor, output_splits: Sequence[int] | None = None,
                   input_splits: Sequence[int] | None = None) -> torch.Tensor:
        nccl = _nccl()
        x = x.contiguous()
        output_splits, input_splits = resolve_splits(self, x, output_splits, input_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        row = x[0].numel() if x.dim() > 1 else 1
        item, dtype, stream = x.element_size(), _dtype(x), self._stream(x)
        send_off = recv_off = 0
        nccl.groupStart()
        for peer in range(self.world_size):
            if input_splits[peer]:
                self.comm.send(x.data_ptr() + send_off * row * item, input_splits[peer] * row,
                               dtype, peer, stream)
            if output_splits[peer]:
                self.comm.recv(out.data_ptr() + recv_off * row * item, output_splits[peer] * row,
                               dtype, peer, stream)
            send_off += input_splits[peer]
            recv_off += output_splits[peer]
        nccl.groupEnd()
        return out

    def exchange_splits(self, input_splits: Sequence[int]) -> list[int]:
        device = torch.device("cuda", torch.cuda.current_device())
        counts = torch.tensor(list(input_splits), dtype=torch.int64, device=device)
        return self.all_to_all(counts, [1] * self.world_size, [1] * self.world_size).tolist()

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> None:
        x = x.contiguous()
        self.comm.send(self._ptr(x), x.numel(), _dtype(x), dst, self._stream(x))

    def recv(self, x: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.comm.recv(self._ptr(x), x.numel(), _dtype(x), src, self._stream(x))
        return x

    def barrier(self) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        self.all_reduce(torch.zeros(1, device=device))
        torch.cuda.current_stream(device).synchronize()

    def destroy(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
