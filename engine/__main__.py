"""Engine process entry: python -m engine --config-json JSON --requests-addr A --outputs-addr B."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from common.config import EngineConfig
from common.curve import CurveKeys, load_secret
from common.gc_heap import freeze_startup_heap
from common.protocol import encode
from common.sockets import is_tcp

if TYPE_CHECKING:
    from engine.server import EngineServer


class StopOnSigterm:
    """SIGTERM before the loop serves exits at once; once it serves, the loop ends after its
    step or poll and shuts down in order. An exception raised from a signal handler lands
    wherever the main thread happens to be, and some places swallow it (a weakref callback
    of a ThreadPoolExecutor did): the engine then ran on until killed."""

    def __init__(self) -> None:
        self.server: EngineServer | None = None  # once serving

    def __call__(self, signum: int, frame: object) -> None:
        if self.server is None:
            raise SystemExit(0)
        self.server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--requests-addr", required=True)
    parser.add_argument("--outputs-addr", required=True)
    parser.add_argument("--ready-fd", type=int, default=None,
                        help="file descriptor that receives the READY frame, then closes")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--data-parallel-rank", type=int, default=None,
                        help="this engine's rank among several (names it in the log)")
    args = parser.parse_args()
    name = "engine" if args.data_parallel_rank is None else f"engine {args.data_parallel_rank}"
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{name}] %(message)s")
    stop = StopOnSigterm()
    signal.signal(signal.SIGTERM, stop)

    # Heavy imports after argument parsing so `--help` stays instant.
    from engine.core import EngineCore, choose_device
    from engine.distributed.tensor_parallel import keep_to_cores, rank_layout
    from engine.server import EngineServer

    config = EngineConfig.from_json(args.config_json)
    if config.tensor_parallel_size > 1:  # rank 0 keeps to its share of the cores
        keep_to_cores(0, rank_layout(config), choose_device(config.device))
    core = EngineCore(config, log_level=args.log_level)
    try:
        curve = None
        if is_tcp(args.requests_addr) or is_tcp(args.outputs_addr):
            curve = CurveKeys.derive(load_secret(None))  # the secret comes in the environment
        server = EngineServer(core, args.requests_addr, args.outputs_addr, curve)
        frozen = freeze_startup_heap()
        if args.ready_fd is not None:
            with os.fdopen(args.ready_fd, "wb") as ready_pipe:
                ready_pipe.write(encode(core.ready_message))
        logging.getLogger("loom.engine").info("ready: %s (%d startup objects frozen out of the "
                                              "garbage collector)", core.ready_message, frozen)
        stop.server = server
        server.serve_forever()
    finally:  # SIGTERM may come at any point: tensor-parallel ranks are told to stop
        core.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is closed in order by now; skip the interpreter's teardown, which frees a
    # large KV cache page by page (~0.4 s for 5.6 GiB) while launch.py waits on the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
