"""Constrained requests waiting for their grammars: outside the scheduler (no seat, no KV
block) until every grammar is built, then handed over with their own matchers; failed when
a build errs or outlasts the compile timeout."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.request import Request
from engine.sampling.grammar import Constraint, GrammarBuild, GrammarCompiler


@dataclass(slots=True)
class AwaitingGrammar:
    request: Request
    builds: list[GrammarBuild]  # one per grammar of the request

    def running_for(self, now: float) -> float:
        return max(build.running_for(now) for build in self.builds)

    @property
    def is_built(self) -> bool:
        return all(build.future.done() for build in self.builds)


@dataclass(slots=True)
class GrammarWaitlist:
    compiler: GrammarCompiler
    timeout: float  # seconds a build may run
    waiting: dict[str, AwaitingGrammar] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    def add(self, request: Request) -> None:
        self.waiting[request.request_id] = AwaitingGrammar(
            request, [self.compiler.submit(grammar) for grammar in request.sampling.grammars])

    def take_built(self) -> tuple[list[Request], dict[str, str]]:
        """The requests whose grammars are built, each with its constraint set, and the
        reasons of those that failed (request id -> reason); both leave the list."""
        built: list[Request] = []
        failed: dict[str, str] = {}
        now = time.monotonic()
        for request_id, waiting in list(self.waiting.items()):
            if not waiting.is_built:
                if waiting.running_for(now) > self.timeout:
                    del self.waiting[request_id]
                    failed[request_id] = (f"the structured-output grammar took more than "
                                          f"{self.timeout:g} s to compile")
                continue
            del self.waiting[request_id]
            try:
                matchers = [build.future.result().deep_copy() for build in waiting.builds]
            except Exception as exc:  # whatever a build raises fails its request only
                failed[request_id] = f"invalid structured-output grammar: {exc}"
                continue
            waiting.request.constraint = Constraint(matchers)
            built.append(waiting.request)
        return built, failed

    def abort(self, request_ids: list[str]) -> None:
        """Drops the requests; a build no other waiting request needs is cancelled."""
        for request_id in request_ids:
            waiting = self.waiting.pop(request_id, None)
            if waiting is None:
                continue
            for grammar in waiting.request.sampling.grammars:
                if not any(grammar in other.request.sampling.grammars
                           for other in self.waiting.values()):
                    self.compiler.forget(grammar)
