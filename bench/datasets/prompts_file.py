"""Prompts from a JSON-lines file (default: bench/data/prompts.jsonl, written for Loom).

Each line: {"kind": "chat" | "completion", "prompt": "...", "system": "..." (optional)}.
With --input-len the N prompts whose lengths lie nearest it are used; a file with fewer
prompts than asked for is cycled.

`write_prompts` exports a drawn workload in a shape both this loader and `vllm bench serve
--dataset-name custom` read (a "prompt" and an "output_tokens" per line), so the two tools
can be pointed at the same requests.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.datasets.sample import DatasetSpec, SampleRequest, draw_length
from bench.datasets.tokenizer import BenchTokenizer


@dataclass(slots=True)
class PromptRecord:
    kind: str
    prompt: str
    system: str | None = None

    def as_sample_text(self, chat: bool) -> tuple[str, str | None]:
        if chat:
            return self.prompt, self.system
        if self.system is None:
            return self.prompt, None
        return f"{self.system}\n\n{self.prompt}", None


def load_prompts(path: Path) -> list[PromptRecord]:
    records = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                records.append(PromptRecord(entry["kind"], entry["prompt"], entry.get("system")))
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a prompt record ({exc})") from exc
    return records


def prompts_requests(spec: DatasetSpec, tokenizer: BenchTokenizer) -> list[SampleRequest]:
    rng = random.Random(spec.seed)
    records = load_prompts(spec.prompts_file)
    rng.shuffle(records)
    texts = [record.as_sample_text(spec.chat) for record in records]
    candidates = [(prompt, system, tokenizer.prompt_len(prompt, system, spec.chat))
                  for prompt, system in texts]
    if spec.input_len is not None:
        target = spec.input_len
        candidates.sort(key=lambda candidate: abs(candidate[2] - target))
    if spec.num_prompts > len(candidates):
        print(f"{spec.prompts_file} holds {len(candidates)} prompts; repeating them to make "
              f"{spec.num_prompts}", file=sys.stderr)
    chosen = list(itertools.islice(itertools.cycle(candidates), spec.num_prompts))
    rng.shuffle(chosen)
    return [SampleRequest(prompt, length, draw_length(rng, spec.output_len, spec.range_ratio),
                          system)
            for prompt, system, length in chosen]


def write_prompts(samples: list[SampleRequest], path: Path, chat: bool) -> None:
    """One line per sample; a chat sample's system message goes before its prompt, since
    vLLM's custom dataset sends the prompt as the lone user message."""
    with open(path, "w", encoding="utf-8") as out:
        for sample in samples:
            prompt = (sample.prompt if sample.system is None
                      else f"{sample.system}\n\n{sample.prompt}")
            record = {"kind": "chat" if chat else "completion", "prompt": prompt,
                      "output_tokens": sample.output_len}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
