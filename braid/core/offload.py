"""Activation-offload lowering pass (paper Sec. 4.4, Fig. 6): insert OFFLOAD/RELOAD.

The staged strategy of the enhanced braided schedule:

* only chunk 0 is offloaded -- on a V pipeline its activations live longest (forward at the
  start of the V, backward at its end); chunk 1's short-lived activations stay, which also
  keeps the PCIe link free for reloads in time;
* in the steady phase (after the rank's first backward) a fraction ``alpha`` of each
  chunk-0 micro-batch's saved activations goes to host memory right after its forward;
* in the warm-up the fraction is ``alpha_warmup`` (the paper limits warm-up offload so its
  copy time stays under T_F); :func:`braid.planner.offload_tune.tune_offload` picks both, and the
  reload lead, from a cost model by simulating candidate policies (``offload_alpha="auto"``);
* the reload is issued ``lead`` compute instructions before the backward that needs the
  activations, so the host-to-device copy runs behind that compute;
* activations whose backward follows within ``min_gap`` compute instructions are not worth
  a round trip and stay on the device.

The pass works on compiled programs (after P2P insertion), so it never changes the
communication order the compiler proved deadlock-free: offload and reload are rank-local.
"""

from __future__ import annotations

from dataclasses import dataclass

from braid.core.ir import Instruction, Offload, OpKind, Plan, Program, Reload, compute_ops

# An offload's device memory is freed once its copy is done, and at the latest when this many
# compute instructions have run after it: the next one waits for the copy (runtime and
# simulator alike; the host runs ahead of the GPU, so the bound is in program order).
RELEASE_AFTER = 2


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    alpha: float
    alpha_warmup: float
    lead: int = 1
    min_gap: int = 3
    chunk: int = 0

    def __post_init__(self) -> None:
        for name in ("alpha", "alpha_warmup"):
            a = getattr(self, name)
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"offload {name} must be in [0, 1], got {a}")
        if self.lead < 0 or self.min_gap < 1:
            raise ValueError(f"offload lead must be >= 0 and min_gap >= 1, got lead={self.lead}, min_gap={self.min_gap}")

    @staticmethod
    def from_plan(plan: Plan) -> "OffloadPolicy | None":
        alpha = plan.config.option("offload_alpha")
        if alpha is None:
            return None
        warm = plan.config.option("offload_alpha_warmup", alpha)
        return OffloadPolicy(float(alpha), float(warm), int(plan.config.option("offload_lead", 1)),
                             int(plan.config.option("offload_min_gap", 3)))


OFFLOAD_OPTIONS = ("offload_alpha", "offload_alpha_warmup", "offload_lead", "offload_min_gap")


def insert_offload(programs: list[Program], policy: OffloadPolicy) -> list[Program]:
    """Return the programs with OFFLOAD/RELOAD instructions added per ``policy``."""
    out = []
    for prog in programs:
        instrs = list(prog.instructions)
        compute_idx = [i for i, ins in enumerate(instrs) if compute_ops(ins)]
        pos_of = {i: k for k, i in enumerate(compute_idx)}  # instruction index -> compute ordinal
        f_at: dict[tuple[int, int], int] = {}
        b_at: dict[tuple[int, int], int] = {}
        first_backward = None
        for i in compute_idx:
            for op in compute_ops(instrs[i]):
                if op.kind is OpKind.F:
                    f_at[op.key] = i
                elif op.kind in (OpKind.B, OpKind.BW):
                    b_at[op.key] = i
                    first_backward = i if first_backward is None else first_backward
        after: dict[int, list[Instruction]] = {}
        before: dict[int, list[Instruction]] = {}
        for key, fi in sorted(f_at.items(), key=lambda kv: kv[1]):
            mb, chunk = key
            if chunk != policy.chunk or key not in b_at:
                continue
            bi = b_at[key]
            gap = pos_of[bi] - pos_of[fi]
            if gap < policy.min_gap:
                continue
            steady = first_backward is not None and fi > first_backward
            frac = policy.alpha if steady else policy.alpha_warmup
            if frac <= 0:
                continue
            after.setdefault(fi, []).append(Offload(mb, chunk, frac))
            # reload `lead` compute instructions before the backward, never before the offload's next op
            k = max(pos_of[bi] - policy.lead, pos_of[fi] + 1)
            before.setdefault(compute_idx[k], []).append(Reload(mb, chunk))
        new: list[Instruction] = []
        for i, ins in enumerate(instrs):
            new += before.get(i, [])
            new.append(ins)
            new += after.get(i, [])
        out.append(Program(prog.rank, tuple(new), prog.meta))
    return out
