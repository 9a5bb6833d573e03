"""The CPU phase-1 kernels: ``sdm_phase1`` (via ``phase1_ffi``) against a NumPy
brute force written from the definitions of docs/DESIGN.md "Phase 1", and
``sdm_phase1_bwd`` (via ``phase1_bwd_ffi``) against ``jax.vjp`` of ``phase1_xla``;
leading batch dims and vmap (one kernel call, per-example results bitwise)."""

import functools
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_sdm.ffi_ops import phase1_bwd_ffi, phase1_ffi
from jax_sdm.xla import Phase1, phase1_xla

from .helpers import assert_one_kernel_call, phase1_gates

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

        def between(s, tj, ti):
            """log_k / log_q at token ti minus log_k at tj for slot s: the gates of tokens tj+1..ti, summed."""
            return sum(xe[t2, n2] for (t2, n2) in writes if ki[t2, n2] == s and tj < t2 <= ti)

        for (ti, ni) in writes:
            for (tj, nj) in writes:
                if tj < ti and ki[ti, ni] == ki[tj, nj]:
                    out["A"][u, ti, tj] += (k_val[u, ti, ni] * k_val[u, tj, nj]
                                            * np.exp(between(ki[ti, ni], tj, ti)))
        for (ti, mi) in reads:
            for (tj, nj) in writes:
                if tj <= ti and qi[ti, mi] == ki[tj, nj]:
                    out["QK"][u, ti, tj] += (q_val[u, ti, mi] * k_val[u, tj, nj]
                                             * np.exp(between(qi[ti, mi], tj, ti)))

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
    return k_idx, k_val, phase1_gates(rng, N, C, W, gate), q_idx, q_val


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
            with np.errstate(over="ignore"):
                in_f32 = wv.astype(np.float32)  # a log sum below -3.4e38 is -inf in float32
            ok = np.isfinite(in_f32)
            np.testing.assert_array_equal(np.isfinite(g), ok, err_msg=name)
            np.testing.assert_array_equal(g[~ok], in_f32[~ok], err_msg=name)
            np.testing.assert_allclose(g[ok], wv[ok], rtol=rtol, atol=atol, err_msg=name)


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
@pytest.mark.parametrize("gate", ["lane", "token", "extreme"])
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


def test_phase1_returns_a_phase1():
    got = phase1_ffi(*make_inputs(101, 1, 3, 1, 1, 2), 2)
    assert isinstance(got, Phase1)
    assert Phase1._fields == FIELDS


@pytest.mark.parametrize("case,invalid,gate", [
    ((3, 5, 3, 2, 4), 0.0, "lane"),
    ((3, 17, 5, 4, 8), 0.0, "token"),
    ((3, 9, 6, 5, 12), 0.25, "lane"),
    ((2, 16, 6, 5, 4), 0.1, "any"),
    ((3, 16, 6, 5, 4), 0.1, "extreme"),
])
def test_phase1_matches_xla(case, invalid, gate):
    N, C, W, R, K = case
    args = make_inputs(seed_of(case, invalid, gate), N, C, W, R, K,
                       invalid=invalid, gate=gate)
    got = phase1_ffi(*args, K)
    want = phase1_xla(*args, K)
    assert len(want) == len(FIELDS)
    for name, g, wv in zip(FIELDS, got, want):
        g, wv = np.asarray(g), np.asarray(wv)
        assert g.shape == wv.shape and g.dtype == wv.dtype, (name, g.shape, wv.shape)
        if name in INT_FIELDS:
            np.testing.assert_array_equal(g, wv, err_msg=name)
        else:
            np.testing.assert_array_equal(np.isfinite(g), np.isfinite(wv), err_msg=name)
            np.testing.assert_array_equal(g[~np.isfinite(wv)], wv[~np.isfinite(wv)], err_msg=name)
            ok = np.isfinite(wv)
            np.testing.assert_allclose(g[ok], wv[ok], rtol=1e-5, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------------------
# Phase-1 backward (sdm_phase1_bwd via phase1_bwd_ffi) against jax.vjp(phase1_xla)
# ---------------------------------------------------------------------------



def fresh_seed():
    """A new seed every run (reported by the assertions that use it)."""
    return int(np.random.SeedSequence().entropy % 2**32)


def make_bwd_inputs(seed, N, C, W, R, K, *, invalid=0.1, partial=0.3, pad_tokens=1, gate="lane"):
    """Collisions (small K), repeats in a token (W vs K), out-of-range ids, tokens with
    some lanes -1 and padding tokens at the end (all ids -1)."""
    rng = np.random.default_rng(seed + 1)
    args = list(make_inputs(seed, N, C, W, R, K, invalid=invalid, gate=gate, pad_tokens=pad_tokens))
    for i in (0, 3):
        idx = args[i]
        tokens = rng.random(idx.shape[:2]) < partial
        lanes = rng.random(idx.shape) < 0.5
        idx[tokens[:, :, None] & lanes] = -1
    return tuple(args)


def group_first_entries(p1):
    """Mask [N, C*W] of each write group's first sorted entry."""
    w_order, w_group = np.asarray(p1.w_order), np.asarray(p1.w_group)
    N, CW = w_order.shape
    mask = np.zeros((N, CW), bool)
    for u in range(N):
        starts = w_group[u, :-1]
        nonempty = starts < w_group[u, 1:]
        mask[u, w_order[u, starts[nonempty]]] = True
    return mask


def make_cotangents(seed, p1, *, dcpe_everywhere=False):
    """Random cotangents of k_eff, w, cpe, q_w, A (strictly lower), QK (lower incl. the
    diagonal). dcpe is nonzero only at group-first entries, as the backward steps give it."""
    rng = np.random.default_rng(seed + 2)
    shape_w, shape_r = p1.k_eff.shape, p1.q_w.shape
    C = shape_w[-2]
    f32 = np.float32
    dk_eff = rng.standard_normal(shape_w).astype(f32)
    dw = rng.standard_normal(shape_w).astype(f32)
    dq_w = rng.standard_normal(shape_r).astype(f32)
    dA = (rng.standard_normal(p1.A.shape) * np.tri(C, C, -1)).astype(f32)
    dQK = (rng.standard_normal(p1.QK.shape) * np.tri(C, C, 0)).astype(f32)
    dcpe = rng.standard_normal(shape_w).astype(f32)
    if not dcpe_everywhere:
        first = group_first_entries(p1).reshape(shape_w)
        dcpe = np.where(first, dcpe, 0).astype(f32)
    return dk_eff, dw, dcpe, dq_w, dA, dQK


@functools.partial(jax.jit, static_argnums=1)
def phase1_vjp_xla(args, K, cots):
    """jax.vjp of phase1_xla w.r.t. (k_val, x, q_val); zero cotangents on log_k, rex, log_q."""
    k_idx, k_val, x, q_idx, q_val = args
    dk_eff, dw, dcpe, dq_w, dA, dQK = cots

    def f(kv, xx, qv):
        return tuple(phase1_xla(k_idx, kv, xx, q_idx, qv, K)[:9])

    out, vjp = jax.vjp(f, k_val, x, q_val)
    zero = [jnp.zeros_like(o) for o in out]
    return vjp((zero[0], zero[1], dcpe, dk_eff, dw, zero[5], dq_w, dA, dQK))


def rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# Shapes are few on purpose: each (shape, K) compiles the XLA reference's VJP once (seconds);
# the gate kinds share a shape.
BWD_CASES = [
    # (N, C, W, R, K, gate)
    (4, 12, 5, 4, 5, "lane"),
    (4, 12, 5, 4, 5, "token"),
    (4, 12, 5, 4, 5, "any"),      # gates of either sign
    (4, 12, 5, 4, 5, "extreme"),  # gates of -inf, -3e38, -1e30, -1e10 among ordinary ones
    (3, 8, 6, 3, 3, "lane"),      # hot: W > K, repeats in every token
    (3, 6, 1, 1, 3, "lane"),      # one lane
]


# A case of another shape than the first compiles the pure-JAX VJP again: slow (the whole op's gradients against
# the token loop cover those shapes too).
@pytest.mark.parametrize("case", [
    pytest.param(c, id="N{}C{}W{}R{}K{}-{}".format(*c), marks=() if c[:5] == BWD_CASES[0][:5] else pytest.mark.slow)
    for c in BWD_CASES])
def test_phase1_bwd_matches_xla_vjp(case):
    N, C, W, R, K, gate = case
    seed = fresh_seed()
    args = make_bwd_inputs(seed, N, C, W, R, K, gate=gate)
    p1 = phase1_ffi(*args, K)
    cots = make_cotangents(seed, p1)
    got = phase1_bwd_ffi(*args, K, p1, *cots)
    want = phase1_vjp_xla(args, K, cots)
    for name, g, wv, like in zip(("dk_val", "dx", "dq_val"), got, want, (args[1], args[2], args[4])):
        g = np.asarray(g)
        assert g.shape == like.shape and g.dtype == np.float32, (name, g.shape, g.dtype)
        assert np.isfinite(g).all(), f"{name}: non-finite gradients (seed {seed})"
        err = rel_l2(g, wv)
        assert err < 1e-5, f"{name}: relative L2 error {err:.3g} (seed {seed})"


def test_phase1_bwd_dcpe_anywhere_and_none_cotangents():
    """dcpe at any write entry counts for its slot's total; None cotangents are zeros."""
    N, C, W, R, K = BWD_CASES[0][:5]
    seed = fresh_seed()
    args = make_bwd_inputs(seed, N, C, W, R, K)
    p1 = phase1_ffi(*args, K)
    cots = make_cotangents(seed, p1, dcpe_everywhere=True)
    got = phase1_bwd_ffi(*args, K, p1, *cots)
    want = phase1_vjp_xla(args, K, cots)
    for name, g, wv in zip(("dk_val", "dx", "dq_val"), got, want):
        assert rel_l2(g, wv) < 1e-5, (name, seed)
    # only dA: None for the rest equals explicit zeros
    zeros = [np.zeros_like(c) for c in cots]
    only_dA = list(zeros)
    only_dA[4] = cots[4]
    a = phase1_bwd_ffi(*args, K, p1, None, None, None, None, cots[4], None)
    b = phase1_bwd_ffi(*args, K, p1, *only_dA)
    for x1, x2 in zip(a, b):
        assert np.asarray(x1).tobytes() == np.asarray(x2).tobytes()


def test_phase1_bwd_zero_for_invalid_and_repeats():
    N, C, W, R, K = 3, 11, 5, 4, 4
    args = make_bwd_inputs(seed_of("bwd-zeros"), N, C, W, R, K, invalid=0.25)
    k_idx, q_idx = args[0], args[3]
    p1 = phase1_ffi(*args, K)
    assert (np.asarray(p1.repeats) > 0).all()
    cots = make_cotangents(7, p1)
    dk_val, dx, dq_val = (np.asarray(a) for a in phase1_bwd_ffi(*args, K, p1, *cots))
    kinv = (k_idx < 0) | (k_idx >= K)
    qinv = (q_idx < 0) | (q_idx >= K)
    repeat = np.zeros_like(kinv)
    for n in range(W):
        for n2 in range(n):
            repeat[:, :, n] |= (k_idx[:, :, n] == k_idx[:, :, n2]) & ~kinv[:, :, n]
    assert kinv.any() and qinv.any() and repeat.any()
    assert (dk_val[kinv] == 0).all() and (dx[kinv] == 0).all() and (dq_val[qinv] == 0).all()
    assert (dx[repeat] == 0).all()
    assert (dk_val[repeat] != 0).any()  # a repeat still has a weight gradient


def test_phase1_bwd_reads_only_the_lower_parts():
    """Garbage on and above dA's diagonal and above dQK's is ignored, bitwise."""
    N, C, W, R, K = 2, 9, 3, 3, 4
    args = make_bwd_inputs(seed_of("bwd-tril"), N, C, W, R, K)
    p1 = phase1_ffi(*args, K)
    cots = list(make_cotangents(3, p1))
    ref = phase1_bwd_ffi(*args, K, p1, *cots)
    rng = np.random.default_rng(4)
    cots[4] = cots[4] + (rng.standard_normal(cots[4].shape) * np.triu(np.ones((C, C)))).astype(np.float32)
    cots[5] = cots[5] + (rng.standard_normal(cots[5].shape) * np.triu(np.ones((C, C)), 1)).astype(np.float32)
    got = phase1_bwd_ffi(*args, K, p1, *cots)
    for x1, x2 in zip(ref, got):
        assert np.asarray(x1).tobytes() == np.asarray(x2).tobytes()


def test_phase1_bwd_deterministic_bitwise_and_threads():
    """Repeated calls, jit, and a unit-by-unit run agree bitwise (enough units for several threads)."""
    N, C, W, R, K = 64, 32, 8, 8, 24
    args = make_bwd_inputs(seed_of("bwd-det"), N, C, W, R, K)
    p1 = phase1_ffi(*args, K)
    cots = make_cotangents(5, p1)
    a = phase1_bwd_ffi(*args, K, p1, *cots)
    b = phase1_bwd_ffi(*args, K, p1, *cots)
    c = jax.jit(phase1_bwd_ffi, static_argnums=5)(*args, K, p1, *cots)
    for x1, x2, x3 in zip(a, b, c):
        assert np.asarray(x1).tobytes() == np.asarray(x2).tobytes()
        assert np.asarray(x1).tobytes() == np.asarray(x3).tobytes()
    for u in (0, 17, 63):
        sl = lambda t: type(t)(*(np.asarray(f)[u:u + 1] for f in t))
        one = phase1_bwd_ffi(*(x[u:u + 1] for x in args), K, sl(p1), *(x[u:u + 1] for x in cots))
        for full, o in zip(a, one):
            assert np.asarray(full)[u:u + 1].tobytes() == np.asarray(o).tobytes()


def test_phase1_bwd_shape_errors():
    N, C, W, R, K = 2, 4, 2, 3, 3
    args = make_bwd_inputs(seed_of("bwd-err"), N, C, W, R, K)
    p1 = phase1_ffi(*args, K)
    cots = list(make_cotangents(1, p1))
    for i, name in enumerate(("dk_eff", "dw", "dcpe", "dq_w", "dA", "dQK")):
        bad = list(cots)
        bad[i] = bad[i][..., :1]
        with pytest.raises(ValueError, match=name):
            phase1_bwd_ffi(*args, K, p1, *bad)
    with pytest.raises(ValueError, match="log_q"):
        phase1_bwd_ffi(*args, K, p1._replace(log_q=p1.log_q[:1]), *cots)
    with pytest.raises(ValueError, match="x"):
        phase1_bwd_ffi(args[0], args[1], args[2][:1], args[3], args[4], K, p1, *cots)


# ---------------------------------------------------------------------------
# Leading batch dims and vmap: one kernel call, per-example results bitwise
# ---------------------------------------------------------------------------

def test_phase1_vmap_one_call_and_bitwise():
    V1, V2, P, C, W, R, K = 3, 2, 2, 7, 4, 3, 5
    args = make_bwd_inputs(seed_of("vmap-fwd"), V1 * V2 * P, C, W, R, K)
    nested = [a.reshape((V1, V2, P) + a.shape[1:]) for a in args]
    per_example = [[phase1_ffi(*(a[i, j] for a in nested), K) for j in range(V2)] for i in range(V1)]

    f1 = jax.vmap(lambda *a: phase1_ffi(*a, K))
    f2 = jax.vmap(jax.vmap(lambda *a: phase1_ffi(*a, K)))
    one = f1(*(a[0] for a in nested))
    two = f2(*nested)
    for name, k in zip(FIELDS, range(len(FIELDS))):
        for i in range(V1):
            for j in range(V2):
                want = np.asarray(per_example[i][j][k]).tobytes()
                assert np.asarray(two[k])[i, j].tobytes() == want, name
                if i == 0:
                    assert np.asarray(one[k])[j].tobytes() == want, name
    assert_one_kernel_call(f2, *nested)

    # mapped over axis 1 of x only: the other inputs are shared (broadcast)
    xs = np.stack([args[2][:P], 0.5 * args[2][:P]], axis=1)  # [P, 2, C, W]
    g = jax.vmap(lambda x: phase1_ffi(args[0][:P], args[1][:P], x, args[3][:P], args[4][:P], K),
                 in_axes=1)
    got = g(xs)
    for v in range(2):
        want = phase1_ffi(args[0][:P], args[1][:P], xs[:, v], args[3][:P], args[4][:P], K)
        for name, gv, wv in zip(FIELDS, got, want):
            assert np.asarray(gv)[v].tobytes() == np.asarray(wv).tobytes(), name
    assert_one_kernel_call(g, xs)


def test_phase1_unbatched_unit():
    """A single unit without batch dims: [C, W] / [C, R]."""
    args = make_bwd_inputs(seed_of("one-unit"), 1, 6, 3, 2, 4)
    got = phase1_ffi(*(a[0] for a in args), 4)
    want = phase1_ffi(*args, 4)
    for name, g, wv in zip(FIELDS, got, want):
        assert g.shape == wv.shape[1:], name
        assert np.asarray(g).tobytes() == np.asarray(wv)[0].tobytes(), name


def test_phase1_bwd_batch_dims_and_vmap():
    V, P, C, W, R, K = 3, 2, 8, 4, 3, 5
    args = make_bwd_inputs(seed_of("vmap-bwd"), V * P, C, W, R, K)
    p1 = phase1_ffi(*args, K)
    cots = make_cotangents(9, p1)
    flat = phase1_bwd_ffi(*args, K, p1, *cots)

    def split(a):
        return np.asarray(a).reshape((V, P) + np.shape(a)[1:])

    b_args = [split(a) for a in args]
    b_p1 = type(p1)(*(split(f) for f in p1))
    b_cots = [split(c) for c in cots]
    batched = phase1_bwd_ffi(*b_args, K, b_p1, *b_cots)
    f = jax.vmap(lambda a, p, c: phase1_bwd_ffi(*a, K, p, *c))
    vmapped = f(b_args, b_p1, b_cots)
    for fl, ba, vm in zip(flat, batched, vmapped):
        assert ba.shape == (V, P) + fl.shape[1:]
        assert np.asarray(ba).tobytes() == np.asarray(fl).tobytes()
        assert np.asarray(vm).tobytes() == np.asarray(fl).tobytes()
    for v in range(V):
        one = phase1_bwd_ffi(*(a[v] for a in b_args), K, type(p1)(*(x[v] for x in b_p1)),
                             *(c[v] for c in b_cots))
        for vm, o in zip(vmapped, one):
            assert np.asarray(vm)[v].tobytes() == np.asarray(o).tobytes()
    assert_one_kernel_call(f, b_args, b_p1, b_cots)


def test_phase1_handlers_check_leading_dims():
    """The handlers take any leading dims but check their product and the per-unit shapes."""
    N, C, W, R, K = 4, 5, 3, 2, 4
    args = make_bwd_inputs(seed_of("handler-dims"), N, C, W, R, K)
    p1 = phase1_ffi(*args, K)
    cots = make_cotangents(2, p1)
    f32 = jnp.float32
    outs = (jax.ShapeDtypeStruct((2, 2, C, W), f32), jax.ShapeDtypeStruct((2, 2, C, W), f32),
            jax.ShapeDtypeStruct((2, 2, C, R), f32))
    call = jax.ffi.ffi_call("sdm_phase1_bwd", outs)

    def run(dA):
        ins = [*args, p1.log_k, p1.rex, p1.cpe, p1.log_q, *cots[:4], dA, cots[5]]
        ins = [np.asarray(a).reshape((2, 2) + np.shape(a)[1:]) if i != 13 else a for i, a in enumerate(ins)]
        return call(*ins, num_slots=np.int64(K))

    good = run(np.asarray(cots[4]).reshape(4, 1, C, C))  # other leading dims, same product
    want = phase1_bwd_ffi(*args, K, p1, *cots)
    for g, wv in zip(good, want):
        assert np.asarray(g).reshape(wv.shape).tobytes() == np.asarray(wv).tobytes()
    with pytest.raises(Exception, match=r"sdm_phase1_bwd: dA has shape \[3, 5, 5\]"):
        jax.block_until_ready(run(np.asarray(cots[4])[:3]))
    with pytest.raises(Exception, match=r"sdm_phase1_bwd: dA has shape \[4, 5, 4\]"):
        jax.block_until_ready(run(np.asarray(cots[4])[:, :, :4]))
