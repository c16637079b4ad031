# The smallest root module that runs llmgw: the providers find the cluster as the CLIs do, from
# NOMAD_ADDR, NOMAD_TOKEN, CONSUL_HTTP_ADDR and CONSUL_HTTP_TOKEN in the environment (an
# `address` here would win over the exported one), and the module.

terraform {
  required_version = ">= 1.3.0"

  required_providers {
    nomad = {
      source  = "hashicorp/nomad"
      version = ">= 2.0.0"
    }
    consul = {
      source  = "hashicorp/consul"
      version = ">= 2.16.0"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.1.0"
    }
  }
}

variable "api_keys" {
  type        = list(string)
  description = "Bearer tokens for the routers' clients; pass them with TF_VAR_api_keys='[\"...\"]'."
  sensitive   = true
}

provider "nomad" {}

provider "consul" {}

module "llmgw" {
  source = "../.."

  llmgw_version = "0.1.0"
  image         = "registry.example.com/llmgw"
  datacenters   = ["dc1"]
  node_pool     = "default"
  gpu_node_pool = "gpu"
  models_file   = "${path.module}/models.yaml"
  router_count  = 2
  router_port   = 8080
  api_keys      = var.api_keys
}

output "router_service" {
  description = "Where clients reach llmgw: the Consul service and port of the routers."
  value       = "${module.llmgw.router_service_name}.service.consul:${module.llmgw.router_port}"
}

output "token_accessors" {
  description = "Accessor IDs of the tokens the module made, to audit or revoke them."
  value = {
    nomad  = module.llmgw.nomad_token_accessor_ids
    consul = module.llmgw.consul_token_accessor_ids
  }
}

output "admin_token" {
  description = "Token for llmgw ctl (LLMGW_ADMIN_TOKEN); `terraform output -raw admin_token`."
  value       = module.llmgw.admin_token
  sensitive   = true
}
