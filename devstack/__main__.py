"""`python -m devstack up|down`: the single-machine llmgw stack for demos, development and tests.

    python -m devstack up [--tiny] [--state-dir DIR] [--services nomad|process] [--no-tour] [--alert-for 20s]
                          [--acl] [--tls] [--s3] [--no-models]
    python -m devstack down [--state-dir DIR]

`up` stays in the foreground until Ctrl-C (or `down` from another shell) and then stops every
process it started. `--tiny` (or LLMGW_DEVSTACK_TINY=1) serves a tiny generated GGUF instead of
downloading Gemma, which is what the tests use.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from devstack import stack


def _duration(text: str) -> str:
    try:
        stack.prom.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devstack", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    state_help = "where state, logs and generated files live (env LLMGW_DEVSTACK_DIR; default .devstack)"
    default_dir = Path(os.environ.get("LLMGW_DEVSTACK_DIR") or stack.DEFAULT_STATE_DIR)

    up = verbs.add_parser("up", help="start Consul, Nomad, two watchers, a router and the demo models")
    up.add_argument("--state-dir", type=Path, default=default_dir, help=state_help)
    up.add_argument(
        "--tiny",
        action="store_true",
        default=os.environ.get("LLMGW_DEVSTACK_TINY", "") not in ("", "0", "false"),
        help="serve a tiny generated GGUF instead of Gemma 3 270M (nothing is downloaded)",
    )
    up.add_argument("--nodes", type=Path, default=stack.fleet.DEMO_FLEET, help="the simulated fleet (YAML)")
    up.add_argument(
        "--models", type=Path, default=stack.demo_models.TEMPLATE, help="models template (demo-models.yaml)"
    )
    up.add_argument(
        "--services",
        choices=["nomad", "process"],
        default="nomad",
        help="run the watchers and the router as Nomad jobs (jobs/local) or as child processes",
    )
    up.add_argument(
        "--nomad",
        choices=["auto", "standin", "real"],
        default="auto",
        help="a real 'nomad agent -dev' when on PATH (auto), or always the stand-in",
    )
    up.add_argument(
        "--clock-speed",
        type=float,
        default=4.0,
        help="the stand-in runs Nomad's restart and reschedule delays this many times faster",
    )
    up.add_argument("--watchers", type=int, default=2)
    up.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the demo models")
    up.add_argument("--no-tour", action="store_true", help="skip the tour (the tests do)")
    up.add_argument(
        "--acl",
        action="store_true",
        default=os.environ.get("LLMGW_DEVSTACK_ACL", "") not in ("", "0", "false"),
        help="Nomad's and Consul's ACLs on (the stand-in's --acl-bootstrap-token, Consul deny by default): "
        "llmgw runs on the tokens of docs/policies/llmgw-*.hcl, and NOMAD_TOKEN and CONSUL_HTTP_TOKEN "
        "are the operator's (env LLMGW_DEVSTACK_ACL=1)",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        default=os.environ.get("LLMGW_DEVSTACK_TLS", "") not in ("", "0", "false"),
        help="Nomad's API over HTTPS with a certificate of only the names 'nomad tls cert create' gives; "
        "NOMAD_CACERT names its CA (env LLMGW_DEVSTACK_TLS=1)",
    )
    up.add_argument(
        "--s3",
        action="store_true",
        default=os.environ.get("LLMGW_DEVSTACK_S3", "") not in ("", "0", "false"),
        help="also serve tiny-s3, whose weights llmgw fetches from a local S3 server (moto) that enforces "
        "credentials, with the keys in the model's Nomad Variable (env LLMGW_DEVSTACK_S3=1)",
    )
    up.add_argument(
        "--no-models",
        action="store_true",
        help="apply no models and wait for none: the cluster as docs/getting-started.md has it before step 4",
    )
    up.add_argument(
        "--alert-for",
        type=_duration,
        default=stack.prom.DEFAULT_ALERT_FOR,
        help="cut the alert rules' for: durations to this in the dev stack's copy (a Prometheus duration)",
    )

    down = verbs.add_parser("down", help="stop everything a running 'devstack up' started")
    down.add_argument("--state-dir", type=Path, default=default_dir, help=state_help)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.verb == "down":
        return stack.run_down(args.state_dir)
    options = stack.UpOptions(
        state_dir=args.state_dir,
        tiny=args.tiny,
        nodes=args.nodes,
        template=args.models,
        services=args.services,
        nomad=args.nomad,
        clock_speed=args.clock_speed,
        watchers=args.watchers,
        wait_timeout=args.wait,
        tour=not args.no_tour,
        alert_for=args.alert_for,
        acl=args.acl,
        apply_models=not args.no_models,
        tls=args.tls,
        s3=args.s3,
    )
    return stack.run_up(options)


if __name__ == "__main__":
    sys.exit(main())
