"""A scripted stand-in for the engine process, and a harness that serves the real frontend
app against it, for fast frontend tests.

The fake engine binds the engine's two sockets in the test's event loop and answers each
AddRequest with a scripted token stream, one token per step and one frame per step for
all running requests; it honours AbortRequests and records everything it receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from common import protocol
from common.protocol import (
    AbortRequests,
    AddRequest,
    FinishReason,
    Ready,
    RequestError,
    RequestOutput,
    Shutdown,
    StepOutputs,
    StepStats,
)
from common.sockets import Endpoints, make_socket
from frontend.app import create_app
from frontend.state import EngineAddress, FrontendSettings

MODEL_NAME = "fake-model"
MAX_MODEL_LEN = 256
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world! The capital of France is Paris. Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog. Stop here. END of story.",
]


@functools.cache
def build_test_tokenizer() -> Any:
    """A tiny byte-level BPE tokenizer with a ChatML template, built offline and saved to
    disk like a model directory (so loading goes through `from_pretrained`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    wrapped.chat_template = CHATML_TEMPLATE
    model_dir = tempfile.mkdtemp(prefix="loom-test-tokenizer-")
    wrapped.save_pretrained(model_dir)
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def model_dir_of(tokenizer: Any) -> str:
    return str(Path(tokenizer.name_or_path))


def engine_info(tokenizer: Any) -> Ready:
    return Ready(
        model_name=MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        block_size=16,
        eos_token_ids=[tokenizer.eos_token_id],
        vocab_size=len(tokenizer),
    )


@dataclass(slots=True)
class _Running:
    request: AddRequest
    script: list[int]
    generated: int = 0


def fake_logprobs(token_id: int, num_top: int) -> list[Any]:
    """[chosen logprob, top-N]: the chosen token at -0.5, then the ids after it at
    -1.5, -2.5, ..."""
    return [-0.5, [[token_id + rank, -0.5 - rank] for rank in range(num_top)]]


@dataclass
class FakeEngine:
    endpoints: Endpoints
    eos_token_ids: list[int]
    step_interval_s: float = 0.001
    tokens_per_step: int = 1  # as a speculative engine's accepted drafts come, several a step
    queue_time_s: float = 0.25  # reported with each request's first token
    # The tokens to answer a request with, cycled when shorter than max_tokens.
    reply: Callable[[AddRequest], list[int]] = lambda request: [5, 6, 7]
    refuse: Callable[[AddRequest], str | None] = lambda request: None
    refusal_code: str = ""  # the RequestError code refusals carry
    # A token's logprobs entry, for requests that ask for logprobs.
    logprobs: Callable[[int, int], list[Any]] = fake_logprobs
    adds: list[AddRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    num_bad_frames: int = 0
    shutdowns: int = 0
    step: int = 0
    _running: dict[str, _Running] = field(default_factory=dict)
    _errors: list[RequestError] = field(default_factory=list)
    _task: asyncio.Task | None = None

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._requests = make_socket(self._context, zmq.PULL, self.endpoints.requests, bind=True)
        self._outputs = make_socket(self._context, zmq.PUSH, self.endpoints.outputs, bind=True)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._requests.close(linger=0)
            self._outputs.close(linger=0)
            self._context.term()

    async def send_raw(self, frame: bytes) -> None:
        await self._outputs.send(frame)

    async def send(self, message: protocol.Message) -> None:
        await self._outputs.send(protocol.encode(message))

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.005)

    async def _run(self) -> None:
        while True:
            if not self._running:
                self._handle(await self._requests.recv())
            while await self._requests.poll(timeout=0):
                self._handle(await self._requests.recv())
            while self._errors:
                await self.send(self._errors.pop(0))
            if self._running:
                await self._step()
            await asyncio.sleep(self.step_interval_s)

    def _handle(self, frame: bytes) -> None:
        try:
            message = protocol.decode(frame)
        except protocol.FrameError:
            self.num_bad_frames += 1
            return
        if isinstance(message, AddRequest):
            self.adds.append(message)
            reason = self.refuse(message)
            if reason is not None:
                self._errors.append(RequestError(message.request_id, reason,
                                                 self.refusal_code))
            else:
                self._running[message.request_id] = _Running(message, self.reply(message))
        elif isinstance(message, AbortRequests):
            self.aborted.extend(message.request_ids)
            for request_id in message.request_ids:
                self._running.pop(request_id, None)
        elif isinstance(message, Shutdown):
            self.shutdowns += 1

    async def _step(self) -> None:
        outputs = [self._output(request_id, running)
                   for request_id, running in list(self._running.items())]
        self.step += 1
        stats = StepStats(num_running=len(self._running),
                          num_generation_tokens=sum(len(o.new_token_ids) for o in outputs))
        await self.send(StepOutputs(self.step, outputs, stats))

    def _output(self, request_id: str, running: _Running) -> RequestOutput:
        """Up to tokens_per_step tokens of the script, cut where the request finishes."""
        tokens: list[int] = []
        finish = None
        while finish is None and len(tokens) < self.tokens_per_step:
            token = running.script[running.generated % len(running.script)]
            running.generated += 1
            tokens.append(token)
            finish = self._finish_reason(running, token)
        if finish is not None:
            del self._running[request_id]
        num_top = running.request.sampling.logprobs
        logprobs = None if num_top is None else [self.logprobs(t, num_top) for t in tokens]
        queue_time = self.queue_time_s if running.generated == len(tokens) else None
        return RequestOutput(request_id, tokens, finish, logprobs=logprobs,
                             queue_time_s=queue_time)

    def _finish_reason(self, running: _Running, token: int) -> str | None:
        sampling = running.request.sampling
        if running.generated >= sampling.min_tokens:
            if not sampling.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in sampling.stop_token_ids:
                return FinishReason.STOP
        if running.generated >= sampling.max_tokens:
            return FinishReason.LENGTH
        return None


class FrontendHarness:
    """The real frontend app on 127.0.0.1 (random port) in front of a FakeEngine."""

    def __init__(self, tokenizer: Any, engine_info_known: bool = True,
                 **settings: Any) -> None:
        """`settings`: FrontendSettings fields beyond the engine's (tenants, say)."""
        self.tokenizer = tokenizer
        self.info = engine_info(tokenizer)
        self.endpoints = Endpoints.private_ipc()
        self.engine = FakeEngine(self.endpoints, list(self.info.eos_token_ids))
        settings = FrontendSettings(
            MODEL_NAME,
            [EngineAddress(self.endpoints.requests, self.endpoints.outputs)],
            self.info if engine_info_known else None,
            **settings,
        )
        self.app = create_app(settings, tokenizer)
        self.server = TestServer(self.app, host="127.0.0.1")
        self.client = TestClient(self.server)

    async def __aenter__(self) -> FrontendHarness:
        await self.engine.start()
        await self.client.start_server()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.client.close()
        await self.engine.stop()
        self.endpoints.remove()

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def reply_with(self, text: str, eos: bool = True) -> list[int]:
        """Make the engine answer every request with `text` (then EOS)."""
        script = self.encode(text) + ([self.info.eos_token_ids[0]] if eos else [])
        self.engine.reply = lambda request: script
        return script
