#!/usr/bin/env bash
# A Megatron-LM run moves here and back through its checkpoints, checked with stock Megatron-LM itself on CPU
# (docs/megatron_compat.md, "Checkpoints: a Megatron-LM run moves here and back"). Not part of the test suite.
#
#   bash tools/megatron_lm_round_trip.sh MEGATRON_LM_DIR OUT_DIR [FLAG ...]
#
# FLAGs are added to both programs' model flags (e.g. --untie-embeddings-and-output-weights: the default, as in
# Megatron-LM, is a tied output layer).
# MEGATRON_LM_DIR: a Megatron-LM checkout at tag core_v0.16.1 (its pretrain_gpt.py runs through
# tools/megatron_lm_on_cpu.py). Every run is 4 processes, TP 2 x PP 2, the distributed optimizer, bf16, --mock-data,
# the same flags on both sides (those only Megatron-LM needs on a CPU aside), 6 iterations in all:
#   1. Megatron-LM trains 6 iterations, saving every 2                              OUT_DIR/megatron
#   2. this program resumes its iteration 2 and trains to 4 (--exit-interval 4)     OUT_DIR/here
#   3. Megatron-LM resumes this program's iteration 4 and trains to 6, no extra flag OUT_DIR/back
#   4. Megatron-LM resumes its own iteration 4 and trains to 6 (saving it)          OUT_DIR/again
#   5. this program resumes 1.'s iteration 2 with SNIP (a cycle at 4, the plan in the checkpoint and as
#      te_precision_config*.yaml beside it); Megatron-LM resumes that and trains to 6  OUT_DIR/snip, OUT_DIR/snip_back
# Checked (exit 1 otherwise): 2.'s losses and learning rates at 3 and 4 are 1.'s, bit for bit; 3.'s at 5 and 6 are
# 4.'s; 4. continues as 1. did: its loss and learning rate at 5 are 1.'s, and its iteration-6 checkpoint holds 1.'s
# weights, optimizer and RNG states, bit for bit; 5.'s Megatron-LM run resumes at iteration 4 with 32 consumed
# samples. Megatron-LM logs the first iteration of a run without resetting its loss sum, so with --log-interval 1
# the loss it prints for a run's second iteration (2 in 1., 6 in 3. and 4.) is the mean of the first two
# (docs/megatron_compat.md, "The round trip, step by step"). About 2-8 minutes on 2 cores.
set -euo pipefail
MEGATRON_LM=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
HERE=$(cd "$(dirname "$0")/.." && pwd)
export MEGATRON_LM OMP_NUM_THREADS=1
DEPS="$OUT/deps"  # what Megatron-LM's training code imports beyond this program's dependencies
python -c "import six" 2>/dev/null || pip install --quiet --target "$DEPS" six
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}:$DEPS"

# The run's length and warm-up: 6 iterations of 8 samples; LENGTH="--train-samples 50 --lr-decay-samples 45
# --lr-warmup-samples 10" runs Megatron-LM's sample-based schedule instead (6 iterations too).
read -r -a LENGTH <<< "${LENGTH:---train-iters 6 --lr-warmup-iters 1}"
FLAGS=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4 --group-query-attention
       --num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --swiglu --disable-bias-linear
       --normalization RMSNorm --position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0
       --micro-batch-size 2 --global-batch-size 8 "${LENGTH[@]}" --lr 1e-3 --min-lr 1e-4
       --lr-decay-style cosine --bf16 --use-distributed-optimizer --tensor-model-parallel-size 2
       --pipeline-model-parallel-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 --seed 5
       --log-interval 1 --eval-iters 0 --eval-interval 1000 "$@")
# Megatron-LM on a CPU: its local layers, gloo, no CUDA fusions.
MEGATRON_CPU=(--transformer-impl local --ckpt-format torch_dist --distributed-backend gloo
              --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion
              --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm)
# megatron-core's DotProductAttention, which Megatron-LM's local layers run (the same kernels: bit-identical).
HERE_ATTENTION=(--attention-backend local)
port=29700

megatron() {  # OUT_NAME FLAGS...
    local name=$1; shift
    port=$((port + 1))
    (cd "$OUT" && torchrun --nproc-per-node 4 --master-port $port "$HERE/tools/megatron_lm_on_cpu.py" \
        "${FLAGS[@]}" "${MEGATRON_CPU[@]}" "$@" > "$OUT/$name.log" 2>&1) || { tail -30 "$OUT/$name.log"; exit 1; }
}
here() {  # OUT_NAME FLAGS...
    local name=$1; shift
    port=$((port + 1))
    torchrun --nproc-per-node 4 --master-port $port "$HERE/pretrain_llama.py" "${FLAGS[@]}" "${HERE_ATTENTION[@]}" \
        "$@" > "$OUT/$name.log" 2>&1 || { tail -30 "$OUT/$name.log"; exit 1; }
}
copy() {  # FROM_DIR ITERATION TO_DIR: a checkpoint directory holding that one checkpoint
    rm -rf "$3" && mkdir -p "$3" && cp -r "$1/iter_$(printf %07d "$2")" "$3/" && echo "$2" > "$3/latest_checkpointed_iteration.txt"
}

rm -rf "$OUT/megatron" "$OUT/here" "$OUT/back" "$OUT/again" "$OUT/snip" "$OUT/snip_back"
echo "1. Megatron-LM trains 6 iterations"; megatron megatron --save "$OUT/megatron" --save-interval 2
echo "2. this program resumes its iteration 2"; copy "$OUT/megatron" 2 "$OUT/here"
here here --load "$OUT/here" --save "$OUT/here" --save-interval 2 --exit-interval 4
echo "3. Megatron-LM resumes this program's iteration 4"; copy "$OUT/here" 4 "$OUT/back"; megatron back --load "$OUT/back"
echo "4. Megatron-LM resumes its own iteration 4"; copy "$OUT/megatron" 4 "$OUT/again"
megatron again --load "$OUT/again" --save "$OUT/again" --save-interval 2
echo "5. this program resumes iteration 2 with SNIP; Megatron-LM resumes its iteration 4"
copy "$OUT/megatron" 2 "$OUT/snip"
here snip --load "$OUT/snip" --save "$OUT/snip" --save-interval 2 --exit-interval 4 --snip --snip-interval 2
copy "$OUT/snip" 4 "$OUT/snip_back"; megatron snip_back --load "$OUT/snip_back"

python - "$OUT" <<'EOF'
import re, sys, tempfile
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

out = Path(sys.argv[1])

def checkpoint(name, iteration):  # the sharded part of a torch_dist checkpoint: model, optimizer, RNG states
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(out / name / f"iter_{iteration:07d}", f"{tmp}/state.pt")
        return torch.load(f"{tmp}/state.pt", weights_only=False)

def same(a, b):  # bit for bit, dtypes included
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b

def steps(name):
    text = (out / f"{name}.log").read_text()
    return {int(i): (lr, loss) for i, lr, loss in re.findall(
        r"iteration +(\d+)/ +\d+ \|.*?learning rate: ([\d.E+-]+) \|.*?lm loss: ([\d.E+-]+)", text)}

runs = {name: steps(name) for name in ("megatron", "here", "back", "again", "snip", "snip_back")}
print(f"{'iteration':>9} " + " ".join(f"{name:>24}" for name in runs))
for it in range(1, 7):
    print(f"{it:>9} " + " ".join(f"{' / '.join(run[it]) if it in run else '':>24}" for run in runs.values()))
failed = []
if {it: runs["megatron"][it] for it in (3, 4)} != runs["here"]:
    failed.append("2. resuming Megatron-LM's iteration 2 here did not continue as Megatron-LM did")
if runs["back"] != runs["again"] or sorted(runs["back"]) != [5, 6]:
    failed.append("3. Megatron-LM resuming this program's iteration 4 did not continue as from its own")
uninterrupted, again = checkpoint("megatron", 6), checkpoint("again", 6)
differ = sorted(k for k in uninterrupted.keys() | again.keys() if not same(uninterrupted.get(k), again.get(k)))
learning_rate_6 = runs["again"].get(6, (None,))[0]
if runs["again"].get(5) != runs["megatron"][5] or learning_rate_6 != runs["megatron"][6][0] or differ:
    failed.append(f"4. Megatron-LM resuming its own iteration 4 did not continue as its uninterrupted run"
                  f"{': the iteration-6 checkpoints differ in ' + ', '.join(differ[:5]) if differ else ''}")
snip_back = (out / "snip_back.log").read_text()
if "iteration        5/       6 | consumed samples:           40" not in snip_back:
    failed.append("5. Megatron-LM did not resume the SNIP run's checkpoint at its data position")
print("\n".join(failed) or "round trip: Megatron-LM -> here -> Megatron-LM continues as Megatron-LM itself does")
sys.exit(1 if failed else 0)
EOF
