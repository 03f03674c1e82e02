"""ffmem's web process and its database layer: reads the index database, never imports torch."""
