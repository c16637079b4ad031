key_prefix "llmgw/" {
  policy = "write"
}

session_prefix "" {
  policy = "write"
}

node "llmgw-models" {
  policy = "write"
}

service "llmgw-model" {
  policy = "write"
}

service "llmgw-engine" {
  policy = "read"
}

node_prefix "" {
  policy = "read"
}
