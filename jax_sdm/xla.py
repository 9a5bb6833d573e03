"""The chunked form of docs/MATH.md ("Chunked form", "Phase 1") in pure JAX (`impl="xla"`).

`phase1_xla` and `solve_xla` compute, for every (chunk, stream) unit at once, the same arrays as the `phase1` and
`solve` kernels (docs/DESIGN.md); `chunk_loop_xla` runs the bank-dependent chunk steps with `lax.scan`.
Differentiated by JAX's autodiff.
"""
import jax
import jax.numpy as jnp
from jax import lax

from . import segments
from .layout import Phase1

_NO_SLOT = jnp.iinfo(jnp.int32).max  # sort key of invalid entries: after every real slot
# Caps on the [entries, C] arrays of Phase 1's pair sums (elements): those of one block of a unit's tokens, and those
# of the units that run at once.
_PAIR_BLOCK = 1 << 20
_PAIR_BUDGET = 1 << 21


def _group_map(slot_key, ids, num):
    """Sort entries by (slot, id); return the CSR map (`order`, `group`) of DESIGN.md."""
    slot_s, id_s = lax.sort((slot_key, ids), num_keys=2)
    valid = slot_s != _NO_SLOT
    n_valid = jnp.sum(valid).astype(jnp.int32)
    pos = jnp.arange(num, dtype=jnp.int32)
    start = valid & jnp.concatenate([jnp.ones(1, bool), slot_s[1:] != slot_s[:-1]])
    gid = jnp.cumsum(start) - 1
    group = jnp.full(num + 1, n_valid, jnp.int32).at[jnp.where(start, gid, num + 1)].set(pos, mode="drop")
    return jnp.where(valid, id_s, -1).astype(jnp.int32), group


def _pair_sums(table_gate, table_weight, group_w, k_val, group_r, q_val):
    """`A` and `QK` of one unit from its groups' rows over the tokens (`table_gate`, `table_weight` `[G, C]`) and its
    entries' groups and weights (`[C, W]` writes, `[C, R]` reads; group G: none).

    An entry e of token i meets its group's writes of every token j before it (j <= i for a read) with the weight
    val_e * Kw[j] * exp(X), X = the sum of the row's gates at tokens j+1..i, a direct sum. The tokens go in blocks,
    each rematerialised in the backward, so that the `[entries, C]` arrays of one block only are held at once.
    """
    G, C = table_gate.shape
    W, R = group_w.shape[1], group_r.shape[1]
    Cb = max(1, min(C, _PAIR_BLOCK // ((W + R) * C)))  # tokens per block
    NB = -(-C // Cb)
    j = jnp.arange(C)

    def blocks(a, fill):
        return jnp.pad(a, [(0, NB * Cb - C), (0, 0)], constant_values=fill).reshape(NB, Cb, a.shape[1])

    def terms(tok, groups, vals, strict):  # [Cb, L] entries of the block's tokens -> [Cb, C]
        tok = tok[:, None, None]
        gates = jnp.where(j <= tok, table_gate.at[groups].get(mode="fill", fill_value=0), 0)
        exponent = jnp.concatenate([lax.cumsum(gates[..., 1:], axis=2, reverse=True),
                                    jnp.zeros(gates.shape[:-1] + (1,), gates.dtype)], axis=-1)  # tokens j+1..i
        pair = j < tok if strict else j <= tok
        weight = vals[..., None] * table_weight.at[groups].get(mode="fill", fill_value=0)
        return jnp.where(pair, weight * jnp.exp(jnp.where(pair, exponent, 0)), 0).sum(axis=1)

    def block(args):
        b, gw, kv, gr, qv = args
        tok = b * Cb + jnp.arange(Cb)
        return terms(tok, gw, kv, True), terms(tok, gr, qv, False)

    if NB == 1:  # one block: no loop (the unit is rematerialised as a whole)
        return block((0, group_w, k_val, group_r, q_val))
    A, QK = lax.map(jax.checkpoint(block), (jnp.arange(NB), blocks(group_w, G), blocks(k_val, 0),
                                            blocks(group_r, G), blocks(q_val, 0)))
    return A.reshape(NB * Cb, C)[:C], QK.reshape(NB * Cb, C)[:C]


def _phase1_unit(k_idx, k_val, x, q_idx, q_val, num_slots):
    """Phase 1 of one unit (`[C, W]` / `[C, R]`) by a slot sort and a row per slot group over the chunk's tokens
    (docs/MATH.md "Phase 1")."""
    C, W = k_idx.shape
    R = q_idx.shape[1]
    E = C * (W + R)
    kvalid = (k_idx >= 0) & (k_idx < num_slots)
    qvalid = (q_idx >= 0) & (q_idx < num_slots)
    k_val = jnp.where(kvalid, k_val, 0)
    q_val = jnp.where(qvalid, q_val, 0)
    t_w = jnp.broadcast_to(jnp.arange(C)[:, None], (C, W))
    t_r = jnp.broadcast_to(jnp.arange(C)[:, None], (C, R))
    # Ties within a slot: token, then write lanes, then read lanes.
    slot = jnp.concatenate([jnp.where(kvalid, k_idx, _NO_SLOT).ravel(), jnp.where(qvalid, q_idx, _NO_SLOT).ravel()])
    tie = jnp.concatenate([(t_w * (W + R) + jnp.arange(W)).ravel(), (t_r * (W + R) + W + jnp.arange(R)).ravel()])
    is_write = jnp.arange(E) < C * W
    entry = jnp.arange(E)
    gates = jnp.concatenate([x.ravel(), jnp.zeros(C * R, x.dtype)])
    weights = jnp.concatenate([k_val.ravel(), q_val.ravel()])
    slot_s, tie_s, isw_s, x_s, val_s, entry_s = lax.sort(
        (slot.astype(jnp.int32), tie.astype(jnp.int32), is_write, gates, weights, entry), num_keys=2)
    valid_s = slot_s != _NO_SLOT
    tok_s = tie_s // (W + R)
    same_slot_as_prev = jnp.concatenate([jnp.zeros(1, bool), slot_s[1:] == slot_s[:-1]])
    # In sorted order a repeated write lane directly follows a write of the same slot and token.
    prev_write_same_token = jnp.concatenate([jnp.zeros(1, bool), isw_s[:-1] & (tok_s[1:] == tok_s[:-1])])
    repeat_s = isw_s & valid_s & same_slot_as_prev & prev_write_same_token
    head_s = isw_s & valid_s & ~repeat_s  # the first write of its slot in its token

    # Each slot group gets a row over the chunk's tokens: its head gate and its write weight sum (repeats included)
    # at each token with a write of the slot; a group has one head per token. The groups are at most K (distinct
    # slots) and E, so G rows hold them; row G takes nothing (invalid entries).
    G = min(E, num_slots)
    group_s = jnp.where(valid_s, jnp.cumsum(~same_slot_as_prev) - 1, G)
    table_gate = jnp.zeros((G, C), x.dtype).at[jnp.where(head_s, group_s, G), tok_s].set(
        jnp.where(head_s, x_s, 0), mode="drop")
    table_weight = jnp.zeros((G, C), x.dtype).at[jnp.where(isw_s & valid_s, group_s, G), tok_s].add(
        jnp.where(isw_s, val_s, 0), mode="drop")
    # Per-slot log-cumsums from the rows: each a direct sum of the gates it covers (never a difference of two sums,
    # which would cancel, and give -inf - -inf = NaN for a gate of -inf).
    suffix = lax.cumsum(table_gate, axis=1, reverse=True)  # gates at tokens t..C-1
    at_entry = lambda table: table.at[group_s, tok_s].get(mode="fill", fill_value=0)
    incl_s = at_entry(lax.cumsum(table_gate, axis=1))  # gates at tokens 0..t: log_k, log_q
    rex_s = at_entry(jnp.concatenate([suffix[:, 1:], jnp.zeros((G, 1), x.dtype)], axis=1))  # tokens t+1..C-1
    total_s = suffix.at[group_s, 0].get(mode="fill", fill_value=0)

    pos = jnp.arange(E)
    inverse = jnp.zeros(E, jnp.int32).at[entry_s].set(pos.astype(jnp.int32), unique_indices=True)

    def unsort(vals):
        return vals.at[inverse].get(unique_indices=True)

    log_all = unsort(incl_s)
    log_k, log_q = log_all[: C * W].reshape(C, W), log_all[C * W:].reshape(C, R)
    rex = unsort(rex_s)[: C * W].reshape(C, W)
    total = unsort(total_s)[: C * W].reshape(C, W)

    group = unsort(group_s)  # G: no group (an invalid entry), a row of zeros
    A, QK = _pair_sums(table_gate, table_weight, group[: C * W].reshape(C, W), k_val,
                       group[C * W:].reshape(C, R), q_val)

    w_order, w_group = _group_map(jnp.where(kvalid, k_idx, _NO_SLOT).ravel().astype(jnp.int32),
                                  jnp.arange(C * W, dtype=jnp.int32), C * W)
    r_order, r_group = _group_map(jnp.where(qvalid, q_idx, _NO_SLOT).ravel().astype(jnp.int32),
                                  jnp.arange(C * R, dtype=jnp.int32), C * R)
    return Phase1(
        log_k=log_k, rex=rex, cpe=jnp.exp(total), k_eff=k_val * jnp.exp(log_k), w=k_val * jnp.exp(rex),
        log_q=log_q, q_w=q_val * jnp.exp(log_q), A=A, QK=QK,
        w_order=w_order, w_group=w_group, r_order=r_order, r_group=r_group,
        repeats=jnp.sum(repeat_s).astype(jnp.int32))


def phase1_xla(k_idx, k_val, x, q_idx, q_val, num_slots):
    """Phase 1 (DESIGN.md) for units of shape `[..., C, W]` / `[..., C, R]`; returns a `Phase1`."""
    batch = k_idx.shape[:-2]
    C, W = k_idx.shape[-2:]
    R = q_idx.shape[-1]
    flat = [a.reshape((-1,) + a.shape[-2:]) for a in (k_idx, k_val, x, q_idx, q_val)]
    dt = jnp.promote_types(k_val.dtype, jnp.float32)  # float32, or float64 under x64
    flat = [flat[0].astype(jnp.int32), flat[1].astype(dt), flat[2].astype(dt), flat[3].astype(jnp.int32),
            flat[4].astype(dt)]
    per_unit = min(C * (W + R) * C, _PAIR_BLOCK)
    # Units at once: a divisor of their number (lax.map would compile a second copy of the unit for a remainder).
    N, most = flat[0].shape[0], max(1, _PAIR_BUDGET // per_unit)
    batch_size = max(d for d in range(1, min(N, most) + 1) if N % d == 0) if N else 1
    # Rematerialised in the backward: autodiff keeps only each unit's inputs, not its [C*(W+R), C] pair arrays.
    unit = jax.checkpoint(lambda a: _phase1_unit(*a, num_slots))
    out = lax.map(unit, tuple(flat), batch_size=batch_size)
    return Phase1(*[o.reshape(batch + o.shape[1:]) for o in out])


def solve_xla(A, beta):
    """`(I + diag(beta) A)^{-1}` per unit, `[..., C, C]`."""
    C = A.shape[-1]
    eye = jnp.eye(C, dtype=A.dtype)
    M = eye + beta[..., :, None] * A
    return jax.scipy.linalg.solve_triangular(M, jnp.broadcast_to(eye, M.shape), lower=True, unit_diagonal=True)


def _gather_rows(bank, idx, dtype):
    """Rows `bank[p, idx[p, ...]]` in `dtype`, zero for out-of-range ids. bank [P, K, D], idx [P, ...]."""
    return jax.vmap(lambda b, i: b.at[i].get(mode="fill", fill_value=0))(bank, idx).astype(dtype)


def _rounded(rows, storage):
    """`rows` with the values they take stored in the bank's `storage` dtype (bfloat16: rounded), in their own dtype.
    The rounding's derivative is taken as 1: the gradient goes through in the rows' dtype, as the kernels' float32
    working gradient (`bank_grad_dtype=float32`) does, never rounded to the storage dtype between chunks."""
    if jnp.dtype(storage) == rows.dtype:
        return rows
    return rows + lax.stop_gradient(rows.astype(storage).astype(rows.dtype) - rows)  # exact: r - x is


def _write_groups(bank, k_idx, p1, delta, storage, packed=None):
    """Decay-and-write of one chunk: each written row once, `cpe * S0[s] + sum_e w[e] delta[t_e]` (docs/MATH.md
    "Chunked form"), rounded as the bank's `storage` dtype holds it.

    With `packed = (initial, stamp, seg0, local)` (packed sequences, jax_sdm/segments.py) a group's `S0[s]` is the
    row at the start of its token's segment, and only the groups of the chunk's last segment are stored (the
    chunk's earlier segments are over), stamping their rows; it returns `(bank, stamp)` then.
    """
    P, C, W = k_idx.shape
    E = C * W
    K = bank.shape[1]

    def one_stream(bank_p, k_idx_p, w_p, cpe_p, order, group, delta_p, packed_p):
        contrib = (w_p[:, :, None] * delta_p[:, None, :]).reshape(E, -1)
        entry = jnp.maximum(order, 0)
        sorted_contrib = jnp.where((order >= 0)[:, None], contrib[entry], 0)
        first = group[:-1]
        sizes = group[1:] - first
        gid = jnp.cumsum(jnp.zeros(E, jnp.int32).at[first].add(sizes > 0, mode="drop")) - 1
        sums = jax.ops.segment_sum(sorted_contrib, jnp.where(order >= 0, gid, E), num_segments=E,
                                   indices_are_sorted=True)
        head = jnp.minimum(first, E - 1)
        head_entry = entry[head]
        slot = jnp.where(sizes > 0, k_idx_p.ravel()[head_entry], K)
        if packed_p is None:
            old = bank_p.at[slot].get(mode="fill", fill_value=0)
        else:
            initial_p, stamp_p, seg0_p, local_p = packed_p
            group_local = local_p[head_entry // W]
            old = segments.current_rows(bank_p, initial_p, stamp_p, slot, jnp.where(group_local == 0, seg0_p, -2))
            slot = jnp.where(group_local == jnp.max(local_p), slot, K)
        new = cpe_p.ravel()[head_entry][:, None] * old.astype(sums.dtype) + sums
        bank_p = bank_p.at[slot].set(_rounded(new.astype(bank_p.dtype), storage), mode="drop")
        if packed_p is None:
            return bank_p
        return bank_p, stamp_p.at[slot].set(seg0_p + jnp.max(local_p), mode="drop")

    return jax.vmap(one_stream)(bank, k_idx, p1.w, p1.cpe, p1.w_order, p1.w_group, delta, packed)


def _dot(subscripts, a, b):
    """A float32 contraction at full precision: the GPU's default for float32 dots is TF32 (about 1e-3 relative),
    far outside the 1e-5 accuracy bar (docs/MATH.md "Determinism and numerics")."""
    return jnp.einsum(subscripts, a, b, precision=lax.Precision.HIGHEST)


def chunk_loop_xla(bank, k_idx, q_idx, v, beta, p1, minv, packed=None):
    """Phase 2: the chunk steps. Arrays are in kernel layout, `[NC, P, C, ...]`; bank `[P, K, D]`.

    Arithmetic in `v`'s dtype (float32, or float64 under x64), the working bank too: a bfloat16 bank's rows are
    rounded once per chunk that writes them (as the kernels round them), but its gradient stays in the working dtype
    between chunks (a bfloat16 cotangent would round every gather's and read's contribution to a row, and lose
    most digits of a row read hundreds of times). Returns `y [NC, P, C, D]` and the final bank.
    For packed sequences, `packed = (seg0, local, last)` of `segments.chunk_segments` (`p1` then comes from the
    virtual slot ids of `segments.virtual_slots`): the bank's rows carry stamps, rows are read as of the start of
    each token's segment, and the final bank is that of each stream's last segment (jax_sdm/segments.py).
    """
    K = bank.shape[1]
    storage = bank.dtype
    bank = bank.astype(jnp.promote_types(storage, v.dtype))

    def gather(bank, idx, dtype, rows_of_segment):
        if rows_of_segment is None:
            return _gather_rows(bank, idx, dtype)
        return rows_of_segment(jnp.where((idx >= 0) & (idx < K), idx, K)).astype(dtype)

    def step(carry, chunk):
        k_idx_c, q_idx_c, v_c, beta_c, p1_c, minv_c, packed_c = chunk
        if packed_c is None:
            bank, rows_of_segment = carry, None
        else:
            bank, initial, stamp = carry
            seg0_c, local_c = packed_c
            current = jnp.where(local_c == 0, seg0_c[:, None], -2)[..., None]  # [P, C, 1]
            rows_of_segment = lambda rows: jax.vmap(segments.current_rows)(bank, initial, stamp, rows, current)
        G = _dot("pcw,pcwd->pcd", p1_c.k_eff, gather(bank, k_idx_c, v_c.dtype, rows_of_segment))
        Q0 = _dot("pcr,pcrd->pcd", p1_c.q_w, gather(bank, q_idx_c, v_c.dtype, rows_of_segment))
        u = beta_c[..., None] * (v_c - G)
        delta = _dot("pij,pjd->pid", minv_c, u)
        y = Q0 + _dot("pij,pjd->pid", p1_c.QK, delta)
        if packed_c is None:
            return _write_groups(bank, k_idx_c, p1_c, delta, storage), y
        bank, stamp = _write_groups(bank, k_idx_c, p1_c, delta, storage, (initial, stamp, seg0_c, local_c))
        return (bank, initial, stamp), y

    if packed is None:
        bank, y = lax.scan(step, bank, (k_idx, q_idx, v, beta, p1, minv, None))
        return y, bank.astype(storage)
    seg0, local, last = packed
    carry = (bank, bank, jnp.zeros(bank.shape[:2], jnp.int32))
    (final, initial, stamp), y = lax.scan(step, carry, (k_idx, q_idx, v, beta, p1, minv, (seg0, local)))
    return y, segments.final_bank(final, initial, stamp, last).astype(storage)
