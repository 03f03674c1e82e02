"""GPT-Neo family: GPT-2's block layout with nn.Linear projections (local/global attention alternates)."""

from engine.adapters.base import Adapter

ADAPTER = Adapter(
    family="gpt_neo",
    architectures=("GPTNeoForCausalLM",),
    layers="transformer.h",
    ff_norm="ln_2",
    keys="mlp.c_fc",
    values="mlp.c_proj",
    activation=lambda config: config.activation_function,
    final_norm="transformer.ln_f",
    unembedding="lm_head",
)
