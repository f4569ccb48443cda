"""Prefill/decode disaggregation: a request's prompt runs on a prefill engine, its decoding on
a decode engine, and the client reads one stream.

`--kv-roles` gives each engine (data-parallel rank) a role: `prefill`, `decode` or `both`
(vLLM's `kv_producer`, `kv_consumer`, `kv_both`). While a prefill and a decode engine serve,
each request (each choice) takes two legs:

1. The prefill leg goes to a prefill engine with max_tokens 1 and `export_kv`: it computes
   the prompt's KV and the first token, and sends the prompt's whole blocks as KV_BLOCKS
   frames as its chunks finish them; this frontend relays each frame as is (no copy) to the
   decode engine chosen for the request, over the engines' own links (ipc here, CURVE tcp
   to another host).
2. After the first token (streamed to the client at once), the decode leg goes to the decode
   engine with the prompt and that token: its prefix lookup finds the relayed blocks, it
   computes only the prompt's partial last block and the first token, and decodes on.

A request that ends at its first token (a stop token, max_tokens 1) has no decode leg. A
constrained or pooling request, or any request while no prefill or no decode engine serves,
runs whole on one engine. A prefill engine that dies before the first token re-routes the
request whole to its decode engine. Closing the stream aborts both legs; the decode engine
drops blocks that no request claims.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from common.protocol import AddRequest, FinishReason, RequestOutput
from frontend.request_stream import EngineDeadError, RequestStream

if TYPE_CHECKING:
    from frontend.engine_client import EngineClient
    from frontend.metrics import LoomMetrics

logger = logging.getLogger("loom.frontend.disaggregation")

KV_ROLES = ("prefill", "decode", "both")
VLLM_ROLE_NAMES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def parse_kv_roles(text: str, num_engines: int) -> list[str]:
    """`prefill,decode`-style roles, one per engine (vLLM's names accepted)."""
    roles = [VLLM_ROLE_NAMES.get(role.strip(), role.strip()) for role in text.split(",")]
    unknown = [role for role in roles if role not in KV_ROLES]
    if unknown:
        raise ValueError(f"unknown KV role {unknown[0]!r}: each is one of {KV_ROLES} (or "
                         f"{tuple(VLLM_ROLE_NAMES)})")
    if len(roles) != num_engines:
        raise ValueError(f"{len(roles)} KV roles for {num_engines} engines: give one each")
    return roles


@dataclass(slots=True)
class PrefillDecodeRoute:
    """The two engines of one API request; quacks like an EngineClient for a Generation."""

    prefill: EngineClient
    decode: EngineClient
    # Per prompt: its leading blocks the decode engine was sent before (frontend.router's
    # prefix index), which the prefill engine then does not send; a guess: a block the
    # decode engine has evicted since is recomputed there.
    decode_holds: dict[tuple[int, ...], int] = field(default_factory=dict)

    @property
    def metrics(self) -> LoomMetrics:
        return self.decode.metrics

    def add(self, request: AddRequest) -> RequestStream | DisaggregatedStream:
        sampling = request.sampling
        if sampling.grammars or sampling.pooling or sampling.max_tokens <= 1:
            return self.decode.add(request)
        return DisaggregatedStream(self, request)


@dataclass(eq=False)
class DisaggregatedStream:
    """One request's outputs from its prefill leg, then from its decode leg."""

    route: PrefillDecodeRoute
    request: AddRequest
    finished: bool = False
    _prefill: RequestStream | None = None
    _decode: RequestStream | None = None
    _num_cached_tokens: int = 0  # the prefill engine's prefix hit: what the client is told
    _sent_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        request, route = self.request, self.route
        route.prefill.kv_sinks[request.request_id] = route.decode.relay_kv
        first_token_only = replace(request.sampling, max_tokens=1)
        try:
            held = route.decode_holds.get(tuple(request.prompt_token_ids), 0)
            self._prefill = route.prefill.add(replace(request, sampling=first_token_only,
                                                      export_kv=True, kv_skip_blocks=held))
        except BaseException:
            self._stop_relay()
            raise

    def __aiter__(self) -> DisaggregatedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._decode is not None:
            output = await self._decode.__anext__()
            output.num_cached_tokens = self._num_cached_tokens
            self.finished = self._decode.finished
            return output
        assert self._prefill is not None
        try:
            output = await self._prefill.__anext__()
        except EngineDeadError:  # nothing came back: the decode engine runs it whole
            logger.warning("prefill engine %d is gone before %s's first token: engine %d "
                           "runs it whole", self.route.prefill.rank, self.request.request_id,
                           self.route.decode.rank)
            self._stop_relay()
            self._decode = self.route.decode.add(self.request)
            return await self.__anext__()
        self._num_cached_tokens = output.num_cached_tokens
        if output.finish_reason != FinishReason.LENGTH or not output.new_token_ids:
            self.finished = output.finish_reason is not None
            return output  # a stop token, an abort, a deadline: the request ends here
        self._stop_relay()
        self._decode = self.route.decode.add(self._decode_leg(output.new_token_ids))
        output.finish_reason = None
        return output

    def _decode_leg(self, first: list[int]) -> AddRequest:
        timeout_s = self.request.timeout_s
        if timeout_s is not None:
            timeout_s = max(timeout_s - (time.monotonic() - self._sent_at), 1e-3)
        return replace(self.request, output_token_ids=first, timeout_s=timeout_s)

    def _stop_relay(self) -> None:
        self.route.prefill.kv_sinks.pop(self.request.request_id, None)

    def close(self) -> None:
        self._stop_relay()
        if self._prefill is not None:
            self._prefill.close()
        if self._decode is not None:
            self._decode.close()
        elif not self.finished:  # blocks relayed for a decode leg that never came
            self.route.decode.abort([self.request.request_id])
