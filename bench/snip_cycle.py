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
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
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
    opts, rest = p.parse_known_args()  # the rest passes through to pretrain_llama.py

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prefix, tok = build_data(work, opts.data_dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(opts.nproc),
               str(ROOT / "pretrain_llama.py"), "--model-preset", opts.preset, *shape_args(opts),
               "--tensor-model-parallel-size", str(opts.tp), "--pipeline-model-parallel-size", str(opts.pp),
               "--micro-batch-size", str(opts.micro_batch_size), "--global-batch-size", str(opts.global_batch_size),
               "--train-iters", str(2 * opts.interval), "--lr", "1e-3", "--lr-decay-style", "constant",
               "--data-path", prefix, "--tokenizer-model", tok, "--split", "99,1,0", "--eval-iters", "0",
               "--log-interval", "1", "--log-timers-to-tensorboard", "--snip", "--snip-interval", str(opts.interval),
               "--snip-probe-passes", str(opts.probe_passes), "--snip-curvature", opts.curvature,
               "--tensorboard-dir", str(work / "tb"),
               *(["--bf16"] if opts.bf16 else []), *rest]
        subprocess.run(cmd, check=True, cwd=ROOT, env=conditions.worker_env(opts.nproc, opts.threads),
                       stdout=subprocess.DEVNULL)
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


if __name__ == "__main__":
    main()
