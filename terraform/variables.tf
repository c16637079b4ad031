variable "llmgw_version" {
  type        = string
  description = "llmgw release to run: the tag of var.image for the watcher, router and node agent."
  default     = "0.1.0"
}

variable "image" {
  type        = string
  description = "Container image with llmgw installed, without the tag (see docs/operating.md to build it)."
  default     = "llmgw"
}

variable "datacenters" {
  type        = list(string)
  description = "Nomad datacenters llmgw's jobs may run in; [\"*\"] means all."
  default     = ["*"]

  validation {
    condition     = length(var.datacenters) > 0
    error_message = "datacenters must name at least one datacenter (or \"*\")."
  }
}

variable "node_pool" {
  type        = string
  description = "Nomad node pool for the watcher and the routers; keep them off the GPU nodes so a busy engine cannot starve them."
  default     = "default"
}

variable "gpu_node_pool" {
  type        = string
  description = "Nomad node pool of the GPU nodes: the node agent runs on every node in it."
  default     = "gpu"
}

variable "models_file" {
  type        = string
  description = "Path to the models YAML (profiles and models); its text is stored in Consul KV at llmgw/config/models, where the watcher reads it."

  validation {
    condition     = fileexists(var.models_file)
    error_message = "models_file must point at an existing models YAML file."
  }

  validation {
    condition     = can(yamldecode(file(var.models_file)))
    error_message = "models_file is not valid YAML; check it with `llmgw render <file> -o /tmp/out`."
  }
}

variable "router_count" {
  type        = number
  description = "Number of router instances; each runs on a different host."
  default     = 3

  validation {
    condition     = var.router_count >= 1 && floor(var.router_count) == var.router_count
    error_message = "router_count must be a whole number of at least 1."
  }
}

variable "router_port" {
  type        = number
  description = "Static port the routers listen on, on each host; load balancers and clients need a fixed one."
  default     = 8080

  validation {
    condition     = var.router_port >= 1 && var.router_port <= 65535 && floor(var.router_port) == var.router_port
    error_message = "router_port must be a port number between 1 and 65535."
  }
}

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API as seen from inside the tasks (a URL; https:// where Nomad has TLS). Empty: the Nomad agent on the task's own host, http://127.0.0.1:4646 (the tasks run on the host's network)."
  default     = ""
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API as seen from inside the tasks (host:port or a URL). Empty: the Consul agent on the task's own host, http://127.0.0.1:8500, where a default Consul agent listens."
  default     = ""
}

variable "max_start_failures" {
  type        = number
  description = "Consecutive start failures after which the watcher parks a model."
  default     = 5

  validation {
    condition     = var.max_start_failures >= 1 && floor(var.max_start_failures) == var.max_start_failures
    error_message = "max_start_failures must be a whole number of at least 1."
  }
}

variable "engines_dir" {
  type        = string
  description = "Directory on the GPU nodes where engines are installed as <dir>/<engine>/<version>/; the node agent reports what it finds there."
  default     = "/opt/llmgw/engines"
}

variable "models_dir" {
  type        = string
  description = "Directory on the GPU nodes where model weights are cached as <dir>/<model>/."
  default     = "/opt/llmgw/models"
}

variable "api_keys" {
  type        = list(string)
  description = "Bearer tokens clients must present to the routers. An empty list turns authentication off, which the routers log as a warning at every start."
  sensitive   = true

  validation {
    condition     = alltrue([for k in var.api_keys : length(k) > 0 && length(regexall("[,\\s]", k)) == 0])
    error_message = "Each API key must be non-empty and contain no commas or whitespace (the routers read them as one comma-separated list)."
  }
}

variable "admin_token" {
  type        = string
  description = "Bearer token for the watcher's admin API (llmgw ctl sends it as LLMGW_ADMIN_TOKEN). Left null, a random one is generated and exported as the sensitive output admin_token."
  default     = null
  sensitive   = true
}

variable "tls" {
  description = "TLS to Nomad and Consul: a directory present on every node, mounted read-only at /etc/llmgw/tls in llmgw's tasks (empty: nothing is mounted), the names of the files in it, and the names to verify the agents' certificates against where nomad_addr and consul_addr are names the certificates lack (NOMAD_TLS_SERVER_NAME, CONSUL_TLS_SERVER_NAME); empty strings for what you do not use. Set nomad_addr and consul_addr (and node_nomad_addr) to https:// addresses with it."
  type = object({
    dir                    = optional(string, "")
    nomad_cacert           = optional(string, "")
    nomad_client_cert      = optional(string, "")
    nomad_client_key       = optional(string, "")
    consul_cacert          = optional(string, "")
    consul_client_cert     = optional(string, "")
    consul_client_key      = optional(string, "")
    nomad_tls_server_name  = optional(string, "")
    consul_tls_server_name = optional(string, "")
  })
  default = {}
}

variable "node_nomad_addr" {
  description = "The node agent's Nomad address, its own node's client API, as seen from the task (https://... where it requires TLS); empty: the agent on the node, http://127.0.0.1:4646."
  type        = string
  default     = ""
}

variable "models_namespace" {
  description = "Nomad namespace of the model jobs: the watcher registers and scales them there (the routers ask it through Consul), and its Nomad policy grants only there. Create it first (`nomad namespace apply`)."
  type        = string
  default     = "default"
}
