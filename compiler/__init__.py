"""Turns exported graphs into a compiled artifact for one target (ort-cpu, ort-cuda): `compiler.build`.

Nothing is imported here, so the runtime can read `compiler.targets` without onnx or torch.
"""
