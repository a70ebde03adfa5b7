"""Host runtime: load a compiled artifact and generate (autoregressive, speculative, MultiDecode)."""

from runtime.artifact import Artifact, ArtifactBusyError
from runtime.beam_search import BeamSearchResult, BeamSequence, beam_search
from runtime.forest import CapacityError
from runtime.generate import generate, stream
from runtime.load import load_artifact
from runtime.model_runner import NonFiniteLogitsError
from runtime.multi import MultiMetrics, MultiResult, generate_multi, stream_branches
from runtime.request import PromptTooLongError
from runtime.results import GenerationResult, Metrics
from runtime.sampling import SamplingParams

__all__ = [
    "Artifact", "ArtifactBusyError", "BeamSearchResult", "BeamSequence", "CapacityError", "GenerationResult",
    "Metrics", "MultiMetrics", "MultiResult", "NonFiniteLogitsError", "PromptTooLongError", "SamplingParams",
    "beam_search", "generate", "generate_multi", "load_artifact", "stream", "stream_branches",
]
