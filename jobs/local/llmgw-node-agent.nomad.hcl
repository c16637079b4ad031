# Development variant of llmgw-node-agent.nomad.hcl: one agent per (simulated) node, run from a
# local virtualenv through raw_exec. For the dev stack and tests only.

variable "venv" {
  type        = string
  description = "Virtualenv with llmgw installed (its bin/llmgw is run)."
}

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API."
}

variable "nomad_token" {
  type        = string
  description = "NOMAD_TOKEN: the node agent's token where Nomad's ACLs are on (python -m devstack up --acl); empty: none."
  default     = ""
}

variable "nomad_cacert" {
  type        = string
  description = "NOMAD_CACERT: the CA of Nomad's HTTPS certificate (python -m devstack up --tls); empty: the system's CAs."
  default     = ""
}

variable "node_pool" {
  type        = string
  description = "Node pool of the GPU nodes."
  default     = "default"
}

job "llmgw-node-agent" {
  type        = "system"
  datacenters = ["*"]
  node_pool   = var.node_pool

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
        interval = "2s"
        timeout  = "1s"
      }
    }

    task "agent" {
      driver = "raw_exec"

      config {
        command = "${var.venv}/bin/llmgw"
        args = [
          "node-agent",
          "--listen", "127.0.0.1:${NOMAD_PORT_metrics}",
          "--node-id", "${node.unique.id}",
          "--engines-dir", "${meta.llmgw_engines_dir}",
          # Each node's own weights cache where the fleet declares one (devstack up --s3 gives
          # each GPU node its own, as its llmgw-weights host volume): without it the agent
          # published /opt/llmgw/models over it, and the fetch wrote there instead.
          "--models-dir", "${meta.llmgw_models_dir}",
          "--fabric", "${meta.llmgw_fabric}",
          "--interval", "5",
        ]
      }

      env {
        NOMAD_ADDR  = var.nomad_addr
        NOMAD_TOKEN  = var.nomad_token
        NOMAD_CACERT = var.nomad_cacert
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
