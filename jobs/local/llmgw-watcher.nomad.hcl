# Development variant of llmgw-watcher.nomad.hcl: runs llmgw from a local virtualenv through
# raw_exec, with tokens passed as plain variables. For the dev stack and tests only: on a real
# cluster use ../llmgw-watcher.nomad.hcl, whose tokens come from Nomad Variables.

variable "venv" {
  type        = string
  description = "Virtualenv with llmgw installed (its bin/llmgw is run)."
}

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API."
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API."
}

variable "admin_port" {
  type        = number
  description = "Base admin port; instance N listens on admin_port + N."
  default     = 4700
}

variable "watcher_count" {
  type        = number
  description = "Number of watchers (one leads)."
  default     = 2
}

variable "max_start_failures" {
  type        = number
  description = "Consecutive start failures after which a model is parked."
  default     = 5
}

variable "nomad_token" {
  type        = string
  description = "NOMAD_TOKEN: the watcher's token where Nomad's ACLs are on (python -m devstack up --acl); empty: none."
  default     = ""
}

variable "nomad_cacert" {
  type        = string
  description = "NOMAD_CACERT: the CA of Nomad's HTTPS certificate (python -m devstack up --tls); empty: the system's CAs."
  default     = ""
}

variable "consul_cacert" {
  type        = string
  description = "CONSUL_CACERT: the CA of Consul's HTTPS certificate (python -m devstack up --tls); empty: the system's CAs."
  default     = ""
}

variable "consul_token" {
  type        = string
  description = "CONSUL_HTTP_TOKEN: the watcher's token where Consul's ACLs are on (python -m devstack up --acl); empty: none."
  default     = ""
}

variable "admin_token" {
  type        = string
  description = "LLMGW_ADMIN_TOKEN: the bearer token the admin API wants for writes; empty: none."
  default     = ""
}

variable "node_pool" {
  type        = string
  description = "Node pool for llmgw's own services: not the GPU pool the models run in."
  default     = "default"
}

job "llmgw-watcher" {
  type        = "service"
  datacenters = ["*"]
  node_pool   = var.node_pool

  group "watcher" {
    count = var.watcher_count

    network {
      port "admin" {}
    }

    service {
      name = "llmgw-watcher"
      port = "admin"
      # Prometheus finds its targets by the metrics tag (jobs/prometheus/prometheus.yml).
      tags = ["llmgw", "metrics"]

      check {
        type     = "http"
        path     = "/healthz"
        interval = "2s"
        timeout  = "1s"
      }
    }

    task "watcher" {
      driver = "raw_exec"

      config {
        command = "${var.venv}/bin/llmgw"
        args    = ["watcher", "--listen", "127.0.0.1:${NOMAD_PORT_admin}", "--max-start-failures", "${var.max_start_failures}"]
      }

      env {
        NOMAD_ADDR        = var.nomad_addr
        CONSUL_HTTP_ADDR  = var.consul_addr
        NOMAD_TOKEN       = var.nomad_token
        NOMAD_CACERT      = var.nomad_cacert
        CONSUL_HTTP_TOKEN = var.consul_token
        CONSUL_CACERT     = var.consul_cacert
        LLMGW_ADMIN_TOKEN = var.admin_token
      }

      resources {
        cpu    = 200
        # About 250 MB resident at 1,000 models (docs/capacity.md): 256 would leave no room.
        memory = 512
      }
    }
  }
}
