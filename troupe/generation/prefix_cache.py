"""Keys and values of prompt prefixes kept between requests: a prompt that starts as an earlier
one did (a long system prompt, the samples of one GRPO group admitted at different steps, a
multi-turn conversation's earlier turns) runs only what follows the longest cached prefix.

A prompt is cut into blocks of ``block`` tokens; a block's key hashes the key of the block
before it with its own tokens, so a key names the whole prefix up to the block's end, and it
starts from ``namespace`` (the weights' version, the adapter's name): nothing computed under
other weights is ever reused. What is left after the last whole block is kept too, as a
shorter "tail" block under the key of the prefix before it: a multi-turn conversation whose
next turn continues the tokens of the last (troupe.rlhf.agents.loop keeps each finished turn) then
runs only its new tokens, not up to a block of the old ones again. Each block holds its keys and values for every layer, (kv_heads,
block, head_dim) each; blocks are evicted least recently used first once their bytes pass
``budget_bytes``. A hit is copied into the newcomer's slot at admission (troupe.generation.
slots), which costs a copy of the prefix's keys and values instead of its forward pass.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Block:
    k: list[torch.Tensor]  # per layer (kv_heads, block, head_dim)
    v: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PrefixCache:
    def __init__(self, budget_bytes: int = 512 << 20, block: int = 16):
        self.budget_bytes, self.block = budget_bytes, block
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        # tails: the key of the whole blocks before a tail -> {the tail's key: its tokens}
        self.tails: dict[bytes, dict[bytes, tuple[int, ...]]] = {}
        self.tail_parent: dict[bytes, bytes] = {}
        self.nbytes = 0
        self.hit_tokens = 0      # prompt tokens served from the cache
        self.lookup_tokens = 0   # prompt tokens looked up
        self._lock = threading.Lock()

    def keys(self, tokens: list[int], namespace: str = "") -> list[bytes]:
        """The key of each whole block of ``tokens``."""
        out, h = [], self._root(namespace)
        B = self.block
        for i in range(len(tokens) // B):
            chunk = ",".join(map(str, tokens[i * B:(i + 1) * B])).encode()
            h = hashlib.blake2b(h + chunk, digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, tokens: list[int], namespace: str = "") -> tuple[int, list[Block]]:
        """The longest cached prefix of ``tokens`` that leaves at least one token to run (the
        next token's logits come from the last one): its length and blocks. The caller
        ``record``s what it makes of it (a prompt may be looked up again once a newcomer
        ahead of it has been cached)."""
        keys = self.keys(tokens[:-1], namespace)
        found = []
        with self._lock:
            for key in keys:
                b = self.blocks.get(key)
                if b is None:
                    break
                found.append((key, b))
            n = len(found) * self.block
            parent = found[-1][0] if found else self._root(namespace)
            best = max((t for t in self.tails.get(parent, {}).items()
                        if n + len(t[1]) < len(tokens) and tuple(tokens[n:n + len(t[1])]) == t[1]),
                       key=lambda t: len(t[1]), default=None)
            if best is not None:
                found.append((best[0], self.blocks[best[0]]))
                n += len(best[1])
            for key, _ in reversed(found):  # the first blocks become the most recent:
                self.blocks.move_to_end(key)  # a prefix outlives what continues it
        return n, [b for _, b in found]

    @staticmethod
    def _root(namespace: str) -> bytes:
        return hashlib.blake2b(namespace.encode(), digest_size=16).digest()

    def record(self, tokens: int, hit: int) -> None:
        """A prompt of ``tokens`` tokens admitted, ``hit`` of them from the cache."""
        with self._lock:
            self.lookup_tokens += tokens
            self.hit_tokens += hit

    def insert(self, tokens: list[int], k: list[torch.Tensor], v: list[torch.Tensor],
               namespace: str = "") -> None:
        """Keep the whole blocks of ``tokens`` whose keys and values are ``k``, ``v`` (per layer
        (kv_heads, len(tokens), head_dim), or longer: the first positions are the prompt's)."""
        B = self.block
        keys = self.keys(tokens, namespace)
        whole = len(keys) * B
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self.blocks:
                    self._add(key, k, v, i * B, (i + 1) * B)
            order = list(keys)
            if whole < len(tokens):  # the tail, under the key of what comes before it
                parent = keys[-1] if keys else self._root(namespace)
                tail = tuple(tokens[whole:])
                key = hashlib.blake2b(parent + b"|tail|" + ",".join(map(str, tail)).encode(),
                                      digest_size=16).digest()
                if key not in self.blocks:
                    self._add(key, k, v, whole, len(tokens))
                    self.tails.setdefault(parent, {})[key] = tail
                    self.tail_parent[key] = parent
                order.append(key)
            for key in reversed(order):  # the first blocks the most recent: under pressure the
                self.blocks.move_to_end(key)  # deepest go first, and what stays is a prefix
            while self.nbytes > self.budget_bytes:
                key, old = self.blocks.popitem(last=False)
                self.nbytes -= old.nbytes
                parent = self.tail_parent.pop(key, None)
                if parent is not None:
                    del self.tails[parent][key]
                    if not self.tails[parent]:
                        del self.tails[parent]

    def _add(self, key: bytes, k: list[torch.Tensor], v: list[torch.Tensor], lo: int,
             hi: int) -> None:
        block = Block([t[:, lo:hi].clone() for t in k], [t[:, lo:hi].clone() for t in v])
        self.blocks[key] = block
        self.nbytes += block.nbytes

    def clear(self) -> None:
        with self._lock:
            self.blocks.clear()
            self.tails.clear()
            self.tail_parent.clear()
            self.nbytes = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
