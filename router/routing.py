"""Which replica gets a request: least outstanding requests, with affinity for a shared prompt
prefix or a pinned session, bounded so that affinity never overloads a replica.

A replica that already holds a prompt's prefix in its KV cache skips that prefill, which on a
long system prompt or a long conversation is most of the time to first token. The router cannot
see the engines' caches, so it remembers where it sent each prefix (the approximate prefix
scorer of the Gateway API inference extension and llm-d: chained hashes over fixed-size
character blocks, an LRU per model) and assumes the cache is still there. Affinity yields to
load: a replica is preferred for its cache only while it carries no more than `slack` requests
above the least loaded one, or no more than `balance_factor` times the average; past that, a
cold cache elsewhere is faster than a queue here (SGLang's cache-aware policy makes the same
trade).

No I/O here: the app feeds in replica keys (node, ServiceID) and request text, and tests drive
it directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

from router.outliers import Outliers

# 64 characters is about 16 tokens, vLLM's KV block; 256 blocks cover the first 16 KiB of a
# prompt, past which a prefix is distinctive enough that more text adds cost, not precision.
BLOCK_CHARS = 64
MAX_BLOCKS = 256
# Per model; ~100 bytes an entry, so about 6 MiB at the cap for a busy model. A model's table
# holds TABLE_PER_REPLICA entries per replica up to the cap, and goes with its last replica.
TABLE_CAPACITY = 65536
TABLE_PER_REPLICA = 16384
# Replicas remembered per key: enough to spread a popular system prompt over a small pool.
HOLDERS = 4


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a replica's cache is keyed on, in order: chat messages or a completion prompt.

    Chat content may be a string or a list of parts; `str()` of the parts is stable for equal
    requests, which is all the hashing needs.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                text = content if isinstance(content, str) else str(content)
                parts.append(f"{message.get('role', '')}\x1f{text}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        # A batch of prompts is keyed on its first; a token-ID prompt on its first IDs.
        return first if isinstance(first, str) else str(prompt[: MAX_BLOCKS * 8])
    return ""


def prefix_hashes(text: str, block: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained hashes of whole blocks: the i-th stands for the prompt's first i+1 blocks, so two
    prompts share a hash exactly as far as they share a prefix. A trailing partial block is left
    out, as the engines' caches leave it out."""
    hashes: list[int] = []
    previous = 0
    end = min(len(text) // block, max_blocks) * block
    for start in range(0, end, block):
        previous = hash((previous, text[start : start + block]))
        hashes.append(previous)
    return hashes


def session_hash(value: str) -> int:
    # Tagged so that a session ID can never collide with a prefix chain.
    return hash(("session", value))


class AffinityTable:
    """Key (prefix hash or session) -> the replicas that last received it, most recent first,
    least recently used keys first out.

    Several holders per key, because a prefix shared by many conversations (one system prompt
    for a whole application) ends up cached on several replicas once load has spread it; any
    of them serves it without a cold prefill, and picking among them keeps the shared prompt
    from pinning every new conversation to the first replica that saw it.
    """

    def __init__(self, capacity: int = TABLE_CAPACITY, holders: int = HOLDERS) -> None:
        self.capacity = capacity
        self.holders = holders
        self._where: OrderedDict[int, tuple[Hashable, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def lookup(self, keys: Sequence[int], candidates: Collection[Hashable]) -> tuple[list[Hashable], int]:
        """The candidates holding the longest prefix (most recent first), and how many blocks."""
        where = self._where
        for depth in range(len(keys), 0, -1):
            holders = where.get(keys[depth - 1])
            if holders is not None:
                present = [r for r in holders if r in candidates]
                if present:
                    return present, depth
        return [], 0

    def get(self, key: int) -> Hashable | None:
        holders = self._where.get(key)
        return holders[0] if holders else None

    def record(self, keys: Sequence[int], replica: Hashable) -> None:
        where = self._where
        limit = self.holders
        for key in keys:
            holders = where.get(key)
            if holders is None:
                where[key] = (replica,)
            elif holders[0] != replica:
                where[key] = (replica, *[r for r in holders if r != replica][: limit - 1])
            where.move_to_end(key)
        self.trim()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.trim()

    def trim(self) -> None:
        where = self._where
        while len(where) > self.capacity:
            where.popitem(last=False)


def within_bound(load: int, loads: Sequence[int], slack: int, balance_factor: float) -> bool:
    """May a replica at `load` take one more request for affinity's sake?"""
    least = min(loads)
    if load - least <= slack:
        return True
    average_after = (sum(loads) + 1) / len(loads)
    return load + 1 <= balance_factor * average_after


class Balancer:
    """Outstanding requests per replica, affinity tables per model, and the replicas ejected for
    failing (router/outliers.py). Single-threaded: the event loop is its only caller.

    A replica that goes away is not looked for in the tables: `lookup` only ever returns
    candidates, so its entries are dead weight that the LRU pushes out, and forgetting it costs
    nothing (walking a full table took 16 ms of the event loop per replica)."""

    def __init__(
        self,
        *,
        slack: int = 2,
        balance_factor: float = 1.5,
        table_capacity: int = TABLE_CAPACITY,
        policy: str = "affinity",
        outliers: Outliers | None = None,
    ) -> None:
        self.policy = policy
        self.outliers = outliers or Outliers()
        self.slack = slack
        self.balance_factor = balance_factor
        self.table_capacity = table_capacity
        self.outstanding: dict[Hashable, int] = {}
        self._tables: dict[str, AffinityTable] = {}
        self._turn = 0

    def table(self, model: str) -> AffinityTable:
        table = self._tables.get(model)
        if table is None:
            table = self._tables[model] = AffinityTable(self.table_capacity)
        return table

    def choose(
        self,
        model: str,
        replicas: Sequence[Hashable],
        *,
        prefix: Sequence[int] = (),
        session: int | None = None,
        exclude: Collection[Hashable] = (),
        now: float = 0.0,
    ) -> Hashable | None:
        """Pick a replica of `model` for one request and remember the choice for its keys.

        `exclude` holds replicas this request already failed on. Ejected replicas are used only
        when nothing else is left: trying a replica that failed a moment ago beats refusing.
        """
        candidates = [r for r in replicas if r not in exclude]
        if not candidates:
            return None
        if self.outliers.any_ejected():
            candidates = self.outliers.in_rotation(candidates, now)

        if self.policy == "round-robin":
            self._turn += 1
            return candidates[self._turn % len(candidates)]
        outstanding = self.outstanding
        loads = [outstanding.get(r, 0) for r in candidates]
        if self.policy == "least-outstanding":
            return self._least_loaded(candidates, loads)
        table = self.table(model)
        chosen: Hashable | None = None
        if session is not None:
            pinned = table.get(session)
            if (
                pinned is not None
                and pinned in candidates
                and within_bound(outstanding.get(pinned, 0), loads, self.slack, self.balance_factor)
            ):
                chosen = pinned
        if chosen is None and prefix:
            holders, depth = table.lookup(prefix, candidates)
            # A holder of less than half the prompt saves less than a queue costs: a new
            # conversation that shares only a system prompt goes by load, and the system prompt
            # gets cached on every replica once (cheap), instead of a hot one piling its
            # conversations onto the replicas that happened to see it first (SGLang's
            # cache-aware policy uses the same threshold). The conversation's later turns match
            # nearly whole and stay where their history is.
            if holders and depth * 2 >= len(prefix):
                # The least loaded holder; among equals the one that got this prefix longest
                # ago, which takes turns between replicas sharing a system prompt.
                holder = min(reversed(holders), key=lambda r: outstanding.get(r, 0))
                if within_bound(outstanding.get(holder, 0), loads, self.slack, self.balance_factor):
                    chosen = holder
        if chosen is None:
            chosen = self._least_loaded(candidates, loads)
        if session is not None:
            table.record((session,), chosen)
        if prefix:
            table.record(prefix, chosen)
        return chosen

    def _least_loaded(self, candidates: Sequence[Hashable], loads: Sequence[int]) -> Hashable:
        least = min(loads)
        tied = [r for r, load in zip(candidates, loads, strict=True) if load == least]
        # Rotate among equals, so that new conversations on an idle fleet spread out instead
        # of all landing on the first replica in the catalog.
        self._turn += 1
        return tied[self._turn % len(tied)]

    def acquire(self, replica: Hashable) -> None:
        self.outstanding[replica] = self.outstanding.get(replica, 0) + 1

    def release(self, replica: Hashable) -> None:
        left = self.outstanding.get(replica, 0) - 1
        if left > 0:
            self.outstanding[replica] = left
        else:
            self.outstanding.pop(replica, None)

    def ejected(self, now: float) -> set[Hashable]:
        return self.outliers.ejected(now)

    def forget(self, replica: Hashable) -> None:
        self.outliers.forget(replica)

    def fleet_size(self, model: str, replicas: int) -> None:
        """A model's replica count changed: its table grows or shrinks with it, and goes with
        the last replica (a model scaled to zero holds no memory for its prefixes)."""
        if replicas <= 0:
            self._tables.pop(model, None)
            return
        table = self._tables.get(model)
        if table is not None:
            table.resize(self._capacity(replicas))

    def _capacity(self, replicas: int) -> int:
        return min(self.table_capacity, TABLE_PER_REPLICA * max(1, replicas))
