"""The chunk runner's autograd calls, without the per-call Python of the public wrappers.

A unit task runs one to three autograd calls on tiny graphs; at small model sizes the
Python around them is the task's cost. Measured per call on CPU (torch 2.13):
``torch.autograd.grad`` on gradient edges ~110 us, of which ~65 us is its argument
handling (``_make_grads`` compares every output's shape symbolically), against ~45 us for
the engine call it ends in; ``get_gradient_edge`` ~8 us against ~1 us for building the
edge from ``grad_fn``; ``Function.apply`` ~12 us against ~8 us for the C++ ``apply`` it
wraps. These helpers make the same calls with what the runner already guarantees
(explicit output gradients of the right shapes, no functorch transforms, non-leaf
outputs) and fall back to the public functions where the private entry points are missing
or behave differently: they are used from torch 2.13 on, where they were checked against
the public functions (on torch 2.11 the runner's first backward failed with "element 0 of
tensors does not require grad").
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

def _version(v: str) -> tuple[int, int]:
    major, minor = v.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# The private entry points, on the torch versions they were checked on; else the public ones.
FAST = _version(torch.__version__) >= (2, 13)
_engine_run_backward = None
if FAST:
    try:  # the engine call of torch.autograd.grad/backward (keeps its context stash for compiled backward)
        from torch.autograd.graph import _engine_run_backward
    except ImportError:  # pragma: no cover - a torch without it
        FAST = False


def edge(t: torch.Tensor) -> GradientEdge:
    """The autograd edge of ``t``'s gradient: ``get_gradient_edge(t)`` without its checks for non-leaf tensors."""
    fn = t.grad_fn
    return GradientEdge(fn, t.output_nr) if (FAST and fn is not None) else get_gradient_edge(t)


def grad(outputs: Sequence[torch.Tensor | GradientEdge], inputs: Sequence[torch.Tensor | GradientEdge],
         grad_outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs)`` as one engine call (an input the
    outputs do not depend on is an error, as there).

    ``grad_outputs`` must hold one gradient per output, of its shape and dtype (not
    checked here: the runner passes what the next unit's backward returned).
    """
    if _engine_run_backward is None:  # pragma: no cover - older torch
        return torch.autograd.grad(outputs, inputs, grad_outputs)
    return _engine_run_backward(tuple(outputs), tuple(grad_outputs), False, False, tuple(inputs), False, accumulate_grad=False)


def on_this_thread() -> torch.autograd.set_multithreading_enabled:
    """Run backward calls on the calling thread (a context manager).

    By default autograd hands every backward over CUDA tensors to a per-device worker thread
    and sleeps until it is done: two thread switches per call. The runner makes a backward
    call per unit, hundreds per step, and on a GPU host the switches cost more than small
    units' kernels take (the small preset's step on one H100 halved without them). The
    engine runs the same nodes in the same order either way, so values are unchanged.
    The executor and the profiler both run unit tasks under this.
    """
    return torch.autograd.set_multithreading_enabled(False)


def fast_apply(fn: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``fn.apply`` without ``Function.apply``'s Python wrapper (default-argument binding for
    ``setup_context`` and unwrapping of dead functorch wrappers: the runner never runs under
    functorch transforms, and ``fn`` must have no ``setup_context``)."""
    if "setup_context" in fn.__dict__:
        raise TypeError(f"{fn.__name__} defines setup_context: use its apply")
    if not FAST:
        return fn.apply
    return super(torch.autograd.Function, fn).apply  # type: ignore[misc]
