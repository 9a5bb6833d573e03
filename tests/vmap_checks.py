"""Checks that a vmapped kernel wrapper stays one FFI call (vmap_method="broadcast_all")."""

import jax


def primitive_names(closed_jaxpr):
    """Every primitive of a jaxpr, sub-jaxprs included."""
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.append(eqn.primitive.name)
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(closed_jaxpr.jaxpr)
    return names


def assert_one_kernel_call(fn, *args):
    """`fn(*args)` traces to exactly one ffi_call and no loop, and lowers to one custom call."""
    names = primitive_names(jax.make_jaxpr(fn)(*args))
    assert names.count("ffi_call") == 1, names
    assert not {"while", "scan", "map"} & set(names), names
    hlo = jax.jit(fn).lower(*args).as_text()
    assert hlo.count("stablehlo.custom_call") == 1, hlo
    assert "stablehlo.while" not in hlo, hlo
