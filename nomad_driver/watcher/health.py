"""Each model as an entry in the Consul UI, with a check that says how it is doing and why.

The entries live on an external catalog node (`llmgw-models`), registered through
`/v1/catalog/register` the way consul-esm registers what it watches: no agent owns that node,
so no agent's anti-entropy removes the entries, and a new leader finds exactly the entries the
old one left, under IDs derived from the model name, and corrects them rather than adding
duplicates. Entries for models no longer defined are removed by whichever watcher leads.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from nomad_driver.consul import Consul
from nomad_driver.redaction import redact

log = logging.getLogger("llmgw.health")

NODE = "llmgw-models"
SERVICE = "llmgw-model"


def service_id(model: str) -> str:
    return f"{SERVICE}-{model}"


@dataclass(frozen=True)
class Entry:
    status: str  # passing | warning | critical
    output: str


class HealthEntries:
    """Keeps the catalog in line with the latest decisions, writing only what changed."""

    def __init__(self, consul: Consul, *, node: str = NODE, address: str = "127.0.0.1") -> None:
        self.consul = consul
        self.node = node
        self.address = address
        # What the catalog holds, as far as this watcher knows; None until read back, which a
        # new leader does first so that it corrects what its predecessor left.
        self._known: dict[str, Entry] | None = None

    def forget(self) -> None:
        """After losing leadership, or a Consul restart: read the catalog again before writing."""
        self._known = None

    async def _load(self) -> dict[str, Entry]:
        known: dict[str, Entry] = {}
        for check in await self.consul.health_node(self.node):
            sid = str(check.get("ServiceID") or "")
            if not sid.startswith(f"{SERVICE}-"):
                continue
            known[sid[len(SERVICE) + 1 :]] = Entry(str(check.get("Status", "")), str(check.get("Output", "")))
        return known

    async def sync(
        self,
        desired: Mapping[str, Entry],
        gone: Iterable[str] | None = None,
        within: Callable[[], float] = lambda: math.inf,
    ) -> int:
        """Register changed entries and remove stale ones: all the others (`gone` None: the
        models of a full pass), or those named; returns how many writes it made. Each call to
        Consul must answer `within()` seconds (TimeoutError): a leader's first sync of ten
        thousand models takes longer than its lease, one write never should."""
        if self._known is None:
            async with asyncio.timeout(within()):
                self._known = await self._load()
        # The Consul UI shows the output to anyone with catalog read; redacted before comparing,
        # so that what was written compares equal to what is read back.
        desired = {m: Entry(e.status, redact(e.output)) for m, e in desired.items()}
        writes = 0
        for model, entry in sorted(desired.items()):
            was = self._known.get(model)
            if was == entry:
                continue
            if not writes:
                # One example per sync: why a wave of writes came, without a line per model.
                log.info("event=catalog_entry_changed model=%s was=%r now=%r", model, was, entry)
            async with asyncio.timeout(within()):
                await self.consul.catalog_register(self._body(model, entry))
            self._known[model] = entry
            writes += 1
        stale = set(self._known) - set(desired) if gone is None else set(gone) & set(self._known)
        for model in sorted(stale):
            async with asyncio.timeout(within()):
                await self.consul.catalog_deregister(self.node, service_id(model))
            del self._known[model]
            writes += 1
        return writes

    def _body(self, model: str, entry: Entry) -> dict[str, object]:
        sid = service_id(model)
        return {
            "Node": self.node,
            "Address": self.address,
            # consul-esm's markers: an external node that nobody should probe on its own.
            "NodeMeta": {"external-node": "true", "external-probe": "false"},
            "SkipNodeUpdate": True,
            "Service": {
                "ID": sid,
                "Service": SERVICE,
                "Tags": [f"model={model}"],
                "Meta": {"model": model},
            },
            "Check": {
                "CheckID": sid,
                "Name": f"model {model}",
                "ServiceID": sid,
                "Status": entry.status,
                "Output": entry.output,
            },
        }
