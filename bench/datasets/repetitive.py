"""A workload whose answers repeat their prompts, where n-gram and suffix drafts pay: "rewrite
this function with one change" over Loom's own functions, and "copy this passage, then sum
it up" over paragraphs of Loom's own docs. Written once to bench/data/repetitive.jsonl
(the prompts file format), so every run sends the same requests:

    python -m bench.datasets.repetitive            # rewrites bench/data/repetitive.jsonl
    python -m bench.compare --dataset prompts --prompts-file bench/data/repetitive.jsonl \\
        --endpoint /v1/chat/completions ...
"""

from __future__ import annotations

import ast
import json
import random
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "bench" / "data" / "repetitive.jsonl"
SOURCES = ["engine/scheduler.py", "engine/block_manager.py", "engine/request.py",
           "frontend/detokenizer.py", "frontend/stop_strings.py", "common/sampling.py",
           "engine/speculative/ngram.py", "engine/kv_cache_groups.py"]
DOCS = ["README.md", "docs/architecture.md", "docs/batch-invariance.md"]


def functions(path: Path, min_lines: int = 8, max_lines: int = 30) -> list[tuple[str, str]]:
    """(source, a local name to rename) of each function of a fitting length."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        text = ast.get_source_segment(source, node)
        if text is not None:  # the first line comes without its indentation
            text = textwrap.dedent(" " * node.col_offset + text)
        if text is None or not min_lines <= text.count("\n") + 1 <= max_lines:
            continue
        names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                        and isinstance(n.ctx, ast.Store) and len(n.id) > 3})
        if names:
            found.append((text, names[0]))
    return found


def paragraphs(path: Path, min_words: int = 60, max_words: int = 140) -> list[str]:
    text = path.read_text()
    blocks = [" ".join(block.split()) for block in re.split(r"\n\s*\n", text)]
    return [block for block in blocks if min_words <= len(block.split()) <= max_words
            and not block.startswith(("|", "#", "```", "-", "*", "    "))]


def prompts(count: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rewrites = [(code, name) for source in SOURCES for code, name in functions(ROOT / source)]
    quotes = [block for doc in DOCS for block in paragraphs(ROOT / doc)]
    rng.shuffle(rewrites)
    rng.shuffle(quotes)
    records = []
    for code, name in rewrites[:count // 2]:
        records.append({"kind": "chat", "prompt": (
            f"Rewrite this Python function with one change: rename `{name}` to "
            f"`{name}_value`. Output the whole function and nothing else.\n\n```python\n"
            f"{code}\n```")})
    for block in quotes[:count - len(records)]:
        records.append({"kind": "chat", "prompt": (
            f"Here is a passage:\n\n{block}\n\nCopy the passage word for word, then add "
            "one sentence that sums it up.")})
    rng.shuffle(records)
    return records


def main() -> None:
    records = prompts()
    with open(OUTPUT, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} prompts to {OUTPUT}")


if __name__ == "__main__":
    main()
