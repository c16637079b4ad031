terraform {
  required_version = ">= 1.3.0" # optional(type, default) in variables.tf

  required_providers {
    # 2.0 is the first release with nomad_variable and the hcl2 `vars` map as used here.
    nomad = {
      source  = "hashicorp/nomad"
      version = ">= 2.0.0"
    }
    # consul_acl_token_secret_id and the non-legacy ACL resources.
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
