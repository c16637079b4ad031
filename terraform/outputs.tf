output "router_service_name" {
  description = "Consul service the routers register; point a load balancer or DNS (llmgw-router.service.consul) at it."
  value       = "llmgw-router"
}

output "router_port" {
  description = "Static port the routers listen on, on every host that runs one."
  value       = var.router_port
}

output "watcher_service_name" {
  description = "Consul service of the watchers' admin API and metrics; set LLMGW_ADMIN_ADDR to one of its instances for llmgw ctl."
  value       = "llmgw-watcher"
}

output "job_ids" {
  description = "Nomad job IDs of llmgw's own services."
  value       = local.job_ids
}

output "models_key" {
  description = "Consul KV key holding the model definitions."
  value       = local.models_key
}

output "nomad_token_accessor_ids" {
  description = "Accessor IDs (not secrets) of the Nomad tokens, to find or revoke them with `nomad acl token info`."
  value = {
    watcher    = nomad_acl_token.watcher.accessor_id
    node_agent = nomad_acl_token.node_agent.accessor_id
  }
}

output "consul_token_accessor_ids" {
  description = "Accessor IDs (not secrets) of the Consul tokens, to find or revoke them with `consul acl token read`."
  value = {
    watcher = consul_acl_token.watcher.accessor_id
    router  = consul_acl_token.router.accessor_id
  }
}

output "admin_token" {
  description = "Bearer token for the watcher's admin API (LLMGW_ADMIN_TOKEN for llmgw ctl); read it with `terraform output -raw admin_token`."
  value       = local.admin_token
  sensitive   = true
}

output "operator_policy_names" {
  description = "The policies to attach to the tokens of the people who run `llmgw apply` (read and register the model jobs, store the definitions)."
  value = {
    nomad  = nomad_acl_policy.operator.name
    consul = consul_acl_policy.operator.name
  }
}
