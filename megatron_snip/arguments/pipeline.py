"""The pipeline's stages: the layers of each (even, or uneven with Megatron-LM's
``--decoder-first/last-pipeline-num-layers``) and the interleaved schedule's virtual stages, checked as
Megatron-LM and megatron-core check them, before any process group."""

from __future__ import annotations

import argparse

from .errors import require


def validate_pipeline(args: argparse.Namespace) -> None:
    """The layers of each pipeline stage and the interleaved schedule, as Megatron-LM and megatron-core check them:
    set ``virtual_pipeline_model_parallel_size`` (None: no interleaving) from either of its flags (the
    configuration keeps that one). The p2p overlap and the param-gather alignment apply to the interleaved
    schedule only (model/llama.py, training/setup.py)."""
    layers, vpp = args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size
    pp, uneven = args.pipeline_model_parallel_size, (args.decoder_first_pipeline_num_layers is not None
                                                     or args.decoder_last_pipeline_num_layers is not None)
    require(layers is None or vpp is None, "give --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank, not both")
    require(layers is None or not uneven, "with uneven stages (--decoder-first/last-pipeline-num-layers) give the "
            "interleaved schedule as --num-virtual-stages-per-pipeline-rank (as Megatron-LM requires)")
    if layers is not None:
        require(layers >= 1 and args.num_layers % (pp * layers) == 0,
                f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                f"--num-layers-per-virtual-pipeline-stage {layers}")
        vpp = args.num_layers // (pp * layers)
    require(vpp is None or vpp >= 1, "--num-virtual-stages-per-pipeline-rank must be >= 1")
    vpp = vpp if vpp is not None and vpp > 1 else None
    if uneven:
        _validate_uneven_stages(args, vpp or 1)
    else:
        require(args.num_layers % pp == 0,
                f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                f"choose a PP size that divides the layer count")
        require(vpp is None or args.num_layers % (pp * vpp) == 0,
                f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                f"--num-virtual-stages-per-pipeline-rank {vpp}")
    if vpp is not None:
        require(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
        require(args.num_microbatches % pp == 0,
                f"the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size {pp}, "
                f"but there are {args.num_microbatches} per step; make --global-batch-size / (--micro-batch-size x "
                f"data-parallel size) a multiple of {pp}")
        require(args.overlap_p2p_comm or pp > 2,
                f"--no-overlap-p2p-communication batches the interleaved schedule's messages, which needs "
                f"--pipeline-model-parallel-size > 2 (at {pp} the previous and next stage are one peer; as in "
                f"Megatron-LM); drop the flag")
    args.virtual_pipeline_model_parallel_size = vpp
    args.num_layers_per_virtual_pipeline_stage = None


def _validate_uneven_stages(args: argparse.Namespace, vpp: int) -> None:
    """--decoder-first/last-pipeline-num-layers: megatron-core's rules (the middle stages share the rest evenly,
    every stage's layers split into ``vpp`` chunks), and the layout megatron-core states but cannot build."""
    pp, first, last = (args.pipeline_model_parallel_size, args.decoder_first_pipeline_num_layers,
                       args.decoder_last_pipeline_num_layers)
    require(pp > 1, "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers need "
            "--pipeline-model-parallel-size > 1")
    given = {f"--decoder-{which}-pipeline-num-layers": n for which, n in (("first", first), ("last", last))
             if n is not None}
    for flag, n in given.items():
        require(n >= 1, f"{flag} {n} must be >= 1")
        require(n % vpp == 0, f"{flag} {n} is not divisible by --num-virtual-stages-per-pipeline-rank {vpp} (each "
                f"virtual stage holds whole layers)")
    rest, middle = args.num_layers - sum(given.values()), pp - len(given)
    shown = " + ".join(f"{flag} {n}" for flag, n in given.items())
    require(rest >= 0 and bool(rest) == bool(middle),
            f"--num-layers {args.num_layers} leaves {rest} layers after {shown} for {middle} other pipeline stages; "
            f"every stage needs layers (and every layer a stage)")
    require(middle == 0 or rest % (middle * vpp) == 0,
            f"the {rest} layers left after {shown} do not split evenly into {middle} other pipeline stages"
            + (f" x --num-virtual-stages-per-pipeline-rank {vpp}" if vpp > 1 else ""))
    # megatron-core 0.16.1's layer offset of an interleaved stage divides by the number of middle stages, even
    # where there are none (ZeroDivisionError building the model); one flag gives the same layout.
    if vpp > 1 and middle == 0 and len(given) == 2:
        require(False, f"--decoder-first-pipeline-num-layers with --decoder-last-pipeline-num-layers at "
                f"--pipeline-model-parallel-size {pp} and --num-virtual-stages-per-pipeline-rank {vpp} fails in "
                f"megatron-core (its layer offset divides by the number of middle stages, here none); give only "
                f"--decoder-first-pipeline-num-layers {first}: the last stage then holds the other "
                f"{args.num_layers - first}")
