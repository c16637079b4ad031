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

variable "admin_tls_cert" {
  type        = string
  description = "File in tls_dir: certificate for the admin API to serve HTTPS with (LLMGW_ADMIN_TLS_CERT); empty: plain HTTP."
  default     = ""
}

variable "admin_tls_key" {
  type        = string
  description = "File in tls_dir: private key of admin_tls_cert (LLMGW_ADMIN_TLS_KEY)."
  default     = ""
}

# --- Where Nomad and Consul are, and TLS to them. The same set in all three jobs, so that one
# variables file (docs/operating.md, section 9) serves each: `nomad job run` refuses a variable a
# job does not declare. The certificate variables are file names inside tls_dir.

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API as seen from the task (https://... where it requires TLS); empty: the agent on the task's node, http://127.0.0.1:4646 (the task is on the host's network)."
  default     = ""
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API as seen from the task (https://... where it requires TLS); empty: the agent on the task's node, http://127.0.0.1:8500, where a default Consul agent listens."
  default     = ""
}

variable "nomad_tls_server_name" {
  type        = string
  description = "NOMAD_TLS_SERVER_NAME: the name to verify Nomad's certificate against when nomad_addr is a name the certificate lacks (e.g. server.global.nomad); empty: the address's host."
  default     = ""
}

variable "consul_tls_server_name" {
  type        = string
  description = "CONSUL_TLS_SERVER_NAME: the name to verify Consul's certificate against when consul_addr is a name the certificate lacks (e.g. server.dc1.consul); empty: the address's host."
  default     = ""
}

variable "tls_dir" {
  type        = string
  description = "Directory on every node holding the certificate files named below, mounted read-only at /etc/llmgw/tls in the task; empty (the default): nothing is mounted."
  default     = ""
}

variable "nomad_cacert" {
  type        = string
  description = "File in tls_dir: the CA that signed Nomad's HTTPS certificate (NOMAD_CACERT); empty: the image's CAs. Unused by the router, which never calls Nomad."
  default     = ""
}

variable "nomad_client_cert" {
  type        = string
  description = "File in tls_dir: client certificate for Nomad's mutual TLS (NOMAD_CLIENT_CERT); empty: none."
  default     = ""
}

variable "nomad_client_key" {
  type        = string
  description = "File in tls_dir: private key of nomad_client_cert (NOMAD_CLIENT_KEY)."
  default     = ""
}

variable "consul_cacert" {
  type        = string
  description = "File in tls_dir: the CA that signed Consul's HTTPS certificate (CONSUL_CACERT); empty: the image's CAs. Unused by the node agent, which never calls Consul."
  default     = ""
}

variable "consul_client_cert" {
  type        = string
  description = "File in tls_dir: client certificate for Consul's mutual TLS (CONSUL_CLIENT_CERT); empty: none."
  default     = ""
}

variable "consul_client_key" {
  type        = string
  description = "File in tls_dir: private key of consul_client_cert (CONSUL_CLIENT_KEY)."
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
      port "admin" {}
    }

    service {
      name = "llmgw-watcher"
      port = "admin"
      # Prometheus finds its targets by the metrics tag (jobs/prometheus/prometheus.yml).
      tags = ["llmgw", "metrics"]

      check {
        type     = "http"
        protocol = var.admin_tls_cert == "" ? "http" : "https"
        path     = "/healthz"
        interval = "10s"
        timeout  = "2s"
        # Consul runs the check against the task's IP, which no serving certificate names; it
        # asks whether the API answers, not who it is.
        tls_skip_verify = true
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
        args  = ["watcher", "--listen", "0.0.0.0:${NOMAD_PORT_admin}", "--max-start-failures", "${var.max_start_failures}"]
        ports = ["admin"]
        # The host's network: a default Consul agent listens on 127.0.0.1 only, which a task on
        # Docker's bridge cannot reach.
        network_mode = "host"
        # The certificates, only when a directory is given, and where nothing of the image is:
        # Docker's default plugin config refuses host paths, and a mount over /etc/ssl/certs
        # would hide the image's CA bundle.
        volumes = var.tls_dir == "" ? [] : ["${var.tls_dir}:/etc/llmgw/tls:ro"]
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
        NOMAD_ADDR             = coalesce(var.nomad_addr, "http://127.0.0.1:4646")
        CONSUL_HTTP_ADDR       = coalesce(var.consul_addr, "http://127.0.0.1:8500")
        NOMAD_TLS_SERVER_NAME  = var.nomad_tls_server_name
        CONSUL_TLS_SERVER_NAME = var.consul_tls_server_name
        # The leader's address as others reach it, so a follower can send `llmgw ctl retry` on
        # to it.
        LLMGW_ADMIN_ADVERTISE = "${NOMAD_ADDR_admin}"
        NOMAD_NAMESPACE       = var.models_namespace
        NOMAD_CACERT         = var.nomad_cacert == "" ? "" : "/etc/llmgw/tls/${var.nomad_cacert}"
        NOMAD_CLIENT_CERT    = var.nomad_client_cert == "" ? "" : "/etc/llmgw/tls/${var.nomad_client_cert}"
        NOMAD_CLIENT_KEY     = var.nomad_client_key == "" ? "" : "/etc/llmgw/tls/${var.nomad_client_key}"
        CONSUL_CACERT        = var.consul_cacert == "" ? "" : "/etc/llmgw/tls/${var.consul_cacert}"
        CONSUL_CLIENT_CERT   = var.consul_client_cert == "" ? "" : "/etc/llmgw/tls/${var.consul_client_cert}"
        CONSUL_CLIENT_KEY    = var.consul_client_key == "" ? "" : "/etc/llmgw/tls/${var.consul_client_key}"
        LLMGW_ADMIN_TLS_CERT = var.admin_tls_cert == "" ? "" : "/etc/llmgw/tls/${var.admin_tls_cert}"
        LLMGW_ADMIN_TLS_KEY  = var.admin_tls_key == "" ? "" : "/etc/llmgw/tls/${var.admin_tls_key}"
      }

      resources {
        cpu    = 200
        # About 250 MB resident at 1,000 models (docs/capacity.md): 256 would leave no room.
        memory = 512
      }
    }
  }
}
