key_prefix "llmgw/state/" {
  policy = "list"
}

key_prefix "llmgw/config/" {
  policy = "list"
}

key_prefix "llmgw/activity/" {
  policy = "write"
}

key_prefix "llmgw/inflight/" {
  policy = "write"
}

service "llmgw-engine" {
  policy = "read"
}

node_prefix "" {
  policy = "read"
}
