"""Our paged Llama-family model against transformers, in float32."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from common.default_model import resolve_model
from engine.layers.rotary import RopeConfig, rope_inv_freq
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.platform.cpu import choose_dtype, cpu_has_native_bf16
from engine.weights.loader import load_model
from tests.model_fixtures import (
    allocate_kv_caches,
    build_metadata,
    build_tiny_hf_model,
    build_tiny_llama_dir,
    contiguous_metadata,
    model_step,
    positions_for,
)

TOLERANCE = 1e-3
BLOCK_SIZE = 4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def run_step(model: LlamaForCausalLM, kv_caches, token_ids: list[int], seq_lens: list[int],
             query_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
    """One engine step over a flattened batch; logits for every scheduled token."""
    metadata = build_metadata(block_tables, seq_lens, query_lens, BLOCK_SIZE)
    with torch.no_grad(), model_step(model, metadata, BLOCK_SIZE):
        hidden = model(torch.tensor(token_ids), positions_for(seq_lens, query_lens), kv_caches)
        return model.compute_logits(hidden)


def prefill_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    blocks = -(-len(token_ids) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(model, blocks, BLOCK_SIZE)
    metadata = contiguous_metadata([len(token_ids)], [len(token_ids)], BLOCK_SIZE, blocks)
    with torch.no_grad(), model_step(model, metadata, BLOCK_SIZE):
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), kv_caches)
        return model.compute_logits(hidden)


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    return (ours - theirs).abs().max().item()


def load_tiny(tmp_path: Path, model_type: str = "llama", **overrides):
    hf_model = build_tiny_hf_model(model_type, **overrides)
    hf_model.save_pretrained(tmp_path / model_type)
    ours = load_model(str(tmp_path / model_type), torch.float32, torch.device("cpu"))
    return hf_model, ours


TINY_CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "mistral": ("mistral", {}),  # sliding_window 4096 > prompt: full attention is exact
    "mistral-window-full": ("mistral", {"sliding_window": 20}),  # the 20-token prompt fills it
}


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_prefill_matches_transformers(tmp_path: Path, case: str) -> None:
    model_type, overrides = TINY_CASES[case]
    hf_model, ours = load_tiny(tmp_path, model_type, **overrides)
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    diff = max_diff(prefill_logits(ours, prompt), hf_logits(hf_model, prompt))
    print(f"\n{case}: prefill max abs diff {diff:.2e}")
    assert diff < TOLERANCE


@pytest.mark.parametrize("case", ["llama", "qwen2", "llama3-rope"])
def test_tiny_chunked_prefill_and_decode_through_paged_cache(tmp_path: Path, case: str) -> None:
    """Request A: two prefill chunks then 3 decodes; request B shares A's steps from step 2."""
    model_type, overrides = TINY_CASES[case]
    hf_model, ours = load_tiny(tmp_path, model_type, **overrides)
    generator = torch.Generator().manual_seed(2)
    seq_a = torch.randint(3, 256, (23,), generator=generator).tolist()  # 20 prompt + 3 decoded
    seq_b = torch.randint(3, 256, (9,), generator=generator).tolist()  # 6 prompt + 3 decoded
    tables = [[7, 2, 9, 4, 0, 11], [5, 10, 1]]  # non-contiguous, interleaved block ids
    kv_caches = allocate_kv_caches(ours, 12, BLOCK_SIZE)

    a_rows = [run_step(ours, kv_caches, seq_a[:13], [13], [13], tables[:1])]
    step = run_step(ours, kv_caches, seq_a[13:20] + seq_b[:6], [20, 6], [7, 6], tables)
    a_rows.append(step[:7])
    b_rows = [step[7:]]
    for i in range(3):
        step = run_step(ours, kv_caches, [seq_a[20 + i], seq_b[6 + i]],
                        [21 + i, 7 + i], [1, 1], tables)
        a_rows.append(step[:1])
        b_rows.append(step[1:])

    diff_a = max_diff(torch.cat(a_rows), hf_logits(hf_model, seq_a))
    diff_b = max_diff(torch.cat(b_rows), hf_logits(hf_model, seq_b))
    print(f"\n{case}: paged chunked+decode max abs diff A {diff_a:.2e}, B {diff_b:.2e}")
    assert diff_a < TOLERANCE and diff_b < TOLERANCE


def test_tiny_model_is_sensitive_to_rope_scaling(tmp_path: Path) -> None:
    """Guards the parity tests above: a wrong rope must show up far above the tolerance."""
    hf_model, ours = load_tiny(tmp_path, "llama", rope_scaling=LLAMA3_ROPE)
    plain = ModelConfig.from_hf({**json.loads((tmp_path / "llama" / "config.json").read_text()),
                                 "rope_parameters": None, "rope_scaling": None})
    wrong = LlamaForCausalLM(plain)
    wrong.load_state_dict(ours.state_dict())
    prompt = list(range(3, 43))
    assert max_diff(prefill_logits(wrong, prompt), hf_logits(hf_model, prompt)) > 100 * TOLERANCE


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "legacy-type-key": {"type": "linear", "factor": 2.0},
    "llama3": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                    "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_frequencies_match_transformers(case: str) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(ROPE_CASES[case])
    base = {"hidden_size": 1024, "num_attention_heads": 8, "max_position_embeddings": 16384,
            "rope_theta": 500000.0}
    hf_config = transformers.LlamaConfig(**base, rope_scaling=dict(scaling))
    params = hf_config.rope_parameters
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, "cpu")
    rope = RopeConfig.from_hf({**base, "rope_scaling": scaling})
    inv_freq, scale = rope_inv_freq(rope, 128, base["max_position_embeddings"])
    torch.testing.assert_close(inv_freq, hf_inv_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale)


def test_dynamic_ntk_matches_transformers_per_position() -> None:
    """Position p uses the frequencies transformers uses when decoding p with a KV cache."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 64, "vocab_size": 32, "max_position_embeddings": 64,
            "rope_theta": 10000.0}
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    ours = LlamaForCausalLM(ModelConfig.from_hf({**base, "rope_parameters": scaling}))
    assert ours.model.rotary_tables.cos.shape == (128, 64)
    hf_config = transformers.LlamaConfig(**base, rope_scaling=dict(scaling))
    for position in (10, 63, 64, 100, 127):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=position + 1)
        expected = torch.cos(position * inv_freq).repeat(2)
        torch.testing.assert_close(ours.model.rotary_tables.cos[position], expected)


def test_longrope_tables_match_transformers_within_and_beyond_the_original_context() -> None:
    """Position p's cos equals transformers' when it rotates a sequence of p + 1 tokens."""
    hf_model = build_tiny_hf_model("phi3", original_max_position_embeddings=80, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 0.5 * i for i in range(8)]})
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    ours = LlamaForCausalLM(config).model.rotary_tables
    for position in (0, 40, 79, 80, 200):
        cos, _ = hf_model.model.rotary_emb(torch.zeros(1, 1, 64), torch.tensor([[position]]))
        torch.testing.assert_close(ours.cos[position], cos[0, 0])


def test_model_config_variants() -> None:
    qwen = ModelConfig.from_hf({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "vocab_size": 10,
                                "eos_token_id": [3, 4], "rope_theta": 1e6})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.head_dim == 16
    assert qwen.eos_token_ids == (3, 4) and qwen.rope.theta == 1e6
    llama = ModelConfig.from_hf({"hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "vocab_size": 10, "eos_token_id": 2,
                                 "attention_bias": True, "head_dim": 32,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert llama.qkv_bias and llama.o_bias and llama.num_key_value_heads == 4
    assert llama.head_dim == 32 and llama.eos_token_ids == (2,) and llama.rope.theta == 5e5
    assert llama.sliding_window is None and llama.max_exact_len == 2048


@pytest.mark.parametrize(("overrides", "windows"), [
    ({"model_type": "mistral", "sliding_window": 4096}, (4096, 4096, 4096)),
    ({"model_type": "mistral", "sliding_window": None}, (None, None, None)),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
     (None, None, None)),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True,
      "max_window_layers": 1}, (None, 4096, 4096)),  # as transformers 4 placed them
    ({"model_type": "gemma3_text", "sliding_window": 512, "hidden_activation": "gelu_pytorch_tanh",
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     (512, None, 512)),
])
def test_sliding_windows_are_per_layer_and_the_whole_context_is_served(overrides,
                                                                       windows) -> None:
    config = ModelConfig.from_hf({"hidden_size": 64, "intermediate_size": 8,
                                  "num_hidden_layers": 3, "num_attention_heads": 4,
                                  "vocab_size": 10, "max_position_embeddings": 32768,
                                  **overrides})
    assert config.layer_windows == windows and config.max_exact_len == 32768


def test_choose_dtype(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")
    assert cpu_has_native_bf16(str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert not cpu_has_native_bf16(str(cpuinfo))
    assert choose_dtype("auto", torch.device("cuda")) == torch.bfloat16
    expected_cpu = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert choose_dtype("auto", torch.device("cpu")) == expected_cpu
    assert choose_dtype("float32", torch.device("cpu")) == torch.float32
    assert choose_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError):
        choose_dtype("int8", torch.device("cpu"))


def test_tiny_dir_fixture_loads_without_tokenizer(tmp_path: Path) -> None:
    model_dir = build_tiny_llama_dir(tmp_path, num_hidden_layers=1)
    assert resolve_model(model_dir) == model_dir
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert model.num_layers == 1 and model.config.eos_token_ids == (2,)
    assert model.kv_cache_shape(10, 4) == (10, 2, 4, 16)
    logits = prefill_logits(model, [5, 6, 7])
    assert logits.shape == (3, 256) and torch.isfinite(logits).all()


def test_resolve_model_rejects_unknown(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local Hugging Face directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    started = time.monotonic()
    model_dir = resolve_model(None)
    print(f"\nresolve_model(None): {time.monotonic() - started:.2f} s")
    return model_dir


def test_smollm2_matches_transformers_and_answers_paris(smollm2_dir: str) -> None:
    from transformers import AutoTokenizer
    from transformers import LlamaForCausalLM as HFLlama

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    token_ids = tokenizer.encode(prompt)
    hf_model = HFLlama.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = load_model(smollm2_dir, torch.float32, torch.device("cpu"))
    assert ours.config.eos_token_ids == (2,)

    logits = prefill_logits(ours, token_ids)
    diff = max_diff(logits, hf_logits(hf_model, token_ids))
    print(f"\nSmolLM2-135M-Instruct fp32 chat prompt ({len(token_ids)} tokens): "
          f"max abs logit diff vs transformers {diff:.2e}")
    assert diff < TOLERANCE
    answer = greedy_decode(ours, token_ids, max_new_tokens=10)
    assert "Paris" in tokenizer.decode(answer)


def greedy_decode(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    total = len(prompt) + max_new_tokens
    table = list(range(-(-total // BLOCK_SIZE)))[::-1]  # reversed block order
    kv_caches = allocate_kv_caches(model, len(table), BLOCK_SIZE)
    logits = run_step(model, kv_caches, prompt, [len(prompt)], [len(prompt)], [table])
    generated = [int(logits[-1].argmax())]
    while len(generated) < max_new_tokens and generated[-1] not in model.config.eos_token_ids:
        seq_len = len(prompt) + len(generated)
        logits = run_step(model, kv_caches, generated[-1:], [seq_len], [1], [table])
        generated.append(int(logits[-1].argmax()))
    return generated


def hub_layout_cache(root: Path, repo_id: str, source: Path) -> Path:
    """What huggingface_hub leaves after downloading `repo_id`: a snapshot named by its commit
    and refs/main naming that commit."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_resolve_model_takes_a_hub_id_from_the_cache_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = Path(build_tiny_llama_dir(tmp_path))
    snapshot = hub_layout_cache(tmp_path / "hub", "acme/tiny-llama", source)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Path(resolve_model("acme/tiny-llama")) == snapshot
    with pytest.raises(ValueError, match=r"'acme/missing': not found in the Hugging Face cache"):
        resolve_model("acme/missing")
