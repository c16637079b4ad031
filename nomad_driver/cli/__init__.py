"""The `llmgw` command: the one room allowed to know both the watcher and the router. It may import
every room of nomad_driver and router; no other room imports nomad_driver.cli."""


def main() -> None:
    """The console script. The verbs load only now, so importing a single CLI module stays cheap."""
    from nomad_driver.cli.app import main as run

    run()
