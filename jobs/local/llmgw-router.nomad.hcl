# Development variant of llmgw-router.nomad.hcl: runs llmgw from a local virtualenv through
# raw_exec. For the dev stack and tests only.

variable "venv" {
  type        = string
  description = "Virtualenv with llmgw installed (its bin/llmgw is run)."
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API."
}

variable "port" {
  type        = number
  description = "Port the router listens on."
  default     = 8080
}

variable "consul_cacert" {
  type        = string
  description = "CONSUL_CACERT: the CA of Consul's HTTPS certificate (python -m devstack up --tls); empty: the system's CAs."
  default     = ""
}

variable "consul_token" {
  type        = string
  description = "CONSUL_HTTP_TOKEN: the router's token where Consul's ACLs are on (python -m devstack up --acl); empty: none."
  default     = ""
}

variable "api_keys" {
  type        = string
  description = "LLMGW_API_KEYS: the keys clients send as Bearer tokens, comma-separated; empty: none asked."
  default     = ""
}

variable "node_pool" {
  type        = string
  description = "Node pool for llmgw's own services: not the GPU pool the models run in."
  default     = "default"
}

job "llmgw-router" {
  type        = "service"
  datacenters = ["*"]
  node_pool   = var.node_pool

  group "router" {
    count = 1

    network {
      port "http" {
        static = var.port
      }
    }

    service {
      name = "llmgw-router"
      port = "http"
      # Prometheus finds its targets by the metrics tag (jobs/prometheus/prometheus.yml).
      tags = ["llmgw", "metrics"]

      check {
        type     = "http"
        path     = "/healthz"
        interval = "2s"
        timeout  = "1s"
      }
    }

    task "router" {
      driver = "raw_exec"

      config {
        command = "${var.venv}/bin/llmgw"
        args    = ["router", "--listen", "127.0.0.1:${NOMAD_PORT_http}"]
      }

      env {
        CONSUL_HTTP_ADDR  = var.consul_addr
        CONSUL_HTTP_TOKEN = var.consul_token
        CONSUL_CACERT     = var.consul_cacert
        LLMGW_API_KEYS    = var.api_keys
      }

      resources {
        cpu    = 500
        memory = 256
      }
    }
  }
}
