"""A bench job's results: measured against predicted per run, braid's best over the best external
baseline per round, the printed table and the stored measurement sets (``--capture``)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from braid.io.files import atomic_write_text
from braid.io.inputs import InputFileError, read_json
from braid.io.limits import MEASUREMENTS
from braid.io.trace import Trace
from braid.measure.calibrate import predict, rel_err
from braid.measure.config import BenchConfig
from braid.measure.device_prediction import is_dense_decoder, predicted_device_used
from braid.measure.experts import expert_load, format_moe_runs, moe_run_fields
from braid.measure.peers import best_per_peer, format_per_peer

MEASUREMENTS_FORMAT = "braid-measurements/1"


def summarize(bc: BenchConfig, raw: dict[str, Any]) -> dict[str, Any]:
    """Measured vs predicted figures per run (the ``--json`` document)."""
    pc = bc.profile
    doc = raw["profile"]
    memory = "allocator_peak" if pc.device == "cuda" else "instruction_end"
    tokens = pc.seq * pc.micro_batch_size
    vision = pc.vision is not None
    flops = doc.get("model_flops_per_sample", 0.0)
    backend = doc.get("meta", {}).get("tp_backend") or pc.tp_backend  # as the run resolved "auto" (or "all")
    out_runs = []
    traces = {}
    by_round = _round_steps(raw["runs"])
    walls: dict[tuple[str, int], list] = {}
    for r in sorted(raw["runs"], key=lambda r: r.get("round", 0)):
        walls.setdefault((r["schedule"], r["m"]), []).append(r["ranks"][0].get("wall"))
    for r in raw["runs"]:
        if r.get("round", 0) != 0:
            continue  # later rounds only add step times (step_s_rounds)
        ranks = r["ranks"]
        rounds = by_round[(r["schedule"], r["m"])]
        step_s = statistics.median(rounds)
        # one figure per pipeline rank: the max over its TP ranks and replicas (global rank = (dp * pp + pp_rank) * tp + tp_rank)
        peaks = [max(ranks[(d * pc.pp + p) * pc.tp + t]["peak"] for d in range(pc.dp) for t in range(pc.tp)) for p in range(pc.pp)]
        mode = ranks[0].get("cuda_graph")  # a graph replay has no host lane
        sim, pred_peaks = predict(doc, r["schedule"], r["m"], pc.pp, pc.tp, pc.layers_per_stage, memory, mode, vision,
                                  pc.moe_layers)
        pred = sim.report.step_time_s
        raw_pred = None
        if raw.get("raw_profile") is not None:
            raw_pred = predict(raw["raw_profile"], r["schedule"], r["m"], pc.pp, pc.tp, pc.layers_per_stage, memory,
                               mode, vision, pc.moe_layers)[0].report.step_time_s
        # every data-parallel replica runs m micro-batches: the job's tokens and FLOPs are dp times one pipeline's
        mfu = pc.dp * r["m"] * pc.micro_batch_size * flops / (step_s * pc.world_size * pc.peak_flops) if pc.peak_flops else 0.0
        out_runs.append({"schedule": r["schedule"], "m": r["m"], "step_s": step_s, "step_s_rounds": rounds,
                         "step_s_all": slowest_rank_steps(ranks),
                         "tokens_per_s": pc.dp * r["m"] * tokens / step_s, "mfu": mfu, "peak_bytes": peaks,
                         "predicted_step_s": pred, "step_err": rel_err(pred, step_s), "predicted_peak_bytes": pred_peaks,
                         "raw_predicted_step_s": raw_pred,
                         "raw_step_err": rel_err(raw_pred, step_s) if raw_pred is not None else None,
                         "peak_err": max((abs(rel_err(p, q)) for p, q in zip(pred_peaks, peaks)), default=0.0),
                         "host_s": _host_s(ranks), "cuda_graph": ranks[0].get("cuda_graph"),
                         "graph_pool_bytes": [rk.get("graph_pool_bytes") for rk in ranks],
                         "reserve_breakdown": [rk.get("reserve_breakdown") for rk in ranks],  # where the reserve lies (CUDA)
                         "reserved_peak_bytes": [rk.get("reserved") for rk in ranks],  # per rank, absolute (CUDA)
                         "device_used_bytes": [rk.get("device_used") for rk in ranks],  # nvidia-smi's view (CUDA)
                         "predicted_device_used_bytes": _predicted_used(pc, r["schedule"], r["m"], pred_peaks, mode, backend,
                                                                         sim.trace),
                         "loss": next((rk["loss"] for rk in ranks if rk["loss"] is not None), None),
                         "braided_blocks": ranks[0].get("braided_blocks"),
                         # where its time went: the epoch seconds of each round's measured steps (rank 0),
                         # and the busy time per rank, chunk and phase of the recorded step after them
                         "timed_wall_rounds": walls[(r["schedule"], r["m"])],
                         "busy_per_chunk_s": _chunk_busy(ranks), "compute_s": _per_rank(ranks, "compute_s"),
                         "compute_kernels": _per_rank(ranks, "compute_kernels"),
                         **moe_run_fields(pc, ranks, sim, r["m"], doc)})
        measured = [rk["trace"] for rk in ranks if rk["trace"] is not None]
        load = expert_load([rk.get("routes") for rk in ranks], pc.ep, pc.tp, "one step, all replicas")
        merged = Trace({"schedule": r["schedule"], "source": "measured", "m": r["m"], "device": pc.device,
                        **({"expert_load": load.to_dict()} if load is not None else {})},
                       [e for t in measured for e in t.events], {k: v for t in measured for k, v in t.memory.items()})
        traces[f"{r['schedule']}_m{r['m']}"] = (sim.trace, merged)
    ext = []
    ext_rounds = _round_steps([e for e in raw["external"] if "error" not in e])
    for e in raw["external"]:
        if e.get("round", 0) != 0:
            continue
        if "error" in e:
            ext.append({k: v for k, v in e.items() if k != "round"})
            continue
        rk = e["ranks"]
        rounds = ext_rounds[(e["schedule"], e["m"])]
        step_s = statistics.median(rounds)
        peaks = [x["peak"] for x in rk] if rk[0]["peak"] is not None else None
        ext.append({"schedule": e["schedule"], "peer": e.get("peer"), "mode": e.get("mode"), "m": e["m"], "step_s": step_s,
                    "step_s_rounds": rounds,
                    "tokens_per_s": pc.dp * e["m"] * tokens / step_s, "peak_bytes": peaks,
                    "reserved_peak_bytes": [x.get("reserved") for x in rk],
                    "device_used_bytes": [x.get("device_used") for x in rk],
                    "host_s": _host_s(rk), "compute_s": _per_rank(rk, "compute_s"),
                    "compute_kernels": _per_rank(rk, "compute_kernels")})
    cfg = {**asdict(pc), "model": asdict(pc.model), "schedules": list(bc.schedules), "mbs": list(bc.mbs),
           "warmup": bc.warmup, "steps": bc.steps, "rounds": bc.rounds, "tp_backend": backend}
    done = 1 + max((r.get("round", 0) for r in raw["runs"] + raw["external"]), default=-1)
    return {"config": cfg, "device": doc.get("meta", {}).get("device"), "memory": memory, "rounds_done": done, "runs": out_runs,
            "external": ext, "best_over_external": round_ratios(out_runs, ext), "ranking": ranking(out_runs),
            "best_per_peer": best_per_peer(out_runs, ext), "compute_bound": compute_bound(out_runs, ext),
            "notes": raw["notes"] + [_megatron_line()], "profile": doc, "raw_profile": raw.get("raw_profile"),
            "memory_snapshot": raw.get("memory_snapshot"), "_traces": traces}


def _predicted_used(pc, schedule: str, m: int, peaks: list[float], mode: str | None, backend: str,
                    trace: Trace) -> list[float] | None:
    """Per rank, the device memory in use :mod:`braid.cost.device_memory` predicts (CUDA, dense decoder LMs;
    None otherwise); ``backend``: the TP backend the run used; ``trace``: the simulated step (when a graphed
    step's gradients are allocated)."""
    cfg = {**asdict(pc), "model": asdict(pc.model), "tp_backend": backend}
    if pc.device != "cuda" or pc.vision is not None or not is_dense_decoder(cfg["model"]):
        return None
    from braid import schedules

    return predicted_device_used(cfg, schedule, schedules.build(schedule, pc.pp, m).placement, peaks, mode == "step",
                                 trace=trace, m=m)


def _chunk_busy(ranks: list[dict[str, Any]]) -> dict[str, float] | None:
    """Busy seconds per rank, chunk and phase (``r<rank>c<chunk><phase>``) of a run's recorded step,
    merged over the ranks that recorded one (None where none did)."""
    got = [rk["chunk_busy"][0] for rk in ranks if rk.get("chunk_busy")]
    return {k: v for b in got for k, v in b.items()} or None


def _per_rank(ranks: list[dict[str, Any]], key: str) -> list[Any] | None:
    """Each rank's ``key`` from its profiled step (``--compute-busy``: ``compute_s``, ``compute_kernels``),
    or None where a rank did not measure it."""
    got = [rk.get(key) for rk in ranks]
    return None if any(g is None for g in got) else got


def compute_bound(runs: list[dict[str, Any]], external: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per m with profiled compute (``--compute-busy``): how far a schedule of this partition and these
    kernels could go.

    A step is at least its busiest rank's compute, and no placement of the same work is shorter than
    the ranks' mean compute. Over braid's runs at m, the least busiest-rank figure (``busiest_s``, its
    schedule ``busiest_of``) and the least mean (``mean_s``, ``mean_of``); against the best baseline
    row's median step (``external``, ``external_step_s``), ``ceiling`` = that step / ``busiest_s``
    (what no schedule of this partition can beat) and ``ceiling_balanced`` = that step / ``mean_s``
    (the work spread evenly, no bubble)."""
    out: dict[int, dict[str, Any]] = {}
    for m in sorted({r["m"] for r in runs}):
        rs = [r for r in runs if r["m"] == m and r.get("compute_s")]
        if not rs:
            continue
        busiest = min(rs, key=lambda r: max(r["compute_s"]))
        even = min(rs, key=lambda r: statistics.mean(r["compute_s"]))
        row = {"busiest_s": max(busiest["compute_s"]), "busiest_of": busiest["schedule"],
               "mean_s": statistics.mean(even["compute_s"]), "mean_of": even["schedule"]}
        ext = [e for e in external if e["m"] == m and "step_s" in e]
        if ext:
            best = min(ext, key=lambda e: e["step_s"])
            row.update(external=best["schedule"], external_step_s=best["step_s"],
                       ceiling=best["step_s"] / row["busiest_s"], ceiling_balanced=best["step_s"] / row["mean_s"])
        out[m] = row
    return out


def format_compute(summary: dict[str, Any]) -> list[str]:
    """The report's lines on profiled compute per rank and the ceiling it sets (``--compute-busy``)."""
    lines = []
    ms = lambda xs: "/".join(f"{x * 1e3:.1f}" for x in xs)  # noqa: E731
    for m, b in sorted(summary.get("compute_bound", {}).items()):
        rows = [f"{r['schedule']} {ms(r['compute_s'])}" for r in summary["runs"] if r["m"] == m and r.get("compute_s")]
        rows += [f"{e['schedule']} {ms(e['compute_s'])}" for e in summary["external"] if e["m"] == m and e.get("compute_s")]
        lines.append(f"compute per rank at m={m} (ms, one profiled step, NCCL kernels and copies left out): " + "; ".join(rows))
        line = (f"ceiling at m={m}: braid's busiest rank computes at least {b['busiest_s'] * 1e3:.1f} ms ({b['busiest_of']}), "
                f"its ranks {b['mean_s'] * 1e3:.1f} ms on average ({b['mean_of']})")
        if "ceiling" in b:
            line += (f"; against the best baseline row ({b['external']}, {b['external_step_s'] * 1e3:.1f} ms) no schedule of "
                     f"this partition and these kernels gets past {b['ceiling']:.3f}x, the work spread evenly with no "
                     f"bubble {b['ceiling_balanced']:.3f}x")
        lines.append(line)
    return lines


def _host_s(ranks: list[dict[str, Any]]) -> float | None:
    """CPU seconds per step of the thread that launches it: the median step, of the busiest rank."""
    return max((statistics.median(rk["host"]) for rk in ranks if rk.get("host")), default=None)


def slowest_rank_steps(ranks: list[dict[str, Any]]) -> list[float]:
    """Each measured step's time: that of its slowest rank (every rank reports ``times``)."""
    return [max(rk["times"][i] for rk in ranks) for i in range(len(ranks[0]["times"]))]


def _round_steps(runs: list[dict[str, Any]]) -> dict[tuple[str, int], list[float]]:
    """Per (schedule, m), the median step of each round, in round order."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in sorted(runs, key=lambda r: r.get("round", 0)):
        out.setdefault((r["schedule"], r["m"]), []).append(statistics.median(slowest_rank_steps(r["ranks"])))
    return out


def round_ratios(runs: list[dict[str, Any]], external: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per m: braid's best schedule over the best external baseline, as tokens/s, taken within
    each round (every run of a round ran in turn, so a host that drifts between rounds moves
    both sides): ``{m: {"rounds": [...], "median": .., "min": .., "max": ..}}``. Only for m
    with both sides measured in every round."""
    out: dict[int, dict[str, Any]] = {}
    for m in sorted({r["m"] for r in runs}):
        ours = [r["step_s_rounds"] for r in runs if r["m"] == m]
        theirs = [e["step_s_rounds"] for e in external if e["m"] == m and "step_s_rounds" in e]
        if not ours or not theirs:
            continue
        n = min(len(x) for x in ours + theirs)
        ratios = [min(t[i] for t in theirs) / min(o[i] for o in ours) for i in range(n)]
        out[m] = {"rounds": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


RANK_GAP = 0.03  # two schedules whose measured steps differ by more than this must be ranked right


def ranking(runs: list[dict[str, Any]], gap: float = RANK_GAP) -> dict[int, dict[str, Any]]:
    """Per m: braid's schedules in measured and in predicted order (fastest first), and every pair
    whose measured steps differ by more than ``gap`` that the prediction orders the other way
    (``wrong``: ``[faster, slower, measured gap]``). The simulator exists to say which schedule
    wins before launch; this is that claim, checked."""
    out: dict[int, dict[str, Any]] = {}
    for m in sorted({r["m"] for r in runs}):
        rs = [r for r in runs if r["m"] == m]
        wrong = [[a["schedule"], b["schedule"], b["step_s"] / a["step_s"] - 1] for a in rs for b in rs
                 if b["step_s"] > a["step_s"] * (1 + gap) and b["predicted_step_s"] <= a["predicted_step_s"]]
        out[m] = {"measured": [r["schedule"] for r in sorted(rs, key=lambda r: r["step_s"])],
                  "predicted": [r["schedule"] for r in sorted(rs, key=lambda r: r["predicted_step_s"])], "wrong": wrong}
    return out


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def format_device_memory(summary: dict[str, Any]) -> list[str]:
    """Per row (CUDA), each rank's allocator reserved peak and the device's memory in use after
    the counted steps (``braid.measure.runs._device_memory``): what runs out, beside the table's
    allocator peaks; braid's rows add the in-use figure :mod:`braid.cost.device_memory` predicts.
    Nothing on CPU."""
    rows = [r for r in summary["runs"] + summary["external"] if any(r.get("reserved_peak_bytes") or [])]
    if not rows:
        return []
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    out = ["device memory per rank, MiB (allocator reserved peak / in use on the device; braid rows: "
           "/ predicted in use, braid.cost.device_memory):"]
    for r in rows:
        pred = r.get("predicted_device_used_bytes") or []
        per = " ".join(f"{mib(a)}/{mib(b)}" + (f"/{mib(pred[i])}" if i < len(pred) else "")
                       for i, (a, b) in enumerate(zip(r["reserved_peak_bytes"], r.get("device_used_bytes") or [])))
        out.append(f"  {r['schedule']} m={r['m']}: {per}")
    split = [(r, b) for r in summary["runs"] for b in (r.get("reserve_breakdown") or [])[:1] if b]
    if split:
        out.append("where rank 0's reserve lies after the counted steps, MiB (graph pool; other segments, in use; of those "
                   "partly in use, in use):")
        out += [f"  {r['schedule']} m={r['m']}: {mib(b['pool_bytes'])}; {mib(b['other_bytes'])}, {mib(b['other_active_bytes'])}; "
                f"{mib(b['pinned_bytes'])}, {mib(b['pinned_active_bytes'])}" for r, b in split]
    return out


def format_report(summary: dict[str, Any]) -> str:
    """The text table: one line per run, measured next to predicted."""
    w = max([28] + [len(r["schedule"]) + 2 for r in summary["runs"] + summary["external"]])  # baseline rows name their mode
    head = (f"{'schedule':<{w}}{'m':>3}{'step ms':>10}{'pred ms':>10}{'err %':>8}{'raw %':>8}{'tokens/s':>11}{'MFU %':>7}"
            f"{'host ms':>9}  peak MiB per rank (measured / predicted)")
    lines = [head, "-" * len(head)]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    for r in summary["runs"]:
        peaks = " ".join(f"{mib(a)}/{mib(b)}" for a, b in zip(r["peak_bytes"], r["predicted_peak_bytes"]))
        raw_err = f"{100 * r['raw_step_err']:>+8.1f}" if r.get("raw_step_err") is not None else f"{'-':>8}"
        lines.append(f"{r['schedule']:<{w}}{r['m']:>3}{r['step_s'] * 1e3:>10.2f}{r['predicted_step_s'] * 1e3:>10.2f}"
                     f"{100 * r['step_err']:>+8.1f}{raw_err}{r['tokens_per_s']:>11.0f}{100 * r['mfu']:>7.1f}"
                     f"{_ms(r.get('host_s')):>9}  {peaks}" + ("  [CUDA graph]" if r.get("cuda_graph") == "step" else ""))
    for e in summary["external"]:
        if "error" in e:
            lines.append(f"{e['schedule']:<{w}}{e['m']:>3}  could not run: {e['error']}")
        else:
            peaks = " ".join(mib(b) for b in e["peak_bytes"]) if e["peak_bytes"] else "-"
            lines.append(f"{e['schedule']:<{w}}{e['m']:>3}{e['step_s'] * 1e3:>10.2f}{'-':>10}{'-':>8}{'-':>8}{e['tokens_per_s']:>11.0f}"
                         f"{'-':>7}{_ms(e.get('host_s')):>9}  {peaks}")
    for m, rk in sorted(summary.get("ranking", {}).items()):
        if len(rk["measured"]) > 1:
            flag = "; ".join(f"{a} measured {100 * g:.1f}% faster than {b} but predicted slower" for a, b, g in rk["wrong"])
            lines.append(f"order at m={m}: measured {' < '.join(rk['measured'])}; predicted {' < '.join(rk['predicted'])}"
                         + (f"  RANKED WRONG: {flag}" if flag else ""))
    for m, b in sorted(summary.get("best_over_external", {}).items()):
        n = len(b["rounds"])
        spread = f" [{b['min']:.3f}, {b['max']:.3f}] over {n} rounds" if n > 1 else " (one round; --rounds N gives a spread)"
        lines.append(f"braid's best / best external baseline at m={m} (tokens/s, within a round): {b['median']:.3f}x{spread}")
    lines += format_moe_runs(summary)
    lines += format_per_peer(summary.get("best_per_peer", {}))
    lines += format_device_memory(summary)
    lines += format_compute(summary)
    cal = summary["profile"].get("meta", {}).get("calibration")
    if cal:
        fitted = {k: v for k, v in cal.items() if k in ("p2p_s", "ar_scale", "a2a_scale", "host_task_s", "compute_factor")}
        scales = " ".join(f"{ph}={v:.3f}" for ph, v in cal.get("compute_scale_per_phase", {}).items())
        if cal.get("compute_scale_per_stage"):  # a graphed tp=1 probe's busy time per stage (F, then BW)
            scales += " per stage (F/BW) " + " ".join(f"{k}:{sc['F']:.3f}/{sc['B']:.3f}"
                                                      for k, sc in sorted(cal["compute_scale_per_stage"].items()))
        graphed = cal.get("cuda_graph") == "step"
        lines.append(f"calibration ({cal['probe']}{', graphed: no host lane' if graphed else ''}): compute scale {scales}; "
                     f"host time per unit task profiled {cal.get('profiled_host_task_s', 0.0) * 1e6:.0f} us; "
                     + (", ".join(f"{k}={v:.4g}" for k, v in fitted.items()) or "no communication figure")
                     + (f"; probe predicted {100 * cal['probe_error']:+.1f}%" if abs(cal.get("probe_error", 0.0)) > 0.005 else "")
                     + "; 'raw %' is the uncalibrated profile's error")
    lines += [f"note: {n}" for n in summary["notes"]]
    return "\n".join(lines)


def read_measurements(path: str | Path) -> dict[str, Any]:
    """A stored-measurements file (``braid-measurements/1``), or an empty one if ``path`` does not exist;
    a file that is not one is a ``ValueError`` naming it."""
    p = Path(path)
    if not p.exists():
        return {"format": MEASUREMENTS_FORMAT, "sets": []}
    try:
        doc = read_json(p, "measurements file", expect=object, limit=MEASUREMENTS)
    except InputFileError as err:
        raise ValueError(f"{err}"[:400]) from None
    fmt = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
    if fmt != MEASUREMENTS_FORMAT or not isinstance(doc.get("sets"), list):
        raise ValueError(f"{p}: not a measurements file (format={fmt!r}, expected {MEASUREMENTS_FORMAT!r} with a 'sets' list)")
    return doc


def capture(summary: dict[str, Any], path: str | Path, name: str) -> None:
    """Add (or replace) the set ``name`` in a stored-measurements file (``braid-measurements/1``),
    written atomically: a run killed while capturing leaves the previous file whole."""
    add_set(path, set_entry(summary, name))


def add_set(path: str | Path, entry: dict[str, Any]) -> None:
    """Add (or replace) the set ``entry["name"]`` in a stored-measurements file, atomically."""
    p = Path(path)
    doc = read_measurements(p)
    doc["sets"] = [s for s in doc["sets"] if s.get("name") != entry["name"]] + [entry]
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(doc, indent=1))


# a run's device memory (GPU: reserved peak, in use, graph pool per rank; the predicted allocator peak per
# pipeline rank that predicts them), so a stored set holds the device-memory model to it as to the step time
DEVICE_MEMORY_KEYS = ("reserved_peak_bytes", "device_used_bytes", "graph_pool_bytes", "predicted_peak_bytes", "reserve_breakdown")


def set_entry(summary: dict[str, Any], name: str) -> dict[str, Any]:
    """The stored set of a bench summary (the ``--json`` document)."""
    cfg = summary["config"]
    import os

    return {"name": name, "device": summary["device"], "memory": summary["memory"],
            # runnable processes per core over the last minute when captured: > 1 means the
            # machine was oversubscribed and the step times are not a timing reference
            "load_per_core": os.getloadavg()[0] / (os.cpu_count() or 1),
            "layout": {"tp": cfg["tp"], "pp": cfg["pp"], "v": cfg["v"], "layers_per_stage": list(cfg["layers_per_stage"])},
            "model": cfg["model"], "seq": cfg["seq"], "micro_batch_size": cfg["micro_batch_size"], "dtype": cfg["dtype"],
            "runs": [{k: r.get(k) for k in ("schedule", "m", "step_s", "step_s_all", "peak_bytes", "step_s_rounds", "host_s",
                                            "cuda_graph", *DEVICE_MEMORY_KEYS)} for r in summary["runs"]],
            # what the device-memory model needs besides the layout and model (braid.measure.device_prediction)
            "tp_backend": cfg.get("tp_backend", "auto"), "tp_max_ctas": cfg.get("tp_max_ctas"),
            # the calibrated profile the runs are predicted from, and the profile before the
            # calibration (None when the run read --costs): with the probe's evidence in
            # profile.meta.calibration, enough to re-fit the calibration offline
            "profile": summary["profile"], "raw_profile": summary.get("raw_profile")}


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------
def _megatron_line() -> str:
    from braid.baselines import megatron_gpt as megatron

    if not megatron.available():
        return "megatron-core interleaved 1F1B: not installed (pip install -e '.[megatron]' to compare against it)"
    return ("megatron-core interleaved 1F1B ('mcore:' rows): its GPT model (local layer spec, SDPA attention) "
            "with the same weights; its no-pipelining schedule at pp=1")
