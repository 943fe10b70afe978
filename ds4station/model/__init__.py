"""What the model is, without torch: config, tensor layout, the GGUF header reader, sizes, routes, footprints."""
