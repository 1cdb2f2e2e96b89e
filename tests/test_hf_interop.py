"""Hugging Face Llama import/export and the HuggingFaceTokenizer, against real `transformers`.

Two tiny randomly initialised LlamaForCausalLM (GQA; untied, and tied with Llama 3.1 rope
scaling) are saved with save_pretrained and imported once per module with
tools/convert_hf_llama.py; their logits in our model (TP1, TP2 x PP2) are compared with
transformers' own forward pass, exports tensor by tensor with the original files, and --bf16
runs' exports (mixed-precision and distributed optimizer) with their fp32 masters.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port, launch, tiny_hf_llama

# fp32 end to end; only the order of floating-point operations differs from transformers.
LOGIT_TOL = 1e-4


# Several conversions in one process (each start-up costs seconds): tools/convert_hf_llama.py's
# main() (megatron_snip/cli/convert_hf_llama.py) per argument list, stopping at the first failure.
_CONVERT_MANY = """
import json, sys
from megatron_snip.cli import convert_hf_llama as tool
for argv in json.loads(sys.argv[1]):
    rc = tool.main(argv + ["--no-progress"])
    if rc:
        sys.exit(rc)
"""


def convert(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return convert_many([list(args)], check=check)


def convert_many(argvs: list[list[str]], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", _CONVERT_MANY, json.dumps(argvs)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and proc.returncode != 0:
        raise AssertionError(f"convert_hf_llama.py exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


@dataclass(frozen=True)
class Imported:
    hf_dir: str  # the Hugging Face model (save_pretrained)
    ckpt: str    # its import (read only: tests train and export into their own directories)


@pytest.fixture(scope="module")
def imported(hf_tokenizer_data, tmp_path_factory) -> dict[str, Imported]:
    """The two models the tests share, each imported once (4 layers, GQA): "untied", and "tied"
    with Llama 3.1 rope scaling (tied embeddings and rope scaling as in Llama 3.2 1B/3B)."""
    out = {}
    for name, tied in (("untied", False), ("tied", True)):
        d = tmp_path_factory.mktemp(name)
        hf_dir = tiny_hf_llama(d / "hf", hf_tokenizer_data.vocab_size, tied=tied, rope_scaling=tied)
        out[name] = Imported(hf_dir, str(d / "ckpt"))
    convert_many([["import", "--load-dir", m.hf_dir, "--save-dir", m.ckpt] for m in out.values()])
    return out


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def our_logits(data, ckpt: str, tokens: torch.Tensor, tmp_path: Path, nproc: int, *flags: str) -> torch.Tensor:
    """Logits of checkpoint ``ckpt`` through pretrain_llama.py's model (tests/drivers/hf_logits.py)."""
    torch.save(tokens, tmp_path / "tokens.pt")
    out = tmp_path / "logits.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), str(ROOT / "tests" / "drivers" / "hf_logits.py"),
           "--load", ckpt, "--data-path", data.prefix, "--tokenizer-type", "HuggingFaceTokenizer",
           "--tokenizer-model", data.tokenizer_dir, "--split", "90,10,0", "--train-iters", "0",
           "--micro-batch-size", str(tokens.shape[0]), "--seq-length", str(tokens.shape[1]), "--eval-iters", "0",
           *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "LOGITS_TOKENS": str(tmp_path / "tokens.pt"),
                               "LOGITS_OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def sample_tokens(vocab: int, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor, vocab: int, label: str,
                        imported: bool = True) -> float:
    assert ours.shape[:2] == theirs.shape[:2] and ours.shape[2] >= vocab
    # An import's padding rows are zero; training then pushes the padded ids' logits down.
    assert not imported or torch.all(ours[..., vocab:] == 0), "padding rows of an import must give zero logits"
    diff = (ours[..., :vocab] - theirs).abs().max().item()
    print(f"max |logit difference| {label}: {diff:.3g} (logits up to {theirs.abs().max().item():.3g})")
    assert diff < LOGIT_TOL
    return diff


@pytest.mark.integration
@pytest.mark.parametrize("model,layout", [
    ("untied", ()),
    ("tied", ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")),
], ids=["untied-tp1", "tied-rope-scaling-tp2pp2"])
def test_imported_logits_equal_transformers(hf_tokenizer_data, imported, tmp_path, model, layout):
    vocab = hf_tokenizer_data.vocab_size
    tokens = sample_tokens(vocab)
    ours = our_logits(hf_tokenizer_data, imported[model].ckpt, tokens, tmp_path, 4 if layout else 1, *layout)
    assert_logits_match(ours, hf_logits(imported[model].hf_dir, tokens), vocab, f"{model} {layout or 'TP1'}")


def _tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _load_quietly(hf_dir: str):
    """transformers' LlamaForCausalLM.from_pretrained, failing on any warning it logs or raises."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = LlamaForCausalLM.from_pretrained(hf_dir)
    finally:
        logger.removeHandler(handler)
    problems = [r.getMessage() for r in records if r.levelno >= logging.WARNING] + [str(w.message) for w in caught]
    assert not problems, problems
    return model


@pytest.mark.integration
@pytest.mark.parametrize("model", ["untied", "tied"])
def test_export_is_bit_exact_and_loads_without_warnings(imported, tmp_path, model):
    hf_dir, ckpt = imported[model].hf_dir, imported[model].ckpt
    # --dtype bf16: exported from the fp32 import, and imported (file-backed converted tensors), then exported.
    bf16 = [["export", "--load-dir", ckpt, "--save-dir", str(tmp_path / "bf16"), "--dtype", "bf16"],
            ["import", "--load-dir", hf_dir, "--save-dir", str(tmp_path / "ckpt16"), "--dtype", "bf16"],
            ["export", "--load-dir", str(tmp_path / "ckpt16"), "--save-dir", str(tmp_path / "bf16_import")]]
    convert_many([["export", "--load-dir", ckpt, "--save-dir", str(tmp_path / "out")], *bf16[:3 * (model == "untied")]])
    original, exported = _tensors(hf_dir), _tensors(str(tmp_path / "out"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    hf_model = _load_quietly(str(tmp_path / "out"))
    assert hf_model.config.tie_word_embeddings == (model == "tied")
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 1
    side = json.loads((tmp_path / "out" / "megatron_snip.json").read_text())
    assert side["iteration"] == 0 and "master weights" in side["weights"]
    if model == "untied":  # --dtype bf16 halves the files and rounds each tensor once.
        for out in ("bf16", "bf16_import"):
            halved = _tensors(str(tmp_path / out))
            assert sorted(halved) == sorted(original)
            assert all(torch.equal(halved[n], t.to(torch.bfloat16)) for n, t in original.items()), out
        assert not list((tmp_path / "ckpt16").glob(".import-scratch-*"))


@pytest.mark.integration
def test_train_with_snip_then_export_matches_ours(hf_tokenizer_data, imported, tmp_path):
    """import -> 4 iterations at TP2 with SNIP (FP4 plan from iteration 2) -> export: transformers'
    logits of the export equal ours from the trained checkpoint, and training moved the weights."""
    vocab = hf_tokenizer_data.vocab_size
    hf_dir = imported["untied"].hf_dir
    data = ["--data-path", hf_tokenizer_data.prefix, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", hf_tokenizer_data.tokenizer_dir, "--split", "90,10,0"]
    launch(2, ["--load", imported["untied"].ckpt, "--finetune", "--save", str(tmp_path / "trained"),
               "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
               "--train-iters", "4", "--save-interval", "2", "--lr", "1e-3", "--eval-iters", "0",
               "--snip", "--snip-fp4-target", "0.75", *data])
    convert("export", "--load-dir", str(tmp_path / "trained"), "--save-dir", str(tmp_path / "out"))
    side = json.loads((tmp_path / "out" / "megatron_snip.json").read_text())
    assert side["iteration"] == 4 and "nvfp4" in json.dumps(side["precision_plan"])
    before, after = _tensors(hf_dir), _tensors(str(tmp_path / "out"))
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    tokens = sample_tokens(vocab)
    # --precision bf16: our forward without the plan's quantization, as transformers computes it.
    ours = our_logits(hf_tokenizer_data, str(tmp_path / "trained"), tokens, tmp_path, 2,
                      "--pipeline-model-parallel-size", "2", "--precision", "bf16")
    assert_logits_match(ours, hf_logits(str(tmp_path / "out"), tokens), vocab, "trained, TP1 PP2", imported=False)


def test_tokenizer_matches_transformers(hf_tokenizer_data, tiny_data):
    from transformers import AutoTokenizer

    from megatron_snip.data.corpus import iter_documents
    from megatron_snip.data.datasets import load_tokens
    from megatron_snip.data.tokenizer import build_tokenizer

    ours = build_tokenizer("HuggingFaceTokenizer", hf_tokenizer_data.tokenizer_dir)
    theirs = AutoTokenizer.from_pretrained(hf_tokenizer_data.tokenizer_dir)
    texts = [t for doc in iter_documents(tiny_data.corpus, ("text",)) for t in doc.values()]
    assert ours.vocab_size == len(theirs) == hf_tokenizer_data.vocab_size
    assert (ours.bos, ours.eod) == (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
    for text in texts[:20] + ["héllo wörld 123\n\tx = 1  # ünïcode ✓"]:
        ids = ours.tokenize(text)
        assert ids == theirs(text).input_ids and ids[0] == ours.bos
        assert ours.detokenize(ids) == theirs.decode(ids, skip_special_tokens=True) == text
    # preprocess_data wrote each document as BOS ... EOD, like Megatron-LM with --append-eod.
    stream = load_tokens(hf_tokenizer_data.prefix).tolist()
    first = ours.tokenize(texts[0]) + [ours.eod]
    assert stream[:len(first)] == first


@pytest.mark.integration
def test_bad_directories_are_refused(hf_tokenizer_data, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_snip.interop.hf_files import HFFormatError, read_config, weight_files

    hf_dir = Path(tiny_hf_llama(tmp_path / "hf", hf_tokenizer_data.vocab_size, tied=False, layers=2))
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(HFFormatError, match=r"config.json: architecture \['MistralForCausalLM'\] is not supported"):
        read_config(str(hf_dir))
    # A sharded model with one shard missing.
    sharded = tmp_path / "sharded"
    LlamaForCausalLM(LlamaConfig(**{k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                           "num_attention_heads", "num_key_value_heads")},
                                 num_hidden_layers=2)).save_pretrained(str(sharded), max_shard_size="100KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(HFFormatError, match=rf"names shard .*{shards[1].name}.* which is missing"):
        weight_files(str(sharded))
    # config.json that does not belong to the weights: named file, tensor, both shapes.
    (hf_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    proc = convert("import", "--load-dir", str(hf_dir), "--save-dir", str(tmp_path / "ckpt"), check=False)
    assert proc.returncode == 2
    # (whichever MLP tensor the file lists first)
    assert re.search(r"model\.safetensors: model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight has shape "
                     r"\((160, 64|64, 160)\) but config\.json implies \((128, 64|64, 128)\)", proc.stderr), proc.stderr
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.integration
def test_flags_that_disagree_with_the_checkpoint_are_refused(hf_tokenizer_data, imported):
    from megatron_snip.arguments import ArgumentError, parse_config

    base = ["--load", imported["untied"].ckpt, "--train-iters", "1", "--data-path", hf_tokenizer_data.prefix,
            "--split", "90,10,0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", hf_tokenizer_data.tokenizer_dir]
    model = parse_config(base, world_size=1, cuda=False).model
    assert (model.num_layers, model.hidden_size, model.num_query_groups, model.norm_epsilon) == (4, 64, 2, 1e-6)
    assert model.padded_vocab_size == 768 and model.vocab_size == hf_tokenizer_data.vocab_size
    with pytest.raises(ArgumentError, match="--hidden-size 128 disagrees with the checkpoint in .* which has 64"):
        parse_config([*base, "--hidden-size", "128"], world_size=1, cuda=False)
    with pytest.raises(ArgumentError,
                       match="--model-preset tiny sets --hidden-size 128 but the checkpoint in .* has 64"):
        parse_config([*base, "--model-preset", "tiny"], world_size=1, cuda=False)


@pytest.mark.integration
def test_bf16_runs_export_their_fp32_master_weights(hf_tokenizer_data, imported, tmp_path):
    """A --bf16 run keeps fp32 masters in its optimizer state: export writes those (fp32, not
    bf16-representable after training), not the bf16 copies, from megatron-core's mixed-precision
    optimizer (PP2) and from the distributed optimizer's flat DP-sharded buffers (PP2 x DP2, the
    same samples per step): both runs' masters agree to within what bf16 compute noise moves
    through Adam's normalised steps."""
    hf_dir = imported["tied"].hf_dir
    lr, iters = 1e-3, 2
    common = ["--load", imported["tied"].ckpt, "--finetune", "--bf16", "--pipeline-model-parallel-size", "2",
              "--seq-length", "64", "--global-batch-size", "2", "--train-iters", str(iters), "--lr", str(lr),
              "--eval-iters", "0",
              "--data-path", hf_tokenizer_data.prefix, "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", hf_tokenizer_data.tokenizer_dir, "--split", "90,10,0"]
    launch(2, [*common, "--save", str(tmp_path / "trained"), "--micro-batch-size", "2"])
    launch(4, [*common, "--save", str(tmp_path / "dist"), "--micro-batch-size", "1", "--use-distributed-optimizer"])
    original = _tensors(hf_dir)
    exports = {}
    convert_many([["export", "--load-dir", str(tmp_path / run), "--save-dir", str(tmp_path / f"{run}_hf")]
                  for run in ("trained", "dist")])
    for run in ("trained", "dist"):
        exports[run] = _tensors(str(tmp_path / f"{run}_hf"))
        assert sorted(exports[run]) == sorted(original)
        w = exports[run]["model.layers.1.mlp.down_proj.weight"]
        assert w.dtype == torch.float32 and not torch.equal(w, w.to(torch.bfloat16).float())
        assert not torch.equal(w, original["model.layers.1.mlp.down_proj.weight"])
        assert "fp32 master weights of the checkpoint's optimizer" in \
            json.loads((tmp_path / f"{run}_hf" / "megatron_snip.json").read_text())["weights"]
        assert not (tmp_path / f"{run}_hf" / "fp32_masters").exists()
    # The run starts from the import rounded to bf16 (its masters are the loaded weights, not the
    # initial ones), then Adam moves each weight by at most ~lr per step; a misplaced master would
    # be off by the weights' own scale (std 0.2).
    for run, name in ((r, n) for r in exports for n in original):
        w, start = exports[run][name], original[name]
        assert torch.all((w - start).abs() <= start.abs() * 2**-8 + 1.5 * lr * iters), (run, name)
        # The runs differ in bf16 rounding only (micro-batches of 1 vs 2): where a gradient is
        # near zero, Adam's normalised step may take the other sign (at most 2 lr per step).
        diff = (w - exports["trained"][name]).abs()
        assert run == "trained" or (diff.max() <= 2 * lr * iters and diff.mean() < 1e-4), name
    _load_quietly(str(tmp_path / "dist_hf"))


@pytest.mark.integration
def test_qkv_and_fc1_layouts_are_megatrons():
    """The pure mapping: linear_qkv is [q heads of group g; k_g; v_g] per query group, linear_fc1 is
    [gate; up], the vocabulary part is the first rows; export inverts import exactly."""
    from megatron_snip.interop.convert import export_part, hf_names, import_part, part_view
    from megatron_snip.model.config import ModelConfig

    lay = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=6, num_attention_heads=4, num_query_groups=2,
                      vocab_size=5, share_embeddings_and_output_weights=False)
    d, h = lay.kv_channels, lay.hidden_size
    q, k, v = torch.randn(4 * d, h), torch.randn(2 * d, h), torch.randn(2 * d, h)
    qkv = torch.zeros((4 + 2 * 2) * d, h)
    for part, t in (("q", q), ("k", k), ("v", v)):
        import_part(qkv, part, t, lay, part)
    want = torch.cat([torch.cat([q[2 * g * d:(2 * g + 2) * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
                      for g in range(2)])
    assert torch.equal(qkv, want)
    assert all(torch.equal(export_part(qkv, p, lay), t) for p, t in (("q", q), ("k", k), ("v", v)))
    fc1 = torch.randn(12, h)
    assert torch.equal(part_view(fc1, "gate", lay), fc1[:6]) and torch.equal(part_view(fc1, "up", lay), fc1[6:])
    assert torch.equal(part_view(torch.arange(8.0).view(8, 1), "vocab", lay).flatten(), torch.arange(5.0))
    names = hf_names(lay)
    assert names["model.layers.0.self_attn.k_proj.weight"] == ("decoder.layers.0.self_attention.linear_qkv.weight", "k")
    assert "lm_head.weight" in names and "lm_head.weight" not in hf_names(
        replace(lay, share_embeddings_and_output_weights=True))
    # A zero-centred norm (--apply-layernorm-1p) stores scale - 1; Hugging Face stores the scale.
    centred, gamma = replace(lay, apply_layernorm_1p=True), torch.randn(8)
    assert names["model.layers.0.input_layernorm.weight"] == ("decoder.layers.0.input_layernorm.weight", "norm")
    norm = torch.zeros(8)
    import_part(norm, "norm", gamma, centred, "norm")
    assert torch.equal(norm, gamma - 1) and torch.equal(export_part(norm, "norm", centred), (gamma - 1) + 1)
    assert torch.equal(export_part(gamma, "norm", lay), gamma)
    for wrong in ((6, 8), (8, 4)):  # too many rows; the right size transposed
        with pytest.raises(ValueError, match=rf"k_proj has shape \({wrong[0]}, {wrong[1]}\) but config.json implies "
                                             r"\(4, 8\)"):
            import_part(qkv, "k", torch.randn(*wrong), lay, "k_proj")


def test_export_reads_checkpoints_saved_before_newer_flags():
    """A checkpoint's saved arguments lack the flags added after it was written: the export's
    configuration gives them their defaults instead of failing with a KeyError."""
    from conftest import run_config

    from megatron_snip.interop.dist_masters import _run_config

    saved = run_config("--tensor-model-parallel-size", "2", world_size=2).to_flags()
    for newer in ("exit_duration_in_mins", "attention_backend"):
        saved.pop(newer, None)
    run = _run_config(saved)
    assert run.parallel.tensor_model_parallel_size == 2 and run.model.transformer_impl == "local"
