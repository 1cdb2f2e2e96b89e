#!/usr/bin/env python3
"""Run stock Megatron-LM's ``pretrain_gpt.py`` on a machine without a GPU (its flags unchanged).

    MEGATRON_LM=/path/to/Megatron-LM torchrun --nproc-per-node 4 tools/megatron_lm_on_cpu.py PRETRAIN_GPT_FLAGS...

For checking checkpoints both ways with Megatron-LM itself (tools/megatron_lm_round_trip.sh); on a GPU run
Megatron-LM directly. Megatron-LM's own code runs unmodified; around it:

- megatron-snip's CUDA shim (``megatron_snip.compat.cpu``), and ``torch.cuda.is_available`` / the device's
  properties answered as a GPU would (Megatron-LM asserts CUDA at start-up and asks the architecture);
- megatron-core from the installed wheel (its compiled dataset helpers; the source tree has none, and
  Megatron-LM would compile them) and Megatron-LM's fused CUDA kernels not built (their unfused paths run);
- torch.compile off (megatron-core compiles its fusions; eager runs the same functions);
- the load of a checkpoint with the distributed optimizer given what apex's or Transformer Engine's Adam gives
  it on a GPU: without them megatron-core falls back to torch's Adam, whose state does not exist before the
  first step (``DistributedOptimizer.state_dict`` then asserts, so Megatron-LM cannot resume any such
  checkpoint, its own included), keeps a step per parameter (which its fully_reshardable load cannot copy),
  and ends up with the loaded step shared by all parameters (``megatron_snip.training.adam_state``);
- the data iterators built without moving torch's generator, which the shim makes CUDA's too: on a GPU the
  DataLoader's seed draw after a resume's RNG restore does not touch the generator dropout uses.

Needs the packages Megatron-LM's training code imports beyond megatron-snip's (``six``).
"""

import os
import runpy
import sys
import types

MEGATRON_LM = os.environ["MEGATRON_LM"]  # a Megatron-LM checkout (tag core_v0.16.1)
sys.path.append(MEGATRON_LM)  # after site-packages: megatron.core is the installed wheel, megatron.training the tree
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from megatron_snip.compat.cpu import enable  # noqa: E402

enable()
torch.cuda.is_available = lambda: True
torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(major=9, minor=0, name="cpu",
                                                                                total_memory=0)

import megatron.core.datasets.utils as dataset_utils  # noqa: E402
import megatron.legacy.fused_kernels as fused_kernels  # noqa: E402
import megatron.training.checkpointing as megatron_checkpointing  # noqa: E402
import megatron.training.training as megatron_training  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402

from megatron_snip.training import adam_state  # noqa: E402

dataset_utils.compile_helpers = lambda: None
fused_kernels.load = lambda args: None
load_checkpoint = megatron_checkpointing.load_checkpoint


def load_checkpoint_with_adam_state(ddp_model, optimizer, *args, **kwargs):
    if optimizer is None:
        return load_checkpoint(ddp_model, optimizer, *args, **kwargs)
    adam_state.materialize(optimizer)
    content = None
    tracker = os.path.join(megatron_training.get_args().load or "", "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        iteration = int(open(tracker).read().strip())
        path = os.path.join(os.path.dirname(tracker), f"iter_{iteration:07d}")
        content = dist_checkpointing.load_content_metadata(path)
    with adam_state.fully_reshardable_steps_kept(content):
        loaded = load_checkpoint(ddp_model, optimizer, *args, **kwargs)
    adam_state.own_steps(optimizer)
    return loaded


megatron_training.load_checkpoint = load_checkpoint_with_adam_state
build_data_iterators = megatron_training.build_train_valid_test_data_iterators


def build_data_iterators_keeping_rng(*args, **kwargs):
    """Megatron-LM's data iterators, built without moving the generator that stands in for CUDA's.

    Creating a DataLoader's iterator draws its base seed from torch's CPU generator, after a resume's RNG restore.
    On a GPU that generator is not the one dropout draws from; here the shim's CUDA generator is the CPU one, so
    the draw would shift every dropout mask of a resumed run against the uninterrupted one.
    """
    state = torch.get_rng_state()
    try:
        return build_data_iterators(*args, **kwargs)
    finally:
        torch.set_rng_state(state)


megatron_training.build_train_valid_test_data_iterators = build_data_iterators_keeping_rng
sys.argv = [os.path.join(MEGATRON_LM, "pretrain_gpt.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
