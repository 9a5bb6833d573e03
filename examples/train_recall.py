"""Train a small model with the SDM layer on associative recall, from the command line.

    python examples/train_recall.py [--steps 300] [--impl auto] [--save DIR]

Prints the loss and accuracy as it trains, then the accuracy on fresh sequences, both for whole-sequence calls
and for prefill + token-by-token decoding. `--save DIR` writes the trained parameters with Orbax, with the model's
options beside them (`DIR/options.json`), so that `examples/decode.py --checkpoint DIR` rebuilds the same model.
Needs the `nn` extra (`pip install "jax_sdm[nn]"`), and orbax-checkpoint for `--save`. The task, model and
training loop are `jax_sdm.nn.recall`, which `notebooks/03_training.ipynb` uses too.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import jax_sdm
from jax_sdm.nn import recall

# The options that build the task and the model: a checkpoint stores them. The model's own (its vocabulary and
# memory) must match the checkpoint's to load it; the task's lengths may change (a longer prompt, say).
MODEL_OPTIONS = {"keys": 16, "values": 16, "slots": 64, "addressing": "product_key"}
TASK_OPTIONS = {"pairs": 8, "queries": 8}
OPTIONS_FILE = "options.json"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default; an option whose default is None says in its help what it means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_model_options(p, from_checkpoint=False):
    """The task and model options; with `from_checkpoint` they default to None (decode.py: the checkpoint's)."""
    for name, kind, help in (("pairs", int, "key-value pairs per sequence"),
                             ("queries", int, "keys asked again per sequence"),
                             ("keys", int, "distinct key tokens"),
                             ("values", int, "distinct value tokens"),
                             ("slots", int, "memory slots per head"),
                             ("addressing", ("product_key", "topk"), "how a token finds its slots")):
        default = {**MODEL_OPTIONS, **TASK_OPTIONS}[name]
        typed = dict(choices=kind) if isinstance(kind, tuple) else dict(type=kind)
        if from_checkpoint:
            p.add_argument(f"--{name}", default=None, help=f"{help} (default: the checkpoint's, else {default})",
                           **typed)
        else:
            p.add_argument(f"--{name}", default=default, help=help, **typed)


def add_run_options(p, steps, steps_help="training steps"):
    """The options of a training run and of evaluation: how long, on what, with which seed."""
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--batch-size", type=int, default=64, help="sequences per training step")
    p.add_argument("--learning-rate", type=float, default=3e-3, help="Adam's peak learning rate")
    p.add_argument("--impl", choices=("auto", "ffi", "xla", "reference"), default="auto",
                   help="the sdm_write_read implementation the layer calls")
    p.add_argument("--eval-batch", type=int, default=256, help="sequences per evaluation batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and the data")


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_model_options(p)
    add_run_options(p, steps=300)
    p.add_argument("--log-every", type=int, default=25, help="steps between two lines of the training log")
    p.add_argument("--target", type=float, default=0.95, help="exit with status 1 below this accuracy")
    p.add_argument("--save", type=Path, metavar="DIR",
                   help="directory to save the trained parameters and the model's options in (replaced if present; "
                        "default: no saving)")
    return p


def task_and_model(args):
    task = recall.RecallTask(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                             num_queries=args.queries)
    model = recall.default_model(task, seed=args.seed, impl=args.impl, slots_per_head=args.slots,
                                 addressing=args.addressing)
    return task, model


def save_checkpoint(directory, model, args):
    """The model's parameters (Orbax, `DIR/params`) and its options (`DIR/options.json`); replaces `directory`'s
    previous checkpoint."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / OPTIONS_FILE).unlink(missing_ok=True)  # never a new options file beside old parameters
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", nnx.state(model, nnx.Param), force=True)
        checkpointer.wait_until_finished()
    options = {name: getattr(args, name) for name in {**MODEL_OPTIONS, **TASK_OPTIONS}}
    (directory / OPTIONS_FILE).write_text(json.dumps({"jax_sdm": jax_sdm.__version__, "options": options}, indent=1))


def checkpoint_options(directory):
    """The task and model options stored in a checkpoint directory; ValueError (one line) if it holds none."""
    path = Path(directory) / OPTIONS_FILE
    if not path.is_file():
        raise ValueError(f"{directory} is not a checkpoint of examples/train_recall.py --save (no {OPTIONS_FILE})")
    return json.loads(path.read_text())["options"]


def resolve_options(args, stored, directory):
    """Fill the options left unset (None) in `args` from `stored`; ValueError (one line) naming every model option
    set to a value other than the checkpoint's."""
    disagree = [name for name in MODEL_OPTIONS
                if getattr(args, name) is not None and getattr(args, name) != stored[name]]
    if disagree:
        flags = lambda values: " ".join(f"--{n} {values[n]}" for n in disagree)
        raise ValueError(f"the checkpoint {directory} holds a model with {flags(stored)}, not {flags(vars(args))} "
                         "(leave the model options out to take the checkpoint's)")
    fill_options(args, stored)


def fill_options(args, values):
    """Set the task and model options left unset (None) in `args` to `values`."""
    for name in {**MODEL_OPTIONS, **TASK_OPTIONS}:
        if getattr(args, name) is None:
            setattr(args, name, values[name])


def load_parameters(directory, model):
    """Restore `model`'s parameters from `DIR/params`; ValueError (one line) naming a parameter whose shape or
    dtype differs between the model and the checkpoint."""
    import orbax.checkpoint as ocp

    params = nnx.state(model, nnx.Param)
    path = Path(directory).resolve() / "params"
    with ocp.StandardCheckpointer() as checkpointer:
        leaves = lambda tree: {jax.tree_util.keystr(key, simple=True, separator="."): leaf
                               for key, leaf in jax.tree_util.tree_leaves_with_path(tree)}
        stored = leaves(checkpointer.metadata(path).item_metadata)
        for name, leaf in leaves(params).items():
            have = stored.get(name)
            if have is None or (tuple(have.shape), have.dtype) != (leaf.shape, leaf.dtype):
                found = "missing" if have is None else f"{have.dtype}{list(have.shape)}"
                raise ValueError(f"the checkpoint {directory} does not fit this model: parameter {name} is "
                                 f"{leaf.dtype}{list(leaf.shape)} here, {found} there")
        nnx.update(model, checkpointer.restore(path, params))


def main(argv=None):
    args = parser().parse_args(argv)
    task, model = task_and_model(args)
    print(f"jax {jax.__version__} on {jax.default_backend()}; task: {task}; sequence length {task.seq_len}")
    print(f"memory layer: {model.memory.num_heads} heads x {model.memory.slots_per_head} slots x "
          f"{model.memory.head_dim}, {model.memory.num_writes} writes / {model.memory.num_reads} reads per token, "
          f"{model.memory.addressing} addressing, impl={args.impl}")

    def log(step, loss, accuracy, seconds):
        print(f"step {step:5d}/{args.steps}  loss {loss:.4f}  accuracy {accuracy:.3f}  {seconds:6.1f} s", flush=True)

    recall.train(model, task, steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                 seed=args.seed, log_every=args.log_every, log=log)
    accuracy = recall.evaluate(model, task, batch_size=args.eval_batch)
    tokens, _, _ = task.batch(np.random.default_rng(args.seed + 1), args.eval_batch)
    start = time.perf_counter()
    answers = recall.decode_answers(model, task, tokens)
    decode_accuracy = float(np.mean(np.asarray(answers) == tokens[:, task.prompt_len + 1::2]))
    print(f"final accuracy: {accuracy:.4f} (whole sequences), {decode_accuracy:.4f} (prefill + decode, "
          f"{time.perf_counter() - start:.1f} s)")
    if args.save is not None:
        save_checkpoint(args.save, model, args)
        print(f"saved the parameters and the model's options in {args.save}")
    return 0 if min(accuracy, decode_accuracy) >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
