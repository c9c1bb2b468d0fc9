"""``python -m braid.profile``: measure a cost file (``docs/costs.md``) on the machine it runs on.

The simulator is only as good as its costs. This profiler builds the executor's own model
chunks (:func:`braid.models.build.build_rank_chunks`) for a layout (tp, pp, chunks,
layers per stage) and times every unit task of every chunk back to back, as the executor
runs them, through the very call the executor makes (``ModelChunk.run(mb, UnitTask)``):
forward, activation-backward and weight-backward, median of ``--iters`` runs (CUDA events
recorded between the tasks without synchronising on GPU, ``perf_counter`` on CPU), and on
GPU the host time to issue one unit task (``host_task_s``, the simulator's host lane). It also measures the TP all-reduce of a boundary activation alone and overlapped
with a GEMM (-> ``ar_slowdown``, paper Appendix F) and, on GPU, how much longer it takes
while GEMMs run beside it (-> ``ar_stretch``), the P2P time of the stage-boundary
activation, the host-copy bandwidth (pinned host<->device on GPU, a memcpy on CPU), and
the activation bytes each unit keeps (``torch.cuda.memory_allocated`` deltas on GPU, the
chunk's ``live_bytes()`` on CPU), what a split backward keeps until W, and on GPU each
unit's workspace (allocator peak during the unit above what it keeps: logits, MLP
intermediates), which the simulator holds while the unit runs.

A vision-language ``--model`` (``qwen2-vl-*``, ``qwen2.5-vl-*``) is profiled as ``examples/qwen2_vl.py``
runs it (:func:`braid.models.vision_chunk.build_vlm_rank_chunks`): its vision chunk (patch embedding,
ViT blocks, ``merge``; one ``--image-size`` image per sample) is stage 0, so the file carries the
tower's unit costs and ``braid.simulate --model qwen2-vl-...`` predicts the whole step from them.

A mixture-of-experts ``--model`` at ``--ep E`` spawns E data-parallel replicas of the layout, its experts
sharded over them (:mod:`braid.measure.experts`): the MoE units are timed as above (the experts' as the
busiest replica ran them), and the all-to-all on the expert-parallel group (one row exchange at this
shape, the counts' exchange; ``meta.comm.a2a_s``), scaled by the busiest replica's share of the rows
(``meta.moe``: routing counts, imbalance), gives each MoE unit's ``T_A2A``/``T_A2A_B``.

Chunks are keyed by virtual stage in the written file, so one profile serves every
placement (loop or V) of the same stage split. It spawns ``tp * pp`` (times ``--ep``) processes itself
(gloo on CPU, NCCL on GPU). Examples::

    python -m braid.profile --preset tiny --pp 2 --layers-per-stage 1 --seq 16 -o costs.json
    python -m braid.profile --preset 7b-layer --tp 2 --pp 1 --layers-per-stage 1 --seq 4096 --device cuda -o h200.json
    python -m braid.simulate --pp 2 --mbs 8 --tp 1 --costs costs.json
    python -m braid.profile --model qwen2-vl-tiny --pp 2 --seq 8 -o vl_costs.json
    python -m braid.profile --model qwen3-moe-tiny --ep 2 --pp 1 --seq 16 -o moe_costs.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from braid.io.cli import Parser, check_outputs, run_main
from braid.io.files import atomic_write_text
from braid.measure.config import add_model_args, config_from_args
from braid.measure.launch import JobFailed
from braid.measure.units import profile

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(prog="python -m braid.profile", description=__doc__.split("\n\n")[1],
                epilog="Examples:\n" + __doc__.split("Examples::")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("-o", "--output", default="costs.json", help="cost file to write (default costs.json)")
    ap.add_argument("--cuda-graph", choices=["none", "step"], default=None,
                    help="costs for steps replayed as whole-step CUDA graphs (step: no host time per unit task) or eager "
                         "(none); default: step where capturable (braid.runtime.graphs)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pc = config_from_args(ap, args)
    from braid.runtime.graphs import config_reason, graphed_costs

    why = config_reason(pc.device, tp=pc.tp, tp_backend=pc.tp_backend, ep=pc.ep, moe=bool(getattr(pc.model, "experts", 0)),
                        moe_dispatch=pc.moe_dispatch)
    if args.cuda_graph == "step" and why:
        ap.error(f"--cuda-graph step: {why}")
    check_outputs(ap, [("-o", args.output)])
    try:
        doc = graphed_costs(profile(pc), args.cuda_graph)
    except JobFailed as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 1
    atomic_write_text(args.output, json.dumps(doc, indent=1))
    c = doc["meta"]["comm"]
    moe = doc["meta"].get("moe")
    if moe:
        from braid.measure.experts import format_routing

        log.info("all-to-all on the EP group (ep=%d): %.3g ms per row exchange of %.0f bytes a rank, %.3g ms per counts "
                 "exchange; the busiest EP rank's at imbalance %.3f", moe["ep"], c["a2a_s"] * 1e3, c["a2a_bytes"],
                 c["a2a_counts_s"] * 1e3, moe["imbalance"])
        if moe.get("routing"):
            log.info("%s", format_routing(moe["routing"], "the profile's micro-batches"))
    log.info("wrote %s: %d stages on %s; all-reduce %.3g ms, ar_slowdown %.3f, ar_stretch %.2f, P2P %.3g ms, "
             "copy %.3g GB/s (x%.2f with both directions at once)", args.output, len(doc["chunks"]), doc["meta"]["device"],
             c["ar_s"] * 1e3, doc["ar_slowdown"], doc["ar_stretch"], c["p2p_s"] * 1e3, doc["pcie_bytes_per_s"] / 1e9,
             doc["copy_duplex_slowdown"])
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
