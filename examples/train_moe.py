"""The examples' mixture-of-experts flags: ``--moe-dispatch`` and the checks of ``--ep`` made before any process group.

``--moe-dispatch splits`` (the default) sends every expert-parallel peer exactly its rows; the
all-to-all's splits are read on the host every MoE layer, so the step runs eager.
``--moe-dispatch padded`` sends every peer a block of ``T * min(k, E/ep)`` rows, zeros after the
real ones (:class:`braid.runtime.expert_parallel.PaddedAllToAllDispatch`): nothing is read on the
host and the step can be a whole-step CUDA graph, for ``ep`` times the rows on the wire (tp=1).
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence


def add_moe_args(group: argparse._ArgumentGroup) -> None:
    """``--moe-dispatch`` in ``group`` (the layout's flags, beside ``--ep``)."""
    from braid.io.cli import add_moe_dispatch_arg

    add_moe_dispatch_arg(group)


def check_expert_parallel(args: argparse.Namespace, model: Any, torch_names: Sequence[str]) -> None:
    """``--ep``: a mixture-of-experts model whose experts and data-parallel ranks it divides, braid's schedules;
    ``--moe-dispatch`` one that runs at this layout; a whole-step CUDA graph only where the routing needs no
    host read (ep=1 tp=1, or ``--moe-dispatch padded`` at tp=1) (raises ``ValueError``)."""
    from braid.io.cli import check_moe_dispatch
    from braid.runtime.expert_parallel import check_expert_layout
    from braid.runtime.graphs import config_reason

    experts = getattr(model.cfg, "experts", None)
    if args.moe_dispatch != "splits" and experts is None:
        raise ValueError(f"--moe-dispatch {args.moe_dispatch} moves a mixture of experts' rows; this model has no experts "
                         "(e.g. --model qwen3-moe-tiny)")
    check_moe_dispatch(args.moe_dispatch, ep=args.ep, tp=args.tp)
    if experts is not None and args.cuda_graph == "step":
        why = config_reason("cuda", tp=args.tp, ep=args.ep, moe=True, moe_dispatch=args.moe_dispatch)
        if why:
            raise ValueError(f"--cuda-graph step: {why}; use --cuda-graph none")
    if args.ep == 1:
        return
    if experts is None:
        raise ValueError(f"--ep {args.ep} needs a mixture-of-experts model (e.g. --model qwen3-moe-tiny); this one has no experts")
    check_expert_layout(args.ep, args.dp, experts=experts, cp=args.cp, tp=args.tp)
    if torch_names:
        raise ValueError(f"--ep {args.ep}: {torch_names[0]} has no expert parallelism; use braid's schedules")
    if (args.save or args.resume) and args.tp > 1:
        raise ValueError(f"--ep {args.ep} --tp {args.tp}: --save/--resume keep expert shards at tp=1 only for now; "
                         "--save-hf writes the trained model")
