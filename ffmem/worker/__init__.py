"""The worker: holds one model per process, claims jobs from the store (index runs, analyses) and
answers live traces over HTTP."""
