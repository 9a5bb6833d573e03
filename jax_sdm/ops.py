"""The public op `sdm_write_read` and its `impl` dispatch: the kernel path (`kernel_path.py`), the chunked form in
pure JAX (`xla.py`) or the token loop (`reference.py`)."""

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from . import ffi_ops, kernel_path, layout, segments, sharding
from .reference import sdm_reference
from .xla import chunk_loop_xla, phase1_xla, solve_xla

IMPLS = ("auto", "ffi", "xla", "reference")


DIFFERENTIABLE = layout.differentiable_ordered_broadcast  # the pure-JAX path serves every transformation


def _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, seg=None):
    """The chunked form in pure JAX (docs/MATH.md "Chunked form"); `seg`: the tokens' segment counters of packed
    sequences (`segments.segment_numbers`, padding already dropped), or None.

    Without packed sequences it runs one stream at a time under `vmap` over `B` and `H`: the streams' axes stay
    apart and are never scanned over, so under `jit` with inputs sharded along `B` / `H` every device keeps its own
    streams (no all-gather). Packed sequences run the streams merged (`_sdm_xla_packed`)."""
    if seg is not None:
        return _sdm_xla_packed(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, seg)
    f32 = jnp.promote_types(bank.dtype, jnp.float32)
    units = lambda a, fill=0: layout.to_stream_units(a, dims, fill)  # [NC, B, H, C, ...]

    def one_stream(bank_s, k_idx_s, k_val_s, x_s, v_s, beta_s, q_idx_s, q_val_s):
        p1 = phase1_xla(k_idx_s, k_val_s, x_s, q_idx_s, q_val_s, dims.K)
        minv = solve_xla(p1.A, beta_s)
        one = lambda a: a[:, None]  # [NC, C, ...] -> [NC, P = 1, C, ...]
        y, final = chunk_loop_xla(bank_s[None], one(k_idx_s), one(q_idx_s), one(v_s), one(beta_s),
                                  type(p1)(*map(one, p1)), one(minv))
        return y[:, 0], final[0], jnp.sum(p1.repeats)

    per_head = jax.vmap(one_stream, in_axes=(0,) + (1,) * 7, out_axes=(1, 0, 0))
    per_stream = jax.vmap(per_head, in_axes=(0,) + (1,) * 7, out_axes=(1, 0, 0))
    y, final, repeats = per_stream(
        layout.batch_banks(bank, dims, DIFFERENTIABLE), units(k_idx, -1), units(k_val.astype(f32)),
        units(layout.lane_gates(g, dims, DIFFERENTIABLE).astype(f32)), units(v.astype(f32)),
        units(beta.astype(f32)), units(q_idx, -1), units(q_val.astype(f32)))
    return layout.from_stream_units(y, dims).astype(bank.dtype), final, jnp.sum(repeats)


def _sdm_xla_packed(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, seg):
    """The chunked form in pure JAX for packed sequences, in kernel layout (the `P = B*H` streams merged)."""
    f32 = jnp.promote_types(bank.dtype, jnp.float32)
    units = lambda a, fill=0: layout.to_units(a, dims, fill)
    k_idx_u = units(k_idx.astype(jnp.int32), -1)
    q_idx_u = units(q_idx.astype(jnp.int32), -1)
    # Phase 1 sees each segment of a chunk on its own (virtual) slots.
    packed = segments.chunk_segments(seg, dims, layout.to_units)
    p1_slots = segments.checked_virtual_slot_count(dims, "xla")
    p1_k_idx, p1_q_idx = (segments.virtual_slots(a, packed[1], dims.K) for a in (k_idx_u, q_idx_u))
    p1 = phase1_xla(p1_k_idx, units(k_val.astype(f32)), units(layout.lane_gates(g, dims, DIFFERENTIABLE).astype(f32)),
                    p1_q_idx, units(q_val.astype(f32)), p1_slots)
    beta_u = units(beta.astype(f32))
    minv = solve_xla(p1.A, beta_u)
    bank = layout.batch_banks(bank, dims, DIFFERENTIABLE)
    y, final = chunk_loop_xla(bank.reshape(dims.P, dims.K, dims.D), k_idx_u, q_idx_u, units(v.astype(f32)),
                              beta_u, p1, minv, packed)
    return (layout.from_units(y, dims).astype(bank.dtype), final.reshape(dims.B, dims.H, dims.K, dims.D),
            jnp.sum(p1.repeats))


def _check_inputs(num_slots, k_idx, q_idx, floats, op="sdm_write_read"):
    """The run-time checks of `check=True`: slot ids outside `[0, K)`, non-finite inputs (`floats`, in the order of
    `CHECKED_FLOATS`; for the gates only NaN, since `g = -inf` is a hard reset) and gates `g > 0`; `op` names the
    function in the messages.

    Each is a `jax.experimental.checkify.check`: run eagerly it raises `checkify.JaxRuntimeError` (a `ValueError`);
    under `checkify.checkify(f)` the first failing one is the returned error (`err.get()` is its message,
    `err.throw()` raises it). Staged (`jit`, `scan`, ...) without `checkify`, JAX refuses to compile it.
    """
    out_of_range = lambda idx: jnp.sum(~layout.in_range(idx, num_slots, jnp))
    problems = [(out_of_range(k_idx), f"write slot ids (k_idx) outside [0, K={num_slots})"),
                (out_of_range(q_idx), f"read slot ids (q_idx) outside [0, K={num_slots})")]
    # g = -inf is in the domain (a hard reset of the written row): the gates' only non-finite error is NaN (+inf
    # is caught as g > 0).
    nonfinite = lambda name, a: jnp.isnan(a) if name == "g" else ~jnp.isfinite(a)
    problems += [(jnp.sum(nonfinite(name, a)), f"non-finite values in `{name}`")
                 for name, a in zip(CHECKED_FLOATS, floats)]
    problems.append((jnp.sum(floats[CHECKED_FLOATS.index("g")] > 0), "gates `g` > 0 (the domain is g <= 0, a decay)"))
    for count, what in problems:
        checkify.check(count == 0, f"{op}(check=True): {{count}} " + what, count=count)


CHECKED_FLOATS = ("bank", "k_val", "v", "beta", "g", "q_val")


def _count_repeats(k_idx, num_slots):
    """Write lanes that repeat an earlier lane's slot in the same token (the reference path's count)."""
    W = k_idx.shape[-1]
    earlier = jnp.tril(jnp.ones((W, W), bool), -1)
    same = (k_idx[..., :, None] == k_idx[..., None, :]) & earlier
    valid = (k_idx >= 0) & (k_idx < num_slots)
    return jnp.sum(valid & jnp.any(same, axis=-1)).astype(jnp.int32)


def snapshot_code(snapshot_dtype, bank_dtype):
    """The kernels' code (`ffi_ops.SNAPSHOT_CODES`) of `sdm_write_read`'s `snapshot_dtype` for a bank of
    `bank_dtype`: None or the bank's own dtype store the bank's dtype (so bfloat16 for a bfloat16 bank is None);
    bfloat16, "float8_e4m3fn" and "int4" (names or JAX dtypes) their codes. Anything else is a ValueError."""
    if snapshot_dtype is None:
        return 0
    try:
        name = snapshot_dtype if isinstance(snapshot_dtype, str) else jnp.dtype(snapshot_dtype).name
    except TypeError:
        name = None
    codes = dict(ffi_ops.SNAPSHOT_CODES, **{jnp.dtype(bank_dtype).name: 0})
    if name is not None and name in codes:
        return codes[name]
    raise ValueError(f"sdm_write_read: `snapshot_dtype` must be None (the bank's dtype, {jnp.dtype(bank_dtype).name}), "
                     f"jnp.bfloat16, \"float8_e4m3fn\" or \"int4\", got {snapshot_dtype!r}")


def default_chunk_size(impl="auto"):
    """The tokens per chunk that `chunk_size=None` picks for `impl` on the default backend: 128 where the CUDA
    kernels run the call (faster than 64 on the H200 at every measured shape, forward and backward), else 64."""
    on_gpu = jax.default_backend() == "gpu" and impl in ("auto", "ffi") and kernel_path.kernels_available()
    return 128 if on_gpu else 64


def sdm_write_read(bank, k_idx, k_val, v, beta, g, q_idx, q_val, *, chunk_size=None, impl="auto", check=False,
                   return_repeats=False, segment_ids=None, bank_grad_dtype=None, snapshot_dtype=None, in_place=False):
    """Sparse Delta Memory: write then read a sparse per-head memory bank at every token (docs/MATH.md).

    Args:
      bank: `[B, H, K, D]` (or `[H, K, D]` shared by the batch), float32 or bfloat16; with `jax_enable_x64`,
        `impl="xla"` and `"reference"` also take float64 (computed in float64: for checking results).
      k_idx, k_val: `[B, T, H, W]` write slot ids (int) and weights (the bank's dtype).
      v: `[B, T, H, D]` values (the bank's dtype).
      beta: `[B, T, H]` write strengths, float32 (or float64 with a float64 bank).
      g: `[B, T, H]` per-token or `[B, T, H, W]` per-write log-gates, float32 (or float64 with a float64 bank).
        The domain is `g <= 0` (a decay): every finite gate and `-inf` (a hard reset: the written row forgets
        everything before the write) give finite results equal to the token loop's. `g > 0` is outside it: the chunked forms' exponents overflow
        (no positive range is served exactly), and `check=True` reports it.
      q_idx, q_val: `[B, T, H, R]` read slot ids and weights.
      chunk_size: tokens per chunk of the chunked form (changes results only by rounding); None (the default)
        for `default_chunk_size(impl)`: 128 where the CUDA kernels run, else 64 (and 64 with `segment_ids` where
        128 would break the limit on `K` below).
      impl: "auto" | "ffi" | "xla" | "reference". "ffi" runs the FFI kernels (C++ on CPU, CUDA on GPU) and
        raises NotImplementedError where this build has none; "xla" the chunked form in pure JAX; "reference" the
        token loop. "auto" runs the kernels where this build has them for the platform, else "xla" (on a
        TPU).
      check: also check the data at run time: slot ids outside `[0, K)`, non-finite inputs and gates `g > 0` are
        errors, reported through `jax.experimental.checkify`: wrap the (jitted) function in `checkify.checkify` to
        get them as an error value (`err.throw()` raises `checkify.JaxRuntimeError`, a `ValueError`); run eagerly
        they raise that directly. Under `jit` without `checkify` JAX refuses to compile the checks. Without `check`
        an out-of-range id, of any integer type, is ignored: it reads zeros and touches no row; and a non-finite
        input gives unspecified values in the streams (batch element x head) it enters, and only there.
      return_repeats: also return the number of write lanes that repeated a slot of an earlier lane of the same
        token (such a slot decays once; docs/MATH.md).
      segment_ids: `[B, T]` ints for packed sequences: a token whose id differs from the previous token's starts
        a new sequence from `bank`; a negative id marks padding (the token does nothing and reads zeros). The
        final bank is the bank after each row's last non-padding token. Every `impl`, on the CPU and the GPU.
        The chunked forms (`"ffi"`, `"xla"`) need `K * (chunk_size + 1) < 2^31`.
      bank_grad_dtype: the dtype in which the kernels' backward (`impl="ffi"`) keeps the gradient of the bank
        between chunks: None (the default) for the bank's dtype, or `jnp.float32`. Inside each chunk step the
        arithmetic is float32 either way; a bfloat16 working gradient is rounded once per row a step writes. For
        a bfloat16 bank, bfloat16 halves the backward's largest memory traffic and the gradient bank's memory;
        float32 gives slightly more accurate gradients (measured at T=4096, chunk 64, 256 slots each rewritten
        about 64 times: relative L2 error of the gradients 2.3e-3 to 3.2e-3 against 1.8e-3 to 2.9e-3, with
        bfloat16's own rounding of the inputs and outputs the larger part). The pure-JAX paths ignore it: the
        chunked form (`"xla"`) keeps it in float32 (the rows rounded as stored, the gradient not), the token loop
        works in float32 throughout.
      snapshot_dtype: how the kernels' forward (`impl="ffi"`) stores, for the backward, the rows each chunk writes
        (the snapshot, the largest part of the training memory: `(T - C) * W * D` elements per stream at chunk size
        `C`, every chunk's rows but the last's; docs/MATH.md "Snapshot storage"). None (the default): the bank's
        dtype, exact (so is the
        bank's own dtype, e.g. `jnp.bfloat16` for a bfloat16 bank). `jnp.bfloat16` for a float32 bank: half the
        bytes, each element rounded to nearest even. `"float8_e4m3fn"`: a byte per element and a float32 scale per
        row (the row's largest magnitude / 448). `"int4"` (experimental: gradient errors near 1e-1): two elements a
        byte, symmetric codes -7..7 of the row's largest magnitude / 7, rounded to nearest, and a float32 scale per
        row. The lossy ones change only the gradients of `k_val`, `g` and `q_val`: the backward reads the rows
        earlier chunks wrote from the decoded snapshot (measured errors in docs/MATH.md). Results are bitwise reproducible for
        each. The pure-JAX paths ignore it (they keep no snapshot).
      in_place: return the final bank in `bank`'s buffer, for a call of the kernels (`impl="ffi"`) that is not
        differentiated and has no `segment_ids`: a prefill whose bank the caller drops. With `bank` donated to the
        enclosing `jax.jit` (`donate_argnums`), the kernels update the written rows where they are and touch no
        other row; otherwise XLA copies the whole bank first, which costs more than the default (a new final bank,
        into which only the rows no token writes are copied). The same results either way. A differentiated call
        keeps `bank` for the backward and ignores it, and so do the other `impl`s and packed sequences.

    Returns:
      `(y, final_bank)`: readings `[B, T, H, D]` and the bank after the last token `[B, H, K, D]`, in the bank's
      dtype; `(y, final_bank, repeats)` with `return_repeats=True`. Any dimension may be 0: an empty problem
      (`B`, `T`, `H`, `K` or `D` zero) gives zero (or empty) readings and the bank unchanged; `W = 0` (`R = 0`)
      means tokens that write (read) nothing.
    """
    if impl not in IMPLS:
        raise ValueError(f"sdm_write_read: `impl` must be one of {IMPLS}, got {impl!r}")
    bank = jnp.asarray(bank)
    num_slots = bank.shape[-2] if bank.ndim >= 2 else 0
    if chunk_size is None:
        chunk_size = default_chunk_size(impl)
        if segment_ids is not None and segments.virtual_slot_count(num_slots, chunk_size) >= 2**31:
            chunk_size = 64  # packed sequences' virtual slot ids must fit int32
    k_idx, q_idx = (i if isinstance(i, jax.Array) else layout.slot_ids(i, num_slots) for i in (k_idx, q_idx))
    k_idx, k_val, v, beta, g, q_idx, q_val = map(jnp.asarray, (k_idx, k_val, v, beta, g, q_idx, q_val))
    dims = layout.validate(bank, k_idx, k_val, v, beta, g, q_idx, q_val, chunk_size,
                           allow_float64=impl in ("xla", "reference"))
    if bank_grad_dtype is not None and jnp.dtype(bank_grad_dtype) not in (jnp.dtype(jnp.float32), bank.dtype):
        raise ValueError(f"sdm_write_read: `bank_grad_dtype` must be None, float32 or the bank's dtype "
                         f"({bank.dtype}), got {jnp.dtype(bank_grad_dtype)}")
    snapshot = snapshot_code(snapshot_dtype, bank.dtype)
    if not isinstance(in_place, bool):
        raise TypeError(f"sdm_write_read: `in_place` must be a bool, got {type(in_place).__name__}")
    seg = None
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        segments.validate(segment_ids, dims.B, dims.T)
        if impl != "reference":  # Phase 1 of the chunked forms runs on virtual slots
            segments.checked_virtual_slot_count(dims, impl)
        seg, pad = segments.segment_numbers(segment_ids)
        if check:  # the ids of padding tokens are not used: not checked
            _check_inputs(dims.K, *(segments.drop_padding(a, pad, fill=0) for a in (k_idx, q_idx)),
                          (bank, k_val, v, beta, g, q_val))
        k_idx, q_idx = segments.drop_padding(k_idx, pad), segments.drop_padding(q_idx, pad)
    elif check:
        _check_inputs(dims.K, k_idx, q_idx, (bank, k_val, v, beta, g, q_val))
    if layout.is_empty(dims):
        y, final = layout.empty_result(bank, dims)
        return (y, final, jnp.int32(0)) if return_repeats else (y, final)
    if impl == "auto":  # the kernels where this backend has them (for packed sequences too), else pure JAX
        impl = "ffi" if kernel_path.kernels_available() else "xla"
    if impl != "ffi":  # the kernel path maps the ids as it lays the tokens out (per slab in a no-grad call)
        k_idx, q_idx = layout.slot_ids(k_idx, dims.K), layout.slot_ids(q_idx, dims.K)
    k_idx, k_val, g, q_idx, q_val, dims = layout.one_lane_if_none(k_idx, k_val, g, q_idx, q_val, dims)
    # Inside `shard_map`: every input varies along the manual axes along which any does (a bank shared by the
    # devices is updated per device; the transpose of this cast sums its gradient over them).
    axes = sharding.varying_axes(bank, k_idx, k_val, v, beta, g, q_idx, q_val)
    bank, k_idx, k_val, v, beta, g, q_idx, q_val = (sharding.to_varying(a, axes)
                                                    for a in (bank, k_idx, k_val, v, beta, g, q_idx, q_val))
    if impl == "reference":
        y, final = sdm_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val, segment_ids=segment_ids)
        repeats = _count_repeats(k_idx, dims.K) if return_repeats else None
    elif impl == "xla":
        y, final, repeats = _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, seg)
    else:
        y, final, repeats = kernel_path.sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, bank_grad_dtype,
                                                seg, snapshot_code=snapshot, in_place=in_place)
    return (y, final, repeats) if return_repeats else (y, final)
