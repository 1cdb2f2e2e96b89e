"""Multi-process training over gloo: parity between layouts, resume-exactness, resharding.

Every run starts from the same saved initial weights (PP stages draw their
initial weights from different RNG streams, so a shared checkpoint is what
makes layouts comparable) and reads the same global batches.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, launch, resume_from, scalars, train_args

from megatron_snip.training import tags

pytestmark = pytest.mark.integration  # every test here launches processes

LOSS = tags.LM_LOSS
VALID = tags.LM_LOSS_VALIDATION


def run_from_init(tiny_data, init_ckpt, tmp_path, nproc, *layout, iters=6):
    tb = tmp_path / "tb"
    launch(nproc, train_args(tiny_data, *layout, "--load", str(init_ckpt), "--no-load-optim", "--no-load-rng",
                             "--tensorboard-dir", str(tb), iters=iters))
    return scalars(tb, LOSS)


@pytest.fixture(scope="module")
def baseline(tiny_data, init_ckpt, tmp_path_factory):
    """Losses of TP1 PP1 DP1 from the initial weights."""
    return run_from_init(tiny_data, init_ckpt, tmp_path_factory.mktemp("base"), 1)


def assert_close(got: dict, want: dict, rel: float):
    assert sorted(got) == sorted(want) and len(want) > 0
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), f"iteration {step}: {got[step]} vs {want[step]}"


def test_losses_fall(baseline):
    assert baseline[6] < baseline[1] - 0.3


@pytest.mark.parametrize("layout,nproc", [
    (("--tensor-model-parallel-size", "2"), 2),
    (("--pipeline-model-parallel-size", "2"), 2),
    ((), 2),  # DP=2 with the same global batch: 2 micro-batches per rank instead of 4
    # DP=2 with Megatron-LM's DDP and determinism flags: small buckets reduced as the backward goes, fp32
    # accumulation in the reduce-scatter, the gradient-size check, deterministic kernels
    (("--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "5000",
      "--ddp-reduce-scatter-with-fp32-accumulation", "--check-for-large-grads", "--deterministic-mode"), 2),
])
def test_layout_matches_single_process(tiny_data, init_ckpt, baseline, tmp_path, layout, nproc):
    losses = run_from_init(tiny_data, init_ckpt, tmp_path, nproc, *layout)
    # Only the order of floating-point reductions differs between layouts.
    assert_close(losses, baseline, rel=2e-5)


def test_uneven_pipeline_stages_match_single_process(tiny_data, init_ckpt, baseline, tmp_path):
    """--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3: megatron-core builds 1 and 3
    layers, the initial weights load into them by their global layer numbers, and the run trains as TP1 does."""
    tb = tmp_path / "tb"
    proc = launch(2, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers",
                                "1", "--decoder-last-pipeline-num-layers", "3", "--load", str(init_ckpt),
                                "--no-load-optim", "--no-load-rng", "--tensorboard-dir", str(tb)))
    assert "PP=2 (layers per stage 1, 3)" in proc.stdout
    assert_close(scalars(tb, LOSS), baseline, rel=2e-5)


def losses_and_grads(tiny_data, init_ckpt, tmp_path, nproc, *layout, iters=4):
    """Losses of ``iters`` steps from the initial weights, and the unsharded gradients of the next
    batch (tests/drivers/dump_grads.py)."""
    tb, out = tmp_path / "tb", tmp_path / "grads.pt"
    launch(nproc, train_args(tiny_data, *layout, "--load", str(init_ckpt), "--no-load-optim", "--no-load-rng",
                             "--tensorboard-dir", str(tb), iters=iters),
           env={"GRADS_OUT": str(out)}, script=ROOT / "tests" / "drivers" / "dump_grads.py")
    return scalars(tb, LOSS), torch.load(out)


@pytest.fixture(scope="module")
def baseline_grads(tiny_data, init_ckpt, tmp_path_factory):
    return losses_and_grads(tiny_data, init_ckpt, tmp_path_factory.mktemp("base_grads"), 1)


CP2 = ("--context-parallel-size", "2")
# SNIP cycles (every 3 iterations) whose plan stays bf16 (a target of 0, bf16 the only non-FP4 candidate): they
# must leave training as it was (tests/test_snip_probes.py: their statistics under CP equal CP=1's).
SNIP_KEEPING_BF16 = ("--snip", "--snip-interval", "3", "--snip-fp4-target", "0", "--snip-formats", "bf16", "nvfp4",
                     "--snip-probe-passes", "1")


@pytest.mark.parametrize("layout", [
    # the local layers' torch norms, whose gradients megatron-core all-reduces over TP
    ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    # the interleaved schedule: 2 chunks of 1 layer per pipeline rank
    ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
    # context parallelism: each sequence in 4 chunks over 2 ranks (tests/test_context_parallel.py: the attention);
    # alone with the per-token loss (every token counts: the same loss and gradients as the mean's)
    (*CP2, "--calculate-per-token-loss"),
    (*CP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
    (*CP2, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", *SNIP_KEEPING_BF16),
], ids=["tp2-sp", "pp2-vpp2", "cp2-per-token-loss", "cp2-tp2-sp", "cp2-pp2-vpp2-snip"])
def test_layout_matches_tp1_in_losses_and_gradients(tiny_data, init_ckpt, baseline_grads, tmp_path, layout):
    """Trains as TP1 does: losses of 4 steps, then every gradient of a 5th batch (with a SNIP cycle between)."""
    model_parallel = any(flag in layout for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"))
    nproc = 4 if CP2[0] in layout and model_parallel else 2
    losses, grads = losses_and_grads(tiny_data, init_ckpt, tmp_path, nproc, *layout)
    if "--snip" in layout:
        assert sorted(scalars(tmp_path / "tb", tags.snip("objective"))) == [3]  # the cycle ran
    want_losses, want_grads = baseline_grads
    assert_close(losses, want_losses, rel=2e-5)
    assert sorted(grads) == sorted(want_grads)
    assert any("layernorm" in name for name in grads)  # the norms' gradients are compared too
    worst = {name: ((grads[name] - g).abs().max() / g.abs().max()).item() for name, g in want_grads.items()}
    print(f"\n{' '.join(layout)} vs TP1: max |loss diff| {max(abs(losses[k] - want_losses[k]) for k in losses):.2e}; "
          f"max |grad diff| {max((grads[n] - g).abs().max().item() for n, g in want_grads.items()):.2e}, "
          f"relative to the tensor's largest {max(worst.values()):.2e} ({max(worst, key=worst.get)})")
    for name, rel in worst.items():
        assert rel < 1e-4, (name, rel)


DIST_OPT = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")


@pytest.fixture(scope="module")
def cp2_run(tiny_data, init_ckpt, tmp_path_factory):
    """6 iterations at CP2 from the initial weights, the distributed optimizer sharded over the 2 CP ranks
    (megatron-core shards it over DP x CP) with overlapped communication, saving at 3 and 6, SNIP cycles (plan held
    at bf16) before each save: each CP rank perturbs its own shard and its peer's."""
    d = tmp_path_factory.mktemp("cp2")
    launch(2, train_args(tiny_data, *CP2, *DIST_OPT, *SNIP_KEEPING_BF16, "--load", str(init_ckpt), "--no-load-optim",
                         "--no-load-rng", "--save", str(d / "ckpt"), "--save-interval", "3",
                         "--tensorboard-dir", str(d / "tb")))
    return d


def test_cp2_with_the_distributed_optimizer_trains_as_tp1(cp2_run, baseline):
    assert sorted(scalars(cp2_run / "tb", tags.snip("objective"))) == [3, 6]  # the cycles ran
    assert_close(scalars(cp2_run / "tb", LOSS), baseline, rel=2e-5)


def test_cp2_checkpoint_resumes_at_cp1(tiny_data, cp2_run, tmp_path):
    """Weights and optimizer state saved at CP2 continue at CP1 as the CP2 run did."""
    ckpt = resume_from(cp2_run / "ckpt", 3, tmp_path / "ckpt")
    launch(1, train_args(tiny_data, "--use-distributed-optimizer", "--load", str(ckpt),
                         "--tensorboard-dir", str(tmp_path / "tb")))
    full, resumed = scalars(cp2_run / "tb", LOSS), scalars(tmp_path / "tb", LOSS)
    assert sorted(resumed) == [4, 5, 6]
    assert_close(resumed, {k: full[k] for k in resumed}, rel=2e-5)


def test_checkpoints_move_between_cp2_and_cp1_dp2(tiny_data, cp2_run, tmp_path):
    """CP2 -> CP1 x DP2 (the distributed optimizer's shards over DP x CP = 2 ranks either way), and back: each
    continues as the run that saved it did."""
    ckpt = resume_from(cp2_run / "ckpt", 3, tmp_path / "dp2")
    launch(2, train_args(tiny_data, *DIST_OPT, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4",
                         "--tensorboard-dir", str(tmp_path / "tb_dp2")))
    cp2, dp2 = scalars(cp2_run / "tb", LOSS), scalars(tmp_path / "tb_dp2", LOSS)
    assert sorted(dp2) == [4, 5, 6]
    assert_close(dp2, {k: cp2[k] for k in dp2}, rel=2e-5)
    back = resume_from(ckpt, 4, tmp_path / "back")
    launch(2, train_args(tiny_data, *CP2, *DIST_OPT, "--load", str(back),
                         "--tensorboard-dir", str(tmp_path / "tb_back")))
    again = scalars(tmp_path / "tb_back", LOSS)
    assert sorted(again) == [5, 6]
    assert_close(again, {k: dp2[k] for k in again}, rel=2e-5)


@pytest.fixture(scope="module")
def tp2pp2_run(tiny_data, tmp_path_factory):
    """8 iterations at TP2 PP2 saving at 4 and 8."""
    d = tmp_path_factory.mktemp("tp2pp2")
    launch(4, train_args(tiny_data, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--save", str(d / "ckpt"), "--save-interval", "4", "--tensorboard-dir", str(d / "tb"),
                         iters=8))
    return d


def test_resume_is_exact_tp2pp2(tiny_data, tp2pp2_run, tmp_path):
    ckpt = resume_from(tp2pp2_run / "ckpt", 4, tmp_path / "ckpt")
    launch(4, train_args(tiny_data, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--load", str(ckpt), "--tensorboard-dir", str(tmp_path / "tb"), iters=8))
    full = scalars(tp2pp2_run / "tb", LOSS)
    resumed = scalars(tmp_path / "tb", LOSS)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert {k: full[k] for k in resumed} == resumed  # bit-identical losses
    assert scalars(tmp_path / "tb", VALID) == scalars(tp2pp2_run / "tb", VALID)


def test_tp2pp2_checkpoint_loads_into_tp1pp1(tiny_data, tp2pp2_run, tmp_path):
    launch(1, train_args(tiny_data, "--load", str(tp2pp2_run / "ckpt"), "--skip-train",
                         "--tensorboard-dir", str(tmp_path / "tb"), iters=8))
    want = scalars(tp2pp2_run / "tb", VALID)[8]
    assert scalars(tmp_path / "tb", VALID)[8] == pytest.approx(want, rel=1e-5)


VPP = ("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2")


def test_interleaved_pipeline_resume_is_exact_and_loads_into_tp1(tiny_data, tmp_path):
    """PP2 x VPP2: a checkpoint of both chunks per rank resumes bit for bit and loads into TP1 PP1."""
    launch(2, train_args(tiny_data, *VPP, "--save", str(tmp_path / "full"), "--save-interval", "2",
                         "--tensorboard-dir", str(tmp_path / "tb_full"), iters=4))
    ckpt = resume_from(tmp_path / "full", 2, tmp_path / "resumed")
    launch(2, train_args(tiny_data, *VPP, "--load", str(ckpt), "--tensorboard-dir", str(tmp_path / "tb_res"),
                         iters=4))
    full, resumed = scalars(tmp_path / "tb_full", LOSS), scalars(tmp_path / "tb_res", LOSS)
    assert sorted(resumed) == [3, 4]
    assert {k: full[k] for k in resumed} == resumed
    launch(1, train_args(tiny_data, "--load", str(tmp_path / "full"), "--skip-train",
                         "--tensorboard-dir", str(tmp_path / "tb_tp1"), iters=4))
    assert scalars(tmp_path / "tb_tp1", VALID)[4] == pytest.approx(scalars(tmp_path / "tb_full", VALID)[4], rel=1e-5)


def test_distributed_optimizer_resume_is_exact(tiny_data, tmp_path):
    args = ("--use-distributed-optimizer", "--save-interval", "3")
    launch(2, train_args(tiny_data, *args, "--save", str(tmp_path / "full"), "--tensorboard-dir",
                         str(tmp_path / "tb_full")))
    ckpt = resume_from(tmp_path / "full", 3, tmp_path / "resumed")
    launch(2, train_args(tiny_data, *args, "--load", str(ckpt), "--save", str(ckpt),
                         "--tensorboard-dir", str(tmp_path / "tb_res")))
    full, resumed = scalars(tmp_path / "tb_full", LOSS), scalars(tmp_path / "tb_res", LOSS)
    assert sorted(resumed) == [4, 5, 6]
    assert {k: full[k] for k in resumed} == resumed


def test_bf16_run_saves_and_resumes_exactly(tiny_data, tmp_path):
    """--bf16 (bf16 parameters, fp32 masters in the optimizer) checkpoints and resumes bit for bit:
    every parameter, the norms' included, is bf16, as the mixed-precision optimizer requires. With dropout
    (Megatron-LM's default for a model given by its flags): the resumed run draws the masks the whole run
    drew (opening the data loader at the resume must not move the random stream dropout draws from)."""
    full, tb_full, tb_resumed = tmp_path / "full", tmp_path / "tb_full", tmp_path / "tb_resumed"
    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    launch(1, train_args(tiny_data, "--bf16", *dropout, "--save", str(full), "--save-interval", "2",
                         "--tensorboard-dir", str(tb_full), iters=4))
    ckpt = resume_from(full, 2, tmp_path / "resumed")
    launch(1, train_args(tiny_data, "--bf16", *dropout, "--load", str(ckpt), "--save", str(ckpt),
                         "--tensorboard-dir", str(tb_resumed), iters=4))
    want = scalars(tb_full, LOSS)
    assert scalars(tb_resumed, LOSS) == {3: want[3], 4: want[4]}


def test_tied_embeddings_train_at_pp2_as_at_tp1_resume_and_export(tiny_data, tmp_path):
    """A Megatron-LM script without --untie-embeddings-and-output-weights gets a tied output layer: from the
    same initial weights, PP2 (the last stage's copy of the embedding kept equal by megatron-core) trains
    as one process does, resumes bit for bit, and exports with tie_word_embeddings and no lm_head."""
    import json

    from conftest import TINY_MEGATRON
    from safetensors.torch import load_file

    from megatron_snip.training.checkpointing import read_record

    def run(nproc, *extra, iters=3):
        launch(nproc, train_args(tiny_data, *extra, model=TINY_MEGATRON, iters=iters))

    init, pp2 = tmp_path / "init", ("--pipeline-model-parallel-size", "2")
    run(1, "--save", str(init), iters=0)
    assert read_record(str(init)).args["share_embeddings_and_output_weights"] is True
    start = ("--load", str(init), "--no-load-optim", "--no-load-rng")
    run(1, *start, "--tensorboard-dir", str(tmp_path / "tb1"))
    run(2, *pp2, *start, "--save", str(tmp_path / "full"), "--save-interval", "2",
        "--tensorboard-dir", str(tmp_path / "tb2"))
    assert_close(scalars(tmp_path / "tb2", LOSS), scalars(tmp_path / "tb1", LOSS), rel=2e-5)
    ckpt = resume_from(tmp_path / "full", 2, tmp_path / "resumed")
    run(2, *pp2, "--load", str(ckpt), "--tensorboard-dir", str(tmp_path / "tb_res"))
    full, resumed = scalars(tmp_path / "tb2", LOSS), scalars(tmp_path / "tb_res", LOSS)
    assert sorted(resumed) == [3] and {k: full[k] for k in resumed} == resumed
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_llama.py"), "export", "--load-dir",
                    str(tmp_path / "full"), "--save-dir", str(tmp_path / "hf"), "--no-progress"],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    names = {name for f in (tmp_path / "hf").glob("*.safetensors") for name in load_file(str(f))}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
