"""`llmgw fetch`: the download of a model's weights into the node's cache, which llmgw owns
instead of Nomad's `artifact` block (go-getter). See docs/models.md, "Weights and the cache"."""
