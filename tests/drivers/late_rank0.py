"""pretrain_llama.py whose rank 0 starts LATE_S seconds after the others, as on a loaded node: test-only.

Used by tests/test_forked_ranks.py: a refused launch must still print rank 0's error line when the other
ranks find the problem first.
"""

import os
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":
        time.sleep(float(os.environ["LATE_S"]))
    from megatron_snip.cli.pretrain import main

    sys.exit(main())
