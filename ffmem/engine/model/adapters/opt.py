"""OPT family: ReLU memories in fc1 / fc2, pre-LN blocks (the FF works on flattened [batch·pos, d] rows).

Post-LN OPT (do_layer_norm_before=False, OPT-350m) normalizes after the residual add, so o ≠ r + y,
and it projects (project_out) between the last block and the unembedding: `unsupported` says so.
"""

from transformers import PretrainedConfig

from ffmem.engine.model.adapters.base import Adapter

ADAPTER = Adapter(
    family="opt",
    architectures=("OPTForCausalLM",),
    layers="model.decoder.layers",
    ff_norm="final_layer_norm",
    keys="fc1",
    values="fc2",
    activation=lambda config: config.activation_function,
    final_norm="model.decoder.final_layer_norm",
    unembedding="lm_head",
)


def unsupported(config: PretrainedConfig) -> str | None:
    """Why this OPT config breaks the r + y = o decomposition or the unembedding path, else None."""
    if not config.do_layer_norm_before:
        return (
            "post-LN OPT (do_layer_norm_before=False, e.g. OPT-350m) normalizes each block's output "
            "after the residual add, so its FF memories do not decompose as r + y = o"
        )
    if config.word_embed_proj_dim != config.hidden_size:
        return (
            "OPT with project_out (word_embed_proj_dim ≠ hidden_size) maps o to another space "
            "before the unembedding"
        )
    if getattr(config, "_remove_final_layer_norm", False):
        return "OPT without a final layer norm (_remove_final_layer_norm=True)"
    return None
