"""Turns exported graphs into a compiled artifact for one target (ort-cpu, ort-cuda): `compiler.build`.

What a target means (providers, session options) is in `common/targets.py`, read by the runtime too.
"""
