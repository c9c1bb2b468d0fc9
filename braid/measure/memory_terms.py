"""The pure parts of ``benchmarks/bench_memory_terms.py`` (issue 51): a measured term, the delta and
peak arithmetic over probe functions, the child-process protocol of the context term, NVML's view
of a GPU without a CUDA call, and the table and JSON the script writes. The probes are arguments,
so all of it runs on CPU with fake ones (``tests/test_bench_memory_terms.py``); the script passes
``mem_get_info`` and the caching allocator's counters."""

from __future__ import annotations

import select
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

MIB = 2**20
Probe = Callable[[], int]
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_MODULE_LOADING", "CUBLAS", "PYTORCH_CUDA_ALLOC_CONF",
                "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_SYMM_MEM", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True, slots=True)
class Term:
    """One measured term: its value (bytes, or a ratio), how it was measured, and the readings behind it."""

    term: str
    value: float | int | None
    how: str
    unit: Literal["B", "ratio"] = "B"
    detail: dict[str, Any] = field(default_factory=dict)


def measure_delta(label: str, fn: Callable[[], Any], probes: Mapping[str, Probe], *, how: str,
                  value: Callable[[dict[str, int]], int] | None = None,
                  sync: Callable[[], None] | None = None) -> tuple[Term, Any]:
    """Read every probe, run ``fn``, read them again: a :class:`Term` and what ``fn`` returned.

    The term's value is ``value(deltas)`` (default: the first probe's delta); its detail holds each
    probe's ``<name>_before``, ``<name>_after`` and ``<name>_delta``. ``sync`` runs before each reading.
    """
    if sync is not None:
        sync()
    before = {k: int(p()) for k, p in probes.items()}
    out = fn()
    if sync is not None:
        sync()
    after = {k: int(p()) for k, p in probes.items()}
    delta = {k: after[k] - before[k] for k in probes}
    detail = {f"{k}_{when}": v[k] for k in probes for when, v in (("before", before), ("after", after), ("delta", delta))}
    got = value(delta) if value is not None else delta[next(iter(probes))]
    return Term(label, int(got), how, detail=detail), out


def run_peaks(step: Callable[[], Any], steps: int, probes: Mapping[str, Probe], *, reset: Callable[[], None],
              peak_allocated: Probe, peak_reserved: Probe, sync: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run ``steps`` steps after ``reset()`` of the allocator's peaks, reading ``used`` and ``reserved``
    after each: the allocator's peaks, the largest ``used`` read, the bound ``max(used - reserved) +
    reserved peak`` and the fragmentation ``reserved peak / allocated peak`` (None when nothing was allocated)."""
    if steps < 1:
        raise ValueError(f"run_peaks needs >= 1 step, got {steps}")
    sync()
    reset()
    used, outside = [], []
    for _ in range(steps):
        step()
        sync()
        u, r = int(probes["used"]()), int(probes["reserved"]())
        used.append(u)
        outside.append(u - r)
    pa, pr = int(peak_allocated()), int(peak_reserved())
    return {"allocated_peak": pa, "reserved_peak": pr, "used_peak": max(used), "used_peak_bound": max(outside) + pr,
            "fragmentation": pr / pa if pa else None, "used_after_each_step": used}


def above_held(reserved_peak: float, allocated_peak: float, held: float) -> float | None:
    """The fragmentation above the state ``held`` across steps: ``(reserved peak - held) / (allocated peak - held)``,
    what :attr:`braid.cost.device_memory.DeviceTerms.fragmentation` scales; None if nothing was allocated above it."""
    over = allocated_peak - held
    return (reserved_peak - held) / over if over > 0 else None


def child_context(used: Probe, argv: Sequence[str], env: Mapping[str, str], timeout_s: float = 300.0) -> tuple[int, int]:
    """Start ``argv`` (a child that prints its allocator reserve once it holds its context, then waits
    for a line), read ``used`` before it starts and while it waits: (used delta, the child's reserve)."""
    before = used()
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(env))
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line.strip():
            raise RuntimeError(f"the child did not report within {timeout_s:.0f} s (exit code {proc.poll()})")
        during = used()
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return during - before, int(line)


def _fmt(v: float | int | None, unit: str) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f}" if unit == "ratio" else f"{v / MIB:.1f} MiB"


def table(rank: int, device: str, terms: Sequence[Term]) -> str:
    """A rank's terms as text: term, value, the used/reserved deltas where the term is a delta, how."""
    lines = [f"rank {rank} ({device})", f"{'term':<44} {'value':>14} {'used d':>12} {'reserved d':>12}  how"]
    for t in terms:
        d = [t.detail.get(k) for k in ("used_delta", "reserved_delta")]
        cols = [_fmt(x, "B") if x is not None else "" for x in d]
        lines.append(f"{t.term:<44} {_fmt(t.value, t.unit):>14} {cols[0]:>12} {cols[1]:>12}  {t.how}")
    return "\n".join(lines)


def document(ranks: Sequence[dict[str, Any]], *, command: str, versions: dict[str, Any], env: dict[str, str],
             config: dict[str, Any], partial: bool) -> dict[str, Any]:
    """The JSON document (see the module doc); ``ranks``: per rank ``rank``, ``device`` and ``terms`` (:class:`Term`)."""
    rows = [{**{k: v for k, v in r.items() if k != "terms"}, "terms": [asdict(t) for t in r["terms"]]}
            for r in sorted(ranks, key=lambda r: r["rank"])]
    return {"bench": "memory_terms", "partial": partial, "command": command, "versions": versions, "env": env,
            "config": config, "ranks": rows}


def env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that change what NCCL, cuBLAS, the allocator and CUDA's loader hold."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)}


def nvml_handle(index: int, environ: Mapping[str, str]) -> Any | None:
    """pynvml's handle of the GPU CUDA numbers ``index`` under ``CUDA_VISIBLE_DEVICES`` (an NVML index or
    a full UUID), or None without pynvml. Makes no CUDA call (torch's ``device_memory_used`` asks for the
    current device, which initialises CUDA); :func:`context_terms` checks the PCI bus afterwards."""
    try:
        import pynvml

        pynvml.nvmlInit()
        vis = environ.get("CUDA_VISIBLE_DEVICES")
        entry = str(index) if vis is None else vis.split(",")[index].strip()
        return (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                else pynvml.nvmlDeviceGetHandleByUUID(entry))
    except Exception:  # noqa: BLE001 - no pynvml or no NVML: the term says it fell back
        return None


def nvml_used(handle: Any) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def nvml_bus(handle: Any) -> int:
    import pynvml

    bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
    return int((bus.decode() if isinstance(bus, bytes) else bus).split(":")[-2], 16)  # "00000000:1B:00.0" -> 0x1B


def inductor_terms(uncompiled: Sequence[Term], compiled: Sequence[Term]) -> list[Term]:
    """The compiled eager case less the uncompiled one, per peak and the non-allocator bytes."""
    def pick(terms, suffix):
        return next((t.value for t in terms if t.term.endswith(suffix)), None)

    out = []
    for suffix in (".reserved_peak", ".allocated_peak", ".nonallocator"):
        a, b = pick(uncompiled, suffix), pick(compiled, suffix)
        out.append(Term(f"inductor{suffix}_delta", None if a is None or b is None else b - a,
                        f"compiled units' eager{suffix.replace('_', ' ').replace('.', ' ')} less the uncompiled run's"))
    return out
