"""The short tour `devstack up` prints once the stack is up: real calls, their real answers.

Each step shows the command a user would type and what it returned just now, so the tour is
also a smoke test: a broken router or watcher shows up here as an error, not as a claim.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

import httpx
import openai

from devstack import prometheus as prom
from devstack.addresses import Addresses
from devstack.services import venv_root


class TourStack(Protocol):
    """What the tour reads of the running stack (`stack.Stack` is one)."""

    @property
    def addr(self) -> Addresses: ...
    @property
    def gemma_is_real(self) -> bool: ...
    @property
    def nomad_is_standin(self) -> bool: ...
    @property
    def dir(self) -> Path: ...
    @property
    def logs(self) -> Path: ...
    @property
    def models_file(self) -> Path: ...


PROMPT = "The three primary colours are"
# A base model continues text; it has not learnt to follow a chat turn, so the curl asks for a
# completion too. Chat requests work the same way (`/v1/chat/completions`), and are what an
# instruction-tuned model is for.
STORY = "Once upon a time, in a small village by the sea,"


def _print(text: str = "") -> None:
    print(text, flush=True)


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in text.rstrip().splitlines())


def _one_line(text: str) -> str:
    return " ".join(text.split())


SPLIT = "gemma-3-270m-split"


# The router asks for a key only where the stack gave it some (--acl); any key does otherwise.
ANY_KEY = "devstack"


def openai_step(router: str, model: str = "gemma-3-270m", api_key: str = "") -> str:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key=api_key or ANY_KEY, max_retries=5, timeout=120)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0.7)
    return reply.choices[0].text


def refusal_step(router: str, model: str, api_key: str = "") -> str:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key=api_key or ANY_KEY, max_retries=0, timeout=60)
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        code = body.get("code") or (body.get("error") or {}).get("code", "")
        message = body.get("message") or (body.get("error") or {}).get("message", str(exc))
        return f"HTTP {exc.status_code} {code}: {message}"
    except openai.APIError as exc:
        return f"error: {exc}"
    return "answered (not refused)"


def curl_command(router: str, api_key: str = "") -> list[str]:
    body = {"model": "gemma-3-270m", "prompt": STORY, "max_tokens": 40}
    auth = ["-H", f"Authorization: Bearer {api_key}"] if api_key else []
    return [
        "curl",
        "-s",
        f"{router}/v1/completions",
        *auth,
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps(body),
    ]


def curl_step(router: str, api_key: str = "") -> str:
    argv = curl_command(router, api_key)
    if shutil.which("curl") is None:
        return "(curl is not installed here)"
    out = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    try:
        reply: dict[str, Any] = json.loads(out.stdout)
        return STORY + str(reply["choices"][0]["text"])
    except (ValueError, KeyError, IndexError, TypeError):
        return out.stdout.strip() or out.stderr.strip()


def alerts_step(
    prometheus: str, models: tuple[str, ...] = ("kev-0.5b", "phi-4"), wait_s: float = 120.0
) -> str:
    """The firing alerts about `models`, from Prometheus's own API, once the demo's have fired.

    The dev stack cuts the rules' `for:` to seconds, but an alert still needs that long after
    the model's state changed, and a scrape and an evaluation, so the tour waits for them.
    """
    deadline = time.monotonic() + wait_s
    found: list[dict[str, Any]] = []
    while True:
        try:
            found = [a for a in prom.alerts(prometheus) if a.get("state") == "firing"]
        except (httpx.HTTPError, ValueError) as exc:
            return f"error: {exc}"
        names = {(a["labels"].get("alertname"), a["labels"].get("model")) for a in found}
        if set(prom.DEMO_ALERTS) <= names or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    lines = []
    for a in sorted(found, key=lambda a: (a["labels"].get("model", ""), a["labels"].get("alertname", ""))):
        labels = a["labels"]
        if labels.get("model") not in models:
            continue
        summary = (a.get("annotations") or {}).get("summary", "")
        lines.append(f"{labels['alertname']:<32} {labels.get('severity', ''):<9} {summary}")
    return "\n".join(lines) or f"(none firing after {wait_s:.0f}s; see {prometheus}/classic/alerts)"


def ctl_step(stack: TourStack, *args: str) -> str:
    llmgw = str(venv_root() / "bin" / "llmgw")
    env = {**os.environ, **stack.addr.env(), "COLUMNS": "120", "NO_COLOR": "1"}
    out = subprocess.run([llmgw, "ctl", *args], capture_output=True, text=True, env=env, timeout=60)
    return (out.stdout + out.stderr).rstrip()


def show_tour(stack: TourStack, models: dict[str, dict[str, Any]]) -> None:
    a = stack.addr
    gemma = "Gemma 3 270M (a base model: fluent rather than helpful)"
    if not stack.gemma_is_real:
        gemma = "a tiny generated model standing in for Gemma (random weights, so random text)"
    _print()
    _print("=" * 100)
    _print("llmgw dev stack: a five-minute tour")
    _print("=" * 100)
    _print(f"\n1. {gemma}, through the router, with the openai SDK:\n")
    _print(
        _indent(
            "from openai import OpenAI\n"
            f'client = OpenAI(base_url="{a.router}/v1", api_key="{a.api_key or ANY_KEY}")\n'
            f'client.completions.create(model="gemma-3-270m", prompt="{PROMPT}", max_tokens=32)'
        )
    )
    try:
        _print(f"\n    -> {_one_line(PROMPT + openai_step(a.router, api_key=a.api_key))}")
    except openai.APIError as exc:
        _print(f"\n    -> error: {exc}")

    _print("\n2. The same model with curl:\n")
    _print(_indent(shlex.join(curl_command(a.router, a.api_key))))
    _print(f"\n    -> {_one_line(curl_step(a.router, a.api_key))}")

    _print(f"\n3. The same weights as one replica over two nodes of one fabric ({SPLIT}): llama-server on")
    _print("   one node, its layers spread to a ggml-rpc-server shard on the other, over RPC:\n")
    try:
        _print(f"    -> {_one_line(PROMPT + openai_step(a.router, SPLIT, a.api_key))}")
    except openai.APIError as exc:
        _print(f"    -> error: {exc}")
    _print(
        "\n   Every replica; the split one is one row, its leader's, with its fabric and shard (ctl replicas):\n"
    )
    _print(_indent(ctl_step(stack, "replicas")))

    _print("\n4. The two incidents, replayed. Each model against what it should have now:\n")
    _print(_indent(ctl_step(stack, "status")))
    _print("\n   A request for a parked or unplaceable model is refused at once, with why:\n")
    for model in ("kev-0.5b", "phi-4"):
        _print(f"    {model}: {refusal_step(a.router, model, a.api_key)}")
    _print(f"\n   And the alerts that fire for them, from Prometheus's API ({a.prometheus}/api/v1/alerts):\n")
    _print(_indent(alerts_step(a.prometheus)))

    _print("\n5. Where to look:\n")
    _print(f"    Consul UI          {a.consul}/ui/dc1/services/llmgw-model (each model, with its health)")
    _print(f"    watcher metrics    {a.admin}/metrics   (llmgw_model_parked, llmgw_model_unplaceable, ...)")
    _print(f"    router metrics     {a.router}/metrics")
    _print(f"    Prometheus         {a.prometheus}/classic/alerts (the alerts; targets found in Consul)")
    _print(f"    admin API          {a.admin}/v1/admin/summary")
    _print(f"    Nomad API          {a.nomad}/v1/jobs")
    _print(f"    logs               {stack.logs} (Consul, Nomad, Prometheus)")
    if stack.nomad_is_standin:
        _print(
            f"                       {stack.dir / 'nomad' / 'alloc'}/<alloc-id>/alloc/logs (watchers, router, engines)"
        )

    _print("\n6. Use it from another shell:\n")
    env_file = stack.dir / "env"
    _print(_indent("\n".join(f"export {k}={v}" for k, v in a.env().items())))
    _print(f"\n   (or: source {env_file}), then try:\n")
    # With --acl the router asks for a key; .devstack/env has it as OPENAI_API_KEY.
    auth = ' -H "Authorization: Bearer $OPENAI_API_KEY"' if a.api_key else ""
    _print(
        _indent(
            f"llmgw plan {stack.models_file}  # nothing to do: what is applied is what runs\n"
            "llmgw ctl status                 # the table above\n"
            "llmgw ctl replicas               # every replica; the split one with its shard\n"
            "llmgw ctl summary                # the fleet: nodes, GPUs by class, parked, unplaceable\n"
            "llmgw ctl models kev-0.5b        # one model in full, with its last error\n"
            f"curl -s $LLMGW_ROUTER_URL/v1/models{auth}\n"
            "curl -s $LLMGW_ADMIN_ADDR/metrics | grep '^llmgw_model_'\n"
            "curl -s $PROMETHEUS_ADDR/api/v1/alerts   # the firing alerts, as Prometheus sees them\n"
            "# the on-demand copy starts on its first request (and stops after 2 idle minutes):\n"
            f"curl -s $LLMGW_ROUTER_URL/v1/completions{auth} -H 'Content-Type: application/json' \\\n"
            '  -d \'{"model": "gemma-3-270m-on-demand", "prompt": "Once upon a time", "max_tokens": 24}\'\n'
            "llmgw ctl retry kev-0.5b         # place it again: five more failures, parked again"
        )
    )
    _print("=" * 100)
    del models
