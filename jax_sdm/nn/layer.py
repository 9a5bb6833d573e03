"""`SparseDeltaMemory`: the SDM sequence mixer as a Flax NNX layer (projections, sparse addressing, gates,
learned initial bank, decode state), and its jitted decode loop."""
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_sdm
from jax_sdm import ffi_ops, lowering
from jax_sdm.product_key import candidate_table
from jax_sdm.step import INFERENCE_ONLY

from .addressing import balanced_factors, topk_slots

ADDRESSINGS = ("product_key", "topk")
FACTOR_SCORES = ("direct", "sub_keys")
GATES = ("token", "write")
INITIAL_BANKS = ("learned", "zeros")
READOUT_NORMS = ("rms", "layer")
IMPLS = ("auto", "ffi", "xla", "reference")


def l2_normalize(x, axis=-1, eps=1e-12):
    """`x / (|x|_2 + eps)` along `axis`."""
    return x / (jnp.sqrt(jnp.sum(x * x, axis=axis, keepdims=True)) + eps)


# Weight activations, applied to the selected slots' scaled scores `[..., k]`. The names of the PyTorch reference
# layer's options ("Softmax", "l2_normalize", or a torch.nn activation's class name) map to these in lower case.
ACTIVATIONS = {
    "softmax": lambda s: jax.nn.softmax(s, axis=-1),
    "l2_normalize": l2_normalize,
    "identity": lambda s: s,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": lambda s: jax.nn.gelu(s, approximate=False),
    "silu": jax.nn.silu,
    "softplus": jax.nn.softplus,
}


def _gate_params(rng, num_heads, A_init_range, param_dtype):
    """`A_log`, `dt_bias` as in gated delta nets: the decay rate `A = exp(A_log)` uniform in `A_init_range`
    (at least 1e-4), and the step `softplus(dt_bias)` log-uniform in [1e-3, 1e-1], so that at init the per-token
    gates `-A * softplus(a + dt_bias)` mix long and short memories across heads."""
    rate_key, dt_key = jax.random.split(rng)
    low, high = (float(v) for v in A_init_range)
    A = jnp.maximum(jax.random.uniform(rate_key, (num_heads,), jnp.float32, low, high), 1e-4)
    dt = jnp.exp(jax.random.uniform(dt_key, (num_heads,), jnp.float32, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    dt_bias = dt + jnp.log(-jnp.expm1(-dt))  # the inverse of softplus
    return jnp.log(A).astype(param_dtype), dt_bias.astype(param_dtype)


class DecodeWeights(NamedTuple):
    """The parameters a decode step reads (`SparseDeltaMemory.projection_weights`)."""
    kernel: jax.Array  # [d_model, H, width]: the input projections, concatenated per head (computation dtype)
    bias: jax.Array | None  # [H, width]
    out_kernel: jax.Array  # [H * D, d_model]
    out_bias: jax.Array | None  # [d_model]
    gates: jax.Array  # [H, 2] float32: -exp(A_log), dt_bias
    norm: jax.Array  # [2, D] float32: the readout norm's scale and bias (zeros where it has none)


class SparseDeltaMemory(nnx.Module):
    """Sparse Delta Memory as a sequence-mixing layer: `x [B, T, d_model] -> y [B, T, d_model]`.

    Every head owns a bank of `slots_per_head` rows of width `head_dim`. At each token the layer projects `x`
    (one matmul for all of it) to write and read addresses, a value, a write strength `beta` and a log-gate `g`;
    the addresses pick `num_writes` slots to write and `num_reads` slots to read (sparse addressing), and
    `jax_sdm.sdm_write_read` runs the gated delta-rule recurrence over the sequence. The readings go through an
    optional norm and sigmoid output gate, then an output projection.

    Args:
      d_model: width of the input and output.
      num_heads: heads `H`, each with its own bank, keys and gates.
      slots_per_head: bank rows `K` per head.
      num_writes, num_reads: slots `W` written and `R` read per token and head (at most `K`).
      head_dim: bank row width `D` (default `d_model // num_heads`).
      addressing: `"product_key"` (default): `K` is a product of factors and a slot scores the sum of its
        factors' scores; the top `k` slots come from the top `k` of each factor, exactly, never scoring all `K`
        (`jax_sdm.product_key_topk`). `"topk"`: one score per slot, ranked over all `K` (for small `K`).
      factor_scores: how a factor's scores are made. `"direct"` (default): columns of the address projection,
        `sum(factors)` per head and address (a factor's column `c` is its score of index `c`). `"sub_keys"`: a
        query of width `key_dim` per factor, against that factor's learned sub-keys (shared by writes and
        reads).
      product_key_factors: the factors, any number (at least 2) of any sizes whose product is `slots_per_head`,
        e.g. `(256, 256)` or `(64, 32, 32)`; the first is the most significant digit of a slot id. Default:
        `balanced_factors(slots_per_head, num_factors)`.
      num_factors: the number of balanced factors when `product_key_factors` is not given (2 or more).
      key_dim: width of a query per factor and of a sub-key, for `factor_scores="sub_keys"` (default
        `head_dim`).
      write_activation, read_activation: how the selected slots' scaled scores become weights, one of
        `ACTIVATIONS` ("softmax" (default), "l2_normalize", "identity", "sigmoid", "tanh", "relu", "gelu",
        "silu", "softplus"; case-insensitive) or a callable on `[..., k]`.
      write_scale, read_scale: multiply the selected scores before the activation (default 1 for direct scores,
        `1 / sqrt(key_dim)` for sub-keys).
      gate: `"token"`: one log-gate per token and head, `g = -exp(A_log) * softplus(a + dt_bias)`; `"write"`:
        key-weighted decay, per written slot `g * |k_n|` (a slot written with a small weight decays less; for
        nonnegative weights this is `g * k_n`).
      query_batchnorm: batch-normalise the write and read address projections (over batch and time, padding
        excluded), against slot collapse. Its running statistics are `nnx.BatchStat`s: `layer.train()` (the
        default) normalises with the batch's statistics and updates them, `layer.eval()` uses them; `decode`
        always uses them.
      output_gate: multiply the (normed) readings by `sigmoid` of a projection of `x`.
      readout_norm: normalise each head's readings: `"rms"` (RMSNorm, default; `True` means it), `"layer"`
        (LayerNorm with bias), `None` or `False` (none). One learned scale of width `D`, shared by the heads.
      norm_eps: the readout norm's epsilon.
      use_bias: biases on every projection (default True).
      init_std: the projections' weights are truncated normal (cut at 3 standard deviations) with this standard
        deviation (default `d_model ** -0.5`); biases start at zero.
      bank_init_std: the learned initial bank's init, truncated normal as above (default `init_std`; 0 gives
        zeros).
      A_init_range: the range of the decay rates `exp(A_log)` at init.
      initial_bank: `"learned"` (a parameter `[H, K, D]`, shared by the batch) or `"zeros"`.
      chunk_size, impl: passed to `jax_sdm.sdm_write_read` (`impl` "auto", "ffi", "xla" or "reference"); `impl`
        also picks `product_key_topk`'s ("xla" for "xla" and "reference").
      snapshot_dtype: passed to `jax_sdm.sdm_write_read`: how the kernels' forward stores the written rows for the
        backward (None, the bank's dtype; `jnp.bfloat16` for a float32 bank, `"float8_e4m3fn"`, `"int4"`).
      dtype: the computation dtype and the bank's (float32 or bfloat16); `beta` and `g` are float32.
      param_dtype: the parameters' dtype.
      sequence_axis: sequence parallelism: the name of a mesh axis along which the caller shards the activations'
        `T` axis. The op's inputs are then resharded to heads along that axis (an all-to-all: each device runs
        the recurrence of its heads over the whole sequence) and the readings back to `T`. Needs a mesh in context
        (`jax.set_mesh`) and `num_heads` divisible by the axis size. None (the default): the op runs on
        the inputs as they are sharded.
      rngs: `nnx.Rngs` for the initialisation.

    Call: `y, state = layer(x, state=None, segment_ids=None, in_place=False)`. Without a state the sequence starts
    from the initial bank; `state` (from `init_state` or a previous call) is the bank `[B, H, K, D]` to continue
    from, and the returned state is the bank after the last token. `in_place=True` with a state is for a prefill
    that drops the state it passes: the new state comes back in that state's buffer when the caller donates it to
    its `jax.jit` (`donate_argnums`), so that only the written rows are touched (`sdm_write_read`'s `in_place`;
    without donation XLA copies the state first; ignored without a state, under a gradient, with `segment_ids`
    and by the pure-JAX `impl`s). A call with one token (`T == 1`) and a state is a decode
    step (inference only: not differentiable, as `jax_sdm.sdm_step`); `decode` and `decode_loop` are the decode
    interface. `segment_ids [B, T]` (packed and padded sequences: a new id starts again from the initial
    bank or `state`, a negative id pads) go to `sdm_write_read`, with the `impl`s that serve them.

    Parameters: `write_query`, `read_query`, `value_proj`, `beta_proj`, `gate_proj`, `output_gate` (each an
    `nnx.Linear` from `d_model`, used together as one matmul), `slot_keys` (sub-keys), `A_log`, `dt_bias`,
    `norm`, `out_proj`, `bank`; `write_norm`, `read_norm` with `query_batchnorm`. `weight_decay_mask` marks the
    ones to keep out of weight decay.
    """

    def __init__(self, d_model, *, num_heads, slots_per_head, num_writes, num_reads, head_dim=None,
                 addressing="product_key", factor_scores="direct", product_key_factors=None, num_factors=2,
                 key_dim=None, write_activation="softmax", read_activation="softmax", write_scale=None,
                 read_scale=None, gate="token", query_batchnorm=False, output_gate=True, readout_norm="rms",
                 norm_eps=1e-6, use_bias=True, init_std=None, bank_init_std=None, A_init_range=(0.0, 16.0),
                 initial_bank="learned", chunk_size=None, impl="auto", snapshot_dtype=None, dtype=jnp.float32,
                 param_dtype=jnp.float32, sequence_axis=None, rngs):
        def fail(message):
            raise ValueError(f"SparseDeltaMemory: {message}")

        def choice(name, value, options):
            if value not in options:
                fail(f"`{name}` must be one of {options}, got {value!r}")

        choice("addressing", addressing, ADDRESSINGS)
        choice("factor_scores", factor_scores, FACTOR_SCORES)
        choice("gate", gate, GATES)
        choice("initial_bank", initial_bank, INITIAL_BANKS)
        choice("impl", impl, IMPLS)
        if isinstance(readout_norm, bool):
            readout_norm = "rms" if readout_norm else None
        if readout_norm is not None:
            choice("readout_norm", readout_norm, READOUT_NORMS)
        if head_dim is None:
            if d_model % num_heads:
                fail(f"d_model = {d_model} is not a multiple of num_heads = {num_heads}; pass head_dim")
            head_dim = d_model // num_heads
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("slots_per_head", slots_per_head),
                            ("head_dim", head_dim), ("num_writes", num_writes), ("num_reads", num_reads)):
            if not (isinstance(value, (int, np.integer)) and value >= 1):
                fail(f"`{name}` must be a positive integer, got {value!r}")
        for name, value in (("num_writes", num_writes), ("num_reads", num_reads)):
            if value > slots_per_head:
                fail(f"`{name}` = {value} exceeds slots_per_head = {slots_per_head}")
        if addressing == "product_key":
            if product_key_factors is not None:
                factors = tuple(int(f) for f in product_key_factors)
                if len(factors) < 2 or min(factors) < 1 or math.prod(factors) != slots_per_head:
                    fail(f"`product_key_factors` must be 2 or more positive integers whose product is "
                         f"slots_per_head = {slots_per_head}, got {tuple(product_key_factors)}")
            else:
                if num_factors < 2:
                    fail(f"product-key addressing needs num_factors >= 2, got {num_factors} (use "
                         f"addressing='topk' for one factor)")
                factors = balanced_factors(slots_per_head, num_factors)
        else:
            if product_key_factors is not None:
                fail("`product_key_factors` is for addressing='product_key'")
            factors = (slots_per_head,)
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise TypeError(f"SparseDeltaMemory: `dtype` must be float32 or bfloat16 (the bank's), got {dtype}")
        activations, activation_names = {}, []
        for name, act in (("write_activation", write_activation), ("read_activation", read_activation)):
            if isinstance(act, str):
                if act.lower() not in ACTIVATIONS:
                    fail(f"`{name}` must be a callable or one of {tuple(ACTIVATIONS)}, got {act!r}")
                activation_names.append(act.lower())
                act = ACTIVATIONS[act.lower()]
            elif not callable(act):
                fail(f"`{name}` must be a callable or one of {tuple(ACTIVATIONS)}, got {act!r}")
            else:
                activation_names.append(None)
            activations[name] = act

        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.slots_per_head, self.num_writes, self.num_reads = slots_per_head, num_writes, num_reads
        self.addressing, self.factors, self.factor_scores = addressing, factors, factor_scores
        self.key_dim = key_dim or head_dim
        default_scale = 1.0 if factor_scores == "direct" else 1.0 / math.sqrt(self.key_dim)
        self.write_scale = default_scale if write_scale is None else float(write_scale)
        self.read_scale = default_scale if read_scale is None else float(read_scale)
        self.write_activation = activations["write_activation"]
        self.read_activation = activations["read_activation"]
        self.activation_names = tuple(activation_names)  # None for a callable
        self.gate = gate
        self.chunk_size, self.impl = chunk_size, impl
        jax_sdm.ops.snapshot_code(snapshot_dtype, dtype)  # a bad value fails here, not at the first call
        self.snapshot_dtype = snapshot_dtype
        self.initial_bank_kind = initial_bank
        self.dtype, self.param_dtype = dtype, param_dtype
        self.sequence_axis = sequence_axis

        H, D, F = num_heads, head_dim, len(factors)
        std = d_model ** -0.5 if init_std is None else float(init_std)
        weight_init = jax.nn.initializers.truncated_normal(std, lower=-3.0, upper=3.0)
        linear = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=use_bias, kernel_init=weight_init,
                                                dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # The address projection's width per head: the factors' scores, or a query per factor.
        self.address_width = sum(factors) if factor_scores == "direct" else F * self.key_dim
        self.write_query = linear(d_model, H * self.address_width)
        self.read_query = linear(d_model, H * self.address_width)
        # Sub-keys of every factor, concatenated along the slot axis (slot keys for "topk"); shared by writes and
        # reads, since both must find the same rows.
        self.slot_keys = (nnx.Param(jax.random.normal(rngs.params(), (H, sum(factors), self.key_dim), param_dtype))
                          if factor_scores == "sub_keys" else None)
        self.value_proj = linear(d_model, H * D)
        self.beta_proj = linear(d_model, H)
        self.gate_proj = linear(d_model, H)
        A_log, dt_bias = _gate_params(rngs.params(), H, A_init_range, param_dtype)
        self.A_log, self.dt_bias = nnx.Param(A_log), nnx.Param(dt_bias)
        self.output_gate = linear(d_model, H * D) if output_gate else None
        batchnorm = lambda: nnx.BatchNorm(H * self.address_width, momentum=0.9, epsilon=1e-5, dtype=dtype,
                                          param_dtype=param_dtype, rngs=rngs)
        self.write_norm = batchnorm() if query_batchnorm else None
        self.read_norm = batchnorm() if query_batchnorm else None
        self.readout_norm_kind = readout_norm
        if readout_norm == "rms":
            self.norm = nnx.RMSNorm(D, epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        elif readout_norm == "layer":
            self.norm = nnx.LayerNorm(D, epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        else:
            self.norm = None
        self.out_proj = linear(H * D, d_model)
        bank_std = std if bank_init_std is None else float(bank_init_std)
        if initial_bank == "learned":
            shape = (H, slots_per_head, D)
            bank = (jax.nn.initializers.truncated_normal(bank_std, lower=-3.0, upper=3.0)(
                rngs.params(), shape, param_dtype) if bank_std > 0 else jnp.zeros(shape, param_dtype))
            self.bank = nnx.Param(bank)
        else:
            self.bank = None

    # -- the pieces ------------------------------------------------------------------------------------------

    def _input_projections(self):
        """The projections of `x` made in one matmul, in column order."""
        mods = [self.write_query, self.read_query, self.value_proj, self.beta_proj, self.gate_proj]
        return mods + ([self.output_gate] if self.output_gate is not None else [])

    def projection_weights(self):
        """The parameters a decode step reads, in the forms its operations take (`DecodeWeights`): the weights of
        the layer's matmuls in the computation dtype, the input projections concatenated per head in the column
        order of `project`, then `out_proj`'s; the gates' and the readout norm's parameters in float32. A decode
        loop makes them once, outside its scan (`decode_loop`): they grow with `sqrt(K)` for direct factor scores,
        and remaking them every step costs more than the step itself at large `K`."""
        H, D = self.num_heads, self.head_dim
        mods = self._input_projections()
        widths = self._projection_widths()
        kernel = jnp.concatenate([m.kernel[...].astype(self.dtype).reshape(self.d_model, H, w)
                                  for m, w in zip(mods, widths)], axis=2)
        bias = None
        if mods[0].bias is not None:
            bias = jnp.concatenate([m.bias[...].astype(self.dtype).reshape(H, w) for m, w in zip(mods, widths)],
                                   axis=1)
        out_bias = None if self.out_proj.bias is None else self.out_proj.bias[...].astype(self.dtype)
        f32 = jnp.float32
        gates = jnp.stack([-jnp.exp(self.A_log[...].astype(f32)), self.dt_bias[...].astype(f32)], axis=-1)
        norm = jnp.zeros((2, D), f32)
        if self.norm is not None:
            norm = norm.at[0].set(self.norm.scale[...].astype(f32))
            if getattr(self.norm, "bias", None) is not None:
                norm = norm.at[1].set(self.norm.bias[...].astype(f32))
        return DecodeWeights(kernel, bias, self.out_proj.kernel[...].astype(self.dtype), out_bias, gates, norm)

    def _projection_widths(self):
        """The columns per head of each input projection, in the order of `project`."""
        return [m.out_features // self.num_heads for m in self._input_projections()]

    def _projection(self, x, weights=None):
        """Every input projection of `x [B, T, d_model]` as one matmul: `[B, T, H, width]`, the columns of each head
        in the order of `project`."""
        weights = self.projection_weights() if weights is None else weights
        kernel, bias = weights.kernel, weights.bias
        out = jnp.einsum("btd,dhw->bthw", x.astype(self.dtype), kernel)
        return out if bias is None else out + bias

    def project(self, x, weights=None):
        """`x [B, T, d_model]` -> `(write_address [B, T, H, address_width], read_address, value [B, T, H, D],
        b [B, T, H], a [B, T, H], output_gate [B, T, H, D] or None)`: every projection of `x` as one matmul in the
        computation dtype, the kernels concatenated per head (so that a head-sharded layer stays head-sharded).
        `weights`: `projection_weights()`, when the caller has made them already."""
        out = self._projection(x, weights)
        parts = jnp.split(out, np.cumsum(self._projection_widths())[:-1], axis=-1)
        parts[3], parts[4] = parts[3][..., 0], parts[4][..., 0]  # b, a: one column per head
        return tuple(parts) + ((None,) if self.output_gate is None else ())

    def address(self, write_address, read_address):
        """Slots and weights for the address projections `[B, T, H, address_width]`: `(k_idx, k_val, q_idx,
        q_val)`, ids `[B, T, H, W]` / `[B, T, H, R]` int32 and weights `activation(scale * scores)` of the selected
        slots. Writes and reads are ranked in one search (`max(W, R)` slots each; the best `R` are the first `R`
        of the best `max(W, R)`), so that a decode step launches few kernels."""
        scores, ids = self._rank(write_address, read_address, axis=0)
        W, R = self.num_writes, self.num_reads
        # The activations run on both halves and are then split: a split of the top-k's scores themselves lets
        # XLA move the slice into the top-k, which then compiles to a full sort of every row.
        k_val = self.write_activation(scores[..., :W] * self.write_scale)[0].astype(self.dtype)
        q_val = self.read_activation(scores[..., :R] * self.read_scale)[1].astype(self.dtype)
        return ids[0, ..., :W], k_val, ids[1, ..., :R], q_val

    def _rank(self, write_address, read_address, axis):
        """The best `max(W, R)` slots of the write and the read address projections `[B, T, H, address_width]`,
        stacked along `axis` (0: `[2, B, T, H, k]`; 3: `[B, T, H, 2, k]`): `(scores float32, slot ids int32)`."""
        F = len(self.factors)
        projection = jnp.stack([write_address, read_address], axis=axis)
        if self.factor_scores == "direct":
            scores = projection  # the factors' scores side by side
        else:
            query = projection.reshape(projection.shape[:-1] + (F, self.key_dim))
            keys = jnp.split(self.slot_keys[...].astype(query.dtype), np.cumsum(self.factors)[:-1], axis=1)
            spec = "abthd,hnd->abthn" if axis == 0 else "bthad,hnd->bthan"
            scores = jnp.concatenate([jnp.einsum(spec, query[..., f, :], keys[f]) for f in range(F)], axis=-1)
        k = max(self.num_writes, self.num_reads)
        if self.addressing == "product_key":
            topk_impl = "xla" if self.impl in ("xla", "reference") else self.impl
            scores, ids = jax_sdm.product_key_topk(scores, self.factors, k, impl=topk_impl)
        else:
            scores, ids = topk_slots(scores, k)
        return scores.astype(jnp.float32), ids

    def _gates(self, b, a, k_val):
        """`beta [B, T, H]` and `g` (`[B, T, H]`, or `[B, T, H, W]` key-weighted) in float32."""
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if self.gate == "write":
            g = g[..., None] * jnp.abs(k_val.astype(jnp.float32))
        return beta, g

    def _memory_inputs(self, x, segment_ids=None, use_running_average=None, weights=None):
        """The op's arguments and the output gate's projection for `x [B, T, d_model]`."""
        B, T, _ = x.shape
        H = self.num_heads
        # Named scopes: a device trace groups the layer's kernels by them (benchmarks/bench_layer.py --trace).
        with jax.named_scope("project"):
            write_address, read_address, v, b, a, gate_in = self.project(x, weights)
        with jax.named_scope("address"):
            write_address, read_address = self._query_batchnorm(write_address, read_address, use_running_average,
                                                                segment_ids)
            k_idx, k_val, q_idx, q_val = self.address(write_address, read_address)
        with jax.named_scope("project"):
            beta, g = self._gates(b, a, k_val)
        return (k_idx, k_val, v, beta, g, q_idx, q_val), gate_in

    def _query_batchnorm(self, write_address, read_address, use_running_average, segment_ids=None):
        """The address projections `[B, T, H, address_width]` batch-normalised (`query_batchnorm`), or as they are."""
        if self.write_norm is None:
            return write_address, read_address
        B, T, H = write_address.shape[:3]
        shape = (B, T, H * self.address_width)
        mask = None if segment_ids is None else jnp.broadcast_to((segment_ids >= 0)[..., None], shape)
        normed = lambda norm, z: norm(z.reshape(shape), use_running_average, mask=mask).reshape(z.shape)
        return normed(self.write_norm, write_address), normed(self.read_norm, read_address)

    def memory_inputs(self, x, segment_ids=None):
        """The op's per-token arguments for `x [B, T, d_model]`: `(k_idx, k_val, v, beta, g, q_idx, q_val)`
        in the layout of `jax_sdm.sdm_write_read`."""
        return self._memory_inputs(x, segment_ids)[0]

    def readout(self, x, y):
        """Readings `y [B, T, H, D]` of `x [B, T, d_model]` -> the layer's output `[B, T, d_model]`."""
        return self._readout(y, None if self.output_gate is None else self.output_gate(x))

    def _readout(self, y, gate_in, weights=None):
        """`readout` with the output gate's projection of `x` given (`[B, T, H * D]`, from `project`), and
        optionally `projection_weights()`."""
        if self.norm is not None:
            y = self.norm(y)
        if gate_in is not None:
            y = y * jax.nn.sigmoid(gate_in.reshape(y.shape)).astype(y.dtype)
        return self._out_projection(y, weights)

    def _out_projection(self, y, weights=None):
        """`out_proj` of the readings `[B, T, H, D]` (normed and gated), with `projection_weights()` if given."""
        B, T = y.shape[:2]
        y = y.reshape(B, T, self.num_heads * self.head_dim).astype(self.dtype)
        if weights is None:
            return self.out_proj(y)
        # What out_proj computes, with its kernel cast beforehand.
        out = jax.lax.dot_general(y, weights.out_kernel, (((y.ndim - 1,), (0,)), ((), ())))
        return out if weights.out_bias is None else out + weights.out_bias

    def initial_bank(self):
        """The bank every sequence starts from, `[H, K, D]` in the layer's dtype."""
        if self.bank is None:
            return jnp.zeros((self.num_heads, self.slots_per_head, self.head_dim), self.dtype)
        return self.bank[...].astype(self.dtype)

    def init_state(self, batch_size):
        """The decode state before the first token: the initial bank for each batch row, `[B, H, K, D]`."""
        bank = self.initial_bank()
        return jnp.broadcast_to(bank[None], (batch_size,) + bank.shape)

    def access_stats(self, x, segment_ids=None):
        """Memory-access statistics of `x [B, T, d_model]` per head (`memory_access_stats` of the layer's
        memory inputs; padding tokens excluded). Jittable: call it inside a training step to watch for slot
        collapse."""
        mask = None if segment_ids is None else segment_ids >= 0
        return memory_access_stats(self.memory_inputs(x, segment_ids), self.slots_per_head, mask=mask)

    # -- the call --------------------------------------------------------------------------------------------

    def _check_state(self, state, batch_size):
        bank_shape = (batch_size, self.num_heads, self.slots_per_head, self.head_dim)
        if state is not None and tuple(state.shape) != bank_shape:
            raise ValueError(f"SparseDeltaMemory: `state` must be the bank [B, H, K, D] = {bank_shape}, got "
                             f"{tuple(state.shape)} (make one with init_state(batch_size))")

    def __call__(self, x, *, state=None, segment_ids=None, in_place=False):
        """`x [B, T, d_model]` -> `(y [B, T, d_model], state [B, H, K, D])` (see the class docstring)."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"SparseDeltaMemory: `x` must be [B, T, d_model={self.d_model}], got {x.shape}")
        if not isinstance(in_place, bool):
            raise TypeError(f"SparseDeltaMemory: `in_place` must be a bool, got {type(in_place).__name__}")
        B, T, _ = x.shape
        self._check_state(state, B)
        if state is not None and T == 1 and segment_ids is None:
            return self._decode(x, state, use_running_average=None)
        bank = self.initial_bank() if state is None else state.astype(self.dtype)
        args, gate_in = self._memory_inputs(x, segment_ids)
        if self.sequence_axis is not None:
            # T-sharded activations: the op runs on heads. Each input is pinned T-sharded where it is made, then
            # resharded to heads, so XLA moves it by an all-to-all (left alone, it may all-gather `x` instead).
            spec = jax.sharding.PartitionSpec
            pin = lambda a, s: jax.lax.with_sharding_constraint(a, s)
            args = tuple(pin(pin(a, spec(None, self.sequence_axis)), spec(None, None, self.sequence_axis))
                         for a in args)
        with jax.named_scope("memory"):
            y, bank = jax_sdm.sdm_write_read(bank, *args, chunk_size=self.chunk_size, impl=self.impl,
                                             segment_ids=segment_ids, snapshot_dtype=self.snapshot_dtype,
                                             in_place=in_place and state is not None)
        if self.sequence_axis is not None:  # back to T; pinned on heads first, so that its cotangent reaches the op so
            spec = jax.sharding.PartitionSpec
            pin = lambda a, s: jax.lax.with_sharding_constraint(a, s)
            y = pin(pin(y, spec(None, None, self.sequence_axis)), spec(None, self.sequence_axis))
        with jax.named_scope("readout"):
            return self._readout(y, gate_in), bank

    def fused_decode(self):
        """Whether a decode step runs its addressing's activations, gates, memory step, readout norm and output gate
        as one kernel call (`sdm_layer_decode_step`): with `impl` "auto" or "ffi", named activations, and the
        kernels on this backend. Otherwise `decode` runs them as separate operations (the same values up to
        rounding)."""
        return (self.impl in ("auto", "ffi") and None not in self.activation_names
                and lowering.is_registered("sdm_layer_decode_step", jax.default_backend()))

    def _ranks_in_decode_kernel(self):
        """Whether the decode step's kernel call also ranks the lists (`sdm_layer_decode_rank_step`): direct
        product-key scores, no query batch norm, and at most the factors and `k` its CUDA kernel takes."""
        max_factors, max_k = lowering.layer_decode_rank_limits()
        return (self.addressing == "product_key" and self.factor_scores == "direct" and self.write_norm is None
                and len(self.factors) <= max_factors and max(self.num_writes, self.num_reads) <= max_k
                and lowering.is_registered("sdm_layer_decode_rank_step", jax.default_backend()))

    def _decode_fused(self, x, state, use_running_average, weights=None):
        """The decode step as one kernel call after the projection and the top-k (see `fused_decode`)."""
        aw = self.address_width
        weights = self.projection_weights() if weights is None else weights
        with jax.named_scope("project"):
            proj = self._projection(x, weights)[:, 0]  # [B, H, width]
        columns = np.cumsum([0] + self._projection_widths())  # write, read, v, b, a, output gate
        options = dict(num_writes=self.num_writes, num_reads=self.num_reads, v_offset=int(columns[2]),
                       b_offset=int(columns[3]), a_offset=int(columns[4]),
                       og_offset=int(columns[5]) if self.output_gate is not None else -1,
                       write_activation=self.activation_names[0], read_activation=self.activation_names[1],
                       per_write_gates=self.gate == "write", readout_norm=self.readout_norm_kind,
                       write_scale=self.write_scale, read_scale=self.read_scale,
                       norm_eps=0.0 if self.norm is None else float(self.norm.epsilon))
        bank = state.astype(self.dtype)
        if self._ranks_in_decode_kernel():
            options.update(factors=self.factors, k=max(self.num_writes, self.num_reads), write_rank_offset=0,
                           read_rank_offset=aw)
            table = candidate_table(self.factors, options["k"])
            with jax.named_scope("memory"):
                bank, out = _inference_only(ffi_ops.layer_decode_rank_step_ffi, tuple(options.items()), bank, proj,
                                            table, weights.gates, weights.norm)
        else:
            with jax.named_scope("address"):
                write_address, read_address = self._query_batchnorm(proj[:, None, :, :aw],
                                                                    proj[:, None, :, aw:2 * aw], use_running_average)
                scores, ids = self._rank(write_address, read_address, axis=3)  # [B, 1, H, 2, k]
            with jax.named_scope("memory"):
                bank, out = _inference_only(ffi_ops.layer_decode_step_ffi, tuple(options.items()), bank, ids[:, 0],
                                            scores[:, 0], proj, weights.gates, weights.norm)
        with jax.named_scope("readout"):
            return self._out_projection(out[:, None], weights), bank

    def _decode(self, x, state, use_running_average, weights=None, fused=None):
        if self.fused_decode() if fused is None else fused:
            return self._decode_fused(x, state, use_running_average, weights)
        args, gate_in = self._memory_inputs(x, use_running_average=use_running_average, weights=weights)
        with jax.named_scope("memory"):
            y, bank = jax_sdm.sdm_step(state.astype(self.dtype), *(a[:, 0] for a in args), impl=self.impl)
        with jax.named_scope("readout"):
            return self._readout(y[:, None], gate_in, weights), bank

    def decode(self, x_t, state, *, weights=None):
        """One decode step: `x_t [B, d_model]` (or `[B, 1, d_model]`) and the state `[B, H, K, D]` ->
        `(y_t, state)`, `y_t` shaped like `x_t`, with the batch-norm running statistics; inference only. After the
        projection and the address top-k, one kernel call makes the lanes' weights and gates, runs the memory step
        and the readout norm and gate (`fused_decode()`; with a callable activation, `jax_sdm.sdm_step` and
        separate operations, the same values up to rounding). Under `jax.jit` with the state donated (`decode_loop`
        does that) the bank is updated in place; an undonated state is copied every step. In a loop of steps, pass
        `weights=layer.projection_weights()` made once before the loop (XLA does not hoist them out of a scan)."""
        squeeze = x_t.ndim == 2
        x = x_t[:, None] if squeeze else x_t
        if x.ndim != 3 or x.shape[1:] != (1, self.d_model):
            raise ValueError(f"SparseDeltaMemory.decode: `x_t` must be [B, d_model={self.d_model}] or "
                             f"[B, 1, d_model], got {x_t.shape}")
        self._check_state(state, x.shape[0])
        y, state = self._decode(x, state, use_running_average=True, weights=weights)
        return (y[:, 0] if squeeze else y), state


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _inference_only(step, options, *arrays):
    """`step(*arrays, **dict(options))` (a layer decode step's kernel call), inference only like `sdm_step`."""
    return step(*arrays, **dict(options))


@_inference_only.defjvp
def _inference_only_jvp(step, options, primals, tangents):
    raise TypeError(INFERENCE_ONLY + " (the layer's decode step, a call with one token and a state, "
                    "runs it; to train, call the layer on sequences)")


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=3)
def _decode_loop(graphdef, params, x, state, unroll=1):
    layer = nnx.merge(graphdef, params)
    weights = layer.projection_weights()  # once, not in every step

    def body(state, x_t):
        y_t, state = layer.decode(x_t, state, weights=weights)
        return state, y_t

    state, ys = jax.lax.scan(body, state, jnp.swapaxes(x, 0, 1), unroll=unroll)
    return jnp.swapaxes(ys, 0, 1), state


def decode_loop(layer, x, state, *, unroll=1):
    """Decode `x [B, T, d_model]` token by token through `layer`: one `jax.jit` with a `lax.scan` over the
    tokens of `layer.decode`, the state donated (updated in place, never copied; the `state` passed in is
    deleted). Returns `(y [B, T, d_model], state)`: the same as `layer(x, state=state)` up to rounding, at the
    cost of `T` decode steps. `unroll`: steps per iteration of the compiled loop (`lax.scan`'s `unroll`; more
    steps an iteration pay the loop's own per-iteration work less often, and take longer to compile; the result
    is the same up to rounding, as the compiler may fuse the steps of an iteration differently). For a model of
    your own, write the scan body around your model's step the same way and jit it with the state in
    `donate_argnums`."""
    if x.ndim != 3 or x.shape[-1] != layer.d_model:
        raise ValueError(f"decode_loop: `x` must be [B, T, d_model={layer.d_model}], got {x.shape}")
    if not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 1:
        raise ValueError(f"decode_loop: `unroll` must be a positive int, got {unroll!r}")
    layer._check_state(state, x.shape[0])
    graphdef, params = nnx.split(layer)
    return _decode_loop(graphdef, params, x, state, unroll)


def memory_access_stats(memory_inputs, num_slots, mask=None):
    """Per-head statistics of sparse memory access, for diagnosing slot collapse; jittable.

    `memory_inputs` is `(k_idx, k_val, v, beta, g, q_idx, q_val)` as for `sdm_write_read` (e.g.
    `layer.memory_inputs(x)`), `num_slots` the static `K`, `mask [B, T]` (optional) true on the tokens to count.
    Returns a dict of float32 arrays `[H]`:
      `write_touched`, `read_touched`: the fraction of the `K` slots written (read) at least once;
      `write_entropy`, `read_entropy`: the entropy of the slots' write (read) counts as a distribution, over
        `log K` (1: uniform use of all slots, 0: one slot);
      `beta_mean`, `beta_min`, `g_mean`, `g_min`: the write strengths' and log-gates' mean and minimum.
    """
    k_idx, _, _, beta, g, q_idx, _ = memory_inputs
    B, T, H = beta.shape
    weight = jnp.ones((B, T), jnp.float32) if mask is None else mask.astype(jnp.float32)
    stats = {}
    for name, idx in (("write", k_idx), ("read", q_idx)):
        heads = jnp.arange(H, dtype=jnp.int32)[:, None] * num_slots
        flat = (idx.astype(jnp.int32) + heads).reshape(-1)
        w = jnp.broadcast_to(weight[:, :, None, None], idx.shape).reshape(-1)
        counts = jax.ops.segment_sum(w, flat, num_segments=H * num_slots).reshape(H, num_slots)
        total = jnp.sum(counts, axis=1, keepdims=True)
        p = counts / jnp.maximum(total, 1e-30)
        entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=1)
        stats[f"{name}_touched"] = jnp.mean((counts > 0).astype(jnp.float32), axis=1)
        stats[f"{name}_entropy"] = entropy / (math.log(num_slots) if num_slots > 1 else 1.0)
    for name, val in (("beta", beta), ("g", g)):
        val = val.astype(jnp.float32)
        w = jnp.broadcast_to(weight.reshape(B, T, *([1] * (val.ndim - 2))), val.shape)
        axes = tuple(i for i in range(val.ndim) if i != 2)
        stats[f"{name}_mean"] = jnp.sum(val * w, axis=axes) / jnp.maximum(jnp.sum(w, axis=axes), 1.0)
        stats[f"{name}_min"] = jnp.min(jnp.where(w > 0, val, jnp.inf), axis=axes)
    return stats


def weight_decay_mask(model, *, decay_bank=True):
    """An optax mask for `model` (any NNX module holding `SparseDeltaMemory` layers): a function of the
    parameters that gives True where weight decay applies, False on every layer's `A_log` and `dt_bias` (the
    reference layer's no-weight-decay marks) and, with `decay_bank=False`, on its learned initial bank. Use it
    as `optax.adamw(lr, weight_decay=wd, mask=weight_decay_mask(model))` with
    `nnx.Optimizer(model, tx, wrt=nnx.Param)`; it accepts the parameter state (`nnx.State`) or the same tree
    as a pure dict."""
    excluded = set()
    names = ("A_log", "dt_bias") + (() if decay_bank else ("bank",))
    for path, node in nnx.iter_graph(model):
        if isinstance(node, SparseDeltaMemory):
            excluded.update(tuple(str(p) for p in path) + (n,) for n in names)

    def key_name(entry):
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                return str(getattr(entry, attr))
        return str(entry)

    def mask(params):
        def leaf(path, _):
            keys = tuple(key_name(p) for p in path)
            # A leaf is the Variable's value under its own path (or one level deeper in a pure dict's "value").
            return not any(keys[:len(e)] == e for e in excluded if len(keys) >= len(e))
        return jax.tree_util.tree_map_with_path(leaf, params)

    return mask
