"""Shared helpers of the test suite: golden files, oracles (the token loop, in float64 too), gradients through
`jax.vjp`, jaxpr and HLO inspection, gates at the domain's edge, and the loading of benchmark scripts. Test modules
import it as `.helpers` (tests/ is a package); a script run from tests/ (sanitize_case.py) or a test's subprocess
with tests/ on PYTHONPATH imports it as `helpers`. Random problems come from `jax_sdm.testing.random_problem`."""
import importlib.util
import pathlib
import sys

import numpy as np

from jax_sdm.testing import random_problem

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parent


def golden_problem(npz):
    """Convert a golden file of the reference package (`tests/data/golden_*.npz`) to `sdm_write_read` layout.

    Returns `(args, expected)`: the op's arguments (`B = P` streams, `H = 1`) and a dict with `y`, `final_bank`,
    `dy` (the cotangent applied to `y`) and the gradients `grad_<argument>` in the same layout.
    """
    d = {k: np.asarray(v) for k, v in dict(npz).items()}
    P, T, W = d["k_idx"].shape
    S = d["memory"].shape[0] // P
    D = d["memory"].shape[1]
    offset = (np.arange(P) * S)[:, None, None]  # golden ids are global bank rows
    head = lambda a: a[:, :, None]  # [P, T, ...] -> [B=P, T, H=1, ...]
    gate = lambda a: a[..., 0] if a.shape[-1] == 1 else a
    args = dict(
        bank=d["memory"].reshape(P, 1, S, D), k_idx=head(d["k_idx"] - offset).astype(np.int32),
        k_val=head(d["k_val"]), v=head(d["v"]), beta=head(d["beta"][..., 0]), g=head(gate(d["g"])),
        q_idx=head(d["q_idx"] - offset).astype(np.int32), q_val=head(d["q_val"]))
    expected = dict(
        y=d["out"].reshape(P, T, 1, D), final_bank=d["final_bank"].reshape(P, 1, S, D), dy=head(d["dout"]),
        grad_bank=d["grad_memory"].reshape(P, 1, S, D), grad_k_val=head(d["grad_k_val"]),
        grad_v=head(d["grad_v"]), grad_beta=head(d["grad_beta"][..., 0]), grad_g=head(gate(d["grad_g"])),
        grad_q_val=head(d["grad_q_val"]))
    return args, expected


def rel_err(a, b):
    """Relative L2 error of `a` against `b`, in float64."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


FLOAT_ARGS = ("bank", "k_val", "v", "beta", "g", "q_val")


def outputs_and_grads(op, args, dy, dbank=None, **kw):
    """`(y, final_bank, grads)` of `op(**args, **kw)` with the cotangents `dy` and `dbank` (zeros if None).

    `grads` maps each float argument (`FLOAT_ARGS`) to its gradient, through `jax.vjp` of the jitted op.
    """
    import jax
    import jax.numpy as jnp

    floats = {k: jnp.asarray(args[k]) for k in FLOAT_ARGS}
    rest = {k: v for k, v in args.items() if k not in FLOAT_ARGS}
    (y, final), vjp = jax.vjp(jax.jit(lambda f: op(**f, **rest, **kw)), floats)
    dbank = jnp.zeros_like(final) if dbank is None else jnp.asarray(dbank, final.dtype)
    (grads,) = vjp((jnp.asarray(dy, y.dtype), dbank))
    return y, final, grads


def token_loop64(args, dy, dbank):
    """`(y, final_bank, grads)` of the token loop in float64 (`outputs_and_grads` of `sdm_write_read` with
    `impl="reference"` under x64), as NumPy arrays: the oracle for float32 results."""
    import jax

    from jax_sdm import sdm_write_read

    with jax.enable_x64(True):
        a64 = {k: (np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v) for k, v in args.items()}
        y, final, grads = outputs_and_grads(sdm_write_read, a64, dy, dbank, impl="reference")
        return np.asarray(y), np.asarray(final), {k: np.asarray(v) for k, v in grads.items()}


def out_of_range_case(seed, K=16):
    """A problem with out-of-range slot ids, and its twin where those lanes point at an extra zero row with zero
    weights instead: the twin's row K stays zero, so both must agree on `y` and on the first K rows."""
    p = random_problem(seed, T=12, K=K, D=4, W=3, R=3, distinct=False, repeats=True)
    bad = dict(p, k_idx=p["k_idx"].copy(), q_idx=p["q_idx"].copy())
    bad["k_idx"][:, ::3, :, 1] = K  # one past the end
    bad["k_idx"][:, 1::3, :, 2] = -1
    bad["q_idx"][:, ::2, :, 0] = 99
    k_out = (bad["k_idx"] < 0) | (bad["k_idx"] >= K)
    q_out = (bad["q_idx"] < 0) | (bad["q_idx"] >= K)
    twin = dict(p, bank=np.concatenate([p["bank"], np.zeros_like(p["bank"][..., :1, :])], axis=-2),
                k_idx=np.where(k_out, K, bad["k_idx"]), k_val=np.where(k_out, 0, p["k_val"]).astype(np.float32),
                q_idx=np.where(q_out, K, bad["q_idx"]), q_val=np.where(q_out, 0, p["q_val"]).astype(np.float32))
    return bad, twin


def cotangents(seed, args):
    """Random cotangents `(dy, dbank)` for a problem."""
    rng = np.random.default_rng(seed + 1000)
    B, T, H, _ = args["k_idx"].shape
    D = args["v"].shape[-1]
    K = args["bank"].shape[-2]
    return rng.standard_normal((B, T, H, D)), rng.standard_normal((B, H, K, D))


def check_against_reference(op, args, chunk_size, tol, seed=0):
    """Assert `op` matches the token loop on outputs and every gradient, to relative L2 error `tol`."""
    from jax_sdm import sdm_reference

    dy, dbank = cotangents(seed, args)
    y, final, g = outputs_and_grads(op, args, dy, dbank, chunk_size=chunk_size)
    y_ref, final_ref, g_ref = outputs_and_grads(sdm_reference, args, dy, dbank)
    assert y.dtype == args["bank"].dtype and final.dtype == args["bank"].dtype
    assert rel_err(y, y_ref) < tol, rel_err(y, y_ref)
    assert rel_err(final, final_ref) < tol, rel_err(final, final_ref)
    for k in FLOAT_ARGS:
        assert g[k].shape == np.shape(args[k]), k
        assert rel_err(g[k], g_ref[k]) < tol, (k, rel_err(g[k], g_ref[k]))


def equations(jaxpr):
    """Every equation of a (closed) jaxpr, those of its sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found += equations(sub)
    return found


def ffi_calls(jaxpr, target):
    """The equations of `jaxpr` that call FFI target `target`."""
    return [e for e in equations(jaxpr) if e.params.get("target_name") == target]


def assert_one_kernel_call(fn, *args):
    """`fn(*args)` traces to exactly one ffi_call and no loop, and lowers to one custom call (vmap folds the
    mapped axis into the kernel's batch instead of looping)."""
    import jax

    names = [e.primitive.name for e in equations(jax.make_jaxpr(fn)(*args))]
    assert names.count("ffi_call") == 1, names
    assert not {"while", "scan", "map"} & set(names), names
    hlo = jax.jit(fn).lower(*args).as_text()
    assert hlo.count("stablehlo.custom_call") == 1, hlo
    assert "stablehlo.while" not in hlo, hlo


EXTREME_GATES = (-np.inf, -3e38, -1e30, -1e10)


def extreme_gates(rng, g, fraction=0.15):
    """`g` with a random `fraction` of its entries replaced by gates at the edge of the domain: -inf (a hard
    reset), -3e38 (two of them overflow to -inf), -1e30 and -1e10 (far beyond float32's digits of the others)."""
    g = np.array(g)
    hit = rng.random(g.shape) < fraction
    g[hit] = rng.choice(np.array(EXTREME_GATES, g.dtype), size=int(hit.sum()))
    return g


def phase1_gates(rng, N, C, W, gate="lane"):
    """Phase 1's gates `x [N, C, W]` float32: "lane" (-softplus of a normal per lane), "token" (one per token,
    repeated over the lanes), "any" (small values of either sign: Phase 1 computes any finite gate as written) or
    "extreme" ("lane" with some gates of -inf, -3e38, -1e30, -1e10)."""
    if gate == "extreme":
        return extreme_gates(rng, phase1_gates(rng, N, C, W, "lane"))
    if gate == "lane":
        x = -np.logaddexp(0.0, rng.standard_normal((N, C, W)))
    elif gate == "token":
        x = np.repeat(-np.logaddexp(0.0, rng.standard_normal((N, C, 1))), W, axis=2)
    elif gate == "any":
        x = 0.3 * rng.standard_normal((N, C, W))
    else:
        raise ValueError(f"unknown gate kind {gate!r}")
    return x.astype(np.float32)


def entry_ops_of_shape(hlo, shape):
    """The ops (`copy`, `custom-call`, ...) of a compiled module's entry computation (`.compile().as_text()`) whose
    result has `shape`, whatever its dtype: the buffers of that shape it materialises. Ops inside fusions are not
    listed (an elementwise op over a whole array that feeds a gather in a fusion runs for the gathered elements
    only)."""
    import re

    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    dims = re.escape("[" + ",".join(map(str, shape)) + "]")
    return re.findall(rf"= [a-z0-9]+{dims}\S* ([\w-]+)\(", entry)


def kernel_layout(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The kernels' arguments in kernel layout as `kernel_path.Inputs` (no packed sequences): bank `[P, K, D]` and
    per-token arrays `[NC, P, C, ...]` (`layout.kernel_tokens`)."""
    from jax_sdm import kernel_path, layout

    bank = layout.batch_banks(bank, dims).reshape(dims.P, dims.K, dims.D)
    return kernel_path.Inputs(bank, *layout.kernel_tokens(k_idx, k_val, g, v, beta, q_idx, q_val, dims), None)


def stored_groups(w_group):
    """Which entries of the forward's snapshot hold a row, from Phase 1's `w_group` `[..., NC, P, C*W + 1]`: the
    write groups of every chunk but the last (`[..., NC - 1, P, C*W]`; entries past a unit's group count are never
    written or read, so they hold whatever the buffer held)."""
    group = np.asarray(w_group)
    return (group[..., 1:] > group[..., :-1])[..., :-1, :, :]


def product_key_brute_force(x, factors, k):
    """`product_key_topk`'s slot ids `[..., k]` the slow way, for tests: every slot scored (numpy, float32 sums in
    factor order) and all of them sorted by (score desc with NaN last, rank tuple lexicographic), the order that
    `product_key_topk` documents."""
    x = np.asarray(np.asarray(x, np.float32))
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    offsets = np.cumsum((0,) + tuple(factors))
    out = np.empty((rows.shape[0], k), np.int32)
    for r, row in enumerate(rows):
        grid, rank_key = None, np.zeros((), np.int64)
        for f, n in enumerate(factors):
            s = row[offsets[f]:offsets[f + 1]]
            rank = np.empty(n, np.int64)
            rank[np.argsort(-s, kind="stable")] = np.arange(n)  # numpy sorts NaN last and -0 with +0
            grid = s if grid is None else np.add.outer(grid, s).astype(np.float32)
            rank_key = np.add.outer(rank_key * n, rank)
        out[r] = np.lexsort((rank_key.ravel(), -grid.ravel()))[:k]
    return out.reshape(lead + (k,))


def product_key_slot_scores(x, factors, ids):
    """Differentiable: the scores of slots `ids` from the full grid of sums (broadcast in factor order), a NaN as
    the one quiet NaN that `product_key_topk` writes (a GPU add makes other NaN bits than a CPU add)."""
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    offsets = np.cumsum((0,) + tuple(factors))
    grid = None
    for f in range(len(factors)):
        s = x[..., offsets[f]:offsets[f + 1]]
        s = s.reshape(s.shape[:-1] + (1,) * f + (factors[f],))
        grid = s if grid is None else grid[..., None] + s
    grid = grid.reshape(x.shape[:-1] + (-1,))
    picked = jnp.take_along_axis(grid, jnp.asarray(ids), axis=-1)
    return jnp.where(jnp.isnan(picked), jnp.float32(np.nan), picked)


def product_key_scores(seed, lead, factors, kind="normal", dtype=None):
    """Factor scores `[*lead, sum(factors)]` (default float32): standard normal, or with ties: "ints" (small integers:
    exact ties within a factor and between slots), "equal", "special" (NaN, -inf, signed zeros, repeated values),
    "infinities" (both infinities, NaN, signed zeros: some slots' sums are +inf + -inf)."""
    import jax.numpy as jnp

    dtype = jnp.float32 if dtype is None else dtype
    rng = np.random.default_rng(seed)
    shape = tuple(lead) + (sum(factors),)
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "ints":
        x = rng.integers(-2, 3, shape)
    elif kind == "equal":
        x = np.full(shape, 0.75)
    elif kind == "special":
        x = rng.choice(np.array([np.nan, -np.inf, -0.0, 0.0, 1.0, -1.0, 2.5]), shape)
    elif kind == "infinities":
        x = rng.choice(np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 1.0, -1.0, 0.5]), shape)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return jnp.asarray(x, dtype)


# Runs the test module tests/<name>.py as __main__ inside the package `tests` (so that its relative imports work)
# without putting the repository on sys.path (which would shadow the installed jax_sdm with the source tree's).
_RUN_TEST_MODULE = """
import importlib.util, runpy, sys
spec = importlib.util.spec_from_file_location("tests", {init!r}, submodule_search_locations=[{tests!r}])
package = importlib.util.module_from_spec(spec)
sys.modules["tests"] = package
spec.loader.exec_module(package)
runpy.run_module("tests.{name}", run_name="__main__", alter_sys=True)
"""


def run_on_host_devices(script, n_devices, timeout):
    """Run the test module `script` (its `__file__`) as `__main__` in a fresh process whose CPU backend has
    `n_devices` devices (XLA's host-platform device count is fixed when jax starts, so a test needing several
    devices runs its body there); return the JSON object on the last line of its output."""
    import json
    import os
    import subprocess

    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    code = _RUN_TEST_MODULE.format(init=str(TESTS / "__init__.py"), tests=str(TESTS), name=pathlib.Path(script).stem)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_benchmark(name):
    """The script benchmarks/<name>.py as a module: benchmarks/ is on sys.path while it loads, as when the script
    runs (its own folder first), so that it imports the other benchmark scripts."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)
