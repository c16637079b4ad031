namespace "default" {
  capabilities = ["list-jobs", "read-job", "submit-job", "read-logs"]
}

node {
  policy = "read"
}
