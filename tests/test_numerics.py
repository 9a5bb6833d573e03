"""The edges of the input domain, every impl against the float64 token loop: gates at the edge of `g <= 0`
(`-inf`, a hard reset of the written row, and huge finite magnitudes), slot ids of any integer type, and empty
dimensions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, cotangents, extreme_gates, outputs_and_grads, rel_err, token_loop64

# The pure-JAX path at the domain edges is slow to compile on a CPU: `--run-slow` (the default run covers it in
# test_xla.py and test_oracles.py).
CHUNKED = ("ffi", pytest.param("xla", marks=pytest.mark.slow))
REFERENCE_SLOW = pytest.param("reference", marks=pytest.mark.slow)
TOL = 1e-5


SEED = int(np.random.SeedSequence().entropy % 10_000)  # fresh every session, printed by the failures
_ORACLE = {}


def token_loop64_cached(label, args, seed):
    """`token_loop64` of a problem, computed once per session for every impl that compares with it."""
    if label not in _ORACLE:
        dy, dbank = cotangents(seed, args)
        _ORACLE[label] = (dy, dbank) + token_loop64(args, dy, dbank)
    return _ORACLE[label]


def assert_matches_reference(args, impl, chunk_size, label, seed=SEED):
    dy, dbank, y_ref, final_ref, g_ref = token_loop64_cached(label, args, seed)
    y, final, grads = outputs_and_grads(sdm_write_read, args, dy, dbank, impl=impl, chunk_size=chunk_size)
    got = dict(y=y, final_bank=final, **{f"grad_{k}": grads[k] for k in FLOAT_ARGS})
    want = dict(y=y_ref, final_bank=final_ref, **{f"grad_{k}": g_ref[k] for k in FLOAT_ARGS})
    for name in got:
        g = np.asarray(got[name])
        assert np.isfinite(g).all(), f"{label} {impl} C={chunk_size}: non-finite {name}"
        err = rel_err(g, want[name])
        assert err < TOL, f"{label} {impl} C={chunk_size}: {name} relative error {err:.3g}"


def gate_problem(seed, kind, per_write_gates=True):
    """Collisions, repeats and per-write (or per-token) gates, with every 7th token's gates set to `kind`
    (a number) or, for "mixed", a random 15% of the gates set to the values of EXTREME_GATES."""
    p = random_problem(seed, B=2, T=70, H=1, K=6, D=5, W=3, R=2, distinct=False, repeats=True,
                       per_write_gates=per_write_gates)
    g = p["g"].copy()
    if kind == "mixed":
        g = extreme_gates(np.random.default_rng(seed), g)
    else:
        g[:, ::7] = kind
    return dict(p, g=g.astype(np.float32))


# (gate kind, chunk size): extreme gates at chunk starts, inside chunks and across chunks (T = 70).
GATE_CASES = [(-np.inf, 5), (-np.inf, 64), (-3e38, 16), (-1e30, 16), (-1e10, 64), ("mixed", 7)]


@pytest.mark.parametrize("impl", CHUNKED)
@pytest.mark.parametrize("kind,chunk_size", GATE_CASES, ids=[f"{k}-C{c}" for k, c in GATE_CASES])
def test_extreme_gates_match_token_loop(impl, kind, chunk_size):
    """Every finite or infinite gate <= 0 gives finite outputs, final bank and gradients equal to the token
    loop's."""
    assert_matches_reference(gate_problem(SEED, kind), impl, chunk_size, f"g={kind} seed={SEED}")


@pytest.mark.parametrize("impl", CHUNKED)
def test_minus_inf_per_token_gate(impl):
    args = gate_problem(SEED, -np.inf, per_write_gates=False)
    assert_matches_reference(args, impl, 16, f"per-token g=-inf seed={SEED}")


@pytest.mark.parametrize("impl", ("reference",) + CHUNKED)
def test_minus_inf_is_a_hard_reset(impl):
    """A write with g = -inf forgets the row: after it, the bank does not depend on the row's earlier contents,
    and the gradient of the final bank w.r.t. the initial row is 0, as is the gradient w.r.t. the -inf gate (the
    kernels' gate gradients are sums of signed terms: 0 up to float32 rounding of the others)."""
    p = random_problem(3, B=1, T=12, H=1, K=4, D=3, W=1, R=1, distinct=False)
    p["k_idx"][...] = 2
    p["g"][0, 5, 0] = -np.inf  # token 5 resets slot 2; tokens 6.. write it again
    bank2 = p["bank"].copy()
    bank2[0, 0, 2] += 10.0
    y1, f1 = sdm_write_read(**p, impl=impl, chunk_size=4)
    y2, f2 = sdm_write_read(**dict(p, bank=bank2), impl=impl, chunk_size=4)
    np.testing.assert_array_equal(np.asarray(f1)[0, 0, 2], np.asarray(f2)[0, 0, 2])
    np.testing.assert_array_equal(np.asarray(y1)[:, 5:], np.asarray(y2)[:, 5:])

    floats = {k: jnp.asarray(p[k]) for k in ("bank", "g")}
    rest = {k: v for k, v in p.items() if k not in floats}
    grads = jax.grad(lambda f: jnp.sum(sdm_write_read(**f, **rest, impl=impl, chunk_size=4)[1][0, 0, 2]))(floats)
    assert np.all(np.asarray(grads["bank"])[0, 0, 2] == 0)
    dg = np.asarray(grads["g"])
    assert np.isfinite(dg).all()
    assert abs(dg[0, 5, 0]) <= 1e-6 * np.linalg.norm(dg), dg[0, 5, 0]


# ---------------------------------------------------------------------------
# Slot ids of any integer type
# ---------------------------------------------------------------------------

def wide_id_problem(seed, K=8):
    """A problem whose ids include values that alias valid slots when wrapped to 32 bits (2^32 + s, 2^33 - 1,
    -2^32 + s, 2^31 + s), and its twin with those ids replaced by -1."""
    p = random_problem(seed, B=1, T=9, H=2, K=K, D=3, W=3, R=2, distinct=False)
    k64, q64 = p["k_idx"].astype(np.int64), p["q_idx"].astype(np.int64)
    k64[0, ::2, 0, 1] += 2**32
    k64[0, 1::3, 1, 0] = 2**33 - 1
    q64[0, ::3, :, 0] -= 2**32
    q64[0, 1::2, 1, 1] += 2**31
    bad_k, bad_q = (k64 < 0) | (k64 >= K), (q64 < 0) | (q64 >= K)
    twin = dict(p, k_idx=np.where(bad_k, -1, k64).astype(np.int32), q_idx=np.where(bad_q, -1, q64).astype(np.int32))
    return dict(p, k_idx=k64, q_idx=q64), twin, int(bad_k.sum()), int(bad_q.sum())


@pytest.mark.parametrize("impl", ("reference",) + CHUNKED)
@pytest.mark.parametrize("x64", [False, True])
def test_64_bit_ids_never_alias_a_slot(impl, x64):
    wide, twin, _, _ = wide_id_problem(5)
    want = sdm_write_read(**twin, impl=impl, chunk_size=4)
    with jax.enable_x64(x64):
        for ids in ("numpy", "jax"):
            args = dict(wide) if ids == "numpy" else dict(wide, k_idx=jnp.asarray(wide["k_idx"]),
                                                           q_idx=jnp.asarray(wide["q_idx"]))
            if ids == "jax" and not x64:
                continue  # a JAX array cannot hold 64-bit ids without x64
            got = sdm_write_read(**args, impl=impl, chunk_size=4)
            for g, w in zip(got, want):  # an aliased id would change them by O(1)
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7, err_msg=ids)


@pytest.mark.slow  # every type through the pure-JAX path; test_validation.py and the 64-bit test above cover ids
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.uint32, np.int64, np.uint64])
def test_ids_of_every_integer_type(dtype):
    """Ids are compared in their own type: a uint8 id of 255 with K = 300 is a valid slot, an int8 id of -1 or a
    uint32 id of 2^31 + 2 is not."""
    info = np.iinfo(dtype)
    K = 300
    p = random_problem(2, B=1, T=6, H=1, K=K, D=2, W=2, R=2, distinct=False)
    k = (p["k_idx"] % min(K, int(info.max) + 1)).astype(np.int64)
    q = (p["q_idx"] % min(K, int(info.max) + 1)).astype(np.int64)
    if info.max >= 2**31 + 2:
        k[0, 0, 0, 0] = 2**31 + 2  # wraps to a negative int32
    if info.min < 0:
        q[0, 1, 0, 1] = -1
    k[0, 2, 0, 1] = min(int(info.max), 255)
    want = sdm_write_read(**dict(p, k_idx=np.where(k >= K, -1, k).astype(np.int32), q_idx=q.astype(np.int32)),
                          impl="xla", chunk_size=4)
    with jax.enable_x64(True):
        for to_array in (np.asarray, jnp.asarray):
            got = sdm_write_read(**dict(p, k_idx=to_array(k.astype(dtype)), q_idx=to_array(q.astype(dtype))),
                                 impl="xla", chunk_size=4)
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)


def test_check_reports_wide_ids():
    """Each check reports on its own (checkify raises the first that fails): the write ids, then the read ids."""
    wide, narrow, n_k, n_q = wide_id_problem(6)
    with jax.enable_x64(True):
        with pytest.raises(Exception, match=f"{n_k} write slot ids"):
            jax.block_until_ready(sdm_write_read(**dict(wide, k_idx=jnp.asarray(wide["k_idx"]),
                                                        q_idx=jnp.asarray(wide["q_idx"])), impl="xla", check=True))
        with pytest.raises(Exception, match=f"{n_q} read slot ids"):
            jax.block_until_ready(sdm_write_read(**dict(wide, k_idx=jnp.asarray(np.maximum(narrow["k_idx"], 0)),
                                                        q_idx=jnp.asarray(wide["q_idx"])), impl="xla", check=True))


# ---------------------------------------------------------------------------
# Positive gates: outside the domain, reported by check=True
# ---------------------------------------------------------------------------

def test_check_reports_positive_gates():
    p = random_problem(4, B=1, T=6, H=1, K=8, D=2, W=2, R=2)
    g = p["g"].copy()
    g[0, 1:4, 0] = 0.3
    with pytest.raises(Exception, match=r"3 gates `g` > 0 \(the domain is g <= 0"):
        jax.block_until_ready(sdm_write_read(**dict(p, g=g), impl="xla", check=True))
    g[0, 1:4, 0] = 0.0  # the edge of the domain is in it
    jax.block_until_ready(sdm_write_read(**dict(p, g=g), impl="xla", check=True))


@pytest.mark.parametrize("impl", ("reference",) + CHUNKED)
def test_check_accepts_hard_resets_and_reports_nan_gates(impl):
    """g = -inf (a hard reset) is in the domain: check=True passes it; a NaN gate is reported."""
    p = random_problem(5, B=1, T=6, H=1, K=8, D=2, W=2, R=2)
    g = p["g"].copy()
    g[0, 2, 0] = -np.inf
    jax.block_until_ready(sdm_write_read(**dict(p, g=g), impl=impl, check=True))
    g[0, 4, 0] = np.nan
    with pytest.raises(Exception, match="1 non-finite values in `g`"):
        jax.block_until_ready(sdm_write_read(**dict(p, g=g), impl=impl, check=True))


# ---------------------------------------------------------------------------
# Empty dimensions
# ---------------------------------------------------------------------------

EMPTY = {"B": dict(B=0), "T": dict(T=0), "H": dict(H=0), "K": dict(K=0), "D": dict(D=0)}


def empty_problem(seed, shared_bank=False, per_write_gates=False, **zero):
    """A random problem with one dimension (B, T, H, K, D, W or R) set to 0."""
    dims = {**dict(B=2, T=5, H=3, K=4, D=3, W=2, R=2), **zero}
    full = random_problem(seed, **{k: max(v, 1) for k, v in dims.items()}, shared_bank=shared_bank,
                          per_write_gates=per_write_gates, distinct=False)
    B, T, H, K, D, W, R = (dims[k] for k in "BTHKDWR")
    sl = lambda a, *n: a[tuple(slice(0, m) for m in n)]
    bank = sl(full["bank"], H, K, D) if shared_bank else sl(full["bank"], B, H, K, D)
    return dict(bank=bank, k_idx=sl(full["k_idx"], B, T, H, W), k_val=sl(full["k_val"], B, T, H, W),
                v=sl(full["v"], B, T, H, D), beta=sl(full["beta"], B, T, H),
                g=sl(full["g"], B, T, H, W) if per_write_gates else sl(full["g"], B, T, H),
                q_idx=sl(full["q_idx"], B, T, H, R), q_val=sl(full["q_val"], B, T, H, R))


EMPTY_CASES = [(dim, False) for dim in sorted(EMPTY)] + [("B", True), ("T", True)]


@pytest.mark.parametrize("impl", ("reference",) + CHUNKED)
@pytest.mark.parametrize("dim,shared_bank", EMPTY_CASES, ids=[f"{d}{'-shared' * s}" for d, s in EMPTY_CASES])
def test_empty_dimension(impl, dim, shared_bank):
    """No stream, token, slot or column: zero (or empty) readings, the bank unchanged, gradients of the right
    shapes (the bank's is the final bank's cotangent, summed over the batch for a shared bank)."""
    p = empty_problem(1, shared_bank=shared_bank, **EMPTY[dim])
    B, T, H, _ = p["k_idx"].shape
    K, D = p["bank"].shape[-2:]
    y, final = sdm_write_read(**p, impl=impl, chunk_size=4)
    assert y.shape == (B, T, H, D) and y.dtype == p["bank"].dtype and not np.asarray(y).any()
    np.testing.assert_array_equal(np.asarray(final), np.broadcast_to(p["bank"], (B, H, K, D)))
    dy, dbank = cotangents(0, dict(p, bank=np.zeros((B, H, K, D), np.float32)))
    _, _, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl=impl, chunk_size=4)
    for k in FLOAT_ARGS:
        assert grads[k].shape == np.shape(p[k]), k
    want_bank = dbank.sum(0) if shared_bank else dbank
    np.testing.assert_allclose(np.asarray(grads["bank"]), want_bank, rtol=1e-6)
    for k in FLOAT_ARGS[1:]:
        assert not np.asarray(grads[k]).any(), k


@pytest.mark.parametrize("impl", (REFERENCE_SLOW,) + CHUNKED)
@pytest.mark.parametrize("lanes", ["W", "R", "WR"])
def test_no_write_or_no_read_lanes(impl, lanes):
    """W = 0: tokens write nothing (no decay either), the readings read the initial bank; R = 0: the readings
    are zeros and the bank evolves as with reads. Both equal the full problem with those lanes' ids out of
    range, and so do the gradients."""
    full = empty_problem(2, per_write_gates=True)
    p = dict(full)
    if "W" in lanes:
        p.update(k_idx=full["k_idx"][..., :0], k_val=full["k_val"][..., :0], g=full["g"][..., :0])
        full["k_idx"] = np.full_like(full["k_idx"], -1)
    if "R" in lanes:
        p.update(q_idx=full["q_idx"][..., :0], q_val=full["q_val"][..., :0])
        full["q_idx"] = np.full_like(full["q_idx"], -1)
    dy, dbank = cotangents(0, full)
    y, final, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl=impl, chunk_size=4)
    y_f, final_f, grads_f = outputs_and_grads(sdm_write_read, full, dy, dbank, impl=impl, chunk_size=4)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_f), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_f), rtol=1e-6, atol=1e-7)
    for k in FLOAT_ARGS:
        assert grads[k].shape == np.shape(p[k]), k
        if grads[k].shape == grads_f[k].shape:
            np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(grads_f[k]), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# Non-finite inputs with check=False: contained in their streams
# ---------------------------------------------------------------------------

NON_FINITE = {
    "bank": lambda p: p["bank"].__setitem__((0, 1, 2, 0), np.nan),
    "v": lambda p: p["v"].__setitem__((0, 3, 1, 1), np.inf),
    "beta": lambda p: p["beta"].__setitem__((1, 4, 1), -np.inf),
    "g": lambda p: p["g"].__setitem__((0, 5, 0), np.nan),
}


@pytest.mark.parametrize("impl", (REFERENCE_SLOW,) + CHUNKED)
@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_non_finite_input_stays_in_its_stream(impl, name):
    """The documented contract: a non-finite input (check=False) leaves the values of its stream (batch element
    x head) unspecified, and every other stream's readings and bank exactly as without it."""
    p = random_problem(7, B=2, T=9, H=2, K=6, D=3, W=2, R=2, distinct=False)
    bad = {k: np.array(v) for k, v in p.items()}
    NON_FINITE[name](bad)
    where = np.argwhere(~np.isfinite(bad[name]))[0]
    b, h = (where[0], where[1]) if name == "bank" else (where[0], where[2])
    y0, f0 = (np.asarray(a) for a in sdm_write_read(**p, impl=impl, chunk_size=4))
    y1, f1 = (np.asarray(a) for a in sdm_write_read(**bad, impl=impl, chunk_size=4))
    other = np.ones((2, 2), bool)
    other[b, h] = False
    np.testing.assert_array_equal(y1.transpose(0, 2, 1, 3)[other], y0.transpose(0, 2, 1, 3)[other])
    np.testing.assert_array_equal(f1[other], f0[other])
