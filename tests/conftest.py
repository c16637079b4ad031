"""Fixtures for the real parts live in tests/fixtures/, one module per part, so each can grow
without the others: consul.py (a Consul dev agent), engines.py (tiny GGUF files and llama.cpp
servers), nomad.py (the Nomad stand-in)."""

pytest_plugins = [
    "tests.fixtures.consul",
    "tests.fixtures.engines",
    "tests.fixtures.llama_cpp",
    "tests.fixtures.nomad",
]
