"""examples/train_recall.py and examples/decode.py: their options, and checkpoints that carry the model's options."""
import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
from flax import nnx  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# A task and model small enough to train a few steps quickly.
SMALL = ["--pairs", "3", "--queries", "2", "--keys", "6", "--values", "5", "--slots", "16", "--eval-batch", "8"]


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import decode
    import train_recall

    return train_recall, decode


def test_help_shows_every_default(examples):
    for module in examples:
        p = module.parser()
        text = p.format_help()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if action.default is None:  # its help says what leaving it out means
                assert "default: " in action.help, (module.__name__, action.dest)
            else:
                assert f"(default: {action.default})" in " ".join(text.split()), (module.__name__, action.dest)


def test_decode_reads_every_option_it_lists(examples):
    """decode.py offers no training-log, target or save options: it does not train to a target or save."""
    _, decode = examples
    options = {s for a in decode.parser()._actions for s in a.option_strings}
    assert not options & {"--save", "--log-every", "--target"}
    assert {"--checkpoint", "--slots", "--steps", "--impl"} <= options


def test_checkpoint_restores_the_parameters(examples, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    train_recall, _ = examples
    args = train_recall.parser().parse_args(SMALL + ["--seed", "3"])
    _, model = train_recall.task_and_model(args)
    train_recall.save_checkpoint(tmp_path / "ckpt", model, args)
    stored = train_recall.checkpoint_options(tmp_path / "ckpt")
    assert stored == dict(pairs=3, queries=2, keys=6, values=5, slots=16, addressing="product_key")

    other = train_recall.parser().parse_args(SMALL + ["--seed", "4"])  # other initial parameters
    _, restored = train_recall.task_and_model(other)
    want, before = nnx.state(model, nnx.Param), nnx.state(restored, nnx.Param)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(before)))
    train_recall.load_parameters(tmp_path / "ckpt", restored)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(nnx.state(restored, nnx.Param))):
        np.testing.assert_array_equal(a, b)

    # A model of another shape: a one-line error naming the parameter, before Orbax sees it.
    big = train_recall.parser().parse_args(SMALL + ["--slots", "64"])
    _, wrong = train_recall.task_and_model(big)
    with pytest.raises(ValueError, match=r"^the checkpoint .* does not fit this model: parameter memory\.\S+ is "
                                         r"float32\[.*64.*\] here, float32\[.*16.*\] there$"):
        train_recall.load_parameters(tmp_path / "ckpt", wrong)


def test_resolve_options(examples):
    train_recall, decode = examples
    stored = dict(pairs=3, queries=2, keys=6, values=5, slots=16, addressing="topk")
    args = decode.parser().parse_args(["--checkpoint", "x", "--pairs", "5"])
    train_recall.resolve_options(args, stored, "x")  # the task's lengths may change; the rest comes from "x"
    assert (args.pairs, args.queries, args.keys, args.values, args.slots, args.addressing) == (5, 2, 6, 5, 16, "topk")
    args = decode.parser().parse_args(["--checkpoint", "x", "--slots", "256", "--keys", "6", "--addressing",
                                       "product_key"])
    with pytest.raises(ValueError) as info:
        train_recall.resolve_options(args, stored, "x")
    assert str(info.value) == ("the checkpoint x holds a model with --slots 16 --addressing topk, not --slots 256 "
                               "--addressing product_key (leave the model options out to take the checkpoint's)")


def test_train_save_load_and_decode(examples, tmp_path, capsys):
    """train_recall.py trains a few steps and saves; decode.py takes the model options from the checkpoint, and
    refuses in one line a model option that disagrees with it, or a directory that is no checkpoint."""
    pytest.importorskip("orbax.checkpoint")
    train_recall, decode = examples
    ckpt = str(tmp_path / "ckpt")
    assert train_recall.main(SMALL + ["--steps", "3", "--log-every", "1", "--target", "0", "--save", ckpt]) == 0
    out = capsys.readouterr().out
    assert "step     3/3" in out and "final accuracy" in out and "saved" in out
    assert json.loads((tmp_path / "ckpt" / "options.json").read_text())["options"]["slots"] == 16

    assert decode.main(["--checkpoint", ckpt, "--show", "1", "--eval-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "loaded" in out and "decode accuracy" in out and "ms per step" in out

    with pytest.raises(SystemExit) as info:
        decode.main(["--checkpoint", ckpt, "--slots", "256"])
    assert info.value.code == (f"decode.py: the checkpoint {ckpt} holds a model with --slots 16, not --slots 256 "
                               "(leave the model options out to take the checkpoint's)")
    with pytest.raises(SystemExit) as info:
        decode.main(["--checkpoint", str(tmp_path)])
    assert info.value.code == (f"decode.py: {tmp_path} is not a checkpoint of examples/train_recall.py --save "
                               "(no options.json)")
