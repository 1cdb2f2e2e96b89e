"""Precision inside megatron-core's model: the quantized linear layers of the local spec
(``layers``), the Transformer Engine adapter (``te_layers``), the controller that walks the model's
``TransformerLayer``s and applies a plan once per module (``controller``), and plans as megatron-core's
per-module precision configs (``megatron_config``)."""
