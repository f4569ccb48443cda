"""The transformers baseline: W1's prompts through `model.generate` in static batches,
in-process, greedy, every answer forced to the full output length.

    python -m bench.hf_generate [--model DIR] [--dtype auto] [--device auto]
        [--batch 1,32,64] [--num-prompts 64] [--output-len 128] [--max-batches N]

Each batch size runs the same prompts (chat template applied, left-padded) in consecutive
batches of that size (the first N of them with --max-batches); output tok/s = generated
tokens / wall time of those batches. What
`bench.compare` reports for servers at concurrency c, this reports for batch c.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.datasets import BenchTokenizer, DatasetSpec, build_dataset, chat_messages
from common.default_model import resolve_model
from engine.core import choose_device
from engine.platform.cpu import choose_dtype


def run_batches(model, tokenizer, prompts: list[str], batch: int, output_len: int,
                max_batches: int | None = None) -> float:
    """Output tokens per second over the prompts in batches of `batch` (the first
    `max_batches` batches when set)."""
    generated, started = 0, time.perf_counter()
    for first in list(range(0, len(prompts), batch))[:max_batches]:
        inputs = tokenizer(prompts[first:first + batch], return_tensors="pt",
                           padding=True).to(model.device)
        with torch.inference_mode():
            output = model.generate(**inputs, max_new_tokens=output_len,
                                    min_new_tokens=output_len, do_sample=False)
        generated += (output.shape[1] - inputs["input_ids"].shape[1]) * output.shape[0]
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_generate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="auto", help="auto: what launch.py would pick")
    parser.add_argument("--device", default="auto", help="auto: cuda when there is one")
    parser.add_argument("--batch", default="1,32,64")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-batches", type=int, default=None,
                        help="at most this many batches per size (batch 1 of 256 prompts "
                             "is 256 sequential generates)")
    args = parser.parse_args()

    import transformers

    model_dir = resolve_model(args.model)
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(
        device).eval()
    samples = build_dataset(DatasetSpec(name="prompts", num_prompts=args.num_prompts,
                                        input_len=args.input_len, output_len=args.output_len,
                                        chat=True), BenchTokenizer.load(model_dir))
    prompts = [tokenizer.apply_chat_template(chat_messages(sample.prompt, sample.system),
                                             tokenize=False,
                                             add_generation_prompt=True) for sample in samples]
    run_batches(model, tokenizer, prompts[:1], 1, 4)  # warm-up
    print(f"transformers {transformers.__version__} generate on {device}, {dtype}, "
          f"{torch.get_num_threads()} threads, {len(prompts)} prompts, "
          f"{args.output_len} tokens forced\n")
    print("| batch | output tok/s |\n|--:|--:|")
    for batch in (int(size) for size in args.batch.split(",") if size):
        rate = run_batches(model, tokenizer, prompts, batch, args.output_len, args.max_batches)
        print(f"| {batch} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
