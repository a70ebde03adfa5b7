"""Traces Hugging Face causal LMs into fixed-shape ONNX graphs with an explicit KV cache."""
