"""Turns exported graphs into a compiled artifact for one target (ort-cpu, ort-cuda): `compiler.build`.

What a target means (one `Target` record each: provider, device, optimisation, float16) is in
`common/targets.py`, read by the runtime too.
"""
