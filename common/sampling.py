"""Per-request sampling parameters, shared by frontend (validation) and engine (sampler)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

POOLING_TYPES = (None, "last", "mean")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # number of top logprobs per token; None: no logprobs
    grammars: list[str] = field(default_factory=list)  # llguidance grammars the output must
    # match, every one of them (structured outputs; a JSON output adds its number bounds)
    # An embedding request (/v1/embeddings): its prompt's final hidden states pooled, the
    # last token's ("last") or their mean ("mean"), L2-normalized; None: a generation.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if not isinstance(self.grammars, list) or not all(
                isinstance(grammar, str) for grammar in self.grammars):
            raise ValueError("grammars must be a list of strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_wire(self) -> dict:
        wire = asdict(self)
        wire["logit_bias"] = [[int(k), float(v)] for k, v in self.logit_bias.items()]
        return wire

    @classmethod
    def from_wire(cls, wire: dict) -> SamplingParams:
        if not isinstance(wire, dict):
            raise TypeError("sampling params must be a map")
        known = {f.name for f in fields(cls)}
        unknown = set(wire) - known
        if unknown:
            raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
        values = dict(wire)
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"]}
        return cls(**values)
