"""GPT-2 family: plain GELU memories in `mlp.c_fc` / `mlp.c_proj` (Conv1D, weights stored [in, out])."""

from ffmem.engine.model.adapters.base import Adapter

ADAPTER = Adapter(
    family="gpt2",
    architectures=("GPT2LMHeadModel",),
    layers="transformer.h",
    ff_norm="ln_2",
    keys="mlp.c_fc",
    values="mlp.c_proj",
    activation=lambda config: config.activation_function,
    final_norm="transformer.ln_f",
    unembedding="lm_head",
)
