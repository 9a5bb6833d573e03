"""The CPU's no-grad forward (`sdm_token_recurrence`: the token recurrence in one C++ kernel) against the token loop;
and that a differentiated call still runs the chunked kernels."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jax_sdm import sdm_step, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, cotangents, extreme_gates, ffi_calls, out_of_range_case, outputs_and_grads, rel_err

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's no-grad forward")

TARGET = "sdm_token_recurrence"
ffi_op = functools.partial(sdm_write_read, impl="ffi")


def fresh_seed():
    return int(np.random.SeedSequence().entropy % 2**31)


def forward(args, **kw):
    """`(y, final_bank, repeats)` of the jitted no-grad forward."""
    return jax.jit(lambda a: ffi_op(**a, return_repeats=True, **kw))(args)


def reference(args):
    return jax.jit(lambda a: sdm_write_read(**a, impl="reference", return_repeats=True))(args)


CASES = {  # name: random_problem keywords
    "per-token gates": dict(B=2, T=77, H=3, K=64, D=16, W=4, R=3),
    "per-write gates": dict(B=2, T=77, H=3, K=64, D=16, W=4, R=3, per_write_gates=True),
    "repeats": dict(B=2, T=61, H=2, K=16, D=8, W=6, R=5, distinct=False, repeats=True, per_write_gates=True),
    "shared bank": dict(B=3, T=40, H=2, K=32, D=8, W=3, R=2, shared_bank=True, distinct=False),
    "wide lanes": dict(B=1, T=30, H=1, K=1024, D=37, W=256, R=200, per_write_gates=True, distinct=False),
    "one stream, D 1": dict(B=1, T=130, H=1, K=5, D=1, W=2, R=2, distinct=False, repeats=True),
}


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_token_loop(case):
    args = random_problem(fresh_seed(), **CASES[case])
    y, final, repeats = forward(args, chunk_size=16)
    y_ref, final_ref, repeats_ref = reference(args)
    assert y.dtype == final.dtype == jnp.float32
    assert final.shape == final_ref.shape
    assert rel_err(y, y_ref) < 1e-5, rel_err(y, y_ref)
    assert rel_err(final, final_ref) < 1e-5, rel_err(final, final_ref)
    assert int(repeats) == int(repeats_ref)
    if case == "repeats":
        assert int(repeats) > 0


@pytest.mark.parametrize("per_write_gates", [False, True])
def test_bfloat16_within_the_bar(per_write_gates):
    """Rounded once per written row per token (the chunked kernels: per chunk): within the bar of docs/MATH.md
    against a float64 token loop, over a long sequence with every row rewritten many times."""
    args = random_problem(fresh_seed(), B=1, T=1024, H=2, K=64, D=16, W=4, R=4, distinct=False,
                          per_write_gates=per_write_gates, dtype=jnp.bfloat16)
    y, final, _ = forward(args)
    with jax.enable_x64(True):
        y64, final64 = sdm_write_read(**{k: np.asarray(v, np.float64) if jnp.issubdtype(v.dtype, jnp.floating)
                                         else v for k, v in args.items()}, impl="reference")
    assert y.dtype == final.dtype == jnp.bfloat16
    assert rel_err(y, y64) < 1.5e-2, rel_err(y, y64)
    assert rel_err(final, final64) < 1.5e-2, rel_err(final, final64)


def test_repeats_decay_once_and_count():
    """A slot written twice in a token decays once with its first lane's gate, and both lanes take part in pred and
    the write; each repeat is counted once."""
    K, D = 4, 3
    rng = np.random.default_rng(fresh_seed())
    bank = rng.standard_normal((1, 1, K, D)).astype(np.float32)
    k_idx = np.array([[[[2, 0, 2, 2]]]], np.int32)  # slot 2 three times: two repeats
    k_val = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
    g = np.array([[[[-0.3, -0.7, -5.0, -9.0]]]], np.float32)  # the repeats' gates must not be used
    v = rng.standard_normal((1, 1, 1, D)).astype(np.float32)
    beta = np.array([[[0.6]]], np.float32)
    q_idx = np.array([[[[2, 1]]]], np.int32)
    q_val = rng.standard_normal((1, 1, 1, 2)).astype(np.float32)
    args = dict(bank=bank, k_idx=k_idx, k_val=k_val, v=v, beta=beta, g=g, q_idx=q_idx, q_val=q_val)
    y, final, repeats = forward(args)
    S = bank[0, 0].astype(np.float64)
    S[2] *= np.exp(-0.3)
    S[0] *= np.exp(-0.7)
    k = k_val[0, 0, 0].astype(np.float64)
    pred = k[0] * S[2] + k[1] * S[0] + k[2] * S[2] + k[3] * S[2]
    d = 0.6 * (v[0, 0, 0] - pred)
    S[2] += (k[0] + k[2] + k[3]) * d
    S[0] += k[1] * d
    y_want = q_val[0, 0, 0, 0] * S[2] + q_val[0, 0, 0, 1] * S[1]
    np.testing.assert_allclose(np.asarray(final)[0, 0], S, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y)[0, 0, 0], y_want, rtol=1e-5, atol=1e-6)
    assert int(repeats) == 2


def test_infinite_gates_are_hard_resets():
    rng = np.random.default_rng(fresh_seed())
    args = random_problem(fresh_seed(), B=2, T=70, H=2, K=16, D=8, W=4, R=3, distinct=False, repeats=True,
                          per_write_gates=True)
    args["g"] = extreme_gates(rng, args["g"], fraction=0.3)
    assert np.isneginf(args["g"]).any()
    y, final, _ = forward(args, chunk_size=16)
    y_ref, final_ref, _ = reference(args)
    assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(final)).all()
    assert rel_err(y, y_ref) < 1e-5 and rel_err(final, final_ref) < 1e-5


def test_out_of_range_ids_touch_no_row():
    bad, twin = out_of_range_case(fresh_seed())
    y, final, _ = forward(bad, chunk_size=4)
    y_twin, final_twin, _ = forward(twin, chunk_size=4)
    np.testing.assert_allclose(y, y_twin, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(final, np.asarray(final_twin)[..., :-1, :], rtol=1e-6, atol=1e-7)
    # and ids of other integer types, beyond int32, are out of range too (never wrapped)
    k_idx = bad["k_idx"].astype(np.int64)
    wide = dict(bad, k_idx=np.where(k_idx >= 16, np.int64(2**32 + 3), k_idx))
    assert (wide["k_idx"] == 2**32 + 3).any()
    with jax.enable_x64(True):
        y_wide, final_wide, _ = forward(wide, chunk_size=4)
    np.testing.assert_array_equal(y_wide, y)
    np.testing.assert_array_equal(final_wide, final)


def test_bitwise_reproducible():
    args = random_problem(fresh_seed(), B=3, T=100, H=2, K=64, D=24, W=5, R=4, distinct=False, repeats=True)
    first = forward(args)
    again = forward(args)
    recompiled = jax.jit(lambda a: ffi_op(**a, return_repeats=True))(args)  # a fresh trace and compilation
    eager = ffi_op(**args, return_repeats=True)
    for other in (again, recompiled, eager):
        for a, b in zip(first, other):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_results_do_not_depend_on_the_chunk_size():
    """Token by token: the chunk size (the kernel layout of the inputs) changes nothing, not even the rounding."""
    args = random_problem(fresh_seed(), B=2, T=50, H=2, K=32, D=8, W=3, R=3, distinct=False, repeats=True,
                          dtype=jnp.bfloat16)
    base = forward(args, chunk_size=1)
    for chunk_size in (7, 64, 256):
        for a, b in zip(base, forward(args, chunk_size=chunk_size)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_same_bits_as_a_decode_loop(dtype):
    """The no-grad forward and a `lax.scan` of `sdm_step` (the fused decode step) share their per-token arithmetic:
    prefilling with one and decoding with the other gives the same bits as either alone."""
    args = random_problem(fresh_seed(), B=2, T=33, H=2, K=32, D=20, W=4, R=3, distinct=False, repeats=True,
                          per_write_gates=True, dtype=dtype)
    y, final, _ = forward(args)

    def decode(bank, tokens):
        return sdm_step(bank, *tokens, impl="ffi")[::-1]

    tokens = tuple(jnp.moveaxis(jnp.asarray(args[k]), 1, 0)
                   for k in ("k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val"))
    final_step, y_step = jax.jit(lambda b, t: jax.lax.scan(decode, b, t))(jnp.asarray(args["bank"]), tokens)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(jnp.moveaxis(y_step, 0, 1), np.float32))
    np.testing.assert_array_equal(np.asarray(final, np.float32), np.asarray(final_step, np.float32))


def test_under_vmap_one_call_same_bits():
    args = random_problem(fresh_seed(), B=1, T=20, K=16, W=3, R=2, distinct=False, repeats=True)
    stacked = {k: np.stack([v, v[..., ::-1] if k.endswith("idx") else 0.5 * v]) for k, v in args.items()}
    f = jax.vmap(lambda a: ffi_op(**a, chunk_size=8, return_repeats=True))
    ys, finals, repeats = jax.jit(f)(stacked)
    for i in range(2):
        y, final, n = forward({k: v[i] for k, v in stacked.items()}, chunk_size=8)
        np.testing.assert_array_equal(ys[i], y)
        np.testing.assert_array_equal(finals[i], final)
        assert int(repeats[i]) == int(n)
    hlo = jax.jit(f).lower(stacked).as_text()
    assert hlo.count(f"@{TARGET}(") == 1 and "stablehlo.while" not in hlo, hlo


def test_no_grad_forward_runs_the_token_kernel_only():
    """A call that is not differentiated lowers, on the CPU, to the token kernel alone: no Phase 1, solve or chunk
    steps."""
    args = random_problem(fresh_seed(), B=2, T=40, H=2, K=16, W=3, R=2)
    hlo = jax.jit(lambda a: ffi_op(**a, chunk_size=8)).lower(args).as_text()
    targets = set(re.findall(r"stablehlo.custom_call @(\w+)\(", hlo))
    assert targets == {TARGET}, targets


def test_gpu_lowering_keeps_the_chunked_kernels():
    """The kernel is picked per platform when lowering: lowered for CUDA, a call that is not differentiated runs the
    chunked kernels (no residuals) and never the CPU's token kernel."""
    args = random_problem(fresh_seed(), B=2, T=40, H=2, K=16, W=3, R=2)
    traced = jax.jit(lambda a: ffi_op(**a, chunk_size=8)).trace(args)
    targets = lambda platforms: set(re.findall(r"stablehlo.custom_call @(\w+)\(",
                                               traced.lower(lowering_platforms=platforms).as_text()))
    assert targets(("cuda",)) == {"sdm_phase1", "sdm_solve", "sdm_forward"}
    assert targets(("cpu",)) == {TARGET}


def test_gradients_run_the_chunked_kernels():
    """Differentiated, the call runs the chunked kernels' forward (which saves the residuals) and backward, never the
    token kernel; the forward of the VJP gives the token kernel's results to rounding and the gradients match the
    token loop's."""
    seed = fresh_seed()
    args = random_problem(seed, B=2, T=45, H=2, K=24, D=8, W=4, R=3, distinct=False, repeats=True,
                          per_write_gates=True)
    dy, dbank = cotangents(seed, args)
    floats = {k: jnp.asarray(args[k]) for k in FLOAT_ARGS}
    rest = {k: v for k, v in args.items() if k not in FLOAT_ARGS}
    op = lambda f: ffi_op(**f, **rest, chunk_size=16)
    jaxpr = jax.make_jaxpr(lambda f: jax.vjp(op, f)[1]((jnp.asarray(dy), jnp.asarray(dbank))))(floats)
    assert ffi_calls(jaxpr, TARGET) == []
    assert len(ffi_calls(jaxpr, "sdm_forward")) == 1 and len(ffi_calls(jaxpr, "sdm_backward")) == 1
    y, final, grads = outputs_and_grads(sdm_write_read, args, dy, dbank, impl="ffi", chunk_size=16)
    y_ref, final_ref, grads_ref = outputs_and_grads(sdm_write_read, args, dy, dbank, impl="reference")
    y_nograd, final_nograd, _ = forward(args, chunk_size=16)
    assert rel_err(y, y_nograd) < 1e-6 and rel_err(final, final_nograd) < 1e-6
    for k in FLOAT_ARGS:
        assert rel_err(grads[k], grads_ref[k]) < 1e-5, (k, rel_err(grads[k], grads_ref[k]))


def test_checked_mode():
    args = random_problem(fresh_seed(), B=1, T=12, H=2, K=16, D=4, W=3, R=2)
    y, final = ffi_op(**args, check=True)
    y_plain, final_plain = ffi_op(**args)
    np.testing.assert_array_equal(y, y_plain)
    np.testing.assert_array_equal(final, final_plain)
    bad = dict(args, k_idx=np.where(np.arange(3) == 1, 16, args["k_idx"]).astype(np.int32))
    with pytest.raises(ValueError, match="outside"):
        ffi_op(**bad, check=True)
    err, _ = jax.jit(checkify.checkify(lambda a: ffi_op(**a, check=True)))(bad)
    assert err.get() is not None and "k_idx" in err.get()
