"""llmgw's control plane. The root holds the contracts and clients every room shares (definitions,
rendering, KV state, node meta, the Nomad and Consul clients, the watch loop); it imports no room."""
