"""What each target means for ONNX Runtime (one `Target` record each: provider, device, the optimisation
done ahead of time, float16, prepacking) and how its sessions are opened.

Read by the compiler (to build for a target) and the runtime (to open sessions the same way), so
it lives with the shared types."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import onnxruntime as ort

from kernels import cuda_library_path, library_path


@dataclass(frozen=True)
class Target:
    """Everything a target means, in one record: read by the compiler to build for it and by the runtime
    (runtime/placement.py) to open its sessions and place its tensors the same way."""

    name: str
    provider: str  # the execution provider its sessions must get (ONNX Runtime falls back silently)
    device: str  # where its tensors live: the runtime keeps the KV cache and bound buffers there
    offline_level: ort.GraphOptimizationLevel  # the optimisation the compiler saves ahead of time
    float16: bool  # its graphs compute in float16
    prepacked: bool  # its compiled graphs carry ONNX Runtime's prepacked weights (CPU kernels' layouts)
    greedy_outputs: bool  # its graphs also return each row's greedy token (compiler/greedy_outputs.py)

    def providers(self, cuda_graph: bool = False) -> list:
        """The providers to open its sessions with; `cuda_graph`: replay each fixed-shape graph's kernels
        as one CUDA graph (its inputs and outputs must stay bound at the same device addresses)."""
        if self.device == "cuda":
            return [(self.provider, {"enable_cuda_graph": "1" if cuda_graph else "0"}), "CPUExecutionProvider"]
        return [self.provider]


# Saved offline at EXTENDED on the CPU: it is portable across machines of the target (ALL adds layout
# transforms specific to the CPU that runs them). CUDA graphs are prepared provider-independently
# (BASIC) so that they can be built on a machine without a GPU.
TARGETS = {
    "ort-cpu": Target("ort-cpu", "CPUExecutionProvider", "cpu", ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                      float16=False, prepacked=True, greedy_outputs=False),
    "ort-cuda": Target("ort-cuda", "CUDAExecutionProvider", "cuda", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                       float16=True, prepacked=False, greedy_outputs=True),
}


def get_target(name: str) -> Target:
    """The target of this name; an unknown name is refused with the list."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {sorted(TARGETS)}")
    return TARGETS[name]


# CPU features that select MLAS kernels, and so the layout of prepacked weights.
_KERNEL_FLAGS = (
    "sse3", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
    "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "asimddp", "i8mm", "bf16", "sve", "sme",
)


def platform_signature() -> dict[str, str]:
    """What prepacked weights built here are valid for: ONNX Runtime's version and the CPU's kernels."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags |= set(line.split(":", 1)[1].split()) & set(_KERNEL_FLAGS)
    except OSError:
        pass
    return {"onnxruntime": ort.__version__, "machine": platform.machine(), "cpu_flags": " ".join(sorted(flags))}


def check_prepacked(built_for: dict[str, str]) -> None:
    """Refuse prepacked weights built for another ONNX Runtime or CPU: ORT would either fail on them or
    silently repack a private copy in every session."""
    here = platform_signature()
    if built_for and built_for != here:
        diff = {k: (built_for.get(k), here.get(k)) for k in sorted(set(built_for) | set(here))
                if built_for.get(k) != here.get(k)}
        raise TargetUnavailableError(
            "this artifact's prepacked weights were built for another platform: "
            + "; ".join(f"{k}: artifact {a!r}, this machine {b!r}" for k, (a, b) in diff.items())
            + ". Re-run `python -m export` on this machine (prepacking is done at build time)."
        )


def check_session(session: ort.InferenceSession, target: Target) -> None:
    """ONNX Runtime falls back to the CPU silently when the GPU provider cannot start (no GPU, no CUDA
    libraries): refuse instead of running a GPU artifact's float16 graphs on the CPU."""
    needed = target.provider
    if session.get_providers()[0] != needed:
        raise TargetUnavailableError(
            f"target {target.name!r}: ONNX Runtime could not start {needed} (no GPU visible, or CUDA/cuDNN "
            f"libraries missing; see ONNX Runtime's log above); this session got {session.get_providers()}"
        )


class TargetUnavailableError(RuntimeError):
    """The execution provider a target needs is not installed here."""


_GPU_INSTALL = ("`pip uninstall -y onnxruntime && pip install --force-reinstall --no-deps 'onnxruntime-gpu>=1.31'`")


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def check_target(target: Target) -> None:
    """Refuse a target whose execution provider this ONNX Runtime lacks, saying how to get it."""
    needed = target.provider
    available = ort.get_available_providers()
    if needed not in available:
        both = _installed("onnxruntime") and _installed("onnxruntime-gpu")
        raise TargetUnavailableError(
            f"target {target.name!r} needs ONNX Runtime's {needed}, which this installation lacks "
            f"(available: {available}). "
            + ("Both onnxruntime and onnxruntime-gpu are installed, and they share one `onnxruntime` module: "
               f"{_GPU_INSTALL} (docs/gpu.md). " if both else
               f"For ort-cuda, on a machine with an NVIDIA GPU: `pip install 'mxspd[cuda]'`, then {_GPU_INSTALL}; ")
            + "for this machine use target ort-cpu."
        )
    on_gpu = target.device == "cuda"
    if on_gpu and importlib.util.find_spec("nvidia") is not None and hasattr(ort, "preload_dlls"):
        with contextlib.suppress(Exception):  # else the session's start names what is missing (check_session)
            ort.preload_dlls()  # pip's CUDA and cuDNN wheels (the [cuda] extra) are not on the loader's path


def session_options(threads: int | None = None, library: Path | None = None, target: Target | None = None
                    ) -> ort.SessionOptions:
    """`library`: another build of mxspd's kernels than the installed one (benchmarks compare builds). A
    GPU target's sessions get the CUDA kernels' library (kernels/cuda_build.py) where it is built, not the
    CPU one (two libraries of one domain cannot share a session; its graphs use no CPU kernel of ours)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    lib = library or (cuda_library_path() if target is not None and target.device == "cuda" else library_path())
    if lib is not None:  # mxspd's own ops (ai.mxspd), for graphs that use them
        so.register_custom_ops_library(str(lib))
    return so


def spin_within_calls(so: ort.SessionOptions) -> ort.SessionOptions:
    """A session's pool threads spin between the ops of a call and stop when it returns.

    Generation alternates sessions (prefill, decode; DLM steps, TLM scoring): a pool whose threads
    spin after its call takes the cores from the next session's call (inside SpD that made a TLM
    scoring call cost 2-3x a decode step), and a pool that never spins wakes its threads for each
    of a call's ~240 parallel ops (two threads were then no faster than one). docs/benchmarks-history.md:
    1.4x per decode call. A new pool's threads spin before their first sleep: see `parked_pools`.
    """
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


def _thread_ids() -> set[str]:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: nothing to wait for
        return set()


def _running(tids: set[str]) -> set[str]:
    running = set()
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread has exited
            continue
        if stat[stat.rindex(")") + 2] == "R":
            running.add(tid)
    return running


@contextmanager
def parked_pools(timeout_s: float = 2.0) -> Iterator[None]:
    """Sessions made inside: on leaving, wait until the threads their pools started have gone to sleep.

    A new pool's threads spin (~10 ms each on this kind of CPU) before they first sleep, and an
    artifact opens about a dozen sessions: for ~150 ms after a load they took the cores from the
    first calls, which then measured ~40x slow and misled the draft policy (tests/test_draft_policy.py).
    """
    before = _thread_ids()
    yield
    new = _thread_ids() - before
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < 3 and time.monotonic() < deadline:  # three quiet looks in a row: a thread seen
        quiet = 0 if _running(new) else quiet + 1     # between two spins is looked at again
        time.sleep(0.002)


def compiled_session_options(target: Target, threads: int | None = None) -> ort.SessionOptions:
    """How a compiled graph is loaded to run (by the runtime, and by the compiler to time it)."""
    so = session_options(threads, target=target)
    spin_within_calls(so)
    if target.prepacked:
        # Optimised at build time; optimising again could change a weight and so miss its
        # prepacked blob (ORT would then repack a private copy silently).
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so
