"""Turns exported graphs into a compiled artifact for one target (ort-cpu, ort-cuda)."""

from compiler.build import compile_artifact

__all__ = ["compile_artifact"]
