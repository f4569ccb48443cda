"""KV cache block manager: fixed-size blocks, per-request block tables, O(1) allocate and free.

Pure Python (no torch): it hands out block ids; the model runner owns the tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class BlockManager:
    num_blocks: int
    block_size: int
    free_block_ids: deque[int] = field(init=False)
    num_integrity_violations: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.free_block_ids = deque(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_missing_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks the request still needs so its table covers its first num_tokens tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(request.block_table))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.num_missing_blocks(request, num_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_tokens: int) -> None:
        missing = self.num_missing_blocks(request, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"{request.request_id}: {missing} blocks needed, "
                               f"{self.num_free_blocks} free")
        popleft = self.free_block_ids.popleft
        request.block_table.extend(popleft() for _ in range(missing))

    def free(self, request: Request) -> None:
        # Tail first: the blocks a request filled last are the first to be reused.
        self.free_block_ids.extend(reversed(request.block_table))
        request.block_table = []

    def check_integrity(self, live_requests: list[Request]) -> list[str]:
        """Every block is either free or owned by exactly one live request. Returns violations."""
        owner: dict[int, str] = {}
        problems: list[str] = []
        for block_id in self.free_block_ids:
            if block_id in owner:
                problems.append(f"block {block_id} is on the free list twice")
            owner[block_id] = "<free>"
        for request in live_requests:
            for block_id in request.block_table:
                if block_id in owner:
                    problems.append(f"block {block_id} of {request.request_id} is also "
                                    f"held by {owner[block_id]}")
                owner[block_id] = request.request_id
        leaked = self.num_blocks - len(owner)
        if leaked:
            problems.append(f"{leaked} blocks are neither free nor owned by a live request")
        self.num_integrity_violations += len(problems)
        return problems
