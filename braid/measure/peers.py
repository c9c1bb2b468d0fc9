"""The external peers' rows of ``python -m braid.bench``: which baselines run in which modes.

Every baseline (:data:`braid.baselines.torch_pp.BASELINES`) runs in every mode of its peer
(:mod:`braid.baselines.modes`): by default torch eager and torch's best (torchtitan's TP with
per-layer compile and async TP at tp > 1, compile at tp = 1), megatron-core eager and
graphed (and for a mixture of experts, megatron-core's EP all-to-all overlap, ``a2a_overlap``).
A row is named by its schedule and mode (``torch:ScheduleZBVZeroBubble [compile]``); a mode that
cannot run on the job's device, or on its model (megatron-core's graph over a dropless MoE), is a
row that says why, not a failure.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, replace
from typing import Any, Sequence

from braid.baselines.modes import (
    DEFAULT_MCORE_MODES,
    PeerMode,
    default_mcore_modes,
    default_torch_modes,
    mode_unavailable,
    parse_modes,
    peer_of,
    row_label,
)


COMPILE_TIMEOUT_S = 300.0  # the torch baselines' collectives wait this long (first steps compile)


@dataclass(frozen=True, slots=True)
class PeerRun:
    """One external row: baseline ``name`` in ``mode``; ``why``: the reason it cannot run here, or None."""

    name: str
    mode: PeerMode
    label: str
    why: str | None

    @property
    def peer(self) -> str:
        return peer_of(self.name)


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """The bench's flags choosing the external baselines and their modes."""
    ap.add_argument("--baselines", nargs="+", metavar="NAME",
                    help="external baselines (default: torch_1f1b_i torch_zb_v torch_dualpipe_v, and mcore_1f1b_i when "
                         "megatron-core is installed)")
    ap.add_argument("--torch-modes", nargs="+", metavar="MODE",
                    help="modes of the torch baselines, parts eager|titan|compile|async_tp joined with '+' "
                         "(default: eager titan+compile+async_tp at tp > 1, eager compile at tp = 1)")
    ap.add_argument("--mcore-modes", nargs="+", metavar="MODE", default=list(DEFAULT_MCORE_MODES),
                    help="modes of the megatron-core baseline, parts eager|graphed|te|a2a_overlap joined with '+' "
                         "(default: eager graphed; a2a_overlap: a mixture of experts' EP all-to-all overlap, ep > 1, bf16)")


def peer_runs_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace, tp: int, device_type: str,
                        pc: Any = None) -> list[PeerRun]:
    """The rows the flags ask for (``ap.error`` -- exit 2 -- on a bad name or mode); with the job's profile config
    ``pc``, a row its model cannot run says why (:func:`with_model_refusals`)."""
    from braid.baselines.torch_pp import BASELINES, available_baselines

    names = args.baselines or available_baselines()
    bad = [n for n in names if n not in BASELINES]
    if bad:
        ap.error(f"unknown baseline {bad[0]!r}; valid names: {', '.join(BASELINES)}")
    try:
        runs = peer_runs(names, args.torch_modes or default_torch_modes(tp), args.mcore_modes, tp, device_type)
        return runs if pc is None else with_model_refusals(runs, pc)
    except ValueError as err:
        ap.error(str(err))
        raise  # unreachable: ap.error exits


def peer_runs_default(pc: Any) -> list[PeerRun]:
    """The default rows for a job of profile config ``pc``: every available baseline in its peer's default modes
    (megatron-core's EP overlap too for a mixture of experts)."""
    from braid.baselines.megatron_moe import is_moe
    from braid.baselines.torch_pp import available_baselines

    return with_model_refusals(peer_runs(available_baselines(), default_torch_modes(pc.tp),
                                         default_mcore_modes(is_moe(pc.model)), pc.tp, pc.device), pc)


def with_model_refusals(runs: Sequence[PeerRun], pc: Any) -> list[PeerRun]:
    """``runs`` with each megatron-core row that the job's model, ``ep`` (``pc.ep``, 1 where the config has none)
    and dtype rule out saying why (:func:`braid.baselines.megatron_moe.mode_refusal`: graphed over a dropless MoE,
    the EP overlap without experts, at ep = 1 or in float32), so it is reported without being built."""
    import torch

    from braid.baselines.megatron_moe import mode_refusal

    ep, dtype = getattr(pc, "ep", 1), getattr(torch, pc.dtype)
    return [replace(r, why=r.why or mode_refusal(r.mode, pc.model, ep=ep, dtype=dtype, pp=pc.pp)) if r.peer == "mcore"
            else r for r in runs]


def peer_runs(names: Sequence[str], torch_modes: Sequence[str], mcore_modes: Sequence[str], tp: int,
              device_type: str) -> list[PeerRun]:
    """Every ``(baseline, mode)`` row, each with why it cannot run on ``device_type`` (or None)."""
    from braid.baselines.torch_pp import baseline_label

    return [PeerRun(n, mode, row_label(baseline_label(n), mode), mode_unavailable(n, mode, device_type, tp))
            for n, mode in parse_modes(names, torch_modes, mcore_modes, tp)]


def torch_groups(run: PeerRun, groups: Any, device: Any, shared: dict[str, Any]) -> Any:
    """The torch baselines' process groups for ``run`` (None for another peer), made on first use and kept
    in ``shared`` for the job, so that every torch pipeline reuses one compilation of its layers.

    A compiled layer's cached code does not depend on Inductor's flags (async TP is one), so when
    ``run`` compiles in another mode than the job's last compiled run, the compile caches are
    dropped first. Collective for torch runs (every rank runs the same rows in the same order).
    """
    if run.peer != "torch":
        return None
    from braid.baselines.torch_pp import BaselineGroups

    if "groups" not in shared:
        # Ranks compile a compiled mode's layers side by side, each in its own time, while its
        # peer waits in the first collective: the groups' timeout leaves room for that.
        shared["groups"] = BaselineGroups.create(groups, device, timeout_s=COMPILE_TIMEOUT_S)
    if run.mode.compile:
        if shared.get("compiled", run.mode) != run.mode:
            import torch._dynamo

            torch._dynamo.reset()
        shared["compiled"] = run.mode
    return shared["groups"]


def peer_fields(run: PeerRun) -> dict[str, Any]:
    """What a row's JSON says of its peer: ``{"peer": "torch", "mode": "titan+compile+async_tp"}``."""
    return {"peer": run.peer, "mode": run.mode.label}


def peers_note(runs: Sequence[PeerRun]) -> str:
    """One report line: the modes each peer ran in."""
    by_peer: dict[str, list[str]] = {}
    for r in runs:
        if r.mode.label not in by_peer.setdefault(r.peer, []):
            by_peer[r.peer].append(r.mode.label)
    return "external modes: " + "; ".join(f"{p}: {', '.join(m)}" for p, m in sorted(by_peer.items()))


def best_per_peer(runs: list[dict[str, Any]], external: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per m and per peer: braid's best schedule over that peer's best row (any schedule, any mode),
    as tokens/s, per round (``{m: {peer: {"rounds", "median", "min", "max", "best_rows"}}}``);
    ``best_rows`` names the peer's fastest row in each round."""
    out: dict[int, dict[str, Any]] = {}
    for m in sorted({r["m"] for r in runs}):
        ours = [r["step_s_rounds"] for r in runs if r["m"] == m]
        for peer in sorted({e.get("peer", "") for e in external if e["m"] == m and "step_s_rounds" in e}):
            theirs = [e for e in external if e["m"] == m and e.get("peer", "") == peer and "step_s_rounds" in e]
            n = min(len(x) for x in ours + [e["step_s_rounds"] for e in theirs])
            best = [min(theirs, key=lambda e: e["step_s_rounds"][i]) for i in range(n)]
            ratios = [b["step_s_rounds"][i] / min(o[i] for o in ours) for i, b in enumerate(best)]
            out.setdefault(m, {})[peer] = {"rounds": ratios, "median": statistics.median(ratios), "min": min(ratios),
                                           "max": max(ratios), "best_rows": [b["schedule"] for b in best]}
    return out


def format_per_peer(per_peer: dict[int, dict[str, Any]]) -> list[str]:
    """Report lines for :func:`best_per_peer`: one per m and peer, with the peer's best row named."""
    lines = []
    for m, peers in sorted(per_peer.items()):
        for peer, b in sorted(peers.items()):
            rows = sorted(dict.fromkeys(b["best_rows"]), key=b["best_rows"].count, reverse=True)  # ties: first round first
            spread = f" [{b['min']:.3f}, {b['max']:.3f}]" if len(b["rounds"]) > 1 else ""
            lines.append(f"braid's best / {peer}'s best at m={m}: {b['median']:.3f}x{spread}; {peer}'s best row: "
                         + ", ".join(f"{r} ({b['best_rows'].count(r)}/{len(b['best_rows'])} rounds)" for r in rows))
    return lines
