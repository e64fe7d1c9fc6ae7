"""Quantization recipes and the writer of quantized checkpoints (see docs/checkpoint-format.md)."""
