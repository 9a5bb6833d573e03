"""The CUDA Phase 1 and Phase-1 backward (``sdm_phase1`` / ``sdm_phase1_bwd`` on platform CUDA, through
``phase1_ffi`` / ``phase1_bwd_ffi``) against the CPU kernels, output by output: the integer maps and repeat
counts exactly, the floats to a relative L2 error below 1e-5. Skipped without a GPU.

Run on the GPU machine (built with nvcc present, so that ``jax_sdm._sdm_cuda`` exists):
``python -m pytest tests/test_gpu_phase1.py -q``.
"""

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_sdm import lowering
from jax_sdm.ffi_ops import _phase1_workspace, phase1_bwd_ffi, phase1_ffi

from .helpers import phase1_gates

FIELDS = (
    "log_k", "rex", "cpe", "k_eff", "w", "log_q", "q_w", "A", "QK",
    "w_order", "w_group", "r_order", "r_group", "repeats",
)
INT_FIELDS = set(FIELDS[9:])
BWD_FIELDS = ("dk_val", "dx", "dq_val")
RTOL = 1e-5


def seed_of(*parts):
    """A fresh seed per run, reproducible from the printed value (``zlib`` is not salted)."""
    return (zlib.crc32(repr(parts).encode()) + int(np.random.SeedSequence().entropy % 1_000_000)) % 2**32


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def make_inputs(seed, N, C, W, R, K, *, invalid=0.1, partial=0.2, pad_tokens=0, gate="lane"):
    """Phase 1's inputs: collisions (small K), repeats (W vs K), out-of-range ids (-1, K, K+3, -7), tokens with
    some lanes -1, padding tokens (all ids -1) at the end; per-lane, per-token or arbitrary gates."""
    rng = np.random.default_rng(seed)

    def ids(shape):
        a = rng.integers(0, max(K, 1), size=shape).astype(np.int32)
        if K == 0:
            a[...] = -1
        bad = rng.random(shape) < invalid
        a[bad] = rng.choice(np.array([-1, K, K + 3, -7], np.int32), size=int(bad.sum()))
        tokens = rng.random(shape[:2]) < partial
        a[tokens[:, :, None] & (rng.random(shape) < 0.5)] = -1
        if pad_tokens:
            a[:, C - pad_tokens:] = -1
        return a

    k_idx, q_idx = ids((N, C, W)), ids((N, C, R))
    k_val = rng.standard_normal((N, C, W)).astype(np.float32)
    q_val = rng.standard_normal((N, C, R)).astype(np.float32)
    return k_idx, k_val, phase1_gates(rng, N, C, W, gate), q_idx, q_val


def make_cotangents(seed, N, C, W, R):
    """Random cotangents of k_eff, w, cpe (everywhere), q_w, A, QK (full: the kernels read only the lower
    parts, both of them)."""
    rng = np.random.default_rng(seed + 7)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)
    return n(N, C, W), n(N, C, W), n(N, C, W), n(N, C, R), n(N, C, C), n(N, C, C)


# ---------------------------------------------------------------------------
# Running on one device
# ---------------------------------------------------------------------------

def cpu():
    return jax.devices("cpu")[0]


def gpu():
    return jax.devices("gpu")[0]


def run_on(device, fn, arrays, *static):
    """``fn(*arrays, *static)`` with the arrays committed to ``device``; numpy results."""
    with jax.default_device(device):
        out = fn(*[jax.device_put(a, device) for a in arrays], *static)
        out = jax.block_until_ready(out)
    for o in out:
        assert list(o.devices())[0].platform == device.platform, (device, o.devices())
    return [np.asarray(o) for o in out]


def p1_fn(k_idx, k_val, x, q_idx, q_val, K):
    return tuple(phase1_ffi(k_idx, k_val, x, q_idx, q_val, K))


def bwd_fn(k_idx, k_val, x, q_idx, q_val, log_k, rex, cpe, log_q, dk_eff, dw, dcpe, dq_w, dA, dQK, K):
    """phase1_bwd_ffi given the Phase-1 outputs it reads (the other fields are not used)."""
    p1 = dict(log_k=log_k, rex=rex, cpe=cpe, log_q=log_q)
    p1 = tuple(p1.get(name) for name in FIELDS)
    return tuple(phase1_bwd_ffi(k_idx, k_val, x, q_idx, q_val, K, p1, dk_eff, dw, dcpe, dq_w, dA, dQK))


def rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    den = np.linalg.norm(want)
    num = np.linalg.norm(got - want)
    return num / den if den > 0 else num


def check_same(names, got, want, label=""):
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (label, name, g.shape, w.shape, g.dtype, w.dtype)
        if name in INT_FIELDS:
            np.testing.assert_array_equal(g, w, err_msg=f"{label} {name}")
        else:
            assert np.array_equal(np.isfinite(g), np.isfinite(w)), f"{label} {name}: non-finite pattern differs"
            ok = np.isfinite(w)
            err = rel_l2(g[ok], w[ok])
            assert err < RTOL, f"{label} {name}: relative L2 error {err:.3g} (max abs diff " \
                               f"{np.abs(g[ok].astype(np.float64) - w[ok]).max():.3g})"


def compare_phase1(args, K, label):
    """Phase 1 on the GPU and the CPU, then the backward on both with the same (CPU) Phase-1 outputs."""
    got = run_on(gpu(), p1_fn, args, K)
    want = run_on(cpu(), p1_fn, args, K)
    check_same(FIELDS, got, want, label + " phase1")
    p1 = dict(zip(FIELDS, want))
    N, C, W = args[0].shape
    R = args[3].shape[-1]
    cots = make_cotangents(zlib.crc32(label.encode()), N, C, W, R)
    bwd_args = list(args) + [p1["log_k"], p1["rex"], p1["cpe"], p1["log_q"]] + list(cots)
    got_b = run_on(gpu(), bwd_fn, bwd_args, K)
    want_b = run_on(cpu(), bwd_fn, bwd_args, K)
    check_same(BWD_FIELDS, got_b, want_b, label + " phase1_bwd")
    return got, got_b


def workspace_bytes(N, C, W, R, backward):
    return int(_phase1_workspace((N,), C, W, R, backward).shape[0])


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def test_cuda_module_registered():
    assert lowering.HAS_CUDA_MODULE, "jax_sdm._sdm_cuda was not built (no nvcc at build time?)"
    assert lowering.is_registered("sdm_phase1", "CUDA")
    assert lowering.is_registered("sdm_phase1_bwd", "CUDA")


# (N, C, W, R, K, invalid, pad_tokens, gate): the scratch in shared memory.
SHARED_CASES = [
    (4, 16, 1, 1, 4, 0.1, 2, "lane"),
    (3, 16, 7, 7, 5, 0.2, 3, "lane"),        # hot slots, repeats
    (3, 16, 7, 1, 3, 0.1, 0, "token"),       # W > K: repeats in every token
    (3, 16, 6, 5, 4, 0.1, 1, "any"),         # gates of any sign
    (2, 64, 7, 7, 16, 0.1, 5, "lane"),
    (2, 64, 1, 64, 8, 0.2, 0, "lane"),
    (2, 64, 64, 7, 32, 0.1, 4, "token"),
    (2, 64, 64, 64, 1000, 0.05, 0, "lane"),  # E = 8192: the largest unit in shared memory here
    (2, 256, 7, 7, 64, 0.1, 10, "lane"),
    (2, 256, 1, 1, 2, 0.0, 0, "lane"),       # two slots over 256 tokens: long groups
    (1, 16, 256, 256, 64, 0.05, 2, "lane"),
    (2, 7, 3, 3, 1000, 0.0, 0, "lane"),      # sparse: few collisions
    # gates of -inf, -3e38, -1e30, -1e10 among ordinary ones: exact resets, no NaN (direct range sums)
    (3, 16, 7, 7, 5, 0.1, 2, "extreme"),
    (2, 64, 7, 7, 16, 0.1, 5, "extreme"),
    (2, 256, 1, 1, 2, 0.0, 0, "extreme"),    # long groups
    (2, 64, 64, 64, 1000, 0.05, 0, "extreme"),
]

# Units too large for shared memory: the scratch lives in the workspace result.
GLOBAL_CASES = [
    (2, 256, 64, 64, 4096, 0.02, 3, "lane"),    # E = 32768
    (1, 64, 256, 64, 8, 0.05, 0, "lane"),       # collision-heavy, E = 20480
    (1, 256, 256, 256, 4096, 0.02, 3, "lane"),  # C, W, R at the GPU limits: E = 131072
    (130, 64, 256, 7, 1000, 0.05, 0, "lane"),   # more units than workspace slices (128)
    (2, 256, 64, 64, 4096, 0.02, 3, "extreme"),
]


# Units whose scratch fits shared memory but for the run arrays, which live in the workspace (in the forward, the
# backward or both).
MIXED_CASES = [
    (2, 128, 64, 64, 65536, 0.02, 3, "lane"),  # the flagship's unit (chunk 128, W = R = 64), both directions
    (2, 128, 64, 64, 4096, 0.02, 3, "extreme"),
    (1, 64, 200, 8, 8, 0.05, 0, "extreme"),    # collision-heavy, both directions
    (130, 64, 128, 64, 1000, 0.05, 0, "lane"),  # the backward only, more units than workspace slices (128)
]


def _ids(cases):
    return [f"N{c[0]}C{c[1]}W{c[2]}R{c[3]}K{c[4]}-{c[7]}" for c in cases]


@pytest.mark.parametrize("case", SHARED_CASES, ids=_ids(SHARED_CASES))
def test_gpu_phase1_matches_cpu(case):
    N, C, W, R, K, invalid, pad, gate = case
    assert workspace_bytes(N, C, W, R, False) == 0 and workspace_bytes(N, C, W, R, True) == 0
    seed = seed_of(case)
    args = make_inputs(seed, N, C, W, R, K, invalid=invalid, pad_tokens=pad, gate=gate)
    compare_phase1(args, K, f"seed={seed} {case}")


@pytest.mark.parametrize("case", GLOBAL_CASES, ids=_ids(GLOBAL_CASES))
def test_gpu_phase1_workspace_path_matches_cpu(case):
    N, C, W, R, K, invalid, pad, gate = case
    assert workspace_bytes(N, C, W, R, False) > 0 and workspace_bytes(N, C, W, R, True) > 0
    seed = seed_of(case)
    args = make_inputs(seed, N, C, W, R, K, invalid=invalid, pad_tokens=pad, gate=gate)
    compare_phase1(args, K, f"seed={seed} {case}")


@pytest.mark.parametrize("case", MIXED_CASES, ids=_ids(MIXED_CASES))
def test_gpu_phase1_run_arrays_in_workspace_match_cpu(case):
    N, C, W, R, K, invalid, pad, gate = case
    E, slices = C * (W + R), min(N, 128)
    # Only the run arrays' slices (4 bytes per entry forward, 8 backward, rounded up to 256) where not all fits.
    assert workspace_bytes(N, C, W, R, True) == slices * ((8 * E + 255) // 256 * 256)
    assert workspace_bytes(N, C, W, R, False) in (0, slices * ((4 * E + 255) // 256 * 256))
    seed = seed_of(case)
    args = make_inputs(seed, N, C, W, R, K, invalid=invalid, pad_tokens=pad, gate=gate)
    compare_phase1(args, K, f"seed={seed} {case}")


@pytest.mark.parametrize("case", [
    (2, 16, 0, 3, 4),   # no writes
    (2, 16, 3, 0, 4),   # no reads
    (2, 16, 0, 0, 4),   # no entries
    (3, 16, 4, 3, 0),   # K = 0: every entry invalid
    (0, 16, 4, 3, 5),   # no units
], ids=lambda c: f"N{c[0]}C{c[1]}W{c[2]}R{c[3]}K{c[4]}")
def test_gpu_phase1_degenerate_shapes(case):
    N, C, W, R, K = case
    args = make_inputs(seed_of(case), N, C, W, R, K)
    compare_phase1(args, K, f"{case}")


@pytest.mark.parametrize("case", [SHARED_CASES[6], GLOBAL_CASES[0]], ids=["shared", "workspace"])
def test_gpu_phase1_deterministic_bitwise(case):
    N, C, W, R, K, invalid, pad, gate = case
    args = [jax.device_put(a, gpu()) for a in make_inputs(seed_of(case), N, C, W, R, K, invalid=invalid,
                                                          pad_tokens=pad, gate=gate)]
    runs = [p1_fn(*args, K), p1_fn(*args, K), jax.jit(p1_fn, static_argnums=5)(*args, K)]
    for name, a, b, c in zip(FIELDS, *runs):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes() == np.asarray(c).tobytes(), name
    p1 = runs[0]
    cots = [jax.device_put(c, gpu()) for c in make_cotangents(5, N, C, W, R)]
    bwd_args = list(args) + [p1[0], p1[1], p1[2], p1[5]] + cots
    runs = [bwd_fn(*bwd_args, K), bwd_fn(*bwd_args, K), jax.jit(bwd_fn, static_argnums=15)(*bwd_args, K)]
    for name, a, b, c in zip(BWD_FIELDS, *runs):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes() == np.asarray(c).tobytes(), name


@pytest.mark.parametrize("case", [(2, 3, 16, 7, 5, 6), (2, 2, 64, 256, 7, 100)], ids=["shared", "workspace"])
def test_gpu_phase1_batch_dims_and_vmap(case):
    """Leading batch dims and vmap fold into more units: bitwise the flat call."""
    B, P, C, W, R, K = case
    args = [jax.device_put(a, gpu()) for a in make_inputs(seed_of(case), B * P, C, W, R, K)]
    flat = p1_fn(*args, K)
    batched = [a.reshape((B, P) + a.shape[1:]) for a in args]
    for got in (p1_fn(*batched, K), jax.vmap(lambda *a: p1_fn(*a, K))(*batched)):
        for name, f, g in zip(FIELDS, flat, got):
            assert g.shape == (B, P) + f.shape[1:], name
            assert np.asarray(g).reshape(f.shape).tobytes() == np.asarray(f).tobytes(), name
    cots = [jax.device_put(c, gpu()) for c in make_cotangents(9, B * P, C, W, R)]
    bwd_args = list(args) + [flat[0], flat[1], flat[2], flat[5]] + cots
    flat_b = bwd_fn(*bwd_args, K)
    batched_b = [a.reshape((B, P) + a.shape[1:]) for a in bwd_args]
    for got in (bwd_fn(*batched_b, K), jax.vmap(lambda *a: bwd_fn(*a, K))(*batched_b)):
        for name, f, g in zip(BWD_FIELDS, flat_b, got):
            assert np.asarray(g).reshape(f.shape).tobytes() == np.asarray(f).tobytes(), name


@pytest.mark.parametrize("gate", ["lane", "extreme"])
def test_gpu_phase1_bwd_matches_xla_vjp(gate):
    """The CUDA backward against jax.vjp of the pure-JAX Phase 1 (on the GPU too); finite for extreme gates."""
    from jax_sdm.xla import phase1_xla
    N, C, W, R, K = 3, 16, 6, 5, 6
    args = make_inputs(seed_of("xla-vjp", gate), N, C, W, R, K, pad_tokens=2, gate=gate)
    k_idx, k_val, x, q_idx, q_val = [jax.device_put(a, gpu()) for a in args]
    cots = [jax.device_put(c, gpu()) for c in make_cotangents(3, N, C, W, R)]
    dk_eff, dw, dcpe, dq_w, dA, dQK = cots

    def floats(kv, xx, qv):
        p = phase1_xla(k_idx, kv, xx, q_idx, qv, K)
        return p.k_eff, p.w, p.cpe, p.q_w, p.A, p.QK

    _, vjp = jax.vjp(floats, k_val, x, q_val)
    want = vjp((dk_eff, dw, dcpe, dq_w, dA, dQK))
    p1 = p1_fn(k_idx, k_val, x, q_idx, q_val, K)
    got = bwd_fn(k_idx, k_val, x, q_idx, q_val, p1[0], p1[1], p1[2], p1[5], *cots, K)
    for name, g, w in zip(BWD_FIELDS, got, want):
        assert list(g.devices())[0].platform == "gpu"
        assert np.isfinite(np.asarray(g)).all(), name
        err = rel_l2(g, w)
        assert err < RTOL, f"{name}: relative L2 error {err:.3g}"


def test_gpu_phase1_handlers_take_the_workspace_only_when_needed():
    """Direct calls with the CPU handlers' results only (no workspace) work while the scratch fits in shared
    memory, and fail with a clear error when the shapes need the workspace."""
    f32, i32 = jnp.float32, jnp.int32

    def direct(N, C, W, R, K):
        args = [jax.device_put(a, gpu()) for a in make_inputs(seed_of("direct", C, W), N, C, W, R, K)]
        shapes = [((C, W), f32)] * 5 + [((C, R), f32)] * 2 + [((C, C), f32)] * 2 + [
            ((C * W,), i32), ((C * W + 1,), i32), ((C * R,), i32), ((C * R + 1,), i32), ((), i32)]
        call = jax.ffi.ffi_call("sdm_phase1", [jax.ShapeDtypeStruct((N,) + s, d) for s, d in shapes])
        return args, call(*args, num_slots=np.int64(K))

    args, out = direct(2, 16, 7, 7, 5)
    want = p1_fn(*args, 5)
    for name, g, w in zip(FIELDS, out, want):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), name
    with pytest.raises(Exception, match="workspace has 0 bytes"):
        jax.block_until_ready(direct(1, 256, 64, 64, 100)[1])
