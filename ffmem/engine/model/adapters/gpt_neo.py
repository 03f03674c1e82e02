"""GPT-Neo family: GPT-2's module paths with nn.Linear projections (local/global attention alternates).

Rows are read by layout (base.rows_out / rows_in), so GPT-2's adapter serves as it is.
"""

from dataclasses import replace

from ffmem.engine.model.adapters import gpt2

ADAPTER = replace(gpt2.ADAPTER, family="gpt_neo", architectures=("GPTNeoForCausalLM",))
