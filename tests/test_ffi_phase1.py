"""The CPU phase-1 kernel (``sdm_phase1`` via ``phase1_ffi``) against a NumPy
brute force written from the definitions of docs/DESIGN.md "Phase 1"."""

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_sdm.ffi_ops import phase1_ffi

FIELDS = (
    "log_k", "rex", "cpe", "k_eff", "w", "log_q", "q_w", "A", "QK",
    "w_order", "w_group", "r_order", "r_group", "repeats",
)
FLOAT_FIELDS = FIELDS[:9]
INT_FIELDS = FIELDS[9:]


# ---------------------------------------------------------------------------
# Brute force (float64, O(E^2) loops straight from the definitions)
# ---------------------------------------------------------------------------

def phase1_brute(k_idx, k_val, x, q_idx, q_val, K):
    k_idx = np.asarray(k_idx)
    q_idx = np.asarray(q_idx)
    k_val = np.asarray(k_val, np.float64)
    x = np.asarray(x, np.float64)
    q_val = np.asarray(q_val, np.float64)
    N, C, W = k_idx.shape
    R = q_idx.shape[2]
    out = {
        "log_k": np.zeros((N, C, W)), "rex": np.zeros((N, C, W)),
        "cpe": np.ones((N, C, W)), "k_eff": np.zeros((N, C, W)),
        "w": np.zeros((N, C, W)), "log_q": np.zeros((N, C, R)),
        "q_w": np.zeros((N, C, R)), "A": np.zeros((N, C, C)),
        "QK": np.zeros((N, C, C)),
        "w_order": np.full((N, C * W), -1, np.int32),
        "w_group": np.zeros((N, C * W + 1), np.int32),
        "r_order": np.full((N, C * R), -1, np.int32),
        "r_group": np.zeros((N, C * R + 1), np.int32),
        "repeats": np.zeros((N,), np.int32),
    }
    for u in range(N):
        ki, qi = k_idx[u], q_idx[u]
        valid_w = (ki >= 0) & (ki < K)
        valid_r = (qi >= 0) & (qi < K)
        repeat = np.zeros((C, W), bool)
        for t in range(C):
            for n in range(W):
                if valid_w[t, n] and any(ki[t, n2] == ki[t, n] for n2 in range(n)):
                    repeat[t, n] = True
        out["repeats"][u] = repeat.sum()
        xe = np.where(valid_w & ~repeat, x[u], 0.0)
        writes = [(t, n) for t in range(C) for n in range(W) if valid_w[t, n]]
        reads = [(t, m) for t in range(C) for m in range(R) if valid_r[t, m]]

        for (t, n) in writes:
            s = ki[t, n]
            same = [(t2, n2) for (t2, n2) in writes if ki[t2, n2] == s]
            lk = sum(xe[t2, n2] for (t2, n2) in same if t2 <= t)
            rx = sum(xe[t2, n2] for (t2, n2) in same if t2 > t)
            tot = sum(xe[t2, n2] for (t2, n2) in same)
            out["log_k"][u, t, n] = lk
            out["rex"][u, t, n] = rx
            out["cpe"][u, t, n] = np.exp(tot)
            out["k_eff"][u, t, n] = k_val[u, t, n] * np.exp(lk)
            out["w"][u, t, n] = k_val[u, t, n] * np.exp(rx)
        for (t, m) in reads:
            s = qi[t, m]
            lq = sum(xe[t2, n2] for (t2, n2) in writes if ki[t2, n2] == s and t2 <= t)
            out["log_q"][u, t, m] = lq
            out["q_w"][u, t, m] = q_val[u, t, m] * np.exp(lq)

        lkU = out["log_k"][u]
        lqU = out["log_q"][u]
        for (ti, ni) in writes:
            for (tj, nj) in writes:
                if tj < ti and ki[ti, ni] == ki[tj, nj]:
                    out["A"][u, ti, tj] += (k_val[u, ti, ni] * k_val[u, tj, nj]
                                            * np.exp(lkU[ti, ni] - lkU[tj, nj]))
        for (ti, mi) in reads:
            for (tj, nj) in writes:
                if tj <= ti and qi[ti, mi] == ki[tj, nj]:
                    out["QK"][u, ti, tj] += (q_val[u, ti, mi] * k_val[u, tj, nj]
                                             * np.exp(lqU[ti, mi] - lkU[tj, nj]))

        def csr(entries, idx, lanes, order, group):
            srt = sorted(entries, key=lambda e: (idx[e], e[0], e[1]))
            for p, (t, l) in enumerate(srt):
                order[p] = t * lanes + l
            g = 0
            for p, e in enumerate(srt):
                if p == 0 or idx[e] != idx[srt[p - 1]]:
                    group[g] = p
                    g += 1
            group[g:] = len(srt)

        csr(writes, ki, W, out["w_order"][u], out["w_group"][u])
        csr(reads, qi, R, out["r_order"][u], out["r_group"][u])
    return out


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def seed_of(*parts):
    """A reproducible per-test seed (Python's str hash is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def make_inputs(seed, N, C, W, R, K, *, invalid=0.0, gate="lane", pad_tokens=0):
    rng = np.random.default_rng(seed)
    k_idx = rng.integers(0, K, size=(N, C, W)).astype(np.int32)
    q_idx = rng.integers(0, K, size=(N, C, R)).astype(np.int32)
    if invalid:
        for a in (k_idx, q_idx):
            mask = rng.random(a.shape) < invalid
            a[mask] = rng.choice(np.array([-1, K, K + 3, -7], np.int32), size=mask.sum())
    if pad_tokens:
        k_idx[:, C - pad_tokens:] = -1
        q_idx[:, C - pad_tokens:] = -1
    k_val = rng.standard_normal((N, C, W)).astype(np.float32)
    q_val = rng.standard_normal((N, C, R)).astype(np.float32)
    if gate == "lane":
        x = -np.logaddexp(0.0, rng.standard_normal((N, C, W)))  # -softplus
    elif gate == "token":
        x = np.repeat(-np.logaddexp(0.0, rng.standard_normal((N, C, 1))), W, axis=2)
    elif gate == "any":  # any finite value is computed as written
        x = 0.3 * rng.standard_normal((N, C, W))
    else:
        raise ValueError(gate)
    return k_idx, k_val, x.astype(np.float32), q_idx, q_val


def check_against_brute(got, want, rtol=1e-5, atol=1e-5):
    assert len(got) == len(FIELDS)
    for name, g in zip(FIELDS, got):
        g = np.asarray(g)
        wv = want[name]
        assert g.shape == wv.shape, (name, g.shape, wv.shape)
        if name in INT_FIELDS:
            assert g.dtype == np.int32, (name, g.dtype)
            np.testing.assert_array_equal(g, wv, err_msg=name)
        else:
            assert g.dtype == np.float32, (name, g.dtype)
            np.testing.assert_allclose(g, wv, rtol=rtol, atol=atol, err_msg=name)


CASES = [
    # (N, C, W, R, K)
    (3, 5, 1, 1, 4),
    (3, 5, 3, 2, 4),
    (3, 8, 4, 3, 6),
    (3, 9, 6, 5, 12),
    (3, 13, 2, 4, 5),
    (3, 17, 5, 1, 8),
    (2, 16, 6, 5, 4),  # hot: few slots, many repeats
    (3, 7, 3, 3, 1000),  # sparse: few collisions
]


@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}C{c[1]}W{c[2]}R{c[3]}K{c[4]}" for c in CASES])
@pytest.mark.parametrize("gate", ["lane", "token"])
def test_phase1_matches_brute_force(case, gate):
    N, C, W, R, K = case
    seed = seed_of(case, gate)
    args = make_inputs(seed, N, C, W, R, K, gate=gate)
    got = phase1_ffi(*args, K)
    check_against_brute(got, phase1_brute(*args, K))


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_phase1_out_of_range_ids(seed):
    N, C, W, R, K = 3, 11, 4, 3, 6
    args = make_inputs(seed, N, C, W, R, K, invalid=0.3)
    k_idx, q_idx = args[0], args[3]
    assert (k_idx < 0).any() and (k_idx >= K).any()
    assert (q_idx < 0).any() or (q_idx >= K).any()
    got = phase1_ffi(*args, K)
    want = phase1_brute(*args, K)
    check_against_brute(got, want)
    # invalid entries: zeros, cpe 1, order -1 at the end
    invalid = (k_idx < 0) | (k_idx >= K)
    got = dict(zip(FIELDS, (np.asarray(g) for g in got)))
    for name in ("log_k", "rex", "k_eff", "w"):
        assert (got[name][invalid] == 0).all(), name
    assert (got["cpe"][invalid] == 1).all()
    n_valid = (~invalid).reshape(N, -1).sum(1)
    for u in range(N):
        assert (got["w_order"][u, n_valid[u]:] == -1).all()
        assert (got["w_group"][u, -1] == n_valid[u])


def test_phase1_padding_tokens_and_any_gates():
    N, C, W, R, K = 3, 12, 3, 2, 5
    args = make_inputs(21, N, C, W, R, K, pad_tokens=4, gate="any")
    got = phase1_ffi(*args, K)
    check_against_brute(got, phase1_brute(*args, K))
    A, QK = np.asarray(got[7]), np.asarray(got[8])
    assert (A[:, 8:, :] == 0).all() and (A[:, :, 8:] == 0).all()
    assert (QK[:, 8:, :] == 0).all()


def test_phase1_triangular_structure():
    args = make_inputs(31, 3, 10, 4, 3, 3)
    got = phase1_ffi(*args, 3)
    A, QK = np.asarray(got[7]), np.asarray(got[8])
    assert (np.triu(A) == 0).all()  # strictly lower
    assert (np.triu(QK, 1) == 0).all()  # lower with diagonal
    assert (np.asarray(got[13]) > 0).all()  # K=3, W=4: every token repeats


def test_phase1_batch_shape_jit_and_vmap():
    B, P, C, W, R, K = 2, 3, 6, 3, 2, 5
    args = make_inputs(41, B * P, C, W, R, K)
    flat = phase1_ffi(*args, K)
    batched = [a.reshape((B, P) + a.shape[1:]) for a in args]
    got = phase1_ffi(*batched, K)
    for name, f, g in zip(FIELDS, flat, got):
        assert g.shape == (B, P) + f.shape[1:], name
        np.testing.assert_array_equal(np.asarray(g).reshape(f.shape), np.asarray(f), err_msg=name)
    jitted = jax.jit(phase1_ffi, static_argnums=5)(*args, K)
    for name, f, g in zip(FIELDS, flat, jitted):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(f), err_msg=name)
    vmapped = jax.vmap(lambda *a: phase1_ffi(*a, K))(*batched)
    for name, f, g in zip(FIELDS, flat, vmapped):
        np.testing.assert_array_equal(np.asarray(g).reshape(f.shape), np.asarray(f), err_msg=name)


def test_phase1_input_casts():
    """Other index ints and float dtypes are cast in the wrapper."""
    args = make_inputs(51, 2, 5, 2, 2, 4)
    k_idx, k_val, x, q_idx, q_val = args
    ref = phase1_ffi(*args, 4)
    got = phase1_ffi(k_idx.astype(np.int16), k_val.astype(np.float16).astype(np.float32),
                     x, q_idx.astype(np.uint8), q_val, 4)
    np.testing.assert_array_equal(np.asarray(got[9]), np.asarray(ref[9]))
    got16 = phase1_ffi(k_idx, jnp.asarray(k_val, jnp.bfloat16), x, q_idx, q_val, 4)
    assert got16[0].dtype == jnp.float32


def test_phase1_deterministic_bitwise():
    args = make_inputs(61, 4, 32, 8, 8, 16)
    a = phase1_ffi(*args, 16)
    b = phase1_ffi(*args, 16)
    c = jax.jit(phase1_ffi, static_argnums=5)(*args, 16)
    for name, x1, x2, x3 in zip(FIELDS, a, b, c):
        assert np.asarray(x1).tobytes() == np.asarray(x2).tobytes(), name
        assert np.asarray(x1).tobytes() == np.asarray(x3).tobytes(), name


def test_phase1_large_units_threads():
    """Enough work to use several threads: results equal a unit-by-unit run."""
    args = make_inputs(71, 64, 32, 8, 8, 24)
    full = phase1_ffi(*args, 24)
    for u in (0, 17, 63):
        one = phase1_ffi(*(a[u:u + 1] for a in args), 24)
        for name, f, o in zip(FIELDS, full, one):
            assert np.asarray(f)[u:u + 1].tobytes() == np.asarray(o).tobytes(), name


def test_phase1_empty_batch_and_no_slots():
    args = make_inputs(81, 2, 4, 2, 2, 3)
    got = phase1_ffi(*(a[:0] for a in args), 3)
    assert got[0].shape == (0, 4, 2) and got[13].shape == (0,)
    # K = 0: every entry is invalid
    got = phase1_ffi(*args, 0)
    check_against_brute(got, phase1_brute(*args, 0))


def test_phase1_shape_errors():
    args = list(make_inputs(91, 2, 4, 2, 2, 3))
    bad = list(args)
    bad[1] = bad[1][:, :, :1]
    with pytest.raises(ValueError, match="k_val"):
        phase1_ffi(*bad, 3)
    bad = list(args)
    bad[3] = bad[3][:, :3]
    with pytest.raises(ValueError, match="q_idx"):
        phase1_ffi(*bad, 3)


def test_phase1_returns_phase1_tuple_if_available():
    got = phase1_ffi(*make_inputs(101, 1, 3, 1, 1, 2), 2)
    try:
        from jax_sdm.xla import Phase1
    except ImportError:
        assert isinstance(got, tuple)
        return
    assert isinstance(got, Phase1)
    assert Phase1._fields == FIELDS


def _phase1_xla():
    try:
        from jax_sdm.xla import phase1_xla
    except ImportError:
        return None
    return phase1_xla


@pytest.mark.skipif(_phase1_xla() is None, reason="jax_sdm.xla.phase1_xla does not import")
@pytest.mark.parametrize("case,invalid,gate", [
    ((3, 5, 3, 2, 4), 0.0, "lane"),
    ((3, 17, 5, 4, 8), 0.0, "token"),
    ((3, 9, 6, 5, 12), 0.25, "lane"),
    ((2, 16, 6, 5, 4), 0.1, "any"),
])
def test_phase1_matches_xla(case, invalid, gate):
    N, C, W, R, K = case
    args = make_inputs(seed_of(case, invalid, gate), N, C, W, R, K,
                       invalid=invalid, gate=gate)
    got = phase1_ffi(*args, K)
    want = _phase1_xla()(*args, K)
    assert len(want) == len(FIELDS)
    for name, g, wv in zip(FIELDS, got, want):
        g, wv = np.asarray(g), np.asarray(wv)
        assert g.shape == wv.shape and g.dtype == wv.dtype, (name, g.shape, wv.shape)
        if name in INT_FIELDS:
            np.testing.assert_array_equal(g, wv, err_msg=name)
        else:
            np.testing.assert_allclose(g, wv, rtol=1e-5, atol=1e-5, err_msg=name)
