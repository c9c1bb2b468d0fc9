"""The examples' memory check before launch (``examples/train_fit.py``): braid.simulate's device memory per GPU
against the card, on a card size given here (the check itself runs on CUDA only)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from braid.simulate import device_memory_gib

GIB = 2.0**30
H100 = 79.18 * GIB  # what torch reports for an 80 GB H100


@pytest.fixture
def train_fit(monkeypatch):
    """``examples/train_fit.py`` (the examples' own modules are not a package)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))
    import train_fit

    return train_fit


def _args(**kw) -> argparse.Namespace:
    base = dict(model="7b", tp=1, pp=2, dp=1, ep=1, cp=1, mbs=8, micro_batch_size=2, optimizer="plain", recompute="none",
                last_stage_lighter=2, sequence_parallel=False, offload_alpha=None, device="cuda", skip_memory_check=False,
                hf=None, image_size=None)
    return argparse.Namespace(**{**base, **kw})


def _vlm_argv(train_fit, **kw) -> list[str]:
    args = _args(**kw)
    name = train_fit.catalog_name(args, vision=True)
    assert name == "qwen2-vl-7b"
    return train_fit.simulate_argv(args, name, 2306)  # 2048 caption tokens + the 7B tower's 258 visual tokens


def test_the_check_prices_the_run_as_it_executes(train_fit) -> None:
    """--cuda-graph none runs eager: the check prices that, not the whole-step graph of the default."""
    assert "--cuda-graph" not in _vlm_argv(train_fit)
    assert _vlm_argv(train_fit, cuda_graph="none")[-2:] == ["--cuda-graph", "none"]


def test_the_vlm_layout_that_hung_at_the_cards_limit_is_refused_and_a_fitting_schedule_named(train_fit) -> None:
    argv = _vlm_argv(train_fit)
    predicted = device_memory_gib([*argv, "--schedule", "braided_v", "--schedule", "1f1b_i"])
    assert predicted["braided_v"] > H100 / GIB > predicted["1f1b_i"]
    refusal, warning = train_fit.verdict(argv, ["braided_v"], H100)
    assert warning is None and refusal is not None and "\n" not in refusal
    assert f"{predicted['braided_v']:.1f} GiB" in refusal and f"1f1b_i ({predicted['1f1b_i']:.1f} GiB)" in refusal
    assert "--skip-memory-check" in refusal
    # the same run on a card that holds it: nothing; on one it nearly fills: a warning, no refusal
    assert train_fit.verdict(argv, ["braided_v"], 4 * predicted["braided_v"] * GIB) == (None, None)
    refusal, warning = train_fit.verdict(argv, ["braided_v"], predicted["braided_v"] * GIB / 0.95)
    assert refusal is None and warning.startswith("warning: --schedule braided_v") and "95%" in warning


def test_where_no_schedule_fits_the_refusal_names_the_lighter_optimizer(train_fit) -> None:
    """The 7B VLM at tp=2 under the default optimizer (fp32 masters and moments at dp=1) fits no schedule of the
    layout; its GPU runs used --optimizer plain, and the refusal names it with its prediction."""
    argv = _vlm_argv(train_fit, tp=2, pp=1, optimizer="zero1")
    plain = device_memory_gib([*_vlm_argv(train_fit, tp=2, pp=1), "--schedule", "braided_v"])["braided_v"]
    refusal, _ = train_fit.verdict(argv, ["braided_v"], H100)
    assert refusal is not None and f"try --optimizer plain ({plain:.1f} GiB)" in refusal


def test_the_layouts_that_ran_on_80_gb_cards_pass(train_fit) -> None:
    """tp=2 VLM (both schedules ran at 40-53 GB allocated) and the tp=1 x pp=2 1f1b_i that ran at 46-59 GB."""
    for kw, names in (({"tp": 2, "pp": 1}, ["braided_v", "1f1b_i"]), ({}, ["1f1b_i"])):
        assert train_fit.verdict(_vlm_argv(train_fit, **kw), names, H100)[0] is None, kw


@pytest.mark.parametrize("kw", [{"device": "cpu"}, {"skip_memory_check": True}, {"cp": 2}, {"hf": "ckpt"},
                                {"image_size": 224}, {"model": "no-such-preset"}])
def test_what_is_not_checked(train_fit, kw) -> None:
    assert train_fit.check_fits(_args(**kw), True, ["braided_v"], 2306, rank=0) is None


def test_language_model_presets_map_to_the_catalog(train_fit) -> None:
    assert train_fit.catalog_name(_args(model="7b"), vision=False) == "qwen2-7b"
    assert train_fit.catalog_name(_args(model="qwen3-moe-30b-a3b"), vision=False) == "qwen3-moe-30b-a3b"
    assert train_fit.catalog_name(_args(model="qwen2-vl-7b"), vision=False) is None


def test_a_memory_cap_is_the_card_the_check_compares_with(train_fit) -> None:
    argv = _vlm_argv(train_fit, tp=2, pp=1)
    need = device_memory_gib([*argv, "--schedule", "1f1b_i"])["1f1b_i"]
    refusal, _ = train_fit.verdict(argv, ["1f1b_i"], 0.5 * need * GIB, capped=True)
    assert refusal is not None and f"GPU's {0.5 * need:.1f} GiB (--memory-cap)" in refusal
    assert train_fit.verdict(argv, ["1f1b_i"], 2 * need * GIB, capped=True) == (None, None)


@pytest.mark.parametrize("cap", [4.0, float("nan")])
def test_a_memory_cap_off_cuda_is_one_line(train_fit, cap) -> None:
    got = train_fit.check_fits(_args(device="cpu", memory_cap=cap), True, ["braided_v"], 2306, rank=0)
    assert got == "--memory-cap holds the CUDA caching allocator; it needs --device cuda"


def test_the_example_refuses_a_memory_cap_on_cpu_before_any_work(tmp_path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "examples/lm.py"), "--model", "tiny", "--device", "cpu",
                           "--memory-cap", "4", "--steps", "1"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("--memory-cap holds the CUDA caching allocator; it needs --device cuda")


def test_a_memory_cap_leaves_the_allocator_what_cuda_and_nccl_do_not_hold(train_fit) -> None:
    """The cap is device memory in use (the planner's figure): the allocator gets the cap less the bytes
    ``braid.cost.device_memory`` places outside it, which differ by pipeline rank (a middle rank has two peers)."""
    from braid.cost.device_memory import DEVICE_TERMS, outside_allocator_bytes

    args = _args(tp=1, pp=4, dp=1)  # ranks 0..3 are pipeline ranks 0..3
    first, middle = (train_fit.allocator_share(6.0, args, rank) for rank in (0, 1))
    assert first == 6.0 * GIB - outside_allocator_bytes(DEVICE_TERMS, tp=1, pp=4, pp_rank=0)
    assert first - middle == pytest.approx(DEVICE_TERMS.p2p_pair)  # one more P2P connection, nothing else
    with pytest.raises(ValueError, match=r"^--memory-cap 1: CUDA, NCCL and cuBLAS are predicted to hold [\d.]+ GiB"):
        train_fit.allocator_share(1.0, _args(tp=2, pp=2, dp=2), 0)


def test_a_memory_cap_leaves_out_what_the_run_itself_holds_outside_the_allocator(train_fit) -> None:
    """Given the run's braid.simulate command line, the allocator's share is the cap less that run's most outside
    the allocator: under sequence parallelism the copy-engine TP group, and a whole-step CUDA graph's instantiated
    nodes, which a capped-group layout estimate leaves out (2 H200s: 4357 MiB outside at the capped pick's SP m=16
    run, benchmarks/results/graph_exec_h200x2.txt's diagnostic, against 3169 MiB without SP)."""
    from braid.cost.device_memory import DEVICE_TERMS, outside_allocator_bytes

    args = _args(model="small", tp=2, pp=1, mbs=16, micro_batch_size=1, optimizer="zero1", recompute="full")
    name = train_fit.catalog_name(args, vision=False)
    runs = {sp: [*train_fit.simulate_argv(_args(**{**vars(args), "sequence_parallel": sp}), name, 4096),
                 "--schedule", "braided_v"] for sp in (True, False)}
    plain = train_fit.allocator_share(8.0, args, 0)
    assert plain == 8.0 * GIB - outside_allocator_bytes(DEVICE_TERMS, tp=2, pp=1, pp_rank=0)
    sp, no_sp = (train_fit.allocator_share(8.0, args, 0, runs[x]) for x in (True, False))
    outside = {x: device_memory_gib(runs[x], key="device_outside_gib")["braided_v"] * GIB for x in runs}
    assert sp == 8.0 * GIB - outside[True] and no_sp == 8.0 * GIB - outside[False]
    assert sp < no_sp < plain  # the copy-engine group and its copy nodes; the graph either way
    graph = outside[False] - outside_allocator_bytes(DEVICE_TERMS, tp=2, pp=1, pp_rank=0)
    assert graph == pytest.approx(16 * 66 * (DEVICE_TERMS.graph_unit + DEVICE_TERMS.graph_collective))
    # a command line braid.simulate refuses falls back to the layout's estimate
    assert train_fit.allocator_share(8.0, args, 0, ["--tp", "0"]) == plain
