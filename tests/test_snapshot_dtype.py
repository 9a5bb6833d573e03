"""`snapshot_dtype`: how the kernels' forward stores the rows it overwrites for the backward (docs/MATH.md
"Snapshot storage"), on the default backend's kernels (the CPU ones here; tests/test_gpu_snapshot_dtype.py on a GPU).

The stored codes are checked against NumPy's (ml_dtypes') rounding of the exact pre-write rows; every option against
the float64 token loop; None (and the bank's own dtype) bitwise against today's default; each option for bitwise
repeatability; bad values for a clear error."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_sdm import ffi_ops, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, cotangents, ffi_calls, outputs_and_grads, rel_err, stored_groups
from .test_gpu_steps import kernel_inputs

LOSSY = (jnp.bfloat16, "float8_e4m3fn", "int4")
# Relative L2 error of the gradients the snapshot enters (k_val, g, q_val) against the float64 token loop that
# each option must stay within: the bar for float8 (3e-2); int4, experimental, measures 9e-2 to 1e-1 at
# these widths (its rounding error grows with the ratio of a row's largest to its typical magnitude, so with D).
BOUNDS = {"bfloat16": 1e-2, "float8_e4m3fn": 3e-2, "int4": 1.2e-1}
# The gradients that never read the snapshot (dS0 = cpe dS1 + sum k_eff dG and the readings' side add no S0 term,
# v and beta see only the forward's residuals): the same bits whatever the snapshot's dtype.
SNAPSHOT_FREE = ("bank", "v", "beta")


def name_of(snapshot_dtype):
    return snapshot_dtype if isinstance(snapshot_dtype, str) else jnp.dtype(snapshot_dtype).name


def run(args, dy, dbank, chunk_size=32, **kw):
    return outputs_and_grads(functools.partial(sdm_write_read, impl="ffi"), args, dy, dbank, chunk_size=chunk_size,
                             **kw)


def token_loop64(args, dy, dbank, **kw):
    with jax.enable_x64(True):
        wide = {k: np.asarray(a, np.float64) if k in FLOAT_ARGS else a for k, a in args.items()}
        y, final, g = outputs_and_grads(functools.partial(sdm_write_read, impl="reference"), wide, dy, dbank, **kw)
        return np.asarray(y), np.asarray(final), {k: np.asarray(v) for k, v in g.items()}


def assert_same_bits(a, b):
    """The outputs and the gradients of `b` (all of FLOAT_ARGS, or those it has) equal `a`'s bitwise."""
    (y_a, final_a, g_a), (y_b, final_b, g_b) = a, b
    np.testing.assert_array_equal(np.asarray(y_a), np.asarray(y_b), err_msg="y")
    np.testing.assert_array_equal(np.asarray(final_a), np.asarray(final_b), err_msg="final bank")
    assert set(g_b) <= set(g_a)
    for k in g_b:
        np.testing.assert_array_equal(np.asarray(g_a[k]), np.asarray(g_b[k]), err_msg=k)


# ---- The stored codes


def stored(seed, code, device=None, chunk=16, bank=None, keep_rows=False, **shape):
    """The forward's snapshot with storage `code` and the exact one (the bank's float32), with a mask of the rows
    the forward writes (rows past a unit's group count are never written or read); on `device` (None: the
    default); `bank`: an initial bank in the kernels' layout `[P, K, D]` instead of the random one; `keep_rows`:
    writes that leave each row as it is (every write weight 0, every decay 1), so that every stored row is a row of
    the initial bank."""
    inputs = kernel_inputs(seed, chunk, **shape)
    if bank is not None:
        inputs = (jnp.asarray(bank, inputs[0].dtype),) + inputs[1:]
    if keep_rows:
        p1 = inputs[5]
        inputs = inputs[:5] + (p1._replace(w=jnp.zeros_like(p1.w), cpe=jnp.ones_like(p1.cpe)),) + inputs[6:]
    inputs = jax.device_put(inputs, device)
    fwd = jax.jit(functools.partial(ffi_ops.forward_ffi, save=True, snapshot_code=code))
    exact = np.asarray(jax.jit(functools.partial(ffi_ops.forward_ffi, save=True))(*inputs).snapshot)
    out = fwd(*inputs)
    used = stored_groups(inputs[5].w_group)
    return np.asarray(out.snapshot), np.asarray(out.snapshot_scale), exact.astype(np.float32), used


def scaled_codes(exact, top):
    """Each row's scale (largest magnitude / top) and the row times the scale's reciprocal, each rounded to float32
    (zero rows: zeros)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # rows never written hold any bits
        scale = np.max(np.abs(exact), axis=-1) / np.float32(top)
        inverse = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        return scale, np.where(inverse[..., None] > 0, exact * inverse[..., None], np.float32(0))


def check_codes(name, device=None, seed=11, bank=None, keep_rows=False, **shape):
    """The stored snapshot of option `name` is the exact written rows rounded as NumPy (ml_dtypes) rounds them:
    bfloat16 and float8 e4m3fn to nearest even, int4 to the nearest of -7..7, two codes a byte (the even element in
    the low nibble), each element times the reciprocal of its row's scale (its largest magnitude / 448 or / 7; the
    scale bitwise too)."""
    snap, scale, exact, used = stored(seed, ffi_ops.SNAPSHOT_CODES[name], device, bank=bank, keep_rows=keep_rows,
                                      **(shape or SHAPE))
    D = exact.shape[-1]
    if name == "bfloat16":
        assert snap.dtype == jnp.bfloat16 and snap.shape == exact.shape and scale.size == 0
        want = exact.astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(snap[used].view(np.uint16), want[used].view(np.uint16))
        return
    want_scale, q = scaled_codes(exact, 448 if name == "float8_e4m3fn" else 7)
    assert snap.dtype == np.uint8 and scale.shape == exact.shape[:-1]
    np.testing.assert_array_equal(scale[used], want_scale[used])
    if name == "float8_e4m3fn":
        assert snap.shape == exact.shape
        want = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        assert np.count_nonzero(snap[used]) > snap[used].size // 2  # real rows, not zeros
    else:
        assert snap.shape == exact.shape[:-1] + ((D + 1) // 2,)
        with np.errstate(invalid="ignore"):  # rows never written hold any bits (not compared)
            nibbles = (np.clip(np.rint(q), -7, 7).astype(np.int8) & 0xF).astype(np.uint8)
        if not keep_rows:  # random written rows: codes across the range
            assert len(np.unique(nibbles[used])) > 8
        nibbles = np.concatenate([nibbles, np.zeros(nibbles.shape[:-1] + (D % 2,), np.uint8)], axis=-1)
        want = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    np.testing.assert_array_equal(snap[used], want[used])
    return exact, used


def code_of(name, q):
    """The codes of values already scaled, as NumPy rounds them."""
    if name == "float8_e4m3fn":
        return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    with np.errstate(invalid="ignore"):
        return np.clip(np.rint(q), -7, 7).astype(np.int8)


def reciprocal_telling_bank(seed, name, shape):
    """An initial bank `[P, K, D]` (float32) whose every row has the largest magnitude `a` in its first column and,
    in the others, values `x` whose code differs between `x * (1 / scale)` and `x / scale`: next to a rounding
    boundary of the code, where the two roundings of float32 fall on either side."""
    rng = np.random.default_rng(seed)
    top = 448 if name == "float8_e4m3fn" else 7
    if name == "float8_e4m3fn":  # midpoints between neighbouring float8 values
        values = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        values = np.arange(0, 8, dtype=np.float32)
    for _ in range(200):  # a row maximum `a` for which such values exist (int4 has few boundaries: some `a` have none)
        a = np.float32(rng.uniform(0.5, 2.0))
        scale = a / np.float32(top)
        inverse = np.float32(1) / scale
        mids = ((values[1:] + values[:-1]) / 2 * scale).astype(np.float32)
        near = [mids]
        for _ in range(8):  # float32 neighbours on either side
            near += [np.nextafter(near[-2 if len(near) > 1 else -1], np.float32(np.inf)),
                     np.nextafter(near[-1], np.float32(0))]
        candidates = np.unique(np.concatenate(near))
        candidates = candidates[(candidates > 0) & (candidates < a)]
        telling = candidates[code_of(name, candidates * inverse) != code_of(name, candidates / scale)]
        if telling.size > 0:
            break
    assert telling.size > 0, f"seed {seed}: no row maximum in 200 draws has values the two codes disagree on"
    P = shape["B"] * shape["H"]
    bank = rng.choice(telling, size=(P, shape["K"], shape["D"])) * rng.choice([-1, 1], size=(P, shape["K"], shape["D"]))
    bank[..., 0] = a
    return bank.astype(np.float32)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "int4"])
def test_codes_multiply_by_the_scales_reciprocal(name):
    """The codes are of `x * (1 / scale)`, the reciprocal rounded once per row (a product per element, not a
    division): on rows made of values whose code the two definitions disagree on, the stored codes are the
    product's (and so differ from the division's)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    shape = dict(B=1, T=32, H=2, K=24, D=16, W=3, R=2, distinct=False)
    bank = reciprocal_telling_bank(seed, name, shape)
    exact, used = check_codes(name, seed=seed, bank=bank, keep_rows=True, **shape)
    first = exact[0][used[0]]  # the first chunk's rows, the initial bank's
    scale = np.max(np.abs(first), axis=-1, keepdims=True) / np.float32(448 if name == "float8_e4m3fn" else 7)
    assert np.all(first[:, 0] == bank[0, 0, 0])
    assert np.count_nonzero(code_of(name, first * (np.float32(1) / scale)) != code_of(name, first / scale)) > 0


SHAPE = dict(B=2, T=70, H=2, K=48, D=37, W=5, R=3, distinct=False, repeats=True)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "int4"])
def test_stored_codes(name):
    check_codes(name)


def test_zero_rows_store_zero_codes():
    args = random_problem(14, T=40, K=16, D=8, W=3, R=2)
    shape = dict(T=40, K=16, D=8, W=3, R=2)
    bank = np.zeros((2, 16, 8), np.float32)
    for name in ("float8_e4m3fn", "int4"):  # writes that keep the zero rows: every stored row is zero
        snap, scale, _, used = stored(14, ffi_ops.SNAPSHOT_CODES[name], bank=bank, keep_rows=True, **shape)
        assert np.all(scale[used] == 0), name
        assert np.all(snap[used] == 0), name
    dy, dbank = cotangents(14, args)
    y, final, g = run(dict(args, bank=np.zeros_like(args["bank"])), dy, dbank, snapshot_dtype="int4")
    for a in (y, final, *g.values()):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))


# ---- Against the token loop


@functools.lru_cache(maxsize=None)
def problem(dtype_name, T=512, K=128, D=48, W=4, segments=False):
    """A problem whose rows are rewritten many times (T * W / K = 16 writes a row), its cotangents and the float64
    token loop's results."""
    args = random_problem(21, B=2, T=T, H=2, K=K, D=D, W=W, R=W, dtype=jnp.dtype(dtype_name))
    if segments:  # packed sequences: segments of 40-200 tokens
        rng = np.random.default_rng(21)
        starts = np.cumsum(rng.integers(40, 200, size=(2, T)), axis=1)
        args["segment_ids"] = np.sum(np.arange(T)[None, :, None] >= starts[:, None, :], axis=-1).astype(np.int32)
    dy, dbank = cotangents(21, args)
    kw = {"segment_ids": args.pop("segment_ids")} if segments else {}
    return args, dy, dbank, kw, token_loop64(args, dy, dbank, **kw)


@pytest.mark.parametrize("bank_dtype", ["float32", "bfloat16"])
def test_none_and_the_banks_dtype_are_todays_bits(bank_dtype):
    args, dy, dbank, _, _ = problem(bank_dtype)
    today = run(args, dy, dbank)
    assert_same_bits(run(args, dy, dbank, snapshot_dtype=None), today)
    assert_same_bits(run(args, dy, dbank, snapshot_dtype=jnp.dtype(bank_dtype)), today)
    assert_same_bits(run(args, dy, dbank, snapshot_dtype=bank_dtype), today)


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("bank_dtype, snapshot_dtype", [("float32", s) for s in LOSSY] +
                         [("bfloat16", s) for s in LOSSY[1:]])
def test_against_the_token_loop(bank_dtype, snapshot_dtype, segments):
    args, dy, dbank, kw, (y_ref, final_ref, g_ref) = problem(bank_dtype, segments=segments)
    y0, final0, g0 = run(args, dy, dbank, **kw)
    y, final, g = run(args, dy, dbank, snapshot_dtype=snapshot_dtype, **kw)
    # The forward's results and the gradients that never read the snapshot are today's.
    assert_same_bits((y, final, g), (y0, final0, {k: g0[k] for k in SNAPSHOT_FREE}))
    # today's accuracy, plus the snapshot's rounding where it enters
    base = 1e-5 if bank_dtype == "float32" else 1.5e-2
    for k in FLOAT_ARGS:
        assert g[k].dtype == np.asarray(args[k]).dtype, k
        err, err0 = rel_err(g[k], g_ref[k]), rel_err(g0[k], g_ref[k])
        assert err0 < base, (k, err0)
        if k in SNAPSHOT_FREE:
            continue
        assert err < BOUNDS[name_of(snapshot_dtype)], (k, err)
        assert err > err0 or name_of(snapshot_dtype) == "bfloat16", (k, err, err0)  # the snapshot is lossy


@pytest.mark.parametrize("T", [32, 33, 64])
@pytest.mark.parametrize("snapshot_dtype", (None,) + LOSSY)
def test_the_last_chunk_stores_no_snapshot(T, snapshot_dtype):
    """The snapshot holds every chunk's writes but the last's (none at all for one chunk: T 32 at chunk 32): with a
    last chunk of 1 token (T 33) or 32 (T 64), each option's gradients are the token loop's within its bound."""
    args = random_problem(T, B=1, T=T, H=2, K=24, D=16, W=3, R=3)
    dy, dbank = cotangents(T, args)
    _, _, g_ref = token_loop64(args, dy, dbank)
    fwd = jax.make_jaxpr(lambda a: jax.vjp(lambda b: sdm_write_read(**dict(a, bank=b), impl="ffi", chunk_size=32,
                                                                  snapshot_dtype=snapshot_dtype), a["bank"]))(args)
    (call,) = ffi_calls(fwd.jaxpr, "sdm_forward")
    assert call.outvars[4].aval.shape[:2] == ((T - 1) // 32, 2)  # [NC - 1, P, C*W, ...]
    _, _, g = run(args, dy, dbank, snapshot_dtype=snapshot_dtype)
    bound = BOUNDS[name_of(snapshot_dtype)] if snapshot_dtype is not None else 1e-5
    for k in FLOAT_ARGS:
        assert rel_err(g[k], g_ref[k]) < bound, (k, rel_err(g[k], g_ref[k]))


@pytest.mark.parametrize("snapshot_dtype", LOSSY)
def test_each_option_bitwise_repeatable(snapshot_dtype):
    args, dy, dbank, _, _ = problem("float32")
    first = run(args, dy, dbank, snapshot_dtype=snapshot_dtype)
    jax.clear_caches()  # compiled anew
    assert_same_bits(run(args, dy, dbank, snapshot_dtype=snapshot_dtype), first)


def test_a_bfloat16_bank_with_a_float32_gradient_bank():
    args, dy, dbank, _, (_, _, g_ref) = problem("bfloat16")
    _, _, g = run(args, dy, dbank, snapshot_dtype="float8_e4m3fn", bank_grad_dtype=jnp.float32)
    for k in ("k_val", "g", "q_val"):
        assert rel_err(g[k], g_ref[k]) < BOUNDS["float8_e4m3fn"], k


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_the_pure_jax_paths_ignore_it(impl):
    """The pure-JAX paths' training step is the same program whatever `snapshot_dtype` (compared as programs: two
    compiles of one program may differ in their last bits on a GPU, whose autotuning picks among kernels by time)."""
    args = random_problem(3, T=40, K=32, D=8, W=3, R=3)
    dy, dbank = cotangents(3, args)
    rest = {k: v for k, v in args.items() if k not in FLOAT_ARGS}

    def program(**kw):
        def loss(floats):
            y, final = sdm_write_read(**floats, **rest, impl=impl, **kw)
            return jnp.sum(y * dy) + jnp.sum(final * dbank)

        return jax.jit(jax.grad(loss)).lower({k: jnp.asarray(args[k]) for k in FLOAT_ARGS}).as_text()

    plain = program()
    assert program(snapshot_dtype="int4") == plain
    assert program(snapshot_dtype=jnp.bfloat16) == plain


@pytest.mark.parametrize("bank_dtype, bad", [(np.float32, jnp.float16), (np.float32, "float8_e5m2"),
                                             (np.float32, "int8"), (jnp.bfloat16, jnp.float32),
                                             (np.float32, "no such dtype"), (np.float32, 3)])
def test_bad_snapshot_dtype(bank_dtype, bad):
    args = random_problem(1, T=8, K=16, D=4, W=2, R=2, dtype=bank_dtype)
    with pytest.raises(ValueError, match="snapshot_dtype"):
        sdm_write_read(**args, impl="ffi", snapshot_dtype=bad)


# ---- The Flax layer passes it on


def layer_grads(snapshot_dtype, seed=5):
    pytest.importorskip("flax")
    from flax import nnx

    from jax_sdm.nn import SparseDeltaMemory

    model = SparseDeltaMemory(16, num_heads=2, slots_per_head=36, num_writes=3, num_reads=2, head_dim=8,
                              chunk_size=8, impl="ffi", snapshot_dtype=snapshot_dtype, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed), (2, 64, 16), jnp.float32)
    r = jax.random.normal(jax.random.key(seed + 1), (2, 64, 16), jnp.float32)
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0] * r))(model)
    return jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param))


def test_the_layer_passes_it_on():
    with jax.default_matmul_precision("highest"):
        today, same, fp8 = (layer_grads(s) for s in (None, jnp.float32, "float8_e4m3fn"))
    for a, b in zip(today, same):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    flat = lambda leaves: np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in leaves])
    assert 0 < rel_err(flat(fp8), flat(today)) < 3e-2


def test_the_layer_refuses_a_bad_value():
    with pytest.raises(ValueError, match="snapshot_dtype"):
        layer_grads("int8")


def test_the_training_step_holds_the_smaller_snapshot():
    """XLA's buffer assignment of a jitted training step: each option's temporaries are smaller by the snapshot's
    saving ((T - chunk) * W rows per stream, every chunk's but the last's, of D elements: 4 bytes each for a
    float32 bank; bfloat16 2, float8 1 and int4 1/2, plus a float32 scale per row for the last two)."""
    B, T, H, K, D, W, chunk = 1, 1024, 2, 256, 64, 8, 64
    args = random_problem(4, B=B, T=T, H=H, K=K, D=D, W=W, R=W)

    def temp_bytes(snapshot_dtype):
        def loss(bank, k_val, v, q_val):
            y, final = sdm_write_read(bank, args["k_idx"], k_val, v, args["beta"], args["g"], args["q_idx"], q_val,
                                      impl="ffi", chunk_size=chunk, snapshot_dtype=snapshot_dtype)
            return jnp.sum(y) + jnp.sum(final)

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        floats = [args[k] for k in ("bank", "k_val", "v", "q_val")]
        return step.lower(*floats).compile().memory_analysis().temp_size_in_bytes

    rows = B * H * (T - chunk) * W
    today = temp_bytes(None)
    for name, row_bytes in (("bfloat16", 2 * D), ("float8_e4m3fn", D + 4), ("int4", D // 2 + 4)):
        saving = rows * (4 * D - row_bytes)
        assert today - temp_bytes(name) >= 0.95 * saving, name


def test_vmap_gives_each_problem_its_own_result():
    """Under vmap (a leading dim of one kernel call: its snapshot and scales too) each problem's gradients are
    those of its own call, bitwise."""
    problems = [random_problem(s, T=40, K=32, D=8, W=3, R=3) for s in range(3)]
    ids = ("k_idx", "q_idx")

    def grads(floats, slots):
        def loss(f):
            y, final = sdm_write_read(**f, **slots, impl="ffi", chunk_size=16, snapshot_dtype="int4")
            return jnp.sum(y * y) + jnp.sum(final)
        return jax.grad(loss)(floats)

    split = lambda p: ({k: jnp.asarray(p[k]) for k in FLOAT_ARGS}, {k: jnp.asarray(p[k]) for k in ids})
    stacked = split({k: np.stack([p[k] for p in problems]) for k in problems[0]})
    batched = jax.vmap(grads)(*stacked)
    for i, p in enumerate(problems):
        own = grads(*split(p))
        for k in FLOAT_ARGS:
            np.testing.assert_array_equal(np.asarray(batched[k][i]), np.asarray(own[k]), err_msg=k)
