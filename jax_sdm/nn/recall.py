"""Associative recall with the SDM layer: the task, a small model, training and decoding.

Shared by `notebooks/03_training.ipynb`, `examples/train_recall.py` and `examples/decode.py`. Needs optax
(the `nn` extra) for training.

The task: a sequence lists `num_pairs` key-value pairs `k1 v1 k2 v2 ...` (distinct keys), then asks
`num_queries` of the keys again, each followed by its value: `... q1 a1 q2 a2 ...`. The model reads the
sequence left to right and must predict each answer `a_j` at its query `q_j`; only those predictions count.
"""
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layer import SparseDeltaMemory


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Token ids: keys `0 .. num_keys-1`, then values `num_keys .. num_keys+num_values-1`."""
    num_keys: int = 16
    num_values: int = 16
    num_pairs: int = 8
    num_queries: int = 8

    def __post_init__(self):
        if self.num_pairs > self.num_keys or self.num_queries > self.num_pairs:
            raise ValueError(f"RecallTask: need num_queries <= num_pairs <= num_keys, got {self}")

    @property
    def vocab_size(self):
        return self.num_keys + self.num_values

    @property
    def prompt_len(self):
        """Tokens before the first query (the pairs)."""
        return 2 * self.num_pairs

    @property
    def seq_len(self):
        return 2 * (self.num_pairs + self.num_queries)

    def batch(self, rng, batch_size):
        """`(tokens, targets, mask)`, each `[batch_size, seq_len]`: the sequences, the next token at every position,
        and 1.0 where that next token is an answer (the positions of the queries)."""
        keys = np.argsort(rng.random((batch_size, self.num_keys)), axis=1)[:, :self.num_pairs]
        values = self.num_keys + rng.integers(0, self.num_values, (batch_size, self.num_pairs))
        asked = np.argsort(rng.random((batch_size, self.num_pairs)), axis=1)[:, :self.num_queries]
        queries = np.take_along_axis(keys, asked, axis=1)
        answers = np.take_along_axis(values, asked, axis=1)
        interleave = lambda a, b: np.stack([a, b], axis=2).reshape(batch_size, -1)
        tokens = np.concatenate([interleave(keys, values), interleave(queries, answers)], axis=1).astype(np.int32)
        targets = np.concatenate([tokens[:, 1:], np.zeros((batch_size, 1), np.int32)], axis=1)
        mask = np.zeros(tokens.shape, np.float32)
        mask[:, self.prompt_len::2] = 1.0
        return tokens, targets, mask


class RecallModel(nnx.Module):
    """Embedding, a token shift (each position sees its own and the previous token's embedding, so a value
    can be written under the address of the key before it), one `SparseDeltaMemory` layer with a residual,
    and a linear head. `memory` holds the layer's keyword arguments."""

    def __init__(self, vocab_size, d_model=64, *, memory, rngs):
        self.d_model = d_model
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        self.shift = nnx.Linear(2 * d_model, d_model, rngs=rngs)
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.memory = SparseDeltaMemory(d_model, **memory, rngs=rngs)
        self.head_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def init_state(self, batch_size):
        """The decode state before the first token: the previous token's embedding and the memory bank."""
        return {"prev": jnp.zeros((batch_size, 1, self.d_model)), "bank": self.memory.init_state(batch_size)}

    def __call__(self, tokens, state=None):
        """`tokens [B, T]` -> `(logits [B, T, vocab], state)`; pass the returned state on to continue."""
        e = self.embed(tokens)
        prev = jnp.zeros_like(e[:, :1]) if state is None else state["prev"]
        h = self.shift(jnp.concatenate([e, jnp.concatenate([prev, e[:, :-1]], axis=1)], axis=-1))
        y, bank = self.memory(self.norm(h), state=None if state is None else state["bank"])
        logits = self.head(self.head_norm(h + y))
        return logits, {"prev": e[:, -1:], "bank": bank}


def default_model(task, seed=0, impl="auto", **memory):
    """A model sized for the default task: it reaches 95% recall in a few hundred steps of batch 64."""
    options = dict(num_heads=2, head_dim=32, slots_per_head=64, num_writes=4, num_reads=4, chunk_size=16,
                   impl=impl)
    options.update(memory)
    return RecallModel(task.vocab_size, 64, memory=options, rngs=nnx.Rngs(seed))


def masked_loss(model, tokens, targets, mask):
    """Mean cross entropy over the answer positions, and the accuracy there."""
    logits, _ = model(tokens)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.sum(mask), jnp.sum(hits * mask) / jnp.sum(mask)


@nnx.jit
def train_step(model, optimizer, tokens, targets, mask):
    (loss, accuracy), grads = nnx.value_and_grad(masked_loss, has_aux=True)(model, tokens, targets, mask)
    optimizer.update(model, grads)
    return loss, accuracy


@nnx.jit
def evaluate_batch(model, tokens, targets, mask):
    return masked_loss(model, tokens, targets, mask)


def train(model, task, *, steps=400, batch_size=64, learning_rate=3e-3, seed=0, log_every=50, log=print):
    """Train with Adam (warm-up then cosine decay); returns the history `{"step", "loss", "accuracy"}` (training
    batches). `log(step, loss, accuracy, seconds)` is called every `log_every` steps (None: silent)."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, min(50, steps // 10 + 1), steps)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.0), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    history = {"step": [], "loss": [], "accuracy": []}
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss, accuracy = train_step(model, optimizer, *task.batch(rng, batch_size))
        history["step"].append(step)
        history["loss"].append(float(loss))
        history["accuracy"].append(float(accuracy))
        if log is not None and (step % log_every == 0 or step == steps):
            log(step, history["loss"][-1], history["accuracy"][-1], time.perf_counter() - start)
    return history


def evaluate(model, task, *, batches=4, batch_size=256, seed=12345):
    """Accuracy on fresh sequences (whole-sequence calls, as in training)."""
    rng = np.random.default_rng(seed)
    return float(np.mean([evaluate_batch(model, *task.batch(rng, batch_size))[1] for _ in range(batches)]))


@functools.partial(nnx.jit, donate_argnums=2)
def decode_call(model, tokens, state):
    """`model(tokens, state)` jitted with the state donated: the bank is updated in place, and the `state` passed
    in is deleted (use the returned one)."""
    return model(tokens, state)


def decode_answers(model, task, tokens):
    """Prefill the pairs of `tokens [B, seq_len]` in one call, then decode one token at a time: feed each query,
    take the model's most likely next token as the answer, feed that answer back. Returns the answers
    `[B, num_queries]` (compare with `tokens[:, prompt_len + 1::2]`)."""
    tokens = jnp.asarray(tokens)
    _, state = decode_call(model, tokens[:, :task.prompt_len], model.init_state(tokens.shape[0]))
    answers = []
    for j in range(task.num_queries):
        query = tokens[:, task.prompt_len + 2 * j][:, None]
        logits, state = decode_call(model, query, state)
        answer = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        answers.append(answer)
        _, state = decode_call(model, answer[:, None], state)
    return jnp.stack(answers, axis=1)
