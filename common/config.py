"""Engine configuration: one dataclass, built from launch.py flags, sent to the engine as JSON."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from common.speculative import SpeculativeConfig

DEFAULT_CUDA_KV_CACHE_FRACTION = 0.8
# Measured on W1 against 2048 and 4096 (docs/benchmarks.md): lower TTFT, same throughput. The
# engine's flag defaults to its machine's budget (engine.platform.machine), this where a
# config is built by hand.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8", "w4a8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's; fp8 = fp8_e4m3


@dataclass(slots=True)
class EngineConfig:
    model: str  # a local Hugging Face directory (config.json + safetensors + tokenizer)
    served_model_name: str = ""
    dtype: str = "auto"  # auto | float32 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: from the machine (engine.platform.machine)
    num_kv_blocks: int | None = None  # overrides the count derived from kv_cache_memory
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; 8-bit: engine.attention.quantized_kv
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS  # None: the machine's
    max_model_len: int | None = None  # None: the model's own limit
    # Running requests a step takes while tenants contend (engine.fair_share); None: the
    # machine's (engine.platform.machine), or no cap where a config is built by hand
    fair_step_rows: int | None = None
    batching: str = "continuous"  # continuous | static
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower value first, FCFS within a level)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # The prefix cache's disk tier (engine.kv_offload): where, and how many bytes (0: off)
    kv_offload_dir: str | None = None  # None: $LOOM_CACHE/kv
    kv_offload_bytes: int = 0
    # One block table for all layers even where sliding-window and global layers mix: every
    # layer keeps every block (engine.kv_cache_groups)
    disable_hybrid_kv_cache_manager: bool = False
    seed: int = 0
    compile: bool = False  # torch.compile the forward (engine.executor.compiled_forward)
    enforce_eager: bool = False  # vLLM's flag: no CUDA graphs or kernel tapes, never compile
    quantization: str = "auto"  # auto (a GGUF's own) | none | int8 | int4 | w8a8
    # A row's logits the same bits whatever shares its step (engine.layers.batch_invariant)
    batch_invariant: bool = False
    quantization_group_size: int = 32  # int4: input channels per scale and zero
    speculative_config: str | None = None  # JSON (common.speculative); None: no drafts
    grammar_compile_timeout: float = 5.0  # seconds a structured-output grammar may take to build
    tensor_parallel_size: int = 1  # ranks over torch.distributed (engine.distributed)
    nnodes: int = 1  # hosts the tensor-parallel ranks span, as many ranks on each
    node_rank: int = 0  # this host's index among them (0: the engine's)
    master_addr: str = "127.0.0.1"  # torch.distributed's TCP rendezvous (node 0's address)
    master_port: int | None = None  # None: a free port (one host only)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.fair_step_rows is not None and self.fair_step_rows < 1:
            raise ValueError("fair_step_rows must be positive")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be continuous or static, not {self.batching!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, "
                             f"not {self.scheduling_policy!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"not {self.kv_cache_dtype!r}")
        if self.quantization_group_size < 1:
            raise ValueError("quantization_group_size must be positive")
        if self.kv_offload_bytes < 0:
            raise ValueError("kv_offload_bytes must not be negative")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be positive")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"{self.tensor_parallel_size} tensor-parallel ranks do not split "
                             f"evenly over {self.nnodes} nodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not among {self.nnodes} nodes")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("ranks on several nodes need --master-addr and --master-port")
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # a bad one fails at start
        if self.batch_invariant and self.compiled:
            raise ValueError("--batch-invariant runs the forward eagerly: drop --compile")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("--batch-invariant is not offered with tensor parallelism yet "
                             "(its all-reduce is not checked): use --tensor-parallel-size 1")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def max_drafts(self) -> int:
        """The most drafts a request verifies in a step (0 without speculative decoding)."""
        speculative = self.speculative
        return 0 if speculative is None else speculative.max_drafts

    @property
    def compiled(self) -> bool:
        return self.compile and not self.enforce_eager

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        return cls(**json.loads(text))

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_dir: str) -> EngineConfig:
        return cls(
            model=model_dir,
            served_model_name=args.served_model_name or "",
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            fair_step_rows=args.fair_step_rows,
            batching=args.batching,
            scheduling_policy=args.scheduling_policy,
            enable_chunked_prefill=not args.no_enable_chunked_prefill,
            enable_prefix_caching=not args.no_enable_prefix_caching,
            kv_offload_dir=args.kv_offload_dir,
            kv_offload_bytes=args.kv_offload_bytes,
            disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
            seed=args.seed,
            compile=args.compile,
            enforce_eager=args.enforce_eager,
            quantization=args.quantization,
            batch_invariant=args.batch_invariant or batch_invariant_from_env(),
            quantization_group_size=args.quantization_group_size,
            grammar_compile_timeout=args.grammar_compile_timeout,
            speculative_config=args.speculative_config,
            tensor_parallel_size=args.tensor_parallel_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
        )


def batch_invariant_from_env() -> bool:
    """vLLM's switch for the same mode, read as ours."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")


def speculative_json(text: str) -> str:
    try:
        SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags named as vLLM names them, where vLLM has one."""
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--kv-cache-memory", type=int, default=None,
                        help="KV cache size in bytes (default: on CPU a quarter of the "
                             "available memory, 1-64 GiB; on CUDA 80%% of free memory)")
    engine.add_argument("--num-kv-blocks", type=int, default=None,
                        help="exact number of KV blocks (overrides --kv-cache-memory)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; int8 / fp8 (e4m3) / fp8_e5m2: 8-bit "
                             "codes and a scale per token and head, ~2x the tokens in the same "
                             "memory (int8 read by the C++ kernel on CPUs; fp8 through torch "
                             "ops)")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step, decodes and prefill chunks together (default: "
                             "512 per core with native bf16, 256 without, 512-8192; 8192 on "
                             "CUDA)")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--fair-step-rows", type=int, default=None,
                        help="with --tenants: while tenants contend, a step runs at most this "
                             "many running requests, each tenant within its share its share of "
                             "them, the others in turns (default: 16 on a CPU, where a step's "
                             "time grows with its rows; no cap on CUDA)")
    engine.add_argument("--batching", default="continuous", choices=["continuous", "static"])
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument("--no-enable-chunked-prefill", action="store_true")
    engine.add_argument("--no-enable-prefix-caching", action="store_true")
    engine.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="sliding-window layers keep every block of a request, as global "
                             "layers do, instead of returning those behind the window")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--compile", action="store_true",
                        help="torch.compile the forward (inductor); the first start compiles "
                             "for ~1 min, later ones load the compile cache")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs for decode steps on a GPU, no kernel tapes on "
                             "a CPU, and never compile the forward (wins over --compile)")
    engine.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATIONS,
                        help="weights quantized at load: int8 / int4 weight-only, w8a8 (int8 "
                             "weights and per-token int8 activations), w4a8 (int4 weights and "
                             "int8 activations per group of 32, llama.cpp's Q4 x Q8_1; on a "
                             "GGUF, its own 4-bit codes); auto: as the checkpoint holds them")
    engine.add_argument("--batch-invariant", action="store_true",
                        help="a request's tokens do not depend on what shares its steps, on "
                             "prefix-cache hits, chunking or preemption (bitwise-equal "
                             "logits); costs speed, see the README. VLLM_BATCH_INVARIANT=1 "
                             "sets it too")
    engine.add_argument("--speculative-config", default=None, type=speculative_json,
                        help='speculative decoding, vLLM\'s JSON: {"method": "ngram" | '
                             '"suffix" | "draft_model", "num_speculative_tokens": k, '
                             '"prompt_lookup_min": ..., "prompt_lookup_max": ..., "model": ...} '
                             '(docs/speculative-decoding.md)')
    engine.add_argument("--quantization-group-size", type=int, default=32,
                        help="int4: input channels sharing one scale and zero (default 32)")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks one engine splits the model over (torch.distributed: gloo "
                             "on CPU, each rank its share of the cores; NCCL on CUDA)")
    engine.add_argument("--nnodes", type=int, default=1,
                        help="hosts the tensor-parallel ranks span (each runs as many)")
    engine.add_argument("--node-rank", type=int, default=0,
                        help="this host's index: 0 runs the engine, others run "
                             "`launch.py --headless` with their ranks")
    engine.add_argument("--master-addr", default="127.0.0.1",
                        help="node 0's address for torch.distributed's TCP rendezvous "
                             "(unauthenticated: a trusted network only)")
    engine.add_argument("--master-port", type=int, default=None,
                        help="its port (default: a free one, on one host only)")
    engine.add_argument("--kv-offload-dir", default=None,
                        help="the prefix cache's disk tier: cached KV blocks are written here "
                             "and read back on a prefix hit, also after a restart (default "
                             "$LOOM_CACHE/kv)")
    engine.add_argument("--kv-offload-bytes", type=int, default=0,
                        help="the disk tier's size in bytes, least recently used blocks out "
                             "first (default 0: no disk tier)")
    engine.add_argument("--grammar-compile-timeout", type=float, default=5.0,
                        help="seconds a structured-output grammar may take to compile before "
                             "its request fails (default 5)")


TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def existing_file(path: str) -> str:
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return path


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the frontend's chat endpoint (vLLM's names)."""
    chat = parser.add_argument_group("chat")
    chat.add_argument("--chat-template", type=existing_file, default=None,
                      help="a Jinja chat template file to use instead of the model's own")
    chat.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                      help="how tool calls are read out of replies (default: hermes, the "
                           "layout the built-in tool prompt asks for)")
