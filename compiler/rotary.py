"""Fuse each query's and key's rotary embedding, with the head transpose before it, into ai.mxspd::Rotary.

Exported, Llama's `q * cos + rotate_half(q) * sin` on the transposed heads is 7 nodes (Transpose,
two Slices or a Split, Neg, Concat, two Muls, Add) for the queries and 7 for the keys of every layer:
14 of a layer's 34, each a few microseconds of dispatch on a few hundred floats. The kernel
(kernels/rotary.cc) does the same float operations, so the fused graph gives the same bits. Only
the exact pattern is fused (rotate-half over the whole head, halves of equal size); anything else
(CodeGen's interleaved rotary, partial rotary, models without it) is left as exported.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from compiler.invariance import Read, constant_value, drop_dead
from compiler.layouts import HEADS_FIRST, attribute, tensor_shapes
from kernels import DOMAIN, ROTARY

ONNX_DOMAINS = ("", "ai.onnx")


def _op(node: onnx.NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ONNX_DOMAINS


class _Graph:
    def __init__(self, model: onnx.ModelProto, read: Read, shapes: dict[str, list[int | None]]) -> None:
        self.model, self.read, self.shapes = model, read, shapes
        self.producer = {o: n for n in model.graph.node for o in n.output}

    def const(self, name: str) -> list[int] | None:
        if not name:
            return None
        value = constant_value(name, self.model, self.read)
        return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]

    def halves(self, first: str, second: str) -> str | None:
        """The tensor X whose last dimension `first` and `second` are the lower and upper halves of."""
        a, b = self.producer.get(first), self.producer.get(second)
        if a is None or b is None:
            return None
        if a is b and _op(a, "Split") and list(a.output) == [first, second]:
            x = a.input[0]
            sizes = self.const(a.input[1]) if len(a.input) > 1 else attribute(a, "split")
            d = (self.shapes.get(x) or [None])[-1]
            last = attribute(a, "axis", 0) in (-1, len(self.shapes.get(x) or []) - 1)
            even = d is not None and d % 2 == 0 and (sizes is None or list(sizes) == [d // 2, d // 2])
            return x if last and even else None
        if not (_op(a, "Slice") and _op(b, "Slice") and a.input[0] == b.input[0]):
            return None
        x = a.input[0]
        shape = self.shapes.get(x) or []
        d = shape[-1] if shape else None
        if not d or d % 2:
            return None
        spans = []
        for s in (a, b):
            starts, ends = self.const(s.input[1]), self.const(s.input[2])
            axes = self.const(s.input[3]) if len(s.input) > 3 else None
            steps = self.const(s.input[4]) if len(s.input) > 4 else None
            if starts is None or ends is None or len(starts) != 1 or axes not in ([-1], [len(shape) - 1]) \
                    or steps not in (None, [1]):
                return None
            spans.append((starts[0], min(ends[0], d)))
        return x if spans == [(0, d // 2), (d // 2, d)] else None

    def tables(self, x: str, cos: str, sin: str) -> bool:
        """cos and sin in the form the kernel reads: [B or 1, 1, T, D] for x [B, H, T, D]."""
        shape, c = self.shapes.get(x) or [], self.shapes.get(cos)
        return (len(shape) == 4 and None not in shape and c == self.shapes.get(sin) and c is not None
                and len(c) == 4 and c[0] in (1, shape[0]) and c[1:] == [1, *shape[2:]])

    def rotary(self, add: onnx.NodeProto) -> tuple[str, str, str] | None:
        """(the heads before their transpose, cos, sin) if `add` ends a rotate-half rotary embedding."""
        muls = [self.producer.get(i) for i in add.input]
        if len(muls) != 2 or not all(_op(m, "Mul") for m in muls):
            return None
        for turned, plain in (muls, muls[::-1]):
            for cat, sin in (turned.input, turned.input[::-1]):
                concat = self.producer.get(cat)
                if not _op(concat, "Concat") or len(concat.input) != 2:
                    continue
                neg = self.producer.get(concat.input[0])
                if not _op(neg, "Neg") or (x := self.halves(concat.input[1], neg.input[0])) is None:
                    continue
                if x not in plain.input or sin in (x, cat):
                    continue
                cos = plain.input[1] if plain.input[0] == x else plain.input[0]
                if not self.tables(x, cos, sin):
                    continue
                transpose = self.producer.get(x)
                if _op(transpose, "Transpose") and list(attribute(transpose, "perm", [])) == HEADS_FIRST:
                    return transpose.input[0], cos, sin
        return None


def fuse_rotary(model: onnx.ModelProto, read: Read = lambda t: t.raw_data,
                shapes: dict[str, list[int | None]] | None = None) -> int:
    """Replace every rotate-half rotary embedding (and its head transpose) by one Rotary node, in place;
    returns how many were fused. `shapes`: compiler.layouts.tensor_shapes (taken here if not given)."""
    graph = _Graph(model, read, tensor_shapes(model) if shapes is None else shapes)
    fused = 0
    for node in model.graph.node:
        if _op(node, "Add") and (found := graph.rotary(node)) is not None:
            rotated = helper.make_node(ROTARY, list(found), list(node.output), name=f"{node.name or 'rotary'}_fused",
                                       domain=DOMAIN)
            node.CopyFrom(rotated)
            fused += 1
    if fused:
        drop_dead(model.graph)
    return fused
