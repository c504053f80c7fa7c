"""The stop window (issue #34): a save that would not fit the time torchrun gives the ranks after
SIGTERM gets a WARNING naming the seconds, the window and what to change, after the save and when
a run resumes."""

from __future__ import annotations

import json

import pytest

from aoe_megatron.train import stop_window as sw


def test_the_window_comes_from_torchruns_variable_or_its_default_under_torchrun():
    assert sw.window_from_env({sw.WINDOW_VAR: "120"}) == (120.0, sw.WINDOW_VAR)
    seconds, source = sw.window_from_env({"TORCHELASTIC_RUN_ID": "abc"})
    assert seconds == sw.TORCHRUN_DEFAULT and "assumed" in source and sw.WINDOW_VAR in source
    assert sw.window_from_env({}) == (None, None)  # one process, srun alone: nothing to compare
    assert sw.window_from_env({sw.WINDOW_VAR: "soon"}) == (None, None)


def test_needed_is_the_step_in_flight_plus_the_save_with_its_margin_plus_the_exit():
    assert sw.needed_seconds(save_seconds=80.0, step_seconds=5.0) == pytest.approx(
        5.0 + sw.SAVE_MARGIN * 80.0 + sw.EXIT_SECONDS)


@pytest.mark.parametrize("save,window,warns", [(60.0, 120.0, False), (90.0, 120.0, True),
                                               (500.0, None, False)])
def test_a_save_that_does_not_fit_the_window_is_warned_about(save, window, warns):
    text = sw.advice(save_seconds=save, window=window, step_seconds=4.0, nbytes=10_250_000_000)
    if not warns:
        assert text is None
        return
    assert text.startswith("WARNING: the last save took 90.0 s (10.25 GB at 0.11 GB/s)")
    needed = sw.needed_seconds(save_seconds=save, step_seconds=4.0)
    for phrase in (f"about {needed:.0f} s", "120 s stop window", sw.WINDOW_VAR,
                   "SHUTDOWN_TIMEOUT in run/slurm/pretrain.sbatch to at least 130 s",
                   "#SBATCH --signal=TERM@", "faster filesystem", "--save-interval"):
        assert phrase in text, (phrase, text)


def _checkpoint(root, step, state):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps(state))


def test_a_resumed_run_warns_from_the_newest_recorded_save(tmp_path):
    _checkpoint(tmp_path, 2, {"step": 2, "save": {"seconds": 200.0, "bytes": 56e9},
                              "step_seconds": 3.0})
    _checkpoint(tmp_path, 4, {"step": 4})  # written before saves were timed: skipped
    assert sw.last_recorded_save(tmp_path) == {"checkpoint": "step_00000002", "seconds": 200.0,
                                               "bytes": 56e9, "step_seconds": 3.0}
    assert sw.last_recorded_save(tmp_path / "absent") is None
    said = []
    sw.StopWindow(start_step=4, say=said.append, resumed_from=tmp_path,
                  environ={sw.WINDOW_VAR: "120"})
    assert len(said) == 1 and said[0].startswith(
        "WARNING: the last recorded save (step_00000002) took 200.0 s (56.00 GB"), said
    said.clear()
    sw.StopWindow(start_step=4, say=said.append, resumed_from=tmp_path,
                  environ={sw.WINDOW_VAR: "400"})
    assert said == []


def test_each_save_is_reported_and_one_that_does_not_fit_is_warned_about():
    class Reporter:
        lines = []

        def save(self, step, **kw):
            self.lines.append({"step": step, **kw})

    said, reporter = [], Reporter()
    window = sw.StopWindow(start_step=0, say=said.append, reporter=reporter,
                           environ={sw.WINDOW_VAR: "30"})
    assert window.record(0) == {"step_seconds": 0.0}
    stats = {"save": {"seconds": 1.5, "bytes": 2_000_000_000}, "host_peak_bytes": None}
    assert window.saved(10, "ck/step_00000010", seconds=2.0, stats=stats) is None
    assert said == ["saved ck/step_00000010 (2.0 s, 2.00 GB at 1.00 GB/s)"]
    assert reporter.lines[0]["window"] == 30.0 and reporter.lines[0]["nbytes"] == 2_000_000_000
    warning = window.saved(20, "ck/step_00000020", seconds=25.0, stats=stats)
    assert warning is not None and said[-1] == warning and "30 s stop window" in warning
