"""Frontend process entry: `python -m frontend --port 8000 --requests-addr ... ...`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import disable_created_metrics

from common.gc_heap import freeze_startup_heap
from common.protocol import FrameError, Ready
from frontend.app import GUARD, create_app
from frontend.cli import add_frontend_args, check_kv_roles, check_tenant_args
from frontend.connection_guard import GuardedSite
from frontend.connection_limits import connection_cap, raise_descriptor_limit
from frontend.raw_reply import LINGER_S
from frontend.state import STATE, EngineAddress, FrontendSettings

logger = logging.getLogger("loom.frontend")

# After the drain: how long aborted requests get to write their last event.
ABORT_GRACE_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__)
    add_frontend_args(parser)
    parser.add_argument(
        "--requests-addr",
        required=True,
        action="append",
        help="ZeroMQ address of an engine's request socket (we connect); once per engine, "
        "in data-parallel rank order",
    )
    parser.add_argument(
        "--outputs-addr",
        required=True,
        action="append",
        help="ZeroMQ address of an engine's output socket (we connect); once per engine",
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="Hugging Face directory with the tokenizer and chat template",
    )
    parser.add_argument(
        "--engine-info", default=None, help="JSON object of the engine's Ready fields"
    )
    parser.add_argument(
        "--engine-info-fd",
        type=int,
        default=None,
        help="a pipe that brings --engine-info once the engine is ready (launch.py starts the "
        "frontend beside the engine, which loads its model meanwhile)",
    )
    parser.add_argument(
        "--engine-pid",
        type=int,
        action="append",
        default=None,
        help="an engine's process id, watched so that its exit is noticed at once; once per "
        "engine, in rank order",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.outputs_addr) != len(args.requests_addr):
        parser.error("give --requests-addr and --outputs-addr once per engine each")
    if args.engine_pid is not None and len(args.engine_pid) != len(args.requests_addr):
        parser.error("give --engine-pid once per engine, or not at all")
    check_tenant_args(parser, args)
    check_kv_roles(parser, args, len(args.requests_addr))
    return args


def engine_addresses(args: argparse.Namespace) -> list[EngineAddress]:
    pids = args.engine_pid or [0] * len(args.requests_addr)  # 0: not watched (remote)
    return [EngineAddress(requests, outputs, pid or None) for requests, outputs, pid
            in zip(args.requests_addr, args.outputs_addr, pids, strict=True)]


def parse_engine_info(text: str | None) -> Ready | None:
    if text is None:
        return None
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        return Ready.from_fields(*(fields[field.name] for field in dataclasses.fields(Ready)))
    except (ValueError, KeyError, FrameError) as exc:
        raise SystemExit(f"--engine-info: invalid engine info ({exc!r})") from exc


async def read_engine_info(fd: int) -> str | None:
    """All the pipe brings: launch.py writes the JSON and closes it, or closes it empty when
    no engine became ready. Read by the event loop, so a SIGTERM meanwhile is heard."""
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb"))
    try:
        text = (await reader.read()).decode()
    finally:
        transport.close()
    if not text:
        logger.info("no engine info: the engine did not become ready")
        return None
    return text


async def unless_stopped(work: Coroutine[Any, Any, str | None], stop: asyncio.Event,
                         ) -> str | None:
    """`work`'s result, or None (and `work` cancelled) when `stop` is set first."""
    working, stopping = asyncio.create_task(work), asyncio.create_task(stop.wait())
    await asyncio.wait((working, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not working.done():
        working.cancel()
        return None
    return working.result()


def load_tokenizer(model_dir: str, chat_template: str | None = None) -> Any:
    """The tokenizer; `chat_template` (a file) replaces the model's own template."""
    # AutoTokenizer imports torch; a directory with tokenizer.json does not need it.
    if (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    return tokenizer


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loading = asyncio.create_task(
        asyncio.to_thread(load_tokenizer, args.model_dir, args.chat_template))
    if args.engine_info_fd is not None:
        args.engine_info = await unless_stopped(read_engine_info(args.engine_info_fd), stop)
        if args.engine_info is None:  # stopped, or no engine became ready
            return
    engine_info = parse_engine_info(args.engine_info)
    served_name = args.served_model_name or (engine_info.model_name if engine_info else None)
    if not served_name:
        raise SystemExit("--served-model-name is required without --engine-info")
    tokenizer = await loading
    settings = FrontendSettings(
        served_name,
        engine_addresses(args),
        engine_info,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
        routing_policy=args.routing_policy,
        kv_roles=args.kv_role_list,
        pooling_type=args.pooling_type,
        tenants=args.tenant_table,
        admission_control=args.admission_control,
        request_read_timeout_s=args.request_read_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        max_connections=connection_cap(args.max_connections, raise_descriptor_limit()),
    )
    app = create_app(settings, tokenizer)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=ABORT_GRACE_S,
        # aiohttp's own idle close only backs up the guard's, which comes first
        keepalive_timeout=args.keep_alive_timeout + args.request_read_timeout,
        lingering_time=LINGER_S,
    )
    await runner.setup()
    try:
        if stop.is_set():
            return
        frozen = freeze_startup_heap()
        site = GuardedSite(runner, args.host, args.port, app[GUARD])
        await site.start()
        logger.info("serving %s on http://%s:%d (at most %d connections; requests must "
                    "arrive within %g s, idle connections close after %g s; %d startup objects "
                    "frozen out of the garbage collector)", served_name, args.host, args.port,
                    settings.max_connections, args.request_read_timeout,
                    args.keep_alive_timeout, frozen)
        await stop.wait()
        await drain(app, args.shutdown_timeout)
    finally:
        await runner.cleanup()
        logger.info("stopped")


async def drain(app: web.Application, timeout_s: float) -> None:
    """New API requests get 503; open ones get timeout_s to finish, then are aborted."""
    state = app[STATE]
    state.drain.start()
    logger.info("stopping: %d open requests get up to %.1f s", state.drain.in_flight, timeout_s)
    if await state.drain.wait_idle(timeout_s):
        return
    logger.warning("aborting %d requests still open after %.1f s", state.drain.in_flight,
                   timeout_s)  # fmt: skip
    if state.engine is not None:
        state.engine.fail_all("The server is shutting down.")
    await state.drain.wait_idle(ABORT_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    disable_created_metrics()
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
