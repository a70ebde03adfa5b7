"""The streaming exporter: memory bounded by a tensor, the same weights as the in-memory passes, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from transformers import LlamaConfig

from benchmarks.make_checkpoint import tensor_shapes, write_safetensors
from export.loader import CheckpointError, placeholder_model
from export.onnx_export import export_model, trace_graph
from export.weights import CheckpointTensors, model_tensors
from quant.onnx_pass import Float16Pass, MXPass, PassChain, apply_passes
from tests.conftest import make_model

C = 32
ROOT = Path(__file__).resolve().parents[1]

# 325M parameters, 1.21 GiB in float32; a small vocabulary keeps the largest tensor at 11 MiB.
BIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
           vocab_size=8000, max_position_embeddings=512, tie_word_embeddings=False)
PEAK_FRACTION = 0.4  # of the float32 model: the old exporter peaked above 5x (a float32 copy, 4.5 in tracing)

CHILD = textwrap.dedent("""
    import resource
    import sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from export.loader import placeholder_model
    from export.onnx_export import export_model
    from export.weights import CheckpointTensors
    if sys.argv[1] == "export":
        ckpt, out = Path(sys.argv[2]), Path(sys.argv[3])
        export_model(placeholder_model(ckpt, 64), CheckpointTensors(ckpt), out, {{"prefill": 8, "decode": 1}}, 64,
                     progress=False)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def _child_peak_bytes(*args: str) -> int:
    """Peak RSS of a fresh child process (its own ru_maxrss, in KiB on Linux): the RUSAGE_CHILDREN
    maximum of this process would include whatever other tests ran before."""
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), *args], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1]) * 1024


def test_export_peak_memory_is_bounded_by_a_tensor_not_the_model(tmp_path):
    ckpt = tmp_path / "big"
    ckpt.mkdir()
    config = LlamaConfig(**BIG)
    shapes = tensor_shapes(config)
    write_safetensors(ckpt / "model.safetensors", shapes, seed=0, progress=False)
    config.save_pretrained(ckpt)
    fp32 = 4 * sum(int(np.prod(s)) for s in shapes.values())

    baseline = _child_peak_bytes("imports")  # the interpreter and the libraries, no model
    peak = _child_peak_bytes("export", str(ckpt), str(tmp_path / "out"))
    written = (tmp_path / "out" / "weights.bin").stat().st_size
    assert written >= 0.99 * fp32  # the whole model went through (float32; equal norm weights are stored once)
    grown = peak - baseline
    assert grown < PEAK_FRACTION * fp32, (
        f"export grew {grown / 2**30:.2f} GiB above the interpreter's {baseline / 2**30:.2f} GiB for a "
        f"{fp32 / 2**30:.2f} GiB float32 model (bound: {PEAK_FRACTION} of it)"
    )


def _initializers(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path), load_external_data=True)
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("kind", ["llama-tied", "codegen", "qwen2"])
def test_streamed_graph_equals_the_in_memory_passes_byte_for_byte(kind, tmp_path):
    """Per-tensor streaming through MX and float16 gives the graph the graph-level passes give."""
    model = make_model(kind, seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    export_model(placeholder_model(tmp_path / "ckpt", C), CheckpointTensors(tmp_path / "ckpt"), tmp_path / "out",
                 {"decode": 1, "score": 3}, C, passes=PassChain([MXPass(lm_head=True), Float16Pass()]),
                 progress=False)
    for graph, tokens in (("decode", 1), ("score", 3)):
        reference = trace_graph(model, tokens, C)
        assert apply_passes(reference, [MXPass(lm_head=True), Float16Pass()]) > 0
        streamed = onnx.load(str(tmp_path / "out" / f"{graph}.onnx"), load_external_data=False)
        assert [(n.op_type, list(n.input), list(n.output)) for n in streamed.graph.node] == \
               [(n.op_type, list(n.input), list(n.output)) for n in reference.graph.node]
        assert streamed.opset_import == reference.opset_import
        ours = _initializers(tmp_path / "out" / f"{graph}.onnx")
        theirs = {t.name: numpy_helper.to_array(t) for t in reference.graph.initializer}
        assert ours.keys() == theirs.keys()
        for name, array in theirs.items():
            assert ours[name].dtype == array.dtype and ours[name].tobytes() == array.tobytes(), name


def test_bfloat16_sharded_checkpoints_are_read_exactly(tmp_path):
    model = make_model("llama-gqa", seed=5).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    tensors = CheckpointTensors(tmp_path / "ckpt")
    for key, value in model.state_dict().items():
        assert tensors(key).dtype == torch.bfloat16 and torch.equal(tensors(key), value), key
    dims = export_model(placeholder_model(tmp_path / "ckpt", C), tensors, tmp_path / "out", {"decode": 1}, C,
                        progress=False)
    assert dims.n_layers == 2


def test_progress_counts_tensors_and_bytes(tmp_path, capsys):
    model = make_model("draft", seed=1)
    export_model(model, model_tensors(model), tmp_path / "out", {"decode": 1}, C, role="dlm")
    err = capsys.readouterr().err
    assert "weights DLM" in err and "tensors" in err and "B/s" in err


def test_unusable_checkpoints_get_clear_errors(tmp_path):
    model = make_model("draft", seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    placeholder = placeholder_model(ckpt, C)

    with pytest.raises(CheckpointError, match="safetensors only"):
        (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
        CheckpointTensors(ckpt)
    (ckpt / "pytorch_model.bin").rename(ckpt / "model.safetensors")

    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        export_model(placeholder, CheckpointTensors(ckpt), tmp_path / "a", {"decode": 1}, C, progress=False)

    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_size])
    header["model.norm.weight_renamed"] = header.pop("model.norm.weight")
    blob = json.dumps(header).encode()
    (ckpt / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + header_size:])
    with pytest.raises(CheckpointError, match="no tensor 'model.norm.weight'"):
        export_model(placeholder, CheckpointTensors(ckpt), tmp_path / "b", {"decode": 1}, C, progress=False)

    (ckpt / "model.safetensors").write_bytes(data)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    shape = r"'model.layers.0.mlp.gate_proj.weight' has shape \[64, 32\] in the checkpoint; its config implies \[48"
    with pytest.raises(CheckpointError, match=shape):
        export_model(placeholder_model(ckpt, C), CheckpointTensors(ckpt), tmp_path / "c", {"decode": 1}, C,
                     progress=False)
