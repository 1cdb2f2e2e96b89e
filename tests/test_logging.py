"""Logging like Megatron-LM's (training/tags.py, training/logger.py, training/progress.py): Megatron-LM's
TensorBoard tags with the right values and flags, the same scalars on W&B (offline), and the progress line;
a SNIP re-plan's measured step against --snip-time-target (training/time_check.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_config, scalars, torchrun, train_args

from megatron_snip.arguments import ArgumentError
from megatron_snip.training import tags
from megatron_snip.training.logger import hms, open_wandb
from megatron_snip.training.metrics_record import MetricsRecord, read_metrics
from megatron_snip.training.precision_setup import missed_time_target
from megatron_snip.training.progress import LogWindow, StepResult
from megatron_snip.training.time_check import TimeTargetCheck


def tensorboard_tags(tensorboard_dir: Path) -> tuple[set[str], set[str]]:
    """(scalar tags, text/tensor tags) of the event files in ``tensorboard_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalar, tensor = set(), set()
    for run in Path(tensorboard_dir).glob("**/events.out.tfevents.*"):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        scalar |= set(acc.Tags()["scalars"])
        tensor |= set(acc.Tags()["tensors"])
    return scalar, tensor


def wandb_records(wandb_dir: Path) -> list[dict]:
    """The records of the one offline W&B run under ``wandb_dir``, read by wandb's own reader."""
    (run_file,) = Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", str(run_file), "--json"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_logging_flags_have_megatrons_defaults():
    log = run_config().logging
    assert (log.log_interval, log.tensorboard_log_interval, log.tensorboard_queue_size) == (100, 1, 1000)
    assert log.log_loss_scale_to_tensorboard and log.timing_log_level == 0
    assert not (log.log_throughput or log.log_timers_to_tensorboard or log.log_memory_to_tensorboard
                or log.log_validation_ppl_to_tensorboard or log.log_params_norm or log.log_num_zeros_in_grad
                or log.log_world_size_to_tensorboard or log.wandb_project)
    assert not run_config("--no-log-loss-scale-to-tensorboard").logging.log_loss_scale_to_tensorboard


def test_wandb_needs_a_directory_and_the_package(monkeypatch, tmp_path):
    with pytest.raises(ArgumentError, match=r"--wandb-project needs a directory .*--wandb-save-dir"):
        run_config("--wandb-project", "p")
    config = run_config("--wandb-project", "p", "--wandb-save-dir", str(tmp_path)).logging
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(SystemExit, match=r"--wandb-project needs the wandb package: pip install wandb"):
        open_wandb(config, None, {})


def test_metrics_record_keeps_the_last_value_and_survives_a_cut_line(tmp_path):
    """A resumed run logs the iterations after its checkpoint again: the last value counts; a line cut short
    by a crash is skipped; non-finite values come back as NaN; a newer record is refused."""
    record = MetricsRecord(str(tmp_path))
    record.write(1, {"lm loss": 5.0, "grad-norm": math.inf})
    record.write(2, {"lm loss": 4.5})
    record.write(2, {"lm loss": 4.25})  # the resumed run's iteration 2
    record.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"version": 1, "iteration": 3, "scal')
    metrics = read_metrics(tmp_path)
    assert metrics["lm loss"] == {1: 5.0, 2: 4.25} and math.isnan(metrics["grad-norm"][1])
    (tmp_path / "metrics.jsonl").write_text('{"version": 2, "iteration": 1, "scalars": {}}\n')
    with pytest.raises(ValueError, match="metrics record version 2 is newer"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_hms():
    assert [hms(s) for s in (0, 61.4, 3599.6, 30 * 3600 + 62)] == ["00:00:00", "00:01:01", "01:00:00", "30:01:02"]


def window(*seconds: float) -> LogWindow:
    """A log window of applied steps that took ``seconds`` each."""
    out = LogWindow()
    for s in seconds:
        out.add(StepResult(None, 1.0, None, True, s))
    return out


def test_a_replans_first_whole_window_is_checked_against_the_time_target():
    """The last whole bf16 window is the reference; the first window wholly under SNIP's plan is judged once
    (a window the plan changed within measures neither plan); a re-plan that meets the target says nothing."""
    check = TimeTargetCheck(time_target=0.8, bf16_gemm=0.030)  # the table: 30 ms of GEMMs per bf16 step
    assert check.window(2, window(0.050, 0.052), plan_since=1, all_bf16=True) is None  # cold
    assert check.window(4, window(0.040, 0.040), plan_since=1, all_bf16=True) is None  # warm: the reference
    assert check.replanned(4, all_bf16=False) is None  # SNIP's plan from 5 on: a reference exists, nothing to say
    assert check.window(5, window(0.037), plan_since=5, all_bf16=False) == (
        f"[snip] iteration 5: {missed_time_target(0.8, 0.040, 0.030, 0.037)}")  # a GEMM time of 0.9 of bf16
    assert check.window(6, window(0.037), plan_since=5, all_bf16=False) is None  # judged once
    check.replanned(6, all_bf16=False)
    assert check.window(8, window(0.037, 0.037), plan_since=8, all_bf16=False) is None  # promoted at 8: mixed
    assert check.pending
    assert check.window(10, window(0.036, 0.036), plan_since=8, all_bf16=False) is None  # 0.867: within 10%
    assert not check.pending


def test_a_run_without_a_bf16_window_says_once_that_it_cannot_check():
    check = TimeTargetCheck(time_target=0.9, bf16_gemm=0.030)  # resumed from a checkpoint's SNIP plan
    assert check.replanned(4, all_bf16=True) is None  # a bf16 plan: nothing to check, nothing to say
    assert check.replanned(10, all_bf16=False) == (
        "[snip] iteration 10: the measured step is not checked against --snip-time-target 0.9: no log window of "
        "this run ran in bf16 to compare it with (it started from a plan that is not bf16: a checkpoint's or "
        "--snip-warmup-plan's)")
    assert check.window(11, window(0.5), plan_since=11, all_bf16=False) is None
    assert check.replanned(20, all_bf16=False) is None


def test_the_time_check_needs_a_time_target_and_a_measured_speed_table():
    from megatron_snip.precision.gemm_speed import peak_speed_model, speed_model_from_times

    shapes = {"self_attention.linear_qkv": (32, 64, 128), "mlp.linear_fc2": (32, 192, 64)}
    times = {m: {p: (0.001, 0.002) for p in ("bf16", "fp8", "nvfp4", "mxfp4")} for m in shapes}
    measured = speed_model_from_times(times, shapes, run_config().precision.recipe(), device="CPU", source="by hand")
    names = ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc2"]
    target = run_config("--snip", "--snip-interval", "2", "--snip-time-target", "1")
    check = TimeTargetCheck.of_run(target, measured, names)
    assert check == TimeTargetCheck(1.0, 2 * 0.003)  # 1 micro-batch of 2 linears, 1 + 2 ms each
    assert TimeTargetCheck.of_run(target, peak_speed_model("auto"), names) is None  # an estimate has no seconds
    assert TimeTargetCheck.of_run(run_config("--snip", "--snip-interval", "2"), measured, names) is None


def write_lying_speed_table(directory: Path, config) -> None:
    """A measured speed table in the cache ``directory`` for ``config``'s linears on this CPU that says every
    precision runs at bf16's speed, where the emulated ones are many times slower."""
    from megatron_snip.precision.flops import LlamaLinearDims
    from megatron_snip.precision.gemm_speed import cache_key, cache_path
    from megatron_snip.training.precision_setup import linear_shapes, timed_precisions

    shapes = linear_shapes(config, LlamaLinearDims.from_config(config.model))
    names = timed_precisions(config)  # what the run times at start-up: the cache file's key names them
    key = cache_key(shapes, config.precision.recipe(), torch.device("cpu"), config.model.params_dtype, names)
    seconds = {module: {p: (1e-5, 3e-5) for p in names} for module in shapes}
    directory.mkdir()
    cache_path(key, directory).write_text(json.dumps({"key": key, "seconds": seconds}))


@pytest.mark.integration
def test_megatron_tags_values_and_wandb(tiny_data, tmp_path):
    """Every Megatron-LM switch on: Megatron-LM's tags with the console's, the scheduler's and exp(loss)'s
    values, this program's beside them, the config panel, and the same scalars in an offline W&B run. With
    SNIP under --snip-time-target 1 (a speed table that prices emulated NVFP4 as bf16 makes a plan with NVFP4
    meet it), warmed up in FP8: its measured step has no bf16 window to be checked against, and the log
    says so once."""
    tb = tmp_path / "tb"
    snip = ["--snip", "--snip-time-target", "1", "--snip-fp4-target", "0.5", "--snip-interval", "2",
            "--snip-probe-passes", "1", "--snip-warmup-plan", "fp8"]
    write_lying_speed_table(tmp_path / "cache", run_config("--micro-batch-size", "2", "--seq-length", "64", *snip))
    proc = torchrun(1, train_args(
        tiny_data, "--tensorboard-dir", str(tb), "--eval-interval", "2", "--log-throughput",
        "--log-timers-to-tensorboard", "--timing-log-level", "1", "--log-memory-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--log-params-norm", "--log-num-zeros-in-grad",
        "--log-world-size-to-tensorboard", "--wandb-project", "snip-test", "--wandb-exp-name", "tiny",
        "--wandb-save-dir", str(tmp_path / "wb"), "--save", str(tmp_path / "ckpt"), *snip, iters=4),
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MEGATRON_SNIP_CACHE": str(tmp_path / "cache")})
    steps = [1, 2, 3, 4]
    assert "speed model measured on CPU (forward + backward of each linear shape (4) in each precision, read from" \
        in proc.stdout
    fp4 = scalars(tb, tags.FP4_FRACTION)
    assert fp4[1] == fp4[2] == 0 and fp4[3] >= 0.5 - 1e-6 and fp4[4] >= 0.5 - 1e-6  # SNIP's from iteration 3 on
    assert scalars(tb, tags.GEMM_TIME) == pytest.approx({k: 1.0 for k in steps})  # the table's word
    assert re.findall(r"^\[snip\] iteration \d+: the measured step is not checked.*$", proc.stdout, re.M) == [
        "[snip] iteration 2: the measured step is not checked against --snip-time-target 1: no log window of this "
        "run ran in bf16 to compare it with (it started from a plan that is not bf16: a checkpoint's or "
        "--snip-warmup-plan's)"]
    scalar_tags, text_tags = tensorboard_tags(tb)
    megatron = {tags.LM_LOSS, tags.LEARNING_RATE, tags.BATCH_SIZE, tags.LOSS_SCALE, tags.WORLD_SIZE, tags.GRAD_NORM,
                tags.NUM_ZEROS, tags.PARAMS_NORM}
    timing = {tags.ITERATION_TIME, tags.THROUGHPUT, tags.timer("forward-backward"), tags.timer("optimizer")}
    validation = {tags.LM_LOSS_VALIDATION, tags.LM_LOSS_VALIDATION_PPL}
    ours = {tags.FP4_FRACTION, tags.FP8_FRACTION, tags.GEMM_TIME, tags.SKIPPED_ITERATIONS, tags.TOKENS_PER_SECOND,
            tags.RSS, tags.UNIGRAM_ENTROPY}
    want = megatron | timing | validation | ours | {tags.vs_samples(t) for t in megatron | validation}
    assert want <= scalar_tags, sorted(want - scalar_tags)
    assert not {t for t in scalar_tags if t.startswith("mem-")}  # Megatron-LM's memory tags are CUDA's
    assert f"{tags.CONFIG}/text_summary" in text_tags
    for tag in megatron | timing | ours - {tags.UNIGRAM_ENTROPY}:
        assert sorted(scalars(tb, tag)) == steps, tag

    # The console's progress line: Megatron-LM's fields, then ours, elapsed and ETA.
    lines = re.findall(r"^\[train\] iteration +(\d+)/ +4 \| consumed samples: +(\d+) \| (.*)$", proc.stdout, re.M)
    assert [(int(i), int(s)) for i, s, _ in lines] == [(k, 8 * k) for k in steps]
    fields = [dict(f.split(": ", 1) for f in rest.rstrip(" |").split(" | ")) for *_, rest in lines]
    assert list(fields[0])[:4] == ["elapsed time per iteration (ms)", "throughput per process (TFLOP/s/process)",
                                   "learning rate", "global batch size"]
    assert {"lm loss", "loss scale", "grad norm", "num zeros", "params norm", "number of skipped iterations",
            "tokens per second", "fp4 flops fraction", "elapsed", "ETA"} <= set(fields[0])
    assert re.fullmatch(r"\d\d:\d\d:\d\d", fields[-1]["ETA"]) and fields[-1]["ETA"] == "00:00:00"
    assert "forward-backward ....." in proc.stdout  # --timing-log-level 1's (min, max) lines

    loss = scalars(tb, tags.LM_LOSS)
    assert loss == pytest.approx({k: float(f["lm loss"]) for k, f in zip(steps, fields)}, rel=2e-6)
    assert scalars(tb, tags.vs_samples(tags.LM_LOSS)) == {8 * k: loss[k] for k in steps}
    # The scheduler's learning rate after each step: 1 warm-up step to 1e-2, then cosine to 0 at step 4.
    lr = {1: 1e-2, 2: 1e-2 * 0.75, 3: 1e-2 * 0.25, 4: 0.0}
    assert scalars(tb, tags.LEARNING_RATE) == pytest.approx(lr, rel=1e-6, abs=1e-12)
    assert {k: float(f["learning rate"]) for k, f in zip(steps, fields)} == pytest.approx(lr, rel=1e-6, abs=1e-12)
    assert set(scalars(tb, tags.BATCH_SIZE).values()) == {8} and set(scalars(tb, tags.WORLD_SIZE).values()) == {1}
    assert set(scalars(tb, tags.LOSS_SCALE).values()) == {1.0}
    grad_norm, params_norm = scalars(tb, tags.GRAD_NORM), scalars(tb, tags.PARAMS_NORM)
    assert all(0 < v < math.inf for v in grad_norm.values()) and all(v > 0 for v in params_norm.values())
    assert params_norm == pytest.approx({k: float(f["params norm"]) for k, f in zip(steps, fields)}, abs=1e-3)
    assert all(v >= 0 for v in scalars(tb, tags.NUM_ZEROS).values())
    assert all(v > 0 for t in timing for v in scalars(tb, t).values())
    valid = scalars(tb, tags.LM_LOSS_VALIDATION)
    assert sorted(valid) == [2, 4]
    assert scalars(tb, tags.LM_LOSS_VALIDATION_PPL) == pytest.approx({k: math.exp(v) for k, v in valid.items()},
                                                                     rel=1e-5)
    assert scalars(tb, tags.vs_samples(tags.LM_LOSS_VALIDATION)) == {16: valid[2], 32: valid[4]}
    (printed,) = re.findall(r"validation loss at iteration 4 \| lm loss value: (\S+) \|", proc.stdout)
    assert float(printed) == pytest.approx(valid[4], rel=1e-6)  # TensorBoard keeps float32

    # W&B: the same scalars at the same iterations (TensorBoard keeps float32), the run's flags as its config.
    records = wandb_records(tmp_path / "wb")
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "tiny" and run["project"] == "snip-test"
    assert run["config"]["update"]["lr"] == 0.01 and run["config"]["update"]["train_iters"] == 4
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == steps
    for tag in (tags.LM_LOSS, tags.LEARNING_RATE, tags.GRAD_NORM, tags.PARAMS_NORM, tags.FP4_FRACTION,
                tags.ITERATION_TIME):
        assert {k: np.float32(h[tag]) for k, h in history.items()} == scalars(tb, tag), tag
    assert {k: h[tags.SAMPLES_VS_STEPS] for k, h in history.items()} == {k: 8 * k for k in steps}
    assert {k: np.float32(h[tags.LM_LOSS_VALIDATION]) for k, h in history.items()
            if tags.LM_LOSS_VALIDATION in h} == valid

    # The run's own record (SAVE/metrics.jsonl): every TensorBoard scalar, at the same iterations.
    record = read_metrics(tmp_path / "ckpt")
    for tag in scalar_tags - {tags.vs_samples(t) for t in scalar_tags}:
        assert {k: np.float32(v) for k, v in record[tag].items()} == scalars(tb, tag), tag


@pytest.mark.integration
def test_tensorboard_log_interval_and_default_switches(tiny_data, tmp_path):
    """--tensorboard-log-interval 2 writes the per-iteration scalars every second iteration; without the
    --log-* switches only Megatron-LM's default tags are written (and --no-log-loss-scale-to-tensorboard
    drops loss-scale)."""
    tb = tmp_path / "tb"
    proc = torchrun(1, train_args(tiny_data, "--tensorboard-dir", str(tb), "--tensorboard-log-interval", "2",
                                  "--log-interval", "3", "--no-log-loss-scale-to-tensorboard", iters=4))
    scalar_tags, _ = tensorboard_tags(tb)
    for tag in (tags.LM_LOSS, tags.LEARNING_RATE, tags.BATCH_SIZE, tags.GRAD_NORM):
        assert sorted(scalars(tb, tag)) == [2, 4] and sorted(scalars(tb, tags.vs_samples(tag))) == [16, 32], tag
    assert sorted(scalars(tb, tags.FP4_FRACTION)) == [2, 4]
    assert sorted(scalars(tb, tags.TOKENS_PER_SECOND)) == [3]  # every --log-interval
    absent = {tags.LOSS_SCALE, tags.WORLD_SIZE, tags.NUM_ZEROS, tags.PARAMS_NORM, tags.ITERATION_TIME,
              tags.THROUGHPUT, tags.LM_LOSS_VALIDATION_PPL, tags.RSS}
    assert not absent & scalar_tags, sorted(absent & scalar_tags)
    assert sorted(scalars(tb, tags.LM_LOSS_VALIDATION)) == [4]
    assert re.findall(r"^\[train\] iteration +(\d+)/", proc.stdout, re.M) == ["3"]
