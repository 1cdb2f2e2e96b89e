"""The precision machinery inside megatron-core's model: the quantized linear layers of the local spec
(``layers``), the Transformer Engine adapter (``te_layers``), and the controller that walks the model's
``TransformerLayer``s and applies a plan once per module (``controller``). The plans they apply, and
their file formats, are ``megatron_snip.precision``; the run's start-up plan is
``megatron_snip.training.precision_setup``."""
