"""A forward recorded as a tape of kernel calls, replayed without the Python around them.

At batch 1 a decode step of a 30-layer model makes ~300 calls into our C++ kernels, and the
Python around them (modules, views, allocations, argument checks) costs more than the
attention it wraps: ~2 ms of a ~7 ms step. A CUDA graph removes that on a GPU; on the CPU the
kernels themselves are the graph: one recording run over inputs at fixed addresses notes
each kernel call with its converted arguments, and each torch op between them; a replay makes
the same calls, in order, over the same buffers (engine.executor.decode_tapes stages each
step's inputs into them).

A recording is refused (the forward stays eager) where a replay could differ from running
the forward again:
- an op reads a tensor's value into Python (`.item()`, `.tolist()`, data-dependent shapes),
  or makes a tensor from Python values (`torch.tensor`);
- a kernel's pointer or a torch op's input lies in memory the tape cannot vouch for: not
  made during the recording, not held by the model (its parameters, buffers and the tensors
  its modules keep), not the KV caches, not the staged inputs, not a constant kept for the
  life of the process (engine.platform.lifelong).
Everything made during the recording stays alive with the tape, so no address it holds is
ever handed out again.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common.attribute_swap import attributes_replaced
from engine.attention.forward_context import StepGaveWay
from engine.kernels.build import loaded_kernels

aten = torch.ops.aten

# Ops that read values into Python or shape their output by them.
READS_VALUES = frozenset({
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
    aten.equal.default, aten.nonzero.default, aten.masked_select.default,
    aten.unique_consecutive.default, aten._unique2.default, aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
})
ALLOCATIONS = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_like.default,
})


class RecordingRefused(RuntimeError):
    """This forward cannot be replayed from a tape; the reason says why."""


GIVE_WAY_EVERY = 16  # replayed calls between two asks (about half a layer)


@dataclass(slots=True)
class Tape:
    calls: list[Callable[[], Any]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # each call's kernel or op ("aten::mul")
    # Everything the calls' addresses point into, alive as long as the tape
    keep: list[torch.Tensor] = field(default_factory=list)

    def replay(self, give_way: Callable[[], bool] | None = None) -> None:
        """Runs the calls; `give_way`, asked every GIVE_WAY_EVERY calls, stops the replay
        (StepGaveWay) where it answers True."""
        if give_way is None:
            for call in self.calls:
                if call():  # a kernel's nonzero status (ops and void kernels return None)
                    raise RuntimeError("a replayed kernel refused its arguments")
            return
        for start in range(0, len(self.calls), GIVE_WAY_EVERY):
            if give_way():
                raise StepGaveWay
            for call in self.calls[start:start + GIVE_WAY_EVERY]:
                if call():
                    raise RuntimeError("a replayed kernel refused its arguments")

    def add(self, name: str, call: Callable[[], Any]) -> None:
        self.names.append(name)
        self.calls.append(call)


class Storages:
    """Memory a tape may point into, as sorted [start, end) byte ranges."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, tensor: torch.Tensor) -> None:
        if tensor.is_mkldnn:  # packed weights: no storage to point into
            return
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        index = bisect.bisect_left(self.starts, start)
        if index < len(self.starts) and self.starts[index] == start:
            self.ends[index] = max(self.ends[index], start + storage.nbytes())
            return
        self.starts.insert(index, start)
        self.ends.insert(index, start + storage.nbytes())

    def covers(self, address: int) -> bool:
        index = bisect.bisect_right(self.starts, address) - 1
        return index >= 0 and address < self.ends[index]


def held_tensors(root: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """Tensors a module keeps: its parameters and buffers, and tensors among its attributes
    (inside tuples, lists, dicts and dataclasses, `depth` levels down)."""
    if isinstance(root, torch.Tensor):
        yield root
    elif depth == 0:
        return
    elif isinstance(root, torch.nn.Module):
        for module in root.modules():
            yield from module.parameters(recurse=False)
            yield from module.buffers(recurse=False)
            for name, value in vars(module).items():
                if name != "_modules" and not isinstance(value, torch.nn.Module):
                    yield from held_tensors(value, depth - 1)
    elif isinstance(root, (tuple, list)):
        for value in root:
            yield from held_tensors(value, depth - 1)
    elif isinstance(root, dict):
        for value in root.values():
            yield from held_tensors(value, depth - 1)
    elif dataclasses.is_dataclass(root) and not isinstance(root, type):
        for item in dataclasses.fields(root):
            yield from held_tensors(getattr(root, item.name), depth - 1)


class Recording(TorchDispatchMode):
    """Notes every torch op and kernel call of the forward run inside it onto `tape`."""

    def __init__(self, tape: Tape, trusted: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.tape = tape
        self.known = Storages()
        self.packed = set()  # ids of trusted tensors without storage (oneDNN's packed weights)
        for tensor in trusted:
            self.known.add(tensor)
            if tensor.is_mkldnn:
                self.packed.add(id(tensor))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in READS_VALUES:
            raise RecordingRefused(f"{func} reads a tensor's values into Python")
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        self.vouch(func, inputs)
        result = func(*args, **kwargs)
        outputs = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
        for tensor in outputs:
            self.known.add(tensor)
            self.tape.keep.append(tensor)
        mutates = any(a.alias_info is not None and a.alias_info.is_write
                      for a in func._schema.arguments)
        if func in ALLOCATIONS or (not mutates and views_only(outputs, inputs)):
            return result  # its memory, or a view of memory, the tape already holds
        self.tape.add(f"aten::{func.overloadpacket.__name__}",
                      mutating_op(func, args, kwargs) if mutates
                      else functional_op(func, args, kwargs, outputs))
        return result

    def vouch(self, what: Any, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.is_mkldnn:
                if id(tensor) in self.packed:
                    continue
                raise RecordingRefused(f"{what} reads packed weights the model does not hold")
            if tensor.numel() and not self.known.covers(tensor.data_ptr()):
                raise RecordingRefused(f"{what} reads a tensor made outside the recording "
                                       "that the model does not hold")

    def note_kernel(self, function: Any, args: tuple) -> None:
        for argtype, value in zip(function.argtypes, args, strict=True):
            if argtype is ctypes.c_void_p and value and not self.known.covers(value):
                raise RecordingRefused(f"kernel {function.__name__} points outside memory the "
                                       "tape holds")
        self.tape.add(function.__name__, kernel_call(function, args))


def views_only(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    """Whether every output is a view of an input: what this call did, not what the op's
    schema allows (`contiguous` and `reshape` copy when they must)."""
    def storage(tensor: torch.Tensor) -> int | None:
        return None if tensor.is_mkldnn else tensor.untyped_storage().data_ptr()

    sources = {storage(tensor) for tensor in inputs} - {None}
    return bool(outputs) and all(storage(tensor) in sources for tensor in outputs)


def mutating_op(func: Any, args: tuple, kwargs: dict) -> Callable[[], None]:
    def call() -> None:
        func(*args, **kwargs)
    return call


def functional_op(func: Any, args: tuple, kwargs: dict,
                  outputs: list[torch.Tensor]) -> Callable[[], None]:
    def call() -> None:
        results = [x for x in tree_flatten(func(*args, **kwargs))[0]
                   if isinstance(x, torch.Tensor)]
        for output, result in zip(outputs, results, strict=True):
            output.copy_(result)
    return call


def kernel_call(function: Any, args: tuple) -> Callable[[], Any]:
    """The kernel with its arguments converted once: the plain function pointer called with
    ctypes values (argtypes would convert them again on every call)."""
    raw = ctypes.CFUNCTYPE(function.restype)(ctypes.cast(function, ctypes.c_void_p).value)
    converted = [argtype(value) for argtype, value in zip(function.argtypes, args, strict=True)]

    def call() -> Any:
        return raw(*converted)
    return call


class RecordingKernel:
    """Stands in for a kernel while a forward records: runs it and notes the call."""

    def __init__(self, function: Any, recording: Recording) -> None:
        self.function = function
        self.recording = recording

    def __call__(self, *args: Any) -> Any:
        result = self.function(*args)
        self.recording.note_kernel(self.function, args)
        return result


@contextmanager
def values_guarded() -> Iterator[None]:
    """`.tolist()` and `.numpy()` read values without a torch op: refused while recording."""
    def refuse(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RecordingRefused("a tensor's values are read into Python (tolist / numpy)")

    with attributes_replaced([(torch.Tensor, "tolist", refuse), (torch.Tensor, "numpy", refuse)]):
        yield


@contextmanager
def kernels_recorded(recording: Recording) -> Iterator[None]:
    """Every loaded kernel library's functions replaced by recording stand-ins."""
    with attributes_replaced([(library, name, RecordingKernel(getattr(library, name), recording))
                              for library, names in loaded_kernels() for name in names]):
        yield


def record(step: Callable[[], torch.Tensor], trusted: Iterable[torch.Tensor],
           ) -> tuple[Tape, torch.Tensor]:
    """Runs `step` once, recording it; (the tape, the step's output, which each replay
    rewrites in place). `trusted`: memory outside the recording the step may read (the
    model's, the caches, the staged inputs). Raises RecordingRefused."""
    trusted = list(trusted)
    tape = Tape()
    recording = Recording(tape, trusted)
    with kernels_recorded(recording), values_guarded(), recording:
        output = step()
    tape.keep.extend(trusted)  # the staged inputs and caches live as long as the tape
    return tape, output

