"""``--memory-snapshot FILE``: the CUDA caching allocator's history of one real step, and the
blocks live at its peak attributed to the model's units, the runtime and the optimizer.

A predicted peak that misses the measured one by a term (a buffer the cost model does not
know, an activation kept longer than planned) is found here by looking, not by guessing.
:func:`record_step` runs one step under ``torch.cuda.memory._record_memory_history`` (Python
stacks of every allocation and free), writes torch's snapshot pickle -- the file
https://pytorch.org/memory_viz opens -- and returns its :func:`attribute` result: the
allocator's trace of the device replayed to the moment of the highest allocated bytes (what
``torch.cuda.max_memory_allocated`` reports), and the blocks live then, grouped by term.

Where a block is charged (:data:`PLACES`, then the rules below it): the innermost frame of its
allocation's stack that lies in one of braid's places names it -- for the model (``braid/models``)
the function and line, with the unit the function belongs to where its name says so
(:data:`UNIT_OF_FUNCTION`); the runtime (``braid/runtime``: receive buffers, the gradients
sent, offload reloads); the optimizer (``braid/training``, ``torch/optim``). Before those
rules, a block still live when the step ends is named by the tensor it holds where the caller
said (``labels``: weights, gradients, optimizer state). A block with no Python frame was
allocated on autograd's backward threads (a backward op: the engine runs CUDA nodes on a
thread of its own, whose Python stack is empty). A block allocated before the recording began
is named by its pool (a CUDA graph's private pool) or as allocated before the step. Anything
else is named by its innermost frame outside torch and the standard library.

The allocator's reserve is read too (:func:`idle_reserve`): the bytes its segments hold free when the
trace ends (cached, not allocated: what fragmentation costs), grouped by the allocation that made
each segment -- so record from the first step whose segments matter (``benchmarks/bench_memory.py``
records a whole case); a segment made before the recording is named so.

Which blocks a pipeline rank holds of which micro-batch and chunk is not in the stacks (one
code path serves every chunk); the rows name the code that allocated them. Several ranks
write one file each (:func:`rank_path`). ``python -m braid.measure.snapshot FILE [--top N]``
prints the attribution of a saved snapshot.
"""

from __future__ import annotations

import linecache
import os
import pickle
import sys
import sysconfig
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from braid.core.braiding import Unit
from braid.io.cli import Parser, check_counts, run_main

# Alloc/free entries kept of the recorded step (several KB each with their stacks, torch says);
# a trace that reaches this many may have lost its start, and its report says so.
MAX_ENTRIES = 200_000
TOP = 20

# (kind, place): the innermost allocation frame whose file lies under ``place`` names the block's
# kind. braid/tp and braid/attention are not listed: their code runs inside a model unit, which
# is the more telling name.
PLACES: tuple[tuple[str, str], ...] = (
    ("model", "braid/models/"),
    ("runtime", "braid/runtime/"),
    ("optimizer", "braid/training/"),
    ("optimizer", "torch/optim/"),
)
STATE = "state"  # a tensor the caller named (weights, gradients, optimizer state), still live when the step ends
BEFORE = "before"  # allocated before the recording began, unnamed: its CUDA graph pool, or just that
BEFORE_STEP, GRAPH_POOL = "allocated before the step", "CUDA graph pool"
SEGMENT_BEFORE = "segment made before the recording"
EXPANDABLE = "expandable segment (mapped page by page, by many allocations)"
BACKWARD = "backward"  # no Python frame: allocated on autograd's backward threads
OTHER = "other"  # the innermost frame outside torch and the standard library

# Model functions whose name says which unit they serve (a shared piece, e.g. the chunk's norm,
# names no unit; its row still names the function and line).
UNIT_OF_FUNCTION: dict[str, Unit] = {
    "embed": Unit.EMBED,
    "qkv": Unit.PRE_ATTN, "project_qkv": Unit.PRE_ATTN, "split_qkv": Unit.PRE_ATTN, "split_rope_qkv": Unit.PRE_ATTN,
    "rope_qk": Unit.PRE_ATTN, "norm1": Unit.PRE_ATTN,
    "attn": Unit.ATTN, "attn_core": Unit.ATTN, "_sdpa": Unit.ATTN,
    "gate_up": Unit.PRE_MLP, "norm2": Unit.PRE_MLP,
    "mlp": Unit.MLP, "mlp_core": Unit.MLP, "swiglu": Unit.MLP, "swiglu_joined": Unit.MLP, "swiglu_down": Unit.MLP,
    "swiglu_grad": Unit.MLP, "swiglu_joined_grad": Unit.MLP,
    "route_rows": Unit.PRE_MLP, "moe_forward": Unit.EXPERTS, "run_experts": Unit.EXPERTS,
    "_loss": Unit.HEAD, "logits": Unit.HEAD,
}

_LIVE = "active_allocated"
_HELD = (_LIVE, "active_pending_free")  # a segment's blocks that are not free to reuse
_STDLIB = sysconfig.get_paths()["stdlib"]


class SnapshotError(ValueError):
    """A file that is not torch's memory snapshot, or one without a device trace."""


@dataclass(frozen=True, slots=True)
class Row:
    """One term (an allocation site ``file:line function``, or a name): the live bytes charged to it
    at the peak and its blocks."""

    kind: str
    term: str
    bytes: int
    count: int
    unit: str | None = None
    source: str = ""  # the text of the largest block's allocation line, where its file is readable here


@dataclass(frozen=True, slots=True)
class Attribution:
    """The peak of one device's trace and the blocks live then: the largest terms (most bytes first)
    and the live bytes per kind and per unit over all terms."""

    device: int
    peak_bytes: int
    peak_index: int  # the trace entry that reached the peak (-1: before the first)
    entries: int
    rows: list[Row] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)
    by_unit: dict[str, int] = field(default_factory=dict)
    truncated: bool = False  # the trace holds MAX_ENTRIES: it may have lost its start
    reserved_bytes: int = 0  # the device's segments when the trace ends
    idle_bytes: int = 0  # of those, free (cached)
    idle: list[Idle] = field(default_factory=list)  # idle_reserve's largest rows


@dataclass(frozen=True, slots=True)
class Idle:
    """The segments one allocation site made (``count``): their reserved bytes and the bytes free in them
    when the trace ends (kept by the allocator's cache, allocated to nothing)."""

    kind: str
    term: str
    reserved: int
    idle: int
    count: int
    source: str = ""


# ----------------------------------------------------------------------------------------
# Attribution (pure Python over torch's snapshot dict)
# ----------------------------------------------------------------------------------------
def _norm(path: str) -> str:
    return path.replace("\\", "/")


def _foreign(filename: str) -> bool:
    """torch's own code, the standard library, or generated code (``<eval_with_key>``, ``<frozen ...>``)."""
    f = _norm(filename)
    return "/torch/" in f or f.startswith("<") or (f.startswith(_norm(_STDLIB)) and "site-packages" not in f)


def _site(fr: dict[str, Any]) -> str:
    return f"{Path(fr['filename']).name}:{fr['line']} {fr['name']}"


def classify(frames: Sequence[dict[str, Any]]) -> tuple[str, str, str | None, dict[str, Any] | None]:
    """``(kind, term, unit, frame)`` of an allocation from its stack (innermost frame first; see the module doc)."""
    if not frames:
        return BACKWARD, "autograd backward op (no Python frame)", None, None
    for i, fr in enumerate(frames):
        f = _norm(fr["filename"])
        for kind, place in PLACES:
            if place in f:
                term = _site(fr)
                unit = None
                if kind == "model":  # the nearest model function, from this one outwards, that names a unit
                    unit = next((UNIT_OF_FUNCTION[g["name"]].value for g in frames[i:]
                                 if g["name"] in UNIT_OF_FUNCTION and "braid/models/" in _norm(g["filename"])), None)
                return kind, term, unit, fr
    fr = next((g for g in frames if not _foreign(g["filename"])), frames[0])
    return OTHER, _site(fr), None, fr


def _device_of(snapshot: dict[str, Any], device: int | None) -> int:
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or not isinstance(snapshot.get("segments"), list):
        raise SnapshotError("not a torch memory snapshot (no 'segments' and 'device_traces')")
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d] or []), default=0)
    if not 0 <= device < len(traces) or not traces[device]:
        raise SnapshotError(f"no allocator trace for device {device} (was the history recorded?)")
    return device


def attribute(snapshot: dict[str, Any], top: int = TOP, device: int | None = None) -> Attribution:
    """The peak of allocated bytes in ``device``'s trace (default: the longest) and the live blocks
    then, grouped by term (:func:`classify`), the ``top`` largest terms as rows.

    A block counts from its ``alloc`` to its first ``free_requested`` (the allocator's allocated
    bytes drop there; ``free_completed`` follows once other streams are done with it). Blocks
    live before the trace began are those it frees without having allocated them, and the
    segments' active blocks it never touches; they count from the start. A block the snapshot's
    ``braid_labels`` names (by address: weights, gradients, optimizer state, read after the
    step) takes that name where it is still live at the trace's end.
    """
    device = _device_of(snapshot, device)
    trace = snapshot["device_traces"][device]
    labels: dict[int, str] = snapshot.get("braid_labels") or {}
    peak, peak_at, live, freed_after = _at_peak(snapshot, device)
    groups: dict[tuple[str, str], list] = {}  # (kind, term) -> [bytes, count, unit, largest size, its frame]
    for addr, (size, frames, pool) in live.items():
        if addr in labels and addr not in freed_after:
            kind, term, unit, fr = STATE, labels[addr], None, None
        elif pool is not None and not frames:
            kind, term, unit, fr = BEFORE, pool, None, None
        else:
            kind, term, unit, fr = classify(frames)
        g = groups.setdefault((kind, term), [0, 0, unit, -1, None])
        g[0] += size
        g[1] += 1
        if size > g[3]:
            g[3], g[4] = size, fr
    rows = [Row(kind, term, b, n, unit, _source(fr))
            for (kind, term), (b, n, unit, _, fr) in groups.items()]
    rows.sort(key=lambda r: (-r.bytes, r.term))
    reserved, idle, idle_rows = idle_reserve(snapshot, top, device)
    return Attribution(device, peak, peak_at, len(trace), rows[:top], _totals(rows, "kind"), _totals(rows, "unit"),
                       len(trace) >= MAX_ENTRIES, reserved, idle, idle_rows)


def _at_peak(snapshot: dict[str, Any], device: int) -> tuple[int, int, dict[int, tuple[int, list, str | None]], set[int]]:
    """``device``'s allocated peak, the trace entry that reached it, the blocks live then (address -> size, frames,
    pool term of a block made before the trace) and the addresses the trace frees after it."""
    trace = snapshot["device_traces"][device]
    events = [(i, e) for i, e in enumerate(trace) if e.get("action") in ("alloc", "free_requested", "free_completed")]
    before = _live_before(snapshot["segments"], events, device)  # addr -> (size, frames, pool term)
    # pass 1: the peak
    size_of = {a: s for a, (s, _, _) in before.items()}
    cur = peak = sum(size_of.values())
    peak_at = -1
    for i, e in events:
        if e["action"] == "alloc":
            size_of[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["addr"] in size_of:
            cur -= size_of.pop(e["addr"])
    # pass 2: the live set at the peak, and what of it is freed later (a label read after the step does not fit that)
    live: dict[int, tuple[int, list, str | None]] = dict(before)
    freed_after: set[int] = set()
    for i, e in events:
        if i > peak_at:
            if e["action"] != "alloc":
                freed_after.add(e["addr"])
        elif e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames") or [], None)
        else:
            live.pop(e["addr"], None)
    return peak, peak_at, live, freed_after


def by_stack(snapshot: dict[str, Any], depth: int, top: int = TOP, device: int | None = None) -> list[tuple[int, int, str]]:
    """The blocks live at the peak grouped by the innermost ``depth`` frames of braid's code in their stacks
    (``(bytes, blocks, frames)``, most bytes first, the ``top`` largest): which call path of one code site
    holds what (a forward's gather against a backward's, say), where :func:`attribute` names only the site."""
    device = _device_of(snapshot, device)
    _, _, live, _ = _at_peak(snapshot, device)
    groups: dict[str, list[int]] = {}
    for size, frames, pool in live.values():
        ours = [f"{_norm(fr['filename']).rsplit('/braid/', 1)[-1]}:{fr['line']} {fr['name']}"
                for fr in frames if "/braid/" in _norm(fr["filename"])][:depth]
        key = " < ".join(ours) or (pool if pool is not None and not frames else "(no braid frame)")
        g = groups.setdefault(key, [0, 0])
        g[0] += size
        g[1] += 1
    return sorted(((b, n, k) for k, (b, n) in groups.items()), key=lambda r: (-r[0], r[2]))[:top]


def idle_reserve(snapshot: dict[str, Any], top: int = TOP, device: int | None = None) -> tuple[int, int, list[Idle]]:
    """``(reserved, idle, rows)`` of ``device``'s segments when the trace ends: their bytes, the bytes free in
    them, and the ``top`` sites with the most idle bytes. A segment is charged to the allocation whose
    ``segment_alloc`` the trace recorded (:func:`classify` of its stack), a CUDA graph's private pool to
    that pool, an expandable segment (``expandable_segments:True``: no one allocation made it) to
    :data:`EXPANDABLE`, any other to :data:`SEGMENT_BEFORE`. A block freed but still used by another
    stream (``active_pending_free``) is not free yet."""
    device = _device_of(snapshot, device)
    made: dict[int, list] = {}
    for e in snapshot["device_traces"][device]:
        if e.get("action") == "segment_alloc":
            made[e["addr"]] = e.get("frames") or []
        elif e.get("action") == "segment_free":
            made.pop(e["addr"], None)
    groups: dict[tuple[str, str], list] = {}  # (kind, term) -> [reserved, idle, segments, largest idle, its frame]
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        total = seg["total_size"]
        free = total - sum(b["size"] for b in seg.get("blocks", []) if b.get("state") in _HELD)
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            kind, term, fr = BEFORE, GRAPH_POOL, None
        elif seg.get("is_expandable"):
            kind, term, fr = OTHER, EXPANDABLE, None
        elif seg["address"] in made:
            kind, term, _, fr = classify(made[seg["address"]])
        else:
            kind, term, fr = BEFORE, SEGMENT_BEFORE, None
        g = groups.setdefault((kind, term), [0, 0, 0, -1, None])
        g[0] += total
        g[1] += free
        g[2] += 1
        if free > g[3]:
            g[3], g[4] = free, fr
    rows = [Idle(kind, term, r, i, n, _source(fr)) for (kind, term), (r, i, n, _, fr) in groups.items()]
    rows.sort(key=lambda r: (-r.idle, -r.reserved, r.term))
    return sum(r.reserved for r in rows), sum(r.idle for r in rows), rows[:top]


def _live_before(segments: list[dict[str, Any]], events: list[tuple[int, dict[str, Any]]],
                 device: int) -> dict[int, tuple[int, list, str]]:
    """Blocks allocated before the trace began: those it frees first, and the segments' active
    blocks it never touches (named by their CUDA graph pool, if any)."""
    seen: set[int] = set()
    out: dict[int, tuple[int, list, str]] = {}
    for _, e in events:
        if e["addr"] not in seen and e["action"] != "alloc":
            out[e["addr"]] = (e["size"], [], BEFORE_STEP)
        seen.add(e["addr"])
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        pool = GRAPH_POOL if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0) else BEFORE_STEP
        for b in seg.get("blocks", []):
            if b.get("state") == _LIVE and b["address"] not in seen:
                out[b["address"]] = (b["size"], b.get("frames") or [], pool)
    return out


def _totals(rows: Iterable[Row], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        name = getattr(r, key)
        if name is not None:
            out[name] = out.get(name, 0) + r.bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _source(fr: dict[str, Any] | None) -> str:
    if not fr or not os.path.isfile(fr["filename"]):
        return ""
    return linecache.getline(fr["filename"], int(fr["line"])).strip()
# ----------------------------------------------------------------------------------------
# Recording (CUDA)
# ----------------------------------------------------------------------------------------
def rank_path(path: str | os.PathLike, rank: int, world: int) -> Path:
    """Where ``rank`` writes its snapshot: ``path`` itself for one rank, else ``FILE.rank<r>.pickle``
    (``snap.pickle`` -> ``snap.rank1.pickle``; a name without a suffix gets ``.pickle``)."""
    p = Path(path)
    if world == 1:
        return p
    return p.with_name(f"{p.stem if p.suffix else p.name}.rank{rank}{p.suffix or '.pickle'}")


def tensor_labels(**groups: Any) -> dict[int, str]:
    """Block addresses of the tensors in ``groups`` (``weights=params, gradients=grads, ...``; a
    group is tensors, or an object whose tensors are found in its attributes, lists, dicts and a
    torch optimizer's ``state``), the group's name with spaces for underscores. The first group
    that names a storage keeps it. A tensor's storage starts its allocator block."""
    import torch

    out: dict[int, str] = {}
    for name, group in groups.items():
        for t in _tensors_in(group, torch, set(), 6):  # deep enough for a wrapper's optimizer's param_groups
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
                out.setdefault(t.untyped_storage().data_ptr(), name.replace("_", " "))
    return out


def _tensors_in(obj: Any, torch: Any, seen: set[int], depth: int) -> Iterable[Any]:
    if obj is None or depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, torch, seen, depth - 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):  # other iterables are not walked: iterating may consume them
        for v in obj:
            yield from _tensors_in(v, torch, seen, depth - 1)
    elif isinstance(obj, torch.nn.Module):
        return  # modules are named through their parameters, not walked
    elif hasattr(obj, "__dict__"):
        if isinstance(obj, torch.optim.Optimizer):
            yield from _tensors_in(dict(obj.state), torch, seen, depth - 1)
        yield from _tensors_in(vars(obj), torch, seen, depth - 1)


def record_step(step_fn: Callable[[], Any], path: str | os.PathLike, device: Any,
                labels: Callable[[], dict[int, str]] | None = None, top: int = TOP) -> Attribution:
    """Run ``step_fn()`` once under the allocator's history (CUDA only), write torch's snapshot to
    ``path`` (with ``labels()``, read after the step, under ``braid_labels``) and return its
    :func:`attribute`. The history starts cleared and is switched off after, so nothing of it
    stays recorded beyond this step."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"a memory snapshot records the CUDA caching allocator; device {dev} is not CUDA")
    mem = torch.cuda.memory
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        mem._record_memory_history(enabled="all", context="all", stacks="python", max_entries=MAX_ENTRIES,
                                   clear_history=True)
        try:
            step_fn()
            torch.cuda.synchronize(dev)
            snap = mem._snapshot()
        finally:
            mem._record_memory_history(enabled=None)
    if labels is not None:
        snap["braid_labels"] = labels()
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    return attribute(snap, top, dev.index if dev.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------------------
# Report and CLI
# ----------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def format_attribution(att: Attribution | dict[str, Any], title: str = "") -> list[str]:
    """Text lines: the peak, the live bytes per kind and unit, then the largest terms (``att`` may be
    the dict form of an :class:`Attribution`, as a bench job gathers it, with keys of its own beside)."""
    if isinstance(att, Attribution):
        a = att
    else:
        a = Attribution(**{f.name: att[f.name] for f in fields(Attribution) if f.name in att})
        a = replace(a, rows=[r if isinstance(r, Row) else Row(**r) for r in a.rows],
                    idle=[r if isinstance(r, Idle) else Idle(**r) for r in a.idle])
    head = f"{title}: " if title else ""
    at = "before the first entry" if a.peak_index < 0 else f"at entry {a.peak_index} of {a.entries}"
    lines = [f"{head}peak {_mib(a.peak_bytes)} MiB allocated on cuda:{a.device}, {at} of the allocator's trace"]
    if a.truncated:
        lines.append(f"  (the trace is full, {MAX_ENTRIES} entries: its start may be lost)")
    share = (lambda n: f"{100 * n / a.peak_bytes:.0f}%") if a.peak_bytes else (lambda n: "-")
    lines.append("  by kind: " + ", ".join(f"{k} {_mib(n)} MiB ({share(n)})" for k, n in a.by_kind.items()))
    if a.by_unit:
        lines.append("  by unit: " + ", ".join(f"{k} {_mib(n)} MiB" for k, n in a.by_unit.items()))
    lines.append(f"  {'MiB':>10} {'share':>6} {'blocks':>6}  {'kind':<9} {'unit':<8} term")
    for r in a.rows:
        lines.append(f"  {_mib(r.bytes):>10} {share(r.bytes):>6} {r.count:>6}  {r.kind:<9} {r.unit or '-':<8} {r.term}")
        if r.source:
            lines.append(f"{'':>47}| {r.source[:100]}")
    if a.reserved_bytes:
        lines.append(f"  reserve when the trace ends: {_mib(a.reserved_bytes)} MiB, {_mib(a.idle_bytes)} MiB of it free "
                     f"(cached); free MiB by the allocation that made the segment:")
        lines.append(f"  {'free':>10} {'of MiB':>10} {'segs':>5}  {'kind':<9} term")
        for r in a.idle:
            lines.append(f"  {_mib(r.idle):>10} {_mib(r.reserved):>10} {r.count:>5}  {r.kind:<9} {r.term}")
            if r.source:
                lines.append(f"{'':>41}| {r.source[:100]}")
    return lines


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    """A snapshot pickle written by :func:`record_step` or ``torch.cuda.memory._dump_snapshot``
    (:class:`SnapshotError` naming the file otherwise). Unpickling runs code: read only files you trust."""
    try:
        with open(path, "rb") as f:
            snap = pickle.load(f)
    except OSError as err:
        raise SnapshotError(f"{path}: {err.strerror or err}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError, IndexError) as err:
        raise SnapshotError(f"{path}: not a snapshot pickle ({type(err).__name__})") from None
    if not isinstance(snap, dict):
        raise SnapshotError(f"{path}: not a torch memory snapshot (a {type(snap).__name__})")
    return snap


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m braid.measure.snapshot FILE [--top N] [--device D] [--stacks N]``: the attribution of a saved snapshot."""
    ap = Parser(prog="python -m braid.measure.snapshot",
                description="Print where the allocated bytes at the peak of a saved CUDA memory snapshot went "
                            "(--memory-snapshot of braid.bench and the training examples, or torch's _dump_snapshot). "
                            "Unpickling runs code: read only files you trust.")
    ap.add_argument("file", metavar="FILE", help="the snapshot pickle")
    ap.add_argument("--top", type=int, default=TOP, help=f"terms listed (default {TOP})")
    ap.add_argument("--device", type=int, default=None, help="device index of the trace (default: the longest trace)")
    ap.add_argument("--stacks", type=int, default=0, metavar="N",
                    help="also list the blocks live at the peak by the innermost N frames of braid's code in their stacks")
    args = ap.parse_args(argv)
    check_counts(ap, args, ("top",))
    if not 0 <= args.stacks <= 64:
        ap.error(f"--stacks {args.stacks}: 0 to 64 frames")
    try:
        snap = load_snapshot(args.file)
        att = attribute(snap, args.top, args.device)
    except SnapshotError as err:
        ap.error(str(err))
    print("\n".join(format_attribution(att, str(args.file))))
    if args.stacks:
        print(f"live at the peak by braid's innermost {args.stacks} frames (MiB, blocks):")
        for b, n, k in by_stack(snap, args.stacks, args.top, args.device):
            print(f"  {b / 2**20:10.1f} {n:6d}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
