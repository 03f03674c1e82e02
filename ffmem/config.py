"""One Settings object; nothing else reads os.environ. Every field is documented (a test checks).

Each field can be set as an environment variable prefixed with FFMEM_ (e.g. FFMEM_DATABASE_URL)
or in a `.env` file in the working directory.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FFMEM_", env_file=".env", extra="ignore")

    database_url: str = Field(
        "sqlite:///data/ffmem.db",
        description="SQLAlchemy URL of the index database: sqlite:///path (default, under ./data/) "
        "or postgresql+psycopg://user@host:5432/db for a team server.",
    )
    db_connect_attempts: int = Field(
        10,
        ge=1,
        description="Times the web process tries to reach Postgres at start before giving up (it may "
        "still be starting); SQLite is opened at once. A refused login or a bad URL fails at once.",
    )
    db_connect_wait: float = Field(
        0.5, gt=0, description="Seconds before the second try to reach Postgres; each wait doubles."
    )
    db_connect_wait_max: float = Field(
        4.0, gt=0, description="The longest wait between two tries to reach Postgres, in seconds."
    )
    max_body_bytes: int = Field(
        65536, ge=1, description="Largest request body the web app accepts (bytes); larger ones get a 413."
    )
    max_query_bytes: int = Field(
        8192, ge=1, description="Longest query string the web app accepts (bytes); longer ones get a 414."
    )
    max_upload_bytes: int = Field(
        20_000_000,
        ge=1,
        description="Largest corpus file that can be uploaded from the browser (/corpora, bytes); a larger "
        "one gets a 413. Larger corpora: put the file where the workers read it and pass its path.",
    )
    upload_dir: Path | None = Field(
        None,
        description="Folder where corpora uploaded from the browser are kept (each with its line counts); "
        "empty (the default): `corpora` in the data folder, the folder of the SQLite database's file "
        "(data/corpora for the default database, wherever the server was started), or data/corpora under "
        "the working directory for a server database. Jobs name them by path, so workers on other "
        "machines need it shared at the same path.",
    )
    cache_dir: Path = Field(
        Path("data/cache"),
        description="Folder for the dequantized safetensors copy of GGUF models and index checkpoints.",
    )
    model: str = Field(
        "smollm2-135m",
        description="Model indexed when none is named: the embedded 'smollm2-135m', a Hugging Face id, "
        "a local folder or a .gguf file.",
    )
    corpus: str = Field(
        "wiki-vital",
        description="Corpus indexed when none is named: 'wiki-vital' (bundled Wikipedia summaries), "
        "a .txt file (one or more sentences a line) or a .jsonl file with a 'text' field.",
    )
    sentences: int | None = Field(
        None,
        ge=1,
        description="Sentences read from the corpus when --sentences is not given; empty (the default): all "
        "of them (the bundled wiki-vital: ~36.5K sentences, ~1M tokens).",
    )
    held_out_every: int = Field(
        10,
        ge=0,
        description="Every this many-th sentence of a run's corpus (index % n = n − 1) is held out of "
        "mining: the paper's analyses and the explanations' scores read those. 0: none is held out "
        "(then they read the corpus's sentences after the run's --sentences).",
    )
    top_k: int = Field(50, ge=1, le=1000, description="Trigger sentences kept per key and sign (T).")
    shaded_triggers: int = Field(
        10,
        ge=0,
        le=1000,
        description="Top triggers per sign whose every token the key page shades: after mining, one more "
        "pass over their sentences (and the band samples') reads the key's coefficient at each token.",
    )
    max_sentence_tokens: int = Field(
        128, ge=2, le=4096, description="Sentences longer than this many tokens are truncated."
    )
    first_position: bool = Field(
        False,
        description="Mine each sentence's first token when the tokenizer puts no BOS before it (`ffmem "
        "index --first-position`). Off, position 0 is left out of the triggers and of every statistic: "
        "there the attention sink gives some keys coefficients far above any they reach elsewhere. A BOS "
        "the tokenizer puts first is never mined; the token after it always is.",
    )
    batch_tokens: int = Field(
        4096,
        ge=64,
        description="Token budget of one length-bucketed batch (batch size × padded length).",
    )
    shard_sentences: int = Field(
        0,
        ge=0,
        description="Sentences per shard: the unit of length bucketing, checkpointing and resuming. 0: "
        "sized by the model, at least 2048 and as many as hold 16 tokens a memory (a finished shard is "
        "merged into the run at a cost that grows with the model's memories).",
    )
    checkpoint_batches: int = Field(
        0,
        ge=0,
        description="A shard's running top-T is checkpointed to the database every this many batches; 0: "
        "by time instead (`checkpoint_seconds`).",
    )
    checkpoint_seconds: float = Field(
        60.0,
        ge=0,
        description="With `checkpoint_batches` 0: a shard's running top-T is checkpointed once this many "
        "seconds have passed since the last checkpoint, and at least ten times as long as that one took "
        "(an 8B model's checkpoint writes 1.2 GB): checkpoints take at most a tenth of the mining.",
    )
    lease_seconds: float = Field(
        120.0,
        gt=0,
        description="A worker holds a shard or job this long after its last renewal; then others may. "
        "A heartbeat renews it every third of it while a step runs, so a step may take longer: the lease "
        "is how long a dead worker's work waits before another worker takes it up (on the same machine "
        "a dead worker is recognized at once).",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Times a worker may take up one step of a job (preparing a run, mining a shard, "
        "storing the run, an analysis) whose worker died each time (its lease ran out: killed for memory, "
        "say); then the job fails, saying so, instead of being taken up forever. Retrying it starts the "
        "count again; a worker stopped cleanly (Ctrl-C, SIGTERM) gives its step back uncounted.",
    )
    value_tokens: int = Field(30, ge=1, le=1000, description="Top and bottom tokens stored per value.")
    token_memories: int = Field(
        32,
        ge=1,
        le=1000,
        description="Memories kept per vocabulary token for token search, each way (promoting, "
        "suppressing), readout and ranking (logit, probability): the most a token search shows each way. "
        "8 B each: 32 cost 1 KB per token and readout (2.3 KB a memory for SmolLM2-135M, whose vocabulary "
        "is as large as its memories; 0.6 KB for Llama-3.1-8B).",
    )
    worker_url: str = Field(
        "http://127.0.0.1:8001",
        description="Where the web process finds the live worker (`ffmem worker` listens there; "
        "`ffmem serve` starts one unless --worker-url names another).",
    )
    worker_timeout: float = Field(
        60.0, gt=0, description="Seconds the web process waits for the live worker's answer."
    )
    search_worker_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a token search waits for the live worker's memories past the stored depth "
        "(token_memories); then it shows the stored ones and says why. The first search ranked by "
        "probability after the worker loads a model computes every value's log Z (seconds on a GPU, about "
        "an index's value projection on a CPU): searches until then show the stored ones.",
    )
    max_prompt_tokens: int = Field(
        512, ge=1, le=8192, description="Longest prompt a live trace accepts, in tokens."
    )
    trace_queue: int = Field(
        16, ge=1, description="Live traces that may wait for the worker; past it the app answers 503."
    )
    live_models: int = Field(1, ge=1, description="Models the live worker keeps loaded at once.")
    trace_rate_limit: str = Field(
        "30/minute",
        description="Live requests (traces and ablations, page or JSON) one client may make, in the "
        "`limits` notation over a moving window: '30/minute', or several such as '30/minute;5/second' "
        "to cap bursts too; '0' or '' turns the limit off. Every request to those routes counts, "
        "refused ones too (a bad prompt costs the worker a tokenization); past the limit the app answers "
        "429 with Retry-After. Clients are told apart by address (see forwarded_allow_ips); the counts "
        "live in the web process's memory.",
    )
    forwarded_allow_ips: str = Field(
        "127.0.0.1",
        description="Reverse proxies (comma-separated addresses or networks, '*' for any) whose "
        "X-Forwarded-For and X-Forwarded-Proto `ffmem serve` believes: behind them the client's address, "
        "which the rate limit counts by, is the forwarded one. '' believes no one; '*' only when nothing "
        "but the proxy can reach the app.",
    )
    analysis_examples: int = Field(
        4000, ge=1, description="Held-out sentences, one random prefix each, of the analyses (Figs. 7–11)."
    )
    analysis_keys: int = Field(100, ge=1, description="Keys sampled per layer for Fig. 3 (token removal).")
    analysis_triggers: int = Field(
        50, ge=1, le=1000, description="Top trigger prefixes per sampled key for Fig. 3."
    )
    analyze: bool = Field(
        False,
        description="Queue the paper's analyses with every index run (`ffmem index --analyze` for one run).",
    )
    explain_sentences: int = Field(
        1000,
        ge=0,
        description="Held-out sentences (those of the run's corpus after the ones it mined) on which each "
        "memory's automatic explanation is scored when the run is stored; 0 leaves them unscored.",
    )
    token_change_memories: int = Field(
        2000,
        ge=0,
        description="Memories sampled (the same number from every layer) whose TokenChange — the tokens "
        "whose next-token probability rises most with the memory amplified and falls most with it switched "
        "off, "
        "by forward passes over held-out contexts where its key fires — is measured and scored against "
        "their value's top tokens when a run is stored; 0 measures none.",
    )
    token_change_contexts: int = Field(
        8,
        ge=1,
        le=64,
        description="Held-out contexts (where the key fires most) per sampled memory's TokenChange.",
    )
    explain_top_records: int = Field(
        20,
        ge=0,
        description="The scoring protocol's top records: per memory and side, the held-out sentences where "
        "it peaks highest, scored with as many random ones (the pooled score, mixed 1:1 with "
        "explain_random_records).",
    )
    explain_random_records: int = Field(
        20,
        ge=0,
        description="The scoring protocol's random records: held-out sentences drawn once by a fixed "
        "shuffle, the same for every memory (its random-only score); 0: every held-out sentence.",
    )
    explain_quadrants: bool = Field(
        False,
        description="A gated model's memories are also described and scored per sign quadrant (pp, pn, np, "
        "nn: the signs of the gate's activation and of the input x·u), each on its own records: about "
        "1.8× the explanations' time and 2.3 KB more stored a memory.",
    )
    explainer_url: str = Field(
        "",
        description="Base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8080/v1) whose model "
        "writes the memories' explanations instead of the built-in heuristic. Empty (the default): nothing "
        "is sent anywhere.",
    )
    explainer_model: str = Field("", description="Model name sent to explainer_url (empty: the server's).")
    explainer_simulated_records: int = Field(
        5,
        ge=0,
        description="With explainer_url set, its model also simulates each side it describes on this many of "
        "the side's top held-out records and as many random ones (OpenAI's simulation score, stored beside "
        "the token table's); 0: it only describes.",
    )
    explainer_timeout: float = Field(60.0, gt=0, description="Seconds to wait for explainer_url's answer.")
    admin_token: SecretStr | None = Field(
        None,
        description="Token for writes (starting, retrying or deleting runs, analyses, labels): sent as "
        "`Authorization: Bearer …` or entered once at /login (a signed cookie). Without one, only a server "
        "bound to 127.0.0.1 accepts writes, and only from its own machine: a request that came through a "
        "proxy (Forwarded, X-Forwarded-For or X-Real-IP) is refused, as every client behind it looks local.",
    )
    admin_session_hours: float = Field(12.0, gt=0, description="How long a /login cookie stays valid.")
    read_only: bool = Field(
        False, description="Refuse every write and hide every write control (`ffmem serve --read-only`)."
    )
    host: str = Field(
        "127.0.0.1",
        description="The address the explorer listens on (`ffmem serve --host`); without an admin token, "
        "writes are allowed on 127.0.0.1 (or ::1, localhost) only, from clients on this machine that no "
        "proxy passed on.",
    )
    device: str = Field("auto", description="auto (CUDA when available), cpu, cuda or cuda:N.")
    compiled_fold: bool = Field(
        False,
        description="Mining on a GPU (any device but the CPU): the torch fold's passes over each group of "
        "layers compiled by torch.compile (needs triton; compiling takes about a minute a process). Off: "
        "run as they are. Mining on the CPU always runs its own compiled fold (numba).",
    )
    dtype: str = Field(
        "auto", description="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16 or float16."
    )

    @property
    def upload_folder(self) -> Path:
        """Where corpora uploaded from the browser go: `upload_dir`, or `corpora` in the data folder (its
        description); read from the current `database_url` (`ffmem serve --db` sets it on a copy)."""
        if self.upload_dir is not None:
            return self.upload_dir
        url = make_url(self.database_url)
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            return Path(url.database).parent / "corpora"
        return Path("data/corpora")

    @field_validator("admin_token", mode="before")
    @classmethod
    def _no_empty_token(cls, value):
        """An empty token (FFMEM_ADMIN_TOKEN= in a compose file) is no token, not one anyone can send."""
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("trace_rate_limit")
    @classmethod
    def _readable_rate_limit(cls, value: str) -> str:
        """A typo in the limit fails at start, with the `limits` library's message."""
        from limits import parse_many

        if value.strip() not in ("", "0"):
            parse_many(value)  # ValueError: couldn't parse rate limit string '…'
        return value


@lru_cache
def get_settings() -> Settings:
    return Settings()
