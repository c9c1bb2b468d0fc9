"""The offload lowering pass and the validator's offload rules."""

import pytest

from braid.core.compiler import ScheduleError, compile_plan, validate_programs
from braid.core.ir import Offload, OpKind, Plan, Program, Reload, ScheduleConfig, compute_ops
from braid.core.offload import OffloadPolicy
from braid.planner.offload_tune import tune_offload
from handplans import one_f_one_b


def _with_offload(plan: Plan, **opts) -> Plan:
    cfg = ScheduleConfig(plan.p, plan.m, plan.v, tuple(sorted(opts.items())))
    return Plan(plan.name, cfg, plan.placement, plan.ranks)


def test_offload_and_reload_bracket_each_long_lived_activation():
    plan = _with_offload(one_f_one_b(4, 8), offload_alpha=0.5, offload_alpha_warmup=0.25)
    progs = compile_plan(plan)
    for prog in progs:
        ins = prog.instructions
        for k, x in enumerate(ins):
            if isinstance(x, Offload):
                # right after its forward, reloaded before its backward
                assert str(ins[k - 1]) == f"F{x.mb}c0" or isinstance(ins[k - 1], Offload)
                r = next(j for j, y in enumerate(ins) if isinstance(y, Reload) and (y.mb, y.chunk) == (x.mb, x.chunk))
                b = next(j for j, y in enumerate(ins) if any(o.kind is OpKind.BW and o.key == (x.mb, 0) for o in compute_ops(y)))
                assert k < r < b
    # warm-up fraction before the first backward, steady fraction after it
    fracs = [x.frac for x in progs[0].instructions if isinstance(x, Offload)]
    assert fracs[0] == 0.25 and fracs[-1] == 0.5
    # the last rank's activations live for one op only: nothing to offload there
    assert not any(isinstance(x, Offload) for x in progs[3].instructions)


def test_validator_rejects_reload_after_its_use():
    plan = _with_offload(one_f_one_b(2, 4), offload_alpha=1.0)
    progs = compile_plan(plan)
    ins = list(progs[0].instructions)
    r = next(j for j, y in enumerate(ins) if isinstance(y, Reload))
    reload = ins.pop(r)
    b = next(j for j, y in enumerate(ins) if str(y) == f"BW{reload.mb}c0")
    ins.insert(b + 1, reload)
    with pytest.raises(ScheduleError, match=f"BW{reload.mb}c0 needs activations offloaded at op .* no RELOAD precedes it") as e:
        validate_programs(plan, [Program(0, tuple(ins)), progs[1]])
    assert e.value.rule == "offload-order"


def test_validator_rejects_offload_of_freed_activation():
    plan = one_f_one_b(2, 4)
    progs = compile_plan(plan)
    ins = list(progs[0].instructions)
    b = next(j for j, y in enumerate(ins) if str(y) == "BW0c0")
    ins[b + 1:b + 1] = [Offload(0, 0), Reload(0, 0)]
    with pytest.raises(ScheduleError, match="offloads activations that a backward already freed"):
        validate_programs(plan, [Program(0, tuple(ins)), progs[1]])


def test_policy_validation():
    with pytest.raises(ValueError, match="alpha must be in"):
        OffloadPolicy(1.5, 0.5)
    with pytest.raises(ValueError, match="lead must be >= 0"):
        OffloadPolicy(0.5, 0.5, lead=-1)


def _costs(pcie_bytes_per_s: float):
    import dataclasses

    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.hardware import get_hardware
    from braid.cost.catalog import get_model

    costs = analytic_costs(get_model("qwen2-12b"), get_hardware("h200"), Layout(2, 2, 2, "v"), activations="runtime")
    return dataclasses.replace(costs, pcie_bytes_per_s=pcie_bytes_per_s)


def test_tune_offload_lowers_the_peak_within_the_slowdown_budget():
    from braid import schedules
    from braid.simulator import simulate

    plan = schedules.build("braided_v_offload", 2, 8)
    costs = _costs(55e9)
    choice = tune_offload(plan, costs, max_slowdown=0.01)
    assert choice.step_s <= choice.base_step_s * 1.01
    assert max(choice.peak_bytes) < 0.95 * max(choice.base_peak_bytes)
    # the options rebuild the chosen plan, and the simulator reproduces the prediction
    rep = simulate(compile_plan(schedules.build("braided_v_offload", 2, 8, **choice.options())), costs, record=False).report
    assert rep.step_time_s == pytest.approx(choice.step_s)
    assert tuple(r.peak_activation_bytes for r in rep.ranks) == choice.peak_bytes
    # a looser budget never gives a higher peak
    assert max(tune_offload(plan, costs, max_slowdown=0.05).peak_bytes) <= max(choice.peak_bytes)


def test_coarse_tune_offload_searches_the_coarse_grid_within_the_budget():
    from braid import schedules
    from braid.planner.offload_tune import COARSE_GRID

    plan = schedules.build("braided_v_offload", 2, 8)
    costs = _costs(55e9)
    coarse = tune_offload(plan, costs, max_slowdown=0.01, coarse=True)
    fine = tune_offload(plan, costs, max_slowdown=0.01)
    pol = coarse.policy
    assert pol.alpha in COARSE_GRID and pol.alpha_warmup in COARSE_GRID and pol.lead == 2
    assert coarse.step_s <= coarse.base_step_s * 1.01
    # the full search looks at every coarse policy too, so it is never worse
    assert max(fine.peak_bytes) <= max(coarse.peak_bytes) <= max(coarse.base_peak_bytes)


def test_tune_offload_offloads_nothing_when_copies_cannot_hide():
    from braid import schedules

    choice = tune_offload(schedules.build("braided_v_offload", 2, 8), _costs(1e6), max_slowdown=0.0)
    assert (choice.policy.alpha, choice.policy.alpha_warmup) == (0.0, 0.0)
    assert choice.peak_bytes == choice.base_peak_bytes and choice.step_s == choice.base_step_s


def test_auto_alpha_without_costs_is_a_clear_error():
    from braid import schedules

    with pytest.raises(ValueError, match="needs a cost model.*tune_offload"):
        schedules.build("braided_v_offload", 2, 8, offload_alpha="auto")
    with pytest.raises(ValueError, match="max_slowdown must be >= 0"):
        tune_offload(schedules.build("braided_v_offload", 2, 8), _costs(55e9), max_slowdown=-1)
