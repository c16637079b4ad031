"""The request path: the OpenAI-compatible router. It may import the root of nomad_driver (the
contracts and clients), never its watcher, cli or node_agent rooms."""
