# Rendered by llmgw from model 'llama-3.3-70b' (definition 330e3816673efeba).
# Edit the models file and render again rather than this file.
job "llmgw-llama-3.3-70b" {
  type        = "service"
  datacenters = ["dc1"]
  node_pool   = "gpu"

  meta {
    llmgw_model    = "llama-3.3-70b"
    llmgw_def_hash = "330e3816673efeba"
    llmgw_source   = "s3://models/meta-llama/Llama-3.3-70B-Instruct/"
    llmgw_profile  = "vllm-4x80g"
  }

  group "engine" {
    count          = 1
    shutdown_delay = "15s"

    constraint {
      attribute = "${meta.llmgw_engine_vllm}"
      operator  = "set_contains"
      value     = "v0.10.1"
    }

    scaling {
      min     = 0
      max     = 1
      enabled = false
    }

    network {
      port "http" {}
    }

    service {
      name = "llmgw-engine"
      port = "http"
      tags = ["model=llama-3.3-70b"]

      meta {
        model    = "llama-3.3-70b"
        def_hash = "330e3816673efeba"
      }

      check {
        name     = "engine ready"
        type     = "http"
        path     = "/health"
        interval = "5s"
        timeout  = "2s"
      }
    }

    restart {
      attempts = 1
      interval = "30m"
      delay    = "15s"
      mode     = "fail"
    }

    reschedule {
      attempts       = 2
      interval       = "24h"
      delay          = "1m"
      delay_function = "exponential"
      max_delay      = "10m"
      unlimited      = false
    }

    update {
      max_parallel = 0
    }

    task "engine" {
      driver       = "docker"
      kill_timeout = "30s"

      config {
        image    = "vllm/vllm-openai:v0.10.1"
        ports    = ["http"]
        shm_size = 17179869184
        args     = [
          "--model",
          "${NOMAD_TASK_DIR}/model/Llama-3.3-70B-Instruct",
          "--served-model-name",
          "llama-3.3-70b",
          "--host",
          "0.0.0.0",
          "--port",
          "${NOMAD_PORT_http}",
          "--max-model-len",
          "32768",
          "--tensor-parallel-size",
          "4",
          "--gpu-memory-utilization",
          "0.92"
        ]
      }

      artifact {
        source      = "s3::https://s3.amazonaws.com/models/meta-llama/Llama-3.3-70B-Instruct/"
        mode        = "dir"
        destination = "local/model/Llama-3.3-70B-Instruct"
      }

      resources {
        cpu    = 16000
        memory = 196608

        device "nvidia/gpu" {
          count = 4

          constraint {
            attribute = "${device.attr.memory}"
            operator  = ">="
            value     = "80000 MiB"
          }

          constraint {
            attribute = "${device.model}"
            operator  = "set_contains_any"
            value     = "NVIDIA H100 80GB HBM3,NVIDIA A100-SXM4-80GB"
          }
        }
      }
    }
  }
}
