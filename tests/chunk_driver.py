"""Drive one model chunk through a program's instructions on one process, as the executor does on its rank.

Shared by the chunk-level tests (fused and cut mode, recomputation, compiled units): each
instruction's received tensors are handed over, its unit steps (:func:`braid.core.braiding.steps`)
run through :meth:`ModelChunk.run`, and its ops end; a chunk that is not the first stage
returns its input gradients, one that is not the last stage has its outputs taken.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from braid.core.braiding import ChunkSpec, steps
from braid.core.ir import OpKind, parse_instruction


def drive(ch: Any, spec: ChunkSpec, program: Sequence[str], *, inputs: Sequence[torch.Tensor] | None = None,
          output_grads: Sequence[torch.Tensor] | None = None, before_op: Callable[[Any], None] | None = None,
          after_op: Callable[[str, Any], None] | None = None) -> tuple[dict[int, torch.Tensor], int]:
    """Run ``program`` (instruction texts) on ``ch``; returns (input gradient by micro-batch, peak live bytes).

    ``inputs``/``output_grads``: per micro-batch, handed to an F / a backward op before it
    runs (a chunk without the embedding / the head). ``before_op(op)`` runs before an
    instruction's units, ``after_op(text, op)`` after each op has ended.
    """
    dxs: dict[int, torch.Tensor] = {}
    peak = 0
    for text in program:
        ins = parse_instruction(text)
        ops = getattr(ins, "ops", (ins,))
        for op in ops:
            if op.kind is OpKind.F and inputs is not None:
                ch.set_input(op.mb, inputs[op.mb])
            elif op.kind is not OpKind.F and output_grads is not None:
                ch.set_output_grad(op.mb, output_grads[op.mb])
            if before_op is not None:
                before_op(op)
        for st in steps(ins, lambda c: spec):
            ch.run(st.op.mb, st.task)
            peak = max(peak, ch.live_bytes())
        for op in ops:
            if op.kind is OpKind.F:
                ch.end_forward(op.mb)
                if not spec.head:
                    ch.pop_output(op.mb)
            elif op.kind in (OpKind.B, OpKind.BW):
                ch.end_backward(op.mb)
                if not spec.embed:
                    dxs[op.mb] = ch.pop_input_grad(op.mb)
            if after_op is not None:
                after_op(text, op)
    return dxs, peak
