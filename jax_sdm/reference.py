"""The token recurrence (docs/MATH.md "Token recurrence"): the oracle every other path is tested against.

One `lax.scan` step per token and stream. Deliberately plain: no chunking, no sorting, no kernels.
"""
import jax
import jax.numpy as jnp

from . import segments

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


def _segment_step(num_slots):
    """`_token_step` on a bank whose rows carry stamps (jax_sdm/segments.py): the token's rows are first brought up
    to its segment (from the initial bank where stale), then the token runs as usual."""
    token_step = _token_step(num_slots)

    def step(carry, token):
        bank, initial, stamp = carry
        seg, *token = token
        k_idx, q_idx = token[0], token[5]
        touched = jnp.concatenate([k_idx, q_idx])
        rows = jnp.where((touched >= 0) & (touched < num_slots), touched, num_slots)
        bank = bank.at[rows].set(segments.current_rows(bank, initial, stamp, rows, seg), mode="drop")
        stamp = stamp.at[rows].set(seg, mode="drop")
        bank, y = token_step(bank, token)
        return (bank, initial, stamp), y

    return step


def sdm_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val, segment_ids=None):
    """Token-loop SDM in the public layout (`[B, T, H, ...]`, README "API"); returns `(y, final_bank)`.

    Arithmetic runs in the bank's dtype promoted to at least float32 (float64 under `jax_enable_x64` with a
    float64 bank); `y` and `final_bank` come back in the bank's dtype. With `segment_ids` `[B, T]`, each row holds
    packed sequences (jax_sdm/segments.py): each starts from `bank`, padding tokens (negative ids) do nothing and
    read zeros, and the final bank is that of the row's last segment.
    """
    B, T, H, W = k_idx.shape
    K, D = bank.shape[-2:]
    out_dtype = bank.dtype
    dt = jnp.promote_types(bank.dtype, jnp.float32)
    if bank.ndim == 3:
        bank = jnp.broadcast_to(bank[None], (B, H, K, D))
    if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], (B, T, H, W))
    if segment_ids is not None:
        seg, pad = segments.segment_numbers(segment_ids)
        k_idx, q_idx = segments.drop_padding(k_idx, pad), segments.drop_padding(q_idx, pad)

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
    bank = bank.astype(dt)
    if segment_ids is None:
        step = _token_step(K)
        final, y = jax.vmap(jax.vmap(lambda bank_p, *tok: jax.lax.scan(step, bank_p, tok)))(bank, *tokens)
    else:
        step = _segment_step(K)

        def one_stream(bank_p, seg_p, *tok):
            carry = (bank_p, bank_p, jnp.zeros(K, jnp.int32))
            (final_p, _, stamp), y_p = jax.lax.scan(step, carry, (seg_p,) + tok)
            return segments.final_bank(final_p, bank_p, stamp, seg_p[-1]), y_p

        seg_streams = jnp.broadcast_to(seg[:, None], (B, H, T))
        final, y = jax.vmap(jax.vmap(one_stream))(bank, seg_streams, *tokens)
    return jnp.moveaxis(y, 1, 2).astype(out_dtype), final.astype(out_dtype)
