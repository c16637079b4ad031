"""The watcher: the control loop that watches Consul and Nomad, reconciles, parks, places, leads,
acts, reports and serves the admin API. Imports the root only; never cli, node_agent or router."""
