"""Weights load into the layers as the layers declare them: at this tensor-parallel rank's
size, each rank reading only its own share of every checkpoint tensor, and a checkpoint that
does not fit the model is refused by name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.distributed.tensor_parallel import TPShard
from engine.weights import loader, safetensors
from engine.weights.loader import load_model
from tests.model_fixtures import build_tiny_llama_dir

CPU = torch.device("cpu")


class CountingSlice:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, inner, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def __getitem__(self, index: object) -> torch.Tensor:
        tensor = self.inner[index]
        self.counter[0] += tensor.numel()
        return tensor


def load_as_rank(model_dir: str, shard: TPShard, monkeypatch: pytest.MonkeyPatch,
                 ) -> tuple[torch.nn.Module, int]:
    """The model rank `shard.rank` of `shard.size` loads, and the elements it read."""
    for module in ("engine.layers.linear", "engine.layers.embedding", "engine.weights.loader"):
        monkeypatch.setattr(f"{module}.tp_shard", lambda: shard)
    counter = [0]
    reader = safetensors.read_safetensors

    def counting(directory: Path, device: torch.device) -> Iterator:
        for name, tensor in reader(directory, device):
            yield name, CountingSlice(tensor, counter)

    monkeypatch.setattr(loader, "read_safetensors", counting)
    return load_model(model_dir, torch.float32, CPU, quantization="none"), counter[0]


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118


@pytest.mark.parametrize("kv_heads", [2, 3], ids=["even", "uneven"])
def test_each_rank_holds_and_reads_only_its_share(kv_heads: int, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = build_tiny_llama_dir(tmp_path, num_attention_heads=2 * kv_heads,
                                     num_key_value_heads=kv_heads, hidden_size=24 * kv_heads,
                                     vocab_size=255)
    full = checkpoint(model_dir)
    head_dim = 12
    replicated = sum(t.numel() for name, t in full.items() if "norm" in name)
    read_by_ranks = 0
    for rank in range(2):
        shard = TPShard(rank, 2)
        model, read = load_as_rank(model_dir, shard, monkeypatch)
        read_by_ranks += read
        kv_start, kv_end = shard.span(kv_heads)
        q_rows = slice(2 * kv_start * head_dim, 2 * kv_end * head_dim)
        kv_rows = slice(kv_start * head_dim, kv_end * head_dim)
        inter = shard.span(128)
        vocab = shard.vocab_span(255)
        for index, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{index}."
            attention, mlp = layer.self_attn, layer.mlp
            assert (attention.num_kv_heads, attention.num_heads) == (
                kv_end - kv_start, 2 * (kv_end - kv_start))
            want_qkv = torch.cat([full[prefix + "self_attn.q_proj.weight"][q_rows],
                                  full[prefix + "self_attn.k_proj.weight"][kv_rows],
                                  full[prefix + "self_attn.v_proj.weight"][kv_rows]])
            assert torch.equal(attention.qkv_proj.weight, want_qkv)
            assert torch.equal(attention.o_proj.weight,
                               full[prefix + "self_attn.o_proj.weight"][:, q_rows])
            want_gate_up = torch.cat([full[prefix + "mlp.gate_proj.weight"][slice(*inter)],
                                      full[prefix + "mlp.up_proj.weight"][slice(*inter)]])
            assert torch.equal(mlp.gate_up_proj.weight, want_gate_up)
            assert torch.equal(mlp.down_proj.weight,
                               full[prefix + "mlp.down_proj.weight"][:, slice(*inter)])
        assert torch.equal(model.model.embed_tokens.weight,
                           full["model.embed_tokens.weight"][slice(*vocab)])
        assert torch.equal(model.lm_head.weight, full["lm_head.weight"][slice(*vocab)])
        assert torch.equal(model.model.norm.weight, full["model.norm.weight"])
    assert read_by_ranks == sum(t.numel() for t in full.values()) + replicated


def load_edited(model_dir: str, edit: Callable[[Iterator[tuple[str, object]]], Iterator],
                monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """load_model over the checkpoint's tensors as `edit` changes their stream."""
    reader = safetensors.read_safetensors
    monkeypatch.setattr(loader, "read_safetensors",
                        lambda directory, device: edit(reader(directory, device)))
    return load_model(model_dir, torch.float32, CPU)


def test_a_checkpoint_tensor_of_no_parameter_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def with_extra(tensors: Iterator) -> Iterator:
        yield from tensors
        yield "model.layers.0.mlp.experts.0.weight", torch.zeros(4, 4)

    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.0\.weight'"):
        load_edited(build_tiny_llama_dir(tmp_path), with_extra, monkeypatch)


def test_a_missing_part_of_a_merged_projection_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def without_v(tensors: Iterator) -> Iterator:
        return ((name, tensor) for name, tensor in tensors
                if name != "model.layers.1.self_attn.v_proj.weight")

    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.self_attn\.v_proj"):
        load_edited(build_tiny_llama_dir(tmp_path), without_v, monkeypatch)
