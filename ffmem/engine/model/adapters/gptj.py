"""GPT-J family: attention and FF read the same ln_1 output in parallel, so r = o − y; lm_head has a bias."""

from ffmem.engine.model.adapters.base import Adapter

ADAPTER = Adapter(
    family="gptj",
    architectures=("GPTJForCausalLM",),
    layers="transformer.h",
    ff_norm=None,
    parallel=lambda config: True,
    keys="mlp.fc_in",
    values="mlp.fc_out",
    activation=lambda config: config.activation_function,
    final_norm="transformer.ln_f",
    unembedding="lm_head",
)
