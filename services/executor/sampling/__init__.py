"""From logits to tokens: the sampler's ladder, penalties, truncation, logprobs, speculative
verification and grammar constraints, batched per step."""
