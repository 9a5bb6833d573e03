"""Build a `SparseDeltaMemory` from a state dict of the PyTorch reference layer (`sparse-delta-memory`).

The reference layer's parameters (torch `Linear` weights are `[out, in]`; `H` heads, `d = d_model`,
`n = sqrt(slots_per_head)`, `key_size = H * 2n`):

| reference name | shape | here |
|---|---|---|
| `Wk_write.weight`, `.bias` | `[key_size, d]`, `[key_size]` | `write_query` (direct factor scores: per head `n` columns of the first factor, then `n` of the second) |
| `Wq_read.weight`, `.bias` | `[key_size, d]`, `[key_size]` | `read_query` |
| `Wv_write.weight`, `.bias` | `[d, d]`, `[d]` | `value_proj` |
| `a_proj.weight`, `.bias` | `[H, d]`, `[H]` | `gate_proj` (the log-gate's input) |
| `b_proj.weight`, `.bias` | `[H, d]`, `[H]` | `beta_proj` (the write strength's input) |
| `A_log`, `dt_bias` | `[H]` | `A_log`, `dt_bias` |
| `Wo.weight`, `.bias` | `[d, d]` | `out_proj` |
| `Wog.weight`, `.bias` (with its output gate) | `[d, d]` | `output_gate` |
| `memory` (with its learned memory) | `[H * slots_per_head, d / H]` | `bank` `[H, slots_per_head, d / H]` |
| `readings_norm.weight`, `.bias` (with normalised readings) | `[d / H]` | `norm` (LayerNorm) |
| `key_bn.*`, `query_bn.*` (with its query batch norm) | `[key_size]` | `write_norm`, `read_norm` (`weight`, `bias`, `running_mean`, `running_var`; `num_batches_tracked` unused) |

Needs neither torch nor the reference package: values are numpy arrays, or anything with
`.detach().cpu().numpy()` (torch tensors, bfloat16 ones too).
"""
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layer import ACTIVATIONS, SparseDeltaMemory

# The reference layer's options (its `SparseDeltaMemoryArgs`) that shape the computation, with its defaults.
REFERENCE_DEFAULTS = dict(num_writes=1, num_reads=1, read_act="Softmax", write_act="Softmax", read_act_scale=1.0,
                          write_act_scale=1.0, norm_eps=1e-6, key_weighted_decay=False)


def _numpy(name, value):
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu()
        if "bfloat16" in str(getattr(value, "dtype", "")):
            value = value.float()
        value = value.numpy()
    try:
        return np.asarray(value)
    except Exception as err:
        raise TypeError(f"load_reference_state_dict: `{name}` is not an array ({type(value).__name__})") from err


def _option(args, name):
    if args is None:
        return REFERENCE_DEFAULTS[name]
    if isinstance(args, dict):
        return args.get(name, REFERENCE_DEFAULTS[name])
    return getattr(args, name, REFERENCE_DEFAULTS[name])


def _activation(name, scale):
    """The reference's activation name and scale -> ours (its scale multiplies softmax's input only)."""
    key = str(name).lower()
    if key not in ACTIVATIONS:
        raise ValueError(f"load_reference_state_dict: the reference activation {name!r} has no counterpart here "
                         f"(known: {tuple(ACTIVATIONS)})")
    return key, (float(scale) if key == "softmax" else 1.0)


def load_reference_state_dict(state_dict, args=None, *, prefix="", dtype=jnp.float32, param_dtype=jnp.float32,
                              rngs=None, **options):
    """A `SparseDeltaMemory` whose parameters are the reference layer's `state_dict`, computing what it computes.

    Args:
      state_dict: a mapping from the reference layer's parameter names (see the module docstring) to arrays
        (numpy, or torch tensors by duck typing). Keys outside `prefix` are ignored.
      args: the reference layer's `SparseDeltaMemoryArgs` (or a dict with its field names): `num_writes`,
        `num_reads`, `read_act`, `write_act`, `read_act_scale`, `write_act_scale`, `norm_eps`,
        `key_weighted_decay` are read from it (the reference's defaults where missing). Everything else (width,
        heads, slots, output gate, readings norm, batch norm, learned memory) comes from the state dict.
      prefix: the layer's prefix in a model's state dict (e.g. `"layers.3.sdm."`).
      dtype, param_dtype: as for `SparseDeltaMemory`.
      rngs: unused randomness for the constructor (default `nnx.Rngs(0)`).
      **options: further `SparseDeltaMemory` options (`chunk_size`, `impl`, ...); options the state dict or
        `args` decide cannot be overridden.

    Returns the layer. Its `__call__` on `x [B, T, d]` gives the reference layer's output and final memory (as
    `[B, H, K, D]`) up to rounding; with batch norm, `layer.eval()` matches the reference's `eval()` and
    `layer.train()` its training mode (whose running variance is unbiased there and biased here).
    Raises `KeyError` naming missing or unexpected keys and `ValueError` naming a key of the wrong shape.
    """
    state = {name[len(prefix):]: _numpy(name, value) for name, value in state_dict.items()
             if name.startswith(prefix)}
    for required in ("Wv_write.weight", "a_proj.weight", "Wk_write.weight"):
        if required not in state:
            raise KeyError(f"load_reference_state_dict: missing key {prefix + required!r} (keys: "
                           f"{sorted(state)[:12]}{' ...' if len(state) > 12 else ''})")
    if any(state[name].ndim != 2 for name in ("Wv_write.weight", "a_proj.weight", "Wk_write.weight")):
        raise ValueError(f"load_reference_state_dict: {prefix}Wv_write.weight, a_proj.weight and Wk_write.weight "
                         f"must be matrices [out, in]")
    d_model = int(state["Wv_write.weight"].shape[1])
    H = int(state["a_proj.weight"].shape[0])
    key_size = int(state["Wk_write.weight"].shape[0])
    if key_size % (2 * H):
        raise ValueError(f"load_reference_state_dict: {prefix}Wk_write.weight has {key_size} rows, not 2 * n per "
                         f"head for {H} heads")
    n = key_size // (2 * H)
    K, D = n * n, d_model // H
    output_gate = "Wog.weight" in state
    layer_norm = "readings_norm.weight" in state
    batchnorm = "query_bn.weight" in state or "key_bn.weight" in state
    learned = "memory" in state

    shapes = {"Wq_read.weight": (key_size, d_model), "Wq_read.bias": (key_size,),
              "Wk_write.weight": (key_size, d_model), "Wk_write.bias": (key_size,),
              "Wv_write.weight": (d_model, d_model), "Wv_write.bias": (d_model,),
              "a_proj.weight": (H, d_model), "a_proj.bias": (H,), "b_proj.weight": (H, d_model), "b_proj.bias": (H,),
              "A_log": (H,), "dt_bias": (H,), "Wo.weight": (d_model, d_model), "Wo.bias": (d_model,)}
    if output_gate:
        shapes.update({"Wog.weight": (d_model, d_model), "Wog.bias": (d_model,)})
    if learned:
        shapes["memory"] = (H * K, D)
    if layer_norm:
        shapes.update({"readings_norm.weight": (D,), "readings_norm.bias": (D,)})
    optional = set()
    if batchnorm:
        for bn in ("query_bn", "key_bn"):
            shapes.update({f"{bn}.{p}": (key_size,) for p in ("weight", "bias", "running_mean", "running_var")})
            optional.add(f"{bn}.num_batches_tracked")
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes) - optional)
    if missing:
        raise KeyError(f"load_reference_state_dict: missing keys {[prefix + m for m in missing]}")
    if unexpected:
        raise KeyError(f"load_reference_state_dict: unexpected keys {[prefix + u for u in unexpected]} (not a "
                       f"parameter of the reference SparseDeltaMemory layer)")
    arrays = {name: state[name] for name in shapes}
    for name, shape in shapes.items():
        if arrays[name].shape != shape:
            raise ValueError(f"load_reference_state_dict: {prefix + name!r} has shape {arrays[name].shape}, "
                             f"expected {shape} (d_model {d_model}, {H} heads, {K} slots per head)")

    write_activation, write_scale = _activation(_option(args, "write_act"), _option(args, "write_act_scale"))
    read_activation, read_scale = _activation(_option(args, "read_act"), _option(args, "read_act_scale"))
    decided = dict(num_heads=H, slots_per_head=K, head_dim=D, addressing="product_key", factor_scores="direct",
                   product_key_factors=(n, n), write_activation=write_activation, read_activation=read_activation,
                   write_scale=write_scale, read_scale=read_scale,
                   gate="write" if _option(args, "key_weighted_decay") else "token", query_batchnorm=batchnorm,
                   output_gate=output_gate, readout_norm="layer" if layer_norm else None,
                   norm_eps=float(_option(args, "norm_eps")), use_bias=True,
                   initial_bank="learned" if learned else "zeros", bank_init_std=0.0)
    clash = sorted(set(options) & (set(decided) | {"num_writes", "num_reads"}))
    if clash:
        raise ValueError(f"load_reference_state_dict: {clash} come from the state dict or `args`; they cannot be "
                         f"passed as options")
    layer = SparseDeltaMemory(d_model, num_writes=int(_option(args, "num_writes")),
                              num_reads=int(_option(args, "num_reads")), dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs if rngs is not None else nnx.Rngs(0), **decided, **options)

    def put(variable, value):
        value = jnp.asarray(value, variable[...].dtype)
        assert value.shape == variable[...].shape, (value.shape, variable[...].shape)
        variable[...] = value

    def linear(module, name):
        put(module.kernel, arrays[f"{name}.weight"].T)
        put(module.bias, arrays[f"{name}.bias"])

    linear(layer.write_query, "Wk_write")
    linear(layer.read_query, "Wq_read")
    linear(layer.value_proj, "Wv_write")
    linear(layer.gate_proj, "a_proj")
    linear(layer.beta_proj, "b_proj")
    linear(layer.out_proj, "Wo")
    put(layer.A_log, arrays["A_log"])
    put(layer.dt_bias, arrays["dt_bias"])
    if output_gate:
        linear(layer.output_gate, "Wog")
    if learned:
        put(layer.bank, arrays["memory"].reshape(H, K, D))
    if layer_norm:
        put(layer.norm.scale, arrays["readings_norm.weight"])
        put(layer.norm.bias, arrays["readings_norm.bias"])
    if batchnorm:
        for module, bn in ((layer.write_norm, "key_bn"), (layer.read_norm, "query_bn")):
            put(module.scale, arrays[f"{bn}.weight"])
            put(module.bias, arrays[f"{bn}.bias"])
            put(module.mean, arrays[f"{bn}.running_mean"])
            put(module.var, arrays[f"{bn}.running_var"])
    assert math.prod(layer.factors) == K
    return layer
