"""Llama family: Llama, Mistral, Qwen2/3, SmolLM — gated SwiGLU memories, RMSNorm, no biases."""

from ffmem.engine.model.adapters.base import Adapter

ADAPTER = Adapter(
    family="llama",
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ),
    layers="model.layers",
    ff_norm="post_attention_layernorm",
    keys="mlp.up_proj",
    gates="mlp.gate_proj",
    values="mlp.down_proj",
    activation=lambda config: config.hidden_act,
    final_norm="model.norm",
    unembedding="lm_head",
)
