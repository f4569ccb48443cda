"""Engine process entry: python -m engine --config-json JSON --requests-addr A --outputs-addr B."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from common.config import EngineConfig
from common.protocol import encode


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--requests-addr", required=True)
    parser.add_argument("--outputs-addr", required=True)
    parser.add_argument("--ready-fd", type=int, default=None,
                        help="file descriptor that receives the READY frame, then closes")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [engine] %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    # Heavy imports after argument parsing so `--help` stays instant.
    from engine.core import EngineCore
    from engine.server import EngineServer

    core = EngineCore(EngineConfig.from_json(args.config_json))
    server = EngineServer(core, args.requests_addr, args.outputs_addr)
    if args.ready_fd is not None:
        with os.fdopen(args.ready_fd, "wb") as ready_pipe:
            ready_pipe.write(encode(core.ready_message))
    logging.getLogger("loom.engine").info("ready: %s", core.ready_message)
    core.grammars.preload()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
