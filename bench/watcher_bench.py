"""The watcher on a large fleet, measured against its three targets.

    .venv/bin/python bench/watcher_bench.py [--models 100,1000] [--idle-seconds 60]
        [--churn-seconds 60] [--park-trials 3]
    .venv/bin/python bench/watcher_bench.py --quick [--models 1000] [--allocs 3] [--passes 5]

The default mode measures the real thing: a Consul dev agent (devstack.consul_agent), the Nomad
stand-in on devstack/nodes/large-200.yaml, and a real `llmgw watcher` process. `--models` jobs
are registered as `llmgw apply` would (rendered by `render_job`, so their ID and
`llmgw_def_hash` match the definitions stored, as apply stores them, one key per model under
`llmgw/config/`, with the time that takes printed), except that the
engine task is a `mock_driver` task that runs for hours and the service has no check (so every
replica is a passing instance at once and nothing probes 1,000 ports). The watcher reaches
Nomad and Consul through a small counting reverse proxy in this process, which is how its API
calls are counted (the stand-in keeps no access log). Then:

- idle: once the watcher has settled, for `--idle-seconds` nothing changes; the calls that
  pass the proxy are counted (target: O(1), under 100 a minute with 1,000 models) and the
  watcher's CPU time (utime + stime from /proc/PID/stat) is taken (target: within 2x from the
  smallest fleet to the largest), beside the passes it ran and those it skipped with nothing
  new to read (its `/healthz` counts both, the models its passes reconciled, and times its last
  full pass, which reconciles every model: the 5-minute resync, measured);
- parking: `--park-trials` more models (3), defined from the start but never ready (their
  check probes a port nobody serves), have their jobs swapped one after the other for one whose
  mock task exits 1 after 200 ms, with the rendered restart and reschedule policies' shape but
  200 ms delays; the time from the 5th failed start (the 5th `Terminated` event with exit code
  1, from Nomad) to `parked: true` in `llmgw/state/<model>` (seen by a blocking query on
  Consul) is reported (target: the worst trial under 2 s), beside what one read of Nomad's
  allocation list costs at this size;
- churned: someone else's job whose task exits and is restarted in place about every second is
  run for `--churn-seconds`: the bytes the watcher reads from Nomad and its CPU, per minute and
  per change it read (the frames of allocation events its event stream was sent; for a watcher
  that lists instead, its long poll on the allocations answering), beside the idle minute's;
- evaluations: someone else's job is scaled between 1 and 2 every second for `--eval-seconds`
  (30), one evaluation each: the evaluation changes the watcher read (event frames, or its long
  poll on `/v1/evaluations` answering), how often it listed the namespace's evaluations and read
  one job's, and its Nomad bytes and CPU per evaluation change.

`--models 100,1000` measures each fleet in turn, on its own Consul and stand-in, and prints them
side by side with the ratio of the largest to the smallest: the cost of one change should not
grow with the fleet (target: within 2x from 100 to 1,000 models).

`--quick` builds snapshots of the same size in memory instead (no Consul, Nomad or process),
sets them on a `Watcher` that does not lead, writes the states its decisions ask for until none
asks for more (as a leader would), and times with `time.process_time` a full pass (every model)
a pass after one model's activity key moved (a KV change: Consul answers the prefix whole, so
finding the key that moved looks at each), and a pass after one allocation changed as the event
stream's feed takes it in (its job named, its per-job index made as events come), each over that
model only, for each fleet size side by side: the cost of an allocation change should not grow
with the fleet (`CHANGE_GROWTH_BUDGET`).

Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from nomad_driver.blocking import Reading
from nomad_driver.config_kv import definition_keys
from nomad_driver.config_store import StoreResult, store_keys
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.nomad import Nomad
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import ModelState, activity_key, state_key
from nomad_driver.watcher.loop import Watcher, WatcherConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from bench._support import CountingProxy, cpu_seconds, rss_mb, start_standin  # noqa: E402
from devstack import lifetime  # noqa: E402
from devstack.consul_agent import ConsulAgent  # noqa: E402
from devstack.ports import free_port  # noqa: E402

IDLE_CALLS_BUDGET = 100
PARK_BUDGET_S = 2.0
RSS_BUDGET_MB = 1000
# A change's cost may grow this much from the smallest fleet measured to the largest.
CHANGE_GROWTH_BUDGET = 2.0
FLEET = REPO / "devstack" / "nodes" / "large-200.yaml"
FAILING = "bench-fail"  # bench-fail-0, -1, ...: one model per parking trial


def models_text(n: int, failing: int = 0) -> str:
    lines = [
        "profiles:",
        "  gpu:",
        "    engine: llama.cpp",
        "    engine_version: b6500",
        "    gpus: 1",
        "    gpu_memory_mib: 24000",
        "models:",
    ]
    for i in range(n):
        lines += [
            f"  m{i}:",
            f"    source: file:///models/m{i}.gguf",
            "    profile: gpu",
            "    replicas: {min: 1, max: 2}",
        ]
    for i in range(failing):
        lines += [
            f"  {FAILING}-{i}:",
            f"    source: file:///models/{FAILING}-{i}.gguf",
            "    profile: gpu",
            "    replicas: {min: 1, max: 1}",
        ]
    return "\n".join(lines) + "\n"


def alloc(job_id: str, i: int, j: int, failed: bool) -> dict[str, Any]:
    t = 1_000_000_000 * (i * 10 + j + 1)
    events = [{"Type": "Received", "Time": t}, {"Type": "Started", "Time": t + 1}]
    if failed:
        events += [{"Type": "Terminated", "Time": t + 2, "DisplayMessage": "Exit Code: 1"}]
    return {
        "ID": f"{i:08x}-0000-0000-0000-{j:012x}",
        "JobID": job_id,
        "ClientStatus": "failed" if failed else "running",
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"State": "dead" if failed else "running", "Events": events}},
    }


def quick_fleet(n: int, allocs_per_model: int, passes: int) -> dict[str, Any]:
    """One synthetic fleet: a full pass, then one model's change at a time, timed."""
    text = models_text(n)
    models = parse_models(text, "bench").models
    now = time.time()
    w = Watcher(Consul("http://127.0.0.1:1"), Nomad("http://127.0.0.1:1"), WatcherConfig(), clock=lambda: now)
    w._verify_skips = ""  # the suite's check reconciles every model at every pass
    kv: dict[str, KVEntry] = {k: KVEntry(k, v, 1) for k, v in definition_keys(text).items()}
    jobs: dict[str, dict[str, Any]] = {}
    allocs: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    for i, (name, m) in enumerate(models.items()):
        jobs[m.job_id] = render_job(m)
        for j in range(allocs_per_model):
            allocs.append(alloc(m.job_id, i, j, failed=j < allocs_per_model - 1))
        evals.append({"ID": f"e{i}a", "JobID": m.job_id, "CreateIndex": 2 * i, "Status": "complete"})
        evals.append({"ID": f"e{i}b", "JobID": m.job_id, "CreateIndex": 2 * i + 1, "Status": "complete"})
        last = allocs[-1]["ID"]
        engines.append(
            {
                "Service": {
                    "ID": f"_nomad-task-{last}-group-engine-llmgw-engine-http",
                    "Meta": {"model": name},
                },
                "Checks": [{"Status": "passing"}],
            }
        )
        kv[state_key(name)] = KVEntry(state_key(name), ModelState().to_kv(), 10 + i)
        kv[activity_key(name)] = KVEntry(activity_key(name), str(now).encode(), 10 + i)
    t0 = time.monotonic()
    w.jobs.snapshot = Reading(1, jobs, t0)
    w.allocs.snapshot = Reading(1, tuple(allocs), t0)
    w.evals.snapshot = Reading(1, tuple(evals), t0)
    w.engines.snapshot = Reading(1, tuple(engines), t0)
    index = n + 100
    # Settled: each state as the leader would have written it, so no decision has more to do.
    for _ in range(3):
        w.kv.snapshot = Reading(index, dict(kv), t0)
        asyncio.run(w.run_pass())
        writes = [a for d in w.decisions.values() for a in d.actions if hasattr(a, "state")]
        if not writes:
            break
        for a in writes:
            index += 1
            kv[state_key(a.model)] = KVEntry(state_key(a.model), a.state.to_kv(), index)
    full = []
    for _ in range(passes):
        w.marks.all()
        start = time.process_time()
        asyncio.run(w.run_pass())
        full.append(time.process_time() - start)
    names = list(models)
    change = []
    for k in range(passes):
        # A request served on one model: its activity key moves, as a router writes it.
        name = names[(k * 7919) % len(names)]
        index += 1
        kv[activity_key(name)] = KVEntry(activity_key(name), str(now).encode(), index)
        w.kv.snapshot = Reading(index, dict(kv), t0)
        models_before = w.marks.model_passes
        start = time.process_time()
        asyncio.run(w.run_pass())
        change.append(time.process_time() - start)
        assert w.marks.model_passes - models_before == 1, "a one-model change reconciled other models"
    nomad_change = []
    # The allocations as the feed holds them (`feeds.py`): listed once, then one changed per
    # event, the reading and its per-job index made as the feed makes them.
    feed = w.alloc_feed
    feed.by_id = {a["ID"]: a for a in allocs}
    feed._job_allocs = {}
    for a in allocs:
        feed._job_allocs.setdefault(a["JobID"], {})[a["ID"]] = a
    feed._publish(None)
    w.allocs.snapshot = Reading(index, feed.data(), t0)
    w._feed_read("nomad-allocations", feed)
    asyncio.run(w.run_pass())
    for k in range(passes):
        i = (k * 7919 + 13) % len(names)
        changed = allocs[i * allocs_per_model + allocs_per_model - 1]
        jobs: set[str] = set()
        feed._put(changed["ID"], {**changed, "ModifyIndex": index + k}, jobs)
        feed._publish(jobs)
        feed._changes = jobs
        w.allocs.snapshot = Reading(index + 1 + k, feed.data(), t0)
        w._feed_read("nomad-allocations", feed)
        models_before = w.marks.model_passes
        start = time.process_time()
        asyncio.run(w.run_pass())
        nomad_change.append(time.process_time() - start)
        assert w.marks.model_passes - models_before == 1, "an allocation change reconciled other models"
    satisfied = sum(1 for d in w.decisions.values() if d.health == "passing")
    return {
        "nomad_change_ms": 1000 * sorted(nomad_change)[len(nomad_change) // 2],
        "models": n,
        "allocations": len(allocs),
        "full_ms": 1000 * min(full),
        "change_ms": 1000 * sorted(change)[len(change) // 2],
        "satisfied": satisfied,
        "rss_mb": rss_mb(os.getpid()),
    }


def quick(args: argparse.Namespace) -> int:
    """The synthetic mode: snapshots built in memory, passes timed in this process."""
    sizes = [int(s) for s in str(args.models).split(",")]
    results = [quick_fleet(n, args.allocs, args.passes) for n in sizes]
    print("models:            " + "".join(f"{r['models']:>12,}" for r in results))
    print("full pass CPU, ms: " + "".join(f"{r['full_ms']:>12.0f}" for r in results))
    print("KV change CPU, ms: " + "".join(f"{r['change_ms']:>12.1f}" for r in results))
    print("alloc change, ms:  " + "".join(f"{r['nomad_change_ms']:>12.1f}" for r in results))
    print("satisfied:         " + "".join(f"{r['satisfied']:>12,}" for r in results))
    print("process RSS, MB:   " + "".join(f"{r['rss_mb']:>12.0f}" for r in results))
    ok = all(r["satisfied"] == r["models"] for r in results)
    if len(results) > 1:
        first, last = results[0], results[-1]
        growth = last["nomad_change_ms"] / first["nomad_change_ms"]
        print(
            f"an allocation change at {last['models']:,} models costs {growth:.2f}x what it costs at "
            f"{first['models']:,} (budget {CHANGE_GROWTH_BUDGET:.0f}x); a KV change "
            f"{last['change_ms'] / first['change_ms']:.2f}x (Consul answers a prefix whole)"
        )
        ok = ok and growth <= CHANGE_GROWTH_BUDGET
    return 0 if ok else 1


# ----- the real thing ------------------------------------------------------------------------


def mock_job(model: Any, config: dict[str, Any], *, keep_checks: bool = False) -> dict[str, Any]:
    """`render_job(model)` with its engine task swapped for a mock_driver task.

    ID, meta (`llmgw_def_hash` above all), constraints, network and service stay as rendered,
    so the watcher takes the job for its model's. Unless `keep_checks`, the service loses its
    check, so a replica is a passing instance as soon as it runs, without a process behind a
    port; with it, the check probes a port nobody serves and the replica never becomes ready.
    """
    job = render_job(model)
    group = job["TaskGroups"][0]
    task = group["Tasks"][0]
    group["Tasks"] = [
        {
            "Name": task["Name"],
            "Driver": "mock_driver",
            "Config": config,
            "Resources": {"CPU": 50, "MemoryMB": 32},
        }
    ]
    for service in group.get("Services") or []:
        if not keep_checks:
            service["Checks"] = []
    return job


async def store_at(consul_url: str, keys: dict[str, bytes]) -> StoreResult:
    consul = Consul(consul_url)
    try:
        return await store_keys(consul, keys)
    finally:
        await consul.close()


def healthz(admin: str) -> dict[str, Any]:
    try:
        body: dict[str, Any] = httpx.get(f"{admin}/healthz", timeout=5).json()
        return body
    except (httpx.HTTPError, ValueError):
        return {}


def wait_for(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise SystemExit(f"{what}: not within {timeout:.0f}s (last: {last!r})")


def satisfied_count(admin: str) -> int:
    try:
        models = httpx.get(f"{admin}/v1/admin/models", timeout=30).json().get("models", [])
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(1 for m in models if m.get("state") == "satisfied")


def watch_parked(consul: str, model: str, seen: list[float], stop: threading.Event) -> None:
    """Record when `llmgw/state/<model>` first says parked, with blocking queries on Consul."""
    index = 0
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            try:
                resp = http.get(f"{consul}/v1/kv/{state_key(model)}", params={"index": index, "wait": "5s"})
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            now = time.time()
            index = int(resp.headers.get("X-Consul-Index", "0"))
            if resp.status_code == 200:
                value = json.loads(base64.b64decode(resp.json()[0]["Value"] or "") or b"{}")
                if value.get("parked"):
                    seen.append(now)
                    return


def fifth_failure(nomad: str, job_id: str, task: str) -> float | None:
    """Unix time of the job's 5th failed start (`Terminated` with exit code 1), from Nomad."""
    allocs = httpx.get(f"{nomad}/v1/job/{job_id}/allocations", timeout=10).json()
    times = []
    for stub in allocs:
        alloc = httpx.get(f"{nomad}/v1/allocation/{stub['ID']}", timeout=10).json()
        state = (alloc.get("TaskStates") or {}).get(task) or {}
        times += [
            e["Time"] / 1e9
            for e in state.get("Events") or []
            if e.get("Type") == "Terminated" and e.get("ExitCode") == 1
        ]
    times.sort()
    return times[4] if len(times) >= 5 else None


def park_trial(consul: str, nomad: str, admin: str, model: Any, stop: threading.Event) -> float:
    """Swap the model's job for one whose task exits 1 after 200 ms (its definition, and so its
    hash, stays the same); seconds from its 5th failed start to `parked: true` in Consul."""
    seen: list[float] = []
    observer = threading.Thread(target=watch_parked, args=(consul, model.name, seen, stop), daemon=True)
    observer.start()
    job = mock_job(model, {"run_for": "200ms", "exit_code": 1}, keep_checks=True)
    group = job["TaskGroups"][0]
    # The rendered policies' shape (one restart in place, then a new allocation) with 200 ms
    # delays instead of 15 s and minutes. Not many restarts in one allocation: Nomad keeps only
    # a task's last ten events, and the watcher counts starts from them.
    group["RestartPolicy"] = {
        "Attempts": 1,
        "Interval": 3_600_000_000_000,
        "Delay": 200_000_000,
        "Mode": "fail",
    }
    group["ReschedulePolicy"] = {
        "Attempts": 0, "Interval": 0, "Unlimited": True, "Delay": 200_000_000,
        "DelayFunction": "constant", "MaxDelay": 1_000_000_000,
    }  # fmt: skip
    httpx.put(f"{nomad}/v1/jobs", json={"Job": job}, timeout=30).raise_for_status()
    observer.join(60)
    fifth = fifth_failure(nomad, model.job_id, group["Tasks"][0]["Name"])
    current = httpx.get(f"{nomad}/v1/job/{model.job_id}", timeout=10).json()["TaskGroups"][0]
    if current["Tasks"][0]["Driver"] != "mock_driver":
        raise SystemExit(f"{model.job_id} was re-registered by someone else; the timing is void")
    if not seen or fifth is None:
        # Say what the watcher saw, so a miss can be told from a broken measurement.
        view = httpx.get(f"{admin}/v1/admin/models/{model.name}", timeout=10).text
        print(
            f"{model.name}: parked seen: {bool(seen)}, 5th failure: {fifth}; the watcher says: {view[:600]}"
        )
        for stub in httpx.get(f"{nomad}/v1/job/{model.job_id}/allocations", timeout=10).json():
            events = (stub.get("TaskStates") or {}).get("engine", {}).get("Events") or []
            print(f"  alloc {stub['ID'][:8]} {stub['ClientStatus']}: {[e['Type'] for e in events][-12:]}")
        return float("inf")
    return seen[0] - fifth


def describe_calls(calls: Counter[tuple[str, str, str, bool]]) -> list[str]:
    out = []
    for (name, method, path, blocking), n in sorted(calls.items(), key=lambda kv: -kv[1]):
        out.append(f"    {n:>5}  {name:<6} {method:<4} {path}{'  (blocking)' if blocking else ''}")
    return out


CHURN_JOB = "bench-churn"


SCALED_JOB = "bench-scaled"


def scaled_job() -> dict[str, Any]:
    """Someone else's job, scaled between 1 and 2 every second in the evaluations window: each
    scale is an evaluation, which a watcher that lists the namespace's evaluations pays for."""
    job = churn_job()
    group = job["TaskGroups"][0]
    group["Tasks"][0]["Config"] = {"run_for": "100h"}
    group["Update"] = {"MaxParallel": 0}  # no deployment: Nomad refuses a scale during one
    return {**job, "ID": SCALED_JOB, "Name": SCALED_JOB}


def scale_every_second(nomad: str, stop: threading.Event) -> None:
    count = 1
    with httpx.Client(base_url=nomad, timeout=30) as http:
        while not stop.wait(1.0):
            count = 3 - count
            http.post(
                f"/v1/job/{SCALED_JOB}/scale",
                json={"Count": count, "Target": {"Group": "work"}, "Message": "bench"},
            ).raise_for_status()


def churn_job() -> dict[str, Any]:
    """Someone else's job whose one task exits and is restarted in place about every second:
    one allocation change a second, which every reader of the cluster's allocations pays for."""
    return {
        "ID": CHURN_JOB,
        "Name": CHURN_JOB,
        "Type": "service",
        "Datacenters": ["dc1"],
        "TaskGroups": [
            {
                "Name": "work",
                "Count": 1,
                "RestartPolicy": {
                    "Attempts": 100_000,
                    "Interval": 3_600_000_000_000,
                    "Delay": 500_000_000,
                    "Mode": "delay",
                },
                "Tasks": [
                    {
                        "Name": "work",
                        "Driver": "mock_driver",
                        "Config": {"run_for": "500ms", "exit_code": 0},
                        "Resources": {"CPU": 50, "MemoryMB": 32},
                    }
                ],
            }
        ],
    }


def nomad_bytes(counts: Counter[tuple[str, str]]) -> int:
    return sum(n for (name, _), n in counts.items() if name == "nomad")


def measure(args: argparse.Namespace, n_models: int) -> dict[str, Any]:
    """One fleet of `n_models`: its idle minute, its churned minute and its parking trials."""
    # The failing model is defined from the start, running but never ready until its job is
    # swapped for one that fails: defining it later would race the watcher, which
    # registers the rendered job of a new definition whose job it has not seen yet.
    text = models_text(n_models, failing=args.park_trials)
    everything = parse_models(text, "bench").models
    failing = [m for name, m in everything.items() if name.startswith(FAILING)]
    models = {name: m for name, m in everything.items() if not name.startswith(FAILING)}
    with tempfile.TemporaryDirectory(prefix="watcher-bench-") as tmp:
        work = Path(tmp)
        # A dev agent logs every request at debug: at 10,000 models that was 8 GB of log in one
        # run, written on the same two cores the watcher is timed on.
        consul = ConsulAgent(log_dir=work, die_with_parent=True, extra_args=("-log-level", "warn")).start()
        standin: subprocess.Popen[bytes] | None = None
        watcher: subprocess.Popen[bytes] | None = None
        stop = threading.Event()
        try:
            standin, nomad = start_standin(work, FLEET, consul.url)
            print(f"[{n_models} models] Consul {consul.url}, stand-in {nomad} on {FLEET.name}")
            started = time.monotonic()
            with httpx.Client(base_url=nomad, timeout=30) as http:
                for model in models.values():
                    job = mock_job(model, {"run_for": "100h"})
                    http.put("/v1/jobs", json={"Job": job}).raise_for_status()
                for model in failing:
                    # Running, never ready: no instance in Consul. An instance with a failing
                    # check would do the same, but Consul syncs a failing check's changing output
                    # to the catalog every 5 minutes (`check_update_interval`); at 10,000 models
                    # each sync is a 15 MB read of the engines, which landed in the windows
                    # below and was counted against the allocation changes they time.
                    job = mock_job(model, {"run_for": "100h"})
                    job["TaskGroups"][0]["Services"] = []
                    http.put("/v1/jobs", json={"Job": job}).raise_for_status()
            print(f"registered {len(models)} mock_driver jobs in {time.monotonic() - started:.1f} s")
            # As `llmgw apply` stores them: one key per model (the single key stops at 512 KiB).
            stored_at = time.monotonic()
            stored = asyncio.run(store_at(consul.url, definition_keys(text, checked=True)))
            print(
                f"stored {len(everything)} definitions in {time.monotonic() - stored_at:.2f} s "
                f"({stored.transactions} transactions)"
            )

            def engines_passing() -> int:
                resp = httpx.get(
                    f"{consul.url}/v1/health/service/llmgw-engine", params={"passing": "1"}, timeout=30
                )
                return len(resp.json()) >= len(models)

            wait_for(f"{len(models)} passing llmgw-engine instances", engines_passing, 240, 2)
            print(
                f"all {len(models)} replicas running and in Consul after {time.monotonic() - started:.1f} s"
            )

            proxy = CountingProxy({"consul": consul.url, "nomad": nomad}).start()
            admin = f"http://127.0.0.1:{free_port()}"
            env = {**os.environ, "NOMAD_ADDR": proxy.url("nomad"), "CONSUL_HTTP_ADDR": proxy.url("consul")}
            log = (work / "watcher.log").open("wb")
            watcher = subprocess.Popen(
                [str(Path(sys.prefix) / "bin" / "llmgw"), "watcher", "--listen", admin.removeprefix("http://")],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=lifetime.die_with_parent,
            )  # fmt: skip
            started = time.monotonic()
            wait_for("the watcher to lead", lambda: healthz(admin).get("leader"), 60)
            wait_for(f"{len(models)} models satisfied", lambda: satisfied_count(admin) >= len(models), 180, 2)
            print(f"watcher leads, every model satisfied after {time.monotonic() - started:.1f} s")

            # Settled: the leader's first passes register every model in the Consul UI once, and
            # Nomad's last updates of the new allocations (each one a read of its list entry)
            # have come in; a wave of those inside the idle minute would be setup, not idleness.
            # And no work left marked: after its first pass a leader rests as long as that pass
            # computed (20 s at 10,000 models), quiet, before the pass over what it wrote.
            def quiet() -> bool:
                before = sum(n for k, n in proxy.snapshot().items() if not k[3])
                time.sleep(10)
                health = healthz(admin)
                idle = not health.get("models_marked") and not health.get("full_pass_marked", True)
                return idle and sum(n for k, n in proxy.snapshot().items() if not k[3]) - before <= 8

            # At ten thousand models that first registration is 10,000 writes: wait for all of it.
            def registered() -> bool:
                checks = httpx.get(f"{consul.url}/v1/health/node/llmgw-models", timeout=30).json()
                return len(checks) >= len(models)

            wait_for("every model in the Consul UI", registered, 600, 5)
            wait_for("the watcher to settle", quiet, 120, 0)

            def window(seconds: float, name: str) -> dict[str, Any]:
                print(f"{name} window: {seconds:.0f} s (watcher pid {watcher.pid})")
                calls0, bytes0, frames0 = proxy.snapshot(), proxy.bytes_snapshot(), proxy.frames_snapshot()
                cpu0, health0 = cpu_seconds(watcher.pid), healthz(admin)
                t0 = time.monotonic()
                time.sleep(seconds)
                calls1, bytes1, frames1 = proxy.snapshot(), proxy.bytes_snapshot(), proxy.frames_snapshot()
                cpu1, health1 = cpu_seconds(watcher.pid), healthz(admin)
                took = time.monotonic() - t0
                calls = calls1 - calls0
                # The changes the watcher read: the frames of allocation events it was sent, or
                # (a watcher that lists instead) its long poll on the allocations answering.
                changes = (frames1 - frames0)[("nomad", "Allocation")] + calls[
                    ("nomad", "GET", "/v1/allocations", True)
                ]
                # Likewise the evaluation changes: frames of evaluation events, or the long poll
                # on the namespace's evaluations answering.
                eval_changes = (frames1 - frames0)[("nomad", "Evaluation")] + calls[
                    ("nomad", "GET", "/v1/evaluations", True)
                ]
                eval_lists = sum(
                    n for (s, _, p, _), n in calls.items() if (s, p) == ("nomad", "/v1/evaluations")
                )
                job_reads = sum(
                    n
                    for (s, _, p, _), n in calls.items()
                    if s == "nomad" and p.startswith("/v1/job/") and p.endswith("/evaluations")
                )
                return {
                    "seconds": took,
                    "calls": calls,
                    "cpu": cpu1 - cpu0,
                    "passes": health1.get("passes", 0) - health0.get("passes", 0),
                    "skipped": health1.get("skipped_passes", 0) - health0.get("skipped_passes", 0),
                    # The last full pass's own CPU, as the watcher timed it.
                    "pass_cpu_ms": float(health1.get("last_full_pass_cpu_ms", 0.0)),
                    "reconciled": health1.get("models_reconciled", 0) - health0.get("models_reconciled", 0),
                    "full_passes": health1.get("full_passes", 0) - health0.get("full_passes", 0),
                    # The collector's full walks of the watcher's heap (`watcher/heap.py`).
                    "gc_full": health1.get("gc_full_collections", 0) - health0.get("gc_full_collections", 0),
                    "gc_frozen": health1.get("gc_frozen_objects", 0),
                    # What woke the passes that ran: a watch that read something new, or the
                    # tick for a deadline.
                    "causes": Counter(health1.get("pass_causes", {}))
                    - Counter(health0.get("pass_causes", {})),
                    "nomad_bytes": nomad_bytes(bytes1 - bytes0),
                    "bytes_by_path": bytes1 - bytes0,
                    "changes": changes,
                    "eval_changes": eval_changes,
                    "eval_lists": eval_lists,
                    "eval_job_reads": job_reads,
                }

            idle = window(args.idle_seconds, "idle")
            httpx.put(f"{nomad}/v1/jobs", json={"Job": churn_job()}, timeout=30).raise_for_status()
            time.sleep(3)  # its first start, before the window opens
            churned = window(args.churn_seconds, "churned")
            httpx.delete(f"{nomad}/v1/job/{CHURN_JOB}", timeout=30).raise_for_status()
            time.sleep(3)
            httpx.put(f"{nomad}/v1/jobs", json={"Job": scaled_job()}, timeout=30).raise_for_status()
            time.sleep(3)
            flipping = threading.Event()
            flipper = threading.Thread(target=scale_every_second, args=(nomad, flipping), daemon=True)
            flipper.start()
            evaluated = window(args.eval_seconds, "evaluations")
            flipping.set()
            flipper.join(10)
            httpx.delete(f"{nomad}/v1/job/{SCALED_JOB}", timeout=30).raise_for_status()
            time.sleep(3)

            parks = [park_trial(consul.url, nomad, admin, model, stop) for model in failing]
            started = time.perf_counter()
            allocs = httpx.get(f"{nomad}/v1/allocations", timeout=30)
            allocs_read = (time.perf_counter() - started, len(allocs.content), len(allocs.json()))
            rss = rss_mb(watcher.pid)
        finally:
            stop.set()
            for proc in (watcher, standin):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            consul.stop()

    names = set(models) | {m.job_id for m in models.values()}
    idle_calls = idle["calls"]
    per_model = sum(
        n for (_, _, path, _), n in idle_calls.items() if path.rstrip("/").rsplit("/", 1)[-1] in names
    )
    return {
        "models": len(models),
        "idle": idle,
        "churned": churned,
        "evaluated": evaluated,
        "per_model_paths": per_model,
        "parks": parks,
        "allocs_read": allocs_read,
        "rss": rss,
    }


def per_minute(w: Mapping[str, Any], key: str) -> float:
    return float(w[key]) * 60 / w["seconds"]


def per_change(w: Mapping[str, Any], key: str) -> float:
    return float(w[key]) / w["changes"] if w["changes"] else float("inf")


def report(results: list[dict[str, Any]]) -> int:
    sizes = [r["models"] for r in results]
    print()
    print(f"Watcher, mock_driver models on {FLEET.name}, real llmgw watcher, {os.cpu_count()} CPUs")
    head = "".join(f"{n:>16,}" for n in sizes)
    ratio_head = f"   {sizes[-1]:,} / {sizes[0]:,}" if len(sizes) > 1 else ""
    print(f"  {'models':<40}{head}{ratio_head}")

    def row(name: str, values: list[float], fmt: str, *, ratio: bool = False, target: str = "") -> None:
        cells = "".join(f"{format(v, fmt):>16}" for v in values)
        extra = ""
        if ratio and len(values) > 1:
            extra = f"{values[-1] / values[0]:>10.1f}x" if values[0] else f"{'-':>11}"
        print(f"  {name:<40}{cells}{extra}   {target}")

    def field(path: tuple[str, ...]) -> list[Any]:
        out = []
        for r in results:
            v: Any = r
            for k in path:
                v = v[k]
            out.append(v)
        return out

    idle, churned = field(("idle",)), field(("churned",))
    row("CPU of the last full pass, ms", [w["pass_cpu_ms"] for w in idle], ".0f", ratio=True,
        target="the resync, every 30 minutes")  # fmt: skip
    row("passes run, idle minute", [per_minute(w, "passes") for w in idle], ".0f")
    row("models reconciled, churned minute", [per_minute(w, "reconciled") for w in churned], ".0f")
    row("passes skipped (nothing new), idle minute", [per_minute(w, "skipped") for w in idle], ".0f")
    row("passes run, churned minute", [per_minute(w, "passes") for w in churned], ".0f")
    row("API calls, idle minute", [sum(w["calls"].values()) * 60 / w["seconds"] for w in idle], ".0f",
        target=f"< {IDLE_CALLS_BUDGET} (O(1))")  # fmt: skip
    row("Nomad bytes, idle minute, kB", [per_minute(w, "nomad_bytes") / 1e3 for w in idle], ".0f", ratio=True)
    row("CPU, idle minute, s", [per_minute(w, "cpu") for w in idle], ".2f", ratio=True,
        target="within 2x across sizes")  # fmt: skip
    row("full garbage collections, idle minute", [per_minute(w, "gc_full") for w in idle], ".0f")
    row("  objects frozen out of them, thousands", [w["gc_frozen"] / 1e3 for w in idle], ".0f", ratio=True)
    row("allocation changes read, churned minute", [per_minute(w, "changes") for w in churned], ".0f")
    row("Nomad bytes, churned minute, MB", [per_minute(w, "nomad_bytes") / 1e6 for w in churned], ".1f",
        ratio=True)  # fmt: skip
    row("CPU, churned minute, s", [per_minute(w, "cpu") for w in churned], ".2f", ratio=True)
    row("Nomad bytes per change, kB", [per_change(w, "nomad_bytes") / 1e3 for w in churned], ".0f", ratio=True,
        target="within 2x across sizes")  # fmt: skip
    row("CPU per change, ms", [per_change(w, "cpu") * 1000 for w in churned], ".1f", ratio=True,
        target="within 2x across sizes")  # fmt: skip
    evaluated = field(("evaluated",))
    row(
        "evaluation changes read, evaluations minute",
        [per_minute(w, "eval_changes") for w in evaluated],
        ".0f",
    )
    row("  namespace evaluation lists in it", [per_minute(w, "eval_lists") for w in evaluated], ".0f")
    row("  per-job evaluation reads in it", [per_minute(w, "eval_job_reads") for w in evaluated], ".0f")
    row("  passes run in it", [per_minute(w, "passes") for w in evaluated], ".0f")
    row("Nomad bytes per evaluation change, kB",
        [w["nomad_bytes"] / max(1, w["eval_changes"]) / 1e3 for w in evaluated], ".1f", ratio=True)  # fmt: skip
    row("CPU per evaluation change, ms",
        [w["cpu"] * 1000 / max(1, w["eval_changes"]) for w in evaluated], ".1f", ratio=True)  # fmt: skip
    row("5th failure -> parked, worst, s", [max(r["parks"]) for r in results], ".2f",
        target=f"< {PARK_BUDGET_S:.0f} at every size")  # fmt: skip
    row("one GET /v1/allocations, ms", [r["allocs_read"][0] * 1000 for r in results], ".0f")
    row("  its size, MB", [r["allocs_read"][1] / 1e6 for r in results], ".2f", ratio=True)
    row("watcher RSS, MB", field(("rss",)), ".0f", ratio=True, target=f"< {RSS_BUDGET_MB:,} at every size")
    for r in results:
        w = r["churned"]
        spread = sorted(w["bytes_by_path"].items(), key=lambda kv: -kv[1])
        print(f"  [{r['models']} models] bytes per change read, churned window, by endpoint:")
        for (name, path), n in spread[:6]:
            print(f"    {n / max(1, w['changes']) / 1e3:>9.0f} kB  {name:<6} {path}")
        for name in ("idle", "churned", "evaluated"):
            causes = ", ".join(f"{c} {n}" for c, n in sorted(r[name]["causes"].items())) or "none"
            print(f"  [{r['models']} models] passes run, {name} window, by cause: {causes}")
        print(f"  [{r['models']} models] parking trials: " + " ".join(f"{p:.2f}" for p in r["parks"]) + " s")
        print(f"  [{r['models']} models] idle calls by endpoint (per-model paths: {r['per_model_paths']}):")
        print("\n".join(describe_calls(r["idle"]["calls"])))

    failures = []
    for r in results:
        w, n = r["idle"], r["models"]
        if w["passes"] + w["skipped"] == 0:
            failures.append(f"{n} models: the watcher's loop did not turn in the idle window")
        if r["rss"] >= RSS_BUDGET_MB:
            failures.append(f"{n} models: the watcher holds too much memory")
        if sum(w["calls"].values()) * 60 / w["seconds"] >= IDLE_CALLS_BUDGET or r["per_model_paths"]:
            failures.append(f"{n} models: an idle minute costs too many calls")
        if max(r["parks"]) >= PARK_BUDGET_S:
            failures.append(f"{n} models: parking took too long")
        if r["churned"]["changes"] == 0:
            failures.append(f"{n} models: the watcher read no allocation change in the churned window")
    if len(results) > 1:
        first, last = results[0]["churned"], results[-1]["churned"]
        idle_first, idle_last = results[0]["idle"], results[-1]["idle"]
        idle_grew = per_minute(idle_last, "cpu") / max(1e-9, per_minute(idle_first, "cpu"))
        if idle_grew > CHANGE_GROWTH_BUDGET:
            failures.append(
                f"an idle minute's CPU grew {idle_grew:.1f}x from {sizes[0]} to {sizes[-1]} models"
            )
        for key, what in (("nomad_bytes", "Nomad bytes"), ("cpu", "CPU")):
            grew = per_change(last, key) / per_change(first, key) if per_change(first, key) else float("inf")
            if grew > CHANGE_GROWTH_BUDGET:
                failures.append(
                    f"{what} per allocation change grew {grew:.1f}x from {sizes[0]} to {sizes[-1]} models "
                    f"(target: within {CHANGE_GROWTH_BUDGET:.0f}x)"
                )
    for failure in failures:
        print(f"MISSED: {failure}")
    return 1 if failures else 0


def real(args: argparse.Namespace) -> int:
    sizes = [int(n) for n in str(args.models).split(",") if n.strip()]
    return report([measure(args, n) for n in sizes])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="synthetic snapshots in memory, no processes")
    ap.add_argument(
        "--models",
        default="1000",
        help="fleet sizes, comma-separated (100,1000 compares them)",
    )
    ap.add_argument("--allocs", type=int, default=3, help="--quick: allocations per model")
    ap.add_argument("--passes", type=int, default=5, help="--quick: passes to time")
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument(
        "--churn-seconds", type=float, default=60.0, help="the window with one allocation change a second"
    )
    ap.add_argument(
        "--eval-seconds",
        type=float,
        default=30.0,
        help="the window in which someone else's job is scaled every second (one evaluation each)",
    )
    ap.add_argument(
        "--park-trials", type=int, default=3, help="failing models to time parking on, one by one"
    )
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    return quick(args) if args.quick else real(args)


if __name__ == "__main__":
    sys.exit(main())
