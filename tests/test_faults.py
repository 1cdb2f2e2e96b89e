"""Faults that must lose nothing: kill -9 at any moment, SIGTERM mid-cycle, a full disk, damaged inputs.

Process and disk faults come from a test-only driver, tests/drivers/faults.py (no production flag).
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import subprocess
import time

import pytest
from conftest import ROOT, launch, scalars, torchrun, torchrun_command, torchrun_env, train_args
from drivers.faults import signal_group

from megatron_snip.arguments import ArgumentError, parse_config
from megatron_snip.training import tags

DRIVER = "tests/drivers/faults.py"
LAYOUT = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
# 5 steps: SNIP cycles at 2 and 4 (one probe pass each), checkpoints at 3 and at the end.
CHAIN = ("--snip", "--snip-fp4-target", "0.5", "--snip-interval", "2", "--snip-probe-passes", "1",
         "--save-interval", "3")
TAGS = (tags.LM_LOSS, tags.GRAD_NORM, tags.FP4_FRACTION, tags.snip("objective"))
WORKER_TRACEBACK = re.compile(r"\[rank\d\]:\s*Traceback")


def tracker(ckpt) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


@pytest.mark.integration
def test_kill_9_anywhere_then_resume_is_exact(tiny_data, tmp_path):
    """TP2 x PP2, 4 ranks, every one killed -9: mid-save, then mid-SNIP-cycle (during a probe pass),
    then SIGTERM'd mid-cycle. Each start resumes from the newest complete checkpoint and every logged
    number (TensorBoard, bit for bit) equals the uninterrupted run's."""
    ckpt = tmp_path / "ckpt"

    def run(tb: str, fault: str, at: int):
        return torchrun(4, train_args(tiny_data, *LAYOUT, *CHAIN, "--load", str(ckpt), "--save", str(ckpt),
                                      "--tensorboard-dir", str(tmp_path / tb), iters=5),
                        check=False, script=DRIVER, timeout=600,
                        env={"FAULT": fault, "FAULT_AT": str(at), "FLUSH_TENSORBOARD": "1"})

    # 1. Steps 1-5 uninterrupted (the reference), then every rank is killed while the final checkpoint
    #    is half written (rank 0's shards on disk, the others' and the metadata not).
    first = run("tb_ref", "kill_in_save", 5)
    assert first.returncode != 0 and "saved checkpoint" in first.stdout, first.stderr[-3000:]
    assert tracker(ckpt) == 3 and not (ckpt / "iter_0000005").exists()
    assert any((ckpt / "iter_0000005.tmp").glob("*.distcp"))  # the half-written one
    assert not (ckpt / "iter_0000005.tmp" / ".metadata").exists()
    ref = {tag: scalars(tmp_path / "tb_ref", tag) for tag in TAGS}
    assert sorted(ref[tags.LM_LOSS]) == [1, 2, 3, 4, 5] and sorted(ref[tags.snip("objective")]) == [2, 4]

    # 2. Resumed from 3 (not the partial 5), killed during the probe pass of the SNIP cycle at 4.
    second = run("tb_2", "kill_in_probe", 4)
    assert second.returncode != 0
    assert f"resumed from {ckpt} at iteration 3" in second.stdout
    assert "[train] iteration        4/" in second.stdout and "[snip] iteration       4" not in second.stdout
    assert scalars(tmp_path / "tb_2", tags.LM_LOSS) == {4: ref[tags.LM_LOSS][4]}
    assert tracker(ckpt) == 3

    # 3. Resumed from 3 again; SLURM's SIGTERM reaches every rank during the probe pass at 4: the cycle
    #    completes, step 5 runs, the run saves and exits 0.
    third = run("tb_3", "term_in_probe", 4)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"resumed from {ckpt} at iteration 3" in third.stdout
    assert "exit signal received: saving at iteration 5 and exiting" in third.stdout
    assert tracker(ckpt) == 5 and (ckpt / "iter_0000005" / ".metadata").is_file()
    assert not (ckpt / "iter_0000005.tmp").exists()
    for tag in TAGS:
        resumed = scalars(tmp_path / "tb_3", tag)
        assert resumed and resumed == {k: v for k, v in ref[tag].items() if k > 3}, tag  # bit-identical


@pytest.mark.integration
def test_sigterm_after_a_periodic_save_still_saves(tiny_data, tmp_path):
    """A run that has saved before (every iteration here) gets SLURM's SIGTERM on every process of the job,
    as torchrun's own shutdown sends it to each worker's process group. That reaches the helper process that
    megatron-core's checkpoint writer spawned at the first save; the save the signal asks for must still
    succeed (it failed with BrokenPipeError when that helper died of the signal)."""
    ckpt = tmp_path / "ckpt"
    run = torchrun(2, train_args(tiny_data, "--tensor-model-parallel-size", "2", *CHAIN[:-1], "1",
                                 "--save", str(ckpt), iters=6),
                   check=False, script=DRIVER, timeout=600, env={"FAULT": "term_in_probe", "FAULT_AT": "4"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "saved checkpoint" in run.stdout.split("[train] iteration        4/")[0]  # saves before the signal
    assert "exit signal received: saving at iteration 5 and exiting" in run.stdout
    assert tracker(ckpt) == 5 and (ckpt / "iter_0000005" / ".metadata").is_file()


@pytest.mark.integration
def test_a_stop_during_a_slow_save_keeps_the_save_within_the_tools_grace(tiny_data, tmp_path):
    """SIGTERM reaches torchrun while the final checkpoint is being written, and the write takes 6 s more.
    torchrun SIGKILLs its workers a grace period after passing the signal on (TORCH_ELASTIC_SHUTDOWN_TIMEOUT):
    with 2 s the save is cut and the checkpoint lost (what tools/lab/compare_precision.py hit with torch's 30 s
    default under load); with the grace the tool gives its runs (comparison.run_env) the save completes."""
    from snip_lab.comparison import STOP_GRACE_S, run_env

    assert run_env(0, 1, 1)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(STOP_GRACE_S) and STOP_GRACE_S >= 300
    fault = {"FAULT": "slow_save", "FAULT_AT": "3", "FAULT_SLEEP": "6"}
    for grace, saved in (("2", False), (run_env(0, 1, 1)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], True)):
        ckpt = tmp_path / f"grace{grace}"
        run = torchrun(1, train_args(tiny_data, "--save", str(ckpt), iters=3), check=False, script=DRIVER,
                       timeout=600, env={**fault, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": grace})
        log = run.stdout + run.stderr
        assert "exit signal received" not in log  # the signal came after the last iteration: no extra step
        if saved:
            assert tracker(ckpt) == 3 and (ckpt / "iter_0000003" / ".metadata").is_file(), log[-3000:]
        else:
            assert not (ckpt / "latest_checkpointed_iteration.txt").exists(), log[-3000:]
            assert not (ckpt / "iter_0000003").exists()


@pytest.mark.integration  # it starts the helper process
def test_the_checkpoint_writer_helper_survives_stop_signals():
    """The Manager process megatron-core's writer would spawn (and a stop signal would kill) is ours: SIGTERM
    and SIGUSR1 leave it serving, and this process's signal mask is as it was (nothing left blocked). The
    write results it carries (torch.distributed.checkpoint's classes) reach it as bytes: it never loads torch."""
    import os

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from megatron_snip.training import save_helper

    save_helper.install()
    queue = filesystem_async._results_queue
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        os.kill(save_helper._manager._process.pid, sig)
    time.sleep(0.5)
    written = {0: [WriteResult(index=MetadataIndex("layer.weight"), size_in_bytes=64, storage_data="__0_0.distcp")]}
    queue.put(written)
    assert queue.get_nowait() == written
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()
    loaded = [m.path for m in psutil.Process(save_helper._manager._process.pid).memory_maps()]
    assert loaded and not [path for path in loaded if "libtorch" in path]


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL every process of a torchrun job started in a session of its own: each worker's process group
    (torchrun gives every worker its own session; a checkpoint writer a worker forked is in it), then the agent's."""
    import psutil

    try:
        workers = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        workers = []
    for pid in [*(w.pid for w in workers), proc.pid]:
        signal_group(pid, signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.mark.integration
def test_kill_9_at_random_moments_several_times_then_resume_is_exact(tiny_data, tmp_path):
    """The TP2 x PP2 SNIP run of the test above (checkpoints every 2 steps here) killed -9, every process
    of the job, at three moments in a row drawn at random over the first half of the uninterrupted run's
    duration (start-up, steps, SNIP cycles and saves alike; each restart loses the steps since the last
    checkpoint, so later kills land further on), resuming each time. After every kill the newest checkpoint
    named is complete, and the run that finishes logs the same numbers as the uninterrupted one, bit for bit.
    The seed and the moments are printed (pytest -s) and in every failure."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    flags = [*LAYOUT, *CHAIN[:-1], "2", "--load", str(ckpt), "--save", str(ckpt)]
    assert CHAIN[-2] == "--save-interval"

    def args(tb: str) -> list[str]:
        return train_args(tiny_data, *flags, "--tensorboard-dir", str(tmp_path / tb), iters=8)

    start = time.monotonic()
    # Under torchrun, as the runs killed: its duration is the span their moments are drawn from.
    torchrun(4, train_args(tiny_data, *LAYOUT, *CHAIN[:-1], "2", "--save", str(tmp_path / "ckpt_ref"),
                           "--tensorboard-dir", str(tmp_path / "tb_ref"), iters=8), timeout=600)
    duration = time.monotonic() - start
    ref = {tag: scalars(tmp_path / "tb_ref", tag) for tag in TAGS}
    moments = []
    for attempt in range(3):
        delay = rng.uniform(0.15, 0.5) * duration
        with open(tmp_path / f"out_{attempt}.txt", "w") as out:
            proc = subprocess.Popen(torchrun_command(4, args(f"tb_{attempt}")), cwd=ROOT, env=torchrun_env(),
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=delay)  # finished before its moment: nothing left to kill
            except subprocess.TimeoutExpired:
                _kill_job(proc)
        log = (tmp_path / f"out_{attempt}.txt").read_text()
        steps = re.findall(r"\[train\] iteration\s+(\d+)", log)
        moments.append(f"{delay:.1f} s (last step logged: {steps[-1] if steps else 'none'}, exit {proc.returncode})")
        if (ckpt / "latest_checkpointed_iteration.txt").exists():
            assert (ckpt / f"iter_{tracker(ckpt):07d}" / ".metadata").is_file(), moments

    final = launch(4, args("tb_final"), timeout=600)
    resumed = re.search(r"resumed from .* at iteration (\d+)", final.stdout)
    since = int(resumed.group(1)) if resumed else 0
    context = f"seed {seed}, run of {duration:.1f} s killed at {moments}, final run from iteration {since}"
    print(context)
    assert any("exit -9" in m for m in moments) and tracker(ckpt) == 8, context
    for tag in TAGS:
        assert scalars(tmp_path / "tb_final", tag) == {k: v for k, v in ref[tag].items() if k > since}, (tag, context)


@pytest.mark.integration
def test_a_save_that_fails_part_way_keeps_the_previous_checkpoint(tiny_data, tmp_path):
    """The disk fills while rank 1 writes its shards of the checkpoint at 4: every rank stops with one
    line naming the checkpoint; the one at 2 stays the newest and loads."""
    ckpt = tmp_path / "ckpt"
    proc = torchrun(2, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
                                  "--save-interval", "2", iters=4),
                    check=False, script=DRIVER, env={"FAULT": "enospc_in_save", "FAULT_AT": "4", "FAULT_RANK": "1"})
    assert proc.returncode == 1
    errors = re.findall(r"pretrain_llama\.py: error: .*", proc.stderr)
    assert len(errors) == 2 and not WORKER_TRACEBACK.search(proc.stderr), proc.stderr[-4000:]
    assert any("No space left on device" in e for e in errors)
    for e in errors:
        assert e.startswith(f"pretrain_llama.py: error: cannot save checkpoint {ckpt / 'iter_0000004'} (")
        assert "the newest complete checkpoint is still" in e
    assert tracker(ckpt) == 2 and sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt", "metrics.jsonl"]  # the partial one was removed
    launch(1, train_args(tiny_data, "--load", str(ckpt), "--skip-train", "--tensorboard-dir",
                         str(tmp_path / "tb"), iters=4))
    assert list(scalars(tmp_path / "tb", tags.LM_LOSS_VALIDATION)) == [2]


def _truncate(path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage, file, message", [
    (lambda d: _truncate(d / "data_text_document.bin", 0.5), "data_text_document.bin",
     r"has \d+ bytes but .*data_text_document.idx indexes \d+ \(truncated"),
    (lambda d: _truncate(d / "data_text_document.bin", 0.99999), "data_text_document.bin", r"has \d+ bytes but"),
    (lambda d: _truncate(d / "data_text_document.idx", 0.5), "data_text_document.idx", r"is corrupt"),
    (lambda d: (d / "data_text_document.idx").write_bytes(b"\x00" * 64), "data_text_document.idx",
     r"is corrupt \(bad header"),
    (lambda d: _truncate(d / "tok.model", 0.5), "tok.model", r"not a SentencePiece model"),
], ids=["bin-truncated", "bin-short-by-bytes", "idx-truncated", "idx-overwritten", "sentencepiece-truncated"])
def test_damaged_data_and_tokenizer_files_are_named(tiny_data, tmp_path, damage, file, message):
    d = tmp_path / "data"
    d.mkdir()
    for f in ("data_text_document.bin", "data_text_document.idx", "tok.model"):
        shutil.copy(f"{tiny_data.prefix.rsplit('/', 1)[0]}/{f}", d / f)
    damage(d)
    with pytest.raises(ArgumentError) as e:
        parse_config(train_args(tiny_data, "--data-path", str(d / "data_text_document"),
                                "--tokenizer-model", str(d / "tok.model")), world_size=1, cuda=False)
    text = str(e.value)
    assert "\n" not in text and str(d / file) in text and re.search(message, text), text


def test_truncated_tokenizer_json_is_named(hf_tokenizer_data, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(hf_tokenizer_data.tokenizer_dir, d)
    _truncate(d / "tokenizer.json", 0.5)
    with pytest.raises(ArgumentError) as e:
        parse_config(["--model-preset", "tiny", "--micro-batch-size", "1", "--global-batch-size", "1",
                      "--train-iters", "1", "--data-path", hf_tokenizer_data.prefix, "--split", "90,10,0",
                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d)],
                     world_size=1, cuda=False)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"--tokenizer-model {d}: not a Hugging Face tokenizer.json ("), text


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_nan_in_one_module_output_is_caught_and_named(tiny_data, tmp_path, policy):
    """A NaN written into layer 1's linear_fc1 output after its GEMM ran (a forward hook) at step 2
    (NVFP4): caught before the step under both policies; the health numbers say that fc1's GEMM gave
    finite values and the NaN entered layer 1's linear_fc2 input from outside the quantized GEMMs."""
    proc = torchrun(1, train_args(tiny_data, "--precision", "nvfp4", "--non-finite-grad-policy", policy,
                                  "--tensorboard-dir", str(tmp_path / "tb"), iters=3),
                    check=False, script="tests/drivers/inject_nonfinite.py",
                    env={"INJECT_AT": "2", "INJECT_OUTPUT": "decoder.layers.1.mlp.linear_fc1"})
    named = "quantized modules with non-finite values: decoder.layers.1.mlp.linear_fc2 (fprop.x"
    if policy == "fail":
        assert proc.returncode == 1
        (error,) = re.findall(r"pretrain_llama\.py: error: .*", proc.stderr)
        assert "non-finite loss and gradients at iteration 2" in error and named in error, error
        assert ("first: decoder.layers.1.mlp.linear_fc2 fprop.x, entered its input from outside the quantized "
                "GEMMs (no quantized GEMM made them: nothing to promote); --non-finite-grad-policy fail") in error
        assert "[train] iteration        2/" not in proc.stdout
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "non-finite loss and gradients at iteration 2" in proc.stdout and named in proc.stdout
        assert "--non-finite-grad-policy skip: update skipped (1 in a row, 1 in the run)" in proc.stdout
        assert scalars(tmp_path / "tb", tags.SKIPPED_ITERATIONS) == {1: 0, 2: 1, 3: 1}
        loss = scalars(tmp_path / "tb", tags.LM_LOSS)
        assert loss[3] == loss[3]  # finite again after the skipped step


# -- the run's folders -----------------------------------------------------------------------

def test_an_unusable_output_folder_is_refused_at_start_up_naming_the_flag_and_errno(tiny_data, tmp_path):
    """Checked on every rank before any model is built: --save, --tensorboard-dir and --wandb-save-dir (or the
    parent that would hold them) can take a new file that is then written, renamed and deleted (a path under a
    file fails for root too)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ArgumentError) as e:
        parse_config(train_args(tiny_data, "--save", str(blocker / "ckpt"), "--tensorboard-dir",
                                str(blocker / "tb"), "--wandb-project", "p", "--wandb-save-dir", str(blocker / "wb")),
                     world_size=1, cuda=False)
    assert e.value.problems == [f"{flag} {blocker / sub}: cannot create the folder: [Errno 20] Not a directory "
                                f"(ENOTDIR: {blocker} is a file); give a folder this job can write"
                                for flag, sub in (("--save", "ckpt"), ("--tensorboard-dir", "tb"),
                                                  ("--wandb-save-dir", "wb"))]
    ok = tmp_path / "ok" / "ckpt"
    parse_config(train_args(tiny_data, "--save", str(ok)), world_size=1, cuda=False)
    assert sorted(tmp_path.iterdir()) == [blocker]  # probed in the parent: nothing created, nothing left


@pytest.mark.integration
@pytest.mark.parametrize("fault, rank, save_interval, failure", [
    ("disk_full", "1", "5", r"cannot write {save}/metrics\.jsonl \(\[Errno 27\] File too large \(EFBIG\)\); every rank "
                       r"stopped; .*"),
    ("unwritable_save", "0", "4", r"cannot save checkpoint {save}/iter_0000004 \((PermissionError|FileExistsError|"
                             r"NotADirectoryError): \[Errno \d+\] .*\); the newest complete checkpoint is still .*"),
])
def test_a_save_folder_that_fails_mid_run_stops_every_rank_in_one_line(tiny_data, tmp_path, fault, rank,
                                                                       save_interval, failure):
    """After iteration 3 one rank can no longer write under --save: the logging rank's files cannot grow (a
    full disk), or the folder takes no new file from rank 0 (read-only, or for root a file in its place). Both
    ranks stop together at iteration 4 (the next agreement, or the save there) with one line (the same on every
    rank that prints), no traceback, no hang."""
    save = tmp_path / "ckpt"
    start = time.time()
    proc = torchrun(2, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--save", str(save),
                                  "--save-interval", save_interval, iters=8),
                    check=False, script=DRIVER, env={"FAULT": fault, "FAULT_AT": "3", "FAULT_RANK": rank,
                                                     "SAVE_DIR": str(save)})
    if save.is_dir():
        save.chmod(0o755)
    errors = re.findall(r"pretrain_llama\.py: error: .*", proc.stderr)
    assert proc.returncode == 1 and not WORKER_TRACEBACK.search(proc.stderr), proc.stderr[-4000:]
    assert len(set(errors)) == 1 and re.fullmatch("pretrain_llama.py: error: " + failure.format(save=re.escape(
        str(save))), errors[0]), errors
    assert "iteration        5/" not in proc.stdout  # stopped at 4
    assert time.time() - start < 120
