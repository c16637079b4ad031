"""How a replica leaves: out of rotation first, then stopped.

Nomad stops a model job's allocation (a scale-down, `nomad job stop`, a node drain, a
reschedule) by taking the group's services out of Consul, waiting the group's
`shutdown_delay`, and only then signalling the engine (`client/allocrunner/groupservice_hook.go`,
`preKillLocked`). Every router watches those services and drops the replica the moment its
entry goes, so the delay is the time the requests already on the engine have to finish.
"""

from __future__ import annotations

SECOND = 1_000_000_000

# Long enough for what a router sent in the instant before it saw the entry go (its blocking
# query returns within milliseconds of the deregistration) to finish as an ordinary answer: a
# few hundred tokens at 20-50 tokens a second. Not longer, because until it ends the stopped
# replica holds its node's memory and GPUs while Nomad already counts them free, so a replica
# placed there next may find the GPU still full. llama-server cuts what is still running at the
# signal; uvicorn-based engines (vLLM, llama-cpp-python) finish it within `KillTimeout` (30 s).
SHUTDOWN_DELAY = 15 * SECOND
