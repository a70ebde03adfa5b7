"""benchmarks.rotation's arithmetic: rotating a linear's inputs and its weights by the same 32-block Hadamard
leaves the float product unchanged (what lets the study quantize the rotated weights alone), and the
standard-library calibration text it and benchmarks.accuracy name."""

import torch

from benchmarks.accuracy import STDLIB_TRAIN, STDLIB_TRAIN_CHARS, calibration_reference
from benchmarks.rotation import BLOCK, hadamard, rotate_rows


def test_rotating_inputs_and_weights_by_the_same_blocks_keeps_the_product():
    h = hadamard()
    assert torch.allclose(h @ h.T, torch.eye(BLOCK, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * BLOCK, dtype=torch.float64, generator=gen)
    w = torch.randn(2 * BLOCK, 5, dtype=torch.float64, generator=gen)
    rotated_x = (x.reshape(3, 2, BLOCK) @ h).reshape(x.shape)  # the study's hook on a linear's input
    assert torch.allclose(rotated_x @ rotate_rows(w, h), x @ w)
    assert not torch.allclose(x @ rotate_rows(w, h), x @ w, atol=1e-3)  # the weights alone: another product


def test_the_standard_library_calibration_text_is_written_and_other_names_pass_through(tmp_path):
    path = calibration_reference(STDLIB_TRAIN, tmp_path)
    text = open(path).read()
    assert len(text) == STDLIB_TRAIN_CHARS and "def " in text
    assert calibration_reference("builtin:smollm2-135m-chat-calibration", tmp_path) == (
        "builtin:smollm2-135m-chat-calibration")
