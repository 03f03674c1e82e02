"""Relations between memories: nearest keys and values (`neighbours`), which memories write into which
keys (`weight_graph`), the same memory in two runs (`comparison`)."""
