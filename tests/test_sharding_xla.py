"""impl="xla" on inputs sharded along batch and/or heads keeps every stream on its device: no collective in the
compiled forward or gradient, results equal to the unsharded ones, outputs sharded like the inputs.

Run in a subprocess (this file as a script) on 4 CPU devices, which must be set before JAX starts; the script
prints one JSON line that the tests assert on.
"""
import json

import pytest

from .helpers import run_on_host_devices

N_DEVICES = 4
FLOATS = ("bank", "k_val", "v", "beta", "g", "q_val")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
# name: (mesh shape, mesh axes, spec of the tokens [B, T, H, ...], spec of the bank [B, H, K, D])
# (Each case compiles the xla path's forward and gradient for 4 devices: tens of seconds on a 2-core machine.)
CASES = {
    "(B, H) over 2x2": ((2, 2), ("b", "h"), ("b", None, "h"), ("b", "h")),
    "H over 4": ((4,), ("h",), (None, None, "h"), (None, "h")),
}


def _run_checks():
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jax_sdm import sdm_write_read
    from jax_sdm.testing import random_problem

    assert len(jax.devices()) == N_DEVICES, jax.devices()

    def loss(floats, ints):
        y, final = sdm_write_read(**floats, **ints, impl="xla", chunk_size=4)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(final * final)

    fwd = jax.jit(lambda a: sdm_write_read(**a, impl="xla", chunk_size=4))
    grad = jax.jit(jax.grad(loss))
    args = random_problem(3, B=4, T=10, H=4, K=8, D=4, W=3, R=2, distinct=False, per_write_gates=True)
    floats = {k: args[k] for k in FLOATS}
    ints = {k: v for k, v in args.items() if k not in FLOATS}
    want_y, want_final = fwd(args)
    want_g = grad(floats, ints)

    results = {}
    for name, (mesh_shape, axes, token_spec, bank_spec) in CASES.items():
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), axes)
        tokens, bank = NamedSharding(mesh, PartitionSpec(*token_spec)), NamedSharding(mesh, PartitionSpec(*bank_spec))
        put = lambda k, v: jax.device_put(v, bank if k == "bank" else tokens)
        s_args = {k: put(k, v) for k, v in args.items()}
        s_floats, s_ints = {k: s_args[k] for k in FLOATS}, {k: s_args[k] for k in ints}
        f, g = fwd.lower(s_args).compile(), grad.lower(s_floats, s_ints).compile()
        y, final = f(s_args)
        grads = g(s_floats, s_ints)
        found = lambda hlo: sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo)})
        same = lambda a, s: bool(a.sharding.is_equivalent_to(s, a.ndim))
        close = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
        results[name] = dict(
            fwd_collectives=found(f.as_text()), grad_collectives=found(g.as_text()),
            y_like_tokens=same(y, tokens), final_like_bank=same(final, bank),
            max_diff=max([close(y, want_y), close(final, want_final)] + [close(grads[k], want_g[k]) for k in FLOATS]))
    print(json.dumps(results))


@pytest.fixture(scope="module")
def report():
    return run_on_host_devices(__file__, N_DEVICES, timeout=1200)


@pytest.mark.slow  # one subprocess compiles every case (about 2 minutes); test_sharding.py covers the kernel path
@pytest.mark.parametrize("case", list(CASES))
def test_xla_streams_stay_on_their_devices(report, case):
    r = report[case]
    assert r["fwd_collectives"] == [] and r["grad_collectives"] == [], r
    assert r["y_like_tokens"] and r["final_like_bank"], r
    assert r["max_diff"] <= 1e-6, r


if __name__ == "__main__":
    _run_checks()
