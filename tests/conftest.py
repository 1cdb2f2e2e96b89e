"""Shared fixtures: a small real dataset, and launching pretrain_llama.py under torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():
    # Without a GPU, the Triton kernels' tests (test_triton_qdq.py) run them in Triton's
    # interpreter. Triton reads this when it is imported (megatron-core imports it) and when
    # a kernel launches, so it is set before anything else; nothing else launches kernels on CPU.
    os.environ["TRITON_INTERPRET"] = "1"

from megatron_snip.compat.launch import free_port  # noqa: E402 (after TRITON_INTERPRET; tests import it from here)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: has cases that run on a CUDA GPU when there is one (bench/gpu_suite.py runs "
        "`pytest -m cuda` on a GPU); on CPU they run their CPU cases or skip")
    config.addinivalue_line(
        "markers", "integration: launches processes (torchrun, spawned gloo workers, a CLI in a subprocess); "
        "`bash scripts/test.sh --fast` runs only the tests without it")


@pytest.fixture(autouse=True, scope="session")
def _font_cache_built():
    """matplotlib lists the system fonts with ``fc-list`` (a subprocess) the first time it is imported on a
    machine; done here, once, so that the first unit test that plots is not taken for one launching a process."""
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _unit_tests_launch_no_process(request, monkeypatch, _font_cache_built):
    """Keeps the tiers honest: a test not marked ``integration`` that starts a process fails, naming the fix."""
    import torch.multiprocessing

    if request.node.get_closest_marker("integration") or torch.cuda.is_available():
        # On a GPU, Triton compiles its kernels with ptxas in a subprocess; CI (CPU) keeps the tiers.
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} launches a process: mark it @pytest.mark.integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)


@dataclass(frozen=True)
class TinyData:
    prefix: str          # --data-path
    tokenizer_model: str  # --tokenizer-model
    corpus: str


def once_per_session(tmp_path_factory, name: str, make):
    """``make(directory)``'s JSON-able result, made once per test run even when pytest-xdist runs the
    session in several processes (scripts/test.sh): the first process to ask makes it in a folder all of
    them share, the others wait for it and read it back."""
    import json

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base folder is a subfolder of the run's
    record = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            (root / name).mkdir()
            record.write_text(json.dumps(make(root / name)))
        return json.loads(record.read_text())


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    """~60 stdlib modules, a 1024-piece tokenizer and the indexed dataset (built once per test run)."""
    from megatron_snip.data.corpus import CorpusConfig, build_corpus
    from megatron_snip.data.datasets import PreprocessConfig, preprocess
    from megatron_snip.data.tokenizer import TokenizerTrainingConfig, train_tokenizer

    def make(d: Path) -> list[str]:
        corpus = str(d / "corpus.jsonl")
        build_corpus(CorpusConfig(output=corpus, max_docs=60, exclude_tests=True, seed=1))
        train_tokenizer(TokenizerTrainingConfig(input=corpus, model_prefix=str(d / "tok"), vocab_size=1024))
        summary = preprocess(PreprocessConfig(input=corpus, output_prefix=str(d / "data"),
                                              tokenizer_model=str(d / "tok.model"), append_eod=True, progress=False))
        return [summary.prefixes["text"], str(d / "tok.model"), corpus]

    return TinyData(*once_per_session(tmp_path_factory, "tiny_data", make))


# A small Llama that runs a step in well under a second on 2 cores at any layout.
TINY_MODEL = ["--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "192",
              "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "64",
              "--max-position-embeddings", "64"]


# The same model as a Megatron-LM script describes it, without a preset: Megatron-LM's meaning, so the
# output layer is tied to the embedding; without dropout, as Megatron-LM's Llama scripts say (its default is 0.1).
TINY_MEGATRON = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4",
                 "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64",
                 "--max-position-embeddings", "64", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--attention-dropout", "0", "--hidden-dropout", "0"]


def train_args(data: TinyData, *extra: str, iters: int = 6, model: list[str] = TINY_MODEL) -> list[str]:
    """Arguments of a short deterministic run of ``model`` on ``data`` (logs every iteration)."""
    return [*model, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "1e-2", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--seed", "7",
            "--data-path", data.prefix, "--split", "90,10,0", "--tokenizer-model", data.tokenizer_model,
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "2", *extra]


def _run_in_world_of_one(rank: int, port: int, out: str, fn, args: tuple) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_snip.compat.cpu import enable

    torch.set_num_threads(1)
    enable()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=1)
    parallel_state.initialize_model_parallel()
    torch.save(fn(*args), out)
    dist.destroy_process_group()


def in_world_of_one(fn, *args, tmp_path: Path):
    """``fn(*args)`` (a module-level function) in a spawned process whose process group is a world of one
    (gloo, nccl with CUDA) with megatron's parallel groups; what it returned."""
    import torch.multiprocessing as mp

    out = tmp_path / f"{fn.__name__}.pt"
    mp.spawn(_run_in_world_of_one, args=(free_port(), str(out), fn, args), nprocs=1, join=True)
    return torch.load(out, weights_only=False)


def running_plan(controller):
    """The precisions this rank's quantized linears run now (modules of other stages: the bf16 default)."""
    from megatron_snip.numerics.recipes import BF16
    from megatron_snip.precision.plan import PrecisionPlan

    return PrecisionPlan({name: m.precision for name, m in controller.modules().items()}, BF16)


def run_config(*flags: str, world_size: int = 1):
    """The validated ``RunConfig`` of TINY_MODEL with ``flags`` (data and files not checked): for tests
    that build the model in-process with the trainer's own builders."""
    from megatron_snip.arguments import parse_args, resolve

    argv = [*TINY_MODEL, "--train-iters", "1", *flags]
    return resolve(parse_args(argv), world_size=world_size, cuda=False, check_files=False)


def torchrun_command(nproc: int, args: list[str], script: str = "pretrain_llama.py") -> list[str]:
    """The command line running ``script`` with ``args`` on ``nproc`` local processes under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), str(ROOT / script), *args]


def torchrun_env(env: dict | None = None) -> dict:
    """The environment of a test's torchrun job: one thread per process (2 cores are shared), plus ``env``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


def torchrun(nproc: int, args: list[str], timeout: float = 300, check: bool = True,
             env: dict | None = None, script: str = "pretrain_llama.py") -> subprocess.CompletedProcess:
    """Run ``script`` (pretrain_llama.py or a driver in tests/drivers taking its flags) on ``nproc``
    local processes; raise with the output on failure."""
    proc = subprocess.run(torchrun_command(nproc, args, script), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=torchrun_env(env))
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def launch(nproc: int, args: list[str], timeout: float = 300, check: bool = True, env: dict | None = None,
           script: str = "pretrain_llama.py") -> subprocess.CompletedProcess:
    """:func:`torchrun`'s job with its ranks forked from a process that imported the trainer once
    (tests/forked_ranks.py): the same program for a fifth of the CPU time, for tests whose point is
    what the run computes. Tests of torchrun's part (exit status, signals, kills) use :func:`torchrun`."""
    from forked_ranks import launch as forked

    proc = forked(nproc, ROOT / script, args, env=torchrun_env(env), cwd=ROOT, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"rank exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def stop_at_iteration(args: list[str], nproc: int, iteration: int, stop) -> tuple[subprocess.Popen, str]:
    """Run pretrain_llama.py with ``args`` on ``nproc`` processes under torchrun until it logs training
    iteration ``iteration``, then call ``stop(proc)`` (send the signal under test) and wait up to 120 s for the
    job to end; the finished process and its whole output (stdout and stderr)."""
    proc = subprocess.Popen(torchrun_command(nproc, args), cwd=ROOT, env=torchrun_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if f"[train] iteration {iteration:>8}/" in line:
                break
        stop(proc)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, "".join(lines) + rest


def resume_from(src: Path, iteration: int, dst: Path) -> Path:
    """A copy of checkpoint directory ``src`` whose newest checkpoint is ``iteration``."""
    dst.mkdir()
    name = f"iter_{iteration:07d}"
    shutil.copytree(src / name, dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def scalars(tensorboard_dir: str | Path, tag: str) -> dict[int, float]:
    """step -> value of one TensorBoard scalar tag (as the user's TensorBoard would show it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for run in sorted(Path(tensorboard_dir).glob("**/events.out.tfevents.*")):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return values


@pytest.fixture(scope="session")
def init_ckpt(tiny_data, tmp_path_factory) -> Path:
    """Initial weights saved by a TP1 PP1 run that trains 0 iterations (tests copy it, never write to it)."""
    def make(d: Path) -> str:
        launch(1, train_args(tiny_data, "--save", str(d / "ckpt"), iters=0))
        return str(d / "ckpt")

    return Path(once_per_session(tmp_path_factory, "init_ckpt", make))


# Llama 3's pre-tokenizer split (tokenizer.json of Meta-Llama-3) and special tokens.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]


@dataclass(frozen=True)
class HFTokenizerData:
    tokenizer_dir: str   # tokenizer.json + tokenizer_config.json
    prefix: str          # the tiny corpus preprocessed with it (--data-path)
    vocab_size: int


@pytest.fixture(scope="session")
def hf_tokenizer_data(tiny_data, tmp_path_factory) -> HFTokenizerData:
    """A Llama-3-style byte-level BPE tokenizer.json (its regex split, <|begin_of_text|> added by the
    post-processor) trained with the `tokenizers` library on the tiny corpus, and that corpus
    preprocessed with it through --tokenizer-type HuggingFaceTokenizer."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from megatron_snip.data.corpus import iter_documents
    from megatron_snip.data.datasets import PreprocessConfig, preprocess

    d = tmp_path_factory.mktemp("hf_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    texts = [text for doc in iter_documents(tiny_data.corpus, ("text",)) for text in doc.values()]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=LLAMA3_SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "model_max_length": 2048, "clean_up_tokenization_spaces": False}))
    summary = preprocess(PreprocessConfig(input=tiny_data.corpus, output_prefix=str(d / "data"),
                                          tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(d),
                                          append_eod=True, progress=False))
    return HFTokenizerData(str(d), summary.prefixes["text"], tok.get_vocab_size())


def tiny_hf_llama(path, vocab_size: int, *, tied: bool, layers: int = 4, rope_scaling: bool = False,
                  seed: int = 0) -> str:
    """A randomly initialised transformers LlamaForCausalLM (GQA: 4 heads, 2 kv heads) saved with
    save_pretrained (fp32 safetensors) into ``path``; its weights are drawn with a std large enough
    that every layer changes the logits visibly."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192, "rope_theta": 500000.0} if rope_scaling
            else {"rope_type": "default", "rope_theta": 10000.0})
    # Llama 3.1's scaling needs a context beyond its original 8192 (transformers warns otherwise).
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16384 if rope_scaling else 64,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied, rope_parameters=rope,
                         bos_token_id=0, eos_token_id=1, initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return str(path)
