"""Bad input fails before any process-group work, naming the flag and the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, launch, train_args

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
    (("--lr-warmup-iters", "6"), 1, "--lr-warmup-iters 6 must be smaller than --lr-decay-iters 6"),
    (("--save-interval", "2"), 1, "--save-interval needs --save"),
    (("--recompute-granularity", "full"), 1, "--recompute-method"),
    (("--overlap-param-gather",), 1, "--overlap-param-gather needs --use-distributed-optimizer"),
    (("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "2"),
     2, "the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size 2"),
    (("--virtual-pipeline-model-parallel-size", "2"), 1,
     "virtual pipeline stages need --pipeline-model-parallel-size > 1"),
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


SNIP_FLAGS = ("--snip", "--snip-interval", "2", "--snip-fp4-target", "0")


@pytest.mark.parametrize("formats,message", [
    (("bf16", "fp8:fast"), "--snip-formats fp8:fast: unknown FP8 recipe 'fast' in precision 'fp8:fast'; valid: "
     "fp8:tensorwise, fp8:delayed, fp8:rowwise, fp8:blockwise, fp8:mxfp8 (Megatron-LM's --fp8-recipe values, and "
     "rowwise)"),
    (("bf16", "fp8_rowwise"), "--snip-formats fp8_rowwise: unknown precision 'fp8_rowwise' (an FP8 recipe per module "
     "is written fp8:rowwise); valid: bf16, fp8, fp8:tensorwise, fp8:delayed, fp8:rowwise, fp8:blockwise, fp8:mxfp8, "
     "nvfp4, mxfp4 (or forward/backward, e.g. 'fp8/bf16')"),
    (("bf16", "fp8", "fp8:tensorwise"), "--snip-formats lists fp8 and fp8:tensorwise, the same quantizers under "
     "--fp8-recipe tensorwise: give one of them (fp8 runs the run's --fp8-recipe, fp8:RECIPE its own)"),
    (("bf16", "fp8:rowwise", "fp8:rowwise"), "--snip-formats lists fp8:rowwise more than once: give each candidate "
     "once"),
])
def test_fp8_recipe_candidates_are_checked_at_the_edge(formats, message):
    from conftest import run_config

    with pytest.raises(ArgumentError) as e:
        run_config(*SNIP_FLAGS, "--snip-formats", *formats)
    assert str(e.value) == message


def test_fp8_recipes_per_module_are_candidates_and_precisions(tiny_data):
    """--snip-formats takes fp8:RECIPE beside the run's fp8 (another recipe than --fp8-recipe's), --precision and
    --snip-warmup-plan take them too, and the measured speed table times each one the run can use."""
    from conftest import run_config

    from megatron_snip.numerics.recipes import Precision
    from megatron_snip.training.precision_setup import timed_precisions

    config = parse(tiny_data, *SNIP_FLAGS, "--snip-formats", "bf16", "fp8", "fp8:rowwise", "fp8:blockwise",
                   "--snip-warmup-plan", "fp8:mxfp8")
    assert config.snip.snip_formats == ("bf16", "fp8", "fp8:rowwise", "fp8:blockwise")
    assert config.start.plan.default == Precision.uniform("fp8:mxfp8")
    assert timed_precisions(config) == ["bf16", "fp8", "nvfp4", "mxfp4", "fp8:rowwise", "fp8:blockwise", "fp8:mxfp8"]
    plain = parse(tiny_data, "--precision", "fp8:rowwise")
    assert plain.start.plan.default == Precision.uniform("fp8:rowwise")
    assert timed_precisions(plain) == ["bf16", "fp8", "nvfp4", "mxfp4", "fp8:rowwise"]
    # Without a GPU no candidate has a fast kernel: a time-target run keeps the research default.
    assert run_config(*SNIP_FLAGS, "--snip-time-target", "1").snip.snip_formats == ("bf16", "fp8", "nvfp4")


def test_triton_kernels_need_cuda(tiny_data, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ArgumentError, match=r"--quant-kernels triton needs (CUDA|the triton package)"):
        parse(tiny_data, "--quant-kernels", "triton")
    assert parse(tiny_data, "--quant-kernels", "torch", "--fp8-gemm", "scaled_mm").precision.fp8_gemm == "scaled_mm"


def test_missing_data_and_a_missing_tokenizer_are_both_named(tmp_path):
    """The data files and the tokenizer file are checked apart: a run missing both hears of both at once."""
    with pytest.raises(ArgumentError) as e:
        parse_config(["--model-preset", "tiny", "--train-iters", "1", "--data-path", str(tmp_path / "x_text_document"),
                      "--tokenizer-model", str(tmp_path / "tok.model")], world_size=1, cuda=False)
    assert [p.split(":")[0] for p in e.value.problems] == [
        f"--data-path {tmp_path / 'x_text_document'}", f"--tokenizer-model {tmp_path / 'tok.model'}"]


def test_a_missing_tokenizer_model_is_one_problem():
    """Without --tokenizer-model nothing is checked against it, so it is named once, not again by the loader."""
    with pytest.raises(ArgumentError) as e:
        parse_config(["--model-preset", "tiny", "--train-iters", "1", "--mock-data", "--fp8-amax-history-len", "0"],
                     world_size=1, cuda=False)
    assert e.value.problems == [
        "--fp8-amax-history-len must be >= 1",
        "--tokenizer-model is required: a sentencepiece .model file (tools/train_tokenizer.py) or, with "
        "--tokenizer-type HuggingFaceTokenizer, a tokenizer.json or the model directory holding it"]


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
    with pytest.raises(ArgumentError,
                       match=r"holds token id \d+, but --tokenizer-model .*small\.model has only 512 ids"):
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
    with pytest.raises(ArgumentError, match=r"iter_0000005, the one .* names, is damaged: .*iter_0000005/metadata.json "
                                            r"is missing; no earlier checkpoint here is intact, or restore the file"):
        parse(tiny_data, "--load", str(tmp_path))


@pytest.mark.integration
def test_cli_reports_error_and_exit_code(tiny_data):
    """The user sees one line on stderr and exit status 78 (a configuration error), before any process group
    starts."""
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_llama.py"),
                           *train_args(tiny_data, "--num-layers", "3", "--pipeline-model-parallel-size", "2")],
                          capture_output=True, text=True, env={"WORLD_SIZE": "2", "PATH": ""}, cwd=ROOT)
    assert proc.returncode == 78
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
    from megatron_snip.numerics.recipes import operand_quantizer
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


# -- Megatron-LM scripts' flags --------------------------------------------------------------------

def without_train_iters(data, *extra):
    """train_args with the length and warm-up left to ``extra`` (--train-samples, --lr-warmup-samples)."""
    argv = train_args(data)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2:]
    return [*argv, *extra]


def test_fp4_format_turns_fp4_on_as_megatron_does(tiny_data):
    assert parse(tiny_data, "--fp4-format", "e2m1").precision.precision == "fp4"
    precision = parse(tiny_data, "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4").precision
    assert (precision.precision, precision.alias(precision.precision)) == ("fp4", "nvfp4")
    assert parse(tiny_data, "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4").precision.fp4_recipe == "mxfp4"
    assert parse(tiny_data, "--fp4-format", "e2m1", "--precision", "nvfp4").precision.precision == "nvfp4"


def test_fp8_delayed_scaling_defaults_are_megatrons_and_a_checkpoint_keeps_its_own():
    from megatron_snip.arguments import parse_args
    from megatron_snip.arguments.architecture import resolve_architecture
    from megatron_snip.arguments.precision import validate_precision
    from megatron_snip.training.checkpoint_record import CheckpointRecord

    def recipe(argv, resumed):
        args = parse_args(["--model-preset", "tiny", "--train-iters", "1", *argv])
        resolve_architecture(args)
        args.notices = []
        validate_precision(args, cuda=False, resumed=resumed)
        return args.fp8_amax_history_len, args.fp8_amax_compute_algo, args.precision_notes

    assert recipe([], None) == (1, "most_recent", [])
    old = CheckpointRecord(1, {"fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"})  # old defaults
    assert recipe([], old) == (1024, "max", [])
    assert recipe(["--fp8-amax-history-len", "16"], old) == (
        16, "max", ["--fp8-amax-history-len 16 replaces the checkpoint's 1024"])


def test_train_samples_run_megatron_lms_schedule_in_samples(tiny_data):
    """Megatron-LM's sample-based training, whose counts need not be multiples of the global batch (its Llama 3
    8B script's are not): --train-samples // global batch iterations, and the LR stepped in samples as its
    get_optimizer_param_scheduler builds it (warm-up from --lr-warmup-init over 10 samples, cosine decay to 45),
    worked out by hand."""
    import math

    import torch

    from megatron_snip.training.setup import build_scheduler

    training = parse_config(without_train_iters(tiny_data, "--train-samples", "50", "--lr-decay-samples", "45",
                                                "--lr-warmup-samples", "10", "--lr-decay-style", "cosine",
                                                "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-init", "2e-4"),
                            world_size=1, cuda=False).training
    assert (training.global_batch_size, training.train_iters, training.lr_decay_iters) == (8, 6, None)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(training, optimizer)
    for samples in range(8, 56, 8):  # after each of the 6 iterations
        scheduler.step(8)
        cosine = 1e-4 + 0.9e-3 * 0.5 * (math.cos(math.pi * (samples - 10) / 35) + 1)
        expected = 2e-4 + 0.8e-3 * samples / 10 if samples <= 10 else cosine if samples <= 45 else 1e-4
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12), samples
    default = parse_config(without_train_iters(tiny_data, "--train-samples", "20"), world_size=1, cuda=False)
    assert (default.training.train_iters, default.training.lr_decay_samples) == (2, 20)
    assert "train_iters" not in default.to_yaml()  # it follows from --train-samples when the file is read back


def test_accepted_megatron_flags_take_megatrons_meaning(tiny_data):
    config = parse(tiny_data, "--kv-channels", "16", "--rotary-percent", "1.0", "--recompute-activations",
                   "--ckpt-format", "torch_dist", "--use-checkpoint-args", "--manual-gc", "--manual-gc-interval", "5",
                   "--no-save-optim", "--no-save-rng")
    assert config.model.recompute_granularity == "selective"
    assert (config.training.manual_gc, config.training.manual_gc_interval, config.training.manual_gc_eval) == (
        True, 5, True)
    assert not parse(tiny_data, "--manual-gc", "--no-manual-gc-eval").training.manual_gc_eval
    assert (config.checkpoint.no_save_optim, config.checkpoint.no_save_rng) == (True, True)


@pytest.mark.parametrize("extra,message", [
    (("--fp4-format", "e2m1", "--fp8-format", "hybrid"), "--fp4-format and --fp8-format cannot be used together"),
    (("--fp4-format", "e2m1", "--precision", "fp8"), "--fp4-format e2m1 turns FP4 on but --precision is fp8"),
    (("--kv-channels", "32"), "--kv-channels 32 differs from --hidden-size 64 / --num-attention-heads 4 = 16"),
    (("--rotary-percent", "0.5"), "--rotary-percent 0.5: Llama rotates every head dimension"),
    (("--ckpt-format", "torch"), "--ckpt-format torch: checkpoints are megatron-core dist_checkpointing"),
    (("--no-fp8-wgrad",), "--no-fp8-wgrad: a plan gives each module one precision for both backward GEMMs"),
    (("--manual-gc-interval", "-1"), "--manual-gc-interval must be >= 0"),
    (("--train-samples", "48"), "give --train-iters or --train-samples, not both"),
    (("--lr-decay-samples", "48"), "--lr-decay-samples, --lr-warmup-samples and --lr-wsd-decay-samples go with "
                                   "--train-samples"),
])
def test_refused_megatron_flags_say_why(tiny_data, extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse(tiny_data, *extra)


@pytest.mark.parametrize("extra,message", [
    ((), "--train-iters N (or Megatron-LM's --train-samples N) is required"),
    (("--train-samples", "48", "--lr-warmup-samples", "48"),
     "the warm-up (48 samples) must be shorter than --lr-decay-samples 48 (default: --train-samples)"),
    (("--train-samples", "48", "--lr-decay-iters", "4"), "with --train-samples give the LR schedule in samples"),
])
def test_train_samples_refusals(tiny_data, extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_config(without_train_iters(tiny_data, *extra), world_size=1, cuda=False)


def test_exit_on_missing_checkpoint_refuses_the_fresh_start(tiny_data, tmp_path):
    assert parse(tiny_data, "--load", str(tmp_path), "--save", str(tmp_path)).checkpoint.load == str(tmp_path)
    with pytest.raises(ArgumentError, match=r"--load .* holds no checkpoint .* and --exit-on-missing-checkpoint"):
        parse(tiny_data, "--load", str(tmp_path), "--save", str(tmp_path), "--exit-on-missing-checkpoint")


# -- bad input that used to escape as a traceback or a misleading line ----------------------------

def test_gurobi_solver_is_checked_at_start_up(tiny_data):
    from megatron_snip.snip.solvers import gurobi_unavailable

    reason = gurobi_unavailable()
    argv = ("--snip", "--snip-interval", "2", "--snip-solver", "gurobi")
    if reason is None:
        assert parse(tiny_data, *argv).snip.snip_solver == "gurobi"
    else:
        with pytest.raises(ArgumentError, match=r"^--snip-solver gurobi: .*; use --snip-solver highs"):
            parse(tiny_data, *argv)
        assert "\n" not in reason


def test_a_split_without_validation_share_turns_evaluation_off(tiny_data):
    """Megatron-LM builds no validation dataset for a share of 0 and skips evaluation (do_valid)."""
    assert parse(tiny_data, "--split", "100,0,0").logging.eval_iters == 0
    assert parse(tiny_data, "--split", "90,10,0").logging.eval_iters == 2
    with pytest.raises(ArgumentError, match=r"--split 0,100,0 gives training no documents"):
        parse(tiny_data, "--split", "0,100,0")
    with pytest.raises(ArgumentError, match=r"--split '1,1,1,1': expected up to three shares"):
        parse(tiny_data, "--split", "1,1,1,1")


def test_a_weighted_blend_missing_a_prefix_says_they_come_in_pairs(tiny_data):
    with pytest.raises(ArgumentError, match=r"'0\.7' looks like a blend weight, but weights and prefixes come in "
                                            r"pairs, each weight before its prefix .*3 items given"):
        parse(tiny_data, "--data-path", "0.7", tiny_data.prefix, "0.3")
    assert parse(tiny_data, "--data-path", "0.7", tiny_data.prefix, "0.3", tiny_data.prefix).data.data_path == (
        "0.7", tiny_data.prefix, "0.3", tiny_data.prefix)


@pytest.mark.parametrize("hf_file", ["config.json", "model.safetensors"])
def test_load_of_a_hugging_face_directory_names_the_converter(tiny_data, tmp_path, hf_file):
    (tmp_path / hf_file).write_text("{}")
    with pytest.raises(ArgumentError, match=r"is a Hugging Face model directory .* python tools/convert_hf_llama\.py "
                                            r"import --load-dir .* --save-dir CKPT_DIR and pass --load CKPT_DIR"):
        parse(tiny_data, "--load", str(tmp_path))


@pytest.mark.integration
def test_help_and_flag_errors_import_no_megatron_core_or_torch():
    """--help and flag errors (one line, exit 78, a refused Megatron-LM flag among them) are answered before torch's
    and megatron-core's seconds of imports (the modules a process imported, read from -X importtime: the same as
    its sys.modules after parsing)."""
    for argv, code in ((["--help"], 0), (["--no-such-flag"], 78), (["--moe-router-topk", "2", "--lr", "x"], 78)):
        proc = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "pretrain_llama.py"), *argv],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == code, proc.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "megatron_snip.arguments" in imported
        assert not {m for m in imported if m.split(".")[0] in ("megatron", "torch")}
    assert "--fp4-format" in subprocess.run([sys.executable, str(ROOT / "pretrain_llama.py"), "--help"],
                                            capture_output=True, text=True, cwd=ROOT, timeout=120).stdout


@pytest.mark.integration
def test_a_megatron_nvfp4_script_trains_saves_lean_checkpoints_and_resumes(tiny_data, tmp_path):
    """--fp4-format e2m1 --fp4-recipe nvfp4 trains every linear GEMM in NVFP4, for --train-samples / global batch
    iterations, under --manual-gc; --no-save-optim --no-save-rng checkpoints hold neither state, and a run resuming
    from one continues at its iteration with a fresh optimizer."""
    from megatron_snip.training.checkpointing import read_record

    ckpt = str(tmp_path / "ckpt")
    megatron = ("--fp4-format", "e2m1", "--fp4-recipe", "nvfp4", "--manual-gc", "--manual-gc-interval", "1",
                "--no-save-optim", "--no-save-rng", "--save", ckpt, "--load", ckpt, "--lr-decay-samples", "32")
    first = launch(1, without_train_iters(tiny_data, *megatron, "--train-samples", "16"))
    assert "100.0% of linear-layer FLOPs in FP4" in first.stdout and "fp4 nvfp4" in first.stdout
    record = read_record(ckpt)
    assert (record.iteration, record.no_optimizer_state, record.no_rng_state) == (2, True, True)
    assert record.args["train_iters"] == 2 and record.args["lr_decay_samples"] == 32
    written = os.path.join(ckpt, "iter_0000002", "run_config.yaml")  # the resolved flags, beside the checkpoint
    again = parse_config(["--yaml-cfg", written], world_size=1, cuda=False)
    assert (again.training.train_iters, again.precision.precision, again.checkpoint.no_save_optim) == (2, "fp4", True)
    second = launch(1, without_train_iters(tiny_data, *megatron, "--train-samples", "32",
                                           "--exit-on-missing-checkpoint"))
    assert "resumed from" in second.stdout and "continuing at 2" in second.stdout
    assert read_record(ckpt).iteration == 4


@pytest.mark.integration
def test_a_pretrained_checkpoint_starts_the_run_until_load_holds_its_own(tiny_data, tmp_path):
    """Megatron-LM's --pretrained-checkpoint: while --load holds no checkpoint the run starts from the pretrained
    one's weights at iteration 0, exactly as --load PRETRAINED --finetune does; relaunched (a requeue), it resumes
    its own checkpoint in --load instead. The written configuration keeps the flags as given."""
    from megatron_snip.training.checkpointing import read_record

    def losses(out: str) -> list[str]:
        return re.findall(r"iteration +\d+/ +\d+ \|.*?lm loss: ([\d.E+-]+)", out)

    pretrained, own, finetuned = (str(tmp_path / d) for d in ("pretrained", "own", "finetuned"))
    launch(1, train_args(tiny_data, "--save", pretrained, iters=2))
    flags = train_args(tiny_data, "--pretrained-checkpoint", pretrained, "--load", own, "--save", own, iters=4)
    first = launch(1, [*flags, "--exit-interval", "2"])
    assert (f"--load {own} holds no checkpoint: starting from the weights of --pretrained-checkpoint {pretrained} "
            f"(its iteration 2) at iteration 0") in first.stdout
    finetune = launch(1, train_args(tiny_data, "--load", pretrained, "--finetune", "--save", finetuned,
                                    "--exit-interval", "2", iters=4))
    assert losses(first.stdout) == losses(finetune.stdout) and len(losses(first.stdout)) == 2
    written = parse_config(["--yaml-cfg", os.path.join(own, "iter_0000002", "run_config.yaml")], world_size=1,
                           cuda=False).checkpoint
    assert (written.load, written.finetune, written.pretrained_checkpoint, written.resumes) == (
        own, False, pretrained, True)
    again = launch(1, flags)
    assert f"resumed from {own} at iteration 2" in again.stdout and "--pretrained-checkpoint" not in again.stdout
    assert read_record(own).iteration == 4
    with pytest.raises(ArgumentError, match=re.escape(f"--pretrained-checkpoint {str(tmp_path)!r} holds no "
                                                      f"checkpoint (no latest_checkpointed_iteration.txt), nor does "
                                                      f"--load {finetuned + 'x'!r}")):
        parse_config(train_args(tiny_data, "--pretrained-checkpoint", str(tmp_path), "--load", finetuned + "x",
                                "--save", finetuned + "x"), world_size=1, cuda=False)


def test_data_beyond_the_vocabulary_names_the_flags_that_gave_it(tiny_data):
    """The tokenizer-size error names what was given: --tokenizer-model, or NullTokenizer's --vocab-size (no
    --tokenizer-model then)."""
    with pytest.raises(ArgumentError) as e:
        parse_config(train_args(tiny_data, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"),
                     world_size=1, cuda=False)
    assert re.search(r"holds token id \d+, but --tokenizer-type NullTokenizer --vocab-size 100 has only 101 ids: "
                     r"the data was preprocessed with a different tokenizer; give --vocab-size", str(e.value))
    assert "--tokenizer-model" not in str(e.value)
