"""The pipeline layout (precision/pipeline_layout.py): which stage and model chunk holds each layer, even and
uneven (--decoder-first/last-pipeline-num-layers), with and without virtual stages, hand-checked and against
megatron-core's own offsets on the TransformerConfig a run builds."""

from __future__ import annotations

import pytest
from conftest import run_config

from megatron_snip.precision.pipeline_layout import PipelineLayout

R = range

# flags (beyond the tiny model's) -> (stage, virtual stage, layers) of every chunk in the schedule's order,
# worked out by hand from Megatron-LM's description: the first / last stage holds the given layers, the middle
# stages share the rest evenly, each stage's layers split into its virtual stages, chunks dealt round-robin.
PLACEMENTS = {
    "even": (("--pipeline-model-parallel-size", "2"), [(0, 0, R(0, 2)), (1, 0, R(2, 4))]),
    "even_vpp2": (("--num-layers", "8", "--pipeline-model-parallel-size", "2",
                   "--num-virtual-stages-per-pipeline-rank", "2"),
                  [(0, 0, R(0, 2)), (1, 0, R(2, 4)), (0, 1, R(4, 6)), (1, 1, R(6, 8))]),
    "first_only": (("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"),
                   [(0, 0, R(0, 1)), (1, 0, R(1, 4))]),
    "last_only": (("--num-layers", "10", "--pipeline-model-parallel-size", "3",
                   "--decoder-last-pipeline-num-layers", "2"),
                  [(0, 0, R(0, 4)), (1, 0, R(4, 8)), (2, 0, R(8, 10))]),
    "both": (("--num-layers", "10", "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1",
              "--decoder-last-pipeline-num-layers", "3"),
             [(0, 0, R(0, 1)), (1, 0, R(1, 4)), (2, 0, R(4, 7)), (3, 0, R(7, 10))]),
    "first_only_vpp2": (("--num-layers", "10", "--pipeline-model-parallel-size", "2",
                         "--num-virtual-stages-per-pipeline-rank", "2", "--decoder-first-pipeline-num-layers", "2"),
                        [(0, 0, R(0, 1)), (1, 0, R(1, 5)), (0, 1, R(5, 6)), (1, 1, R(6, 10))]),
    "last_only_vpp2": (("--num-layers", "10", "--pipeline-model-parallel-size", "3",
                        "--num-virtual-stages-per-pipeline-rank", "2", "--decoder-last-pipeline-num-layers", "2"),
                       [(0, 0, R(0, 2)), (1, 0, R(2, 4)), (2, 0, R(4, 5)),
                        (0, 1, R(5, 7)), (1, 1, R(7, 9)), (2, 1, R(9, 10))]),
    "both_vpp2": (("--num-layers", "10", "--pipeline-model-parallel-size", "3",
                   "--num-virtual-stages-per-pipeline-rank", "2", "--decoder-first-pipeline-num-layers", "2",
                   "--decoder-last-pipeline-num-layers", "4"),
                  [(0, 0, R(0, 1)), (1, 0, R(1, 3)), (2, 0, R(3, 5)),
                   (0, 1, R(5, 6)), (1, 1, R(6, 8)), (2, 1, R(8, 10))]),
}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_chunks_are_megatron_cores_placement(name):
    """The run's layout (ParallelConfig.pipeline_layout) places every chunk where the hand-worked placement says,
    and where megatron-core's get_transformer_layer_offset / get_num_layers_to_build put it on the
    TransformerConfig the run builds (the numbering of TransformerLayer.layer_number)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_snip.model.llama import transformer_config

    flags, placement = PLACEMENTS[name]
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    run = run_config(*flags, "--micro-batch-size", "1", "--global-batch-size", str(pp), world_size=pp)
    layout = run.parallel.pipeline_layout(run.model.num_layers)
    assert [(c.stage, c.virtual_stage, c.layers) for c in layout.chunks()] == placement
    config = transformer_config(run.model, run.parallel)
    interleaved = config.virtual_pipeline_model_parallel_size is not None
    for c in layout.chunks():
        vp = c.virtual_stage if interleaved else None
        assert c.layers.start == get_transformer_layer_offset(config, vp, c.stage), c
        assert len(c.layers) == get_num_layers_to_build(config, vp, c.stage), c
    # Each layer's stage and each stage's layers, from the same chunks.
    assert [layout.stage_of(i) for i in range(layout.num_layers)] == [
        s for s, _, layers in sorted(placement, key=lambda p: p[2].start) for _ in layers]
    assert layout.layers_per_stage() == [sum(len(r) for s, _, r in placement if s == stage) for stage in range(pp)]
    assert PipelineLayout.from_dict(layout.to_dict()) == layout


def test_local_paths_number_layers_within_their_chunk():
    layout = PipelineLayout(10, 2, 2, first_stage_layers=2)
    assert layout.chunk(1, 1).local_path("decoder.layers.7.mlp.linear_fc2") == "decoder.layers.1.mlp.linear_fc2"
    assert layout.chunk(0, 1).local_path("decoder.layers.5.self_attention.linear_qkv") == \
        "decoder.layers.0.self_attention.linear_qkv"
    with pytest.raises(ValueError, match=r"no chunk \(2, 0\)"):
        layout.chunk(2, 0)


@pytest.mark.parametrize("args,message", [
    ((6, 4), "megatron-core cannot place the layers of a 6-layer model at pipeline size 4"),
    ((4, 1, 2), "a 4-layer model at pipeline size 1 x virtual 2: needs layers, PP >= 1, VPP >= 1 (VPP > 1 and uneven "
                "stages only at PP > 1)"),
    ((4, 3, 1, 1), "megatron-core refuses a 4-layer model at pipeline size 3 (stages of 1 + 1 + 1 layers)"),
    ((4, 2, 1, 1, 1), "megatron-core refuses"),  # 2 layers left for no middle stage
    # megatron-core 0.16.1 divides by the (absent) middle stages (arguments/pipeline.py refuses the flags)
    ((4, 2, 2, 2, 2), "megatron-core cannot place the layers of a 4-layer model at pipeline size 2 x virtual 2 "
                      "(stages of 2 + 2 layers) (ZeroDivisionError"),
])
def test_layouts_megatron_core_cannot_place_are_refused(args, message):
    with pytest.raises(ValueError) as e:
        PipelineLayout(*args)
    assert str(e.value).startswith(message), str(e.value)
