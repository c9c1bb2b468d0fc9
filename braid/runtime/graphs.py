"""Whole-step CUDA graphs: a rank's program captured once, then replayed every step.

A compiled :class:`braid.core.ir.Program` is the same every step, and so is what the executor
launches for it: every unit task's kernels, the TP all-reduces, the batched Send/Recv,
the chained runs on the side stream, the offload/reload copies. :class:`GraphedStep`
captures one whole step of :meth:`braid.runtime.executor.Executor.run` into a single
:class:`torch.cuda.CUDAGraph` (megatron-core's ``FullCudaGraphWrapper`` does the same for
its ``forward_backward_func``), so after capture a step costs the host one graph launch
instead of hundreds of Python/autograd calls: the GPU no longer waits for the host.

How a run goes (``mode="step"``):

* **Warm-up** (:data:`WARMUP_STEPS` = 2 eager steps, on the stream the capture will use,
  torch's recommended side-stream warm-up): the first creates everything built on first
  use -- the NCCL communicators and P2P connections of the TP/PP groups, cuBLAS handles and
  workspaces for that stream, the executor's bound unit steps and side stream,
  ``torch.compile``'s kernels, the offloader's pinned host buffers, ``nccl-ce``'s registered
  staging buffers (:mod:`braid.tp.ce_reduce`) -- none of which may happen inside a capture;
  the second checks that the step is steady (no new pinned buffer).
* **Capture** (the next step): the gradients are set to ``None`` first, so the captured
  backward allocates them from the graph's private memory pool (torch's whole-network
  recipe); the executor runs with ``record="off"`` and its ``capturing`` switch (no
  clock, no event query, no stream synchronisation, see below); the side streams that
  joined the capture (chained runs, D2H/H2D copies) are joined back. The capture launches
  nothing, so the graph is then replayed once for that step's data. All ranks meet at a
  barrier before and after (as megatron-core does).
* **Replay** (every later step): the micro-batches' tokens and labels are copied into the
  static buffers the capture read, the parameters get back the captured gradient tensors
  (whatever the caller did with ``.grad`` in between: a replay *writes* the gradients, as
  a step after ``zero_grad(set_to_none=True)``; a fp32 ``main_grad`` buffer is added to,
  as in eager mode, so the caller zeroes it), and the graph is launched. The loss is a
  copy of the captured loss tensor; the gradient norm, the data-parallel reduction and the
  optimizer step run after it, outside the graph, on those very gradient tensors. The host
  then waits for the replay, at most the job's timeout, reading the failure record every
  second (:func:`bounded_wait`): NCCL's watchdog does not see a graph's collectives, so a
  replay whose peer never joins would otherwise wait for ever.

What capture needs from the executor, and where it is: no host synchronisation inside
the step (``Executor.capturing`` skips the end-of-step ``synchronize``;
:class:`~braid.runtime.offload.ActivationOffloader` ``capturing`` releases device memory by
its instruction count alone, without ``Event.query``, and does not synchronise its copy
streams -- they are joined here); no clock marks, memory samples or store reads
(``record="off"``; on CUDA :class:`~braid.runtime.distributed.Abort` waits are
stream-ordered and never read the store); no pinned allocation (the host pool is steady
after warm-up); host-buffer events from before the capture are forgotten. RNG: torch
registers the default CUDA generator with every capture, so dropout drawn from it gets
fresh numbers at each replay (braid's models have none).

Replay equals the eager executor bitwise: the same kernels run in the same stream order on
the same values. Where it cannot: an NCCL all-reduce over more than two ranks may pick
another algorithm for captured buffers, and a sum of three or more terms may then round
differently (two-rank sums are exact either way).

Not capturable (:func:`not_capturable` says why in one line; ``mode=None`` then runs
eager): a CPU device (gloo), the ``symm-mem`` TP backend (its own stream and buffers), a
mixture of experts whose dispatcher reads its routing counts on the host (the all-to-all's
variable splits at ep > 1, the TP slice of the experts; ``--moe-dispatch padded`` is host-free at
tp=1: :attr:`braid.models.moe_dispatch.Dispatcher.host_free`), a chunk
whose ``set_batch`` reads its micro-batches on the host and does not say it is safe
(``graph_safe_batch``), and an :class:`~braid.runtime.distributed.Abort` that reads its
store before waits. A graphed step is for one input shape; another tensor shape is an error
that says so.

Vision-language models: what their chunks read on the host (image grids, where the image
tokens sit: :mod:`braid.models.vlm_batch`) is read before the capture
(``ModelChunk.prepare_batch``) into device tensors the captured step uses, and is the
captured graph's *key* (``ModelChunk.batch_key``). Before each replay every chunk reads its
micro-batches' keys (a host copy of their ``input_ids``), and the ranks agree (one all-reduce)
whether any changed: then every rank drops its graph, runs an eager step of the new shapes
(its kernels, compiled code and buffers are made outside a capture) and captures on the next
step of the same shapes. One graph is kept at a time: after :data:`MAX_CAPTURES` changes of
shape the run stays eager and says why (pad or bucket the images to one shape per run, as
production VLM trainers do, to keep the graph: micro-batches padded to a visual-token budget,
:mod:`braid.models.vlm_pack`, all have one key, their per-step facts copied in with the tokens).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist

from braid.core.capture import capture_reason
from braid.models.chunk import ModelChunk
from braid.runtime.errors import CommTimeout
from braid.runtime.executor import Executor
from braid.runtime.results import StepResult
from braid.io.trace import Trace

log = logging.getLogger(__name__)

CudaGraphMode = Literal["none", "step"]
CUDA_GRAPH_MODES: tuple[str, ...] = ("none", "step")
WARMUP_STEPS = 2
MAX_CAPTURES = 4  # new micro-batch shapes (each a new capture) before a run stays eager


REPLAY_CHECK_S = 1.0  # while a replay runs: how often the job's failure record is read


def bounded_wait(event: Any, timeout_s: float | None, what: str, check: Any = None, poll_s: float = 5e-5) -> None:
    """Wait until ``event`` (recorded after a replay) has passed, at most ``timeout_s`` seconds (None: no
    bound), calling ``check`` (:meth:`braid.runtime.distributed.Abort.check`: raises if another rank
    failed) every :data:`REPLAY_CHECK_S`. NCCL's watchdog does not see collectives captured in a graph,
    so a replay whose peer never joins would otherwise wait for ever; ``CommTimeout`` names ``what``."""
    start = last = time.monotonic()
    while not event.query():
        now = time.monotonic()
        if check is not None and now - last >= REPLAY_CHECK_S:
            check()
            last = now
        if timeout_s is not None and now - start >= timeout_s:
            raise CommTimeout(f"{what} did not finish within {timeout_s:g} s (a captured collective or transfer whose "
                              "peer did not join: NCCL's watchdog does not see a graph's collectives; raise the "
                              "timeout if it is only slow)")
        time.sleep(poll_s)


class GraphCaptureError(RuntimeError):
    """Capturing or replaying a step failed; the message names the rank and the phase."""


def check_mode(mode: str | None) -> CudaGraphMode | None:
    """``mode`` if it is one of :data:`CUDA_GRAPH_MODES` (or None: the default), else one ``ValueError`` line."""
    if mode is not None and mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graph={mode!r}: choose one of {', '.join(CUDA_GRAPH_MODES)}")
    return mode  # type: ignore[return-value]


def config_reason(device: torch.device | str, *, cp: int = 1, tp: int = 1, tp_backend: str | None = None,
                  ep: int = 1, moe: bool = False, moe_dispatch: str = "splits") -> str | None:
    """Why a run of this configuration cannot be captured (None: it can;
    :func:`braid.core.capture.capture_reason`). Needs no process group, so command lines check it before any
    work. ``cp`` (2D-Attention) is captured (tests/test_graphs_gpu.py)."""
    return capture_reason(torch.device(device).type, tp=tp, tp_backend=tp_backend, ep=ep, moe=moe,
                          moe_dispatch=moe_dispatch)


def not_capturable(ex: Executor) -> str | None:
    """The one-line reason why ``ex``'s step cannot be captured, or None when it can."""
    tp = 2 if ex.tp_group is not None else 1
    reason = config_reason(ex.device, cp=2 if ex.sp_group is not None else 1, tp=tp, tp_backend=ex.tp_comm.backend)
    if reason is not None:
        return reason
    for c, ch in sorted(ex.chunks.items()):
        if ch.spec.moe and not ch.moe_host_free():  # a dispatcher says whether it reads the host (Dispatcher.host_free)
            return config_reason(ex.device, tp=tp, ep=2 if ch.moe_moves() else 1, moe=True) or (
                f"chunk {c}: a mixture-of-experts layer's dispatcher reads its routing counts on the host every step; "
                "it runs eager")
        if type(ch).set_batch is not ModelChunk.set_batch and not vars(type(ch)).get("graph_safe_batch", False):
            return f"chunk {c} ({type(ch).__name__}) reads its micro-batches on the host every step; it runs eager"
    if ex.abort is not None and not ex.abort.cuda:
        return "the failure record is read from the store before waits (Abort with cuda=False)"
    return None


def resolve(mode: str | None, ex: Executor) -> tuple[CudaGraphMode, str | None]:
    """The mode a run gets and, when it is ``"none"`` for want of capture, the reason.

    ``None``: ``"step"`` where :func:`not_capturable` finds nothing, else ``"none"``.
    ``"step"`` where the program cannot be captured raises ``ValueError`` with the reason.
    """
    check_mode(mode)
    if mode == "none":
        return "none", None
    reason = not_capturable(ex)
    if reason is None:
        return "step", None
    if mode == "step":
        raise ValueError(f"cuda_graph='step': rank {ex.rank} cannot capture its step: {reason}")
    return "none", reason


def graphed_costs(doc: dict[str, Any], mode: str | None) -> dict[str, Any]:
    """A profiled cost file (``braid.profile``) for steps run under ``mode``: where the step is a
    CUDA graph the host issues no unit task (one launch per step), so ``host_task_s`` (the
    simulator's host lane) is 0; the profiled figure stays in ``meta.profiled_host_task_s``."""
    meta = doc.setdefault("meta", {})
    cfg = meta.get("config", {})
    why = config_reason(cfg.get("device", "cpu"), tp=cfg.get("tp", 1), tp_backend=meta.get("tp_backend"), ep=cfg.get("ep", 1),
                        moe=bool((cfg.get("model") or {}).get("experts")), moe_dispatch=cfg.get("moe_dispatch", "splits"))
    if check_mode(mode) == "none" or why is not None:
        meta["cuda_graph"] = "none"
        return doc
    meta["cuda_graph"] = "step"
    meta["profiled_host_task_s"] = doc.get("host_task_s", 0.0)
    doc["host_task_s"] = 0.0
    return doc


def _leaves(items: Sequence[Any]) -> list[Any]:
    """The tensors of micro-batch items that are tensors or tuples of tensors (a VLM's ``(images, input_ids)``)."""
    return [x for it in items for x in (it if isinstance(it, tuple) else (it,))]


def _empty_like(item: Any, dev: torch.device) -> Any:
    """A static buffer like ``item``: a tensor, or a tuple of them of the same type (a named tuple stays one:
    the chunks read a padded VLM micro-batch, :class:`braid.models.vlm_pack.PackedImages`, by its type)."""
    if not isinstance(item, tuple):
        return torch.empty_like(item, device=dev)
    parts = [torch.empty_like(t, device=dev) for t in item]
    return type(item)(*parts) if hasattr(item, "_fields") else tuple(parts)


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _capturing(stream: Any) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


def _pool_bytes(pool: Any) -> int | None:
    """Bytes of the device segments that belong to the graph's private pool (None where torch does not say)."""
    try:
        snap = torch.cuda.memory._snapshot()
        return int(sum(s["total_size"] for s in snap["segments"] if tuple(s.get("segment_pool_id", ())) == tuple(pool)))
    except Exception:  # noqa: BLE001 - a torch without segment pool ids
        return None


def reserve_breakdown(pool: Any = None) -> dict[str, int] | None:
    """Where this process's allocator reserve lies now (None where torch does not say): ``pool_bytes``, the
    segments of the graph's private ``pool``; ``other_bytes``, every other segment, of which ``other_active_bytes``
    is in use; ``pinned_bytes``, the other segments that are partly in use (``torch.cuda.empty_cache`` cannot
    return them), holding ``pinned_active_bytes``."""
    try:
        segments = torch.cuda.memory._snapshot()["segments"]
    except Exception:  # noqa: BLE001 - a torch without the snapshot
        return None
    key = tuple(pool) if pool is not None else None
    out = dict.fromkeys(("pool_bytes", "other_bytes", "other_active_bytes", "pinned_bytes", "pinned_active_bytes"), 0)
    for seg in segments:
        total, active = int(seg["total_size"]), int(seg.get("active_size", seg.get("allocated_size", 0)))
        if key is not None and tuple(seg.get("segment_pool_id", ())) == key:
            out["pool_bytes"] += total
            continue
        out["other_bytes"] += total
        out["other_active_bytes"] += active
        if 0 < active < total:
            out["pinned_bytes"] += total
            out["pinned_active_bytes"] += active
    return out


def idle_bytes(split: dict[str, int]) -> int:
    """Of a :func:`reserve_breakdown`, the bytes of segments outside the graph's pool with nothing in use
    (what ``torch.cuda.empty_cache`` would return)."""
    return split["other_bytes"] - split["pinned_bytes"] - (split["other_active_bytes"] - split["pinned_active_bytes"])


def _barrier(dev: torch.device) -> None:
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[dev.index if dev.index is not None else torch.cuda.current_device()])
        else:
            dist.barrier()


class EagerStep:
    """The executor's step as it is (``mode="none"``): the same interface as :class:`GraphedStep`."""

    mode: CudaGraphMode = "none"

    def __init__(self, ex: Executor, reason: str | None = None) -> None:
        self.ex, self.reason = ex, reason
        self.events: list[str] = []

    @property
    def captured(self) -> bool:
        return False

    def run(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], *, record: str | None = None) -> StepResult:
        return self.ex.run(tokens, labels, record=record)  # type: ignore[arg-type]

    def release(self) -> None:
        """Nothing to free."""

    def memory(self) -> dict[str, int | None]:
        return {}


class GraphedStep:
    """Runs an executor's step: :data:`WARMUP_STEPS` eager steps, then one captured CUDA graph
    replayed every step (see the module docstring). ``run`` has :meth:`Executor.run`'s
    signature; a step asked to record (``"units"``/``"instructions"``) runs eager and leaves
    the graph as it is. ``events`` lists what happened, one line per step."""

    mode: CudaGraphMode = "step"

    def __init__(self, ex: Executor, *, warmup: int = WARMUP_STEPS) -> None:
        reason = not_capturable(ex)
        if reason is not None:
            raise ValueError(f"rank {ex.rank}: cannot capture this step: {reason}")
        if warmup < 1:
            raise ValueError(f"a graphed step needs >= 1 eager warm-up step (communicators, kernels, buffers), got {warmup}")
        self.ex, self.warmup, self.reason = ex, warmup, None
        self.device = ex.device
        self.stream = torch.cuda.Stream(self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool: Any = None
        self.steps = 0
        self.events: list[str] = []
        self._tokens: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._loss: torch.Tensor | None = None
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._counts: dict[str, int] = {}
        self._host_allocs: list[int] = []
        self._keys: list[Any] | None = None  # the chunks' batch keys the graph was captured for
        self._warm_keys: list[Any] | None = None  # ... and those of the last eager warm-up step
        # Whether a chunk's step depends on host-side facts of its micro-batches (ModelChunk.batch_key)
        self._keyed = any(type(ch).batch_key is not ModelChunk.batch_key for ch in ex.chunks.values())
        self.captures = 0
        self.shape_changes = 0  # graphs released because some rank's micro-batch shapes changed
        self.eager_reason: str | None = None  # set when the inputs changed shape too often to keep a graph
        self.capture_peak_bytes: int | None = None  # allocator peak of the captured step above what was allocated before
        self.grad_bytes: int | None = None  # of which the gradients the capture allocated (they stay: the replays write them)
        self.pool_bytes: int | None = None  # device memory the graph's private pool holds
        self.cached_outside_bytes: int | None = None  # segments outside the pool cached with nothing in them, after the capture
        self.exec_bytes: int | None = None  # device memory the instantiated graph holds outside the allocator
        self.capture_s: float | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for ch in self.ex.chunks.values() for p in ch.parameters() if p.requires_grad]

    # -- the step ------------------------------------------------------------------------
    def run(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], *, record: str | None = None) -> StepResult:
        """One step (forward and backward of every micro-batch, gradients written; see the module docstring)."""
        if record not in (None, "off"):
            self.events.append(f"step {self.steps}: eager (record={record})")
            return self.ex.run(tokens, labels, record=record)  # type: ignore[arg-type]
        if self.eager_reason is not None:
            self.steps += 1
            return self.ex.run(tokens, labels, record="off")
        keys = self._batch_keys(tokens) if self._keyed else None
        if self.graph is not None and not self._agree(keys == self._keys):
            # Micro-batches of another shape on some rank (image grids, image positions): every rank drops its
            # graph, warms up eagerly on the new shapes (compiled kernels, plans, pinned buffers), then captures.
            self.release()
            self.shape_changes += 1
            self.events.append(f"step {self.steps}: new micro-batch shapes: graph released")
        if self.graph is None:
            if self.shape_changes >= MAX_CAPTURES:
                self.eager_reason = (f"the micro-batches changed shape {self.shape_changes} times; eager from step "
                                     f"{self.steps} on (pad or bucket the inputs to one shape per run to keep the graph)")
                self.events.append(f"step {self.steps}: {self.eager_reason}")
                log.info("rank %d: CUDA graphs off: %s", self.ex.rank, self.eager_reason)
                return self.run(tokens, labels)
            if self.steps < self.warmup or not self._agree(keys == self._warm_keys):
                self._warm_keys = keys
                return self._warm(tokens, labels)
            self._capture(tokens, labels)
            return self._replay(tokens, labels, "captured, then replayed")
        return self._replay(tokens, labels, "replay")

    def _agree(self, mine: bool) -> bool:
        """Whether ``mine`` holds on every rank (one all-reduce when the step is keyed: ranks capture and
        release together, since a capture meets the others at a barrier)."""
        if not (self._keyed and dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        flag = torch.tensor([0 if mine else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) == 0

    def _batch_keys(self, tokens: Sequence[Any]) -> list[Any]:
        """Every chunk's host-side key of these micro-batches (ModelChunk.batch_key), in chunk order."""
        return [ch.batch_key(tokens) for _, ch in sorted(self.ex.chunks.items())]

    def _warm(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> StepResult:
        pool = self.ex.offloader.pool
        before = pool.allocations
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            res = self.ex.run(tokens, labels, record="off")
        cur.wait_stream(self.stream)
        self._host_allocs.append(pool.allocations - before)
        what = f"{len(self._host_allocs)}/{self.warmup}" if self.steps < self.warmup else "of new shapes"
        self.events.append(f"step {self.steps}: eager warm-up {what} ({pool.allocations - before} pinned host buffers allocated)")
        self.steps += 1
        return res

    def _capture(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> None:
        ex, dev = self.ex, self.device
        if self._host_allocs[-1]:
            raise GraphCaptureError(f"rank {ex.rank}: the last warm-up step still allocated {self._host_allocs[-1]} pinned "
                                    "host buffers: the offload pool is not steady, a capture would allocate")
        self._tokens = [_empty_like(t, dev) for t in tokens]
        self._labels = [torch.empty_like(t, device=dev) for t in labels]
        self._copy_in(tokens, labels)
        # Host-side facts of the micro-batches (a VLM's image grids and image positions) are read now,
        # outside the capture, into the chunks' device tensors; a replay needs the same keys.
        keys = [ch.prepare_batch(self._tokens) for _, ch in sorted(ex.chunks.items())]
        self._keys = keys if self._keyed else None  # compared with _batch_keys' answer, None where not keyed
        self.captures += 1
        params = self._params()
        for p in params:
            if getattr(p, "main_grad", None) is None:
                p.grad = None  # allocated by the captured backward, from the graph's pool
        kept = {id(p.grad) for p in params if p.grad is not None}
        ex.offloader.pool.forget_events()
        torch.cuda.synchronize(dev)
        _barrier(dev)
        self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        free0, reserved0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        ex.capturing = ex.offloader.capturing = True
        stage = "running the executor's step"
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                res = ex.run(self._tokens, self._labels, record="off")
                stage = "joining the side streams"
                cur = torch.cuda.current_stream(dev)
                for s in (ex._side, getattr(ex.offloader, "d2h", None), getattr(ex.offloader, "h2d", None)):
                    if s is not None and _capturing(s):
                        cur.wait_stream(s)
                stage = "ending the capture"
        except Exception as err:
            first = err.__context__
            why = _line(err) + (f" (raised while handling {_line(first)})" if first is not None else "")
            raise GraphCaptureError(f"rank {ex.rank}: CUDA graph capture failed while {stage}: {why}") from err
        finally:
            ex.capturing = ex.offloader.capturing = False
        self.capture_s = time.perf_counter() - t0
        self.capture_peak_bytes = torch.cuda.max_memory_allocated(dev) - base
        ex.offloader.pool.forget_events()  # events recorded in the capture mean nothing to an eager step
        self.graph = graph
        self._loss = res.loss_tensor
        self._counts = dict(res.counts)
        self._grads = [(p, p.grad) for p in params if p.grad is not None]
        self.grad_bytes = sum(g.numel() * g.element_size() for _, g in self._grads if id(g) not in kept)
        torch.cuda.synchronize(dev)
        # The instantiated graph: device memory the capture took that the allocator did not (its pool did).
        self.exec_bytes = (free0 - torch.cuda.mem_get_info(dev)[0]) - (torch.cuda.memory_reserved(dev) - reserved0)
        _barrier(dev)
        # What was still live when the capture began (torch.cuda.graph empties the cache then) and is freed while
        # capturing goes back to the ordinary pool, whose segments would stay cached beside the graph's: 0.2-1.4 GiB a
        # rank at 7b-layer shapes, measured while the executor still held its last step's sent tensors.
        torch.cuda.empty_cache()
        self.pool_bytes = _pool_bytes(self.pool)
        split = reserve_breakdown(self.pool)
        self.cached_outside_bytes = None if split is None else idle_bytes(split)
        pool_mib = "?" if self.pool_bytes is None else f"{self.pool_bytes / 2**20:.1f}"
        self.events.append(f"step {self.steps}: capture of {sum(self._counts.get(k, 0) for k in ('F', 'B', 'W'))} unit tasks, "
                           f"{self._counts.get('AR', 0)} all-reduces, {self._counts.get('P2P', 0)} P2P, "
                           f"{self._counts.get('chained', 0)} chained runs, {self._counts.get('OFFLOAD', 0)} offloads, "
                           f"{len(self._grads)} gradients in {self.capture_s:.2f} s; pool {pool_mib} MiB; "
                           f"graph {self.exec_bytes / 2**20:.1f} MiB outside the allocator")
        log.info("rank %d: %s", ex.rank, self.events[-1])

    def _copy_in(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> None:
        if len(_leaves(tokens)) != len(_leaves(self._tokens)) or len(labels) != len(self._labels):
            raise ValueError(f"rank {self.ex.rank}: the graph was captured for {len(self._tokens)} micro-batches, got {len(tokens)}")
        for dst, src in zip(_leaves(self._tokens) + self._labels, _leaves(tokens) + list(labels)):
            if not isinstance(src, torch.Tensor) or dst.shape != src.shape or dst.dtype != src.dtype:
                got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(f"rank {self.ex.rank}: the graph was captured for micro-batches {tuple(dst.shape)} "
                                 f"{dst.dtype}, got {got}: another shape needs another graph (or cuda_graph='none')")
            dst.copy_(src, non_blocking=True)

    def _replay(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], note: str) -> StepResult:
        assert self.graph is not None
        self._copy_in(tokens, labels)
        for p, g in self._grads:
            if p.grad is not g:
                p.grad = g  # the graph writes these tensors
        self.graph.replay()
        done = torch.cuda.Event()
        done.record()
        abort = self.ex.abort
        bounded_wait(done, abort.timeout_s if abort is not None else None, f"rank {self.ex.rank}: the replay of step "
                     f"{self.steps}", abort.check if abort is not None else None)
        self.events.append(f"step {self.steps}: {note}")
        self.steps += 1
        ex = self.ex
        meta = {"schedule": ex.plan.name, "source": "measured", "rank": ex.rank, "device": str(self.device),
                "record": "off", "cuda_graph": "step", "summary": {f"count_{k}": v for k, v in self._counts.items()}}
        loss = None if self._loss is None else self._loss.clone()  # the next replay overwrites the captured tensor
        return StepResult(loss, Trace(meta, [], {}), dict(self._counts))

    def release(self) -> None:
        """Free the graph and its pool, with the gradients it wrote (set to None) and the loss; a later
        step captures again (after an eager step of its shapes where the step is keyed, else at once)."""
        torch.cuda.synchronize(self.device)
        for p, g in self._grads:
            if p.grad is g:
                p.grad = None
        for ch in self.ex.chunks.values():
            ch.losses.clear()  # the captured per-micro-batch losses live in the pool
        self.graph = self.pool = self._loss = None
        self._grads, self._tokens, self._labels = [], [], []
        self._host_allocs = [0]  # the host pool was steady
        torch.cuda.empty_cache()

    def memory(self) -> dict[str, int | None]:
        """Device memory of the graph: the allocator's peak during capture (above what was allocated before),
        the gradients among it (allocated by the captured backward, where an eager step's are there before it
        starts), the bytes its private pool holds, and those cached outside it with nothing in use right after the
        capture (0 where torch reports segments: the capture ends by returning them), and what the instantiated
        graph holds outside the allocator (:func:`braid.cost.device_memory.graph_exec_bytes` prices it)."""
        return {"capture_peak_bytes": self.capture_peak_bytes, "captured_grad_bytes": self.grad_bytes,
                "graph_pool_bytes": self.pool_bytes, "cached_outside_bytes": self.cached_outside_bytes,
                "graph_exec_bytes": self.exec_bytes}


def step_runner(ex: Executor, mode: str | None = None, *, warmup: int = WARMUP_STEPS) -> GraphedStep | EagerStep:
    """The runner of ``ex``'s step under ``mode`` (see :func:`resolve`): a :class:`GraphedStep`
    or an :class:`EagerStep` whose ``reason`` says why it is not graphed (None: asked for)."""
    chosen, reason = resolve(mode, ex)
    if chosen == "step":
        return GraphedStep(ex, warmup=warmup)
    if reason is not None:
        log.info("rank %d: CUDA graphs off: %s", ex.rank, reason)
    return EagerStep(ex, reason)
