"""Every link of the explorer is built here; templates call these, never f-strings.

`fmt="json"` gives a page's JSON twin (the same path with `.json` appended). Keyword arguments
with a value of None are left out of the query string.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import quote, quote_plus

_encoded = lru_cache(maxsize=4096)(quote_plus)  # a page builds hundreds of links around one prompt


def _url(path: str, fmt: str | None = None, **query) -> str:
    if fmt == "json":
        path = f"{path}.json" if path != "/" else "/.json"
    kept = "&".join(f"{name}={_encoded(str(value))}" for name, value in query.items() if value is not None)
    return f"{path}?{kept}" if kept else path


def home_url(fmt: str | None = None) -> str:
    return _url("/", fmt)


def model_url(model: str, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}", fmt, **query)


def layer_url(model: str, layer: int, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/layers/{int(layer)}", fmt, **query)


def key_url(model: str, layer: int, key: int, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/layers/{int(layer)}/keys/{int(key)}", fmt, **query)


def search_url(model: str, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/search", fmt, **query)


def corpora_url(fmt: str | None = None, **query) -> str:
    return _url("/corpora", fmt, **query)


def jobs_url(fmt: str | None = None, **query) -> str:
    return _url("/jobs", fmt, **query)


def job_url(job_id: int, fmt: str | None = None) -> str:
    return _url(f"/jobs/{int(job_id)}", fmt)


def start_job_url() -> str:
    return "/jobs"


def retry_job_url(job_id: int) -> str:
    return f"/jobs/{int(job_id)}/retry"


def delete_run_url(model: str, run_id: int) -> str:
    return f"/m/{quote(model, safe='')}/runs/{int(run_id)}/delete"


def login_url(fmt: str | None = None, **query) -> str:
    return _url("/login", fmt, **query)


def logout_url() -> str:
    return "/logout"


def static_url(name: str) -> str:
    return f"/static/{name}"


def trace_url(model: str, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/trace", fmt, **query)


def circuit_url(model: str, fmt: str | None = None, **query) -> str:
    """A prompt's memory circuit in the live view (the trace's query and the circuit's own)."""
    return _url(f"/m/{quote(model, safe='')}/trace/circuit", fmt, **query)


def ablation_url(model: str, layer: int, key: int, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/layers/{int(layer)}/keys/{int(key)}/ablation", fmt, **query)


def token_change_url(model: str, layer: int, key: int, fmt: str | None = None, **query) -> str:
    """What a memory does to the next token (its TokenChange, live); `text`: at a text's top positions."""
    return _url(f"/m/{quote(model, safe='')}/layers/{int(layer)}/keys/{int(key)}/token-change", fmt, **query)


def samples_url(model: str, layer: int, key: int, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/layers/{int(layer)}/keys/{int(key)}/samples", fmt, **query)


def quadrant_url(model: str, layer: int, key: int, quadrant: str, fmt: str | None = None, **query) -> str:
    """A gated key's examples of one sign quadrant (pp, pn, np, nn)."""
    key_path = f"/m/{quote(model, safe='')}/layers/{int(layer)}/keys/{int(key)}"
    return _url(f"{key_path}/quadrants/{quote(quadrant, safe='')}", fmt, **query)


def related_url(model: str, layer: int, key: int, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/layers/{int(layer)}/keys/{int(key)}/related", fmt, **query)


def label_url(model: str, layer: int, key: int, fmt: str | None = None) -> str:
    return _url(f"/m/{quote(model, safe='')}/layers/{int(layer)}/keys/{int(key)}/labels", fmt)


def model_labels_url(model: str, fmt: str | None = None, **query) -> str:
    """Every current label of a model; `fmt="json"` its JSON twin, `fmt="csv"` the same as CSV."""
    path = f"/m/{quote(model, safe='')}/labels"
    return _url(f"{path}.csv", None, **query) if fmt == "csv" else _url(path, fmt, **query)


def delete_label_url(model: str, layer: int, key: int, label_id: int, fmt: str | None = None) -> str:
    return _url(f"{label_url(model, layer, key)}/{int(label_id)}/delete", fmt)


def start_analysis_url(model: str) -> str:
    return f"/m/{quote(model, safe='')}/analysis"


def analysis_url(model: str, fmt: str | None = None, **query) -> str:
    return _url(f"/m/{quote(model, safe='')}/analysis", fmt, **query)


def compare_url(model: str, fmt: str | None = None, **query) -> str:
    """Two runs side by side: query a (run of `model`), b (any run of the same shape), sort, limit, layer."""
    return _url(f"/m/{quote(model, safe='')}/compare", fmt, **query)


def start_compare_url(model: str) -> str:
    return f"/m/{quote(model, safe='')}/compare"
