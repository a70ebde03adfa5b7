"""The KV store graph (common/graph_io.py: KV_STORE_FILE): commits a call's chosen rows of KV into
their cache slots on the device that holds the cache, for every layer at once, in four ops."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from common import graph_io as io
from common.graph_io import ModelDims

_ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


def store_graph(dims: ModelDims, slots: int) -> onnx.ModelProto:
    kv = _ONNX_TYPES[np.dtype(dims.kv_dtype)]
    lead = [2 * dims.n_layers, 1, dims.n_kv_heads]
    column = helper.make_tensor("slot_column_shape", TensorProto.INT64, [5], [1, 1, 1, -1, 1])
    nodes = [
        helper.make_node("Gather", [io.KV_NEW, io.KV_ROWS], ["picked"], axis=3),
        helper.make_node("Reshape", [io.KV_SLOTS, "slot_column_shape"], ["slot_column"]),
        helper.make_node("Shape", ["picked"], ["picked_shape"]),
        helper.make_node("Expand", ["slot_column", "picked_shape"], ["index"]),
        helper.make_node("ScatterElements", [io.KV_CACHE, "index", "picked"], [io.KV_CACHE_OUT], axis=3),
    ]
    graph = helper.make_graph(
        nodes, "kv_store",
        [helper.make_tensor_value_info(io.KV_CACHE, kv, [*lead, slots, dims.head_dim]),
         helper.make_tensor_value_info(io.KV_NEW, kv, [*lead, "T", dims.head_dim]),
         helper.make_tensor_value_info(io.KV_ROWS, TensorProto.INT64, ["m"]),
         helper.make_tensor_value_info(io.KV_SLOTS, TensorProto.INT64, ["m"])],
        [helper.make_tensor_value_info(io.KV_CACHE_OUT, kv, [*lead, slots, dims.head_dim])],
        initializer=[column],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
