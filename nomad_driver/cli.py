"""The `llmgw` command line. Each verb imports its module lazily, so `llmgw render` works on a
laptop with no cluster libraries in use and `llmgw --help` stays fast."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="llmgw",
    help="Serve many LLMs on a Nomad + Consul GPU cluster.",
    no_args_is_help=True,
    add_completion=False,
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
