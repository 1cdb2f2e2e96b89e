"""Where each transformer layer runs: the pipeline layout's model chunks, as megatron-core places them.

A layout is the layer count, the pipeline size (PP), the model chunks per pipeline rank (virtual stages,
VPP) and Megatron-LM's uneven stages (``--decoder-first/last-pipeline-num-layers``: the first / last stage
holds that many layers, the middle stages share the rest evenly, each stage's layers divide into its VPP
chunks). The chunks come from megatron-core's own ``get_transformer_layer_offset`` (the global index of a
chunk's first layer) and ``get_num_layers_to_build`` (its layer count), the functions its
``TransformerBlock`` numbers ``TransformerLayer.layer_number`` with, so the mapping is the model's.

Every global <-> stage-local mapping of this program goes through :class:`PipelineLayout`: SNIP's
per-stage budgets (a module's stage), the per-chunk precision configs (``decoder.layers.N`` is the layer's
index within its chunk), the start-up line of each stage's layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_snip.precision.plan import module_name, parse_module_name


@dataclass(frozen=True)
class ModelChunk:
    """One model chunk of a pipeline layout: which rank runs it and which global layers it holds."""

    stage: int  # pipeline rank, 0-based
    virtual_stage: int  # chunk index on that rank (0 without virtual stages)
    layers: range  # global 0-based layer indices, in order: local index = position

    def local_path(self, name: str) -> str:
        """The path megatron-core gives global module ``name`` inside this chunk (``decoder.layers.{local}...``)."""
        layer, module = parse_module_name(name)
        return module_name(self.layers.index(layer), module)


@dataclass(frozen=True)
class PipelineLayout:
    """The pipeline layout of a ``num_layers``-layer model (ValueError, naming it, where megatron-core
    cannot place its layers)."""

    num_layers: int
    pipeline_stages: int = 1  # PP
    virtual_stages: int = 1  # model chunks per pipeline rank (1: no interleaving)
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers (None: even)
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers (None: even)

    def __post_init__(self):
        self.chunks()  # refuse a layout megatron-core cannot place here, not at first use

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    @property
    def chunk_count(self) -> int:
        return self.pipeline_stages * self.virtual_stages

    def chunks(self) -> list[ModelChunk]:
        """Every model chunk in the interleaved schedule's order (virtual stage 0 of ranks 0..PP-1, then
        virtual stage 1, ...), which is also the order of their layers."""
        return _chunks(self)

    def chunk(self, stage: int, virtual_stage: int = 0) -> ModelChunk:
        """The chunk of pipeline rank ``stage``, virtual stage ``virtual_stage`` (ValueError if none)."""
        if not (0 <= stage < self.pipeline_stages and 0 <= virtual_stage < self.virtual_stages):
            raise ValueError(f"no chunk ({stage}, {virtual_stage}) (pipeline stage, virtual stage) in {self}")
        return self.chunks()[virtual_stage * self.pipeline_stages + stage]

    def stage_of(self, layer: int) -> int:
        """The pipeline rank (physical stage) that runs global layer ``layer`` (0-based)."""
        return next(c.stage for c in self.chunks() if layer in c.layers)

    def layers_per_stage(self) -> list[int]:
        """The layers each pipeline rank holds (all its chunks together)."""
        return [sum(len(c.layers) for c in self.chunks() if c.stage == s) for s in range(self.pipeline_stages)]

    def to_dict(self) -> dict:
        """The layout as files record it (Megatron-LM's names)."""
        return {"num_layers": self.num_layers, "pipeline_model_parallel_size": self.pipeline_stages,
                "virtual_pipeline_model_parallel_size": self.virtual_stages,
                "decoder_first_pipeline_num_layers": self.first_stage_layers,
                "decoder_last_pipeline_num_layers": self.last_stage_layers}

    @classmethod
    def from_dict(cls, d) -> PipelineLayout:
        """The inverse of :meth:`to_dict` (a file that predates uneven stages: even)."""
        return cls(d["num_layers"], d["pipeline_model_parallel_size"], d["virtual_pipeline_model_parallel_size"],
                   d.get("decoder_first_pipeline_num_layers"), d.get("decoder_last_pipeline_num_layers"))

    def __str__(self) -> str:
        """e.g. "a 4-layer model at pipeline size 2 (stages of 1 + 3 layers)"."""
        text = f"a {self.num_layers}-layer model at pipeline size {self.pipeline_stages}"
        if self.virtual_stages > 1:
            text += f" x virtual {self.virtual_stages}"
        if self.uneven:
            text += f" (stages of {' + '.join(map(str, _stage_sizes(self)))} layers)"
        return text


def _stage_sizes(layout: PipelineLayout) -> list[int]:
    """Each stage's layers as the flags give them (for messages; valid or not)."""
    given = [n for n in (layout.first_stage_layers, layout.last_stage_layers) if n is not None]
    middle = layout.pipeline_stages - len(given)
    rest = layout.num_layers - sum(given)
    sizes = [rest // middle if middle > 0 else 0] * layout.pipeline_stages
    if layout.first_stage_layers is not None:
        sizes[0] = layout.first_stage_layers
    if layout.last_stage_layers is not None:
        sizes[-1] = layout.last_stage_layers
    return sizes


@functools.cache
def _chunks(layout: PipelineLayout) -> list[ModelChunk]:
    pp, vpp = layout.pipeline_stages, layout.virtual_stages
    if pp < 1 or vpp < 1 or layout.num_layers < 1 or (vpp > 1 and pp < 2) or (layout.uneven and pp < 2):
        raise ValueError(f"{layout}: needs layers, PP >= 1, VPP >= 1 (VPP > 1 and uneven stages only at PP > 1)")
    if pp == 1:  # megatron-core's offset is 0 and one chunk holds every layer
        return [ModelChunk(0, 0, range(layout.num_layers))]
    config = _core_config(layout)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    chunks = []
    for v in range(vpp):
        for stage in range(pp):
            vp_stage = v if vpp > 1 else None
            try:
                start = get_transformer_layer_offset(config, vp_stage, stage)
                count = get_num_layers_to_build(config, vp_stage, stage)
            except (AssertionError, ZeroDivisionError) as e:
                raise ValueError(f"megatron-core cannot place the layers of {layout} ({type(e).__name__}: {e})") \
                    from None
            chunks.append(ModelChunk(stage, v, range(start, start + count)))
    # Every chunk holds layers and the chunks, in schedule order, hold every layer once: 0, 1, ..., L-1.
    if any(not c.layers for c in chunks) or [i for c in chunks for i in c.layers] != list(range(layout.num_layers)):
        raise ValueError(f"{layout} does not split into {pp} pipeline stages x {vpp} virtual stages of whole layers, "
                         f"each holding some")
    return chunks


def _core_config(layout: PipelineLayout):
    """A megatron-core TransformerConfig with this layout (and a placeholder shape: the offsets read only
    the layout); its own checks of uneven stages raise ValueError."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        return TransformerConfig(
            num_layers=layout.num_layers, hidden_size=1, num_attention_heads=1,
            pipeline_model_parallel_size=layout.pipeline_stages, pipeline_dtype=torch.float32,
            virtual_pipeline_model_parallel_size=layout.virtual_stages if layout.virtual_stages > 1 else None,
            num_layers_in_first_pipeline_stage=layout.first_stage_layers,
            num_layers_in_last_pipeline_stage=layout.last_stage_layers, cuda_graph_scope=[])
    except ValueError as e:
        raise ValueError(f"megatron-core refuses {layout}: {e}") from None
