"""The worker: holds a model and does the heavy work (index runs)."""
