namespace "default" {
  capabilities = ["list-jobs", "read-job", "submit-job"]
}
node {
  policy = "read"
}
