"""Which runs capture their steps as whole-step CUDA graphs: the runtime refuses the others with the reason
(:func:`braid.runtime.graphs.config_reason`), and the memory model prices a captured step's pool
(:mod:`braid.cost.device_memory`: the planner checks what the examples run by default). Torch-free."""

from __future__ import annotations


def capture_reason(device_type: str, *, tp: int = 1, tp_backend: str | None = None, ep: int = 1, moe: bool = False,
                   moe_dispatch: str = "splits") -> str | None:
    """Why a run of this configuration on a ``device_type`` device cannot be captured (None: it can).
    ``moe``: the model has mixture-of-experts layers (``ep``: their expert-parallel degree, ``moe_dispatch``:
    how their rows cross ranks). 2D-Attention (cp > 1) is captured: a rank's zigzag positions are made once per
    length and device, the ring's P2P and the loss sum over the SP group are stream-ordered."""
    if device_type != "cuda":
        return f"device {device_type}: CUDA graphs need a CUDA device (gloo/CPU runs eager)"
    if moe and tp > 1:  # ExpertSlice.plan's rows before the slice
        return (f"a mixture of experts at tp={tp} reads its routing counts on the host every step (the TP slice of "
                "the experts' rows), which a graph replay cannot; it runs eager (--moe-dispatch padded makes ep > 1 "
                "capturable at tp=1)")
    if moe and ep > 1 and moe_dispatch != "padded":  # AllToAllDispatch.plan's splits
        return (f"a mixture of experts at ep={ep} reads its routing counts on the host every step (the all-to-all's "
                "splits), which a graph replay cannot; it runs eager (--moe-dispatch padded makes the step capturable)")
    if tp > 1 and tp_backend == "symm-mem":
        return "TP backend symm-mem: its copy-engine all-reduce runs on its own stream and buffers, not captured"
    return None


def captured_by_default(*, tp: int, ep: int = 1, moe: bool = False, moe_dispatch: str = "splits") -> bool:
    """Whether the training examples on CUDA run this layout as whole-step CUDA graphs (``--cuda-graph``'s
    default, their default TP backend)."""
    return capture_reason("cuda", tp=tp, ep=ep, moe=moe, moe_dispatch=moe_dispatch) is None
