"""LoRA adapters in the executor: the resident ones and their deltas in a step."""
