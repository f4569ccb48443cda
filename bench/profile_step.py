"""Where one engine step's time goes, by op class: a decode step at each batch size and,
optionally, one prefill step, in each forward mode.

    python -m bench.profile_step [--model DIR] [--dtype auto] [--batch 1,64] [--context 128]
        [--prefill 2048] [--steps 20] [--modes eager,taped,compiled] [--tensor-parallel-size 2]
        [--kv-cache-dtype int8]

The engine runs in-process (`EngineCore.step`: scheduler, runner, forward, sampler). Wall time
is the median of unprofiled steps; the op classes come from a torch.profiler run of the same
steps: each op's own (self) CPU time goes to a class by its name or by the function of ours
that issued it. Python/other is the wall time no op accounts for: the scheduler, building the
step's inputs, the interpreter between ops.

Modes: `eager` runs every step's forward op by op (`--enforce-eager`); `taped` as the engine
runs by default, small decode steps replayed from kernel tapes (engine.executor.decode_tapes),
each replayed call timed and classed by its kernel in steps of their own, without the
profiler, interleaved with the unprofiled ones; a prefill step runs as in `eager`, so this mode
profiles none; `compiled` through torch.compile. In every mode the linears and the C++
attention kernels outside the tapes are timed the same way (TIMED_CALLS): the profiler's
overhead falls on Python frames, and its classes are scaled down to the unprofiled wall time
over what no timed call covers only (scaled with the rest, a batch-64 step's GEMMs read ~20%
short).
"""

from __future__ import annotations

import argparse
import inspect
import platform
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from common.attribute_swap import attributes_replaced
from common.config import EngineConfig
from common.default_model import resolve_model
from common.protocol import AddRequest
from common.sampling import SamplingParams
from engine.attention import cpu_backend, torch_backend
from engine.attention.cpu_backend import CpuBackend
from engine.attention.torch_backend import TorchBackend
from engine.core import EngineCore
from engine.distributed.tensor_parallel import keep_to_cores, rank_layout
from engine.executor import kernel_tape
from engine.executor.kernel_tape import Tape
from engine.kernels import (
    elementwise,
    int4_matmul,
    moe_int4,
    paged_decode,
    paged_prefill,
    q8_0_matmul,
)
from engine.kernels import w8a8 as w8a8_kernels
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary, RotaryTables
from engine.platform.cpu import kernel_flags
from engine.quantization import base as quantization_base
from engine.quantization import int4, int8, q8_0, w8a8
from engine.quantization.base import QuantizedLinear
from engine.quantization.unquantized import PackedLinear
from engine.sampling import logits_processors, sampler

CLASSES = ("GEMM", "attention", "KV write", "norms", "rope", "activation", "sampler",
           "collectives", "Python/other")
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                      "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::_int_mm",
                      "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu"})
KV_WRITE_OPS = frozenset({"aten::index_copy_", "aten::index_put_"})
# Inductor names a fused kernel after the ops it fused: the first marker found decides.
FUSED_KERNEL_MARKERS = (("rsqrt", "norms"), ("silu", "activation"), ("sigmoid", "activation"),
                        ("roll", "rope"), ("addcmul", "rope"), ("index_copy", "KV write"))


def _line_range(function: Callable) -> tuple[str, range]:
    lines, first = inspect.getsourcelines(function)
    return _package_path(inspect.getsourcefile(function) or ""), range(first, first + len(lines))


def _package_path(path: str) -> str:
    """A module's file with its folder ("kernels/elementwise.py"): names repeat across folders."""
    return "/".join(Path(path).parts[-2:])


# The functions of ours whose ops and own Python time belong to a class: the C++ kernels run
# inside Python frames (called through ctypes), so those frames carry the kernels' time.
SCOPE_FUNCTIONS: dict[str, tuple[Callable, ...]] = {
    "norms": (RMSNorm.forward_native, RMSNorm.forward_cpu, elementwise.run_add_rms_norm),
    "rope": (Rotary.forward_native, Rotary.forward_cpu, RotaryTables.forward,
             elementwise.run_rotary),
    "activation": (SiluAndMul.forward_native, SiluAndMul.forward_cpu,
                   elementwise.run_silu_and_mul),
    "KV write": (TorchBackend.write_rows, CpuBackend.write_rows, paged_decode.run_write_kv),
}
# Whole modules; activation quantization and scaling belong to the product.
SCOPE_MODULES: dict[str, tuple[ModuleType, ...]] = {
    "attention": (torch_backend, cpu_backend, paged_decode, paged_prefill),
    "GEMM": (quantization_base, int4, int8, q8_0, w8a8, q8_0_matmul, w8a8_kernels, int4_matmul,
             moe_int4),
    "sampler": (sampler, logits_processors),
}
SCOPES: list[tuple[str, str, range]] = [
    (op_class, *_line_range(function))
    for op_class, functions in SCOPE_FUNCTIONS.items() for function in functions
] + [
    (op_class, _package_path(module.__file__ or ""), range(1, 10**6))
    for op_class, modules in SCOPE_MODULES.items() for module in modules
]


# A replayed tape's calls, by kernel (other calls are torch ops, classed by their names).
TAPED_KERNELS = {
    "loom_moe_int4": "GEMM", "loom_int4_matmul": "GEMM", "loom_w4a8_matmul": "GEMM",
    "loom_q8_0_matmul": "GEMM",
    "loom_quantize_rows": "GEMM", "loom_rescale": "GEMM", "loom_paged_decode": "attention",
    "loom_write_kv": "KV write", "loom_write_kv_codes": "KV write", "loom_add_rms_norm": "norms",
    "loom_rotary": "rope", "loom_silu_and_mul": "activation",
}
TAPE_FILE = _package_path(kernel_tape.__file__ or "")


def taped_class(name: str) -> str:
    if name in TAPED_KERNELS:
        return TAPED_KERNELS[name]
    return "GEMM" if name in GEMM_OPS else "KV write" if name in KV_WRITE_OPS else "Python/other"


@contextmanager
def timed_replays(class_us: dict[str, float]) -> Iterator[None]:
    """Every tape replayed call by call, each call's time added to its class."""
    def replay(tape: Tape, give_way: object = None) -> None:
        for name, call in zip(tape.names, tape.calls, strict=True):
            started = time.perf_counter()
            if call():
                raise RuntimeError(f"{name} refused its arguments")
            class_us[taped_class(name)] += (time.perf_counter() - started) * 1e6

    with attributes_replaced([(Tape, "replay", replay)]):
        yield


# Calls timed whole outside the tapes: the profiler's own overhead falls on Python frames, so
# scaling its classes down to the unprofiled wall time would shrink these kernels' share too.
TIMED_CALLS: tuple[tuple[str, type, str], ...] = (
    ("GEMM", QuantizedLinear, "forward"),
    ("GEMM", PackedLinear, "forward"),
    ("GEMM", nn.Linear, "forward"),
    ("attention", CpuBackend, "attend_kernel_rows"),
)
TIMED_SCOPES = [_line_range(getattr(owner, name)) for _, owner, name in TIMED_CALLS]


@contextmanager
def timed_calls(class_us: dict[str, float]) -> Iterator[None]:
    """TIMED_CALLS timed from the outermost entry of their class to its return (a quantized
    linear calls its dense copy, a PackedLinear), added to the class."""
    depth = Counter[str]()

    def timed(op_class: str, call: Callable) -> Callable:
        def wrapper(*args: object, **kwargs: object) -> object:
            depth[op_class] += 1
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                depth[op_class] -= 1
                if depth[op_class] == 0:
                    class_us[op_class] += (time.perf_counter() - started) * 1e6
        return wrapper

    with attributes_replaced([(owner, name, timed(op_class, getattr(owner, name)))
                              for op_class, owner, name in TIMED_CALLS]):
        yield


def in_timed_call(event: FunctionEvent) -> bool:
    """An op or frame inside a replayed tape or a TIMED_CALLS call (timed apart from the
    profiler)."""
    frames = [*([event.name] if is_python_frame(event.name) else []), *python_callers(event)]
    return any(TAPE_FILE in frame or frame_in(frame, TIMED_SCOPES) for frame in frames)


def frame_in(frame: str, scopes: list[tuple[str, range]]) -> bool:
    """Whether a Python frame "path/file.py(line): function" lies in one of `scopes`."""
    path, line = frame_location(frame)
    return any(path.endswith(file_name) and line in lines for file_name, lines in scopes)


def frame_location(frame: str) -> tuple[str, int]:
    """(path, line) of a Python frame "path/file.py(line): function"; line -1 if it has none."""
    file_part, _, _ = frame.partition(": ")
    path, _, line = file_part.rstrip(")").rpartition("(")
    return path, int(line) if line.isdigit() else -1


def is_python_frame(name: str) -> bool:
    return ".py(" in name or name.startswith(("<built-in", "<string>", "<frozen"))


def python_callers(event: FunctionEvent) -> Iterator[str]:
    """The Python frames around an op, innermost first: "path/file.py(line): function"."""
    parent = event.cpu_parent
    while parent is not None:
        yield parent.name
        parent = parent.cpu_parent


def scope_of(frame: str) -> str | None:
    """The class of a Python frame "path/file.py(line): function", if one of SCOPES."""
    path, line = frame_location(frame)
    return next((op_class for op_class, file_name, lines in SCOPES
                 if path.endswith(file_name) and line in lines), None)


def classify(event: FunctionEvent) -> str:
    name = event.name
    if is_python_frame(name):  # the interpreter's own time, or a ctypes kernel's
        return scope_of(name) or "Python/other"
    if name in GEMM_OPS:
        return "GEMM"
    if name in KV_WRITE_OPS:
        return "KV write"
    if name.startswith(("c10d::", "gloo:", "nccl:")):  # tensor parallelism's, waits included
        return "collectives"
    if name.startswith("loom::"):
        return "attention"
    for marker, op_class in FUSED_KERNEL_MARKERS:
        if "cpp_fused" in name and marker in name:
            return op_class
    return next(filter(None, map(scope_of, python_callers(event))), "Python/other")


@dataclass(slots=True)
class StepProfile:
    label: str
    wall_ms: float
    class_ms: dict[str, float] = field(default_factory=dict)

    def row(self) -> str:
        accounted = sum(self.class_ms.values())
        shares = {**self.class_ms, "Python/other": max(self.wall_ms - accounted, 0.0)
                  + self.class_ms.get("Python/other", 0.0)}
        cells = [f"{shares.get(name, 0.0):.1f} ({100 * shares.get(name, 0.0) / self.wall_ms:.0f}%)"
                 for name in CLASSES]
        return f"| {self.label} | {self.wall_ms:.1f} | " + " | ".join(cells) + " |"


def profile_steps(core: EngineCore, label: str, run_step: Callable[[], None],
                  steps: int) -> StepProfile:
    """Median wall time of `steps` steps, each followed by one whose replayed tapes' calls and
    TIMED_CALLS are timed call by call (the two kinds interleaved: this machine's speed
    drifts); then the op classes of `steps` more outside those calls, from the profiler, scaled
    to the wall time the timed calls leave."""
    walls = []
    timed_us = dict.fromkeys(CLASSES, 0.0)
    for _ in range(steps):
        started = time.perf_counter()
        run_step()
        walls.append(time.perf_counter() - started)
        with timed_replays(timed_us), timed_calls(timed_us):
            run_step()
    outside_us = dict.fromkeys(CLASSES, 0.0)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            run_step()
    events = prof.events()
    # The engine's own thread: the one that issues the ops (other threads, such as the
    # compiler's workers, only wait).
    ops_by_thread = Counter(event.thread for event in events if not is_python_frame(event.name))
    engine_thread = ops_by_thread.most_common(1)[0][0]
    for event in events:
        if event.thread == engine_thread and event.self_cpu_time_total > 0 \
                and not event.name.startswith(("## ", "Torch-Compiled")) \
                and not in_timed_call(event):
            outside_us[classify(event)] += event.self_cpu_time_total
    # Profiled ops run slower than unprofiled ones (the profiler's own Python frames most of
    # all): scale the classes outside the timed calls to the unprofiled wall those leave.
    wall_ms = statistics.median(walls) * 1000
    timed_ms = {name: us / steps / 1000 for name, us in timed_us.items()}
    # The timed steps are other steps than the median's: where the machine's drift puts their
    # calls past the median wall, they are scaled to it.
    over = sum(timed_ms.values()) / wall_ms
    if over > 1.0:
        timed_ms = {name: ms / over for name, ms in timed_ms.items()}
    left_ms = max(wall_ms - sum(timed_ms.values()), 0.0)
    profiled_ms = sum(outside_us.values()) / steps / 1000
    scale = min(1.0, left_ms / profiled_ms) if profiled_ms else 1.0
    class_ms = {name: timed_ms[name] + us * scale / steps / 1000
                for name, us in outside_us.items()}
    return StepProfile(label, wall_ms, class_ms)


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(length)]


def start_decoding(core: EngineCore, batch: int, context: int, rng: random.Random,
                   warm_up_steps: int = 3) -> list[str]:
    """`batch` greedy requests of `context` random tokens, stepped past their prefills and
    `warm_up_steps` decodes: from here on every step is a decode of each. Their ids."""
    vocab = core.model.config.vocab_size
    greedy = SamplingParams(max_tokens=core.max_model_len - context, temperature=0.0,
                            ignore_eos=True)
    ids = [f"decode-{index}" for index in range(batch)]
    for request_id in ids:
        core.add_request(AddRequest(request_id, random_prompt(rng, context, vocab), greedy,
                                    time.time()))
    while any(request.is_prefilling for request in core.scheduler.running) \
            or core.scheduler.waiting:
        core.step()
    for _ in range(warm_up_steps):
        core.step()
    return ids


def decode_profile(core: EngineCore, label: str, batch: int, context: int, steps: int,
                   rng: random.Random) -> StepProfile:
    ids = start_decoding(core, batch, context, rng)
    result = profile_steps(core, label, core.step, steps)
    core.abort_requests(ids)
    return result


def prefill_profile(core: EngineCore, label: str, length: int, steps: int,
                    rng: random.Random) -> StepProfile:
    vocab = core.model.config.vocab_size
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counter = iter(range(10**9))

    def one_prefill() -> None:
        core.add_request(AddRequest(f"prefill-{next(counter)}", random_prompt(rng, length, vocab),
                                    one_token, time.time()))
        while core.has_work:
            core.step()

    one_prefill()  # warm-up
    return profile_steps(core, label, one_prefill, steps)


def make_core(args: argparse.Namespace, mode: str, quantization: str) -> EngineCore:
    if mode == "compiled":  # name inductor's fused kernels in the profile
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    config = EngineConfig(
        model=resolve_model(args.model), dtype=args.dtype,
        max_num_seqs=max(args.batch), enable_prefix_caching=False,
        max_num_batched_tokens=max(args.prefill or 0, 2048),
        compile=mode == "compiled", enforce_eager=mode == "eager", quantization=quantization,
        tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.tensor_parallel_size > 1:  # as the engine process does: rank 0 on its cores
        keep_to_cores(0, rank_layout(config), torch.device("cpu"))
    core = EngineCore(config)
    # Every KV page mapped now, as a server that has run a while has: a page's first touch costs
    # milliseconds (engine.platform.huge_pages), which long contexts would otherwise pay inside
    # the profiled steps, as KV writes.
    core.runner.pages.map_all()
    return core


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--prefill", type=int, default=0, help="also profile one prefill step "
                                                               "of this many tokens")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="eager,taped,compiled")
    parser.add_argument("--quantization", default="",
                        help="comma-separated --quantization methods, each profiled eager")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the server's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks (this process is rank 0; its collectives' time, waits for "
                             "the other ranks included, is the `collectives` column)")
    args = parser.parse_args()
    args.batch = [int(size) for size in args.batch.split(",") if size]
    rng = random.Random(args.seed)
    rows = []
    # "auto": a GGUF --model as it is (its own 4-bit linears), float for safetensors;
    # "none": the float weights (the default model's safetensors).
    runs = [(mode, "auto") for mode in filter(None, args.modes.split(","))]
    runs += [("eager", method) for method in args.quantization.split(",")
             if method not in ("", "auto")]
    for mode, method in runs:
        core = make_core(args, mode, method)
        name = mode if method == "auto" else f"{mode} {method}"
        for batch in args.batch:
            rows.append(decode_profile(core, f"{name} decode, batch {batch}", batch,
                                       args.context, args.steps, rng).row())
            print(rows[-1], file=sys.stderr, flush=True)
        if args.prefill and mode != "taped":
            rows.append(prefill_profile(core, f"{name} prefill, {args.prefill} tokens",
                                        args.prefill, max(3, args.steps // 5), rng).row())
            print(rows[-1], file=sys.stderr, flush=True)
        core.shutdown()
        del core
    ranks = f" x {args.tensor_parallel_size} ranks" if args.tensor_parallel_size > 1 else ""
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
          f"{ranks}, "
          f"flags: {kernel_flags()}, torch {torch.__version__}, "
          f"dtype {args.dtype}, KV cache {args.kv_cache_dtype}, context {args.context} tokens; "
          "ms per step (share)\n")
    print("| step | wall ms | " + " | ".join(CLASSES) + " |")
    print("|---|--:|" + "--:|" * len(CLASSES))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
