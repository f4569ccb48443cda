"""What handing a prompt's KV from a prefill engine to a decode engine costs per token.

    python -m bench.kv_transfer [--tokens 2000] [--dtype float32] [--blocks-per-message 4]
        [--repeats 5]

In one process, over ZeroMQ ipc sockets as the engines and the frontend use them: a
prefill side's `BlockCopier.read` of a message's blocks (engine.kv_transfer), the two-part
message pushed to a relay socket and forwarded unchanged (as the frontend does), and the
decode side's `BlockCopier.write` of each block into its own cache. Caches have the default
model's shapes (30 layers, 3 KV heads, head_dim 64, 16-token blocks). Reports the median
over repeats: milliseconds, microseconds per token and GB/s of payload.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zmq

from bench.compare import machine
from engine.kv_transfer import BlockCopier

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def caches(num_blocks: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    return [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]


def one_hand_over(source: BlockCopier, target: BlockCopier, sockets: list[zmq.Socket],
                  num_blocks: int, per_message: int) -> float:
    send, relay_in, relay_out, receive = sockets
    started = time.perf_counter()
    for first in range(0, num_blocks, per_message):
        blocks = list(range(first, min(first + per_message, num_blocks)))
        send.send_multipart([b"header", source.read(blocks)], copy=False)
        relay_out.send_multipart(relay_in.recv_multipart(copy=False), copy=False)
        payload = receive.recv_multipart(copy=False)[1].buffer
        size = source.payload_bytes
        for index, block in enumerate(blocks):
            target.write(block, payload[index * size:(index + 1) * size])
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--blocks-per-message", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    num_blocks = args.tokens // BLOCK
    dtype = getattr(torch, args.dtype)
    source, target = BlockCopier(caches(num_blocks, dtype)), BlockCopier(caches(num_blocks, dtype))
    context = zmq.Context()
    with tempfile.TemporaryDirectory() as directory:
        sockets = [context.socket(kind) for kind in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL)]
        for (bind, connect), name in zip([(0, 1), (2, 3)], ("in", "out"), strict=True):
            address = f"ipc://{Path(directory) / name}"
            sockets[bind].bind(address)
            sockets[connect].connect(address)
        times = [one_hand_over(source, target, sockets, num_blocks, args.blocks_per_message)
                 for _ in range(args.repeats)]
        for socket in sockets:
            socket.close(linger=0)
    context.term()
    assert all(torch.equal(a, b) for a, b in zip(source.caches, target.caches, strict=True))
    median = statistics.median(times)
    tokens, size = num_blocks * BLOCK, source.payload_bytes * num_blocks
    print(machine())
    print(f"{tokens} tokens ({size / 1e6:.1f} MB of {args.dtype} KV, {args.blocks_per_message} "
          f"blocks a message): median {median * 1000:.1f} ms = {median / tokens * 1e6:.1f} us "
          f"per token, {size / median / 1e9:.2f} GB/s; runs "
          f"{', '.join(f'{t * 1000:.1f}' for t in times)} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
