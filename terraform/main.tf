# llmgw on an existing Nomad + Consul cluster: its three jobs, the model definitions in Consul KV,
# and each job's tokens in the Nomad Variable its template reads (nomad/jobs/<job>).

locals {
  # The jobspecs are the same files `nomad job run` takes; the module passes only their variables.
  jobs_dir = "${path.module}/../jobs"

  # Job IDs are fixed in the jobspecs, and the Variables must sit at nomad/jobs/<job ID>: that is
  # the path a job's workload identity may read without any policy.
  job_ids = {
    watcher    = "llmgw-watcher"
    router     = "llmgw-router"
    node_agent = "llmgw-node-agent"
  }

  models_key = "llmgw/config/models"

  admin_token = var.admin_token != null ? var.admin_token : random_password.admin_token.result
}

# Always created, used only when no admin_token is given: a count on a sensitive value is refused.
resource "random_password" "admin_token" {
  length  = 40
  special = false
}

# --- Model definitions ---------------------------------------------------------------------------

# consul_keys, not consul_key_prefix: the prefix llmgw/ also holds the watcher's state and the
# routers' activity, which a prefix resource would delete as drift.
resource "consul_keys" "models" {
  key {
    path   = local.models_key
    value  = file(var.models_file)
    delete = true
  }
}

# --- Tokens for the jobs ---------------------------------------------------------------------------

resource "nomad_variable" "watcher" {
  path = "nomad/jobs/${local.job_ids.watcher}"
  items = {
    nomad_token  = nomad_acl_token.watcher.secret_id
    consul_token = data.consul_acl_token_secret_id.watcher.secret_id
    admin_token  = local.admin_token
  }
}

resource "nomad_variable" "router" {
  path = "nomad/jobs/${local.job_ids.router}"
  items = {
    consul_token = data.consul_acl_token_secret_id.router.secret_id
    api_keys     = join(",", var.api_keys)
  }
}

resource "nomad_variable" "node_agent" {
  path = "nomad/jobs/${local.job_ids.node_agent}"
  items = {
    nomad_token = nomad_acl_token.node_agent.secret_id
  }
}

# --- Jobs ----------------------------------------------------------------------------------------
# Each job waits for its Variable: a task whose template finds no Variable starts without tokens
# and fails its first call with a 403 instead of saying what is missing.
#
# hcl2 vars are strings: Nomad parses a list-typed one from its HCL text and takes a string-typed
# one literally. Every key must be declared in the jobspec, or Nomad refuses the job.

resource "nomad_job" "watcher" {
  jobspec = file("${local.jobs_dir}/llmgw-watcher.nomad.hcl")

  hcl2 {
    vars = {
      llmgw_version          = var.llmgw_version
      image                  = var.image
      datacenters            = jsonencode(var.datacenters)
      node_pool              = var.node_pool
      nomad_addr             = var.nomad_addr
      consul_addr            = var.consul_addr
      max_start_failures     = tostring(var.max_start_failures)
      models_namespace       = var.models_namespace
      tls_dir                = var.tls.dir
      nomad_cacert           = var.tls.nomad_cacert
      nomad_client_cert      = var.tls.nomad_client_cert
      nomad_client_key       = var.tls.nomad_client_key
      consul_cacert          = var.tls.consul_cacert
      consul_client_cert     = var.tls.consul_client_cert
      consul_client_key      = var.tls.consul_client_key
      nomad_tls_server_name  = var.tls.nomad_tls_server_name
      consul_tls_server_name = var.tls.consul_tls_server_name
    }
  }

  depends_on = [nomad_variable.watcher, consul_keys.models]
}

resource "nomad_job" "router" {
  jobspec = file("${local.jobs_dir}/llmgw-router.nomad.hcl")

  hcl2 {
    vars = {
      llmgw_version          = var.llmgw_version
      image                  = var.image
      datacenters            = jsonencode(var.datacenters)
      node_pool              = var.node_pool
      consul_addr            = var.consul_addr
      router_count           = tostring(var.router_count)
      port                   = tostring(var.router_port)
      tls_dir                = var.tls.dir
      consul_cacert          = var.tls.consul_cacert
      consul_client_cert     = var.tls.consul_client_cert
      consul_client_key      = var.tls.consul_client_key
      consul_tls_server_name = var.tls.consul_tls_server_name
    }
  }

  depends_on = [nomad_variable.router]
}

resource "nomad_job" "node_agent" {
  jobspec = file("${local.jobs_dir}/llmgw-node-agent.nomad.hcl")

  hcl2 {
    vars = {
      llmgw_version         = var.llmgw_version
      image                 = var.image
      datacenters           = jsonencode(var.datacenters)
      gpu_node_pool         = var.gpu_node_pool
      engines_dir           = var.engines_dir
      models_dir            = var.models_dir
      nomad_addr            = var.node_nomad_addr
      tls_dir               = var.tls.dir
      nomad_cacert          = var.tls.nomad_cacert
      nomad_client_cert     = var.tls.nomad_client_cert
      nomad_client_key      = var.tls.nomad_client_key
      nomad_tls_server_name = var.tls.nomad_tls_server_name
    }
  }

  depends_on = [nomad_variable.node_agent]
}
