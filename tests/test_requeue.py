"""Requeue only after a clean exit save: the run's exit record and the decision the SLURM script takes from it."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import run_config, stop_at_iteration, torchrun, train_args

from megatron_snip.arguments import ArgumentError
from megatron_snip.training import requeue
from megatron_snip.training.requeue import ExitRecord, decide

NOW = 1_767_225_600.0  # the time a job launched its run, seconds since the epoch


def record(reason: str, written: float = NOW + 600.0, iteration: int = 1250) -> ExitRecord:
    return ExitRecord(iteration=iteration, reason=reason, train_iters=100000, time=written)


@pytest.mark.parametrize("reason, decision", [
    ("SIGUSR1", "requeue"), ("SIGTERM", "requeue"), ("exit-duration", "requeue"),
    ("finished", "done"), ("exit-interval", "done"), ("something-new", "crash")])
def test_decision_by_reason(reason, decision):
    assert decide(record(reason), since=NOW)[0] == decision


def test_no_record_is_a_crash():
    decision, why = decide(None, since=NOW)
    assert decision == "crash" and "no exit record" in why


def test_an_earlier_runs_record_is_stale():
    """A run that crashed before its loop started (bad flag, OOM while building) leaves the record of the run
    before it, a clean preemption: that must not requeue the crash."""
    decision, why = decide(record("SIGUSR1", written=NOW - 1.0), since=NOW)
    assert decision == "crash" and "older than this run" in why
    assert decide(record("SIGUSR1", written=NOW), since=NOW)[0] == "requeue"  # date +%s truncates: same second


def test_record_round_trip_is_atomic_and_clearable(tmp_path):
    assert requeue.read_record(str(tmp_path)) is None
    rec = record("SIGTERM")
    requeue.write_record(str(tmp_path), rec)
    assert requeue.read_record(str(tmp_path)) == rec
    assert [p.name for p in tmp_path.iterdir()] == ["exit_record.json"]  # no temporary file left
    requeue.clear_record(str(tmp_path))
    requeue.clear_record(str(tmp_path))  # nothing to clear: fine
    assert requeue.read_record(str(tmp_path)) is None
    requeue.clear_record(str(tmp_path / "not-created-yet"))  # --save before the first checkpoint


@pytest.mark.parametrize("content, status, word", [
    (None, 1, "crash"),
    (record("SIGUSR1"), 75, "requeue"),
    (record("finished"), 0, "done"),
    (record("exit-duration", written=NOW - 5), 1, "crash"),
    ("{not json", 1, "crash"),
])
def test_command_line_prints_the_decision_and_exits_with_its_status(tmp_path, capsys, content, status, word):
    if isinstance(content, ExitRecord):
        requeue.write_record(str(tmp_path), content)
    elif content is not None:
        (tmp_path / requeue.RECORD).write_text(content)
    assert requeue.main([str(tmp_path), "--since", str(NOW)]) == status
    out = capsys.readouterr().out
    assert out.startswith(f"{word}: ") and out.count("\n") == 1, out


def test_exit_flags_parse():
    assert run_config("--exit-duration-in-mins", "0.5").training.exit_duration_in_mins == 0.5
    assert run_config("--exit-duration-in-mins", "230").training.exit_duration_in_mins == 230.0  # Megatron's ints
    assert run_config().training.exit_duration_in_mins is None
    run_config("--exit-signal-handler")  # Megatron-LM's flag: accepted, the handler is always on
    with pytest.raises(ArgumentError, match=r"--exit-duration-in-mins 0.0 must be > 0"):
        run_config("--exit-duration-in-mins", "0")


def read(ckpt) -> ExitRecord | None:
    return requeue.read_record(str(ckpt))


@pytest.mark.integration
def test_exit_duration_saves_with_a_record_and_a_crash_leaves_none(tiny_data, tmp_path):
    """--exit-duration-in-mins 0.001 has passed by the first iteration: all ranks agree at the next and stop
    there with a checkpoint and a record asking for a requeue. The requeued run crashes (a NaN under the
    default --non-finite-grad-policy fail): the earlier record is gone and no new one is written."""
    ckpt = tmp_path / "ckpt"
    launched = time.time()
    first = torchrun(2, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
                                   "--load", str(ckpt), "--exit-duration-in-mins", "0.001", iters=6))
    assert "--exit-duration-in-mins 0.001: " in first.stdout and "saving at iteration 2 and exiting" in first.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    rec = read(ckpt)
    assert (rec.iteration, rec.reason, rec.train_iters) == (2, "exit-duration", 6) and rec.time >= launched
    assert decide(rec, since=launched)[0] == "requeue"

    launched = time.time()
    second = torchrun(1, train_args(tiny_data, "--save", str(ckpt), "--load", str(ckpt), iters=6), check=False,
                      script="tests/drivers/inject_nonfinite.py",
                      env={"INJECT_AT": "3", "INJECT_PARAM": "decoder.layers.1.mlp.linear_fc2.weight"})
    assert second.returncode == 1 and "resumed from" in second.stdout, second.stderr[-3000:]
    assert read(ckpt) is None
    assert decide(read(ckpt), since=launched)[0] == "crash"


@pytest.mark.integration
def test_sigterm_to_torchrun_leaves_a_record_asking_for_a_requeue(tiny_data, tmp_path):
    """What SLURM does at preemption: SIGTERM to the launcher. torchrun passes it on to the workers and exits
    non-zero (a SignalException), as after a crash; the workers save at the next iteration and the record
    says so, which is what the SLURM script reads."""
    ckpt = tmp_path / "ckpt"
    launched = time.time()
    _, output = stop_at_iteration(train_args(tiny_data, "--save", str(ckpt), iters=100000), 1, 2,
                                  lambda proc: proc.send_signal(signal.SIGTERM))
    assert "exit signal received: saving at iteration" in output and "(SIGTERM)" in output, output[-4000:]
    rec = read(ckpt)
    assert rec is not None and rec.reason == "SIGTERM", output[-4000:]
    assert rec.iteration == int((ckpt / "latest_checkpointed_iteration.txt").read_text()) >= 2
    assert decide(rec, since=launched)[0] == "requeue"
