"""Bad input raises a clear error at trace time, naming the argument and what it needs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_step, sdm_write_read
from jax_sdm.testing import random_problem

GOOD = random_problem(0, B=2, T=5, H=3, K=8, D=4, W=2, R=3)


def call(impl="xla", chunk_size=4, **changes):
    args = dict(GOOD, **changes)
    return sdm_write_read(**args, chunk_size=chunk_size, impl=impl)


def test_good_input_passes():
    y, final = call(impl="ffi")
    assert y.shape == (2, 5, 3, 4) and final.shape == (2, 3, 8, 4)


BAD = {
    # name: (changes, exception, words that must appear in the message)
    "bank_rank": (dict(bank=np.zeros((8, 4), np.float32)), ValueError, ["`bank`", "(8, 4)", "rank 4 or 3"]),
    "bank_heads": (dict(bank=np.zeros((2, 2, 8, 4), np.float32)), ValueError, ["`bank`", "(2, 2, 8, 4)", "[B, H, K, D]"]),
    "shared_bank_heads": (dict(bank=np.zeros((2, 8, 4), np.float32)), ValueError, ["`bank`", "[H, K, D]"]),
    "bank_dtype": (dict(bank=GOOD["bank"].astype(np.float16)), TypeError, ["`bank`", "float16", "float32 or bfloat16"]),
    "bank_int": (dict(bank=GOOD["bank"].astype(np.int32)), TypeError, ["`bank`", "int32"]),
    "k_idx_rank": (dict(k_idx=GOOD["k_idx"][..., 0]), ValueError, ["`k_idx`", "rank 4"]),
    "k_idx_float": (dict(k_idx=GOOD["k_idx"].astype(np.float32)), TypeError, ["`k_idx`", "float32", "integer"]),
    "q_idx_float": (dict(q_idx=GOOD["q_idx"].astype(np.float32)), TypeError, ["`q_idx`", "integer"]),
    "q_idx_shape": (dict(q_idx=GOOD["q_idx"][:, :4]), ValueError, ["`q_idx`", "(2, 4, 3, 3)", "[B, T, H, R]"]),
    "k_val_shape": (dict(k_val=GOOD["k_val"][..., :1]), ValueError, ["`k_val`", "(2, 5, 3, 1)", "[2, 5, 3, 2]"]),
    "k_val_dtype": (dict(k_val=GOOD["k_val"].astype(jnp.bfloat16)), TypeError, ["`k_val`", "bfloat16", "float32"]),
    "q_val_shape": (dict(q_val=GOOD["q_val"][..., :2]), ValueError, ["`q_val`", "[2, 5, 3, 3]"]),
    "v_width": (dict(v=GOOD["v"][..., :3]), ValueError, ["`v`", "(2, 5, 3, 3)", "[2, 5, 3, 4]"]),
    "v_dtype": (dict(v=GOOD["v"].astype(np.float16)), TypeError, ["`v`", "float16", "float32"]),
    "beta_shape": (dict(beta=GOOD["beta"][..., None]), ValueError, ["`beta`", "(2, 5, 3, 1)", "[2, 5, 3]"]),
    "beta_dtype": (dict(beta=GOOD["beta"].astype(jnp.bfloat16)), TypeError, ["`beta`", "bfloat16", "float32"]),
    "g_shape": (dict(g=np.zeros((2, 5, 3, 5), np.float32)), ValueError, ["`g`", "(2, 5, 3, 5)", "per write"]),
    "g_dtype": (dict(g=GOOD["g"].astype(np.float16)), TypeError, ["`g`", "float16"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_argument(name):
    changes, exc, words = BAD[name]
    with pytest.raises(exc) as info:
        call(**changes)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("chunk_size", [0, 257, -3])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match=r"`chunk_size` must be in 1\.\.256, got " + str(chunk_size)):
        call(chunk_size=chunk_size)


def test_chunk_size_must_be_int():
    with pytest.raises(TypeError, match="`chunk_size` must be a Python int"):
        call(chunk_size=16.0)


@pytest.mark.parametrize("lanes", [257])
def test_lane_limits(lanes):
    p = random_problem(1, B=1, T=2, H=1, K=512, D=2, W=2, R=2, distinct=False)
    k_idx = np.zeros((1, 2, 1, lanes), np.int32)
    k_val = np.zeros((1, 2, 1, lanes), np.float32)
    with pytest.raises(ValueError, match=r"`k_idx` has W = %d lanes, expected 0\.\.256" % lanes):
        sdm_write_read(**dict(p, k_idx=k_idx, k_val=k_val), impl="xla")
    q_idx = np.zeros((1, 2, 1, lanes), np.int32)
    with pytest.raises(ValueError, match=r"`q_idx` has R = %d lanes, expected 0\.\.256" % lanes):
        sdm_write_read(**dict(p, q_idx=q_idx, q_val=q_idx.astype(np.float32)), impl="xla")


def test_bad_impl():
    with pytest.raises(ValueError, match="`impl` must be one of"):
        call(impl="cuda")


def test_errors_raise_at_trace_time():
    """Validation runs on shapes alone: under jit it raises while tracing, before any computation."""
    f = jax.jit(lambda v: sdm_write_read(**dict(GOOD, v=v), impl="xla"))
    with pytest.raises(ValueError, match="`v`"):
        f.lower(jax.ShapeDtypeStruct((2, 5, 3, 7), jnp.float32))


def test_other_integer_ids_accepted():
    y64, _ = call(impl="ffi", k_idx=GOOD["k_idx"].astype(np.int16), q_idx=GOOD["q_idx"].astype(np.uint8))
    y32, _ = call(impl="ffi")
    np.testing.assert_array_equal(y64, y32)


PER_TOKEN = ("k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")


@pytest.mark.parametrize("name", PER_TOKEN)
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_leading_shape_mismatch_names_the_argument(name, axis):
    """One per-token argument with a different B, T or H than the others (e.g. `k_idx` with T = 8 among T = 16)
    is the one the error names, whichever argument it is."""
    good = random_problem(3, B=2, T=16, H=3, K=8, D=4, W=2, R=3)
    bad = random_problem(3, **dict(dict(B=2, T=16, H=3), **{"BTH"[axis]: 1 if axis != 1 else 8}), K=8, D=4, W=2, R=3)
    args = dict(good, **{name: bad[name]})
    with pytest.raises(ValueError) as info:
        sdm_write_read(**args, chunk_size=4, impl="xla")
    message = str(info.value)
    assert message.startswith(f"sdm_write_read: `{name}` has shape {bad[name].shape}"), message
    assert "[2, 16, 3" in message, message  # what the other arguments agree on


@pytest.mark.parametrize("name", PER_TOKEN)
def test_step_leading_shape_mismatch_names_the_argument(name):
    good = {k: (a if k == "bank" else a[:, 0]) for k, a in random_problem(4, B=3, T=1, H=2, K=8, D=4, W=2, R=3).items()}
    bad = {k: (a if k == "bank" else a[:, 0]) for k, a in random_problem(4, B=1, T=1, H=2, K=8, D=4, W=2, R=3).items()}
    with pytest.raises(ValueError, match=rf"^sdm_step: `{name}` has shape \(1, 2"):
        sdm_step(**dict(good, **{name: bad[name]}), impl="xla")


def test_bank_batch_mismatch_names_the_bank():
    bank = np.zeros((1, 3, 8, 4), np.float32)
    with pytest.raises(ValueError, match=r"`bank` has shape \(1, 3, 8, 4\), expected \[B, H, K, D\] = \[2, 3, K, D\]"):
        call(bank=bank)


# float64: the kernels compute in float32 and take float32 or bfloat16 banks; the pure-JAX paths compute in the bank's
# dtype, so with x64 on a float64 bank runs there (the tests' float64 token loop is the oracle of every path; its
# numbers against the chunked form's: test_xla.py).

@pytest.mark.parametrize("op", ["sdm_write_read", "sdm_step"])
def test_float64_bank_served_by_the_pure_jax_paths_only(op):
    with jax.enable_x64(True):
        p = random_problem(5, B=2, T=6 if op == "sdm_write_read" else 1, H=2, K=8, D=4, W=2, R=3, dtype=np.float64)
        if op == "sdm_step":
            p = {k: (a if k == "bank" else a[:, 0]) for k, a in p.items()}
        fn = sdm_write_read if op == "sdm_write_read" else sdm_step
        for impl in ("xla", "reference"):
            y, final = jax.eval_shape(lambda p: fn(**p, impl=impl), p)
            assert y.dtype == final.dtype == jnp.float64, impl
        for impl in ("auto", "ffi"):
            with pytest.raises(TypeError, match=rf"^{op}: `bank` has dtype float64, expected float32 or bfloat16 "
                                                r"\(a float64 bank needs impl='xla' or impl='reference'\)"):
                fn(**p, impl=impl)
