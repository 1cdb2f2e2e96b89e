"""The yardstick: a plain-PyTorch Llama training step, written the way torchtitan writes it.

    python bench/peer_step.py --preset tinyllama-1.1b                    # eager, compiled, torchao float8
    python bench/peer_step.py --preset llama3-8b --num-layers 4 --seq-length 4096 --variants compiled
    python bench/peer_step.py --preset tiny --iters 4 --warmup 1 --backend aot_eager   # anywhere, in seconds

What our trainer's step is measured against (bench/gpu_suite.py prints the ratios): the same
Llama (RMSNorm, rotary embeddings, SDPA with the key/value heads repeated for GQA, SwiGLU, no
biases, untied output layer) at the same shape and batch as ``bench/step_time.py`` (a
``--preset`` with its shape overrides, the bench's 2048-piece vocabulary, ``--num-microbatches``
micro-batches of ``--micro-batch-size`` per iteration), fp32 master weights, BF16 autocast with
``--bf16`` (fp32 without), gradients clipped to norm 1 (torchtitan's default ``max_norm``; our
trainer clips alike), AdamW (fused where torch has it for the device), the loss read once per
iteration. Each ``--variants`` entry builds the model afresh (same seed) and times it:

- ``eager``: as written;
- ``compiled``: ``torch.compile`` of each transformer block (torchtitan's per-block compile);
- ``float8-tensorwise`` / ``float8-rowwise``: torchao's float8 training
  (``torchao.float8.convert_to_float8_training`` with that recipe, the output layer left in
  BF16 as torchtitan leaves it), compiled per block; skipped, with a line saying so, where
  torchao does not import or the device has no FP8 tensor cores (capability < 8.9).

Time per iteration is start-to-start of consecutive iterations after ``--warmup`` untimed ones
(the compile happens there), median; TFLOP/s and MFU use the project's FLOP formula
(``megatron_snip.model.llama.flops_per_token``) and its table of peak dense BF16 TFLOP/s.
``--profile VARIANT`` runs ``--profile-steps`` more iterations of that variant under
torch.profiler (its top operators go into the JSON). The process runs ``--threads`` torch threads
(default: all cores, as bench/step_time.py gives one process) and every variant's JSON entry
records the conditions it ran under (bench/conditions.py), which bench/side_by_side.py checks
against our trainer's before it sets the two side by side.
A yardstick, not a second trainer: no data loader, no parallelism, random tokens.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace

import conditions
import torch
import torch.nn.functional as F
from results import write_json
from step_time import BENCH_VOCAB
from timing import StepClock, device_name, peak_memory_gib, peak_memory_reset, profiled
from torch import nn

from megatron_snip.model.presets import PRESETS, LlamaShape

VARIANTS = ("eager", "compiled", "float8-tensorwise", "float8-rowwise")
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later
# The shape flags that override a preset's, as pretrain_llama.py's do (bench/side_by_side.py passes them to both).
SHAPE_OVERRIDES = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
MAX_NORM = 1.0  # gradient clipping, torchtitan's default (and Megatron-LM's --clip-grad)


@dataclass(frozen=True)
class PeerConfig:
    """The model (a preset's shape), the batch (``num_microbatches`` of ``micro_batch_size`` sequences)
    and the compute dtype (``bf16``: autocast to bf16, else fp32)."""

    shape: LlamaShape
    vocab_size: int = BENCH_VOCAB
    micro_batch_size: int = 1
    num_microbatches: int = 8
    bf16: bool = False

    @classmethod
    def from_preset(cls, name: str, num_layers: int | None = None, seq_length: int | None = None,
                    **overrides) -> PeerConfig:
        """A ``megatron_snip.model.presets`` shape, with its fields overridden where given (not None):
        ``num_layers``, ``seq_length`` (and the position embeddings with it), and any of SHAPE_OVERRIDES;
        the other ``overrides`` are this class's fields."""
        shape = {k: v for k in SHAPE_OVERRIDES if (v := overrides.pop(k, None)) is not None}
        if seq_length:
            shape.update(seq_length=seq_length, max_position_embeddings=seq_length)
        return cls(replace(PRESETS[name], **shape, **({"num_layers": num_layers} if num_layers else {})),
                   **overrides)

    def flops_per_iteration(self) -> float:
        """Model FLOPs of one iteration by the project's formula (the trainer bench's figure)."""
        from megatron_snip.model.config import ModelConfig
        from megatron_snip.model.llama import flops_per_token

        s = self.shape
        model = ModelConfig(num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
                            num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
                            seq_length=s.seq_length)
        return flops_per_token(model, self.vocab_size) * self.micro_batch_size * self.num_microbatches * s.seq_length

    def run_conditions(self, variant: str, backend: str) -> conditions.Conditions:
        """What ``variant`` runs under in this process (its torch threads as set now)."""
        s = self.shape
        return conditions.Conditions(
            device=conditions.device_label(), processes=1, threads_per_process=torch.get_num_threads(),
            dtype="fp8" if variant.startswith("float8-") else "bf16" if self.bf16 else "fp32",
            compile=conditions.COMPILE_EAGER if variant == "eager" else backend, recompute="none",
            model=conditions.model_label(s.num_layers, s.hidden_size, s.ffn_hidden_size, s.num_attention_heads,
                                         s.num_query_groups, self.vocab_size),
            seq_length=s.seq_length, micro_batch_size=self.micro_batch_size, num_microbatches=self.num_microbatches,
            flops_per_iteration=self.flops_per_iteration())


# -- the model (torchtitan's llama3 model, trimmed) ------------------------------------------------

def rope_tables(head_dim: int, seq_length: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [seq, head_dim], of the rotary embedding (both halves of a head rotate together)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim] rotated (the half-split layout, as megatron-core's RoPE)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def head_dim(c: LlamaShape) -> int:
    return c.hidden_size // c.num_attention_heads


class Attention(nn.Module):
    def __init__(self, c: LlamaShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_query_groups, head_dim(c)
        self.wq = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, self.kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        repeats = self.heads // self.kv_heads  # torchtitan's repeat_kv
        k, v = (t.repeat_interleave(repeats, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaShape):
        super().__init__()
        self.w1 = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=False)
        self.w3 = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, c: LlamaShape):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.hidden_size, eps=c.norm_epsilon)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.hidden_size, eps=c.norm_epsilon)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c: LlamaShape, vocab_size: int):
        super().__init__()
        self.shape = c
        self.tok_embeddings = nn.Embedding(vocab_size, c.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(c) for i in range(c.num_layers)})
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.norm_epsilon)
        self.output = nn.Linear(c.hidden_size, vocab_size, bias=False)
        cos, sin = rope_tables(head_dim(c), c.seq_length, c.rotary_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)  # the norms
            else:  # the output projections scaled down with depth, as torchtitan does
                scale = 1 / math.sqrt(2 * self.shape.num_layers) if name.endswith(("wo.weight", "w2.weight")) else 1
                nn.init.trunc_normal_(p, std=std * scale, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def compile_blocks(model: Transformer, backend: str = "inductor") -> None:
    """``torch.compile`` each transformer block in place (torchtitan's ``apply_compile``)."""
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True))


def float8_available(device: torch.device) -> str | None:
    """Why torchao's float8 training cannot run here, or None when it can."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # absent, or built for another torch
        return f"torchao does not import ({type(e).__name__}: {e})"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        return "no FP8 tensor cores on this device (CUDA capability >= 8.9 needed)"
    return None


def convert_float8(model: Transformer, recipe: str) -> None:
    """torchao's float8 training of every linear but the output layer (torchtitan's filter)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, fqn: fqn != "output")


def build(config: PeerConfig, variant: str, device: torch.device, backend: str = "inductor",
          seed: int = 0) -> tuple[Transformer, torch.optim.Optimizer]:
    """The model (fp32 weights on ``device``) in ``variant`` and its AdamW."""
    torch.manual_seed(seed)
    with device:  # initialised where it runs: a billion parameters initialised on the host take seconds
        model = Transformer(config.shape, config.vocab_size)
    if variant.startswith("float8-"):
        convert_float8(model, variant.removeprefix("float8-"))
    if variant != "eager":
        compile_blocks(model, backend)
    fused = {"fused": True} if device.type == "cuda" else {}  # torch's fused CUDA kernel, as torchtitan
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    return model, optimizer


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
               bf16: bool = False) -> torch.Tensor:
    """One iteration: forward + backward of every micro-batch ([batch, seq + 1] tokens; loss averaged
    over them; under bf16 autocast with ``bf16``), the gradients clipped to norm MAX_NORM, then the
    optimizer step. Returns the loss as a 0-d tensor (not read: no sync)."""
    device = batches[0].device
    total = torch.zeros((), device=device)
    for tokens in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1)) / len(batches)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def random_batches(config: PeerConfig, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (config.micro_batch_size, config.shape.seq_length + 1), generator=g)
            .to(device) for _ in range(config.num_microbatches)]


def run_variant(config: PeerConfig, variant: str, device: torch.device, iters: int, warmup: int,
                backend: str = "inductor", profile_steps: int = 0) -> dict:
    """Build, warm up (compile) and time one variant: seconds per iteration (median), the losses, the
    warm-up's seconds, the peak memory (GiB, CUDA) and the conditions it ran under; with
    ``profile_steps``, that many more iterations under torch.profiler (``profile``: its table)."""
    model, optimizer = build(config, variant, device, backend)
    batches = random_batches(config, device)
    clock, losses = StepClock(), []
    peak_memory_reset()
    start = time.perf_counter()
    for i in range(iters):
        if i == warmup:
            warmup_seconds = time.perf_counter() - start
        clock.stamp()
        losses.append(train_step(model, optimizer, batches, config.bf16).item())  # one sync per iteration
    clock.stamp()
    result = {"seconds": statistics.median(clock.intervals(warmup)), "warmup_seconds": warmup_seconds,
              "cpu_seconds": statistics.median(clock.intervals(warmup, cpu=True)),
              "losses": losses, "peak_gib": peak_memory_gib(),
              "conditions": config.run_conditions(variant, backend).to_dict()}
    if profile_steps:  # after the timing, which it would slow
        result["profile"] = profiled(lambda m=model, o=optimizer: [train_step(m, o, batches, config.bf16).item()
                                                                   for _ in range(profile_steps)])
    del model, optimizer
    release(device)
    return result


def release(device: torch.device) -> None:
    """Free what a variant left (its compiled graphs, cached blocks) before the next is built."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summarise(config: PeerConfig, measured: dict[str, dict], peak_tflops: float | None) -> tuple[list[str], dict]:
    """Printed lines and JSON figures: each variant's time, TFLOP/s, MFU and memory; float8 as a ratio to
    the compiled BF16 step."""
    flops = config.flops_per_iteration()
    lines, figures = [], {"variants": {}, "flops_per_iteration": flops, "peak_tflops": peak_tflops}
    for name, m in measured.items():
        if "skipped" in m:
            lines.append(f"peer {name:<18}: skipped ({m['skipped']})")
            figures["variants"][name] = m
            continue
        tflops = flops / m["seconds"] / 1e12
        mfu = tflops / peak_tflops if peak_tflops else None
        figures["variants"][name] = {**m, "tflops": tflops, "mfu": mfu}
        memory = "" if m["peak_gib"] is None else f", peak {m['peak_gib']:.1f} GiB"
        lines.append(f"peer {name:<18}: {m['seconds'] * 1e3:9.1f} ms/iteration, {tflops:6.1f} TFLOP/s"
                     + ("" if mfu is None else f", MFU {mfu:.3f}") + f" (warm-up {m['warmup_seconds']:.1f} s{memory})")
    compiled = figures["variants"].get("compiled", {}).get("seconds")
    for name, m in figures["variants"].items():
        if name.startswith("float8-") and "seconds" in m and compiled:
            ratio = compiled / m["seconds"]
            lines.append(f"peer {name} speed-up over compiled bf16: {ratio:.3f}x")
            figures[f"{name}_speedup"] = ratio
    return lines, figures


def main() -> None:
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()
    from megatron_snip.training.logger import peak_tflops

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tinyllama-1.1b", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int, help="override the preset's (e.g. 4 layers of Llama-3-8B)")
    p.add_argument("--seq-length", type=int, help="override the preset's")
    for name in SHAPE_OVERRIDES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help="override the preset's")
    p.add_argument("--vocab-size", type=int, default=BENCH_VOCAB, help="default: the trainer bench's tokenizer's")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--iters", type=int, default=8, help="iterations per variant, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="untimed first iterations (the compile happens there)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: a quick CPU check)")
    p.add_argument("--profile", nargs="+", default=[], choices=VARIANTS, metavar="VARIANT",
                   help="after timing these variants, run --profile-steps more iterations of each under "
                        "torch.profiler: its top operators (printed, and in the JSON)")
    p.add_argument("--profile-steps", type=int, default=1, help="iterations profiled per --profile variant")
    conditions.add_args(p)
    p.add_argument("--peak-tflops", type=float, help="the device's peak dense BF16 TFLOP/s (default: the "
                                                     "project's table for known GPUs)")
    p.add_argument("--json", help="also write the results here (for bench/gpu_suite.py)")
    opts = p.parse_args()
    if opts.iters <= opts.warmup + 1:
        p.error(f"--iters {opts.iters} must exceed --warmup {opts.warmup} + 1 (time at least two iterations)")
    if set(opts.profile) - set(opts.variants):
        p.error(f"--profile {' '.join(sorted(set(opts.profile) - set(opts.variants)))}: not among --variants")
    torch.set_num_threads(conditions.threads_per_process(1, opts.threads))
    config = PeerConfig.from_preset(opts.preset, opts.num_layers, opts.seq_length, vocab_size=opts.vocab_size,
                                    micro_batch_size=opts.micro_batch_size, num_microbatches=opts.num_microbatches,
                                    bf16=opts.bf16, **{k: getattr(opts, k) for k in SHAPE_OVERRIDES})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = config.shape
    print(f"peer: preset {opts.preset}, {shape.num_layers} layers x {shape.hidden_size}, seq {shape.seq_length}, "
          f"vocab {config.vocab_size}, {config.num_microbatches} micro-batches of {config.micro_batch_size}, "
          f"{'bf16' if opts.bf16 else 'fp32'}; {device_name()}; torch {torch.__version__}; "
          f"{opts.iters - opts.warmup} timed iterations", flush=True)
    measured = {}
    for variant in opts.variants:
        why = float8_available(device) if variant.startswith("float8-") else None
        measured[variant] = {"skipped": why} if why else run_variant(
            config, variant, device, opts.iters, opts.warmup, opts.backend,
            opts.profile_steps if variant in opts.profile else 0)
        print(f"  {variant}: done", flush=True)
        # Rewritten after every variant: a run stopped at its time cap (bench/gpu_suite.py) keeps what it timed.
        lines, figures = summarise(config, measured, peak_tflops(opts.peak_tflops))
        write_json(opts.json, {"benchmark": "peer_step", "device": device_name(), "preset": opts.preset,
                               "config": asdict(config), "complete": variant == opts.variants[-1], **figures})
    print("\n".join(lines))
    for variant, m in measured.items():
        if "profile" in m:
            print(f"\n--- profile: peer {variant} ({opts.profile_steps} iteration(s) after the timed ones) ---\n"
                  f"{m['profile']}")


if __name__ == "__main__":
    main()
