# llmgw's control plane: two watchers, one of which leads through a Consul session lock on
# llmgw/leader. The follower serves the admin API read-only and takes over within the session
# TTL if the leader dies, so a lost node does not stop parking and placement reporting.

variable "llmgw_version" {
  type        = string
  description = "llmgw release to run; the image tag."
  default     = "0.1.0"
}

variable "image" {
  type        = string
  description = "Container image with llmgw installed (see docs/operating.md to build it)."
  default     = "llmgw"
}

variable "datacenters" {
  type        = list(string)
  description = "Datacenters the watchers may run in."
  default     = ["*"]
}

variable "node_pool" {
  type        = string
  description = "Node pool for llmgw's own services (not the GPU pool)."
  default     = "default"
}

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API as seen from the task (https://... where it requires TLS); empty: the Nomad agent on the task's node over http."
  default     = ""
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API as seen from the task (https://... where it requires TLS); empty: the Consul agent on the task's node over http."
  default     = ""
}

variable "max_start_failures" {
  type        = number
  description = "Consecutive start failures after which a model is parked."
  default     = 5
}

variable "models_namespace" {
  type        = string
  description = "Nomad namespace of the model jobs (NOMAD_NAMESPACE for llmgw): where the watcher registers and scales them."
  default     = "default"
}

variable "tls_dir" {
  type        = string
  description = "Directory on every node holding the CA and client certificates below, mounted read-only at the same path (the default, the system's CA directory, holds none of llmgw's)."
  default     = "/etc/ssl/certs"
}

variable "nomad_cacert" {
  type        = string
  description = "CA certificate that signed Nomad's HTTPS certificate (a path under tls_dir); empty: the system's CAs."
  default     = ""
}

variable "nomad_client_cert" {
  type        = string
  description = "Client certificate for Nomad's mutual TLS (a path under tls_dir); empty: none."
  default     = ""
}

variable "nomad_client_key" {
  type        = string
  description = "Private key of nomad_client_cert (a path under tls_dir)."
  default     = ""
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

job "llmgw-watcher" {
  type        = "service"
  datacenters = var.datacenters
  node_pool   = var.node_pool

  meta {
    llmgw_version = var.llmgw_version
  }

  group "watcher" {
    count = 2

    # Two watchers on one host would die together, which is the failure the second one is for.
    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    network {
      port "admin" {
        to = 4700
      }
    }

    service {
      name = "llmgw-watcher"
      port = "admin"
      # Prometheus finds its targets by the metrics tag (jobs/prometheus/prometheus.yml).
      tags = ["llmgw", "metrics"]

      check {
        type     = "http"
        path     = "/healthz"
        interval = "10s"
        timeout  = "2s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "10s"
      mode     = "delay"
    }

    task "watcher" {
      driver = "docker"

      config {
        image = "${var.image}:${var.llmgw_version}"
        args  = ["watcher", "--listen", "0.0.0.0:4700", "--max-start-failures", "${var.max_start_failures}"]
        ports = ["admin"]
        # The CA and client certificates for Nomad and Consul, when their APIs require TLS.
        volumes = ["${var.tls_dir}:${var.tls_dir}:ro"]
      }

      # Tokens never appear in the jobspec: they live in a Nomad Variable that only this job's
      # workload identity can read (nomad/jobs/<job> is readable by the job by default).
      template {
        destination = "${NOMAD_SECRETS_DIR}/tokens.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
          {{- with nomadVar "nomad/jobs/llmgw-watcher" -}}
          NOMAD_TOKEN={{ .nomad_token }}
          CONSUL_HTTP_TOKEN={{ .consul_token }}
          LLMGW_ADMIN_TOKEN={{ .admin_token }}
          {{- end }}
        EOT
      }

      env {
        NOMAD_ADDR       = coalesce(var.nomad_addr, "http://${attr.unique.network.ip-address}:4646")
        CONSUL_HTTP_ADDR = coalesce(var.consul_addr, "${attr.unique.network.ip-address}:8500")
        # The leader's address as others reach it (the host's port, not the container's
        # 0.0.0.0:4700), so a follower can send `llmgw ctl retry` on to it.
        LLMGW_ADMIN_ADVERTISE = "${NOMAD_ADDR_admin}"
        NOMAD_NAMESPACE   = var.models_namespace
        NOMAD_CACERT      = var.nomad_cacert
        NOMAD_CLIENT_CERT = var.nomad_client_cert
        NOMAD_CLIENT_KEY  = var.nomad_client_key
        CONSUL_CACERT      = var.consul_cacert
        CONSUL_CLIENT_CERT = var.consul_client_cert
        CONSUL_CLIENT_KEY  = var.consul_client_key
      }

      resources {
        cpu    = 200
        # About 250 MB resident at 1,000 models (docs/capacity.md): 256 would leave no room.
        memory = 512
      }
    }
  }
}
