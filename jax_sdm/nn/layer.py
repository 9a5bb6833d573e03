"""`SparseDeltaMemory`: the SDM sequence mixer as a Flax NNX layer (projections, sparse addressing, gates,
learned initial bank, decode state)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_sdm

from .addressing import balanced_factors, product_key_slots, topk_slots

ADDRESSINGS = ("product_key", "topk")
GATES = ("token", "write")
INITIAL_BANKS = ("learned", "zeros")
IMPLS = ("auto", "ffi", "xla", "reference")


def _gate_params(rng, num_heads, param_dtype):
    """`A_log`, `dt_bias` as in gated delta nets: the decay rate `exp(A_log)` uniform in [1, 16], and the step
    `softplus(dt_bias)` log-uniform in [1e-3, 1e-1], so the initial per-token gates lie between about -1.6 and
    -1e-3 (long and short memories mixed across heads)."""
    rate_key, dt_key = jax.random.split(rng)
    A_log = jnp.log(jax.random.uniform(rate_key, (num_heads,), jnp.float32, 1.0, 16.0))
    dt = jnp.exp(jax.random.uniform(dt_key, (num_heads,), jnp.float32, math.log(1e-3), math.log(1e-1)))
    dt_bias = dt + jnp.log(-jnp.expm1(-dt))  # the inverse of softplus
    return A_log.astype(param_dtype), dt_bias.astype(param_dtype)


class SparseDeltaMemory(nnx.Module):
    """Sparse Delta Memory as a sequence-mixing layer: `x [B, T, d_model] -> y [B, T, d_model]`.

    Every head owns a bank of `slots_per_head` rows of width `head_dim`. At each token the layer projects `x`
    to a write query, a read query, a value, a write strength `beta` and a log-gate `g`; the queries pick
    `num_writes` slots to write and `num_reads` slots to read (sparse addressing), and `jax_sdm.sdm_write_read`
    runs the gated delta-rule recurrence over the sequence. The readings go through an optional norm and sigmoid
    output gate, then an output projection.

    Args:
      d_model: width of the input and output.
      num_heads: heads `H`, each with its own bank, keys and gates.
      slots_per_head: bank rows `K` per head.
      num_writes, num_reads: slots `W` written and `R` read per token and head (at most `K`).
      head_dim: bank row width `D` (default `d_model // num_heads`).
      addressing: `"product_key"`: `K` is the product of `num_factors` factors (`balanced_factors`); each factor
        has its own learned sub-keys and a slot scores the sum of its factors' scores; the top `k` slots are
        found from the top `k` of each factor, never scoring all `K`. `"topk"`: one learned key per slot, scores
        against all `K` (for small `K`).
      num_factors: factors of product-key addressing (2 or more).
      key_dim: width of a query (per factor) and of a slot key (default `head_dim`).
      chunk_size, impl: passed to `jax_sdm.sdm_write_read` (`impl` "auto", "ffi", "xla" or "reference").
      initial_bank: `"learned"` (a parameter `[H, K, D]`, zero at init, shared by the batch) or `"zeros"`.
      softmax_weights: write and read weights are the softmax of the selected slots' scaled scores (default);
        otherwise the scaled scores themselves.
      score_scale: multiplies the scores (default `1 / sqrt(key_dim)`).
      gate: `"token"`: one log-gate per token and head, `g = -exp(A_log) * softplus(a + dt_bias)`; `"write"`:
        per written slot, key-weighted, `g * |k_n|` (a slot written with a small weight decays less).
      output_gate: multiply the (normed) readings by `sigmoid` of a projection of `x`.
      readout_norm: RMS-normalise each head's readings (one learned scale of width `D`, shared by the heads).
      dtype: the computation dtype and the bank's (float32 or bfloat16); `beta` and `g` stay float32.
      param_dtype: the parameters' dtype.
      sequence_axis: sequence parallelism: the name of a mesh axis along which the caller shards the activations'
        `T` axis. The op's inputs are then resharded to heads along that axis (an all-to-all: each device runs
        the recurrence of its heads over the whole sequence) and the readings back to `T`. Needs a mesh in context
        (`jax.set_mesh`) and `num_heads` divisible by the axis size. None (the default): the op runs on
        the inputs as they are sharded.
      rngs: `nnx.Rngs` for the initialisation.

    Call: `y, state = layer(x, state=None, segment_ids=None)`. Without a state the sequence starts from the
    initial bank; `state` (from `init_state` or a previous call) is the bank `[B, H, K, D]` to continue from, and
    the returned state is the bank after the last token. A call with one token (`T == 1`) and a state is a decode
    step: it runs `jax_sdm.sdm_step` (inference only: not differentiable). `segment_ids [B, T]` (packed and padded
    sequences: a new id starts again from the initial bank or `state`, a negative id pads) go to
    `sdm_write_read`, with the `impl`s that serve them.
    """

    def __init__(self, d_model, *, num_heads, slots_per_head, num_writes, num_reads, head_dim=None,
                 addressing="product_key", num_factors=2, key_dim=None, chunk_size=None, impl="auto",
                 initial_bank="learned", softmax_weights=True, score_scale=None, gate="token", output_gate=True,
                 readout_norm=True, dtype=jnp.float32, param_dtype=jnp.float32, sequence_axis=None, rngs):
        def choice(name, value, options):
            if value not in options:
                raise ValueError(f"SparseDeltaMemory: `{name}` must be one of {options}, got {value!r}")

        choice("addressing", addressing, ADDRESSINGS)
        choice("gate", gate, GATES)
        choice("initial_bank", initial_bank, INITIAL_BANKS)
        choice("impl", impl, IMPLS)
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"SparseDeltaMemory: d_model = {d_model} is not a multiple of num_heads = "
                                 f"{num_heads}; pass head_dim")
            head_dim = d_model // num_heads
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("slots_per_head", slots_per_head),
                            ("head_dim", head_dim), ("num_writes", num_writes), ("num_reads", num_reads)):
            if not (isinstance(value, (int, np.integer)) and value >= 1):
                raise ValueError(f"SparseDeltaMemory: `{name}` must be a positive integer, got {value!r}")
        for name, value in (("num_writes", num_writes), ("num_reads", num_reads)):
            if value > slots_per_head:
                raise ValueError(f"SparseDeltaMemory: `{name}` = {value} exceeds slots_per_head = {slots_per_head}")
        if addressing == "product_key":
            if num_factors < 2:
                raise ValueError(f"SparseDeltaMemory: product-key addressing needs num_factors >= 2, got "
                                 f"{num_factors} (use addressing='topk' for one factor)")
            factors = balanced_factors(slots_per_head, num_factors)
        else:
            factors = (slots_per_head,)
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise TypeError(f"SparseDeltaMemory: `dtype` must be float32 or bfloat16 (the bank's), got {dtype}")

        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.slots_per_head, self.num_writes, self.num_reads = slots_per_head, num_writes, num_reads
        self.addressing, self.factors = addressing, factors
        self.key_dim = key_dim or head_dim
        self.score_scale = 1.0 / math.sqrt(self.key_dim) if score_scale is None else float(score_scale)
        self.softmax_weights, self.gate = softmax_weights, gate
        self.chunk_size, self.impl = chunk_size, impl
        self.initial_bank_kind = initial_bank
        self.dtype, self.param_dtype = dtype, param_dtype
        self.sequence_axis = sequence_axis

        H, D, F = num_heads, head_dim, len(factors)
        linear = lambda n_in, n_out, **kw: nnx.Linear(n_in, n_out, dtype=dtype, param_dtype=param_dtype,
                                                      rngs=rngs, **kw)
        self.write_query = linear(d_model, H * F * self.key_dim, use_bias=False)
        self.read_query = linear(d_model, H * F * self.key_dim, use_bias=False)
        # Sub-keys of every factor, concatenated along the slot axis (slot keys for "topk"); shared by writes and
        # reads, since both must find the same rows.
        self.slot_keys = nnx.Param(jax.random.normal(rngs.params(), (H, sum(factors), self.key_dim), param_dtype))
        self.value_proj = linear(d_model, H * D, use_bias=False)
        self.beta_proj = linear(d_model, H)
        self.gate_proj = linear(d_model, H, use_bias=False)
        A_log, dt_bias = _gate_params(rngs.params(), H, param_dtype)
        self.A_log, self.dt_bias = nnx.Param(A_log), nnx.Param(dt_bias)
        self.output_gate = linear(d_model, H * D) if output_gate else None
        self.norm = (nnx.RMSNorm(D, dtype=dtype, param_dtype=param_dtype, rngs=rngs) if readout_norm else None)
        self.out_proj = linear(H * D, d_model, use_bias=False)
        self.bank = (nnx.Param(jnp.zeros((H, slots_per_head, D), param_dtype)) if initial_bank == "learned"
                     else None)

    # -- the pieces ------------------------------------------------------------------------------------------

    def address(self, query, k):
        """Slots and weights for queries `[B, T, H * F * key_dim]`: `(slot_ids [B, T, H, k] int32,
        weights [B, T, H, k])` (softmax of the scaled scores when `softmax_weights`)."""
        B, T = query.shape[:2]
        F = len(self.factors)
        query = query.reshape(B, T, self.num_heads, F, self.key_dim)
        keys = jnp.split(self.slot_keys[...].astype(query.dtype), np.cumsum(self.factors)[:-1], axis=1)
        scores = [jnp.einsum("bthd,hnd->bthn", query[..., f, :], keys[f]) for f in range(F)]
        if self.addressing == "product_key":
            scores, ids = product_key_slots(scores, k)
        else:
            scores, ids = topk_slots(scores[0], k)
        scores = scores.astype(jnp.float32) * self.score_scale
        weights = jax.nn.softmax(scores, axis=-1) if self.softmax_weights else scores
        return ids, weights.astype(self.dtype)

    def memory_inputs(self, x):
        """The op's per-token arguments for `x [B, T, d_model]`: `(k_idx, k_val, v, beta, g, q_idx, q_val)`
        in the layout of `jax_sdm.sdm_write_read`."""
        B, T, _ = x.shape
        H = self.num_heads
        # Named scopes: a device trace groups the layer's kernels by them (benchmarks/bench_layer.py --trace).
        with jax.named_scope("address"):
            k_idx, k_val = self.address(self.write_query(x), self.num_writes)
            q_idx, q_val = self.address(self.read_query(x), self.num_reads)
        with jax.named_scope("project"):
            v = self.value_proj(x).reshape(B, T, H, self.head_dim).astype(self.dtype)
            beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
            a = self.gate_proj(x).astype(jnp.float32)
            g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
                a + self.dt_bias[...].astype(jnp.float32))
            if self.gate == "write":
                g = g[..., None] * jnp.abs(k_val.astype(jnp.float32))
        return k_idx, k_val, v, beta, g, q_idx, q_val

    def readout(self, x, y):
        """Readings `y [B, T, H, D]` -> the layer's output `[B, T, d_model]`."""
        B, T = y.shape[:2]
        if self.norm is not None:
            y = self.norm(y)
        if self.output_gate is not None:
            y = y * jax.nn.sigmoid(self.output_gate(x).reshape(y.shape)).astype(y.dtype)
        return self.out_proj(y.reshape(B, T, self.num_heads * self.head_dim))

    def initial_bank(self):
        """The bank every sequence starts from, `[H, K, D]` in the layer's dtype."""
        if self.bank is None:
            return jnp.zeros((self.num_heads, self.slots_per_head, self.head_dim), self.dtype)
        return self.bank[...].astype(self.dtype)

    def init_state(self, batch_size):
        """The decode state before the first token: the initial bank for each batch row, `[B, H, K, D]`."""
        bank = self.initial_bank()
        return jnp.broadcast_to(bank[None], (batch_size,) + bank.shape)

    # -- the call --------------------------------------------------------------------------------------------

    def __call__(self, x, *, state=None, segment_ids=None):
        """`x [B, T, d_model]` -> `(y [B, T, d_model], state [B, H, K, D])` (see the class docstring)."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"SparseDeltaMemory: `x` must be [B, T, d_model={self.d_model}], got {x.shape}")
        B, T, _ = x.shape
        bank_shape = (B, self.num_heads, self.slots_per_head, self.head_dim)
        if state is not None and tuple(state.shape) != bank_shape:
            raise ValueError(f"SparseDeltaMemory: `state` must be the bank [B, H, K, D] = {bank_shape}, got "
                             f"{tuple(state.shape)} (make one with init_state(batch_size))")
        bank = self.initial_bank() if state is None else state.astype(self.dtype)
        args = self.memory_inputs(x)
        if self.sequence_axis is not None:
            # T-sharded activations: the op runs on heads. Each input is pinned T-sharded where it is made, then
            # resharded to heads, so XLA moves it by an all-to-all (left alone, it may all-gather `x` instead).
            spec = jax.sharding.PartitionSpec
            pin = lambda a, s: jax.lax.with_sharding_constraint(a, s)
            args = tuple(pin(pin(a, spec(None, self.sequence_axis)), spec(None, None, self.sequence_axis))
                         for a in args)
        with jax.named_scope("memory"):
            if state is not None and T == 1 and segment_ids is None:
                y, bank = jax_sdm.sdm_step(bank, *(a[:, 0] for a in args), impl=self.impl)
                y = y[:, None]
            else:
                y, bank = jax_sdm.sdm_write_read(bank, *args, chunk_size=self.chunk_size, impl=self.impl,
                                                 segment_ids=segment_ids)
        if self.sequence_axis is not None:
            y = jax.lax.with_sharding_constraint(y, jax.sharding.PartitionSpec(None, self.sequence_axis))
        with jax.named_scope("readout"):
            return self.readout(x, y), bank
