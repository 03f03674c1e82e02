"""Loading a model: the embedded default, a Hugging Face id, a local folder or a .gguf file (`loading`), its
architecture's adapter (`adapters`), its FF memories read off a forward pass (`hooks`)."""
