"""The tenants file (`--tenants FILE`, TOML): who may call, by the sha256 of their key, with
what weight and limits.

    [tenants.team-a]
    key_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    weight = 2                        # fair share against the others (default 1)
    max_concurrent_requests = 8       # default: no cap
    input_tokens_per_minute = 200000  # prompt tokens, counted when a request is admitted
    output_tokens_per_minute = 50000  # generated tokens, counted as they are generated

`key_sha256` may also be a list (several keys of one tenant, e.g. while rotating them).
Keys are never stored in plain text: `printf %s "$KEY" | sha256sum` gives the digest.
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
FIELDS = {"key_sha256", "weight", "max_concurrent_requests", "input_tokens_per_minute",
          "output_tokens_per_minute"}


class TenantsFileError(ValueError):
    """A tenants file that cannot be served: the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key_digests: tuple[str, ...]  # sha256 hex of each key
    weight: float = 1.0
    max_concurrent_requests: int | None = None  # None: no cap
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class TenantTable:
    tenants: tuple[Tenant, ...]
    by_digest: dict[str, Tenant]

    @classmethod
    def of(cls, tenants: tuple[Tenant, ...]) -> TenantTable:
        return cls(tenants, {digest: tenant for tenant in tenants
                             for digest in tenant.key_digests})

    def for_key(self, key: str) -> Tenant | None:
        """The tenant whose key this is; None for a key nobody holds."""
        return self.by_digest.get(key_digest(key))


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_tenants(path: str | Path) -> TenantTable:
    """Raises TenantsFileError naming what is wrong."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise TenantsFileError(f"--tenants {path}: cannot read it ({exc.strerror})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"--tenants {path}: not valid TOML ({exc})") from exc
    return parse_tenants(document, str(path))


def parse_tenants(document: dict[str, Any], source: str = "tenants file") -> TenantTable:
    extra = set(document) - {"tenants"}
    if extra:
        raise TenantsFileError(f"{source}: unknown top-level key(s) {sorted(extra)}; "
                               f"tenants go in [tenants.NAME] tables")
    entries = document.get("tenants")
    if not isinstance(entries, dict) or not entries:
        raise TenantsFileError(f"{source}: no tenants: add at least one [tenants.NAME] table")
    tenants = tuple(_tenant(name, entry, source) for name, entry in entries.items())
    owners: dict[str, str] = {}
    for tenant in tenants:
        for digest in tenant.key_digests:
            if digest in owners:
                raise TenantsFileError(f"{source}: tenants {owners[digest]!r} and "
                                       f"{tenant.name!r} share a key")
            owners[digest] = tenant.name
    return TenantTable.of(tenants)


def _tenant(name: str, entry: Any, source: str) -> Tenant:
    where = f"{source}: tenant {name!r}"
    if not TENANT_NAME.fullmatch(name):
        raise TenantsFileError(f"{where}: a name is 1-64 letters, digits, '.', '_' or '-', "
                               f"starting with a letter or digit")
    if not isinstance(entry, dict):
        raise TenantsFileError(f"{where}: must be a table ([tenants.{name}])")
    unknown = set(entry) - FIELDS
    if unknown:
        raise TenantsFileError(f"{where}: unknown field(s) {sorted(unknown)}; "
                               f"known: {sorted(FIELDS)}")
    return Tenant(
        name=name,
        key_digests=_digests(entry.get("key_sha256"), where),
        weight=_weight(entry.get("weight", 1.0), where),
        max_concurrent_requests=_limit(entry, "max_concurrent_requests", where),
        input_tokens_per_minute=_limit(entry, "input_tokens_per_minute", where),
        output_tokens_per_minute=_limit(entry, "output_tokens_per_minute", where),
    )


def _digests(value: Any, where: str) -> tuple[str, ...]:
    values = value if isinstance(value, list) else [value]
    if value is None or not values:
        raise TenantsFileError(f"{where}: key_sha256 is required (the sha256 hex digest of "
                               f"its key: printf %s \"$KEY\" | sha256sum)")
    for digest in values:
        if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest.lower()):
            raise TenantsFileError(f"{where}: key_sha256 must be 64 hex digits (a sha256 "
                                   f"digest, never the key itself), got {digest!r}")
    return tuple(digest.lower() for digest in values)


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise TenantsFileError(f"{where}: weight must be a positive number, got {value!r}")
    return float(value)


def _limit(entry: dict[str, Any], field: str, where: str) -> int | None:
    value = entry.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TenantsFileError(f"{where}: {field} must be a whole number of at least 1, "
                               f"got {value!r}")
    return value
