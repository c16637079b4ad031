node {
  policy = "write"
}
