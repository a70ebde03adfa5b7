"""Host runtime: load a compiled artifact and generate (autoregressive or speculative)."""

from runtime.artifact import Artifact, ArtifactBusyError, load_artifact
from runtime.generate import GenerationResult, Metrics, PromptTooLongError, generate, stream
from runtime.model_runner import NonFiniteLogitsError
from runtime.sampling import SamplingParams

__all__ = [
    "Artifact", "ArtifactBusyError", "GenerationResult", "Metrics", "NonFiniteLogitsError", "PromptTooLongError",
    "SamplingParams",
    "generate", "load_artifact", "stream",
]
