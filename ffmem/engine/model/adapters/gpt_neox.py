"""GPT-NeoX family (Pythia): parallel attention/FF when config.use_parallel_residual, else sequential.

The unembedding is `lm_head` from transformers 5 on (4.x called it `embed_out`).
"""

from ffmem.engine.model.adapters.base import Adapter

ADAPTER = Adapter(
    family="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    layers="gpt_neox.layers",
    ff_norm="post_attention_layernorm",
    parallel=lambda config: config.use_parallel_residual,
    keys="mlp.dense_h_to_4h",
    values="mlp.dense_4h_to_h",
    activation=lambda config: config.hidden_act,
    final_norm="gpt_neox.final_layer_norm",
    unembedding="lm_head",
)
