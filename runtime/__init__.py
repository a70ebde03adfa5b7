"""Host runtime: load a compiled artifact and generate (autoregressive or speculative)."""

from runtime.artifact import Artifact, load_artifact
from runtime.generate import GenerationResult, Metrics, PromptTooLongError, generate, stream
from runtime.sampling import SamplingParams

__all__ = [
    "Artifact", "GenerationResult", "Metrics", "PromptTooLongError", "SamplingParams",
    "generate", "load_artifact", "stream",
]
