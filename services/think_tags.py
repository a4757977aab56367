"""The tags a thinking model writes around its reasoning (Qwen3, DeepSeek-R1 distills, QwQ):
the tokenizer decides from them whether a chat thinks, the api splits its output at them."""

THINK_START, THINK_END = "<think>", "</think>"
