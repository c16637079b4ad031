# Rendered by llmgw from model 'gemma-3-4b' (definition dbaa1f4c33aa1d61).
# Edit the models file and render again rather than this file.
job "llmgw-gemma-3-4b" {
  type        = "service"
  datacenters = ["*"]
  node_pool   = "gpu"

  meta {
    llmgw_model    = "gemma-3-4b"
    llmgw_def_hash = "dbaa1f4c33aa1d61"
    llmgw_source   = "hf://ggml-org/gemma-3-4b-it-GGUF/gemma-3-4b-it-Q4_K_M.gguf"
    llmgw_profile  = "llamacpp-python-1x24g"
  }

  group "engine" {
    count = 0

    constraint {
      attribute = "${meta.llmgw_engine_llama_cpp_python}"
      operator  = "set_contains"
      value     = "0.3.36"
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
      tags = ["model=gemma-3-4b"]

      meta {
        model    = "gemma-3-4b"
        def_hash = "dbaa1f4c33aa1d61"
      }

      check {
        name     = "engine ready"
        type     = "http"
        path     = "/v1/models"
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
        command = "${meta.llmgw_engines_dir}/llama-cpp-python/0.3.36/bin/python"
        args    = [
          "-m",
          "llama_cpp.server",
          "--model",
          "${NOMAD_TASK_DIR}/model/gemma-3-4b-it-Q4_K_M.gguf",
          "--host",
          "${NOMAD_IP_http}",
          "--port",
          "${NOMAD_PORT_http}",
          "--n_ctx",
          "8192",
          "--model_alias",
          "gemma-3-4b",
          "--interrupt_requests",
          "False",
          "--n_gpu_layers",
          "-1",
          "--chat_format",
          "gemma"
        ]
      }

      env {
        CUDA_VISIBLE_DEVICES = "${NVIDIA_VISIBLE_DEVICES}"
      }

      artifact {
        source      = "https://huggingface.co/ggml-org/gemma-3-4b-it-GGUF/resolve/main/gemma-3-4b-it-Q4_K_M.gguf"
        mode        = "file"
        destination = "local/model/gemma-3-4b-it-Q4_K_M.gguf"
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
