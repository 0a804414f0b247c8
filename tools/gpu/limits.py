"""The GPU kit's ``limits`` step: the cuda backend against the card's own limits, each measured in the same run.

- The ceilings: a device-to-device copy's bandwidth (bytes read + written) and a large bfloat16 matmul's FLOP/s.
- The engine's model step on a Llama-3-8B-shaped model (random weights) in three forms: bfloat16; fp8 weights in
  128 x 128 blocks (the layout DeepSeek-V3 and Qwen3-FP8 ship, written from the same weights); the bfloat16 model
  over an fp8 KV cache. For each, the decode step at batch 1, 64 and 256 (1024 tokens of context, CUDA graphs as
  the engine runs them) as ms, tokens/s and the copy bandwidth's fraction that the step's least traffic takes (the
  weights a token reads, the embedding table's rows aside, and the batch's cache); and the prefill of 8 x 2048
  tokens as TFLOP/s (the linear layers' and the causal attention's) and its fraction of the matmul's.
- Decode attention at 4k and 32k tokens of context: lmport's paged kernel over a 16-bit and an fp8 cache against
  SDPA and ``flex_attention`` (compiled, no mask) on contiguous K/V of the same shapes.

Figures are the model step (``ModelRunner.execute``: metadata, the forward or its graph, the logits rows), without
the scheduler and sampling around it. Without a GPU (``--smoke``) every part runs at toy size under the
interpreter, so the code cannot rot; no figure of that run is a measurement.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import kit_models

GPU = torch.cuda.is_available()
CONTEXT = 1024
DECODE_BATCHES = (1, 64, 256)
PREFILL = (8, 2048)    # sequences, tokens each
ATTENTION = ((16, 4096), (4, 32768))   # (batch, context) of the attention comparison


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def decode_step_input(batch: int, kv_len: int, block_size: int):
    from lmport.worker.runner import StepInput
    per = -(-kv_len // block_size)
    return StepInput([7] * batch, [1] * batch, [kv_len] * batch,
                     [list(range(s * per, (s + 1) * per)) for s in range(batch)], list(range(batch)))


def prefill_step_input(seqs: int, tokens: int, block_size: int):
    from lmport.worker.runner import StepInput
    per = -(-tokens // block_size)
    ids = torch.randint(3, 1000, (seqs * tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    return StepInput(ids, [tokens] * seqs, [tokens] * seqs, [list(range(s * per, (s + 1) * per)) for s in range(seqs)],
                     [(s + 1) * tokens - 1 for s in range(seqs)])


def time_steps(runner, step, iters: int, warmup: int = 3) -> float:
    """Median ms of ``runner.execute(step)`` to the device's end."""
    for _ in range(warmup):
        runner.execute(step)
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.execute(step)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_ms(fn) -> float:
    """Median ms of ``fn``: Triton's do_bench on a GPU (CUDA events, the L2 flushed), a few host-timed calls off one."""
    if GPU:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=100, rep=400, return_mode="median"))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def ceilings() -> dict:
    n, size = (8192, 2 ** 30) if GPU else (64, 2 ** 20)
    a = torch.randn(n, n, device=kit_device(), dtype=torch.bfloat16)
    b = torch.randn_like(a)
    x = torch.empty(size, dtype=torch.uint8, device=kit_device())
    y = torch.empty_like(x)
    return {"copy_bytes_per_s": 2 * size / (bench_ms(lambda: y.copy_(x)) * 1e-3),
            "matmul_flops_per_s": 2 * n ** 3 / (bench_ms(lambda: a @ b) * 1e-3),
            "copy": f"{size} bytes, device to device, counting read and write", "matmul": f"{n}^3 bfloat16, random"}


def kit_device() -> str:
    return "cuda" if GPU else "cpu"


# -- the model in three forms --------------------------------------------------------------------------------------
def fp8_dir(source: Path) -> Path:
    """``source`` (bfloat16) with every projection's weight as e4m3 codes and a scale per 128 x 128 block
    (``quant_method: "fp8"``, as DeepSeek-V3's config), quantized as tests/test_weights_fp8.py's writer does."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    target = source.with_name(source.name + "-fp8-block")
    if (target / "config.json").exists():
        return target
    writer = kit_models.test_module("test_weights_fp8")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(shard), "pt", device=kit_device()) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                module, _, kind = name.rpartition(".")
                if kind == "weight" and module.rsplit(".", 1)[-1] in writer.PROJECTIONS:
                    tensors |= {f"{module}.{k}": v.contiguous() for k, v in writer.quantize_for("fp8-block", t).items()}
                else:
                    tensors[name] = t
        save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp / shard.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard.name)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = writer.quantization_config("fp8-block")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(target)
    return target


def linear_params(config: dict) -> int:
    """Weights a token multiplies by in a Llama-shaped model's layers (attention and MLP projections)."""
    h, ffn, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads"))
    d = config.get("head_dim") or h // heads
    return config["num_hidden_layers"] * (h * d * (2 * heads + 2 * kv) + 3 * h * ffn)


def prefill_flops(config: dict, seqs: int, tokens: int) -> float:
    """The linear layers' products for every token, the LM head's for each sequence's last, and causal attention
    (QK and PV over each token's earlier tokens and itself)."""
    h, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // heads
    pairs = seqs * tokens * (tokens + 1) / 2
    return (2 * linear_params(config) * seqs * tokens + 2 * h * config["vocab_size"] * seqs
            + 4 * layers * heads * d * pairs)


def model_rows(variant: str, model: Path, ceiling: dict, smoke: bool, **config) -> list[dict]:
    import lmport
    from lmport import EngineConfig
    from lmport.backends.cuda import CudaBackend
    hf = json.loads((model / "config.json").read_text())
    batches, context, (seqs, tokens) = ((1, 3), 64, (2, 64)) if smoke else (DECODE_BATCHES, CONTEXT, PREFILL)
    blocks = max(batches) * -(-context // 64) + 64
    cfg = EngineConfig(device_type="cuda", dtype="bfloat16" if GPU else "float32", max_batch_size=max(batches),
                       max_prefill_token_num=seqs * tokens, cache_max_entry_count=blocks, eager_mode=False, **config)
    rows = []
    start = time.perf_counter()
    with lmport.pipeline(str(model), backend_config=cfg, backend=CudaBackend(device=kit_device())) as pipe:
        runner = pipe.engine.runner
        load_s = time.perf_counter() - start
        weights = runner.allocation()["weight_bytes"]
        table = hf["vocab_size"] * hf["hidden_size"] * 2   # the embedding table: a step reads only its rows
        for b in batches:
            runs = getattr(runner.graphs, "runs", 0)
            ms = time_steps(runner, decode_step_input(b, context, runner.layout.block_size), 5 if smoke else 30)
            least = weights - table + b * context * runner.layout.bytes_per_token
            rows.append({"variant": variant, "kind": "decode", "batch": b, "context": context, "ms": round(ms, 3),
                         "tokens_per_s": round(b / ms * 1e3, 1), "least_bytes": int(least),
                         "copy_fraction": round(least / (ms * 1e-3) / ceiling["copy_bytes_per_s"], 3),
                         "graphs": getattr(runner.graphs, "runs", 0) > runs, "weight_bytes": weights,
                         "cache_bytes_per_token": runner.layout.bytes_per_token, "load_s": round(load_s, 1)})
            print(json.dumps(rows[-1]), flush=True)
        ms = time_steps(runner, prefill_step_input(seqs, tokens, runner.layout.block_size), 2 if smoke else 5,
                        warmup=1 if smoke else 2)
        flops = prefill_flops(hf, seqs, tokens)
        rows.append({"variant": variant, "kind": "prefill", "batch": seqs, "tokens": tokens, "ms": round(ms, 2),
                     "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "flops": flops,
                     "matmul_fraction": round(flops / (ms * 1e-3) / ceiling["matmul_flops_per_s"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    if GPU:
        torch.cuda.empty_cache()
    return rows


# -- decode attention against torch's --------------------------------------------------------------------------------
def attention_rows(ceiling: dict, smoke: bool) -> list[dict]:
    from torch.nn.attention.flex_attention import flex_attention

    from lmport.backends.cuda import CudaBackend
    from lmport.bench.cuda_kernels import Shape
    backend = CudaBackend(device=kit_device())
    flex = torch.compile(flex_attention, dynamic=False) if GPU else flex_attention
    rows = []
    for batch, context in (((2, 64),) if smoke else ATTENTION):
        for policy in (0, "fp8"):
            shape = Shape("decode", batch, 1, context, 32, 8, 128, policy)  # type: ignore[arg-type]
            rows += attention_shape_rows(shape.tiny() if smoke else shape, backend, flex, ceiling)
    return rows


def attention_shape_rows(shape, backend, flex, ceiling: dict) -> list[dict]:
    """One decode shape: lmport's paged kernel and, over a 16-bit cache, torch's on contiguous K/V [B, H, L, D]."""
    import math

    import torch.nn.functional as F

    from lmport.bench.cuda_kernels import build, work
    dtype = torch.bfloat16 if GPU else torch.float32
    cache, meta, q, _, _ = build(shape, dtype, torch.device(kit_device()))
    scale = 1 / math.sqrt(shape.head_dim)
    calls = {"lmport paged": lambda: backend.paged_attention(q, cache, meta, scale)}
    if not shape.policy:
        qs = q.view(shape.batch, 1, shape.q_heads, shape.head_dim).transpose(1, 2).contiguous()
        ks = torch.randn(shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim, device=q.device, dtype=dtype)
        vs = torch.randn_like(ks)
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
        calls["flex_attention"] = lambda: flex(qs, ks, vs, scale=scale, enable_gqa=True)
    moved = work(shape, dtype)[0]
    rows = []
    for name, fn in calls.items():
        row = {"batch": shape.batch, "context": shape.kv_len, "cache": "fp8" if shape.policy else "bf16",
               "method": name, "bytes": moved}
        try:
            ms = bench_ms(fn)
            row.update(ms=round(ms, 4), copy_fraction=round(moved / (ms * 1e-3) / ceiling["copy_bytes_per_s"], 3))
        except Exception as exc:   # a torch path this machine's build lacks: said, the rest still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode_profile(model: Path, smoke: bool) -> list[dict]:
    """Where a batch-1 decode step's device time goes: the eager step under torch's profiler, each kernel's time
    a step (the graph replays the same kernels without their launches)."""
    import lmport
    from lmport import EngineConfig
    from lmport.backends.cuda import CudaBackend
    from torch.profiler import ProfilerActivity, profile
    steps, context = (2, 64) if smoke else (10, CONTEXT)
    cfg = EngineConfig(device_type="cuda", dtype="bfloat16" if GPU else "float32", max_batch_size=1,
                       cache_max_entry_count=-(-context // 64) + 4, eager_mode=True)
    with lmport.pipeline(str(model), backend_config=cfg, backend=CudaBackend(device=kit_device())) as pipe:
        runner = pipe.engine.runner
        step = decode_step_input(1, context, runner.layout.block_size)
        time_steps(runner, step, 2)
        with profile(activities=[ProfilerActivity.CUDA] if GPU else [ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.execute(step)
            sync()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0) if GPU else event.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": event.key[:120], "calls_per_step": event.count / steps,
                         "ms_per_step": round(us / steps / 1e3, 4)})
    rows.sort(key=lambda r: -r["ms_per_step"])
    print(json.dumps(rows[:25], indent=1), flush=True)
    return rows[:40]


PARTS = ("bfloat16", "fp8_kv", "attention", "fp8_weights", "profile")


def run(args) -> dict:
    """The parts ``args.parts`` names (all by default) in turn; each finished part is kept in ``work/result.json``
    as it ends, so a step stopped at its limit still reports what it measured."""
    smoke = not GPU
    parts = args.parts or PARTS
    partial = Path(args.work) / "result.json"
    data: dict = {"device": torch.cuda.get_device_name(0) if GPU else "cpu (interpreter: not a measurement)"}

    def keep(key: str, value) -> None:
        data[key] = value
        partial.write_text(json.dumps({"step": "limits", "status": "failed", "reason": "stopped before its end",
                                       "data": data}, indent=2, default=str))

    keep("ceilings", ceiling := ceilings())
    print(json.dumps(ceiling), flush=True)
    model = kit_models.llama3_8b_dir(args.layers) if GPU else kit_models.small_llama_dir()
    keep("model", {"path": str(model), **kit_models.describe(str(model))})
    forms = {"bfloat16": lambda: model_rows("bfloat16", model, ceiling, smoke),
             "fp8_kv": lambda: model_rows("fp8 KV cache", model, ceiling, smoke, quant_policy="fp8"),
             "attention": lambda: attention_rows(ceiling, smoke),
             "fp8_weights": lambda: model_rows("fp8 weights (128 x 128 blocks)", fp8_dir(model), ceiling, smoke),
             "profile": lambda: decode_profile(model, smoke)}
    for part in parts:
        keep(part, forms[part]())
    return data
