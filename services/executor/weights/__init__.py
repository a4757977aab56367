"""GGUF files: the config and tensors (gguf_loader), their block formats (gguf_quants), and the
tiles the integer kernel reads (quant_parts)."""
