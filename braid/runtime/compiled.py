"""Compiled units: the pure tensor functions of every unit under ``torch.compile``.

A unit (Pre-Attn, Attn, Pre-MLP, MLP; paper Sec. 3, Fig. 2) is linears and an attention
kernel -- one kernel each -- glued by element-wise math that eager PyTorch runs as a string
of small kernels: RMSNorm (cast, square, mean, rsqrt, two products), RoPE of the queries
and keys (slices, a negation, a concatenation, products, cos/sin tables), the SwiGLU gate
and the head's loss, which reads and writes the fp32 logits several times over. At
7B-shaped layers those strings cost about as much memory traffic as a GEMM. Here each glue
function (:class:`braid.models.qwen2.UnitFns`) is compiled on its own: forward and
backward become one or two fused kernels each (the loss only at tp=1, where it needs no
all-reduce inside). The fused residual ``out + residual / t`` stays eager: it is one
kernel either way (no division at t=1), and a compiled call costs host time.

What is *not* compiled, and why the unit contract survives:

- the linears (:mod:`braid.tp.layers`) stay eager autograd functions, so the weight
  gradient is still split off the activation gradient (B/W) and stashed per micro-batch;
- the attention kernels are fused already (SDPA's flash/cuDNN kernels, the ring kernels);
- the chunk runner (:mod:`braid.models.chunk`) still cuts each unit into pieces and runs
  ``torch.autograd.grad`` on them. A compiled function is an autograd function whose
  forward saves its residuals with ``save_for_backward``, so the runner's
  ``saved_tensors_hooks`` see them: they land in the (micro-batch, unit) boxes and can be
  offloaded and reloaded like eager activations.

Each function is compiled once per process with static shapes (``dynamic=False``): every
layer of a model calls it with the same shapes, so one graph serves them all.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from braid.models.qwen2 import EAGER, UnitFns
from braid.tp.embedding import CEKernels, ce_logits_grad_fused, ce_row_max, ce_row_stats, vocab_parallel_cross_entropy


def available(device: torch.device | str) -> bool:
    """Whether ``torch.compile``'s default backend can generate kernels for ``device``.

    CPU needs a C++ compiler (inductor's C++ backend); CUDA needs Triton.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    if dev.type == "cpu":
        import shutil

        return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
    return False


def resolve(compile: bool | None, device: torch.device | str) -> bool:
    """The compile switch: ``None`` means on for CUDA devices where Triton is available, off
    elsewhere (on CPU, compiling costs seconds per shape and tiny models gain nothing);
    ``True`` where it cannot work is refused with one line."""
    dev = torch.device(device)
    if compile is None:
        return dev.type == "cuda" and available(dev)
    if compile and not available(dev):
        need = "Triton" if dev.type == "cuda" else "a C++ compiler (g++)"
        raise ValueError(f"compiled units on {dev.type} need {need}; install it or turn compiling off (--no-compile)")
    return bool(compile)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (b, s) of full-vocabulary ``logits`` (b, s, V), in fp32; 0 at ignored labels
    (the head masks those out anyway)."""
    return F.cross_entropy(logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten(), reduction="none").view(labels.shape)


def _cross_entropy(compiled_ce, kernels: CEKernels):
    def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int = 0, group=None) -> torch.Tensor:
        # tp=1: the whole vocabulary is here, so the loss is plain cross-entropy and compiles into a few
        # fused kernels. With a TP group the max and sums are all-reduced mid-function: the autograd
        # function stays eager around them and its three element-wise pieces run compiled.
        if group is None and vocab_start == 0:
            return compiled_ce(logits, labels)
        return vocab_parallel_cross_entropy(logits, labels, vocab_start, group, kernels)

    return cross_entropy


def _jit(fn):
    return torch.compile(fn, dynamic=False, fullgraph=True)


@functools.cache
def compiled_ce_kernels() -> CEKernels:
    """The vocab-parallel loss's element-wise pieces under ``torch.compile`` (the logits' gradient in its
    fusible form, :func:`braid.tp.embedding.ce_logits_grad_fused`)."""
    return CEKernels(_jit(ce_row_max), _jit(ce_row_stats), _jit(ce_logits_grad_fused))


@functools.cache
def compiled_fns() -> UnitFns:
    """The unit functions under ``torch.compile`` (built once per process; compiled lazily, at first call)."""
    return UnitFns(rms_norm=_jit(EAGER.rms_norm), rope_qk=_jit(EAGER.rope_qk), split_rope_qkv=_jit(EAGER.split_rope_qkv),
                   swiglu=_jit(EAGER.swiglu), swiglu_joined=_jit(EAGER.swiglu_joined),
                   swiglu_grad=_jit(EAGER.swiglu_grad), swiglu_joined_grad=_jit(EAGER.swiglu_joined_grad),
                   # one add (and a division at tp > 1) is one kernel in eager mode too; compiled, it
                   # would only add a compiled call's host time to every unit
                   add_residual=EAGER.add_residual,
                   cross_entropy=_cross_entropy(_jit(token_cross_entropy), compiled_ce_kernels()))


def set_compiled(modules: Iterable[nn.Module], enabled: bool) -> int:
    """Make every unit-bearing submodule of ``modules`` call the compiled (or eager) unit
    functions; returns how many modules were switched. Parameters and results are untouched:
    the same module computes the same values either way, up to floating-point rounding."""
    fns = compiled_fns() if enabled else EAGER
    n = 0
    for mod in modules:
        for sub in mod.modules():
            if isinstance(getattr(type(sub), "fns", None), UnitFns):
                sub.fns = fns
                n += 1
    return n


def is_compiled(module: nn.Module) -> bool:
    """Whether any unit-bearing submodule of ``module`` calls the compiled functions."""
    return any(getattr(sub, "fns", None) is not None and sub.fns is not EAGER
               for sub in module.modules() if isinstance(getattr(type(sub), "fns", None), UnitFns))
