"""Console, TensorBoard and W&B logging, from the one rank that holds the loss.

That rank is the last pipeline stage's TP rank 0 / DP rank 0: it sees the
DP-averaged loss, so each scalar is written exactly once.
"""

from __future__ import annotations

import errno
import logging
import os
import sys

import torch
from megatron.core import parallel_state

from megatron_snip.compat.device import has_cuda
from megatron_snip.training import tags
from megatron_snip.training.config import LoggingConfig
from megatron_snip.training.metrics_record import MetricsRecord

# Dense BF16 peak TFLOP/s per GPU, for MFU. Matched against the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
               "L40S": 362.0, "B200": 2250.0, "GB200": 2500.0}


def peak_tflops(override: float | None) -> float | None:
    """Peak dense TFLOP/s of this GPU (None on CPU or an unknown GPU without ``--peak-tflops``)."""
    if override is not None:
        return override
    if not has_cuda():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def is_logging_rank() -> bool:
    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)


def setup_console() -> None:
    """Python logging to stdout, prefixed with the rank: INFO on rank 0, WARNING elsewhere."""
    # Set up before the process group exists: torchrun/srun put the rank in the environment.
    rank = int(os.environ.get("RANK", "0"))
    # Rank 0 tells the story; the others speak only of problems.
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=True)
    for noisy in ("megatron", "megatron.core"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RunFilesError(RuntimeError):
    """A run file (the metrics record, SNIP's statistics, the exit record) could not be written: every rank
    stops together (``own``: this rank's failure, whose message it prints; the others stop silently)."""

    def __init__(self, message: str, own: bool):
        super().__init__(message)
        self.own = own


def os_error(e: OSError) -> str:
    """``[Errno 30] Read-only file system (EROFS)``: what an OSError says, with its errno's name."""
    name = errno.errorcode.get(e.errno, "?") if e.errno is not None else "?"
    return f"[Errno {e.errno}] {e.strerror} ({name})"


class MetricsLogger:
    """The logging rank's sinks: the console, TensorBoard (``--tensorboard-dir``) and W&B
    (``--wandb-project``), as Megatron-LM writes them (tag names: ``training/tags.py``), and the run's
    own record of its scalars (``SAVE/metrics.jsonl`` with ``--save``: training/metrics_record.py).
    Every method does nothing on the other ranks."""

    def __init__(self, config: LoggingConfig, save_dir: str | None = None, run_config: dict | None = None):
        """``save_dir``: --save (W&B's default directory); ``run_config``: the resolved flags, W&B's config."""
        self.active = is_logging_rank()
        self.writer = None
        self.wandb = None
        self.record = None
        self.failure: str | None = None  # the first run file this rank could not write (run_file_failed)
        if not self.active:
            return
        if save_dir:
            self.record = MetricsRecord(save_dir)
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=config.tensorboard_queue_size)
        if config.wandb_project:
            self.wandb = open_wandb(config, save_dir, run_config or {})

    def scalars(self, values: dict[str, float], step: int, samples: int | None = None) -> None:
        """Each scalar at iteration ``step`` on TensorBoard and W&B; with ``samples`` (consumed samples)
        also Megatron-LM's ``<tag> vs samples`` twin on TensorBoard."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
                if samples is not None:
                    self.writer.add_scalar(tags.vs_samples(tag), value, samples)
        if self.wandb is not None and values:
            self.wandb.log(dict(values), step=step)
        if self.record is not None and values:
            try:
                self.record.write(step, values)
            except OSError as e:  # a full disk or a revoked mount: every rank stops at the next iteration
                record, self.record = self.record, None
                record.abandon()
                self.run_file_failed(record.path, e)

    def run_file_failed(self, path: str, e: OSError) -> None:
        """Note that ``path`` could not be written (the first failure is kept): the loop stops every rank."""
        if self.failure is None:
            self.failure = (f"cannot write {path} ({os_error(e)}); every rank stopped; the newest complete checkpoint "
                            f"stays the one its tracker names: free space or make the folder writable, then resume")

    def wandb_scalars(self, values: dict[str, float], step: int) -> None:
        """W&B only (Megatron-LM's ``samples vs steps``)."""
        if self.wandb is not None:
            self.wandb.log(dict(values), step=step)

    def image(self, tag: str, image, step: int) -> None:
        """An ``[H, W, 3]`` uint8 image on TensorBoard's image panel."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step, dataformats="HWC")

    def panel(self, tag: str, markdown: str, step: int) -> None:
        """Text on TensorBoard's text panel (markdown)."""
        if self.writer is not None:
            self.writer.add_text(tag, markdown, step)

    def text(self, message: str | None) -> None:
        """A console line (None: nothing, for a helper that had nothing to say)."""
        if self.active and message is not None:
            print(message, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.record is not None:
            self.record.close()


def open_wandb(config: LoggingConfig, save_dir: str | None, run_config: dict):
    """A W&B run as Megatron-LM starts it: named --wandb-exp-name in --wandb-project (--wandb-entity),
    its files under --wandb-save-dir (default SAVE/wandb), the run's flags as its config."""
    try:
        import wandb
    except ImportError:
        raise SystemExit("--wandb-project needs the wandb package: pip install wandb (or drop --wandb-project)"
                         ) from None
    directory = config.wandb_save_dir or os.path.join(save_dir, "wandb")
    os.makedirs(directory, exist_ok=True)
    kwargs = {"dir": directory, "name": config.wandb_exp_name, "project": config.wandb_project, "config": run_config}
    if config.wandb_entity:
        kwargs["entity"] = config.wandb_entity
    return wandb.init(**kwargs)


def progress_line(prefix: str, fields: list[tuple[str, str]]) -> str:
    """``[prefix]`` and Megatron-LM's ``name: value |`` for each field (values already formatted; a field
    without a name shows its value alone)."""
    return f"[{prefix}] " + " ".join(f"{name}: {value} |" if name else f"{value} |" for name, value in fields)


def metric_line(prefix: str, iteration: int, metrics: dict[str, float]) -> str:
    """``[prefix] iteration N | name value | ...`` with numbers in a compact format (SNIP's cycle line)."""
    return f"[{prefix}] " + " | ".join([f"iteration {iteration:7d}"] + [f"{k} {_fmt(v)}" for k, v in metrics.items()])


def hms(seconds: float) -> str:
    """``seconds`` as hh:mm:ss (hours beyond 24 kept: 30:00:00)."""
    s = int(round(seconds))
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e12):
        return str(int(v))
    return f"{v:.4g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}"
