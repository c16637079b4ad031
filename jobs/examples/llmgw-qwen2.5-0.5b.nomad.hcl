# Rendered by llmgw from model 'qwen2.5-0.5b' (definition 1006d941d6c9f6ab).
# Edit the models file and render again rather than this file.
job "llmgw-qwen2.5-0.5b" {
  type        = "service"
  datacenters = ["*"]
  node_pool   = "gpu"

  meta {
    llmgw_model    = "qwen2.5-0.5b"
    llmgw_def_hash = "1006d941d6c9f6ab"
    llmgw_source   = "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    llmgw_profile  = "llamacpp-1x24g"
  }

  group "engine" {
    count = 1

    constraint {
      attribute = "${meta.llmgw_engine_llama_cpp}"
      operator  = "set_contains"
      value     = "b6500"
    }

    scaling {
      min     = 0
      max     = 2
      enabled = false
    }

    network {
      port "http" {}
    }

    service {
      name = "llmgw-engine"
      port = "http"
      tags = ["model=qwen2.5-0.5b"]

      meta {
        model    = "qwen2.5-0.5b"
        def_hash = "1006d941d6c9f6ab"
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
      driver       = "raw_exec"
      kill_timeout = "30s"

      config {
        command = "${meta.llmgw_engines_dir}/llama.cpp/b6500/llama-server"
        args    = [
          "--model",
          "${NOMAD_TASK_DIR}/model/qwen2.5-0.5b-instruct-q4_k_m.gguf",
          "--host",
          "${NOMAD_IP_http}",
          "--port",
          "${NOMAD_PORT_http}",
          "--ctx-size",
          "8192",
          "--alias",
          "qwen2.5-0.5b",
          "-ngl",
          "999",
          "--parallel",
          "4"
        ]
      }

      env {
        CUDA_VISIBLE_DEVICES = "${NVIDIA_VISIBLE_DEVICES}"
      }

      artifact {
        source      = "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/qwen2.5-0.5b-instruct-q4_k_m.gguf"
        mode        = "file"
        destination = "local/model/qwen2.5-0.5b-instruct-q4_k_m.gguf"
      }

      resources {
        cpu    = 2000
        memory = 8192

        device "nvidia/gpu" {
          count = 1

          constraint {
            attribute = "${device.attr.memory}"
            operator  = ">="
            value     = "22000 MiB"
          }
        }
      }
    }
  }
}
