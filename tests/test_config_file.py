"""One source of truth: the command line is generated from the configuration sections, and
``--yaml-cfg`` reads what a run writes beside its checkpoints back into the same configuration."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import train_args

from megatron_snip.arguments import ArgumentError, build_parser, parse_args, parse_config
from megatron_snip.arguments.megatron_lm import MegatronLMFlags
from megatron_snip.arguments.megatron_lm_families import GIVEN
from megatron_snip.flags import dest_of, flag_fields, option_of
from megatron_snip.training.config import SECTIONS


def _sections():
    return [*SECTIONS.values(), MegatronLMFlags]


def test_every_flag_field_is_one_flag_with_its_default():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    dests = [dest_of(f) for cls in _sections() for f in flag_fields(cls)]
    assert len(dests) == len(set(dests)), "two fields claim one flag"
    assert set(actions) == {*dests, "help", "yaml_cfg", GIVEN}  # GIVEN: Megatron-LM's other options
    empty = vars(parse_args([]))
    for cls in _sections():
        for f in flag_fields(cls):
            assert option_of(f) in actions[dest_of(f)].option_strings
            assert empty[dest_of(f)] == f.default, f.name


def test_derived_fields_are_not_flags():
    derived = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls) if not f.metadata.get("flag")}
    assert {"data_parallel_size", "num_microbatches", "precision_notes", "padded_vocab_size"} <= derived
    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert not {"--data-parallel-size", "--num-microbatches", "--precision-notes"} & options


def _roundtrip(tmp_path, config, world_size, *extra):
    path = tmp_path / "run_config.yaml"
    path.write_text(config.to_yaml("a header line"))
    return parse_config(["--yaml-cfg", str(path), *extra], world_size=world_size, cuda=False)


# Flags whose presence implies others (Megatron-LM's switches), or that validation rewrites.
@pytest.mark.parametrize("flags", [
    ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--num-layers-per-virtual-pipeline-stage", "1", "--snip", "--snip-interval", "2", "--fp4-recipe", "mxfp4",
     "--precision-schedule", "fwd=bf16@0.9",
     "--lr-warmup-fraction", "0.5", "--nvfp4-disable-rht", "--no-quant-health", "--data-path", "1", "PREFIX"),
    ("--fp4-format", "e2m1", "--recompute-activations"),
    ("--fp8-format", "e4m3"),
    ("--precision", "nvfp4", "--fp8-recipe", "delayed"),
])
def test_the_written_configuration_reads_back_to_the_same_run(tiny_data, tmp_path, flags):
    flags = [tiny_data.prefix if f == "PREFIX" else f for f in flags]
    world = 4 if "--tensor-model-parallel-size" in flags else 1
    config = parse_config(train_args(tiny_data, *flags), world_size=world, cuda=False)
    text = config.to_yaml("a header line")
    assert text.startswith("# a header line\n") and "\nsnip:\n  snip: " in text
    again = _roundtrip(tmp_path, config, world)
    # Start-up notices depend on which flags were given (the file gives every recipe flag), nothing else does.
    assert {**again.to_flags(), "notices": None} == {**config.to_flags(), "notices": None}
    assert (again.start.plan, again.start.schedule) == (config.start.plan, config.start.schedule)


def test_command_line_flags_override_the_file(tiny_data, tmp_path):
    config = parse_config(train_args(tiny_data, "--lr", "0.5"), world_size=1, cuda=False)
    again = _roundtrip(tmp_path, config, 1, "--lr", "0.25", "--seed", "9")
    assert (again.training.lr, again.training.seed) == (0.25, 9)
    assert again.training.lr_decay_iters == config.training.lr_decay_iters


def test_megatron_lm_sections_aliases_and_nulls(tmp_path):
    path = tmp_path / "megatron.yaml"
    path.write_text("language_model:\n  num_layers: 2\n  layernorm_epsilon: 1.e-6\n  ffn_hidden_size: null\n"
                    "model_parallel:\n  tensor_model_parallel_size: 2\n  sequence_parallel: true\n"
                    "lr: 3e-4\ntrain-iters: 5\ndata_path: [0.7, a, 0.3, b]\n")
    args = parse_args(["--yaml-cfg", str(path)])
    assert (args.num_layers, args.norm_epsilon, args.ffn_hidden_size) == (2, 1e-6, None)
    assert (args.tensor_model_parallel_size, args.sequence_parallel, args.lr, args.train_iters) == (2, True, 3e-4, 5)
    assert args.data_path == ["0.7", "a", "0.3", "b"]


@pytest.mark.parametrize("text, message", [
    ("num_layer: 2\n", "num_layer (did you mean num_layers?) is not a flag"),
    ("num_layers: two\n", "num_layers: 'two' is not a int"),
    ("sequence_parallel: 1\n", "sequence_parallel: expected true or false, not 1"),
    ("transformer_impl: te\n", "transformer_impl: 'te' is not one of local, transformer_engine"),
    ("seed: [1, 2]\n", "seed: expected one value, not a list"),
    ("- 1\n", "expected a mapping of flag names to values"),
    ("a: [1\n", "is not valid YAML"),
    ("model:\n  deep:\n    num_layers: 2\n", "section 'model' nests another section"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ArgumentError, match=f"^--yaml-cfg {path}") as e:
        parse_args(["--yaml-cfg", str(path)])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ArgumentError, match="--yaml-cfg .*nope.yaml: no such file"):
        parse_args(["--yaml-cfg", str(tmp_path / "nope.yaml")])


def test_the_flag_docs_are_generated_from_the_sections():
    """README.md's flag table and docs/flags.md are what the configuration dataclasses say
    (regenerate: python -m megatron_snip.arguments.flag_docs --write)."""
    from megatron_snip.arguments.flag_docs import README, REFERENCE, compact_table, readme_with_table, reference

    assert REFERENCE.read_text() == reference()
    assert README.read_text() == readme_with_table(README.read_text())
    assert "| `--snip-fp4-target` |" in reference() and "*(ours)*" in reference()
    assert "| snip | `--snip` `--snip-fp4-target`" in README.read_text() and "`--lr`" not in compact_table()


def test_the_recipe_flags_defaults_are_the_recipes_own():
    from megatron_snip.numerics.recipes import RecipeConfig
    from megatron_snip.precision.config import RECIPE_DEFAULTS, PrecisionConfig

    assert PrecisionConfig(**RECIPE_DEFAULTS).recipe() == RecipeConfig()
