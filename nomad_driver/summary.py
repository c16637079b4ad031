"""The fleet summary: the whole cluster in one answer (`GET /v1/admin/summary`, `llmgw ctl summary`).

A per-node listing is the right tool for four nodes and the wrong one for two hundred: the
questions that matter at that size (how full am I, what is broken, what holds cards it is not
using) are aggregates. Everything here is derived from the same snapshots the other admin
endpoints show, so it cannot disagree with them. A pure function, so the rules are tested with
hand-built fleets; the shape is documented in docs/admin-api.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nomad_driver.fields import as_int
from nomad_driver.node_meta import FABRIC_KEY, GPU_CLASS_KEY, models_cached

# How long a ready replica must go unasked-for to be named idle. Minutes rather than seconds,
# because a replica that flaps in and out of this list is noise, and because unloading one
# throws away its warm KV cache.
IDLE_AFTER_S = 600.0

# Allocations the client has not finished still hold their cards, even when Nomad has asked them
# to stop: the card is busy until the process is gone.
_LIVE_CLIENT_STATUSES = frozenset({"pending", "running", "unknown"})


def _as_dict(item: Any) -> Mapping[str, Any]:
    if isinstance(item, Mapping):
        return item
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        result = dump()
        if isinstance(result, Mapping):
            return result
    return {}


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def node_state(node: Mapping[str, Any]) -> str:
    """ready, ineligible, draining or down: the states that need different responses.

    Anything but Nomad's `ready` status is down here, `initializing` and `disconnected`
    included: none of them can take work now. Draining is checked before ineligible because a
    drain also marks the node ineligible, and "it is being emptied" is the more useful answer.
    """
    if node.get("Status") != "ready":
        return "down"
    if node.get("DrainStrategy") or node.get("Drain") is True:
        return "draining"
    if node.get("SchedulingEligibility") == "ineligible":
        return "ineligible"
    return "ready"


def _alloc_device_ids(alloc: Mapping[str, Any]) -> set[str]:
    ids: set[str] = set()
    tasks = _dict(_dict(alloc.get("AllocatedResources")).get("Tasks"))
    for task in tasks.values():
        for device in _list(_dict(task).get("Devices")):
            ids.update(str(i) for i in _list(_dict(device).get("DeviceIDs")))
    return ids


def held_devices(allocs: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """Device IDs held by live allocations, per node ID."""
    held: dict[str, set[str]] = {}
    for alloc in allocs:
        if alloc.get("ClientStatus") not in _LIVE_CLIENT_STATUSES:
            continue
        held.setdefault(str(alloc.get("NodeID", "")), set()).update(_alloc_device_ids(alloc))
    return held


def _gpu_groups(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    devices = _list(_dict(node.get("NodeResources")).get("Devices"))
    return [_dict(d) for d in devices if _dict(d).get("Type") == "gpu"]


def gpu_use(
    nodes: list[Mapping[str, Any]], held: dict[str, set[str]]
) -> tuple[list[dict[str, Any]], set[str]]:
    """GPUs per class, and the IDs of nodes whose every GPU is free."""
    classes: dict[str, dict[str, Any]] = {}
    entirely_free: set[str] = set()
    for node in nodes:
        node_id = str(node.get("ID", ""))
        state = node_state(node)
        meta_class = _dict(node.get("Meta")).get(GPU_CLASS_KEY)
        node_total = node_free = 0
        for group in _gpu_groups(node):
            name = str(meta_class or group.get("Name") or "unknown")
            use = classes.setdefault(
                name, {"class": name, "total": 0, "used": 0, "free": 0, "unhealthy": 0, "unavailable": 0}
            )
            for instance in _list(group.get("Instances")):
                instance = _dict(instance)
                use["total"] += 1
                node_total += 1
                # Unhealthy GPUs are neither used nor free: counting them as free is how a
                # cluster looks like it has room it does not have.
                if instance.get("Healthy") is not True:
                    use["unhealthy"] += 1
                elif str(instance.get("ID")) in held.get(node_id, set()):
                    use["used"] += 1
                # Cards on a down, draining or ineligible node are not room either: nothing
                # new can land there.
                elif state != "ready":
                    use["unavailable"] += 1
                else:
                    use["free"] += 1
                    node_free += 1
        if node_total and node_free == node_total:
            entirely_free.add(node_id)
    return [classes[c] for c in sorted(classes)], entirely_free


def _fabrics(nodes: list[Mapping[str, Any]], entirely_free: set[str]) -> list[dict[str, Any]]:
    """Capacity per fabric, because a multi-node replica never spans two: free nodes in the
    wrong fabric are not room for the model that needs them, and weights cached in one fabric
    are tens of gigabytes away from the others."""
    fabrics: dict[str, dict[str, Any]] = {}
    present: dict[str, set[str]] = {}
    for node in nodes:
        fabric = _dict(node.get("Meta")).get(FABRIC_KEY)
        if not fabric:
            continue
        use = fabrics.setdefault(
            fabric,
            {
                "fabric": fabric,
                "nodes": 0,
                "nodes_with_weights": 0,
                "models_present": 0,
                "largest_free_block": 0,
            },
        )
        use["nodes"] += 1
        # A down node's disk serves nobody, so its cached weights are not counted as present.
        cached = models_cached(_dict(node.get("Meta"))) if node_state(node) != "down" else set()
        if cached:
            use["nodes_with_weights"] += 1
            present.setdefault(fabric, set()).update(cached)
        # Entirely free is what a multi-node replica needs: a node with one card in use cannot
        # give a full-width shard.
        if str(node.get("ID", "")) in entirely_free:
            use["largest_free_block"] += 1
    for name, use in fabrics.items():
        use["models_present"] = len(present.get(name, set()))
    return [fabrics[f] for f in sorted(fabrics)]


def _replicas(
    replicas: list[Mapping[str, Any]], allocs: list[Mapping[str, Any]], now: float
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    by_id = {str(a.get("ID")): a for a in allocs if a.get("ID")}
    totals = {"total": 0, "ready": 0, "starting": 0}
    idle: list[dict[str, Any]] = []
    for replica in replicas:
        totals["total"] += 1
        if replica.get("ready") is not True:
            totals["starting"] += 1
            continue
        totals["ready"] += 1
        alloc_id = str(replica.get("alloc_id") or replica.get("alloc") or replica.get("id") or "")
        alloc = by_id.get(alloc_id, {})
        # A replica never asked for counts from when its allocation was created; one with
        # neither time is left out rather than guessed at.
        since = _float(replica.get("last_request_at"))
        if since is None and alloc.get("CreateTime"):
            since = as_int(alloc.get("CreateTime")) / 1e9
        if since is None or now - since < IDLE_AFTER_S:
            continue
        idle.append(
            {
                "model": str(replica.get("model", "")),
                "node": str(replica.get("node", "")),
                "alloc_id": alloc_id,
                "idle_seconds": int(now - since),
                "gpus": len(_alloc_device_ids(alloc)),
            }
        )
    # Longest idle first: the best candidate to make room.
    idle.sort(key=lambda r: (-r["idle_seconds"], r["model"], r["alloc_id"]))
    return totals, idle


def _models(models: Mapping[str, Any]) -> dict[str, Any]:
    totals: dict[str, Any] = {"total": 0, "satisfied": 0, "short": 0, "short_models": []}
    unplaceable: list[dict[str, Any]] = []
    parked: list[dict[str, Any]] = []
    for name in sorted(models):
        m = _as_dict(models[name])
        desired, ready = as_int(m.get("desired")), as_int(m.get("ready"))
        is_parked = m.get("parked") is True
        totals["total"] += 1
        # Against what it should have now, not its minimum: an on-demand model's minimum is 0,
        # so one that was asked for (desired 1) and fitted nowhere would otherwise read as fine.
        if ready >= desired and not is_parked:
            totals["satisfied"] += 1
        else:
            totals["short"] += 1
            totals["short_models"].append({"model": name, "desired": desired, "ready": ready})
        if is_parked:
            parked.append(
                {
                    "model": name,
                    "consecutive_failures": as_int(m.get("consecutive_failures")),
                    "last_error": str(m.get("last_error") or ""),
                }
            )
        if m.get("unplaceable") is True:
            unplaceable.append({"model": name, "reason": str(m.get("placement_reason") or "")})
    return {"models": totals, "unplaceable": unplaceable, "parked": parked}


def fleet_summary(
    nodes: list[dict[str, Any]],
    allocs: list[dict[str, Any]],
    replicas: list[Any],
    models: Mapping[str, Any],
    now: float,
) -> dict[str, Any]:
    """The fleet summary from Nomad nodes and allocations, llmgw's replicas and model states.

    Input that is not the expected shape (a missing field, a null list) counts as absent
    rather than failing the whole answer: one odd node must not hide the other two hundred.
    """
    node_list = [_dict(n) for n in nodes]
    alloc_list = [_dict(a) for a in allocs]
    replica_list = [_as_dict(r) for r in replicas]

    node_totals = {"total": len(node_list), "ready": 0, "ineligible": 0, "draining": 0, "down": 0}
    for node in node_list:
        node_totals[node_state(node)] += 1

    gpus, entirely_free = gpu_use(node_list, held_devices(alloc_list))
    replica_totals, idle = _replicas(replica_list, alloc_list, now)
    return {
        "generated_at": now,
        "nodes": node_totals,
        "gpus": gpus,
        "fabrics": _fabrics(node_list, entirely_free),
        "replicas": replica_totals,
        **_models(models),
        "idle_replicas": idle,
    }
