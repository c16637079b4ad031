"""What the watcher's admin API and its callers (`llmgw ctl`, `llmgw watcher`) agree on, kept at
the root so the CLI can name it without loading the watcher's server."""

# The bearer token that guards the admin API's writes, read by the server and by its clients.
TOKEN_ENV = "LLMGW_ADMIN_TOKEN"
