"""Linear weight gradients summed once per step, with their rows kept in the gradient's memory.

A Linear's weight gradient over one microbatch is the product ``G = A @ B`` of the incoming
gradient's and the input's rows (``g.T @ x`` for ``nn.Linear``). At 8 rows such a product is
skinny: it reads and writes the whole weight-sized ``G`` to add 4 MFLOP, so summing microbatch by
microbatch is bound by memory traffic. Summed once over all the step's rows it is one real
product, but the rows have to wait somewhere until then.

They wait in ``G``'s own memory. That memory is taken at the step's first product anyway (the
default writes the first microbatch's product into it), and until the sum is computed it holds
nothing else. While the step's rows fit in half of it, each product only copies its rows in
(:meth:`Staged.add`); :meth:`Staged.finish` computes ``G`` over them. So no activation is kept
longer and the rank's memory between products is the same; its weight products are one per
step instead of one per microbatch.

Layout, for ``G`` of ``P x Q`` elements and room for ``cap`` rows (``cap * (P + Q) <= P * Q / 2``):
the left operand's rows (``cap x P``) at the front of ``G``'s memory, the right operand's
(``cap x Q``) right after them, each product's rows appended as contiguous rows.
:meth:`Staged.finish` copies the used rows out (``rows * (P + Q)`` numbers, at most half of
``G``, freed when it returns) and writes ``G`` over them as one product. Keeping the product
whole is what makes it fast: computing ``G`` in place, in blocks that only overwrite rows
already used, needs a quarter of that workspace, but its split products took 1.18x as long
(Linear(512), 64 rows; 1.04x for Linear(1024), 256 rows).

A Linear's bias gradient is the column sum of the same incoming-gradient rows, so it waits with
them: the bias leaf follows its weight's staging (:func:`add` with ``bias``) and gets one column
sum over all the step's rows when the weight settles, rather than a sum and an addition per
product (one process, the small benchmark's 1F1B step, paired: 0.981x the time). Settling the
bias leaf settles its weight.

The state rides on the step's own parameter leaf (like :mod:`funcpipe.runtime.reuse`'s offered
memory): :func:`allow` lets a leaf stage, :func:`add` stages one product or declines,
:func:`skip` withdraws the permission (a leaf whose products come all at once),
:func:`settle` computes the sum into the leaf's ``.grad`` (adding to anything the engine put
there meanwhile). Whatever reads a leaf's ``.grad`` settles it first.
"""

from __future__ import annotations

import torch

from funcpipe.runtime import reuse

__all__ = [
    "BOTH",
    "NONE",
    "WEIGHT",
    "Staged",
    "add",
    "allow",
    "capacity",
    "settle",
    "skip",
    "staged",
]

Tensor = torch.Tensor
_ATTR = "_funcpipe_staged"  # True: may stage; a Staged: staging; a _Follows: a bias waiting
NONE, WEIGHT, BOTH = 0, 1, 2  # what add staged


def capacity(p: int, q: int) -> int:
    """Rows a ``p x q`` gradient's memory stages: its ``A`` and ``B`` fill at most half of it."""
    return (p * q) // (2 * (p + q))


class Staged:
    """The rows of one weight gradient's products, kept in that gradient's memory."""

    def __init__(self, buf: Tensor, transposed: bool, bias: Tensor | None = None) -> None:
        p, q = buf.shape
        cap = capacity(p, q)
        flat = buf.view(-1)
        self.g, self.transposed, self.cap, self.rows = buf, transposed, cap, 0
        self.a = flat[: cap * p].view(cap, p)  # G's left operand, transposed (a row per row)
        self.b = flat[cap * p : cap * (p + q)].view(cap, q)
        # the bias leaf whose gradient is the column sum of the incoming-gradient rows here
        self.bias = bias

    def add(self, x: Tensor, g: Tensor) -> bool:
        """Copy in one product's rows (``x``: the input rows, ``g``: the incoming gradient's);
        ``False`` (nothing copied) if they do not fit."""
        n = x.shape[0]
        if self.rows + n > self.cap:
            return False
        left, right = (g, x) if self.transposed else (x, g)
        self.a[self.rows : self.rows + n].copy_(left)
        self.b[self.rows : self.rows + n].copy_(right)
        self.rows += n
        return True

    def finish(self) -> Tensor:
        """``G`` = the sum of every added product, written over the rows; returns ``G``. The
        bias leaf (if one follows) gets the incoming gradient's column sum first."""
        if self.bias is not None:
            _add_bias(self.bias, (self.a if self.transposed else self.b)[: self.rows])
        if self.rows == 0:
            return self.g.zero_()
        a, b = self.a[: self.rows].clone(), self.b[: self.rows].clone()
        return torch.mm(a.t(), b, out=self.g)


class _Follows:
    """On a bias leaf: its gradient waits in ``weight``'s staging (settled with it)."""

    __slots__ = ("weight",)

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight


def _add_bias(leaf: Tensor, rows: Tensor) -> None:
    """Add the column sum of ``rows`` to ``leaf.grad`` (its first value into offered memory)."""
    if isinstance(leaf.__dict__.get(_ATTR), _Follows):
        del leaf.__dict__[_ATTR]
    if leaf.grad is not None:
        leaf.grad.add_(rows.sum(0))
        return
    spare = reuse.take(leaf)
    leaf.grad = rows.sum(0) if spare is None else torch.sum(rows, 0, out=spare)


def allow(leaf: Tensor) -> None:
    """Let ``leaf``'s weight gradient this step be staged (:func:`add`)."""
    leaf.__dict__[_ATTR] = True


def skip(leaf: Tensor) -> None:
    """``leaf``'s gradient is summed directly this step (its products come all at once):
    withdraw :func:`allow` unless rows are staged already."""
    if leaf.__dict__.get(_ATTR) is True:
        del leaf.__dict__[_ATTR]


def staged(leaf: Tensor) -> bool:
    """``leaf`` has rows waiting (:func:`settle` would compute something)."""
    return isinstance(leaf.__dict__.get(_ATTR), Staged)


def add(leaf: Tensor, transposed: bool, x: Tensor, g: Tensor, bias: Tensor | None = None) -> int:
    """Stage one product's rows for ``leaf``'s gradient, and for ``bias``'s (the product's bias
    leaf, if any). Returns :data:`NONE` (0: the caller sums both gradients itself: staging not
    allowed, a gradient already there, a shape, layout or form that does not fit; anything
    staged before is then settled into ``.grad`` first), :data:`WEIGHT` (the weight's rows
    staged; the caller sums the bias) or :data:`BOTH`."""
    state = leaf.__dict__.get(_ATTR)
    if state is None:
        return NONE
    if state is True:
        if leaf.grad is not None or not _fits(leaf, x, g):
            del leaf.__dict__[_ATTR]
            return NONE
        buf = reuse.take(leaf)
        if buf is None or not buf.is_contiguous():
            buf = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        follows = bias if bias is not None and _bias_fits(bias, g) else None
        state = leaf.__dict__[_ATTR] = Staged(buf, transposed, follows)
        if follows is not None:
            follows.__dict__[_ATTR] = _Follows(leaf)
    usable = leaf.grad is None and state.transposed == transposed and _same(state.g, x, g)
    if usable and state.add(x, g):
        return BOTH if bias is not None and state.bias is bias else WEIGHT
    settle(leaf)
    return NONE


def _bias_fits(bias: Tensor, g: Tensor) -> bool:
    """A bias whose gradient is the plain column sum of ``g``, not yet given one this step."""
    state = bias.__dict__.get(_ATTR)
    return (
        bias.grad is None
        and (state is None or state is True)
        and bias.shape == g.shape[1:]
        and bias.dtype == g.dtype
        and bias.device == g.device
    )


def _fits(leaf: Tensor, x: Tensor, g: Tensor) -> bool:
    return leaf.dim() == 2 and capacity(*leaf.shape) >= x.shape[0] and _same(leaf, x, g)


def _same(w: Tensor, x: Tensor, g: Tensor) -> bool:
    return (
        x.dim() == 2
        and g.dim() == 2
        and x.dtype == g.dtype == w.dtype
        and x.device == g.device == w.device
    )


def settle(leaf: Tensor) -> None:
    """Compute ``leaf``'s staged sum into its ``.grad`` (added to what is there); staging ends
    for this step. A bias leaf following a weight's staging settles that weight (and so
    itself)."""
    state = leaf.__dict__.pop(_ATTR, None)
    if isinstance(state, _Follows):  # (its weight's staging computes both)
        leaf = state.weight
        state = leaf.__dict__.pop(_ATTR, None)
    if not isinstance(state, Staged):
        return
    total = state.finish()
    if leaf.grad is None:
        leaf.grad = total
    else:
        leaf.grad.add_(total)
