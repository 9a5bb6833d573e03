"""Packed and padded sequences (`segment_ids`): several sequences in one row of the batch, each starting from the
initial bank, and padding tokens that do nothing.

A row's tokens are numbered by segment: a non-padding token whose id differs from the previous token's (or the
row's first token) starts a new segment; the counter `seg` (1 for the first segment, 0 before any) is carried by
every later token, padding included. Padding tokens (negative ids) lose their slot ids before any path sees them:
they write nothing and read zeros.

Resetting the bank at every segment start would cost O(K D). Instead every bank row carries a *stamp*, the segment
that last wrote it: a row whose stamp is not the current segment holds a stale value and is read from the initial
bank instead. Starting a segment therefore costs nothing; each token pays O((W + R) D) for its rows, and the bank
of the row's last segment is assembled once at the end (`final_bank`, one O(K D) select per call).
"""
import jax.numpy as jnp


def validate(segment_ids, B, T, op="sdm_write_read"):
    """`segment_ids` must be `[B, T]` integers."""
    if tuple(segment_ids.shape) != (B, T):
        raise ValueError(f"{op}: `segment_ids` has shape {tuple(segment_ids.shape)}, expected [B, T] = [{B}, {T}]")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"{op}: `segment_ids` has dtype {jnp.dtype(segment_ids.dtype).name}, expected an integer "
                        "type (int32 preferred)")


def segment_numbers(segment_ids):
    """`[B, T]` ids -> `(seg, pad)`: each token's segment counter (int32) and whether it is padding."""
    ids = segment_ids.astype(jnp.int32)
    pad = ids < 0
    changed = jnp.concatenate([jnp.ones_like(pad[:, :1]), ids[:, 1:] != ids[:, :-1]], axis=1)
    return jnp.cumsum(~pad & changed, axis=1, dtype=jnp.int32), pad


def drop_padding(idx, pad, fill=-1):
    """Slot ids `[B, T, H, L]` with those of padding tokens (`pad [B, T]`) set to `fill` (out of range by default:
    they touch no row)."""
    return jnp.where(pad[:, :, None, None], fill, idx)


def current_rows(bank, initial, stamp, rows, current):
    """`bank[rows]` where the row's stamp is `current`, else `initial[rows]` (zeros for out-of-range rows).

    bank, initial `[K, D]`, stamp `[K]`, rows `[...]`, current: scalar or broadcastable to `rows`."""
    fresh = stamp.at[rows].get(mode="fill", fill_value=-1) == current
    return jnp.where(fresh[..., None], bank.at[rows].get(mode="fill", fill_value=0),
                     initial.at[rows].get(mode="fill", fill_value=0))


def final_bank(bank, initial, stamp, last):
    """The bank of segment `last`: rows stamped `last` from `bank`, the others from `initial` (`[..., K, D]`)."""
    return jnp.where((stamp == last[..., None])[..., None], bank, initial)


def chunk_segments(seg, dims, to_units):
    """For the chunked form: `(seg0 [NC, P], local [NC, P, C], last [P])` from the tokens' segment counters
    `seg [B, T]`. `seg0` is the segment running at each chunk's start, `local` each token's segment counted from
    it (0: it continues that segment; negative for the padding of the last chunk), `last` the row's last segment.
    `to_units` is `layout.to_units` (`[B, T, H, ...]` -> `[NC, P, C, ...]`; then `last` is `[P]`) or
    `layout.to_stream_units` (`[NC, B, H, C, ...]`: the streams' axes `P` above are `B, H`)."""
    seg_u = to_units(jnp.broadcast_to(seg[:, :, None], (dims.B, dims.T, dims.H)), dims)  # pads with 0
    seg0 = jnp.concatenate([jnp.zeros_like(seg_u[:1, ..., 0]), seg_u[:-1, ..., -1]])
    last = jnp.broadcast_to(seg[:, -1, None], (dims.B, dims.H)).reshape(seg0.shape[1:])
    return seg0, seg_u - seg0[..., None], last


def virtual_slots(idx, local, num_slots):
    """Slot ids `[NC, P, C, L]` made distinct per segment of a chunk (`s + K * local`; out-of-range ids stay out of
    range, as -1), so that Phase 1 pairs no entries of different segments. Needs `K * (C + 1) < 2^31`."""
    valid = (idx >= 0) & (idx < num_slots)
    return jnp.where(valid, idx + num_slots * local[..., None], -1)


def virtual_slot_count(num_slots, chunk):
    """The slot count of `virtual_slots`: `K * (C + 1)` (a chunk's tokens start at most C segments after its
    first)."""
    return num_slots * (chunk + 1)


def checked_virtual_slot_count(dims, impl):
    """`virtual_slot_count`, checked against the int32 slot ids (`impl` for the message)."""
    count = virtual_slot_count(dims.K, dims.C)
    if count >= 2**31:
        raise ValueError(f"sdm_write_read: `segment_ids` with impl={impl!r} needs K * (chunk_size + 1) < 2^31, got "
                         f"K = {dims.K}, chunk_size = {dims.C}; use a smaller chunk_size or impl='reference'")
    return count
