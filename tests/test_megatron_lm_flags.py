"""Every option of Megatron-LM 0.16.1 gets one answer (docs/megatron_compat.md): implemented with Megatron-LM's
meaning and default, accepted, accepted with a start-up notice, or refused (by itself or with its family) in the
one combined message; a flag error is one line naming the flag and what would be right."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TINY_MEGATRON, TINY_MODEL, in_world_of_one, run_config

from megatron_snip.arguments import ArgumentError, build_parser, parse_args, resolve
from megatron_snip.arguments.megatron_lm import DIFFERENT_DEFAULTS, FILLED_DEFAULTS
from megatron_snip.arguments.megatron_lm_families import (
    ACCEPTED,
    ACCEPTED_VALUES,
    FAMILIES,
    GIVEN,
    MEGATRON_LM_OPTIONS,
    NOTICED,
    REFUSED,
    Given,
)


def _ours() -> dict:
    """This program's own flags (option string -> argparse action)."""
    return {s: a for a in build_parser()._actions if not isinstance(a, Given) for s in a.option_strings}


def _answers(option, ours) -> list[str]:
    implemented = ["implemented"] if option.spellings[0] in ours else []
    tables = [name for name, table in (("accepted", ACCEPTED), ("noticed", NOTICED), ("refused", REFUSED))
              if option.dest in table]
    return implemented + tables + [f"family {f.name}" for f in FAMILIES if f.holds(option)]


def test_the_option_list_is_megatron_lms_parser():
    """651 options, 680 spellings: tools/list_megatron_lm_options.py's count of Megatron-LM 0.16.1's parser."""
    assert len(MEGATRON_LM_OPTIONS) == 651
    assert sum(len(o.spellings) for o in MEGATRON_LM_OPTIONS) == 680
    assert {"--no-persist-layer-norm", "--use-dist-ckpt", "--local-rank", "--moe-router-topk"} <= {
        s for o in MEGATRON_LM_OPTIONS for s in o.spellings}


def test_every_megatron_lm_option_is_answered_exactly_once():
    """Each option: all its spellings a flag here (implemented) or none, and exactly one rule answering it; every
    rule names options Megatron-LM has."""
    ours = _ours()
    kinds: dict[str, int] = {}
    for option in MEGATRON_LM_OPTIONS:
        assert len({s in ours for s in option.spellings}) == 1, f"only some spellings of {option.spellings} are ours"
        answers = _answers(option, ours)
        assert len(answers) == 1, (option.spellings, answers)
        kind = answers[0].split()[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"\nMegatron-LM's {len(MEGATRON_LM_OPTIONS)} options: {kinds}")
    dests, groups = {o.dest for o in MEGATRON_LM_OPTIONS}, {o.group for o in MEGATRON_LM_OPTIONS}
    assert set(ACCEPTED) | set(NOTICED) | set(REFUSED) <= dests
    for family in FAMILIES:
        assert set(family.dests) <= dests and set(family.groups) <= groups, family.name
        assert all(any(d.startswith(p) for d in dests) for p in family.prefixes), family.name
    # values accepted only for options that are not accepted whatever their value
    by_dest = {o.dest: o for o in MEGATRON_LM_OPTIONS}
    assert all(_answers(by_dest[d], ours)[0] in ("noticed", "refused") or _answers(by_dest[d], ours)[0].startswith(
        "family") for d in ACCEPTED_VALUES)


def test_every_spelling_parses_with_its_values():
    """The options answered at start-up are parsed with as many values as Megatron-LM's parser takes (a refused
    one is reported with the others, not as a syntax error), each under its option."""
    ours, argv, last = _ours(), ["--train-iters", "1"], {}
    for option in MEGATRON_LM_OPTIONS:
        if option.spellings[0] in ours:
            continue
        values = [] if option.nargs == 0 else ["1"] * (option.nargs if isinstance(option.nargs, int) else 1)
        for spelling in option.spellings:
            argv += [spelling, *values]
            last[option.dest] = spelling
    given = getattr(parse_args(argv), GIVEN)
    assert {dest: shown.split()[0] for dest, (_, shown, _) in given.items()} == last


def test_answers_of_each_kind():
    """Accepted: nothing said. Noticed: one line each. A Megatron-LM default value or an accepted value: nothing.
    Refused: every refusal of the launch in one error, a family's naming the family."""
    quiet = run_config("--no-persist-layer-norm", "--use-flash-attn", "--expert-model-parallel-size", "1",
                       "--recompute-modules", "core_attn", "--exit-signal", "SIGUSR1", "--no-tp-comm-bulk-wgrad",
                       "--rerun-mode", "disabled").logging.notices
    assert quiet == ()
    notices = run_config("--async-save", "--initial-loss-scale", "65536", "--use-dist-ckpt",
                         "--log-energy").logging.notices
    assert [n.split(":")[0] for n in notices] == ["--async-save", "--initial-loss-scale 65536", "--use-dist-ckpt",
                                                  "--log-energy"]
    assert "deprecated in Megatron-LM and without effect there and here" in notices[2]
    with pytest.raises(ArgumentError) as e:
        run_config("--moe-router-topk", "3", "--fp16", "--exit-signal", "SIGINT", "--recompute-modules", "mlp",
                   "--num-experts", "8", "--use-precision-aware-optimizer", "--exp-avg-dtype", "fp32")
    assert [p.split(":")[0] for p in e.value.problems] == [
        "--moe-router-topk 3", "--fp16", "--exit-signal SIGINT", "--recompute-modules mlp", "--num-experts 8",
        "--use-precision-aware-optimizer"]
    assert e.value.problems[0].endswith("drop Megatron-LM's mixture of experts flags")
    assert "TransformerEngine" not in e.value.problems[-1] and "FusedAdam" in e.value.problems[-1]


def test_a_yaml_file_with_megatron_lms_other_options_is_answered_as_the_command_line(tmp_path):
    path = tmp_path / "megatron.yaml"
    path.write_text("language_model:\n  num_layers: 4\n  moe_router_topk: 3\n  no_persist_layer_norm: true\n"
                    "  perform_initialization: true\n")
    with pytest.raises(ArgumentError, match=r"^--moe-router-topk 3: mixture-of-experts layers are not built here"):
        resolve(parse_args(["--yaml-cfg", str(path), *TINY_MODEL, "--train-iters", "1"]), world_size=1, cuda=False,
                check_files=False)
    path.write_text("no_persist_layer_norm: true\nperform_initialization: false\n")
    notices = resolve(parse_args(["--yaml-cfg", str(path), *TINY_MODEL, "--train-iters", "1"]), world_size=1,
                      cuda=False, check_files=False).logging.notices
    assert [n.split(":")[0] for n in notices] == ["--no-initialization"]


@pytest.mark.parametrize("argv,message", [
    (["--lr", "x"], "--lr 'x': expected a number"),
    (["--seed", "1.5"], "--seed '1.5': expected a whole number"),
    (["--lr"], "--lr needs a value: --lr VALUE"),
    (["--lr-decay-style", "cosin"], "--lr-decay-style 'cosin': expected one of 'constant', 'linear', 'cosine', "
                                    "'inverse-square-root', 'WSD'"),
    (["--bf16=yes"], "--bf16 takes no value (a switch); drop =yes"),
    (["--profile-ranks"], "--profile-ranks needs one or more values: --profile-ranks VALUE [VALUE ...]"),
    (["--hierarchical-context-parallel-sizes"], "--hierarchical-context-parallel-sizes needs one or more values"),
    (["--num-layerz", "4", "--tensor-model-paralel-size", "2"],
     "--num-layerz: no such flag of pretrain_llama.py or Megatron-LM; did you mean --num-layers?\n"
     "--tensor-model-paralel-size: no such flag of pretrain_llama.py or Megatron-LM; did you mean "
     "--tensor-model-parallel-size?"),
    (["--no-such-thing"], "--no-such-thing: no such flag of pretrain_llama.py or Megatron-LM (python "
                          "pretrain_llama.py --help lists them)"),
    (["stray"], "'stray': a value without a flag (flags start with --)"),
])
def test_flag_errors_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(ArgumentError) as e:
        parse_args(argv)
    assert str(e.value).startswith(message)
    assert len(e.value.problems) == message.count("\n") + 1


def _megatron_default(option):
    default = option.default
    return list(default) if isinstance(default, tuple) else default


def test_shared_flags_have_megatron_lms_defaults():
    """Every flag both programs have: Megatron-LM's default, or None filled by validation (the next test), or a
    difference docs/megatron_compat.md gives the reason for (and no stale entry in either list)."""
    ours = _ours()
    for option in MEGATRON_LM_OPTIONS:
        action = ours.get(option.spellings[0])
        if action is None:
            continue
        default = list(action.default) if isinstance(action.default, tuple) else action.default
        megatron = _megatron_default(option)
        if default == megatron or (option.nargs == 0 and {default, megatron} <= {None, False}):
            assert action.dest not in DIFFERENT_DEFAULTS, action.dest  # no stale entry
        elif action.dest not in DIFFERENT_DEFAULTS:
            assert default is None and action.dest in FILLED_DEFAULTS, (action.dest, default, megatron)
    flags = {a.dest: a for a in ours.values()}
    assert all(flags[dest].default is None for dest in FILLED_DEFAULTS)
    assert set(DIFFERENT_DEFAULTS) <= set(flags)


def test_defaults_filled_by_validation_are_megatron_lms():
    """A launch that states its architecture with Megatron-LM's flags (no preset, no checkpoint) and leaves the
    rest to the defaults resolves to Megatron-LM's default of every flag filled at validation (those that depend
    on the machine aside: the backend, the data-loader workers, the local rank)."""
    argv = TINY_MEGATRON[:TINY_MEGATRON.index("--attention-dropout")]  # dropout left to its default too
    config = resolve(parse_args([*argv, "--train-iters", "1"]), world_size=1, cuda=False, check_files=False)
    values, ours = config.to_flags(), _ours()
    given = {s for s in argv if s.startswith("--")}
    checked = 0
    for option in MEGATRON_LM_OPTIONS:
        action = ours.get(option.spellings[0])
        if action is None or action.dest not in FILLED_DEFAULTS or option.spellings[0] in given:
            continue
        if action.dest in ("distributed_backend", "num_workers", "local_rank"):
            continue
        want = _megatron_default(option)
        if option.action == "store_false":  # Megatron-LM's dest is the negation of the flag here
            want = not want
        assert values[action.dest] == want, action.dest
        checked += 1
    assert checked >= 12
    assert run_config().model.hidden_dropout == 0.0  # a preset is a Llama, which trains without dropout


@pytest.mark.parametrize("extra,world,message", [
    (("--decoder-first-pipeline-num-layers", "1"), 1, "--decoder-first-pipeline-num-layers and "
     "--decoder-last-pipeline-num-layers need --pipeline-model-parallel-size > 1"),
    (("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
      "--decoder-last-pipeline-num-layers", "3"), 2, "--num-layers 4 leaves -1 layers after "
     "--decoder-first-pipeline-num-layers 2 + --decoder-last-pipeline-num-layers 3 for 0 other pipeline stages"),
    (("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "1"), 2,
     "--decoder-first-pipeline-num-layers 1 is not divisible by --num-virtual-stages-per-pipeline-rank 2"),
    (("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--decoder-last-pipeline-num-layers", "2"), 2, "with uneven stages (--decoder-first/last-pipeline-num-layers) "
     "give the interleaved schedule as --num-virtual-stages-per-pipeline-rank"),
    (("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"), 2,
     "--decoder-first-pipeline-num-layers with --decoder-last-pipeline-num-layers at --pipeline-model-parallel-size 2 "
     "and --num-virtual-stages-per-pipeline-rank 2 fails in megatron-core"),
    (("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--no-overlap-p2p-communication"), 2, "--no-overlap-p2p-communication batches the interleaved schedule's "
     "messages, which needs --pipeline-model-parallel-size > 2"),
    (("--ddp-bucket-size", "100", "--ddp-num-buckets", "2"), 1, "give --ddp-bucket-size or --ddp-num-buckets"),
    (("--ddp-average-in-collective",), 1, "--ddp-average-in-collective averages with ReduceOp.AVG, which NCCL has"),
    (("--deterministic-mode", "--cross-entropy-loss-fusion"), 1, "--deterministic-mode with "
     "--cross-entropy-loss-fusion: the fused cross entropy is not deterministic"),
    (("--use-distributed-optimizer", "--overlap-param-gather"), 1, "--overlap-param-gather needs "
     "--overlap-grad-reduce"),
    (("--split", "90,10,0", "--train-data-path", "A"), 1, "--split 90,10,0 divides --data-path's documents; "
     "with --train-data-path each split has its own data"),
    (("--data-path", "A", "--train-data-path", "A"), 1, "--data-path and --train-data-path: give one data source"),
    (("--encoder-seq-length", "32"), 1, "--encoder-seq-length 32 and --seq-length 64 disagree"),
])
def test_layout_data_and_ddp_flags_are_checked_as_megatron_lm_checks_them(extra, world, message):
    with pytest.raises(ArgumentError) as e:
        run_config(*extra, world_size=world)
    assert any(p.startswith(message) for p in e.value.problems), e.value.problems


def test_pipeline_ddp_and_data_flags_reach_megatron_core():
    """The flags become megatron-core's settings as Megatron-LM makes them."""
    from megatron_snip.model.llama import transformer_config
    from megatron_snip.training.setup import ddp_config

    uneven = run_config("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
                        "--decoder-last-pipeline-num-layers", "3", "--deterministic-mode", world_size=2)
    core = transformer_config(uneven.model, uneven.parallel)
    assert (core.num_layers_in_first_pipeline_stage, core.num_layers_in_last_pipeline_stage) == (1, 3)
    assert core.deterministic_mode and not core.overlap_p2p_comm and core.batch_p2p_comm
    interleaved = run_config("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                             "--global-batch-size", "8", world_size=2)
    assert interleaved.parallel.virtual_pipeline_model_parallel_size == 2
    # over gloo at PP 2 the messages are neither overlapped nor batched (said at start-up); over NCCL overlapped
    assert "not overlapped" in interleaved.logging.notices[0]
    core = transformer_config(interleaved.model, interleaved.parallel)
    assert (core.overlap_p2p_comm, core.batch_p2p_comm) == (False, False)
    nccl = dataclasses.replace(interleaved.parallel, distributed_backend="nccl")
    assert (transformer_config(interleaved.model, nccl).overlap_p2p_comm,
            transformer_config(interleaved.model, nccl).batch_p2p_comm) == (True, False)
    ddp = run_config("--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-num-buckets", "4",
                     "--ddp-pad-buckets-for-high-nccl-busbw", "--ddp-reduce-scatter-with-fp32-accumulation",
                     "--check-for-large-grads", world_size=2)
    settings = ddp_config(ddp.parallel, 1000, ddp.safety.check_for_large_grads)
    assert (settings.bucket_size, settings.pad_buckets_for_high_nccl_busbw,
            settings.reduce_scatter_with_fp32_accumulation, settings.check_for_large_grads) == (250, True, True, True)
    assert not settings.align_param_gather  # Megatron-LM's rule without the interleaved schedule
    assert ddp_config(run_config("--ddp-bucket-size", "77").parallel, 1000).bucket_size == 77
    data = run_config("--train-data-path", "A", "--test-data-path", "B").data
    assert (data.train_data_path, data.valid_data_path, data.test_data_path, data.split) == (("A",), None, ("B",), None)
    assert run_config("--train-data-path", "A").logging.eval_iters == 0  # no validation data: no evaluation
    assert run_config("--data-path", "A").data.split == "969,30,1"
    assert run_config("--encoder-seq-length", "64").model.seq_length == 64
    assert run_config("--optimizer", "sgd", "--sgd-momentum", "0.5").training.sgd_momentum == 0.5
    samples = resolve(parse_args([*TINY_MODEL, "--train-samples", "16", "--lr-wsd-decay-samples", "8",
                                  "--lr-decay-style", "WSD"]), world_size=1, cuda=False, check_files=False).training
    assert (samples.global_batch_size, samples.train_iters, samples.lr_wsd_decay_samples) == (4, 4, 8)


def test_data_paths_come_from_files_as_megatron_lm_reads_them(tmp_path):
    """--data-args-path: a text file holding --data-path's value; --per-split-data-args-path: a JSON file with the
    per-split paths (a list, or one string split at whitespace; empty: no such split). The written configuration
    leaves the paths to the files; a second source, an unreadable or malformed file is named."""
    import json

    import yaml

    blend = tmp_path / "blend.txt"
    blend.write_text("0.7 /data/a_text_document\n0.3 /data/b_text_document\n")
    config = run_config("--data-args-path", str(blend))
    assert config.data.data_path == ("0.7", "/data/a_text_document", "0.3", "/data/b_text_document")
    assert config.data.split == "969,30,1"  # as with --data-path
    written = yaml.safe_load(config.to_yaml())["data"]
    assert "data_path" not in written and written["data_args_path"] == str(blend)
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": "1 A 2 B", "valid": ["C"], "test": []}))
    data = run_config("--per-split-data-args-path", str(splits)).data
    assert (data.train_data_path, data.valid_data_path, data.test_data_path, data.split) == (
        ("1", "A", "2", "B"), ("C",), None, None)
    (tmp_path / "bad.json").write_text(json.dumps({"train": ["A"]}))
    for flags, message in (
            (("--data-path", "A", "--data-args-path", str(blend)), "--data-path and --data-args-path: give one"),
            (("--data-args-path", str(tmp_path / "none.txt")), f"--data-args-path {tmp_path / 'none.txt'}: cannot "
                                                                 f"be read (No such file or directory)"),
            (("--train-data-path", "A", "--per-split-data-args-path", str(splits)),
             "--train-data-path and --per-split-data-args-path: give one"),
            (("--per-split-data-args-path", str(tmp_path / "bad.json")), f"--per-split-data-args-path "
             f"{tmp_path / 'bad.json'}: expected a JSON object with the keys train, valid and test")):
        with pytest.raises(ArgumentError) as e:
            run_config(*flags)
        assert any(p.startswith(message) for p in e.value.problems), e.value.problems


def test_local_rank_is_the_launchers(monkeypatch):
    """torch.distributed.launch passes --local-rank (and sets $LOCAL_RANK): they must agree; the GPU follows it."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_config("--local-rank", "1").parallel.tensor_model_parallel_size == 1
    with pytest.raises(ArgumentError, match=r"^--local-rank 0 differs from \$LOCAL_RANK 1, which the launcher set"):
        run_config("--local-rank", "0")


def _initial_stds(flags: tuple[str, ...]) -> tuple[float, float]:
    """The standard deviations of a freshly built model's input embedding and first qkv weight."""
    from megatron_snip.model.llama import build_model, transformer_config

    config = run_config(*flags)
    (chunk,) = build_model(config.model, config.parallel, transformer_config(config.model, config.parallel), 1000)
    return (chunk.embedding.word_embeddings.weight.std().item(),
            chunk.decoder.layers[0].self_attention.linear_qkv.weight.std().item())


@pytest.mark.integration
def test_the_embedding_has_its_own_initialisation_as_megatron_lm_gives_it(tmp_path):
    """--embedding-init-method-std: the input embedding's standard deviation (others keep --init-method-std);
    without it the embedding takes --init-method-std, as in Megatron-LM."""
    embedding, linear = in_world_of_one(_initial_stds, ("--init-method-std", "0.01", "--embedding-init-method-std",
                                                         "0.5"), tmp_path=tmp_path)
    assert embedding == pytest.approx(0.5, rel=0.03) and linear == pytest.approx(0.01, rel=0.03)
    embedding, _ = in_world_of_one(_initial_stds, ("--init-method-std", "0.01"), tmp_path=tmp_path)
    assert embedding == pytest.approx(0.01, rel=0.03)


def test_cpu_initialization_on_a_gpu_is_the_flags(monkeypatch):
    """Without CUDA weights are always initialised on the CPU (TP-invariant); with CUDA only with the flag."""
    from megatron_snip.model import llama

    monkeypatch.setattr(llama, "has_cuda", lambda: True)  # only the config is built: no GPU is touched
    off = ("--no-gradient-accumulation-fusion", "--no-rope-fusion")
    assert not llama.transformer_config(run_config(*off).model, run_config(*off).parallel).use_cpu_initialization
    on = run_config(*off, "--use-cpu-initialization")
    assert llama.transformer_config(on.model, on.parallel).use_cpu_initialization
