"""Quantization: weight-only methods applied at load time and checkpoints quantized elsewhere."""
