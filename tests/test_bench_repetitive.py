"""The repetitive workload (bench/data/repetitive.jsonl) loads as a prompts file, and its
generator still finds functions and paragraphs to make it from."""

from __future__ import annotations

from bench.datasets.prompts_file import load_prompts
from bench.datasets.repetitive import OUTPUT, prompts


def test_the_committed_workload_loads_with_both_kinds_of_prompt():
    records = load_prompts(OUTPUT)
    assert len(records) >= 20 and all(record.kind == "chat" for record in records)
    rewrites = [r for r in records if r.prompt.startswith("Rewrite this Python function")]
    quotes = [r for r in records if r.prompt.startswith("Here is a passage")]
    assert len(rewrites) >= 10 and len(quotes) >= 5
    assert all("```python\ndef " in r.prompt for r in rewrites)


def test_the_generator_makes_the_same_kinds_again():
    made = prompts(count=10, seed=1)
    assert len(made) == 10
    assert {record["prompt"].split(" ")[0] for record in made} == {"Rewrite", "Here"}
