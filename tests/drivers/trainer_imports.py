"""What tests/forked_ranks.py's forkserver imports once, before it forks any rank: the trainer and its
dependencies (torch, megatron-core), as pretrain_llama.py imports them (CPU warnings silenced first)."""

from megatron_snip.compat.cpu import silence_expected_warnings

silence_expected_warnings()

import megatron_snip.cli.pretrain  # noqa: E402
import megatron_snip.training.trainer  # noqa: E402,F401
