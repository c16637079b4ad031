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
    count          = 0
    shutdown_delay = "15s"

    constraint {
      attribute = "${meta.llmgw_engine_llama_cpp_python}"
      operator  = "set_contains"
      value     = "0.3.36"
    }

    affinity {
      attribute = "${meta.llmgw_models_cached}"
      operator  = "set_contains"
      value     = "gemma-3-4b"
      weight    = 50
    }

    volume "weights" {
      type      = "host"
      source    = "llmgw-weights"
      read_only = false
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
        command = "/bin/sh"
        args    = [
          "-c",
          "llmgw_want=$1; llmgw_probe=$2; shift 2; if env | grep -q \"^NVIDIA_VISIBLE_DEVICES=\"; then llmgw_given=\"\\\"$NVIDIA_VISIBLE_DEVICES\\\"\"; else llmgw_given=\"nothing (NVIDIA_VISIBLE_DEVICES is not set)\"; fi; export CUDA_VISIBLE_DEVICES=\"$NVIDIA_VISIBLE_DEVICES\"; llmgw_list=$(eval \"$llmgw_probe\" 2>&1); llmgw_rc=$?; llmgw_seen=$(printf '%s\\n' \"$llmgw_list\" | grep -c '^ *CUDA[0-9][0-9]*:'); if [ \"$llmgw_seen\" -lt \"$llmgw_want\" ]; then llmgw_why=\"\"; if [ \"$llmgw_rc\" -ne 0 ]; then llmgw_why=\" (its device listing exited $llmgw_rc)\"; fi; echo \"llmgw: GPU check failed: asked for $llmgw_want GPU(s), the engine sees $llmgw_seen$llmgw_why; Nomad gave $llmgw_given as CUDA_VISIBLE_DEVICES\" >&2; exit 1; fi; echo \"llmgw: GPU check passed: the engine sees $llmgw_seen GPU(s) of $llmgw_given\" >&2; exec \"$@\"",
          "llmgw-gpu-check",
          "1",
          "'${meta.llmgw_engines_dir}/llama-cpp-python/0.3.36/bin/python' -c 'import ctypes, pathlib, llama_cpp; lib = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / '\"'\"'lib'\"'\"' / '\"'\"'libggml.so'\"'\"')); lib.ggml_backend_dev_count.restype = ctypes.c_size_t; lib.ggml_backend_dev_get.restype = ctypes.c_void_p; lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]; lib.ggml_backend_dev_name.restype = ctypes.c_char_p; lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]; names = [lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i)).decode() for i in range(lib.ggml_backend_dev_count())]; print('\"'\"'\\n'\"'\"'.join(n + '\"'\"':'\"'\"' for n in names if n.startswith('\"'\"'CUDA'\"'\"')))'",
          "${meta.llmgw_engines_dir}/llama-cpp-python/0.3.36/bin/python",
          "-m",
          "llama_cpp.server",
          "--model",
          "${meta.llmgw_models_dir}/gemma-3-4b/gemma-3-4b-it-Q4_K_M.gguf",
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
          "hf://ggml-org/gemma-3-4b-it-GGUF/gemma-3-4b-it-Q4_K_M.gguf",
          "--model",
          "gemma-3-4b",
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
        data        = "{{ if nomadVarExists \"llmgw/sources/gemma-3-4b\" }}{{ range $k, $v := nomadVar \"llmgw/sources/gemma-3-4b\" }}{{ $k }}={{ $v }}\n{{ end }}{{ end }}"
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
