"""Balanced keys for 8-bit KV caches.

An 8-bit row has one scale, set by its largest value, so a key's rounding error is spread
over every direction of it, while a score reads a key only along its query: q.e, e the
rounding error. The queries of a KV head are far from isotropic (on the default model a few
directions carry most of them) and the keys' channels differ in size by 10x and more. Scores
need only q.k, and for any invertible A and any m

    q.k = (A q) . (A^-1 (k - m)) + q.m

so an 8-bit cache stores A^-1 (k - m) and attention reads it with A q, the kernels unchanged:
subtracting one m from every key shifts all of a query's scores by the same q.m, which softmax
ignores (a soft cap does not: capped layers keep m = 0).

The rounding error e' of a stored row is about isotropic (the rows are Hadamard-rotated,
engine.attention.quantized_kv) with a size that follows the row's, so the score error's
variance goes as tr(A^-1 S_k A^-1) tr(A S_q A), S_k the keys' covariance and S_q the queries'
second moment. The symmetric A with A S_q A = A^-1 S_k A^-1 minimizes it: A^2 is the matrix
geometric mean of S_k and S_q^-1 (diagonal covariances would give the per-channel scale
sqrt(sigma_k / sigma_q)). Both are damped toward isotropic: served keys unlike the
calibration's must not meet a large A^-1 in a direction calibration saw little of (with the
keys' damping at 0.001 instead of 0.1, 279 of the 309 prompts below agreed). The statistics
come from text the model samples itself (ModelRunner._calibrate_keys): seeded random tokens
have channel sizes like text's but not its directions.

On the default model in fp32 (`bench.quality --kv-cache-dtypes auto,int8 --dtype float32
--prompts 309`), int8 answers agree with the float cache's beyond near ties on 291 of 309 chat
prompts for 20 greedy tokens, against 280 with per-channel power-of-two scales.

Each layer's tables come from one calibration when the runner starts: A rounded to bfloat16,
its inverse computed from the rounded A, m rounded to bfloat16, so runners on the same weights
derive the same tables, and a stored block names the ones it was written with
(ModelRunner.kv_meaning).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

CALIBRATION_SEQUENCES = 8
CALIBRATION_LENGTH = 64  # tokens of each sampled sequence, its first included
CALIBRATION_SEED = 0
QUERY_DAMPING = 0.01  # of the queries' mean variance, added to every direction's
KEY_DAMPING = 0.1  # of the keys' mean variance: calibration text is not the served text


@dataclass(frozen=True, slots=True)
class KeySmoothing:
    """One layer's tables, float32: queries times `query_matrix` (A, [kv_heads, D, D]), keys
    times `key_matrix` (A^-1) plus `key_offset` (-m A^-1, [kv_heads, D]); rows are vectors."""

    query_matrix: torch.Tensor
    key_matrix: torch.Tensor
    key_offset: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k [T, kv_heads, D] as an 8-bit cache stores and reads them."""
        return self.queries(q), self.keys(k)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = q.shape
        kv_heads = self.query_matrix.shape[0]
        grouped = q.float().view(tokens, kv_heads, heads // kv_heads, dim).transpose(0, 1)
        out = torch.matmul(grouped.reshape(kv_heads, -1, dim), self.query_matrix)
        return out.view(kv_heads, tokens, -1, dim).transpose(0, 1).reshape(q.shape).to(q.dtype)

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        out = torch.baddbmm(self.key_offset[:, None], k.float().transpose(0, 1), self.key_matrix)
        return out.transpose(0, 1).to(k.dtype)

    def keys_back(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored keys [T, kv_heads, D] as the keys whose scores a transformed query reads in
        them (less the shift softmax ignores)."""
        held = (stored.float() - self.key_offset).transpose(0, 1)
        return torch.bmm(held, self.query_matrix).transpose(0, 1).to(stored.dtype)

    def fingerprint(self) -> bytes:
        return b"".join(table.float().cpu().numpy().tobytes()
                        for table in (self.query_matrix, self.key_matrix, self.key_offset))


@dataclass(slots=True)
class KeyStatistics:
    """Sums over the tokens one layer saw, per KV head (float64): keys, their outer products,
    and the outer products of its queries (averaged over the head's group)."""

    keys: torch.Tensor | None = None
    key_products: torch.Tensor | None = None
    query_products: torch.Tensor | None = None
    count: int = field(default=0)

    def observe(self, q: torch.Tensor, k: torch.Tensor) -> None:
        tokens, kv_heads, dim = k.shape
        k64 = k.double()
        q64 = q.double().view(tokens, kv_heads, q.shape[1] // kv_heads, dim)
        sums = (k64.sum(0), torch.einsum("thd,the->hde", k64, k64),
                torch.einsum("thgd,thge->hde", q64, q64) / q64.shape[2])
        if self.keys is None:
            self.keys, self.key_products, self.query_products = sums
        else:
            self.keys += sums[0]
            self.key_products += sums[1]
            self.query_products += sums[2]
        self.count += tokens

    def smoothing(self, shift: bool) -> KeySmoothing:
        """`shift`: subtract the keys' mean (not under a soft cap). Computed on the CPU, kept
        where the statistics were."""
        assert self.keys is not None and self.key_products is not None
        assert self.query_products is not None
        average = self.keys.cpu() / self.count
        mean = average.to(torch.bfloat16).double() if shift else torch.zeros_like(average)
        # the keys' second moment about the mean they are stored less
        cross = average[:, :, None] * mean[:, None, :]
        keys = (self.key_products.cpu() / self.count - cross - cross.transpose(1, 2)
                + mean[:, :, None] * mean[:, None, :])
        queries = self.query_products.cpu() / self.count
        matrix = torch.stack([balancing_matrix(k, q) for k, q in zip(keys, queries, strict=True)])
        matrix = matrix.to(torch.bfloat16).double()
        values = torch.linalg.eigvalsh(matrix)
        identity = torch.eye(matrix.shape[-1], dtype=matrix.dtype)
        matrix[(values <= 0).any(-1)] = identity  # bf16 rounding left it not positive definite
        inverse = torch.stack([power(head, -1.0) for head in matrix])
        plain = (matrix == identity).all(-1).all(-1)
        if plain.any():
            logger.warning("8-bit KV keys: %d of %d KV heads keep plain rows (statistics "
                           "silent, not finite, or not invertible)", int(plain.sum()), len(plain))
        device = self.keys.device
        return KeySmoothing(query_matrix=matrix.float().to(device),
                            key_matrix=inverse.float().to(device),
                            key_offset=(-mean[:, None] @ inverse)[:, 0].float().to(device))


def balancing_matrix(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """The symmetric A with A Q A = A^-1 K A^-1 (K, Q [D, D] float64, damped), scaled to an
    RMS eigenvalue of 1; the identity (plain rotated rows) for a head that saw nothing or
    whose statistics or result are not finite."""
    dim = keys.shape[0]
    identity = torch.eye(dim, dtype=keys.dtype)
    finite = torch.isfinite(keys).all() and torch.isfinite(queries).all()
    if not finite or keys.trace() <= 0 or queries.trace() <= 0:
        return identity
    keys = keys + KEY_DAMPING * keys.trace() / dim * identity
    queries = queries + QUERY_DAMPING * queries.trace() / dim * identity
    root, inverse_root = power(queries, 0.5), power(queries, -0.5)
    squared = inverse_root @ power(root @ keys @ root, 0.5) @ inverse_root
    matrix = power((squared + squared.T) / 2, 0.5)
    matrix = (matrix + matrix.T) / 2
    matrix = matrix / matrix.square().sum().div(dim).sqrt()
    return matrix if torch.isfinite(matrix).all() else identity


def power(matrix: torch.Tensor, exponent: float) -> torch.Tensor:
    """A symmetric positive semi-definite matrix to a power, through its eigenvectors (no LU:
    MKL's batched one failed inside the test suite on matrices it inverts alone)."""
    values, vectors = torch.linalg.eigh(matrix)
    return (vectors * values.clamp_min(1e-300).pow(exponent)) @ vectors.T


def fingerprint(tables: list[KeySmoothing | None]) -> str:
    """A short digest naming the tables (empty without them): what a stored block means."""
    if not any(tables):
        return ""
    digest = hashlib.blake2b(digest_size=8)
    for table in tables:
        digest.update(table.fingerprint() if table is not None else b"-")
    return digest.hexdigest()
