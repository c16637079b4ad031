# The one address clients use: several stateless routers behind whatever load balancer fronts
# the service llmgw-router. Each keeps its own snapshot of Consul, so any of them can answer.

variable "llmgw_version" {
  type        = string
  description = "llmgw release to run; the image tag."
  default     = "0.1.0"
}

variable "image" {
  type        = string
  description = "Container image with llmgw installed."
  default     = "llmgw"
}

variable "datacenters" {
  type        = list(string)
  description = "Datacenters the routers may run in."
  default     = ["*"]
}

variable "node_pool" {
  type        = string
  description = "Node pool for llmgw's own services."
  default     = "default"
}

variable "router_count" {
  type        = number
  description = "Number of router instances."
  default     = 3
}

variable "port" {
  type        = number
  description = "Static port the routers listen on (clients and load balancers need a fixed one)."
  default     = 8080
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API as seen from the task (https://... where it requires TLS); empty: the Consul agent on the task's node over http."
  default     = ""
}

variable "tls_dir" {
  type        = string
  description = "Directory on every node holding the CA and client certificates below, mounted read-only at the same path (the default, the system's CA directory, holds none of llmgw's)."
  default     = "/etc/ssl/certs"
}

variable "consul_cacert" {
  type        = string
  description = "CA certificate that signed Consul's HTTPS certificate (a path under tls_dir); empty: the system's CAs."
  default     = ""
}

variable "consul_client_cert" {
  type        = string
  description = "Client certificate for Consul's mutual TLS (a path under tls_dir); empty: none."
  default     = ""
}

variable "consul_client_key" {
  type        = string
  description = "Private key of consul_client_cert (a path under tls_dir)."
  default     = ""
}

job "llmgw-router" {
  type        = "service"
  datacenters = var.datacenters
  node_pool   = var.node_pool

  meta {
    llmgw_version = var.llmgw_version
  }

  group "router" {
    count = var.router_count

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    network {
      port "http" {
        static = var.port
        to     = 8080
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
        interval = "5s"
        timeout  = "2s"
      }
    }

    # Replace one router at a time, and only once the new one passes its check, so clients
    # never see all routers restarting together.
    update {
      max_parallel     = 1
      health_check     = "checks"
      min_healthy_time = "10s"
      healthy_deadline = "2m"
      auto_revert      = true
    }

    task "router" {
      driver = "docker"

      config {
        image = "${var.image}:${var.llmgw_version}"
        args  = ["router", "--listen", "0.0.0.0:8080"]
        ports = ["http"]
        # The CA and client certificates for Consul, when its API requires TLS.
        volumes = ["${var.tls_dir}:${var.tls_dir}:ro"]
      }

      template {
        destination = "${NOMAD_SECRETS_DIR}/tokens.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
          {{- with nomadVar "nomad/jobs/llmgw-router" -}}
          CONSUL_HTTP_TOKEN={{ .consul_token }}
          LLMGW_API_KEYS={{ .api_keys }}
          {{- end }}
        EOT
      }

      env {
        CONSUL_HTTP_ADDR = coalesce(var.consul_addr, "${attr.unique.network.ip-address}:8500")
        CONSUL_CACERT      = var.consul_cacert
        CONSUL_CLIENT_CERT = var.consul_client_cert
        CONSUL_CLIENT_KEY  = var.consul_client_key
      }

      resources {
        cpu    = 1000
        memory = 512
      }
    }
  }
}
