"""`python -m frontend` as its own process, in front of the fake engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from dataclasses import asdict
from typing import Any

import aiohttp

from bench.launched import REPO_ROOT
from common.sockets import Endpoints, free_port
from tests.fake_engine import FakeEngine, build_test_tokenizer, engine_info


async def wait_healthy(url: str, process: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as session, asyncio.timeout(60):
        while True:
            assert process.returncode is None, "the frontend exited early"
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)


async def test_cli_serves_and_stops_cleanly_on_sigterm() -> None:
    tokenizer = build_test_tokenizer()
    info = engine_info(tokenizer)
    endpoints = Endpoints.private_ipc()
    engine = FakeEngine(endpoints, list(info.eos_token_ids))
    engine.reply = lambda request: [*tokenizer.encode("Hello world!"), info.eos_token_ids[0]]
    await engine.start()
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "frontend",
        "--host", "127.0.0.1", "--port", str(port),
        "--requests-addr", endpoints.requests, "--outputs-addr", endpoints.outputs,
        "--model-dir", tokenizer.name_or_path, "--served-model-name", "served",
        "--engine-info", json.dumps(asdict(info)),
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_healthy(f"{base}/health", process)
        async with aiohttp.ClientSession() as session:
            body: dict[str, Any] = {"model": "served", "prompt": "Hi"}
            async with session.post(f"{base}/v1/completions", json=body) as response:
                assert response.status == 200
                assert (await response.json())["choices"][0]["text"] == "Hello world!"
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=10)
        assert process.returncode == 0, stderr.decode()
        log = stderr.decode()
        assert "serving served on http://127.0.0.1" in log
        assert log.splitlines()[0][:4].isdigit()  # lines start with a timestamp
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await engine.stop()
        endpoints.remove()


async def test_frontend_does_not_import_torch() -> None:
    tokenizer = build_test_tokenizer()
    check = (
        "import sys, frontend.__main__ as entry; "
        f"entry.load_tokenizer({tokenizer.name_or_path!r}); "
        "import frontend.app; "
        "sys.exit(3 if 'torch' in sys.modules else 0)"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", check, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert await asyncio.wait_for(process.wait(), timeout=60) == 0
