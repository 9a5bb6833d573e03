"""`segment_ids`: packed sequences in one row equal the separate runs; padding does nothing. Every impl: the token
loop, the chunked form in pure JAX and the CPU kernels (impl="ffi")."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import kernel_path, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, outputs_and_grads, rel_err, run_on_host_devices

TOKEN_ARGS = ("k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
TOL = 2e-5


def fresh_seed(base):
    return base + int(np.random.SeedSequence().entropy % 10_000) * 100


def runs(ids):
    """The segments of one row: `[(start, end)]` of its non-padding runs of equal ids."""
    out, start = [], None
    for t, i in enumerate(list(ids) + [None]):
        if start is not None and (i is None or i != ids[start]):
            out.append((start, t))
            start = None
        if start is None and i is not None and i >= 0:
            start = t
    return out


def separate_runs(p, segment_ids, dy, dbank):
    """The expected outputs and gradients: each segment of each row on its own (the token loop), the cotangent of
    the final bank on each row's last segment. Padding tokens read zeros and get zero gradients."""
    y = np.zeros(p["v"].shape, np.float64)
    final = np.broadcast_to(np.asarray(p["bank"], np.float64), (p["v"].shape[0],) + p["bank"].shape[-3:]).copy()
    grads = {k: np.zeros(np.shape(p[k]), np.float64) for k in FLOAT_ARGS}
    for b, ids in enumerate(segment_ids):
        segs = runs(list(ids))
        for n, (t0, t1) in enumerate(segs):
            row = lambda a: a[b:b + 1, t0:t1]
            part = {k: row(p[k]) for k in TOKEN_ARGS}
            part["bank"] = p["bank"][b:b + 1] if p["bank"].ndim == 4 else p["bank"]
            last = n == len(segs) - 1
            y_s, final_s, g_s = outputs_and_grads(
                sdm_write_read, part, row(dy), dbank[b:b + 1] if last else np.zeros_like(dbank[b:b + 1]),
                impl="reference")
            y[b, t0:t1] = np.asarray(y_s[0])
            if last:
                final[b] = np.asarray(final_s[0])
            for k in TOKEN_ARGS:
                if k in grads:
                    grads[k][b, t0:t1] = np.asarray(g_s[k][0])
            if p["bank"].ndim == 4:
                grads["bank"][b] += np.asarray(g_s["bank"][0])
            else:
                grads["bank"] += np.asarray(g_s["bank"])
        if not segs:  # padding only: the final bank is the initial one
            if p["bank"].ndim == 4:
                grads["bank"][b] += dbank[b]
            else:
                grads["bank"] += dbank[b]
    return y, final, grads


# (impl, chunk_size): chunks of 4 hold several segments, a chunk of 7 ends where row 0's third segment starts and
# a segment spans several; a chunk of 64 holds the whole row.
IMPLS = [("reference", 1), ("xla", 4), ("ffi", 4), ("ffi", 7), ("ffi", 64)]


def check(p, segment_ids, seed, impls=IMPLS):
    """Every impl's outputs and gradients with `segment_ids` against the separate runs."""
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(p["v"].shape)
    B, H = p["k_idx"].shape[0], p["k_idx"].shape[2]
    dbank = rng.standard_normal((B, H) + p["bank"].shape[-2:])
    y_ref, final_ref, grads_ref = separate_runs(p, segment_ids, dy, dbank)
    for impl, chunk_size in impls:
        y, final, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl=impl, chunk_size=chunk_size,
                                            segment_ids=segment_ids)
        assert rel_err(y, y_ref) < TOL, (impl, chunk_size, rel_err(y, y_ref))
        assert rel_err(final, final_ref) < TOL, (impl, chunk_size, rel_err(final, final_ref))
        for k in FLOAT_ARGS:
            assert grads[k].shape == np.shape(p[k]), k
            assert rel_err(grads[k], grads_ref[k]) < TOL, (impl, chunk_size, k, rel_err(grads[k], grads_ref[k]))


# Row 0: four sequences and right padding; row 1: an id that comes back (a new sequence), one across chunks, one
# that starts at a chunk boundary (token 16 for chunks of 4; row 0's token 14 for chunks of 7).
PACKED = [[0] * 5 + [1] * 9 + [2] * 3 + [3] * 7 + [-1] * 4,
          [3] * 3 + [7] * 13 + [3] * 10 + [5] * 2]


@pytest.mark.parametrize("kind", ["repeats_per_write_gates", pytest.param("shared_bank", marks=pytest.mark.slow)])
def test_packed_rows_equal_separate_runs(kind):
    seed = fresh_seed(["repeats_per_write_gates", "shared_bank"].index(kind))
    kw = dict(repeats_per_write_gates=dict(distinct=False, repeats=True, per_write_gates=True),
              shared_bank=dict(distinct=False, shared_bank=True))[kind]
    p = random_problem(seed, B=2, T=len(PACKED[0]), H=2, K=8, D=4, W=3, R=3, **kw)
    check(p, np.array(PACKED, np.int32), seed)


@pytest.mark.slow  # padding: test_packed_rows_equal_separate_runs pads too
def test_padded_row_equals_the_shorter_sequence():
    """Padding on both sides of one sequence (and a row of padding only, which keeps the initial bank)."""
    seed = fresh_seed(50)
    p = random_problem(seed, B=2, T=14, H=2, K=8, D=4, W=3, R=2, distinct=False, repeats=True)
    ids = np.array([[-1] * 3 + [4] * 9 + [-2] * 2, [-1] * 14], np.int32)
    check(p, ids, seed)


def test_kernels_follow_the_token_loop():
    """The CPU kernels against `jax.vjp` of the token loop with `segment_ids` itself (the initial bank's gradient
    above all: it gathers the stale reads of every segment), with the segments' cotangent on the final bank."""
    seed = fresh_seed(70)
    p = random_problem(seed, B=2, T=len(PACKED[0]), H=2, K=6, D=4, W=3, R=2, distinct=False, repeats=True,
                       per_write_gates=True)
    rng = np.random.default_rng(seed)
    dy, dbank = rng.standard_normal(p["v"].shape), rng.standard_normal(p["bank"].shape)
    ids = np.array(PACKED, np.int32)
    y_ref, final_ref, grads_ref = outputs_and_grads(sdm_write_read, p, dy, dbank, impl="reference", segment_ids=ids)
    for chunk_size in (3, 16):
        y, final, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl="ffi", chunk_size=chunk_size,
                                            segment_ids=ids)
        assert rel_err(y, y_ref) < TOL and rel_err(final, final_ref) < TOL
        for k in FLOAT_ARGS:
            assert rel_err(grads[k], grads_ref[k]) < TOL, (chunk_size, k, rel_err(grads[k], grads_ref[k]))


def test_bfloat16_bank_on_the_kernels():
    """A bfloat16 bank (both working gradient banks): the kernels follow the token loop up to bfloat16's
    rounding (measured: relative errors up to about 4e-3)."""
    seed = fresh_seed(80)
    p = random_problem(seed, B=2, T=14, H=2, K=8, D=8, W=3, R=3, distinct=False, dtype=jnp.bfloat16)
    rng = np.random.default_rng(seed)
    dy, dbank = rng.standard_normal(p["v"].shape), rng.standard_normal(p["bank"].shape)
    ids = np.array([[0] * 3 + [1] * 5 + [2] * 4 + [-1] * 2, [5] * 6 + [-1] + [5] * 2 + [6] * 5], np.int32)
    y_ref, final_ref, grads_ref = outputs_and_grads(sdm_write_read, p, dy, dbank, impl="reference", segment_ids=ids)
    for grad_dtype in (None, jnp.float32):
        y, final, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl="ffi", chunk_size=4, segment_ids=ids,
                                            bank_grad_dtype=grad_dtype)
        assert final.dtype == jnp.bfloat16
        assert rel_err(y, y_ref) < 1.5e-2 and rel_err(final, final_ref) < 1.5e-2
        for k in FLOAT_ARGS:
            assert rel_err(grads[k], grads_ref[k]) < 1.5e-2, (grad_dtype, k, rel_err(grads[k], grads_ref[k]))


def test_kernels_under_jit_and_vmap():
    """`segment_ids` as a traced argument, and a `vmap` over problems (folded into the batch: one kernel call)."""
    seed = fresh_seed(90)
    p = random_problem(seed, B=2, T=12, H=1, K=8, D=4, W=2, R=2, distinct=False)
    ids = np.array([[0] * 5 + [1] * 7, [2] * 3 + [-1] * 2 + [2] * 4 + [4] * 3], np.int32)
    run = lambda q, ids: sdm_write_read(**q, impl="ffi", chunk_size=4, segment_ids=ids)
    y, final = jax.jit(run)(p, ids)
    y_ref, final_ref = sdm_write_read(**p, impl="reference", segment_ids=ids)
    assert rel_err(y, y_ref) < TOL and rel_err(final, final_ref) < TOL
    both = jax.tree.map(lambda a, b: np.stack([a, b]), p, random_problem(seed + 1, B=2, T=12, H=1, K=8, D=4, W=2,
                                                                         R=2, distinct=False))
    ids2 = np.stack([ids, ids[::-1]])
    y, final = jax.jit(jax.vmap(run))(both, ids2)
    for i in range(2):
        one = jax.tree.map(lambda a: a[i], both)
        y_i, final_i = sdm_write_read(**one, impl="reference", segment_ids=ids2[i])
        assert rel_err(y[i], y_i) < TOL and rel_err(final[i], final_i) < TOL


def test_segment_ids_errors(monkeypatch):
    p = random_problem(0, B=2, T=6, H=1, K=8, D=4, W=2, R=2)
    good = np.zeros((2, 6), np.int32)
    for impl in ("xla", "ffi"):
        with pytest.raises(ValueError, match=r"`segment_ids` has shape \(2, 5\), expected \[B, T\] = \[2, 6\]"):
            sdm_write_read(**p, impl=impl, segment_ids=good[:, :5])
        with pytest.raises(TypeError, match="`segment_ids` has dtype float32"):
            sdm_write_read(**p, impl=impl, segment_ids=good.astype(np.float32))
        # Phase 1's virtual slots need K * (chunk_size + 1) < 2^31 (checked while tracing: no bank is allocated)
        big = dict(p, bank=jax.ShapeDtypeStruct((2, 1, 2**23, 4), jnp.float32))
        with pytest.raises(ValueError, match=rf"impl='{impl}' needs K \* \(chunk_size \+ 1\) < 2\^31"):
            jax.eval_shape(lambda b: sdm_write_read(**dict(p, bank=b), impl=impl, chunk_size=256,
                                                    segment_ids=good), big["bank"])
    # A platform without the packed-sequence steps (a TPU): impl="ffi" says what serves them, impl="auto" takes the
    # pure-JAX chunked form (the same numbers as impl="xla").
    registered = kernel_path.lowering.is_registered
    monkeypatch.setattr(kernel_path.lowering, "is_registered",
                        lambda name, platform="cpu": "packed" not in name and registered(name, platform))
    with pytest.raises(NotImplementedError, match="impl='ffi' has no cpu kernels for sdm_forward_packed.*'xla'"):
        sdm_write_read(**p, impl="ffi", segment_ids=good)
    ids = np.array([[0, 0, 1, 1, 1, -1], [4, 4, 4, 2, 2, 2]], np.int32)
    for a, b in zip(sdm_write_read(**p, impl="auto", segment_ids=ids, chunk_size=4),
                    sdm_write_read(**p, impl="xla", segment_ids=ids, chunk_size=4)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_check_mode_ignores_padding_ids():
    p = random_problem(1, B=1, T=6, H=1, K=8, D=4, W=2, R=2)
    ids = np.array([[0, 0, 0, 0, -1, -1]], np.int32)
    p["k_idx"][:, 4:] = -7  # padding tokens: their ids are not used, nor checked
    y, _ = sdm_write_read(**p, impl="reference", segment_ids=ids, check=True)
    assert np.all(np.asarray(y)[:, 4:] == 0)
    p["k_idx"][:, 1] = 8
    with pytest.raises(Exception, match=r"write slot ids \(k_idx\) outside \[0, K=8\)"):
        sdm_write_read(**p, impl="reference", segment_ids=ids, check=True)


def _sharded_check():
    """The subprocess of `test_kernels_on_sharded_inputs` (2 CPU devices): print a JSON line of the largest
    differences between the sharded and the unsharded results, and the collectives of the compiled gradient."""
    import json
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    p = random_problem(5, B=2, T=12, H=2, K=8, D=4, W=2, R=2, distinct=False, per_write_gates=True)
    ids = np.array([[0] * 5 + [1] * 7, [2] * 3 + [-1] * 2 + [2] * 4 + [4] * 3], np.int32)
    dy = np.random.default_rng(6).standard_normal(p["v"].shape).astype(np.float32)

    def loss(floats, ints, ids):
        y, final = sdm_write_read(**floats, **ints, impl="ffi", chunk_size=4, segment_ids=ids)
        return jnp.sum(y * dy) + jnp.sum(final)

    floats = {k: jnp.asarray(p[k]) for k in FLOAT_ARGS}
    ints = {k: jnp.asarray(p[k]) for k in ("k_idx", "q_idx")}
    grad = jax.jit(jax.value_and_grad(loss))
    want = grad(floats, ints, ids)
    on_b = NamedSharding(Mesh(np.array(jax.devices()), ("b",)), PartitionSpec("b"))
    sharded = [jax.device_put(a, on_b) for a in (floats, ints, ids)]
    got = grad(*sharded)
    hlo = grad.lower(*sharded).compile().as_text()
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print(json.dumps({"max_diff": diff, "collectives": sorted(set(re.findall(r"all-gather|all-to-all|"
                                                                           r"collective-permute", hlo)))}))


def test_kernels_on_sharded_inputs():
    """Inputs sharded along the batch: each device runs its own streams (no gather), with the results of one."""
    r = run_on_host_devices(__file__, 2, timeout=600)
    assert r["max_diff"] <= 1e-6 and r["collectives"] == [], r


if __name__ == "__main__":
    _sharded_check()
