key_prefix "llmgw/config/" {
  policy = "write"
}
