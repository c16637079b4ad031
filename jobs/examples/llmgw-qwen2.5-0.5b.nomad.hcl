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
    count          = 1
    shutdown_delay = "15s"

    constraint {
      attribute = "${meta.llmgw_engine_llama_cpp}"
      operator  = "set_contains"
      value     = "b6500"
    }

    affinity {
      attribute = "${meta.llmgw_models_cached}"
      operator  = "set_contains"
      value     = "qwen2.5-0.5b"
      weight    = 50
    }

    volume "weights" {
      type      = "host"
      source    = "llmgw-weights"
      read_only = false
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
        command = "/bin/sh"
        args    = [
          "-c",
          "llmgw_want=$1; llmgw_probe=$2; shift 2; if env | grep -q \"^NVIDIA_VISIBLE_DEVICES=\"; then llmgw_given=\"\\\"$NVIDIA_VISIBLE_DEVICES\\\"\"; else llmgw_given=\"nothing (NVIDIA_VISIBLE_DEVICES is not set)\"; fi; export CUDA_VISIBLE_DEVICES=\"$NVIDIA_VISIBLE_DEVICES\"; llmgw_list=$(eval \"$llmgw_probe\" 2>&1); llmgw_rc=$?; llmgw_seen=$(printf '%s\\n' \"$llmgw_list\" | grep -c '^ *CUDA[0-9][0-9]*:'); if [ \"$llmgw_seen\" -lt \"$llmgw_want\" ]; then llmgw_why=\"\"; if [ \"$llmgw_rc\" -ne 0 ]; then llmgw_why=\" (its device listing exited $llmgw_rc)\"; fi; echo \"llmgw: GPU check failed: asked for $llmgw_want GPU(s), the engine sees $llmgw_seen$llmgw_why; Nomad gave $llmgw_given as CUDA_VISIBLE_DEVICES\" >&2; exit 1; fi; echo \"llmgw: GPU check passed: the engine sees $llmgw_seen GPU(s) of $llmgw_given\" >&2; exec \"$@\"",
          "llmgw-gpu-check",
          "1",
          "'${meta.llmgw_engines_dir}/llama.cpp/b6500/llama-server' --list-devices",
          "${meta.llmgw_engines_dir}/llama.cpp/b6500/llama-server",
          "--model",
          "${meta.llmgw_models_dir}/qwen2.5-0.5b/qwen2.5-0.5b-instruct-q4_k_m.gguf",
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
          "--device",
          "CUDA0",
          "--parallel",
          "4"
        ]
      }

      volume_mount {
        volume      = "weights"
        destination = "${meta.llmgw_models_dir}"
        read_only   = true
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

    task "fetch" {
      driver       = "raw_exec"
      kill_timeout = "5s"

      lifecycle {
        hook    = "prestart"
        sidecar = false
      }

      config {
        command = "${meta.llmgw_engines_dir}/llmgw/bin/llmgw"
        args    = [
          "fetch",
          "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf",
          "--model",
          "qwen2.5-0.5b",
          "--cache",
          "${meta.llmgw_models_dir}",
          "--max-size",
          "${meta.llmgw_models_max}",
          "--min-rate",
          "${meta.llmgw_fetch_min_rate}",
          "--stall-window",
          "${meta.llmgw_fetch_stall_window}"
        ]
      }

      template {
        data        = "{{ if nomadVarExists \"llmgw/sources/qwen2~5-0~5b\" }}{{ range $k, $v := nomadVar \"llmgw/sources/qwen2~5-0~5b\" }}{{ $k }}={{ $v }}\n{{ end }}{{ end }}"
        destination = "secrets/source.env"
        env         = true
        change_mode = "noop"
        splay       = "0s"
      }

      volume_mount {
        volume      = "weights"
        destination = "${meta.llmgw_models_dir}"
        read_only   = false
      }

      resources {
        cpu    = 500
        memory = 256
      }
    }
  }
}
