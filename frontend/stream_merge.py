"""Several async iterators read as one, item by item as each becomes ready."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(position of the source iterator, item) pairs until every iterator is exhausted.

    The first exception from any source ends the merge with that exception; the reads
    still pending are cancelled, on any exit.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending: dict[asyncio.Future[T], int] = {}

    def read_next(position: int) -> None:
        pending[asyncio.ensure_future(_next(iterators[position]))] = position

    for position in range(len(iterators)):
        read_next(position)
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                position = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield position, item
                read_next(position)
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _next(iterator: AsyncIterator[T]) -> T:
    return await anext(iterator)
