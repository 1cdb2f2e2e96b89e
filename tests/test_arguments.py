"""Bad input fails before any process-group work, naming the flag and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, train_args
from megatron_snip.arguments import ArgumentError, parse_config


def parse(data, *extra, world_size=1):
    return parse_config(train_args(data, *extra), world_size=world_size, cuda=False)


def test_valid_arguments_derive_layout(tiny_data):
    config = parse(tiny_data, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", world_size=8)
    assert config.parallel.data_parallel_size == 2
    assert config.training.num_microbatches == 8 // (2 * 2)
    assert config.training.lr_decay_iters == config.training.train_iters


def test_preset_fills_shape_and_flags_override(tiny_data):
    model = parse_config(["--model-preset", "llama3-8b", "--num-layers", "2", "--train-iters", "1",
                          "--split", "90,10,0", "--data-path", tiny_data.prefix,
                          "--tokenizer-model", tiny_data.tokenizer_model],
                         world_size=1, cuda=False).model
    assert (model.hidden_size, model.num_query_groups, model.rotary_base) == (4096, 8, 500000)
    assert model.num_layers == 2


@pytest.mark.parametrize("extra,world,flag", [
    (("--num-attention-heads", "4", "--num-query-groups", "4", "--tensor-model-parallel-size", "3"), 3,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (("--num-query-groups", "1", "--tensor-model-parallel-size", "2"), 2, "--num-query-groups 1"),
    (("--num-layers", "4", "--pipeline-model-parallel-size", "3"), 3,
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    (("--global-batch-size", "6", "--micro-batch-size", "4"), 1, "--global-batch-size 6 is not divisible"),
    (("--tensor-model-parallel-size", "2"), 3, "world size 3 is not divisible"),
    (("--seq-length", "128"), 1, "--seq-length 128 exceeds --max-position-embeddings 64"),
    (("--sequence-parallel",), 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (("--lr-warmup-iters", "6"), 1, "--lr-warmup-iters 6 must be smaller than --lr-decay-iters 6"),
    (("--save-interval", "2"), 1, "--save-interval needs --save"),
    (("--recompute-granularity", "full"), 1, "--recompute-method"),
    (("--overlap-param-gather",), 1, "--overlap-param-gather needs --use-distributed-optimizer"),
    (("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "2"),
     2, "the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size 2"),
    (("--virtual-pipeline-model-parallel-size", "2"), 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1"),
    (("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"), 2,
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 2 x --num-layers-per-virtual-pipeline-stage 3"),
    (("--snip", "--snip-interval", "2", "--snip-update-weight", "-1"), 1,
     "--snip-update-weight -1.0 must be a finite number >= 0"),
    (("--snip", "--snip-interval", "2", "--snip-switch-penalty", "nan"), 1,
     "--snip-switch-penalty nan must be a finite number >= 0"),
    (("--snip", "--snip-interval", "2", "--snip-loss-weight", "0", "--snip-update-weight", "0"), 1,
     "--snip-loss-weight and --snip-update-weight are both 0"),
])
def test_inconsistent_flags(tiny_data, extra, world, flag):
    with pytest.raises(ArgumentError, match=flag.replace("-", r"\-")):
        parse(tiny_data, *extra, world_size=world)


def test_triton_kernels_need_cuda(tiny_data, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ArgumentError, match=r"--quant-kernels triton needs (CUDA|the triton package)"):
        parse(tiny_data, "--quant-kernels", "triton")
    assert parse(tiny_data, "--quant-kernels", "torch", "--fp8-gemm", "scaled_mm").precision.fp8_gemm == "scaled_mm"


def test_plan_blocks_must_fit_the_tensor_parallel_split(tiny_data):
    """TINY_MODEL at TP=2: linear_qkv's output is 128, 64 per rank, less than a 128 fp8 block."""
    with pytest.raises(ArgumentError, match=r"--precision fp8: decoder.layers.0.self_attention.linear_qkv cannot "
                                            r"run fp8 at --tensor-model-parallel-size 2: its output dimension is "
                                            r"split into slices of 64, not a multiple of the fp8 block of 128"):
        parse(tiny_data, "--precision", "fp8", "--fp8-recipe", "blockwise", "--tensor-model-parallel-size", "2",
              world_size=2)
    # per-tensor fp8 and the 16/32-element FP4 blocks fit
    for precision in ("fp8", "nvfp4", "mxfp4"):
        parse(tiny_data, "--precision", precision, "--tensor-model-parallel-size", "2", world_size=2)


def test_snip_runs_with_sequence_parallel(tiny_data):
    argv = train_args(tiny_data, "--snip", "--save-interval", "3", "--save", "/tmp/unused", "--sequence-parallel",
                      "--tensor-model-parallel-size", "2")
    assert parse_config(argv, world_size=2, cuda=False).snip.enabled


def test_sequence_parallel_runs_with_the_local_layers_on_cpu(tiny_data):
    """Its norms are the project's own (megatron_snip/model/norms.py): no apex, no CUDA needed."""
    config = parse_config(train_args(tiny_data, "--sequence-parallel", "--tensor-model-parallel-size", "2"),
                          world_size=2, cuda=False)
    assert config.parallel.sequence_parallel and config.model.transformer_impl == "local"


def test_missing_data_path(tiny_data):
    with pytest.raises(ArgumentError, match=r"--data-path .*nope.* not found.*preprocess_data"):
        parse_config(train_args(tiny_data) + ["--data-path", "/nope/data_text_document"], world_size=1, cuda=False)


def test_missing_tokenizer_model(tiny_data):
    with pytest.raises(ArgumentError, match=r"--tokenizer-model"):
        parse_config(train_args(tiny_data) + ["--tokenizer-model", "/nope/tok.model"], world_size=1, cuda=False)


def test_tokenizer_smaller_than_data(tiny_data, tmp_path):
    from megatron_snip.data.tokenizer import TokenizerTrainingConfig, train_tokenizer

    train_tokenizer(TokenizerTrainingConfig(input=tiny_data.corpus, model_prefix=str(tmp_path / "small"),
                                            vocab_size=512))
    with pytest.raises(ArgumentError, match=r"holds token id \d+, but the tokenizer \(--tokenizer-model\) has only 512"):
        parse_config(train_args(tiny_data) + ["--tokenizer-model", str(tmp_path / "small.model")],
                   world_size=1, cuda=False)


def test_load_without_checkpoint(tiny_data, tmp_path):
    with pytest.raises(ArgumentError, match=r"--load .* holds no checkpoint"):
        parse(tiny_data, "--load", str(tmp_path))
    # The resume-or-start pattern (SLURM requeue) is allowed to find nothing yet.
    assert parse(tiny_data, "--load", str(tmp_path), "--save", str(tmp_path)).checkpoint.load == str(tmp_path)


def test_corrupt_tracker(tiny_data, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(ArgumentError, match=r"corrupt: expected an iteration number"):
        parse(tiny_data, "--load", str(tmp_path))


def test_incomplete_checkpoint(tiny_data, tmp_path):
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(ArgumentError, match=r"iter_0000005 is incomplete \(missing metadata.json"):
        parse(tiny_data, "--load", str(tmp_path))


@pytest.mark.integration
def test_cli_reports_error_and_exit_code(tiny_data):
    """The user sees one line on stderr and exit status 2, before any process group starts."""
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_llama.py"),
                           *train_args(tiny_data, "--num-layers", "3", "--pipeline-model-parallel-size", "2")],
                          capture_output=True, text=True, env={"WORLD_SIZE": "2", "PATH": ""}, cwd=ROOT)
    assert proc.returncode == 2
    assert "error: --num-layers 3 is not divisible by --pipeline-model-parallel-size 2" in proc.stderr


@pytest.mark.integration
def test_started_without_a_launcher_it_trains_as_one_process(tiny_data, tmp_path):
    """``python pretrain_llama.py`` with no torchrun/srun environment is a world of one (torch's env://
    rendezvous would stop it with a traceback asking for RANK)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_llama.py"),
                           *train_args(tiny_data, "--save", str(tmp_path / "ckpt"), iters=2)],
                          capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_nvfp4_switches_reach_the_recipe_and_its_quantizers(tiny_data):
    from megatron_snip.precision.recipes import operand_quantizer
    default = parse(tiny_data).precision.recipe()
    assert (default.fp4_stochastic_rounding, default.nvfp4_random_hadamard, default.nvfp4_2d_weights) == (
        True, True, True)  # TE's recipe
    off = parse(tiny_data, "--fp4-disable-stochastic-rounding", "--nvfp4-disable-rht",
                "--nvfp4-disable-2d-quantization").precision.recipe()
    assert operand_quantizer("nvfp4", "wgrad", "dy", default).hadamard
    assert operand_quantizer("nvfp4", "dgrad", "dy", default).stochastic
    assert operand_quantizer("nvfp4", "fprop", "w", default).block == (16, 16)
    assert not operand_quantizer("nvfp4", "wgrad", "dy", off).hadamard
    assert not operand_quantizer("nvfp4", "dgrad", "dy", off).stochastic
    assert not operand_quantizer("mxfp4", "dgrad", "dy", off).stochastic
    assert operand_quantizer("nvfp4", "fprop", "w", off).block == (1, 16)


def test_a_split_without_documents_is_refused_before_start_up(tiny_data):
    """Megatron's default --split 969,30,1 on the 60-document tiny corpus leaves the test split empty (megatron-core
    would loop forever building it): refused with the flags, not a traceback from the trainer."""
    with pytest.raises(ArgumentError, match=r"--split 969,30,1 gives the test split none of the 60 documents"):
        parse(tiny_data, "--split", "969,30,1")
