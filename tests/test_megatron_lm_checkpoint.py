"""A Megatron-LM run moves here and back through its checkpoints (issue 50; docs/megatron_compat.md).

The project cannot carry Megatron-LM's training code, so tests/drivers/megatron_lm_checkpoints.py stands in for
its ``save_checkpoint`` and ``load_checkpoint`` (written from Megatron-LM 0.16.1's, with the args Namespace stock
Megatron-LM saved, tests/data/megatron_lm_args.json). At TP2 x PP2 with the distributed optimizer, tied (its
dp_reshardable format) and untied (--dist-ckpt-optim-fully-reshardable), and with the regular optimizer in one
process: a run of this trainer writes Megatron-LM's checkpoint at iteration 2 and trains on to 4; a second run
resumes that checkpoint here and must continue exactly (loss, LR by Megatron-LM's schedule in samples, data
position), save its own at 4, which Megatron-LM's load reads with its default flags (tools/megatron_lm_round_trip.sh
does both directions with stock Megatron-LM itself).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_MEGATRON, launch

from megatron_snip.training.checkpoint_record import RECORD_KEY, SAVED_BY_MEGATRON_LM, CheckpointRecord
from megatron_snip.training.megatron_lm_checkpoint import CannotLoad, common_state, read_common

DRIVER = "tests/drivers/megatron_lm_checkpoints.py"
ARGS = json.loads((ROOT / "tests" / "data" / "megatron_lm_args.json").read_text())
OLD = ROOT / "tests" / "data" / "checkpoint_v0"
GBS, LR, MIN_LR, WARMUP, ITERS = 8, 1e-3, 1e-4, 1, 4
FLAGS = [*TINY_MEGATRON, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--bf16",
         "--micro-batch-size", "2", "--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--lr", str(LR),
         "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP), "--lr-decay-style", "cosine", "--eval-iters", "0",
         "--log-interval", "1", "--seed", "5"]
TP2_PP2_DISTRIBUTED = ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "2"]
# variant -> (processes, flags, TP x PP, Megatron-LM with Transformer Engine installed): tied with the distributed
# optimizer's dp_reshardable format, untied with its fully_reshardable one and TE (its final norm keeps an
# _extra_state), and the regular optimizer (tied) in one process.
VARIANTS = {"tied": (4, [*FLAGS, *TP2_PP2_DISTRIBUTED], (2, 2), False),
            "untied": (4, [*FLAGS, *TP2_PP2_DISTRIBUTED, "--untie-embeddings-and-output-weights",
                           "--dist-ckpt-optim-fully-reshardable"], (2, 2), True),
            "regular optimizer": (1, FLAGS, (1, 1), False)}
# Megatron-LM's rng_state entry.
RNG_KEYS = ["cuda_rng_state", "np_rng_state", "random_rng_state", "rng_tracker_states", "torch_rng_state"]


def progress(stdout: str) -> dict[int, tuple[float, float, int]]:
    """iteration -> (learning rate, lm loss, consumed samples) of the progress lines."""
    lines = re.findall(r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*?learning rate: ([\d.E+-]+) \|.*?"
                       r"lm loss: ([\d.E+-]+)", stdout)
    return {int(i): (float(lr), float(loss), int(n)) for i, n, lr, loss in lines}


def megatron_lr(iteration: int) -> float:
    """Megatron-LM's cosine schedule with linear warm-up, stepped by the samples of each iteration, after
    ``iteration`` iterations (OptimizerParamScheduler.get_lr)."""
    steps, warmup, decay = iteration * GBS, WARMUP * GBS, ITERS * GBS
    if steps <= warmup:
        return LR * steps / warmup
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * (steps - warmup) / (decay - warmup)) + 1)


def megatron_flops_per_iteration(tp: int) -> float:
    """Megatron-LM's num_floating_point_operations for TINY_MEGATRON (4 layers, hidden 64, 4 heads, 2 query
    groups, SwiGLU 192, seq 64) with its vocabulary rows (NullTokenizer's 127 + 1 ids padded to a multiple of
    128 x ``tp``) and a global batch of 8, worked out by hand from its formula."""
    h, ffn, s, layers, kv = 64, 192, 64, 4, 2 * 16
    attention = 6 * (h * (h + 2 * kv) + h * s / 2 * 2 + h * h)
    mlp = 6 * h * ffn * 3
    return GBS * s * (layers * (attention + mlp) + 6 * h * 128 * tp)


@dataclass(frozen=True)
class RoundTrip:
    variant: str
    tp_pp: tuple[int, int]
    whole: dict  # the uninterrupted run's progress
    resumed: dict  # the run resuming Megatron-LM's checkpoint of iteration 2
    resumed_out: str
    megatron_read: dict  # what Megatron-LM's load_checkpoint read from this program's checkpoint of iteration 4
    ours: Path  # that checkpoint


@pytest.fixture(scope="module", params=list(VARIANTS))
def round_trip(request, tmp_path_factory) -> RoundTrip:
    d = tmp_path_factory.mktemp(request.param.replace(" ", "_"))
    nproc, flags, tp_pp, with_te = VARIANTS[request.param]
    te = {"MEGATRON_LM_WITH_TE": "1" if with_te else "0"}
    whole = launch(nproc, flags, script=DRIVER, env={"MEGATRON_LM_SAVE": f"{d / 'megatron'}:2", **te})
    resumed = launch(nproc, [*flags, "--load", str(d / "megatron"), "--save", str(d / "ours"), "--save-interval",
                             "2"], script=DRIVER, env={"MEGATRON_LM_LOAD": "1", **te})
    (line,) = re.findall(r"^MEGATRON-LM-LOAD (.*)$", resumed.stdout, re.M)
    return RoundTrip(request.param, tp_pp, progress(whole.stdout), progress(resumed.stdout), resumed.stdout,
                     json.loads(line), d / "ours" / "iter_0000004")


@pytest.mark.integration
def test_a_megatron_lm_checkpoint_resumes_as_megatron_lm_resumes_it(round_trip):
    """Iterations 3 and 4 from Megatron-LM's checkpoint of iteration 2 are the uninterrupted run's (same kernels:
    bit for bit), at Megatron-LM's learning rates and data position."""
    assert "(saved by Megatron-LM) at iteration 2 (consumed samples 16); continuing at 2" in round_trip.resumed_out
    assert sorted(round_trip.resumed) == [3, 4]
    for it in (3, 4):
        assert round_trip.resumed[it] == round_trip.whole[it]
        lr, _, consumed = round_trip.resumed[it]
        assert lr == pytest.approx(megatron_lr(it), rel=1e-6) and consumed == it * GBS
    assert [round_trip.whole[it][0] for it in (1, 2)] == pytest.approx([megatron_lr(1), megatron_lr(2)], rel=1e-6)


@pytest.mark.integration
def test_megatron_lm_reads_this_programs_checkpoint_as_its_own(round_trip):
    """Megatron-LM's load_checkpoint with its default flags (no --finetune, no --use-checkpoint-opt_param-scheduler)
    takes the model, optimizer, scheduler (every saved setting equal to its flags', counted in samples), RNG and
    counters from the checkpoint this program saved at iteration 4; untied, as Megatron-LM does with Transformer
    Engine installed, which asks for the final norm's extra state too."""
    read, tp = round_trip.megatron_read, round_trip.tp_pp[0]
    assert (read["iteration"], read["checkpoint_version"], read["consumed_train_samples"]) == (4, 3.0, 32)
    assert (read["skipped_train_samples"], read["consumed_valid_samples"]) == (0, 0)
    assert read["num_floating_point_operations_so_far"] == pytest.approx(4 * megatron_flops_per_iteration(tp))
    assert read["ckpt_tp_pp"] == list(round_trip.tp_pp) and read["loads_rng"] and read["loads_optim"]
    assert read["rng_keys"] == RNG_KEYS and read["scheduler_steps"] == 4 * GBS
    assert read["lr"] == pytest.approx([megatron_lr(4)])
    assert read["untie_embeddings_and_output_weights"] is (round_trip.variant == "untied")
    expected = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if round_trip.variant == "tied":
        expected["distrib_optim_sharding_type"] = "dp_reshardable"
    elif round_trip.variant == "untied":
        expected.update(distrib_optim_sharding_type="fully_reshardable",
                        distrib_optim_fully_reshardable_mem_efficient=False)
    assert read["content_metadata"] == expected


@pytest.mark.integration
def test_the_checkpoint_holds_megatron_lms_layout_beside_this_programs_record(round_trip):
    """What Megatron-LM's load reads, as it reads it: args a Namespace unpickled without this program, the RNG
    state one object per (pp, tp) (replicas over dp-cp), and this program's state under keys of its own: the
    record in common.pt, the quantization state per (pp, tp, dp-cp) rank, the plan as a megatron-core
    precision config beside the checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    class WithoutThisProgram(pickle.Unpickler):
        def find_class(self, module, name):
            assert not module.startswith("megatron_snip"), (module, name)
            return super().find_class(module, name)

    tp, pp = round_trip.tp_pp
    with open(round_trip.ours / "common.pt", "rb") as f:
        common = torch.load(f, weights_only=False, pickle_module=type("P", (), {
            "Unpickler": WithoutThisProgram, "load": pickle.load, "__name__": "pickle"}))
    args = common["args"]
    assert isinstance(args, argparse.Namespace) and common["checkpoint_version"] == 3.0
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size,
            args.context_parallel_size, args.world_size) == (tp, pp, 1, 1, tp * pp)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.add_position_embedding) == (
        4, 64, 4, True)
    assert (args.no_save_optim, args.no_save_rng, args.consumed_train_samples) == (False, False, 32)
    assert (args.vocab_size, args.padded_vocab_size, args.tokenizer_type) == (127, 128 * tp, "NullTokenizer")
    assert (args.layernorm_epsilon, args.add_bias_linear, args.swiglu, args.kv_channels) == (1e-5, False, True, 16)
    assert not hasattr(args, "snip") and not hasattr(args, "norm_epsilon")  # this program's own flags stay its own
    assert common["opt_param_scheduler"]["num_steps"] == 32 and common["opt_param_scheduler"]["lr_decay_steps"] == 32
    assert common[RECORD_KEY]["version"] == 2 and common[RECORD_KEY]["precision_plan"] is not None
    saved = set(FileSystemReader(str(round_trip.ours)).read_metadata().state_dict_metadata)
    assert {k for k in saved if k.startswith("rng_state/")} == {f"rng_state/shard_{p}.{t}_{pp}.{tp}"
                                                               for p in range(pp) for t in range(tp)}
    assert {k for k in saved if k.startswith("megatron_snip_quantization_state/")} == {
        f"megatron_snip_quantization_state/shard_{p}.{t}.0_{pp}.{tp}.1" for p in range(pp) for t in range(tp)}
    # The extra states Megatron-LM's modules ask for with Transformer Engine (megatron-core's
    # _get_extra_state_offsets: one per layer of the 4, the final norm's without offsets), each written once.
    layers = [f"decoder.layers.{m}._extra_state/shard_{i}_4" for i in range(4) for m in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert {k for k in saved if "_extra_state" in k} == {*layers, "decoder.final_layernorm._extra_state/shard_0_1"}
    assert (round_trip.ours / "te_precision_config.yaml").is_file()
    assert sorted(f.name for f in round_trip.ours.glob("te_precision_config.pp*.yaml")) == [
        f"te_precision_config.pp{p}.yaml" for p in range(pp) if pp > 1]


# -- reading a Megatron-LM checkpoint's common.pt ------------------------------------------------------------

def megatron_common(**changed) -> dict:
    """The common.pt stock Megatron-LM wrote at iteration 2 of tests/data/megatron_lm_args.json's run (its
    scheduler state and content metadata as it wrote them), with ``changed`` args."""
    args = argparse.Namespace(**{**ARGS["args"], **changed})
    return {"args": args, "checkpoint_version": 3.0, "iteration": 2, "num_floating_point_operations_so_far": 7.5e8,
            "opt_param_scheduler": {"max_lr": 0.001, "lr_warmup_steps": 8, "num_steps": 16, "lr_decay_style": "cosine",
                                    "lr_decay_steps": 32, "min_lr": 0.0001, "start_wd": 0.01, "end_wd": 0.01,
                                    "wd_incr_style": "constant", "wd_incr_steps": 32},
            "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                                 "chained_optim_avoid_prefix": True}}


@pytest.mark.parametrize("untie", [False, True])
def test_megatron_lms_args_give_the_shape_and_its_meaning(untie):
    """Tying from untie_embeddings_and_output_weights, the padded vocabulary and NullTokenizer's size as Megatron-LM
    gave them, its norm epsilon and zero-centred gamma under its own names, the layout, counters and schedule."""
    record = read_common(megatron_common(untie_embeddings_and_output_weights=untie), "CKPT")
    assert record.saved_by == SAVED_BY_MEGATRON_LM and not record.legacy
    a = record.args
    assert a["share_embeddings_and_output_weights"] is not untie
    assert (a["vocab_size"], a["padded_vocab_size"], a["tokenizer_type"]) == (127, 256, "NullTokenizer")
    assert (a["num_layers"], a["hidden_size"], a["ffn_hidden_size"], a["num_attention_heads"], a["num_query_groups"],
            a["seq_length"], a["rotary_base"], a["norm_epsilon"], a["apply_layernorm_1p"]) == (
        2, 64, 192, 4, 2, 64, 10000, 1e-5, False)
    assert dict(record.layout) == {"tp": 2, "pp": 2, "dp": 1, "cp": 1}
    assert (record.iteration, record.consumed_samples, record.scheduler["num_steps"]) == (2, 16, 16)
    assert record.content_metadata["distrib_optim_sharding_type"] == "dp_reshardable"
    assert not (record.no_optimizer_state or record.no_rng_state or record.dropped)
    multi_head = read_common(megatron_common(group_query_attention=False, num_query_groups=1), "CKPT")
    assert multi_head.args["num_query_groups"] == 4  # Megatron-LM ignores --num-query-groups without GQA


def test_what_megatron_lm_counted_differently_reads_as_megatron_lm_reads_it():
    """No content metadata (megatron-core < 0.13): Megatron-LM's assumption by --ckpt-fully-parallel-save; no
    consumed-samples counter (older Megatron-LM): iteration x global batch; a pending rerun state is said."""
    common = megatron_common(consumed_train_samples=0, ckpt_fully_parallel_save=False)
    del common["content_metadata"]
    common["rerun_state_machine"] = {"mode": "validate_results"}
    record = read_common(common, "CKPT")
    assert record.consumed_samples == 16
    assert record.content_metadata == {"distrib_optim_sharding_type": "dp_zero_gather_scatter"}
    assert len(record.dropped) == 1 and "rerun state machine" in record.dropped[0]


def test_a_megatron_lm_model_that_cannot_be_built_here_is_refused_one_line_per_field(tmp_path):
    """A GELU MLP with biases: each field in one line naming it, reported together (exit 78 at start-up)."""
    from megatron_snip.arguments import ArgumentError, parse_config

    with pytest.raises(CannotLoad) as e:
        read_common(megatron_common(swiglu=False, add_bias_linear=True, num_experts=8), "CKPT")
    assert [re.search(r"\((\w+ \S+) in its args\)", p).group(1) for p in e.value.problems] == [
        "swiglu False", "add_bias_linear True", "num_experts 8"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)  # a complete checkpoint's files, common.pt replaced by Megatron-LM's
    torch.save(megatron_common(swiglu=False, normalization="LayerNorm"), ckpt / "iter_0000002" / "common.pt")
    with pytest.raises(ArgumentError) as e:
        parse_config(["--load", str(ckpt), "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer"],
                     world_size=4, cuda=False)
    assert e.value.problems[:2] == [
        f"--load {ckpt}: {ckpt}/iter_0000002 is a Megatron-LM checkpoint of a GELU MLP (Llama's is SwiGLU) (swiglu "
        f"False in its args), which this program cannot build; it cannot be loaded here",
        f"--load {ckpt}: {ckpt}/iter_0000002 is a Megatron-LM checkpoint of a norm other than RMSNorm (normalization "
        f"'LayerNorm' in its args), which this program cannot build; it cannot be loaded here"]


def test_a_megatron_lm_checkpoint_fills_the_shape_flags(tmp_path):
    """--load of a Megatron-LM checkpoint without shape flags builds its model: tied, 256 vocabulary rows."""
    from megatron_snip.arguments import parse_config

    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    torch.save(megatron_common(), ckpt / "iter_0000002" / "common.pt")
    config = parse_config(["--load", str(ckpt), "--train-iters", "4", "--mock-data", "--tokenizer-type",
                           "NullTokenizer", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                           "2"], world_size=4, cuda=False)
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.vocab_size, m.padded_vocab_size) == (2, 64, 2, 127, 256)
    assert m.share_embeddings_and_output_weights and config.start.resumed.saved_by == SAVED_BY_MEGATRON_LM


# -- errors that say what is wrong -----------------------------------------------------------------------------

def test_a_model_of_another_shape_is_named_with_its_flags_not_called_damaged():
    """checkpoint_v0 (hidden 16, tied) asked for hidden 32 or an output layer: the tensor, both shapes and the flag
    that differs; optimizer state in another layout: the flag that skips it."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_snip.training.checkpoint_match import mismatch

    path = str(OLD / "iter_0000002")
    record = CheckpointRecord(2, {"hidden_size": 16, "num_layers": 1, "share_embeddings_and_output_weights": True})
    run = {"hidden_size": 32, "num_layers": 1, "share_embeddings_and_output_weights": False}

    def state(part, key, shape):
        return {part: {key: ShardedTensor.from_rank_offsets(key, torch.zeros(shape))}}

    said = mismatch(state("model", "embedding.word_embeddings.weight", (128, 32)), path, record, run)
    assert said == (f"checkpoint {path} holds embedding.word_embeddings.weight of shape (128, 16) where this run's is "
                    f"(128, 32): it holds a model of another shape than this run builds (it was saved with "
                    f"--hidden-size 16 (this run: 32), --share-embeddings-and-output-weights True (this run: False)); "
                    f"the checkpoint is not damaged: run with its shape (drop the flags that differ, the checkpoint "
                    f"gives them), or train into another --save")
    assert "holds no output_layer.weight: it holds a model of another shape" in mismatch(
        state("model", "output_layer.weight", (128, 16)), path, record, run)
    assert mismatch(state("optimizer", "optimizer.state.exp_avg.x", (3,)), path, record, run).endswith(
        "the optimizer state was saved in another format or parallel layout than this run reads (saved by "
        "megatron-snip); the checkpoint is not damaged; pass --no-load-optim to load without it")
    assert mismatch(state("model", "embedding.word_embeddings.weight", (128, 16)), path, record, run) is None


# -- context parallelism in the layout -----------------------------------------------------------------------------

def test_context_parallel_peers_hold_distinct_replicas_and_quantization_shards(monkeypatch):
    """At TP 2, PP 1, DP 2, CP 2 (8 ranks): the RNG state is one object per (pp, tp) whose replicas are the dp-cp
    ranks (CP peers never both claim replica 0); the quantization state one object per (pp, tp, dp-cp) rank."""
    from megatron.core import parallel_state as ps

    from megatron_snip.training import megatron_lm_checkpoint as megatron_lm

    rank = {"tp": 1, "dp_cp": 3}
    for name, value in {"get_pipeline_model_parallel_world_size": 1, "get_tensor_model_parallel_world_size": 2,
                        "get_pipeline_model_parallel_rank": 0}.items():
        monkeypatch.setattr(ps, name, lambda v=value: v)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank["tp"])
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda with_context_parallel=False:
                        4 if with_context_parallel else 2)
    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda with_context_parallel=False:
                        rank["dp_cp"] if with_context_parallel else rank["dp_cp"] // 2)
    replicas, shards = set(), set()
    for dp_cp in range(4):
        rank["dp_cp"] = dp_cp
        rng = megatron_lm.rng_object([{}])
        quant = megatron_lm.quantization_object({})
        replicas.add(rng.replica_id)
        shards.add(quant.unique_key)
        assert (rng.global_shape, rng.global_offset) == ((1, 2), (0, 1))
    assert replicas == {0, 1, 2, 3} and len(shards) == 4


def test_the_distributed_optimizer_reshards_over_dp_and_cp_but_not_tp(monkeypatch):
    from megatron_snip.training import checkpointing

    class DistributedOptimizer:
        data_parallel_group_idx = 0

    now = {"tp": 2, "pp": 1, "dp": 1, "cp": 2}
    monkeypatch.setattr(checkpointing, "_layout", lambda: now)
    dp_reshardable = {"distrib_optim_sharding_type": "dp_reshardable"}
    for saved in ({"tp": 2, "pp": 1, "dp": 2, "cp": 1}, {"tp": 2, "pp": 1, "dp": 4}):  # CP 2 <- DP; an older layout
        record = CheckpointRecord(2, {}, layout=saved, content_metadata=dp_reshardable)
        checkpointing._check_optimizer_layout(record, DistributedOptimizer(), "CKPT", fully_parallel=False)
    record = CheckpointRecord(2, {}, layout={"tp": 1, "pp": 1, "dp": 4, "cp": 1}, content_metadata=dp_reshardable)
    with pytest.raises(checkpointing.CheckpointError, match=r"^CKPT was saved at TP=1 PP=1 with the distributed "
                                                            r"optimizer in its dp_reshardable format, which reshards "
                                                            r"only over data-parallel \(and context-parallel\) ranks"):
        checkpointing._check_optimizer_layout(record, DistributedOptimizer(), "CKPT", fully_parallel=False)
    fully = CheckpointRecord(2, {}, layout={"tp": 1, "pp": 2, "dp": 1, "cp": 1},
                             content_metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    checkpointing._check_optimizer_layout(fully, DistributedOptimizer(), "CKPT", fully_parallel=False)
    with pytest.raises(checkpointing.CheckpointError, match=r"holds the optimizer state of a run with "
                                                            r"--use-distributed-optimizer, which this run's optimizer"):
        checkpointing._check_optimizer_layout(fully, object(), "CKPT", fully_parallel=False)


def test_the_namespace_holds_megatron_lms_names_and_counters():
    """common_state's args: the flags under Megatron-LM's names (renamed and negated where they differ), this
    program's own flags left in its record, the parallel sizes and counters Megatron-LM's load reads."""
    from conftest import run_config

    flags = {**run_config("--norm-epsilon", "1e-6", "--snip", "--snip-interval", "2").to_flags(),
             "padded_vocab_size": 256}
    record = CheckpointRecord(6, flags, 48, 8, 0, 1e9, layout={"tp": 2, "pp": 2, "dp": 2, "cp": 2},
                              no_optimizer_state=True)
    args = pickle.loads(pickle.dumps(common_state(record)))["args"]
    assert (args.layernorm_epsilon, args.add_bias_linear, args.untie_embeddings_and_output_weights) == (
        1e-6, False, True)
    assert (args.world_size, args.data_parallel_size, args.context_parallel_size) == (16, 2, 2)
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.no_save_optim, args.no_save_rng) == (
        48, 8, True, False)
    assert (args.padded_vocab_size, args.kv_channels, args.group_query_attention, args.params_dtype) == (
        256, 16, True, torch.float32)
    assert not any(hasattr(args, name) for name in ("snip", "snip_interval", "model_preset", "norm_epsilon",
                                                    "disable_bias_linear", "precision"))


def test_megatron_lms_other_formats_and_release_checkpoints_are_named_not_called_damaged(tmp_path):
    """Its torch format (mp_rank_* files), torch_dcp, a release checkpoint: each said for what it is, with how to
    load it; a newer non-persistent checkpoint, which Megatron-LM would resume, is a notice."""
    from megatron_snip.training.checkpointing import CheckpointError, choose_checkpoint, newer_non_persistent

    def checkpoint(root, tracker: str, files=()):
        (root / "iter_0000004").mkdir(parents=True)
        for name in files:
            (root / "iter_0000004" / name).mkdir() if name.startswith("mp_rank") else (
                root / "iter_0000004" / name).write_bytes(b"")
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
        return str(root)

    for files, fmt in ((("mp_rank_00", "mp_rank_01"), "torch format (mp_rank_* files)"),
                       ((".metadata", "__0_0.distcp"), "torch_dcp or fsdp_dtensor format")):
        root = checkpoint(tmp_path / fmt.split()[0], "4", files)
        with pytest.raises(CheckpointError, match=rf"iter_0000004 is a checkpoint in Megatron-LM's {re.escape(fmt)}, "
                                                  rf"which this program does not read \(only torch_dist\); convert it "
                                                  rf"with Megatron-LM .*\(it is not damaged\)$"):
            choose_checkpoint(root, fallback=True)
    release = checkpoint(tmp_path / "release", "release")
    with pytest.raises(CheckpointError, match=r"names Megatron-LM's release checkpoint .*/release \(weights to "
                                              r"fine-tune from\).* write 0 into .* and pass --finetune"):
        choose_checkpoint(release, fallback=False)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    assert newer_non_persistent(str(ckpt), 2) is None
    (ckpt / "non_persistent").mkdir()
    (ckpt / "non_persistent" / "latest_checkpointed_iteration.txt").write_text("3")
    assert newer_non_persistent(str(ckpt), 2) == (
        f"{ckpt}/non_persistent holds a newer checkpoint (iteration 3) than the one loaded (2), a non-persistent one "
        f"that Megatron-LM would resume instead; to resume it, --load {ckpt}/non_persistent")
