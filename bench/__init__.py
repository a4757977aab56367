"""`llmbus bench`: load generation against any OpenAI-compatible server, and side-by-side runs.

`serve` measures one server (ours or a peer's) with a streaming workload; `compare` starts llmbus
and each installed peer on the same GGUF one at a time and reports ratios. Nothing here imports
torch or the services, so benchmarking a peer needs only httpx and the tokenizer.
"""
