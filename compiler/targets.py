"""What each target means for ONNX Runtime: providers, and the optimisation done ahead of time."""

from __future__ import annotations

import os

import onnxruntime as ort

PROVIDERS = {
    "ort-cpu": ["CPUExecutionProvider"],
    "ort-cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
}
# Saved offline at EXTENDED: it is portable across machines of the target (ALL adds layout
# transforms specific to the CPU that runs them). CUDA graphs are prepared provider-independently
# (BASIC) so that they can be built on a machine without a GPU.
OFFLINE_LEVEL = {
    "ort-cpu": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "ort-cuda": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
}


class TargetUnavailableError(RuntimeError):
    """The execution provider a target needs is not installed here."""


def check_target(target: str) -> None:
    if target not in PROVIDERS:
        raise ValueError(f"unknown target {target!r}; choose one of {sorted(PROVIDERS)}")
    needed = PROVIDERS[target][0]
    available = ort.get_available_providers()
    if needed not in available:
        raise TargetUnavailableError(
            f"target {target!r} needs ONNX Runtime's {needed}, which this installation lacks "
            f"(available: {available}). For ort-cuda install onnxruntime-gpu on a machine with "
            "an NVIDIA GPU and CUDA; for this machine use target ort-cpu."
        )


def session_options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return so
