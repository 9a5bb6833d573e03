"""The Flax NNX layer `jax_sdm.nn.SparseDeltaMemory` and its addressing (`jax_sdm.nn.addressing`)."""
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend.core  # noqa: F401  (jaxprs_in_params)
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import jax_sdm  # noqa: E402
from jax_sdm.nn import (SparseDeltaMemory, balanced_factors, decode_loop, load_reference_state_dict,  # noqa: E402
                        memory_access_stats, product_key_slots, topk_slots, weight_decay_mask)
from .helpers import product_key_brute_force, product_key_slot_scores  # noqa: E402

D_MODEL = 16
SMALL = dict(num_heads=2, slots_per_head=36, num_writes=3, num_reads=2, head_dim=8, chunk_size=4)


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """The layer's projections at full float32 precision. On a GPU the default lets XLA use TF32 for some matmul
    shapes and not others, so two ways of computing the same thing (prefill then decode against one call, a
    rematerialised scan against a plain one) differ by ~1e-4; these tests check the layer's plumbing, not that."""
    with jax.default_matmul_precision("highest"):
        yield


def fresh_seed():
    return int(np.random.SeedSequence().entropy % 2**31)


def layer(seed, **kw):
    return SparseDeltaMemory(D_MODEL, **{**SMALL, **kw}, rngs=nnx.Rngs(seed))


def inputs(seed, B=2, T=11):
    return jax.random.normal(jax.random.key(seed), (B, T, D_MODEL), jnp.float32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# -- the package without flax -------------------------------------------------------------------------------

def test_import_jax_sdm_does_not_import_flax():
    code = ("import sys, jax_sdm; assert 'flax' not in sys.modules, 'flax imported'; "
            "assert 'jax_sdm.nn' not in sys.modules; jax_sdm.nn.SparseDeltaMemory; "
            "assert 'flax' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_without_flax_jax_sdm_works_and_nn_names_the_extra():
    code = ("import sys; sys.modules['flax'] = None  # as if flax were not installed\n"
            "import numpy as np, jax_sdm\n"
            "from jax_sdm.testing import random_problem\n"
            "p = random_problem(0, B=1, T=3, H=1, K=8, D=2, W=2, R=2)\n"
            "jax_sdm.sdm_write_read(*(p[n] for n in ('bank', 'k_idx', 'k_val', 'v', 'beta', 'g', 'q_idx', "
            "'q_val')), impl='reference')\n"
            "try:\n    jax_sdm.nn\nexcept ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'pip install "jax_sdm[nn]"' in out.stdout, out.stdout


def test_missing_attribute_is_attribute_error():
    assert not hasattr(jax_sdm, "no_such_thing")


# -- addressing -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_slots,num_factors", [(4096, 2), (96, 2), (4096, 3), (30, 3), (7, 2), (64, 1)])
def test_balanced_factors(num_slots, num_factors):
    factors = balanced_factors(num_slots, num_factors)
    assert len(factors) == num_factors and math.prod(factors) == num_slots
    assert list(factors) == sorted(factors, reverse=True)
    # No other factorisation into as many factors has a smaller largest factor.
    best = min(max(f) for f in _factorisations(num_slots, num_factors))
    assert max(factors) == best


def _factorisations(n, k):
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorisations(n // d, k - 1):
                yield (d,) + rest


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=2, max_size=3), data=st.data())
def test_product_key_matches_brute_force(sizes, data):
    """The pruned search returns exactly the top-k of all combined scores, best first."""
    total = math.prod(sizes)
    k = data.draw(st.integers(1, min(total, 256)))
    seed = data.draw(st.integers(0, 2**31 - 1))
    keys = jax.random.split(jax.random.key(seed), len(sizes))
    factor_scores = [jax.random.normal(key, (3, n)) for key, n in zip(keys, sizes)]
    scores, ids = product_key_slots(factor_scores, k)

    full = sum(np.asarray(s).reshape((3,) + tuple(n if i == f else 1 for i, n in enumerate(sizes)))
               for f, s in enumerate(factor_scores)).reshape(3, total)
    want_ids = np.argsort(-full, axis=1, kind="stable")[:, :k]
    want_scores = np.take_along_axis(full, want_ids, axis=1)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sizes,k", [((6, 5), 7), ((4, 3, 5), 9)])
def test_product_key_gradient_reaches_selected_scores_only(sizes, k):
    seed = fresh_seed()
    keys = jax.random.split(jax.random.key(seed), len(sizes) + 1)
    factor_scores = [jax.random.normal(key, (4, n)) for key, n in zip(keys, sizes)]
    weights = jax.random.normal(keys[-1], (4, k))

    got = jax.grad(lambda fs: jnp.sum(weights * product_key_slots(fs, k)[0]))(factor_scores)
    want_ids = product_key_brute_force(jnp.concatenate(factor_scores, -1), sizes, k)
    want = jax.grad(lambda fs: jnp.sum(weights * product_key_slot_scores(jnp.concatenate(fs, -1), sizes,
                                                                        want_ids)))(factor_scores)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    # A factor entry in no selected slot gets no gradient; every one in a selected slot gets some.
    _, ids = product_key_slots(factor_scores, k)
    digits = np.asarray(ids)
    for f in reversed(range(len(sizes))):
        used = np.zeros((4, sizes[f]), bool)
        np.put_along_axis(used, digits % sizes[f], True, axis=1)
        digits = digits // sizes[f]
        assert np.all(np.asarray(got[f])[~used] == 0) and np.all(np.asarray(got[f])[used] != 0)


def test_addressing_rejects_bad_k():
    with pytest.raises(ValueError, match="k"):
        topk_slots(jnp.zeros((2, 4)), 5)
    with pytest.raises(ValueError, match="k"):
        product_key_slots([jnp.zeros((2, 2)), jnp.zeros((2, 3))], 7)


# -- the layer --------------------------------------------------------------------------------------------

VARIANTS = {
    "product_key": {},
    "three_factors": dict(num_factors=3, slots_per_head=27),
    "topk_write_gates": dict(addressing="topk", gate="write"),
    "zeros_bank_plain": dict(initial_bank="zeros", output_gate=False, readout_norm=False, use_bias=False,
                             write_activation="identity", read_activation="identity", write_scale=0.3,
                             read_scale=0.3),
    "sub_keys": dict(factor_scores="sub_keys"),
    "unbalanced_factors": dict(product_key_factors=(4, 3, 3), readout_norm="layer"),
    "batchnorm_l2": dict(query_batchnorm=True, write_activation="l2_normalize", read_activation="sigmoid",
                         gate="write"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layer_matches_its_parts_on_the_token_loop(variant):
    """The layer's output is the readout of `sdm_reference` on the layer's own memory inputs."""
    seed = fresh_seed()
    kw = VARIANTS[variant]
    x = inputs(seed + 1)
    model = layer(seed, **kw)
    k_idx, k_val, v, beta, g, q_idx, q_val = model.memory_inputs(x)
    W = model.num_writes
    assert k_idx.shape == (2, 11, 2, W) and q_idx.shape == (2, 11, 2, model.num_reads)
    assert g.shape == ((2, 11, 2, W) if kw.get("gate") == "write" else (2, 11, 2))
    assert bool(jnp.all(g <= 0)) and bool(jnp.all((beta > 0) & (beta < 1)))
    if kw.get("write_activation", "softmax") == "softmax":
        np.testing.assert_allclose(jnp.sum(k_val, -1), 1, rtol=1e-5)
    # Distinct slots per token: top-k never picks a slot twice.
    assert np.all(np.diff(np.sort(np.asarray(k_idx), -1), axis=-1) > 0)
    y_tok, bank_tok = jax.jit(jax_sdm.sdm_reference)(model.initial_bank(), k_idx, k_val, v, beta, g, q_idx, q_val)
    y, bank = nnx.jit(lambda m, x: m(x))(model, x)
    assert rel_err(y, model.readout(x, y_tok)) < 1e-5 and rel_err(bank, bank_tok) < 1e-5


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_impl_is_passed_through(impl):
    seed = fresh_seed()
    x = inputs(seed + 1)
    call = nnx.jit(lambda m, x: m(x))
    y, bank = call(layer(seed, impl=impl), x)
    y_ffi, bank_ffi = call(layer(seed, impl="ffi"), x)
    assert rel_err(y, y_ffi) < 1e-5 and rel_err(bank, bank_ffi) < 1e-5


@pytest.mark.parametrize("impl,variant", [("auto", "product_key"), ("auto", "topk_write_gates"),
                                          ("reference", "product_key")])
def test_prefill_then_decode_equals_one_call(impl, variant):
    seed = fresh_seed()
    model = layer(seed, impl=impl, **VARIANTS[variant])
    x = inputs(seed + 1, T=9)
    call = nnx.jit(lambda m, x, s: m(x, state=s))
    y_all, bank_all = call(model, x, model.init_state(2))
    y_pre, state = call(model, x[:, :5], model.init_state(2))
    ys = [y_pre]
    for t in range(5, 9):
        y_t, state = call(model, x[:, t:t + 1], state)
        ys.append(y_t)
    assert rel_err(jnp.concatenate(ys, axis=1), y_all) < 1e-5
    assert rel_err(state, bank_all) < 1e-5


def test_one_token_with_a_state_is_the_inference_only_decode_step():
    """T == 1 with a state runs `sdm_step`, which refuses derivatives; a longer call with a state trains."""
    seed = fresh_seed()
    model = layer(seed)
    x = inputs(seed + 1, T=2)
    state = model.init_state(2)
    step_loss = lambda m, x: jnp.sum(m(x, state=state)[0] ** 2)
    with pytest.raises(TypeError, match="sdm_step is inference only"):
        nnx.grad(step_loss)(model, x[:, :1])
    # A longer call with a state trains: with the initial bank as the state, its gradients are the stateless
    # call's, except the learned initial bank's, which the given state replaces.
    grads = nnx.state(nnx.grad(step_loss)(model, x), nnx.Param)
    stateless = nnx.state(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2))(model, x), nnx.Param)
    for (path, g), (_, want) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                    jax.tree_util.tree_leaves_with_path(stateless)):
        if path[0] == jax.tree_util.DictKey("bank"):
            assert not np.any(np.asarray(g)), path
        else:
            assert rel_err(g, want) < 1e-5, path
    # With a random state every read meets a nonzero row, so the query side has a gradient whatever the ids.
    random_state = jax.random.normal(jax.random.key(seed + 2), state.shape, jnp.float32)
    grads = nnx.grad(lambda m, x: jnp.sum(m(x, state=random_state)[0] ** 2))(model, x)
    assert np.any(np.asarray(grads.read_query.kernel[...]) != 0)


def test_state_none_equals_init_state():
    seed = fresh_seed()
    model = layer(seed)
    x = inputs(seed + 1)
    call = nnx.jit(lambda m, x, s: m(x, state=s))
    y0, s0 = call(model, x, None)
    y1, s1 = call(model, x, model.init_state(2))
    np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s1, s0, rtol=1e-6, atol=1e-6)
    assert model.init_state(3).shape == (3, 2, 36, 8)


def loss_fn(model, x, target):
    y, state = model(x)
    return jnp.mean((y - target) ** 2) + 0.1 * jnp.mean(state ** 2)


def test_gradients_match_the_token_loop_and_reach_every_parameter():
    seed = fresh_seed()
    x, target = inputs(seed + 1), inputs(seed + 2)
    grads = {impl: nnx.jit(nnx.grad(loss_fn))(layer(seed, impl=impl), x, target) for impl in ("reference", "ffi")}
    ref = jax.tree.leaves(nnx.to_pure_dict(grads["reference"]))
    names = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads["reference"]))[0]]
    for name, g in zip(names, ref):
        assert np.any(np.asarray(g) != 0), f"no gradient reaches {name}"
    for name, g, r in zip(names, jax.tree.leaves(nnx.to_pure_dict(grads["ffi"])), ref):
        assert rel_err(g, r) < 1e-4, (name, rel_err(g, r))


def test_gradient_reaches_only_selected_slot_keys():
    seed = fresh_seed()
    model = layer(seed, addressing="topk", factor_scores="sub_keys", slots_per_head=64)
    # A nonzero initial bank: a read of a row that is zero and never written has no gradient.
    model.bank[...] = jax.random.normal(jax.random.key(seed + 3), model.bank.shape)
    x, target = inputs(seed + 1, T=4), inputs(seed + 2, T=4)
    k_idx, _, _, _, _, q_idx, _ = model.memory_inputs(x)
    grad = nnx.jit(nnx.grad(loss_fn))(model, x, target)
    selected = np.zeros((2, 64), bool)  # [H, K]
    for idx in (k_idx, q_idx):
        for h in range(2):
            selected[h, np.asarray(idx[:, :, h]).ravel()] = True
    key_grad = np.abs(np.asarray(grad.slot_keys[...])).sum(-1)
    assert np.all(key_grad[~selected] == 0) and np.all(key_grad[selected] > 0)


def test_scan_over_layers_and_remat():
    seed = fresh_seed()
    L = 2

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return SparseDeltaMemory(D_MODEL, **SMALL, rngs=rngs)

    stack = make(nnx.Rngs(seed))
    x = inputs(seed + 1)

    def stack_loss(stack, x, remat):
        def block(h, layer):
            y, state = layer(h)
            return h + y, state

        body = nnx.remat(block) if remat else block
        h, states = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, stack)
        return jnp.mean(h ** 2) + jnp.mean(states ** 2), (h, states)

    (loss, (h, states)), grad = nnx.jit(nnx.value_and_grad(stack_loss, has_aux=True),
                                        static_argnums=2)(stack, x, False)
    assert states.shape == (L, 2, 2, 36, 8)
    # The same layers applied one after another.
    graphdef, params = nnx.split(stack)
    h_loop = x
    call = nnx.jit(lambda m, x: m(x))
    for i in range(L):
        one = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], params))
        y, state = call(one, h_loop)
        np.testing.assert_allclose(state, states[i], rtol=1e-5, atol=1e-6)
        h_loop = h_loop + y
    np.testing.assert_allclose(h, h_loop, rtol=1e-5, atol=1e-6)

    (loss_r, _), grad_r = nnx.jit(nnx.value_and_grad(stack_loss, has_aux=True), static_argnums=2)(stack, x, True)
    assert float(loss_r) == pytest.approx(float(loss), rel=1e-6)
    # Rematerialised and plain scans may fuse (and so round) differently: elementwise checks fail on entries near
    # zero, so each leaf is compared in relative L2, far below what a wrong gradient would give.
    for g, r in zip(jax.tree.leaves(nnx.to_pure_dict(grad_r)), jax.tree.leaves(nnx.to_pure_dict(grad))):
        assert np.any(np.asarray(r) != 0)
        assert rel_err(g, r) <= 1e-5


def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    seed = fresh_seed()
    model = layer(seed)
    x = inputs(seed + 1)
    call = nnx.jit(lambda m, x, s: m(x, state=s))
    _, state = call(model, x[:, :6], model.init_state(2))
    y_want, _ = call(model, x[:, 6:], state)

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "model", nnx.state(model))
    checkpointer.save(tmp_path / "decode_state", {"bank": state})
    checkpointer.wait_until_finished()

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: layer(seed + 7)))
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "model", abstract))
    state_back = checkpointer.restore(tmp_path / "decode_state", {"bank": jax.ShapeDtypeStruct(state.shape,
                                                                                             state.dtype)})
    np.testing.assert_array_equal(state_back["bank"], state)
    y, _ = call(restored, x[:, 6:], state_back["bank"])
    np.testing.assert_array_equal(y, y_want)


def test_segment_ids():
    """A packed row equals the separate runs and a padded row the shorter sequence (on the token loop)."""
    seed = fresh_seed()
    model = layer(seed, impl="reference")
    x = inputs(seed + 1, B=2, T=10)
    seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [3, 3, 3, 3, 3, 3, 3, -1, -1, -1]], jnp.int32)
    y, final = nnx.jit(lambda m, x, seg: m(x, segment_ids=seg))(model, x, seg)
    whole = nnx.jit(lambda m, x: m(x))
    first, _ = whole(model, x[:1, :4])
    second, second_final = whole(model, x[:1, 4:])
    np.testing.assert_allclose(y[:1], jnp.concatenate([first, second], axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final[:1], second_final, rtol=1e-5, atol=1e-6)
    short, short_final = whole(model, x[1:, :7])
    np.testing.assert_allclose(y[1:, :7], short, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final[1:], short_final, rtol=1e-5, atol=1e-6)


def test_bfloat16_layer_follows_float32():
    """The bfloat16 layer is the float32 computation on its own addressing, up to bfloat16 rounding. (Its slots
    may differ from the float32 layer's: rounding can swap two close scores in the top-k.)"""
    seed = fresh_seed()
    x = inputs(seed + 1)
    model16 = layer(seed, dtype=jnp.bfloat16)
    y16, bank16 = nnx.jit(lambda m, x: m(x))(model16, x)
    assert y16.dtype == jnp.bfloat16 and bank16.dtype == jnp.bfloat16
    k_idx, k_val, v, beta, g, q_idx, q_val = model16.memory_inputs(x)
    assert k_val.dtype == v.dtype == q_val.dtype == jnp.bfloat16 and beta.dtype == g.dtype == jnp.float32
    model32 = layer(seed)
    f32 = lambda a: a.astype(jnp.float32)
    y, bank = jax_sdm.sdm_reference(model32.initial_bank(), k_idx, f32(k_val), f32(v), beta, g, q_idx, f32(q_val))
    assert rel_err(y16, model32.readout(x, y)) < 3e-2 and rel_err(bank16, bank) < 3e-2


@pytest.mark.parametrize("kw,error,match", [
    (dict(addressing="hash"), ValueError, "addressing"),
    (dict(gate="slot"), ValueError, "gate"),
    (dict(initial_bank="random"), ValueError, "initial_bank"),
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(num_writes=40), ValueError, "num_writes"),
    (dict(num_factors=1), ValueError, "num_factors"),
    (dict(product_key_factors=(6, 5)), ValueError, "product_key_factors"),
    (dict(product_key_factors=(36,)), ValueError, "product_key_factors"),
    (dict(factor_scores="hashed"), ValueError, "factor_scores"),
    (dict(write_activation="swish2"), ValueError, "write_activation"),
    (dict(readout_norm="batch"), ValueError, "readout_norm"),
    (dict(head_dim=None, num_heads=3), ValueError, "head_dim"),
    (dict(dtype=jnp.float16), TypeError, "dtype"),
])
def test_constructor_rejects_bad_options(kw, error, match):
    with pytest.raises(error, match=match):
        layer(0, **kw)


def test_call_rejects_bad_shapes():
    model = layer(0)
    with pytest.raises(ValueError, match="x"):
        model(jnp.zeros((2, 5, D_MODEL + 1)))
    with pytest.raises(ValueError, match="state"):
        model(jnp.zeros((2, 5, D_MODEL)), state=model.init_state(3))


def _numpy_linear(x, module):
    return np.asarray(x, np.float64) @ np.asarray(module.kernel[...], np.float64) + np.asarray(module.bias[...])


def test_one_input_matmul_is_the_separate_projections():
    seed = fresh_seed()
    model = layer(seed)
    x = inputs(seed + 1)
    parts = model.project(x)
    mods = [model.write_query, model.read_query, model.value_proj, model.beta_proj, model.gate_proj,
            model.output_gate]
    assert parts[0].shape == (2, 11, 2, 12) and parts[2].shape == (2, 11, 2, 8) and parts[3].shape == (2, 11, 2)
    for part, module in zip(parts, mods):
        np.testing.assert_allclose(part.reshape(2, 11, -1), _numpy_linear(x, module), rtol=1e-5, atol=1e-5)


def test_direct_scores_address_the_best_slots_of_the_projection():
    """With direct factor scores, a head's slots are the top-k of `x W + b` column sums over all slots."""
    seed = fresh_seed()
    model = layer(seed, product_key_factors=(4, 9))
    x = inputs(seed + 1)
    k_idx, k_val, *_ = model.memory_inputs(x)
    cols = _numpy_linear(x, model.write_query).reshape(2, 11, 2, 13)
    full = (cols[..., :4, None] + cols[..., None, 4:]).reshape(2, 11, 2, 36)
    want = np.argsort(-full, axis=-1, kind="stable")[..., :3]
    np.testing.assert_array_equal(k_idx, want)
    scores = np.take_along_axis(full, want, axis=-1)
    softmax = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(k_val, softmax / softmax.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factor_scores", ["direct", "sub_keys"])
def test_no_tensor_scales_with_all_slots_per_token(factor_scores):
    """At config a's shapes (B 4, T 4096, d_model 1024, K 65536, W = R = 64, bf16) the layer's own computation
    around the op (addressing, projections, gates, readout), forward and backward, makes no [B, T, H, K]-sized
    value (traced only, nothing runs). The largest per-token values are the input projection's output (with
    sub-keys, 2 F key_dim + ... columns) and the masked sums of the addressing's derivative, writes and reads
    together: [2, B, T, H, k, k] (an eighth of [B, T, H, K] here, and one fused reduction for XLA)."""
    B, T, d_model, K = 4, 4096, 1024, 65536
    abstract = nnx.eval_shape(lambda: SparseDeltaMemory(
        d_model, num_heads=1, slots_per_head=K, num_writes=64, num_reads=64, chunk_size=128, dtype=jnp.bfloat16,
        factor_scores=factor_scores, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    x = jax.ShapeDtypeStruct((B, T, d_model), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((B, T, 1, d_model), jnp.bfloat16)  # the op's readings

    def loss(params, x, y):
        model = nnx.merge(graphdef, params, rest)
        args = model.memory_inputs(x)
        floats = sum(jnp.sum(args[i].astype(jnp.float32)) for i in (1, 2, 3, 4, 6))
        return floats + jnp.sum(model.readout(x, y).astype(jnp.float32))

    largest = 0
    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
        jaxpr = jax.make_jaxpr(fn)(params, x, y)

        def walk(jaxpr):
            nonlocal largest
            for eqn in jaxpr.eqns:
                for var in eqn.outvars:
                    if hasattr(var.aval, "shape"):
                        largest = max(largest, math.prod(var.aval.shape))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jaxpr.jaxpr)
    projection = sum(m.out_features for m in abstract._input_projections())
    assert largest <= B * T * max(K // 8, projection), largest


@pytest.mark.parametrize("kw", [{}, dict(num_reads=1, read_activation="l2_normalize"),
                                dict(product_key_factors=(9, 4), write_activation="sigmoid")])
def test_addressing_is_one_product_key_kernel(kw):
    """The product-key search of writes and reads is one call of the product-key top-k kernel, forward and
    backward, and nothing sorts."""
    model = layer(0, **kw)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = inputs(1)
    loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x)[0])
    for fn, target in ((loss, "sdm_product_key_topk\""), (jax.grad(loss), "sdm_product_key_topk_bwd")):
        text = jax.jit(fn).lower(params, x).compile().as_text()
        assert " sort(" not in text and text.count(target) == 1, target


def test_query_batchnorm_train_and_eval():
    """Training mode normalises with the batch's statistics (padding excluded) and updates the running ones;
    eval mode and decoding use the running statistics."""
    seed = fresh_seed()
    model = layer(seed, query_batchnorm=True)
    x = inputs(seed + 1) * 3 + 1
    seg = jnp.array([[0] * 11, [0] * 8 + [-1] * 3], jnp.int32)
    raw = model.project(x)[0].reshape(2, 11, -1)
    valid = np.asarray(seg >= 0)
    rows = np.asarray(raw, np.float64)[valid]
    mean, var = rows.mean(0), rows.var(0)
    before = np.asarray(model.write_norm.mean[...])
    normed = model.write_norm(raw, mask=jnp.broadcast_to(valid[..., None], raw.shape))
    np.testing.assert_allclose(np.asarray(normed)[valid], (rows - mean) / np.sqrt(var + 1e-5), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(model.write_norm.mean[...], 0.9 * before + 0.1 * mean, rtol=1e-5, atol=1e-6)
    # Through the layer: with segment ids the padding does not move the statistics.
    model2 = layer(seed, query_batchnorm=True)
    model2(x, segment_ids=seg)
    np.testing.assert_allclose(model2.write_norm.mean[...], model.write_norm.mean[...], rtol=1e-5, atol=1e-6)
    # Eval: the running statistics, so a token's output does not depend on the rest of the batch.
    model2.eval()
    y_all, _ = model2(x)
    y_one, _ = model2(x[:1])
    np.testing.assert_allclose(y_one, y_all[:1], rtol=1e-5, atol=1e-5)
    model2.train()
    y_all, _ = model2(x)
    y_one, _ = model2(x[:1])
    assert rel_err(y_one, y_all[:1]) > 1e-3


@pytest.mark.parametrize("variant", ["product_key", "batchnorm_l2"])
def test_decode_loop_equals_one_call_and_donates_the_state(variant):
    seed = fresh_seed()
    model = layer(seed, **VARIANTS[variant])
    model.eval()
    x = inputs(seed + 1, T=7)
    prompt_y, state = nnx.jit(lambda m, x, s: m(x, state=s))(model, x[:, :3], model.init_state(2))
    y_all, bank_all = nnx.jit(lambda m, x, s: m(x, state=s))(model, x, model.init_state(2))
    y, bank = decode_loop(model, x[:, 3:], state)
    assert state.is_deleted()  # donated: the bank is updated in place
    assert rel_err(y, y_all[:, 3:]) < 1e-5 and rel_err(bank, bank_all) < 1e-5
    # One step at a time, x_t [B, d_model].
    state = model.init_state(2)
    y_t, state = nnx.jit(lambda m, x, s: m.decode(x, s))(model, x[:, 0], state)
    assert y_t.shape == (2, D_MODEL) and rel_err(y_t, y_all[:, 0]) < 1e-5
    # The projection weights made beforehand (as decode_loop does, outside its scan): the same bits.
    y_w, state_w = nnx.jit(lambda m, x, s: m.decode(x, s, weights=m.projection_weights()))(
        model, x[:, 0], model.init_state(2))
    assert np.array_equal(np.asarray(y_w), np.asarray(y_t)) and np.array_equal(np.asarray(state_w), np.asarray(state))
    # The compiled loop aliases the state to the returned bank.
    graphdef, params = nnx.split(model)
    from jax_sdm.nn.layer import _decode_loop
    text = _decode_loop.lower(graphdef, params, x, model.init_state(2)).compile().as_text()
    assert "input_output_alias" in text
    with pytest.raises(ValueError, match="x_t"):
        model.decode(x, model.init_state(2))


FUSED_DECODE_VARIANTS = {
    **VARIANTS,
    "layer_norm_tanh_gelu": dict(readout_norm="layer", write_activation="tanh", read_activation="gelu"),
    "relu_silu_softplus": dict(write_activation="relu", read_activation="silu", output_gate=False,
                               readout_norm=None, gate="write"),
    "softplus_identity": dict(write_activation="softplus", read_activation="identity", use_bias=False),
}
NAMED_ACTIVATIONS = dict(jax_sdm.nn.layer.ACTIVATIONS)


@pytest.mark.skipif(not jax_sdm.lowering.is_registered("sdm_layer_decode_step", jax.default_backend()),
                    reason="no sdm_layer_decode_step kernel on this backend")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", sorted(FUSED_DECODE_VARIANTS))
def test_fused_decode_step_equals_separate_operations(variant, dtype):
    """The layer's decode step as one kernel call (named activations) against the same layer with the activations
    passed as callables, which runs the step's operations one by one (`sdm_step` and XLA's)."""
    seed = fresh_seed()
    kw = dict(FUSED_DECODE_VARIANTS[variant], dtype=jnp.dtype(dtype), chunk_size=None)
    callables = {name: NAMED_ACTIVATIONS[kw.get(name, "softmax")] for name in ("write_activation", "read_activation")}
    fused, separate = layer(seed, **kw), layer(seed, **{**kw, **callables})
    assert fused.fused_decode() and not separate.fused_decode()
    fused.eval(), separate.eval()
    x = inputs(seed + 1, B=3, T=1).astype(dtype)
    K = fused.slots_per_head
    state = (fused.init_state(3) + 0.3 * jax.random.normal(jax.random.key(seed + 2), (3, 2, K, 8))).astype(dtype)
    step = nnx.jit(lambda m, x, s: m.decode(x, s))
    y_f, bank_f = step(fused, x, state)
    y_s, bank_s = step(separate, x, state)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert rel_err(y_f, y_s) < tol and rel_err(bank_f, bank_s) < tol
    # Bitwise the same on a second call.
    y_again, bank_again = step(fused, x, state)
    assert np.array_equal(np.asarray(y_again), np.asarray(y_f))
    assert np.array_equal(np.asarray(bank_again), np.asarray(bank_f))


@pytest.mark.skipif(not jax_sdm.lowering.is_registered("sdm_layer_decode_step", jax.default_backend()),
                    reason="no sdm_layer_decode_step kernel on this backend")
def test_fused_decode_step_maps_parameter_groups_and_checks_its_arguments():
    """Under vmap every operand, the parameters too, gains a leading axis: the kernel takes each group's heads'
    parameters for that group's streams (the same bits as one call per group). Bad offsets and shapes fail."""
    from jax_sdm import ffi_ops
    rng = np.random.default_rng(fresh_seed())
    G, B, H, K, D, k, width = 2, 3, 2, 40, 8, 5, 30
    bank = jnp.asarray(0.1 * rng.standard_normal((G, B, H, K, D)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, K, (G, B, H, 2, k)), jnp.int32)
    scores = jnp.asarray(rng.standard_normal((G, B, H, 2, k)), jnp.float32)
    proj = jnp.asarray(rng.standard_normal((G, B, H, width)), jnp.float32)
    gates = jnp.asarray(np.stack([-np.exp(rng.standard_normal((G, H))), rng.standard_normal((G, H))], -1),
                        jnp.float32)
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal((G, 2, D)), jnp.float32)
    opts = dict(num_writes=4, num_reads=3, v_offset=2, b_offset=10, a_offset=11, og_offset=12,
                write_activation="softmax", read_activation="l2_normalize", per_write_gates=False,
                readout_norm="layer", write_scale=0.5, read_scale=2.0, norm_eps=1e-5)
    step = jax.jit(lambda *a: ffi_ops.layer_decode_step_ffi(*a, **opts))
    banks, outs = jax.vmap(step)(bank, ids, scores, proj, gates, norm)
    for g in range(G):
        bank_g, out_g = step(bank[g], ids[g], scores[g], proj[g], gates[g], norm[g])
        assert np.array_equal(np.asarray(banks[g]), np.asarray(bank_g))
        assert np.array_equal(np.asarray(outs[g]), np.asarray(out_g))
    assert not np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    args = (bank[0], ids[0], scores[0], proj[0], gates[0], norm[0])
    with pytest.raises(Exception, match="offsets of v, b, a and the output gate"):
        jax.block_until_ready(ffi_ops.layer_decode_step_ffi(*args, **{**opts, "og_offset": width - D + 1}))
    with pytest.raises(Exception, match="num_writes, num_reads <= k"):
        jax.block_until_ready(ffi_ops.layer_decode_step_ffi(*args, **{**opts, "num_writes": k + 1}))
    with pytest.raises(Exception, match="gates must be"):
        jax.block_until_ready(ffi_ops.layer_decode_step_ffi(*args[:4], jnp.zeros((4, 2)), norm[0], **opts))  # 4 heads
    with pytest.raises(TypeError, match=r"unknown options \['read_scael'\]"):
        ffi_ops.layer_decode_step_ffi(*args, **{**opts, "read_scael": 1.0})


@pytest.mark.skipif(not jax_sdm.lowering.is_registered("sdm_layer_decode_rank_step", jax.default_backend()),
                    reason="no sdm_layer_decode_rank_step kernel on this backend")
@pytest.mark.parametrize("factors", [(16, 12), (6, 5, 4)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_that_ranks_its_lists_equals_top_k_then_step(factors, dtype):
    """`sdm_layer_decode_rank_step` ranks each stream's address rows itself: the same bits as the product-key top-k
    of those rows followed by `sdm_layer_decode_step`, ties among the scores included."""
    from jax_sdm import ffi_ops
    from jax_sdm.product_key import candidate_table
    rng = np.random.default_rng(fresh_seed())
    B, H, D, W, R = 3, 2, 8, 5, 7
    K, aw, k = math.prod(factors), sum(factors), max(W, R)
    width = 2 * aw + D + 2 + D
    proj = np.where(rng.random((B, H, width)) < 0.3, 0.5, rng.standard_normal((B, H, width)))  # ties
    proj = jnp.asarray(proj, dtype)
    bank = jnp.asarray(0.1 * rng.standard_normal((B, H, K, D)), dtype)
    gates = jnp.asarray(np.stack([-np.exp(rng.standard_normal(H)), rng.standard_normal(H)], -1), jnp.float32)
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal((2, D)), jnp.float32)
    opts = dict(num_writes=W, num_reads=R, v_offset=2 * aw, b_offset=2 * aw + D, a_offset=2 * aw + D + 1,
                og_offset=2 * aw + D + 2, write_activation="softmax", read_activation="tanh", per_write_gates=True,
                readout_norm="rms", write_scale=0.8, read_scale=1.2, norm_eps=1e-6)
    addresses = jnp.stack([proj[..., :aw], proj[..., aw:2 * aw]], axis=2)  # [B, H, 2, aw]
    scores, ids = jax_sdm.product_key_topk(addresses, factors, k, impl="ffi")
    want = ffi_ops.layer_decode_step_ffi(bank, ids, scores, proj, gates, norm, **opts)
    rank = lambda **kw: ffi_ops.layer_decode_rank_step_ffi(
        bank, proj, candidate_table(factors, k), gates, norm, factors=factors, k=k, **{
            "write_rank_offset": 0, "read_rank_offset": aw, **opts, **kw})
    for a, b in zip(rank(), want):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(Exception, match="address row"):
        jax.block_until_ready(rank(read_rank_offset=width - aw + 1))


def test_decode_loop_unrolled_equals_one_call():
    seed = fresh_seed()
    model = layer(seed, **VARIANTS["product_key"])
    model.eval()
    x = inputs(seed + 1, T=7)  # 7 steps: unroll 3 leaves a remainder iteration
    y_all, bank_all = nnx.jit(lambda m, x, s: m(x, state=s))(model, x, model.init_state(2))
    y3, bank3 = decode_loop(model, x, model.init_state(2), unroll=3)
    # Up to rounding: the compiler may fuse an unrolled iteration's steps differently (on the GPU the outputs
    # differ from the rolled loop's in the last bits).
    assert rel_err(y3, y_all) < 1e-5 and rel_err(bank3, bank_all) < 1e-5
    y3_again, _ = decode_loop(model, x, model.init_state(2), unroll=3)
    assert np.array_equal(np.asarray(y3), np.asarray(y3_again))
    with pytest.raises(ValueError, match="unroll"):
        decode_loop(model, x, model.init_state(2), unroll=0)


def test_access_stats_match_numpy():
    seed = fresh_seed()
    model = layer(seed, gate="write")
    x = inputs(seed + 1)
    seg = jnp.array([[0] * 11, [0] * 6 + [-1] * 5], jnp.int32)
    stats = jax.jit(lambda x, seg: model.access_stats(x, seg))(x, seg)
    k_idx, _, _, beta, g, q_idx, _ = model.memory_inputs(x, seg)
    valid = np.asarray(seg >= 0)
    K = model.slots_per_head
    for name, idx in (("write", k_idx), ("read", q_idx)):
        for h in range(2):
            counts = np.bincount(np.asarray(idx)[..., h, :][valid].ravel(), minlength=K)
            p = counts / counts.sum()
            entropy = -np.sum(p[p > 0] * np.log(p[p > 0])) / np.log(K)
            assert stats[f"{name}_touched"][h] == pytest.approx(np.mean(counts > 0))
            assert stats[f"{name}_entropy"][h] == pytest.approx(entropy, rel=1e-5)
    for name, val in (("beta", beta), ("g", g)):
        for h in range(2):
            v = np.asarray(val)[:, :, h][valid]
            assert stats[f"{name}_mean"][h] == pytest.approx(v.mean(), rel=1e-5)
            assert stats[f"{name}_min"][h] == pytest.approx(v.min(), rel=1e-6)
    # Every slot used equally often: entropy 1; one slot: entropy 0.
    ids = jnp.tile(jnp.arange(36, dtype=jnp.int32).reshape(1, 12, 1, 3), (1, 1, 2, 1))
    fake = (ids, None, None, jnp.ones((1, 12, 2)), -jnp.ones((1, 12, 2)), jnp.zeros_like(ids), None)
    stats = memory_access_stats(fake, 36)
    np.testing.assert_allclose(stats["write_entropy"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats["read_entropy"], 0.0, atol=1e-7)
    np.testing.assert_allclose(stats["read_touched"], 1 / 36, rtol=1e-6)


@pytest.mark.parametrize("decay_bank", [True, False])
def test_weight_decay_mask_with_adamw(decay_bank):
    optax = pytest.importorskip("optax")
    seed = fresh_seed()
    model = layer(seed)
    flat = lambda m: {tuple(str(p.key) for p in path): np.asarray(v) for path, v in
                      jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(m, nnx.Param)))[0]}
    before = flat(model)
    tx = optax.adamw(1e-2, weight_decay=0.5, mask=weight_decay_mask(model, decay_bank=decay_bank))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))  # only decay moves
    kept = {("A_log",), ("dt_bias",)} | (set() if decay_bank else {("bank",)})
    for key, value in flat(model).items():
        old = before[key]
        if key in kept or not np.any(old):
            np.testing.assert_array_equal(value, old, err_msg=str(key))
        else:
            assert np.all(np.abs(value) <= np.abs(old)) and np.any(value != old), key


# -- the reference layer's checkpoints ----------------------------------------------------------------------

def reference_state_dict(rng, d=16, H=2, n=3, output_gate=True, layer_norm=True, batchnorm=True, memory=True):
    """A random state dict with the reference layer's names and shapes (torch Linear weights are [out, in])."""
    key_size, D = H * 2 * n, d // H
    lin = lambda out, inp: {"weight": rng.standard_normal((out, inp)).astype(np.float32) / np.sqrt(inp),
                            "bias": 0.1 * rng.standard_normal(out).astype(np.float32)}
    parts = {"Wq_read": lin(key_size, d), "Wk_write": lin(key_size, d), "Wv_write": lin(d, d), "a_proj": lin(H, d),
             "b_proj": lin(H, d), "Wo": lin(d, d)}
    if output_gate:
        parts["Wog"] = lin(d, d)
    state = {f"{m}.{p}": v for m, ps in parts.items() for p, v in ps.items()}
    state["A_log"] = np.log(rng.uniform(1, 8, H)).astype(np.float32)
    state["dt_bias"] = rng.uniform(-3, 0, H).astype(np.float32)
    if memory:
        state["memory"] = (0.3 * rng.standard_normal((H * n * n, D))).astype(np.float32)
    if layer_norm:
        state["readings_norm.weight"] = rng.uniform(0.5, 1.5, D).astype(np.float32)
        state["readings_norm.bias"] = 0.1 * rng.standard_normal(D).astype(np.float32)
    if batchnorm:
        for bn in ("query_bn", "key_bn"):
            state[f"{bn}.weight"] = rng.uniform(0.5, 1.5, key_size).astype(np.float32)
            state[f"{bn}.bias"] = 0.1 * rng.standard_normal(key_size).astype(np.float32)
            state[f"{bn}.running_mean"] = 0.2 * rng.standard_normal(key_size).astype(np.float32)
            state[f"{bn}.running_var"] = rng.uniform(0.5, 2, key_size).astype(np.float32)
            state[f"{bn}.num_batches_tracked"] = np.array(7)
    return state


def reference_forward(sd, x, W, R, H, n, key_weighted_decay=False, eps=1e-6):
    """The reference layer's computation (its eval mode) in numpy, with the token loop for the memory."""
    x = np.asarray(x, np.float64)
    B, T, d = x.shape
    D = d // H
    lin = lambda name: x @ sd[f"{name}.weight"].T.astype(np.float64) + sd[f"{name}.bias"]
    bn = lambda z, name: ((z - sd[f"{name}.running_mean"]) / np.sqrt(sd[f"{name}.running_var"] + 1e-5)
                          * sd[f"{name}.weight"] + sd[f"{name}.bias"]) if f"{name}.weight" in sd else z

    def keys(raw, k):
        raw = raw.reshape(B, T, H, 2 * n)
        full = (raw[..., :n, None] + raw[..., None, n:]).reshape(B, T, H, n * n)
        idx = np.argsort(-full, axis=-1, kind="stable")[..., :k]
        val = np.take_along_axis(full, idx, axis=-1)
        w = np.exp(val - val.max(-1, keepdims=True))
        return idx.astype(np.int32), w / w.sum(-1, keepdims=True)

    k_idx, k_val = keys(bn(lin("Wk_write"), "key_bn"), W)
    q_idx, q_val = keys(bn(lin("Wq_read"), "query_bn"), R)
    v = lin("Wv_write").reshape(B, T, H, D)
    softplus = lambda z: np.log1p(np.exp(z))
    g = -np.exp(sd["A_log"].astype(np.float64)) * softplus(lin("a_proj") + sd["dt_bias"])
    beta = 1 / (1 + np.exp(-lin("b_proj")))
    if key_weighted_decay:
        g = g[..., None] * k_val
    bank = (sd["memory"].reshape(H, n * n, D) if "memory" in sd else np.zeros((H, n * n, D)))
    y, final = jax_sdm.sdm_reference(*(jnp.asarray(a, jnp.int32 if a.dtype == np.int32 else jnp.float32)
                                       for a in (bank, k_idx, k_val, v, beta, g, q_idx, q_val)))
    y = np.asarray(y)
    if "readings_norm.weight" in sd:
        mu, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
        y = (y - mu) / np.sqrt(var + eps) * sd["readings_norm.weight"] + sd["readings_norm.bias"]
    y = y.reshape(B, T, d)
    if "Wog.weight" in sd:
        y = y / (1 + np.exp(-lin("Wog"))) * 1.0
    return y @ sd["Wo.weight"].T + sd["Wo.bias"], np.asarray(final)


@pytest.mark.parametrize("parts", [dict(), dict(output_gate=False, layer_norm=False, batchnorm=False, memory=False)])
@pytest.mark.parametrize("key_weighted_decay", [False, True])
def test_load_reference_state_dict_computes_the_reference_layer(parts, key_weighted_decay):
    rng = np.random.default_rng(fresh_seed())
    sd = reference_state_dict(rng, **parts)
    args = dict(num_writes=3, num_reads=2, key_weighted_decay=key_weighted_decay)
    model = load_reference_state_dict(sd, args, chunk_size=4)
    model.eval()
    assert (model.num_heads, model.slots_per_head, model.head_dim, model.factors) == (2, 9, 8, (3, 3))
    # Every parameter where it belongs: the projections against numpy matmuls with the state dict's matrices.
    x = rng.standard_normal((2, 10, 16)).astype(np.float32)
    names = ["Wk_write", "Wq_read", "Wv_write", "b_proj", "a_proj"] + (["Wog"] if "Wog.weight" in sd else [])
    for part, name in zip(model.project(jnp.asarray(x)), names):
        np.testing.assert_allclose(part.reshape(2, 10, -1), x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"],
                                   rtol=1e-5, atol=1e-5)
    y, final = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x))
    want_y, want_final = reference_forward(sd, x, 3, 2, 2, 3, key_weighted_decay)
    assert rel_err(y, want_y) < 1e-5 and rel_err(final, want_final) < 1e-5
    # A torch-like tensor (duck typed) and a model-level prefix.
    class Tensor:
        def __init__(self, a):
            self.a = a

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.a

    prefixed = {f"layers.1.sdm.{k}": Tensor(v) for k, v in sd.items()} | {"layers.0.w": np.zeros(3)}
    again = load_reference_state_dict(prefixed, args, prefix="layers.1.sdm.", chunk_size=4)
    again.eval()
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(again, jnp.asarray(x))[0], y)


def test_load_reference_state_dict_rejects_bad_dicts():
    rng = np.random.default_rng(fresh_seed())
    sd = reference_state_dict(rng)
    with pytest.raises(KeyError, match="Wo.bias"):
        load_reference_state_dict({k: v for k, v in sd.items() if k != "Wo.bias"})
    with pytest.raises(KeyError, match="Wv_write.weight"):
        load_reference_state_dict({k: v for k, v in sd.items() if k != "Wv_write.weight"})
    with pytest.raises(KeyError, match="key_bn.running_var"):
        load_reference_state_dict({k: v for k, v in sd.items() if k != "key_bn.running_var"})
    with pytest.raises(KeyError, match="Wfoo.weight"):
        load_reference_state_dict(sd | {"Wfoo.weight": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="memory"):
        load_reference_state_dict(sd | {"memory": np.zeros((5, 8), np.float32)})
    with pytest.raises(ValueError, match="Wq_read.weight"):
        load_reference_state_dict(sd | {"Wq_read.weight": np.zeros((12, 15), np.float32)})
    with pytest.raises(ValueError, match="Mish"):
        load_reference_state_dict(sd, dict(read_act="Mish"))
    with pytest.raises(ValueError, match="slots_per_head"):
        load_reference_state_dict(sd, slots_per_head=4)


def test_check_reference_layer_script_skips_without_torch():
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "check_reference_layer.py"
    code = (f"import sys; sys.modules['torch'] = None; sys.argv = ['x']; import runpy; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "skipped" in out.stdout, out.stdout


# -- the associative-recall helpers (notebooks/03_training.ipynb, examples/) --------------------------------

def test_recall_task_batches_ask_what_was_listed():
    from jax_sdm.nn.recall import RecallTask

    task = RecallTask(num_keys=10, num_values=5, num_pairs=6, num_queries=4)
    tokens, targets, mask = task.batch(np.random.default_rng(fresh_seed()), 32)
    assert tokens.shape == targets.shape == mask.shape == (32, task.seq_len) and task.seq_len == 20
    np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
    for row, row_mask in zip(tokens, mask):
        keys, values = row[:12:2], row[1:12:2]
        assert len(set(keys)) == 6 and np.all(keys < 10) and np.all((values >= 10) & (values < 15))
        pairs = dict(zip(keys, values))
        queries, answers = row[12::2], row[13::2]
        assert len(set(queries)) == 4 and all(pairs[q] == a for q, a in zip(queries, answers))
        assert np.array_equal(np.nonzero(row_mask)[0], np.arange(12, 20, 2))
    with pytest.raises(ValueError, match="num_queries"):
        RecallTask(num_pairs=4, num_queries=5)
