"""A tensor-parallel rank other than 0:
`python -m engine.distributed.tp_worker --rank R --size N ...`,
started by the engine process (rank 0, engine.distributed.tensor_parallel.WorkerRanks).

It loads its slices of the model, allocates the KV cache for its heads (as many blocks as
rank 0 says), then runs every step rank 0 broadcasts, taking part in each collective, until
rank 0 says stop. It never schedules nor samples.
"""

from __future__ import annotations

import argparse
import logging
import sys

from common.config import EngineConfig
from common.gc_heap import freeze_startup_heap


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.distributed.tp_worker")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [tp rank {args.rank}] %(message)s")
    logger = logging.getLogger("loom.engine")

    import torch.distributed as dist

    from engine.attention.quantized_kv import cache_dtype
    from engine.core import choose_device
    from engine.distributed.tensor_parallel import (
        broadcast_int,
        host_group,
        init_group,
        keep_to_cores,
        rank_layout,
        receive_step,
    )
    from engine.executor.model_runner import ModelRunner, StepInputs
    from engine.kv_cache_groups import KVCacheLayout
    from engine.platform.cpu import choose_dtype
    from engine.weights.loader import load_model

    config = EngineConfig.from_json(args.config_json)
    device = choose_device(config.device)
    dtype = choose_dtype(config.dtype, device)
    keep_to_cores(args.rank, rank_layout(config), device)
    init_group(args.rank, args.size, args.master_addr, args.master_port, device)
    model = load_model(config.model, dtype, device, quantization=config.quantization,
                       group_size=config.quantization_group_size)
    num_blocks = broadcast_int()
    layout = KVCacheLayout.for_model(model.config, not config.disable_hybrid_kv_cache_manager)
    runner = ModelRunner(model, num_blocks, config.block_size, device, dtype, layout=layout,
                         cache_dtype=cache_dtype(config.kv_cache_dtype, dtype))
    logger.info("ready: %d of %d KV heads, %d KV blocks (%d startup objects frozen out of the "
                "garbage collector)", model.num_local_kv_heads, model.config.num_key_value_heads,
                num_blocks, freeze_startup_heap())
    while (packed := receive_step()) is not None:
        runner.run(StepInputs.unpack(packed))
    dist.barrier(group=host_group())  # rank 0 waits for this before closing the group
    dist.destroy_process_group()
    logger.info("stopped by rank 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
