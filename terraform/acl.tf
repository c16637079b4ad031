# Least-privilege ACLs, one policy and one token per component and system. What each rule is for
# is listed call by call in tests/acl_table.py, and tests/test_terraform.py checks these rules
# against that table: a call the code makes that no rule allows, or a rule no call needs, fails it.
# Keep the rules literal (no interpolation but the models' namespace) so the test can read them.

# --- Nomad -------------------------------------------------------------------------------------

resource "nomad_acl_policy" "watcher" {
  name        = "llmgw-watcher"
  description = "llmgw watcher: registers and scales the model jobs, reads their allocations, evaluations and engine logs, and reads nodes."

  rules_hcl = <<-EOT
    namespace "${var.models_namespace}" {
      capabilities = ["list-jobs", "read-job", "submit-job", "read-logs"]
    }

    node {
      policy = "read"
    }
  EOT
}

resource "nomad_acl_policy" "node_agent" {
  name        = "llmgw-node-agent"
  description = "llmgw node agent: publishes GPU health, engine versions and cached weights as dynamic node metadata."

  # /v1/client/metadata takes node:write for an update; there is no narrower grant for it.
  rules_hcl = <<-EOT
    node {
      policy = "write"
    }
  EOT
}

# For the people who run `llmgw apply`: attach it to their own tokens
# (`nomad acl token create -policy llmgw-operator ...`). No token is made for it here.
resource "nomad_acl_policy" "operator" {
  name        = "llmgw-operator"
  description = "llmgw plan and apply: lists and reads the model jobs, plans and registers the new or changed ones, reads the nodes' GPUs."

  rules_hcl = <<-EOT
    namespace "${var.models_namespace}" {
      capabilities = ["list-jobs", "read-job", "submit-job"]
    }
    node {
      policy = "read"
    }
  EOT
}

resource "nomad_acl_token" "watcher" {
  name     = "llmgw-watcher"
  type     = "client"
  policies = [nomad_acl_policy.watcher.name]
}

# No Nomad token for the routers: they ask the leading watcher (through Consul) to scale.

resource "nomad_acl_token" "node_agent" {
  name     = "llmgw-node-agent"
  type     = "client"
  policies = [nomad_acl_policy.node_agent.name]
}

# --- Consul ------------------------------------------------------------------------------------
# Health and catalog answers are filtered by node:read as well as service:read, so a token that
# can read llmgw-engine but no nodes sees no replicas at all, not an error.

resource "consul_acl_policy" "watcher" {
  name        = "llmgw-watcher"
  description = "llmgw watcher: model state and the leader lock in KV, its session, the llmgw-models catalog node, and engine health."

  rules = <<-EOT
    key_prefix "llmgw/" {
      policy = "write"
    }

    session_prefix "" {
      policy = "write"
    }

    node "llmgw-models" {
      policy = "write"
    }

    service "llmgw-model" {
      policy = "write"
    }

    service "llmgw-engine" {
      policy = "read"
    }

    node_prefix "" {
      policy = "read"
    }
  EOT
}

resource "consul_acl_policy" "router" {
  name        = "llmgw-router"
  description = "llmgw router: reads model definitions, model state and engine health; writes only activity timestamps and its requests in flight."

  # Not all of llmgw/: the router has no business reading the leader lock. `list`, not `read`:
  # the router reads state recursively, which Consul refuses to `read` alone where
  # acl.enable_key_list_policy is on; `list` still allows no writes.
  rules = <<-EOT
    key_prefix "llmgw/state/" {
      policy = "list"
    }

    key_prefix "llmgw/config/" {
      policy = "list"
    }

    key_prefix "llmgw/activity/" {
      policy = "write"
    }

    key_prefix "llmgw/inflight/" {
      policy = "write"
    }

    service "llmgw-engine" {
      policy = "read"
    }

    node_prefix "" {
      policy = "read"
    }
  EOT
}

# For the people who run `llmgw apply`, as the Nomad one above: only the definitions key.
resource "consul_acl_policy" "operator" {
  name        = "llmgw-operator"
  description = "llmgw apply: stores the model definitions with check-and-set."

  rules = <<-EOT
    key_prefix "llmgw/config/" {
      policy = "write"
    }
  EOT
}

# Local tokens: each datacenter's llmgw talks to its own Consul, and a local token keeps working
# while the primary datacenter is unreachable.
resource "consul_acl_token" "watcher" {
  description = "llmgw-watcher"
  policies    = [consul_acl_policy.watcher.name]
  local       = true
}

resource "consul_acl_token" "router" {
  description = "llmgw-router"
  policies    = [consul_acl_policy.router.name]
  local       = true
}

data "consul_acl_token_secret_id" "watcher" {
  accessor_id = consul_acl_token.watcher.accessor_id
}

data "consul_acl_token_secret_id" "router" {
  accessor_id = consul_acl_token.router.accessor_id
}
