key "llmgw/config/models" {
  policy = "write"
}
