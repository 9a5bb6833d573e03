"""The Flax NNX layer `jax_sdm.nn.SparseDeltaMemory` and its addressing (`jax_sdm.nn.addressing`)."""
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import jax_sdm  # noqa: E402
from jax_sdm.nn import SparseDeltaMemory, balanced_factors, product_key_slots, topk_slots  # noqa: E402

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
    k = data.draw(st.integers(1, total))
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


def test_product_key_gradient_reaches_selected_scores_only():
    seed = fresh_seed()
    keys = jax.random.split(jax.random.key(seed), 3)
    factor_scores = [jax.random.normal(keys[0], (4, 6)), jax.random.normal(keys[1], (4, 5))]
    weights = jax.random.normal(keys[2], (4, 7))
    total = 30

    def pruned(fs):
        return jnp.sum(weights * product_key_slots(fs, 7)[0])

    def brute(fs):
        full = (fs[0][:, :, None] + fs[1][:, None, :]).reshape(4, total)
        return jnp.sum(weights * jax.lax.top_k(full, 7)[0])

    got, want = jax.grad(pruned)(factor_scores), jax.grad(brute)(factor_scores)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    # A factor entry in no selected slot gets no gradient.
    _, ids = product_key_slots(factor_scores, 7)
    used_first = np.zeros((4, 6), bool)
    np.put_along_axis(used_first, np.asarray(ids) // 5, True, axis=1)
    assert np.all(np.asarray(got[0])[~used_first] == 0) and np.all(np.asarray(got[0])[used_first] != 0)


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
    "zeros_bank_plain": dict(initial_bank="zeros", output_gate=False, readout_norm=False, softmax_weights=False,
                             score_scale=0.3),
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
    if kw.get("softmax_weights", True):
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
    model = layer(seed, addressing="topk", slots_per_head=64)
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
    # A fixed seed: in bfloat16 two close slot scores can swap places in the top-k, and then the readings differ by
    # far more than rounding; this draw has no such near tie.
    seed = 0
    x = inputs(seed + 1)
    call = nnx.jit(lambda m, x: m(x))
    y32, _ = call(layer(seed), x)
    y16, bank16 = call(layer(seed, dtype=jnp.bfloat16), x)
    assert y16.dtype == jnp.bfloat16 and bank16.dtype == jnp.bfloat16
    assert rel_err(y16, y32) < 5e-2


@pytest.mark.parametrize("kw,error,match", [
    (dict(addressing="hash"), ValueError, "addressing"),
    (dict(gate="slot"), ValueError, "gate"),
    (dict(initial_bank="random"), ValueError, "initial_bank"),
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(num_writes=40), ValueError, "num_writes"),
    (dict(num_factors=1), ValueError, "num_factors"),
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
