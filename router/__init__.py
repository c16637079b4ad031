"""The request path: the OpenAI-compatible router. From nomad_driver it may import only the root's
contracts and shared parts (spec, state, consul, blocking, placement, safeload, endpoint, certs, logs)."""
