"""Frontend process entry: `python -m frontend --port 8000 --requests-addr ... ...`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from common.protocol import FrameError, Ready
from frontend.app import create_app
from frontend.state import FrontendSettings

logger = logging.getLogger("loom.frontend")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--requests-addr",
        required=True,
        help="ZeroMQ address of the engine's request socket (we connect)",
    )
    parser.add_argument(
        "--outputs-addr",
        required=True,
        help="ZeroMQ address of the engine's output socket (we connect)",
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="Hugging Face directory with the tokenizer and chat template",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the engine's model name)",
    )
    parser.add_argument(
        "--engine-info", default=None, help="JSON object of the engine's Ready fields"
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=1.0,
        help="seconds open requests get to finish on SIGTERM/SIGINT",
    )
    return parser.parse_args(argv)


def parse_engine_info(text: str | None) -> Ready | None:
    if text is None:
        return None
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        return Ready.from_fields(
            fields["model_name"],
            fields["max_model_len"],
            fields["num_kv_blocks"],
            fields["block_size"],
            fields["eos_token_ids"],
            fields["vocab_size"],
            fields["protocol_version"],
        )
    except (ValueError, KeyError, FrameError) as exc:
        raise SystemExit(f"--engine-info: invalid engine info ({exc!r})") from exc


def load_tokenizer(model_dir: str) -> Any:
    # AutoTokenizer imports torch; a directory with tokenizer.json does not need it.
    if (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    engine_info = parse_engine_info(args.engine_info)
    served_name = args.served_model_name or (engine_info.model_name if engine_info else None)
    if not served_name:
        raise SystemExit("--served-model-name is required without --engine-info")
    tokenizer = await asyncio.to_thread(load_tokenizer, args.model_dir)
    settings = FrontendSettings(served_name, args.requests_addr, args.outputs_addr, engine_info)
    runner = web.AppRunner(
        create_app(settings, tokenizer),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=args.shutdown_timeout,
    )
    await runner.setup()
    try:
        if stop.is_set():
            return
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        logger.info("serving %s on http://%s:%d", served_name, args.host, args.port)
        await stop.wait()
        logger.info("stopping")
    finally:
        await runner.cleanup()
        logger.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
