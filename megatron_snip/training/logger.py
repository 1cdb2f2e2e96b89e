"""Console and TensorBoard logging, from the one rank that holds the loss.

That rank is the last pipeline stage's TP rank 0 / DP rank 0: it sees the
DP-averaged loss, so each scalar is written exactly once.
"""

from __future__ import annotations

import logging
import sys

import torch
from megatron.core import parallel_state

from megatron_snip.compat.device import has_cuda

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
            and parallel_state.get_data_parallel_rank() == 0)


def setup_console() -> None:
    """Python logging to stdout, prefixed with the rank: INFO on rank 0, WARNING elsewhere."""
    import os

    # Set up before the process group exists: torchrun/srun put the rank in the environment.
    rank = int(os.environ.get("RANK", "0"))
    # Rank 0 tells the story; the others speak only of problems.
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=True)
    for noisy in ("megatron", "megatron.core"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class MetricsLogger:
    """Prints a line per log interval and writes TensorBoard scalars (on the logging rank only)."""

    def __init__(self, tensorboard_dir: str | None):
        self.active = is_logging_rank()
        self.writer = None
        if self.active and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)

    def log(self, iteration: int, metrics: dict[str, float], prefix: str = "train") -> None:
        if not self.active:
            return
        parts = [f"iteration {iteration:7d}"] + [f"{k} {_fmt(v)}" for k, v in metrics.items()]
        print(f"[{prefix}] " + " | ".join(parts), flush=True)
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"{prefix}/{key}", value, iteration)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """TensorBoard only (e.g. per-layer panels too wide for the console)."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def image(self, tag: str, image, step: int) -> None:
        """An ``[H, W, 3]`` uint8 image on TensorBoard's image panel."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step, dataformats="HWC")

    def panel(self, tag: str, markdown: str, step: int) -> None:
        """Text on TensorBoard's text panel (markdown)."""
        if self.writer is not None:
            self.writer.add_text(tag, markdown, step)

    def text(self, message: str) -> None:
        if self.active:
            print(message, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e12):
        return str(int(v))
    return f"{v:.4g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}"
