"""Exercise the node agent's real NVML path on a machine with a GPU, and print what it found.

    .venv/bin/python bench/gpu_check.py [--engines-dir DIR] [--models-dir DIR] [--seconds N]

It reads the GPUs once, waits for Xid events for a few seconds, reads again, and prints each
GPU, the node metadata the agent would publish and the agent's metrics. It changes nothing on
the machine and talks to no Nomad. Exit status 0 when NVML answered, 2 when it did not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prometheus_client import generate_latest

from nomad_driver.node_agent.agent import NodeAgent, NodeAgentConfig, build_meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines-dir", type=Path, default=Path("/opt/llmgw/engines"))
    parser.add_argument("--models-dir", type=Path, default=Path("/opt/llmgw/models"))
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to collect Xid events")
    args = parser.parse_args()

    agent = NodeAgent(NodeAgentConfig(engines_dir=args.engines_dir, models_dir=args.models_dir))
    first = agent.inventory()
    if first.gpus is None:
        print("NVML did not answer: no driver, no library or no GPU (see the warning above)")
        print(json.dumps(build_meta(first, agent.config), indent=2))
        return 2
    started = time.perf_counter()
    time.sleep(args.seconds)
    inventory = agent.inventory()
    read_s = time.perf_counter() - started - args.seconds
    agent.metrics.update(inventory)
    for gpu in inventory.gpus or []:
        state = "healthy" if gpu.healthy else "UNHEALTHY: " + "; ".join(gpu.unhealthy_reasons)
        print(
            f"GPU {gpu.index} {gpu.uuid} {gpu.name}: {gpu.memory_used_mib}/{gpu.memory_total_mib} MiB, "
            f"util {gpu.utilization_pct}%, {gpu.temperature_c} C, ECC uncorrected {gpu.ecc_uncorrected} "
            f"corrected {gpu.ecc_corrected}, retired pages {gpu.retired_pages} "
            f"(pending {gpu.retired_pages_pending}), Xids {gpu.xids or 'none'}: {state}"
        )
    print(f"one reading of {len(inventory.gpus or [])} GPUs took {read_s * 1000:.1f} ms")
    print("node metadata the agent would publish:")
    print(json.dumps(build_meta(inventory, agent.config), indent=2))
    print("metrics:")
    print(generate_latest(agent.registry).decode())
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
