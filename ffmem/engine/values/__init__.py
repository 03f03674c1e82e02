"""Reading values out: every value's tokens and logit histogram under both readouts (`projection`), the
inverse token → memories table (`token_memories`), how a token shows to a person (`token_display`)."""
