"""Quantization config front-ends."""
