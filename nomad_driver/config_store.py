"""Writing the definitions' keys (`config_kv.py`): `llmgw apply`, and a watcher putting its last
good copy back into a Consul that lost its data.

Consul takes at most 64 operations in one transaction, so ten thousand models take some 160.
Readers must still never act on half of them, hence three steps:

1. claim: `llmgw/config/applied` gets `pending` with check-and-set against the value read, so a
   second apply started meanwhile is told, as with the single key before;
2. the changed and removed model keys, 63 to a transaction, each with a `check-index` on the
   claim: an apply that took over (it claims over a `pending` it found) stops this one at its
   next transaction instead of interleaving with it;
3. commit: `pending` cleared and the generation raised, with check-and-set on the claim, in the
   transaction that also deletes the legacy `llmgw/config/models` key (the upgrade).

Readers hold the set they have while `pending` is set, so they see the old set whole or the new
one whole. An apply interrupted between 1 and 3 leaves `pending` set and some keys of the new
file written: readers keep the definitions they held (a reader started meanwhile reads the keys
as they are), and the next `llmgw apply` takes over the claim and finishes the job.
"""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from nomad_driver.config_kv import (
    APPLIED_KEY,
    CONFIG_PREFIX,
    LEGACY_MODELS_KEY,
    MODEL_KEY_PREFIX,
    Applied,
    parse_applied,
)
from nomad_driver.consul import Consul

TXN_MAX_OPS = 64
# Consul refuses a transaction body over 512 KiB (`txn_max_req_len`); values travel in base64.
TXN_MAX_VALUE_BYTES = 256 * 1024


class StoreConflict(Exception):
    """Someone else wrote the definitions between this writer's read and its commit."""


@dataclass(frozen=True)
class StoreResult:
    changed: bool
    generation: int = 0
    written: int = 0  # keys set
    deleted: int = 0  # model keys removed (and the legacy key)
    transactions: int = 0


def _set(key: str, value: bytes) -> dict[str, Any]:
    return {"KV": {"Verb": "set", "Key": key, "Value": base64.b64encode(value).decode()}}


def _chunks(ops: list[dict[str, Any]], max_ops: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    size = 0
    for op in ops:
        weight = len(op["KV"].get("Value", ""))
        if chunk and (len(chunk) == max_ops or size + weight > TXN_MAX_VALUE_BYTES * 4 // 3):
            yield chunk
            chunk, size = [], 0
        chunk.append(op)
        size += weight
    if chunk:
        yield chunk


async def store_keys(
    consul: Consul, wanted: Mapping[str, bytes], *, create_only: bool = False
) -> StoreResult:
    """Make `llmgw/config/` hold exactly `wanted` (`config_kv.definition_keys`). `create_only`:
    only when nothing is stored at all (a watcher's copy never wins over an apply)."""
    _, entries = await consul.kv_get(CONFIG_PREFIX, recurse=True)
    current = {e.key: e for e in entries}
    applied_entry = current.get(APPLIED_KEY)
    legacy = current.get(LEGACY_MODELS_KEY)
    stored_models = [k for k in current if k.startswith(MODEL_KEY_PREFIX)]
    if create_only and (applied_entry or legacy or stored_models):
        return StoreResult(False)
    applied = parse_applied(applied_entry.value) if applied_entry else Applied()
    models = sum(1 for k in wanted if k.startswith(MODEL_KEY_PREFIX))
    ops = [_set(k, v) for k, v in wanted.items() if k not in current or current[k].value != v]
    removed = [k for k in stored_models if k not in wanted]
    ops += [{"KV": {"Verb": "delete", "Key": k}} for k in removed]
    if not ops and legacy is None and applied_entry is not None and applied.pending is None:
        return StoreResult(False, applied.generation)

    pending_generation = (applied.pending or {}).get("generation")
    generation = max(applied.generation, pending_generation if isinstance(pending_generation, int) else 0) + 1
    claim = Applied(
        applied.generation,
        applied.models,
        {"generation": generation, "since": round(time.time(), 3), "by": socket.gethostname()},
    )
    claimed = await consul.txn([_cas(claim.to_bytes(), applied_entry.modify_index if applied_entry else 0)])
    if not claimed.ok:
        raise StoreConflict(
            f"{APPLIED_KEY} was changed by someone else while applying; run 'llmgw apply' again"
        )
    claim_index = claimed.indexes[APPLIED_KEY]
    commit = [_cas(Applied(generation, models, None).to_bytes(), claim_index)]
    if legacy is not None:
        commit.append({"KV": {"Verb": "delete-cas", "Key": LEGACY_MODELS_KEY, "Index": legacy.modify_index}})
    check = {"KV": {"Verb": "check-index", "Key": APPLIED_KEY, "Index": claim_index}}
    chunks = list(_chunks(ops, TXN_MAX_OPS - len(commit)))
    transactions = 1
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        # The last chunk rides with the commit: one transaction fewer, and a small apply (one
        # model changed) is claim + one transaction.
        txn = chunk + commit if last else [check, *chunk]
        result = await consul.txn(txn)
        transactions += 1
        if not result.ok:
            raise StoreConflict(
                f"{CONFIG_PREFIX} was taken over by another apply (or {LEGACY_MODELS_KEY} was "
                f"written) while this one wrote generation {generation}; the other one's "
                "definitions stand: run 'llmgw apply' again if yours should"
            )
    if not chunks:
        result = await consul.txn(commit)
        transactions += 1
        if not result.ok:
            raise StoreConflict(
                f"{CONFIG_PREFIX} was changed by someone else while applying; run 'llmgw apply' again"
            )
    return StoreResult(
        True,
        generation,
        written=sum(1 for op in ops if op["KV"]["Verb"] == "set"),
        deleted=len(removed) + (legacy is not None),
        transactions=transactions,
    )


def _cas(value: bytes, index: int) -> dict[str, Any]:
    return {
        "KV": {"Verb": "cas", "Key": APPLIED_KEY, "Value": base64.b64encode(value).decode(), "Index": index}
    }
