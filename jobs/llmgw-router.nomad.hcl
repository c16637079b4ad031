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

variable "router_tls_cert" {
  type        = string
  description = "File in tls_dir: certificate for the routers to serve HTTPS with (LLMGW_ROUTER_TLS_CERT); empty: plain HTTP."
  default     = ""
}

variable "router_tls_key" {
  type        = string
  description = "File in tls_dir: private key of router_tls_cert (LLMGW_ROUTER_TLS_KEY)."
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
      }
    }

    service {
      name = "llmgw-router"
      port = "http"
      # Prometheus finds its targets by the metrics tag (jobs/prometheus/prometheus.yml).
      tags = ["llmgw", "metrics"]

      check {
        type     = "http"
        protocol = var.router_tls_cert == "" ? "http" : "https"
        path     = "/healthz"
        interval = "5s"
        timeout  = "2s"
        # Consul runs the check against the task's IP, which no serving certificate names; it
        # asks whether the router answers, not who it is.
        tls_skip_verify = true
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
        args  = ["router", "--listen", "0.0.0.0:${NOMAD_PORT_http}"]
        ports = ["http"]
        # The host's network: a default Consul agent listens on 127.0.0.1 only, which a task on
        # Docker's bridge cannot reach.
        network_mode = "host"
        # The certificates, only when a directory is given, and where nothing of the image is:
        # Docker's default plugin config refuses host paths, and a mount over /etc/ssl/certs
        # would hide the image's CA bundle.
        volumes = var.tls_dir == "" ? [] : ["${var.tls_dir}:/etc/llmgw/tls:ro"]
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
        CONSUL_HTTP_ADDR       = coalesce(var.consul_addr, "http://127.0.0.1:8500")
        CONSUL_TLS_SERVER_NAME = var.consul_tls_server_name
        CONSUL_CACERT        = var.consul_cacert == "" ? "" : "/etc/llmgw/tls/${var.consul_cacert}"
        CONSUL_CLIENT_CERT   = var.consul_client_cert == "" ? "" : "/etc/llmgw/tls/${var.consul_client_cert}"
        CONSUL_CLIENT_KEY    = var.consul_client_key == "" ? "" : "/etc/llmgw/tls/${var.consul_client_key}"
        LLMGW_ROUTER_TLS_CERT = var.router_tls_cert == "" ? "" : "/etc/llmgw/tls/${var.router_tls_cert}"
        LLMGW_ROUTER_TLS_KEY = var.router_tls_key == "" ? "" : "/etc/llmgw/tls/${var.router_tls_key}"
      }

      resources {
        cpu    = 1000
        memory = 512
      }
    }
  }
}
