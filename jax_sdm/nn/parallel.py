"""Sharding the `SparseDeltaMemory` layer's parameters over devices.

`head_parallel_specs(layer, axis)` gives a PartitionSpec for every parameter of a layer so that its heads are split
along a mesh axis: the projections that make per-head columns (queries, values, strengths, gates, output gate) are
column-parallel, the per-head parameters (`A_log`, `dt_bias`, slot keys, the initial bank) are split along their
head axis and the output projection is row-parallel (XLA sums its partial products across the axis). With the
activations replicated along that axis, each device then runs the recurrence of its own heads (the op's streams
are independent) and no bank ever moves. `num_heads` must be divisible by the axis size.
"""
from flax import nnx
from jax.sharding import PartitionSpec as P

# Each parameter's axis that runs over the heads (a per-head block of columns or rows, or the head index itself).
_HEAD_AXIS = {
    ("write_query", "kernel"): 1, ("read_query", "kernel"): 1,
    ("write_query", "bias"): 0, ("read_query", "bias"): 0,
    ("value_proj", "kernel"): 1, ("value_proj", "bias"): 0, ("beta_proj", "kernel"): 1, ("beta_proj", "bias"): 0,
    ("gate_proj", "kernel"): 1, ("gate_proj", "bias"): 0, ("output_gate", "kernel"): 1, ("output_gate", "bias"): 0,
    ("write_norm", "scale"): 0, ("write_norm", "bias"): 0, ("read_norm", "scale"): 0, ("read_norm", "bias"): 0,
    ("out_proj", "kernel"): 0,
    ("A_log",): 0, ("dt_bias",): 0, ("slot_keys",): 0, ("bank",): 0,
}
_REPLICATED = {("norm", "scale"), ("norm", "bias"), ("out_proj", "bias")}


def head_parallel_specs(layer, axis):
    """An `nnx.State` of PartitionSpecs over `layer`'s parameters (`nnx.state(layer, nnx.Param)`'s structure):
    each head-indexed parameter split along `axis` at its head axis, the rest replicated."""
    params = nnx.state(layer, nnx.Param)

    def spec(path, value):
        key = tuple(str(getattr(k, "key", k)) for k in path)
        if key in _REPLICATED:
            return P()
        if key not in _HEAD_AXIS:
            raise ValueError(f"head_parallel_specs: no head axis known for parameter {'.'.join(key)}")
        at = _HEAD_AXIS[key]
        return P(*([None] * at + [axis]))

    return nnx.map_state(spec, params) if hasattr(nnx, "map_state") else _map(spec, params)


def _map(fn, state):
    import jax
    return jax.tree_util.tree_map_with_path(lambda path, v: fn(path, v), state)
