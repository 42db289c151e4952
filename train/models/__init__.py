"""The policy model: loading it, its vision side, generation, merged LoRA and the prediction store."""
