# One node agent on every GPU node: it tells Nomad, as dynamic node metadata, which GPUs are
# healthy, which engine versions are installed and which weights are on local disk, so model
# jobs can constrain on them and the watcher can count them.

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
  description = "Datacenters with GPU nodes."
  default     = ["*"]
}

variable "gpu_node_pool" {
  type        = string
  description = "Node pool of the GPU nodes."
  default     = "gpu"
}

variable "engines_dir" {
  type        = string
  description = "Where engines are installed on the nodes: <dir>/<engine>/<version>/."
  default     = "/opt/llmgw/engines"
}

variable "models_dir" {
  type        = string
  description = "Where model weights are cached on the nodes: <dir>/<model>/."
  default     = "/opt/llmgw/models"
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

job "llmgw-node-agent" {
  type        = "system"
  datacenters = var.datacenters
  node_pool   = var.gpu_node_pool

  meta {
    llmgw_version = var.llmgw_version
  }

  group "agent" {
    network {
      port "metrics" {}
    }

    service {
      name = "llmgw-node-agent"
      port = "metrics"
      tags = ["llmgw", "metrics"]

      check {
        type     = "http"
        path     = "/metrics"
        interval = "30s"
        timeout  = "5s"
      }
    }

    task "agent" {
      driver = "docker"

      config {
        image = "${var.image}:${var.llmgw_version}"
        args = [
          "node-agent",
          "--listen", "0.0.0.0:${NOMAD_PORT_metrics}",
          "--engines-dir", var.engines_dir,
          "--models-dir", var.models_dir,
          "--fabric", "${meta.llmgw_fabric}",
        ]
        ports = ["metrics"]
        # The host's network, like the other two jobs: the node's own Nomad agent is at
        # 127.0.0.1, a name its certificate carries.
        network_mode = "host"
        # Read-only: the agent runs each engine's version command and lists the weights. Host
        # paths, so the GPU nodes' Docker plugin must allow them (`volumes { enabled = true }`,
        # docs/getting-started.md step 1); the certificates only when a directory is given,
        # where nothing of the image is.
        volumes = concat(
          ["${var.engines_dir}:${var.engines_dir}:ro", "${var.models_dir}:${var.models_dir}:ro"],
          var.tls_dir == "" ? [] : ["${var.tls_dir}:/etc/llmgw/tls:ro"],
        )
      }

      template {
        destination = "${NOMAD_SECRETS_DIR}/tokens.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
          {{- with nomadVar "nomad/jobs/llmgw-node-agent" -}}
          NOMAD_TOKEN={{ .nomad_token }}
          {{- end }}
        EOT
      }

      # NVML needs the driver's libraries and the device nodes; Nomad's NVIDIA device plugin
      # hands them over for a GPU request, but the agent must see every GPU without claiming
      # any, so it asks the container toolkit for all of them instead.
      env {
        NVIDIA_VISIBLE_DEVICES     = "all"
        NVIDIA_DRIVER_CAPABILITIES = "utility"
        NOMAD_ADDR                 = coalesce(var.nomad_addr, "http://127.0.0.1:4646")
        NOMAD_TLS_SERVER_NAME      = var.nomad_tls_server_name
        NOMAD_CACERT               = var.nomad_cacert == "" ? "" : "/etc/llmgw/tls/${var.nomad_cacert}"
        NOMAD_CLIENT_CERT          = var.nomad_client_cert == "" ? "" : "/etc/llmgw/tls/${var.nomad_client_cert}"
        NOMAD_CLIENT_KEY           = var.nomad_client_key == "" ? "" : "/etc/llmgw/tls/${var.nomad_client_key}"
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
