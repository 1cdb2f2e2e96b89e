"""Cost of one SNIP cycle, in training iterations.

    python bench/snip_cycle.py                     # tiny Llama, TP=2 PP=2, 4 local processes (CPU here)
    python bench/snip_cycle.py --nproc 8 --tp 2 --pp 2 --preset tinyllama-1.1b --bf16   # a GPU node
    python bench/snip_cycle.py --curvature hutchinson  # the paper's Hutchinson curvature: K more passes

Runs pretrain_llama.py with ``--snip`` re-planning once, then reads TensorBoard:
the cycle's wall time (probe passes, statistics, gather, solve, broadcast) over
the median seconds per training iteration before the cycle (the warm-up plan,
bf16) and after it (the new plan), and its share of the wall time at one cycle per 1000 iterations.
Goals: a cycle costs <= ~10 iterations; on a GPU, <= 1% of 1000 iterations. Each process runs
``--threads`` torch threads (default: the cores shared evenly by ``--nproc``, bench/conditions.py).
Options this script does not know pass through to pretrain_llama.py.

``--process-time`` (one process, a CPU): the same ratio in process CPU time, which other jobs on the
machine do not inflate: after ``--interval`` warm-up iterations, the median of 2 x ``--interval`` training
steps and of three probe cycles on the next batch, in the same process, and the peak RSS after training and
after the cycles::

    python bench/snip_cycle.py --process-time --nproc 1 --tp 1 --pp 1 --micro-batch-size 8   # the quickstart's
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = "--process-time-worker"


def main() -> None:
    if sys.argv[1:2] == [WORKER]:  # one of --process-time's runs, under torchrun: pretrain_llama.py's flags follow
        return process_time_worker(int(sys.argv[2]), sys.argv[3:])
    import conditions
    from step_time import add_layout_args, build_data, shape_args
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_snip.snip.config import CURVATURES, SnipConfig
    from megatron_snip.training import tags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layout_args(p)
    p.add_argument("--interval", type=int, default=10, help="iterations before (and after) the cycle")
    p.add_argument("--probe-passes", type=int, default=SnipConfig.snip_probe_passes,
                   help="--snip-probe-passes (default: the program's, %(default)s)")
    p.add_argument("--curvature", choices=CURVATURES, default=SnipConfig.snip_curvature,
                   help="--snip-curvature (default: the program's, %(default)s; hutchinson adds K forward+backward "
                        "passes)")
    p.add_argument("--process-time", action="store_true",
                   help="one process: the cycle and an iteration in process CPU time (robust to a loaded machine)")
    opts, rest = p.parse_known_args()  # the rest passes through to pretrain_llama.py

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prefix, tok = build_data(work, opts.data_dir)
        run_args = ["--model-preset", opts.preset, *shape_args(opts),
                    "--tensor-model-parallel-size", str(opts.tp), "--pipeline-model-parallel-size", str(opts.pp),
                    "--micro-batch-size", str(opts.micro_batch_size), "--global-batch-size",
                    str(opts.global_batch_size), "--lr", "1e-3", "--lr-decay-style", "constant",
                    "--data-path", prefix, "--tokenizer-model", tok, "--split", "99,1,0", "--eval-iters", "0",
                    "--snip-probe-passes", str(opts.probe_passes), "--snip-curvature", opts.curvature,
                    *(["--bf16"] if opts.bf16 else []), *rest]
        env = conditions.worker_env(opts.nproc, opts.threads)
        if opts.process_time:
            return report_process_time(opts, run_args, env)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(opts.nproc),
               str(ROOT / "pretrain_llama.py"), *run_args, "--train-iters", str(2 * opts.interval),
               "--log-interval", "1", "--log-timers-to-tensorboard", "--snip", "--snip-interval", str(opts.interval),
               "--tensorboard-dir", str(work / "tb")]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        acc = EventAccumulator(str(next((work / "tb").glob("**/events.out.tfevents.*"))), size_guidance={"scalars": 0})
        acc.Reload()
        per_iter = {e.step: e.value for e in acc.Scalars(tags.ITERATION_TIME)}
        cycle = acc.Scalars(tags.snip("cycle seconds"))[0].value
    # Skip the first iterations (warm-up) and the one right after the cycle (new loader workers).
    before = statistics.median(v for k, v in per_iter.items() if 3 <= k <= opts.interval)
    after = statistics.median(v for k, v in per_iter.items() if k > opts.interval + 1)
    print(f"layout TP={opts.tp} PP={opts.pp} DP={opts.nproc // (opts.tp * opts.pp)}, preset {opts.preset}, global "
          f"batch {opts.global_batch_size}, {opts.curvature} curvature: "
          f"{opts.probe_passes if opts.curvature == 'hutchinson' else 0} Hutchinson + {opts.probe_passes} "
          "perturbation passes")
    print("(the cycle's cost in iterations is also in its own log line: snip/cycle iterations)")
    print(f"SNIP cycle                     : {cycle:8.2f} s")
    print(f"iteration before (warm-up plan): {before:8.3f} s   cycle / iteration = {cycle / before:6.1f}")
    print(f"iteration after (new plan)     : {after:8.3f} s   cycle / iteration = {cycle / after:6.1f}")
    # The yardstick: one cycle per 1000 iterations of the new plan should cost <= 1%.
    print(f"one cycle per 1000 iterations  : {100 * cycle / (cycle + 1000 * after):6.2f} % of the wall time")


def report_process_time(opts, run_args: list[str], env: dict) -> None:
    """``--process-time``: one one-process run (``--interval`` warm-up iterations, 2 x ``--interval`` timed ones,
    then three cycles), the median of each in process CPU time, their ratio."""
    if opts.nproc != 1:
        raise SystemExit("snip_cycle.py: --process-time measures one process: give --nproc 1 --tp 1 --pp 1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", __file__, WORKER,
           str(2 * opts.interval), *run_args, "--snip", "--snip-interval", str(10 * opts.interval),
           "--train-iters", str(opts.interval), "--log-interval", str(opts.interval)]
    out = subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    iteration, cycle = statistics.median(result["steps_cpu"]), statistics.median(result["cycles_cpu"])
    print(f"one process, preset {opts.preset}, global batch {opts.global_batch_size}, {opts.curvature} curvature, "
          f"{opts.probe_passes} perturbation draws (process CPU time, medians)")
    print(f"training iteration : {iteration:8.3f} s   (of {len(result['steps_cpu'])} after {opts.interval} "
          "warm-up iterations)")
    print(f"SNIP cycle         : {cycle:8.2f} s   cycle / iteration = {cycle / iteration:6.1f}   (of "
          f"{len(result['cycles_cpu'])}: {', '.join(f'{c:.2f}' for c in result['cycles_cpu'])} s)")
    print(f"peak RSS           : {result['rss_train_mib']:.0f} MiB after training, {result['rss_cycle_mib']:.0f} MiB "
          "after the cycles")


def process_time_worker(timed: int, args: list[str]) -> None:
    """The ``--process-time`` run (under torchrun): train ``--train-iters`` (warm-up), then ``timed`` training steps
    and three probe cycles on the batch after them, each in process CPU time; one JSON line."""
    import resource
    import time
    from itertools import islice

    from megatron_snip.cli.pretrain import trainer_from_command_line
    from megatron_snip.compat.cpu import silence_expected_warnings
    from megatron_snip.snip.probes import ProbeConfig, run_probe_cycle

    silence_expected_warnings()
    trainer = trainer_from_command_line(args)
    c = trainer.config
    trainer.train()
    data = trainer.batches("train", trainer.state.consumed_samples)
    steps = []
    for _ in range(timed):
        start = time.process_time()
        trainer.train_step(data)
        steps.append(time.process_time() - start)
    rss_train = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n = c.training.num_microbatches
    batch = list(islice(data, n))
    cycles = []
    for _ in range(3):
        start = time.process_time()
        run_probe_cycle(trainer.model, trainer.optimizer, trainer.precision, iter(batch), num_microbatches=n,
                        seq_length=c.model.seq_length, micro_batch_size=c.training.micro_batch_size,
                        config=ProbeConfig.from_snip(c.snip, c.training.seed))
        cycles.append(time.process_time() - start)
    print(json.dumps({"steps_cpu": steps, "cycles_cpu": cycles, "rss_train_mib": rss_train,
                      "rss_cycle_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


if __name__ == "__main__":
    main()
