"""ffmem: explore the key-value memories inside transformer feed-forward layers (Geva et al., 2021).

Rooms, with imports one way (engine -> config -> store -> worker / web -> cli; a test keeps them so):
- `ffmem.engine`: torch only — load a model, capture coefficients, mine triggers, project values, trace;
- `ffmem.store`: the database — models, queries, the job queue, export; no torch;
- `ffmem.worker`: holds the model, claims jobs, answers live traces over HTTP;
- `ffmem.web`: the FastAPI explorer, reading the store only; never imports torch;
- `ffmem.cli`: the `ffmem` command, wiring only;
- `ffmem.api`: the index from Python (`ffmem.open(url)`), reading the store only; never imports torch.
"""


def __getattr__(name: str):
    """`ffmem.open`, imported when first asked for: `import ffmem` alone loads nothing."""
    if name == "open":
        from ffmem.api import open

        return open
    raise AttributeError(f"module 'ffmem' has no attribute {name!r}")
