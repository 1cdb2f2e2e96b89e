"""A Megatron-LM Llama script's flags with Megatron-LM's meanings and defaults (docs/megatron_compat.md):
the architecture a script without a preset describes, tied embeddings, --mock-data with NullTokenizer,
the flags accepted or refused (one line naming the flag), checkpoint retention, and the example
script examples/megatron_compat/train_llama3_tiny.sh trained through torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, TINY_MEGATRON, free_port, launch, scalars, torchrun, torchrun_env, train_args

from megatron_snip.arguments import ArgumentError, parse_config


def parse(data, *extra, model=TINY_MEGATRON, world_size=1):
    return parse_config(train_args(data, *extra, model=model), world_size=world_size, cuda=False)


def refused(data, *extra, model=TINY_MEGATRON) -> str:
    """The one-line refusal of ``extra``."""
    with pytest.raises(ArgumentError) as e:
        parse(data, *extra, model=model)
    assert "\n" not in str(e.value)
    return str(e.value)


# -- the architecture --------------------------------------------------------------------------

def test_a_script_without_preset_gets_megatrons_architecture(tiny_data, tmp_path):
    model = parse(tiny_data).model
    assert model.model_preset == "megatron-flags"
    assert model.share_embeddings_and_output_weights and not model.untie_embeddings_and_output_weights
    assert (model.swiglu, model.disable_bias_linear, model.normalization, model.position_embedding_type) == (
        True, True, "RMSNorm", "rope")
    assert (model.rotary_base, model.norm_epsilon, model.num_query_groups) == (10000, 1e-5, 2)
    untied = parse(tiny_data, "--untie-embeddings-and-output-weights").model
    assert not untied.share_embeddings_and_output_weights
    # Megatron-LM's defaults: multi-head attention without --group-query-attention (1 group with it), and
    # SwiGLU's MLP width int(4 h 2/3 / 64) 64.
    bare = [f for f in TINY_MEGATRON if f not in ("--group-query-attention", "--num-query-groups", "2",
                                                  "--ffn-hidden-size", "192")]
    mha = parse(tiny_data, model=bare).model
    assert (mha.num_query_groups, mha.group_query_attention, mha.ffn_hidden_size) == (4, False, 128)
    assert parse(tiny_data, "--group-query-attention", model=bare).model.num_query_groups == 1
    # The written configuration reads back to the same model without a preset.
    config = parse(tiny_data)
    path = tmp_path / "run_config.yaml"
    path.write_text(config.to_yaml())
    assert parse_config(["--yaml-cfg", str(path)], world_size=1, cuda=False).to_flags() == config.to_flags()


def test_a_preset_states_its_own_architecture(tiny_data):
    model = parse(tiny_data, model=["--model-preset", "tiny"]).model
    assert not model.share_embeddings_and_output_weights  # every preset's model is untied
    assert (model.swiglu, model.disable_bias_linear, model.normalization) == (True, True, "RMSNorm")
    assert not parse(tiny_data, "--untie-embeddings-and-output-weights", "--swiglu",
                     model=["--model-preset", "tiny"]).model.share_embeddings_and_output_weights


def test_a_tied_checkpoint_refuses_untying():
    from argparse import Namespace

    from megatron_snip.arguments.architecture import resolve_architecture

    args = Namespace(model_preset="checkpoint", load="CKPT", share_embeddings_and_output_weights=True,
                     untie_embeddings_and_output_weights=True, use_rotary_position_embeddings=False,
                     num_attention_heads=4, num_query_groups=2, apply_layernorm_1p=None)
    with pytest.raises(ArgumentError, match=r"^--untie-embeddings-and-output-weights: the checkpoint in --load CKPT "
                                            r"ties the output layer to the embedding"):
        resolve_architecture(args)
    args.untie_embeddings_and_output_weights, args.share_embeddings_and_output_weights = None, None
    resolve_architecture(args)  # a checkpoint that does not say is untied
    assert (args.share_embeddings_and_output_weights, args.untie_embeddings_and_output_weights) == (False, True)


def _without(flags: list[str], *drop: str) -> list[str]:
    """TINY_MEGATRON without the flags ``drop`` (and a value that follows one)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in drop:
            skip = f in ("--normalization", "--position-embedding-type", "--num-layers")
        else:
            out.append(f)
    return out


@pytest.mark.parametrize("drop,message", [
    (("--swiglu",), "--swiglu is not given: Megatron-LM then builds a GELU MLP"),
    (("--disable-bias-linear",), "--disable-bias-linear is not given: Megatron-LM then adds biases"),
    (("--normalization",), "--normalization LayerNorm: this program builds RMSNorm only"),
    (("--position-embedding-type",), "--position-embedding-type learned_absolute: this program builds rotary"),
    (("--group-query-attention",), "--num-query-groups 2 without --group-query-attention: Megatron-LM then ignores"),
    (("--num-layers",), "--num-layers is required (as in Megatron-LM), or give --model-preset NAME"),
])
def test_what_cannot_be_built_is_refused(tiny_data, drop, message):
    assert refused(tiny_data, model=_without(TINY_MEGATRON, *drop)).startswith(message)


# -- flags accepted, implemented or refused ---------------------------------------------------------

def test_accepted_flags_take_megatrons_meaning(tiny_data):
    from megatron_snip.model.llama import transformer_config

    config = parse(tiny_data, "--use-mcore-models", "--use-flash-attn", "--no-rope-fusion", "--no-bias-swiglu-fusion",
                   "--no-gradient-accumulation-fusion", "--accumulate-allreduce-grads-in-fp32",
                   "--ckpt-fully-parallel-save", "--dataloader-type", "single", "--tiktoken-pattern", "v2",
                   "--no-create-attention-mask-in-dataloader", "--sequence-parallel", "--no-masked-softmax-fusion",
                   "--no-bias-dropout-fusion", "--attention-softmax-in-fp32", "--cross-entropy-loss-fusion",
                   "--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5", "--empty-unused-memory-level", "2",
                   "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                   model=[*_without(TINY_MEGATRON, "--position-embedding-type"),
                          "--use-rotary-position-embeddings", "--no-position-embedding"])
    assert not config.parallel.sequence_parallel  # at TP 1, as Megatron-LM does
    assert config.model.position_embedding_type == "rope"
    assert (config.training.decoupled_lr, config.training.decoupled_min_lr) == (5e-4, 4.5e-5)
    assert (config.checkpoint.ckpt_fully_parallel_save, config.checkpoint.ckpt_fully_parallel_load) == (False, True)
    te = transformer_config(config.model, config.parallel)
    assert (te.masked_softmax_fusion, te.bias_dropout_fusion, te.attention_softmax_in_fp32,
            te.cross_entropy_loss_fusion, te.apply_rope_fusion) == (False, False, True, True, False)
    for name in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):  # one SentencePiece model, read alike
        assert parse(tiny_data, "--tokenizer-type", name).data.tokenizer_type == name


@pytest.mark.parametrize("extra,message", [
    (("--fp16",), "--fp16: fp16 training needs loss scaling"),
    (("--calculate-per-token-loss", "--snip", "--snip-interval", "2"),
     "--calculate-per-token-loss with --snip: SNIP's probe passes measure each micro-batch's mean loss"),
    (("--use-torch-fsdp2",), "--use-torch-fsdp2: FSDP is not supported"),
    (("--use-megatron-fsdp",), "--use-megatron-fsdp: FSDP is not supported"),
    (("--profile", "--use-pytorch-profiler"), "--profile --use-pytorch-profiler writes its trace into "
                                              "--tensorboard-dir"),
    (("--profile", "--profile-step-start", "4", "--profile-step-end", "4"),
     "--profile-step-start 4 and --profile-step-end 4: profiling needs 0 <= start < end"),
    (("--dataloader-type", "cyclic"), "--dataloader-type cyclic: samples are read once per pass"),
    (("--no-create-attention-mask-in-dataloader", "--reset-attention-mask"),
     "--no-create-attention-mask-in-dataloader drops the mask --reset-attention-mask needs"),
    (("--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"),
     "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 contradict each other"),
    (("--tokenizer-type", "TikTokenizer"), "--tokenizer-type TikTokenizer is not supported: Llama 3's tiktoken"),
    (("--mock-data",), "--mock-data and --data-path: give one data source"),
    (("--tokenizer-type", "NullTokenizer"), "--tokenizer-type NullTokenizer needs --vocab-size N >= 1"),
    (("--vocab-size", "2048"), "--vocab-size 2048 differs from the 1024 ids of --tokenizer-model"),
    (("--save", "S", "--save-interval", "2", "--save-retain-interval", "3"),
     "--save-retain-interval 3 must be a positive multiple of --save-interval 2"),
    (("--save-retain-interval", "2"), "--save-retain-interval 2 needs --save DIR and --save-interval N"),
    (("--decoupled-min-lr", "1e-5"), "--decoupled-min-lr goes with --decoupled-lr"),
])
def test_refused_flags_say_why_in_one_line(tiny_data, extra, message):
    assert refused(tiny_data, *extra).startswith(message)


# -- mock data ------------------------------------------------------------------------------

def test_mock_data_is_megatron_cores_with_the_null_tokenizer(monkeypatch):
    """--mock-data --tokenizer-type NullTokenizer --vocab-size N: ids 0..N-1 and the end-of-document id N (Megatron-LM
    0.16.1's), megatron-core's MockGPTDataset split 1,1,1 whatever --split says, and the printed unigram
    entropy is the mock stream's."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    from megatron_snip.arguments import parse_args, resolve
    from megatron_snip.data.stats import entropy_from_counts, mock_unigram_entropy
    from megatron_snip.data.tokenizer import build_tokenizer
    from megatron_snip.training.data import build_datasets

    argv = [*TINY_MEGATRON, "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "300", "--split", "99,1,0"]
    config = resolve(parse_args(argv), world_size=1, cuda=False)  # no data or tokenizer file is needed
    tokenizer = build_tokenizer(config.data.tokenizer_type, config.data.tokenizer_model, config.model.vocab_size)
    assert (tokenizer.vocab_size, tokenizer.eod) == (301, 300)
    monkeypatch.setattr(MockGPTLowLevelDataset, "size", 500)  # fewer documents: the count below reads them all
    data = build_datasets(config.data, tokenizer, seq_length=64, seed=1, num_samples=(8, 4, 4))
    assert data.valid is not None and len(data.train) >= 8
    assert max(int(data.train[i]["tokens"].max()) for i in range(8)) <= 300
    docs = MockGPTLowLevelDataset(tokenizer)
    ids = np.concatenate([docs[i] for i in range(len(docs))])
    assert ids.max() == 300 and all(docs[i][-1] == 300 for i in range(len(docs)))  # each document ends in eod
    counts = np.bincount(ids)
    assert data.unigram_entropy == mock_unigram_entropy(tokenizer) == pytest.approx(entropy_from_counts(counts),
                                                                                    rel=1e-12)


# -- checkpoint retention ---------------------------------------------------------------------

def _checkpoints(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))


def test_retention_deletes_only_the_replaced_checkpoint_off_the_interval(tmp_path):
    """Megatron-LM's rule, checked on directories: the checkpoint the tracker named before the newest is
    deleted unless it is 0, divisible by the interval, not older than the newest, or a link; an interrupted
    deletion (iter_N.deleting) is finished by the next one."""
    from megatron_snip.training.checkpointing import iteration_dir, retire

    for it in (0, 2, 3, 4, 5, 9):
        os.makedirs(iteration_dir(str(tmp_path), it))
    os.symlink(iteration_dir(str(tmp_path), 9), iteration_dir(str(tmp_path), 7))
    os.makedirs(tmp_path / "iter_0000001.deleting")
    root = str(tmp_path)
    assert retire(root, 0, 2, retain_interval=2) is None
    assert retire(root, 2, 3, retain_interval=2) is None  # a multiple
    assert retire(root, 9, 5, retain_interval=2) is None  # newer than the checkpoint just saved
    assert retire(root, 7, 8, retain_interval=2) is None  # a symbolic link
    assert retire(root, None, 4, retain_interval=2) is None
    assert retire(root, 3, 4, retain_interval=2) == iteration_dir(root, 3)
    assert _checkpoints(tmp_path) == ["iter_0000000", "iter_0000002", "iter_0000004", "iter_0000005",
                                      "iter_0000007", "iter_0000009"]


# -- Megatron-LM's FP8 flags --------------------------------------------------------------------

# The precision flags of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh.
LLAMA3_8B_FP8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max")
FP8_NOTICE = ("--fp8-amax-history-len 1024 --fp8-amax-compute-algo max: delayed-scaling settings that do nothing here; "
              "FP8 runs --fp8-recipe tensorwise (this program's default): each tensor scaled by its own current amax, "
              "no history; add --fp8-recipe delayed for Megatron-LM's delayed scaling with them (its default recipe)")
GATHER_NOTICE = ("--fp8-param-gather: parameters stay in their own dtype here and each FP8 GEMM quantizes its weight, "
                 "the values an FP8 parameter would hold; the memory and all-gather savings need Transformer Engine's "
                 "FP8 parameters, which this program does not use")
PROFILE_NOTICE = ("--profile without --use-pytorch-profiler marks an nsys capture range (cudaProfilerStart/Stop), "
                  "which needs CUDA: nothing is profiled here; add --use-pytorch-profiler for a torch.profiler trace")


def test_the_8b_scripts_fp8_flags_say_which_recipe_runs(tiny_data):
    """Megatron-LM's 8B FP8 flags mean delayed scaling there (its --fp8-recipe defaults to delayed); here FP8
    runs this program's default, tensorwise, and one start-up line says so and how to get Megatron-LM's."""
    config = parse(tiny_data, *LLAMA3_8B_FP8, "--fp8-param-gather")
    p = config.precision
    assert (p.precision, p.fp8_recipe, p.fp8_format) == ("fp8", "tensorwise", "hybrid")
    assert config.logging.notices == (GATHER_NOTICE, FP8_NOTICE)
    delayed = parse(tiny_data, *LLAMA3_8B_FP8, "--fp8-recipe", "delayed").precision.recipe()
    assert (delayed.fp8_recipe, delayed.fp8_amax_history_len, delayed.fp8_amax_compute_algo) == ("delayed", 1024, "max")
    assert parse(tiny_data, *LLAMA3_8B_FP8, "--fp8-recipe", "delayed").logging.notices == ()
    assert parse(tiny_data, "--fp8-format", "e4m3").logging.notices[0].startswith(
        "--fp8-format e4m3 without --fp8-recipe: FP8 runs --fp8-recipe tensorwise (this program's default)")
    assert parse(tiny_data, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise").logging.notices == ()


@pytest.mark.integration
@pytest.mark.parametrize("extra, scaling", [
    ((), {}),  # tensorwise: no module keeps an amax history
    (("--fp8-recipe", "delayed"), {"x": [1024, "max"], "w": [1024, "max"], "dy": [1024, "max"]}),
])
def test_the_8b_scripts_fp8_flags_train_the_recipe_they_report(tiny_data, extra, scaling):
    """What the GEMMs of every module kept after two FP8 iterations of the 8B script's precision flags."""
    proc = launch(1, train_args(tiny_data, *LLAMA3_8B_FP8, *extra, iters=2, model=TINY_MEGATRON),
                  script="tests/drivers/fp8_scaling.py")
    (line,) = re.findall(r"^FP8-SCALING (.*)$", proc.stdout, re.M)
    kept = json.loads(line)
    assert len(kept) == 16 and all(state == scaling for state in kept.values()), kept


# -- Megatron-LM flags megatron-core implements without Transformer Engine ------------------------

@pytest.mark.integration
def test_per_token_loss_zero_centred_norms_and_the_profiler_keep_training_as_megatron_does(tiny_data, tmp_path):
    """At DP2 with 2 micro-batches per rank and no --eod-mask-loss, every micro-batch has as many loss tokens, so
    --calculate-per-token-loss (sum over the global batch's tokens / their count) trains as the mean of micro-batch
    means; --apply-layernorm-1p (scale stored as scale - 1) as the plain norms, up to fp32 rounding. --profile
    --use-pytorch-profiler writes rank 0's torch.profiler trace of iterations 2..3 into --tensorboard-dir."""
    from megatron_snip.training import tags

    def run(name, *extra):
        tb = tmp_path / name
        launch(2, train_args(tiny_data, "--tensorboard-dir", str(tb), *extra, iters=5))
        return tb, scalars(tb, tags.LM_LOSS)

    _, plain = run("plain")
    tb, megatron = run("megatron", "--calculate-per-token-loss", "--apply-layernorm-1p", "--profile",
                       "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4")
    assert sorted(plain) == sorted(megatron) == [1, 2, 3, 4, 5]
    assert plain[5] < plain[1]
    assert all(megatron[i] == pytest.approx(plain[i], rel=1e-5) for i in plain), (plain, megatron)
    (trace,) = tb.glob("*.pt.trace.json")  # one rank (--profile-ranks 0), one window
    steps = set(re.findall(r'"ProfilerStep#(\d+)"', trace.read_text()))
    assert steps == {"2", "3"}


def test_a_global_batch_loss_per_token_weighs_every_token_alike():
    import torch

    from megatron_snip.model.step import step_loss

    per_micro_batch = torch.tensor([[6.0, 2.0], [3.0, 6.0]])  # (sum, count) of two micro-batches
    assert step_loss(per_micro_batch).item() == pytest.approx(9.0 / 8.0)  # not (3.0 + 0.5) / 2
    assert step_loss(torch.tensor([3.0, 0.5])).item() == pytest.approx(1.75)


def test_zero_centred_norms_store_scale_minus_one_and_megatron_core_gets_both_switches():
    import torch
    from conftest import run_config

    from megatron_snip.model.llama import transformer_config
    from megatron_snip.model.norms import TorchNorm

    run = run_config("--apply-layernorm-1p", "--calculate-per-token-loss")
    config = transformer_config(run.model, run.parallel)
    assert config.layernorm_zero_centered_gamma and config.calculate_per_token_loss  # megatron-core's switches
    norm, plain = TorchNorm(config, 8, eps=1e-5), torch.nn.RMSNorm(8, eps=1e-5)
    assert torch.equal(norm.weight, torch.zeros(8))
    x = torch.randn(3, 8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        plain.weight.copy_(norm.weight + 1)
    assert torch.allclose(norm(x), plain(x), rtol=1e-6, atol=1e-7)


def test_a_checkpoint_decides_whether_its_norms_are_zero_centred():
    """Norm weights mean the scale, or the scale - 1 with --apply-layernorm-1p: a checkpoint keeps its meaning, and
    one that does not say (older, or imported from Hugging Face) stores the scale."""
    from megatron_snip.arguments import parse_args
    from megatron_snip.arguments.checkpoint import fill_from_checkpoint

    def filled(argv, saved):
        args = parse_args(["--train-iters", "1", *argv])
        fill_from_checkpoint(args, saved, "CKPT")
        return args.apply_layernorm_1p

    assert filled([], {"apply_layernorm_1p": True}) is True
    assert filled([], {}) is False
    with pytest.raises(ValueError, match=r"^--apply-layernorm-1p True disagrees with the checkpoint in CKPT, which "
                                         r"has False; drop --apply-layernorm-1p"):
        filled(["--apply-layernorm-1p"], {})


# -- every problem at once -------------------------------------------------------------------

FIVE_PROBLEMS = ("--fp16", "--use-torch-fsdp2", "--hierarchical-context-parallel-sizes", "2", "--lr", "1e-4",
                 "--min-lr", "1e-3", "--tokenizer-type", "TikTokenizer")
FIVE_MESSAGES = ("--fp16: fp16 training needs loss scaling", "--use-torch-fsdp2: FSDP is not supported",
                 "--min-lr 0.001 exceeds --lr 0.0001",
                 "--hierarchical-context-parallel-sizes 2: their product 2 is not --context-parallel-size 1",
                 "--tokenizer-type TikTokenizer is not supported")


def test_every_problem_of_the_flags_is_reported_at_once(tiny_data):
    with pytest.raises(ArgumentError) as e:
        parse(tiny_data, *FIVE_PROBLEMS)
    assert len(e.value.problems) == 5 and str(e.value) == "\n".join(e.value.problems)
    assert [p for p, m in zip(e.value.problems, FIVE_MESSAGES) if not p.startswith(m)] == []


@pytest.mark.integration
def test_a_launch_with_five_problems_prints_them_once_and_asks_for_no_requeue(tiny_data, tmp_path):
    """Two ranks under torchrun: rank 0 prints the five problems in one message; pretrain_llama.py exits 78 and
    leaves an exit record that the requeue decision reads as a configuration error."""
    from megatron_snip.training import requeue

    save = tmp_path / "ckpt"
    save.mkdir()
    launched = time.time()
    proc = torchrun(2, train_args(tiny_data, *FIVE_PROBLEMS, "--save", str(save), model=TINY_MEGATRON), check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("pretrain_llama.py: error: 5 problems with the flags, files or launch:") == 1
    for message in FIVE_MESSAGES:
        assert proc.stderr.count(f"\n  - {message}") == 1, proc.stderr[-3000:]
    assert "exitcode: 78" in proc.stderr
    assert requeue.decide(requeue.read_record(str(save)), since=launched - 1)[0] == "config"
    direct = subprocess.run([sys.executable, str(ROOT / "pretrain_llama.py"), *train_args(tiny_data, "--fp16")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert direct.returncode == requeue.CONFIG_ERROR_STATUS and direct.stderr.count("error:") == 1


# -- the example script ------------------------------------------------------------------------

SCRIPT = ROOT / "examples" / "megatron_compat" / "train_llama3_tiny.sh"


@pytest.mark.integration
def test_the_megatron_lm_example_script_trains_on_mock_data(tmp_path):
    """Megatron-LM's Llama 3 script (its flags, tiny sizes) runs unchanged through torchrun: 4 iterations of
    FP8 on mock data at DP2 with the distributed optimizer, saving every iteration and keeping the newest and
    every 2nd (--save-retain-interval 2)."""
    from megatron_snip.training.checkpointing import read_record

    ckpt = tmp_path / "ckpt"
    env = torchrun_env({"MASTER_PORT": str(free_port()), "OUT": str(tmp_path),
                        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
                        # torch.compile of megatron-core's fused cross entropy takes ~1 min on a CPU; eager
                        # runs the same function.
                        "TORCHDYNAMO_DISABLE": "1"})
    proc = subprocess.run(["bash", str(SCRIPT), str(ckpt), str(tmp_path / "tb")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"\[train\] iteration +\d+/ +\d+ \| .*?lm loss: ([\d.E+-]+)", proc.stdout)]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert "megatron-flags shape" in proc.stdout and "DP=2" in proc.stdout and "100.0% in FP8" in proc.stdout
    # The recipe that trains is said once, with what Megatron-LM would have run and how to get it.
    assert "fp8 recipe tensorwise/hybrid" in proc.stdout
    notices = re.findall(r"^notice: (.*)$", proc.stdout, re.M)
    assert notices == [GATHER_NOTICE, PROFILE_NOTICE, FP8_NOTICE], notices
    assert _checkpoints(ckpt) == ["iter_0000002", "iter_0000004"]
    saved = read_record(str(ckpt)).args
    assert (saved["mock_data"], saved["tokenizer_type"], saved["vocab_size"]) == (True, "NullTokenizer", 4096)
    assert not saved["share_embeddings_and_output_weights"] and saved["decoupled_lr"] == 5e-4
