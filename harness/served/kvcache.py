"""The paged KV cache and its block allocator.

Each layer's keys and values live in `[num_blocks, block_size, kv_heads, head_dim]` tensors: the
layout of the attention target's decode contract. A sequence owns a list of blocks (its row of the
block table); token t of it sits in block `blocks[t // block_size]` at offset `t % block_size`.
The allocator hands out blocks lazily as sequences grow, from reservations made at admission (so a
running sequence never runs out and nothing is ever preempted); freed blocks go to the back of the
free list, so after some traffic a sequence's blocks are scattered, as in any paged server. One
block may be held out for good (the CUDA graphs' scratch block, harness/served/graphs.py).
Not covered: prefix sharing, swapping, preemption.
"""
from __future__ import annotations

from collections import deque

import torch


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.promised = 0                  # reserved by admitted sequences, not yet handed out

    def available(self) -> int:
        return len(self.free) - self.promised

    def reserve(self, n: int) -> bool:
        if n > self.available():
            return False
        self.promised += n
        return True

    def take(self) -> int:
        """One block out of an earlier reservation."""
        assert self.promised > 0 and self.free, "take() without a reservation"
        self.promised -= 1
        return self.free.popleft()

    def hold(self) -> int:
        """A block taken out for good, before anything is allocated (the CUDA graphs' scratch block):
        no sequence is ever given it, and the capacity no longer counts it."""
        assert self.promised == 0 and len(self.free) == self.num_blocks > 1, "hold() on a used allocator"
        self.num_blocks -= 1
        return self.free.pop()

    def release(self, blocks: list[int], unused_reservation: int) -> None:
        self.free.extend(blocks)
        self.promised -= unused_reservation
        assert 0 <= self.promised <= len(self.free) <= self.num_blocks


class PagedKVCache:
    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [tokens, kv_heads, head_dim] into flat slots (block * block_size + offset)."""
        kh, d = self.k.shape[-2:]
        self.k[layer].view(-1, kh, d).index_copy_(0, slots, k)
        self.v[layer].view(-1, kh, d).index_copy_(0, slots, v)
