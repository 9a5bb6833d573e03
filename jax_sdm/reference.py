"""The token recurrence (docs/MATH.md "Token recurrence"): the oracle every other path is tested against.

One `lax.scan` step per token and stream. Deliberately plain: no chunking, no sorting, no kernels.
"""
import jax
import jax.numpy as jnp

# Full float32 products even where the backend's default for float32 dots is lower (TF32 on the GPU).
HIGHEST = jax.lax.Precision.HIGHEST


def _token_step(num_slots):
    def step(bank, token):
        k_idx, k_val, x, v, beta, q_idx, q_val = token
        W = k_idx.shape[0]
        valid = (k_idx >= 0) & (k_idx < num_slots)
        # A slot listed twice in one token decays once, with the gate of its first lane.
        earlier = jnp.tril(jnp.ones((W, W), bool), -1)
        repeat = jnp.any((k_idx[:, None] == k_idx[None, :]) & earlier, axis=1)
        rows = jnp.where(valid, k_idx, num_slots)  # out-of-range ids touch no row
        decay_rows = jnp.where(valid & ~repeat, k_idx, num_slots)
        k_val = jnp.where(valid, k_val, 0)

        decayed = bank.at[decay_rows].get(mode="fill", fill_value=0) * jnp.exp(x)[:, None]
        bank = bank.at[decay_rows].set(decayed, mode="drop")
        pred = jnp.matmul(k_val, bank.at[rows].get(mode="fill", fill_value=0), precision=HIGHEST)
        d = beta * (v - pred)
        bank = bank.at[rows].add(k_val[:, None] * d[None, :], mode="drop")

        q_rows = jnp.where((q_idx >= 0) & (q_idx < num_slots), q_idx, num_slots)
        y = jnp.matmul(q_val, bank.at[q_rows].get(mode="fill", fill_value=0), precision=HIGHEST)
        return bank, y

    return step


def sdm_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val):
    """Token-loop SDM in the public layout (`[B, T, H, ...]`, README "API"); returns `(y, final_bank)`.

    Arithmetic runs in the bank's dtype promoted to at least float32 (float64 under `jax_enable_x64` with a
    float64 bank); `y` and `final_bank` come back in the bank's dtype.
    """
    B, T, H, W = k_idx.shape
    K, D = bank.shape[-2:]
    out_dtype = bank.dtype
    dt = jnp.promote_types(bank.dtype, jnp.float32)
    if bank.ndim == 3:
        bank = jnp.broadcast_to(bank[None], (B, H, K, D))
    if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], (B, T, H, W))

    def stream_major(a):  # [B, T, H, ...] -> [B, H, T, ...]
        return jnp.moveaxis(a, 2, 1)

    tokens = (
        stream_major(k_idx.astype(jnp.int32)),
        stream_major(k_val.astype(dt)),
        stream_major(g.astype(dt)),
        stream_major(v.astype(dt)),
        stream_major(beta.astype(dt)),
        stream_major(q_idx.astype(jnp.int32)),
        stream_major(q_val.astype(dt)),
    )
    step = _token_step(K)

    def one_stream(bank_p, *tokens_p):
        return jax.lax.scan(step, bank_p, tokens_p)

    final, y = jax.vmap(jax.vmap(one_stream))(bank.astype(dt), *tokens)
    return jnp.moveaxis(y, 1, 2).astype(out_dtype), final.astype(out_dtype)
