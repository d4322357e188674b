"""The LM head's cross-entropy, chunk by chunk, with its gradients formed in the forward pass.

Each chunk of ``R`` rows (``B · chunk`` positions, taken from the flattened rows so no transpose is
needed) costs the logits' product, their statistics (log-sum-exp, argmax), and under
differentiation the logit gradient ``mask · (softmax − onehot) / Σ mask`` and its two products
(the chunk's input gradient and its share of the head's weight gradient, summed in f32). The
statistics and the logit gradient run on :mod:`pallas_kernels.softmax_ce` (``"pallas"``: one
16-bit read of the logits each) or on XLA (``"xla"``).

The head matrix is taken in its stored layout: ``[D, V]`` (an ``nnx.Linear`` kernel) or
``[V, D]`` (a tied embedding table, ``vocab_major``), and its gradient comes back in the same
layout, so neither direction transposes a vocabulary-sized matrix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdn_jax.nn.layers import project

f32 = jnp.float32


def _stats_xla(logits):
    """(lse [R] f32, argmax [R] int32) of 16-bit logits [R, V]."""
    return jax.nn.logsumexp(logits.astype(f32), axis=-1), jnp.argmax(logits, axis=-1)


def _grad_xla(logits, lse, targets, scale):
    """(softmax − onehot) · scale [R, V] in the logits' dtype."""
    p = jnp.exp(logits.astype(f32) - lse[:, None])
    onehot = jnp.arange(logits.shape[1], dtype=targets.dtype) == targets[:, None]
    return ((p - onehot) * scale[:, None]).astype(logits.dtype)


def _stats_pallas(logits):
    from pallas_kernels import softmax_ce

    return softmax_ce.combine(*softmax_ce.ce_stats(logits))


def _grad_pallas(logits, lse, targets, scale):
    from pallas_kernels import softmax_ce

    return softmax_ce.ce_grad(logits, lse, targets.astype(f32), scale)


def check_pallas(x, w, rows: int, vocab: int) -> None:
    """NotImplementedError when the kernels cannot serve the [rows, vocab] logits of ``x @ w``
    here: no Hopper GPU (and no interpreter requested), inputs on Auto mesh axes (the kernels are
    opaque to XLA's partitioner), or a shape or dtype they refuse."""
    from gdn_jax.sharding import pallas_layout_error
    from pallas_kernels import _compat as pk
    from pallas_kernels import softmax_ce

    if pk.execution_mode() == "auto" and not pk.is_hopper():
        raise NotImplementedError("no Hopper GPU (and the Mosaic GPU interpreter not requested)")
    why = pallas_layout_error((x, w))
    if why is not None:
        raise NotImplementedError(why)
    softmax_ce.check(jax.ShapeDtypeStruct((rows, vocab), x.dtype))


def _ce_chunks(x, w, targets, mask, chunk: int, vocab_major: bool, impl: str, grads: bool):
    """Mean cross-entropy and accuracy of the logits ``x @ w``, ``B · chunk`` rows at a time.

    Args:
      x: [B, T, D] normed hidden states (T a multiple of ``chunk``).
      w: [D, V], or [V, D] when ``vocab_major``: the head matrix.
      targets: [B, T] ids in [0, V); mask: [B, T] f32 weights.
      impl: ``"pallas"`` or ``"xla"``: who computes the statistics and the logit gradient.
      grads: also return the gradients of the mean loss: dx [B, T, D] (x.dtype) and dw in w's
        layout (w.dtype, summed over the chunks in f32).
    Returns:
      ((loss, accuracy), (dx, dw) or None).
    """
    B, T, D = x.shape
    R = B * chunk
    n = T // chunk
    stats, grad = (_stats_pallas, _grad_pallas) if impl == "pallas" else (_stats_xla, _grad_xla)
    inv = 1.0 / jnp.maximum(jnp.sum(mask), 1.0)
    wd = 1 if vocab_major else 0  # w's hidden axis
    split = lambda a: a.reshape(n, R, *a.shape[1:])  # [B·T, ...] rows in order: no transpose

    def body(carry, xs):
        xc, tc, mc = xs  # [R, D], [R], [R]
        if vocab_major:  # [R, V] in the compute dtype, as the head computes them
            logits = jax.lax.dot_general(xc, w, (((1,), (1,)), ((), ())))
        else:
            logits = project(xc, w)
        lse, top = stats(logits)
        target = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0].astype(f32)
        correct = (top == tc).astype(f32)
        nll, acc = carry[0] + jnp.sum((lse - target) * mc), carry[1] + jnp.sum(correct * mc)
        if not grads:
            return (nll, acc), None
        # d(Σ mask · nll / Σ mask) / d logits, in the logits' dtype as their cotangent would be
        dlogits = grad(logits, lse, tc, mc * inv)
        dx = jax.lax.dot_general(dlogits, w, (((1,), (1 - wd,)), ((), ())))  # [R, D]
        dims = (((0,), (0,)), ((), ()))
        dw = (
            jax.lax.dot_general(dlogits, xc, dims, preferred_element_type=f32)
            if vocab_major
            else jax.lax.dot_general(xc, dlogits, dims, preferred_element_type=f32)
        )
        dw = dw if carry[2] is None else carry[2] + dw
        return (nll, acc, dw), dx.astype(x.dtype)

    zero = jnp.zeros((), f32)
    rows = B * T
    xs = (split(x.reshape(rows, D)), split(targets.reshape(rows)), split(mask.reshape(rows)))
    if not grads:
        carry, _ = jax.lax.scan(body, (zero, zero), xs)
        return (carry[0] * inv, carry[1] * inv), None
    # The first chunk's weight gradient starts the f32 sum: no vocabulary-sized zeros to write
    # and read back.
    first = jax.tree.map(lambda a: a[0], xs)
    (nll, acc, dw), dx0 = body((zero, zero, None), first)
    carry, dx = jax.lax.scan(body, (nll, acc, dw), jax.tree.map(lambda a: a[1:], xs))
    dx = jnp.concatenate([dx0[None], dx])
    return (carry[0] * inv, carry[1] * inv), (dx.reshape(B, T, D), carry[2].astype(w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def head_cross_entropy(x, w, targets, mask, chunk: int, vocab_major: bool, impl: str):
    """``(loss, accuracy)`` of the logits ``x @ w`` (see :func:`_ce_chunks` for the arguments);
    under reverse-mode differentiation the gradients are formed chunk by chunk in the forward
    pass and the backward pass only scales them by the loss's cotangent."""
    return _ce_chunks(x, w, targets, mask, chunk, vocab_major, impl, grads=False)[0]


def _fwd(x, w, targets, mask, chunk, vocab_major, impl):
    return _ce_chunks(x, w, targets, mask, chunk, vocab_major, impl, grads=True)


def _bwd(chunk, vocab_major, impl, res, g):
    dx, dw = res
    g = g[0]  # the accuracy has no gradient
    scale = lambda a: (a.astype(f32) * g).astype(a.dtype)
    return scale(dx), scale(dw), None, None


head_cross_entropy.defvjp(_fwd, _bwd)
