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

variable "nomad_addr" {
  type        = string
  description = "The node's own Nomad client API as seen from the task (https:// where it requires TLS); empty: the agent on the task's node over http."
  default     = ""
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

job "llmgw-node-agent" {
  type        = "system"
  datacenters = var.datacenters
  node_pool   = var.gpu_node_pool

  meta {
    llmgw_version = var.llmgw_version
  }

  group "agent" {
    network {
      port "metrics" {
        to = 4710
      }
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
          "--listen", "0.0.0.0:4710",
          "--engines-dir", var.engines_dir,
          "--models-dir", var.models_dir,
          "--fabric", "${meta.llmgw_fabric}",
        ]
        ports = ["metrics"]
        # Read-only: the agent runs each engine's version command and lists the weights.
        volumes = [
          "${var.engines_dir}:${var.engines_dir}:ro",
          "${var.models_dir}:${var.models_dir}:ro",
          "${var.tls_dir}:${var.tls_dir}:ro",
        ]
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
        NOMAD_ADDR                 = coalesce(var.nomad_addr, "http://${attr.unique.network.ip-address}:4646")
        NOMAD_CACERT               = var.nomad_cacert
        NOMAD_CLIENT_CERT          = var.nomad_client_cert
        NOMAD_CLIENT_KEY           = var.nomad_client_key
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
