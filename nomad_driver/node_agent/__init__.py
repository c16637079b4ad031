"""What runs on each GPU node: reads the GPUs and installed engines and publishes them as node
metadata. Imports the root contracts and clients only; never the watcher, cli or router."""
