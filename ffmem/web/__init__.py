"""The web process: FastAPI pages and their JSON twins, reading the store only; never imports torch."""
