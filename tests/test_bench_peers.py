"""The bench's peer rows: every baseline in every mode of its peer, named, with why a mode cannot run,
and braid's best over each peer's best row per round."""

from __future__ import annotations

import pytest

from braid.measure.peers import best_per_peer, format_per_peer, peer_runs
from braid.baselines.modes import McoreMode, TorchMode, default_torch_modes, parse_modes


def test_modes_parse_and_name_themselves() -> None:
    assert TorchMode.parse("eager") == TorchMode()
    assert TorchMode.parse("compile+titan").label == "titan+compile"
    assert TorchMode.parse("titan+compile+async_tp") == TorchMode("titan", True, True)
    assert McoreMode.parse("graphed+te") == McoreMode("te", True)
    assert McoreMode.parse("eager").label == "eager"
    with pytest.raises(ValueError, match="use titan\\+compile\\+async_tp"):
        TorchMode.parse("compile+async_tp")
    with pytest.raises(ValueError, match="unknown torch mode 'fast'"):
        TorchMode.parse("fast")
    with pytest.raises(ValueError, match="at tp=1 use eager or compile"):
        parse_modes(["torch_zb_v"], ["titan"], [], tp=1)


def test_default_rows_are_eager_and_best_of_each_peer_and_say_why_on_cpu() -> None:
    assert default_torch_modes(2) == ("eager", "titan+compile+async_tp")
    assert default_torch_modes(1) == ("eager", "compile")
    rows = peer_runs(["torch_zb_v", "mcore_1f1b_i"], default_torch_modes(2), ["eager", "graphed"], tp=2, device_type="cpu")
    assert [r.label for r in rows] == ["torch:ScheduleZBVZeroBubble [eager]",
                                       "torch:ScheduleZBVZeroBubble [titan+compile+async_tp]",
                                       "mcore:interleaved 1F1B [eager]", "mcore:interleaved 1F1B [graphed]"]
    why = {r.label: r.why for r in rows}
    assert why["torch:ScheduleZBVZeroBubble [eager]"] is None and why["mcore:interleaved 1F1B [eager]"] is None
    assert "compiled layer" in why["torch:ScheduleZBVZeroBubble [titan+compile+async_tp]"]
    assert "CUDA graph needs CUDA" in why["mcore:interleaved 1F1B [graphed]"]
    assert [r.peer for r in rows] == ["torch", "torch", "mcore", "mcore"]


def test_split_backward_schedules_run_eager_only_and_interleaved_1f1b_compiles() -> None:
    # torch's ZB-V and DualPipeV fail at the W step of a compiled layer on one rank only, which
    # would leave its peer waiting in a P2P receive: those rows say why instead of running.
    rows = peer_runs(["torch_1f1b_i", "torch_zb_v", "torch_dualpipe_v"], ["compile"], [], tp=1, device_type="cpu")
    why = {r.name: r.why for r in rows}
    assert "pytorch/pytorch#161904" in why["torch_zb_v"] and "pytorch/pytorch#161904" in why["torch_dualpipe_v"]
    assert why["torch_1f1b_i"] is None or "compiled layer" not in why["torch_1f1b_i"]


def test_best_per_peer_takes_each_peers_fastest_row_within_each_round() -> None:
    runs = [{"m": 4, "step_s_rounds": [1.0, 2.0]}, {"m": 4, "step_s_rounds": [0.5, 4.0]}]  # braid's best: 0.5, 2.0
    ext = [{"schedule": "t [eager]", "peer": "torch", "m": 4, "step_s_rounds": [3.0, 3.0]},
           {"schedule": "t [compile]", "peer": "torch", "m": 4, "step_s_rounds": [2.0, 5.0]},
           {"schedule": "m [graphed]", "peer": "mcore", "m": 4, "step_s_rounds": [1.0, 1.0]},
           {"schedule": "m [te]", "peer": "mcore", "m": 4, "error": "not installed"}]
    got = best_per_peer(runs, ext)[4]
    assert got["torch"]["rounds"] == [2.0 / 0.5, 3.0 / 2.0]
    assert got["torch"]["best_rows"] == ["t [compile]", "t [eager]"]
    assert got["mcore"]["rounds"] == [1.0 / 0.5, 1.0 / 2.0]
    lines = format_per_peer({4: got})
    assert lines[0].startswith("braid's best / mcore's best at m=4: 1.250x [0.500, 2.000]; mcore's best row: m [graphed] (2/2")
    assert "t [compile] (1/2 rounds), t [eager] (1/2 rounds)" in lines[1]


def test_bench_refuses_a_bad_mode_before_any_work(capsys) -> None:
    from braid.bench import main

    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--pp", "2", "--torch-modes", "warp"])
    assert e.value.code == 2
    assert "unknown torch mode 'warp'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--pp", "2", "--baselines", "deepspeed"])
    assert e.value.code == 2
    assert "unknown baseline 'deepspeed'" in capsys.readouterr().err


def test_without_megatron_core_the_bench_has_no_mcore_rows_and_says_how_to_install_it(monkeypatch) -> None:
    """megatron-core is an optional extra: with it absent (import fails), the baselines list and the
    bench's rows leave it out and the report's note names the extra."""
    import sys

    from braid.baselines import megatron_gpt
    from braid.baselines.torch_pp import available_baselines
    from braid.measure.report import _megatron_line

    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as when it is not installed
    assert not megatron_gpt.available()
    names = available_baselines()
    assert names and not any(n.startswith("mcore") for n in names)
    rows = peer_runs(names, default_torch_modes(1), ["eager", "graphed"], tp=1, device_type="cpu")
    assert rows and {r.peer for r in rows} == {"torch"}
    assert "not installed" in _megatron_line() and ".[megatron]" in _megatron_line()
