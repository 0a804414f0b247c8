"""Loading a GGUF to the first generated token: lmport against llama.cpp's server, on the same files, one run.

Files: the default model's shipped Q4_1 GGUF, Q4_K_M and Q6_K made from it with
`llama-quantize --allow-requantize IN OUT TYPE`, and a ~1.1B-parameter random-weight Llama (TinyLlama's
shape with the default model's vocabulary: written F16 by gguf's own writer, one tensor at a time, then
`llama-quantize` to Q4_K_M; nothing from a hub), all made once under LMPORT_CACHE/benchmark-models (never
in the repository), plus any --files given (--skip-1b leaves the large one out). Per file and engine,
alternating for --repeats rounds, each round twice:

- cold: the file evicted from the page cache first (posix_fadvise DONTNEED), so it is read from disk;
- warm: right after, the file's pages cached.

A round is one fresh process from start to its first generated token: lmport is a Python process
that builds an Engine (cpu backend, a 16-block KV cache) and generates one token; llama.cpp is
`llama-server -m FILE -t THREADS -c 512`, asked for one token as soon as /health answers. Measured by
the parent: wall seconds to the first token, the child's peak RSS (its own VmHWM: read by the
parent from /proc before ending llama-server, printed by the lmport child as it ends) and the bytes it
wrote to disk (``os.wait4``'s ru_oublock). The Python process's own floor (``lmport.engine.engine`` imported, no
model) is measured too and printed beside lmport's RSS, and lmport's RSS at its first token split into anonymous
and file-backed memory beside the weights and KV cache it holds. The cpu kernels are built (once per CPU and source
version, as llama.cpp is built beforehand) before the first round, so that no round times the compiler. Targets checked
in the table: peak RSS at most 1.3x the file's tensor bytes plus the KV cache, nothing written, cold
first token within 3x llama.cpp's. The machine is named in the output (CPU model, the SIMD flags that
matter, cores, memory, a measured read bandwidth: lmport/bench/machine.py; the load average before and after): on a
shared machine timings drift, so only one run's ratios mean much.

llama.cpp is not vendored: pass its bin directory (--llama-bin or LMPORT_LLAMA_CPP_BIN).

Run: python benchmarks/load.py [--repeats 5] [--skip-1b] [--only NAME ...] [--files A.gguf ...] [--files-only]
     [--out benchmarks/results/load.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lmport.bench.client import LLAMA_SERVING, served_url
from lmport.bench.machine import spread

LMPORT_CHILD = r"""
import sys
from lmport import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
engine = Engine(sys.argv[1], EngineConfig(device_type="cpu", cache_max_entry_count=16))
engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=1, ignore_eos=True))
while not any(out.finished for out in engine.step()):
    pass
print("kv_bytes", engine.plan.cache_bytes, "weight_bytes", engine.weight_bytes, flush=True)
print("peak_rss_bytes", {VMHWM}, "rss_anon_bytes", {RSSANON}, "rss_file_bytes", {RSSFILE})
"""
FLOOR_CHILD = "import lmport.engine.engine\nprint('peak_rss_bytes', {VMHWM})"
# The cpu backend's kernels are compiled once per CPU and source version (llama.cpp's are built beforehand
# too): built here before any round, so that no round times the compiler.
BUILD_CHILD = ("from lmport.backends.cpu import kernels\n"
               "assert kernels.load() is not None, 'the cpu kernels did not build'")


# A process's own peak RSS (VmHWM, kB). Not ``wait4``'s ru_maxrss: Linux carries the forking parent's RSS into
# the child's maximum across exec, and this parent has torch imported. And its RSS now: anonymous memory (what it
# allocated) and file-backed (a mapped file's pages it reads, its libraries).
VMHWM, RSSANON, RSSFILE = (f"int(next(l for l in open('/proc/self/status') if l.startswith('{field}')).split()[1]) "
                           f"* 1024" for field in ("VmHWM", "RssAnon", "RssFile"))
LMPORT_CHILD = LMPORT_CHILD.replace("{VMHWM}", VMHWM).replace("{RSSANON}", RSSANON).replace("{RSSFILE}", RSSFILE)
FLOOR_CHILD = FLOOR_CHILD.replace("{VMHWM}", VMHWM)


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measured(cmd: list[str], until=None, log: Path | None = None) -> dict:
    """Run ``cmd``; ``until(proc)`` (if given) returns once the first token is out, then the process is ended.
    With ``log``, the process's output goes there rather than to a pipe read here."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w") if log else subprocess.PIPE,
                            stderr=subprocess.STDOUT if log else subprocess.DEVNULL, text=True)
    out = ""
    if until is None and log is None:
        out = proc.stdout.read() if proc.stdout else ""
    else:
        until(proc)
    seconds = time.perf_counter() - start
    peak = None
    if until is not None:
        peak = peak_rss(proc.pid)
        proc.terminate()
    _, status, usage = os.wait4(proc.pid, 0)
    if until is None and status != 0:
        raise RuntimeError(f"{cmd[:3]} exited with {status}")
    words = out.split()
    extra = {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 2) if words[i].endswith("_bytes")}
    peak = extra.pop("peak_rss_bytes", peak)
    return {"seconds": seconds, "peak_rss": peak, "written": usage.ru_oublock * 512, **extra}


def lmport_round(path: Path) -> dict:
    return measured([sys.executable, "-c", LMPORT_CHILD, str(path)])


def llama_round(bin_dir: Path, path: Path, threads: int) -> dict:
    log = Path(tempfile.mkdtemp(prefix="lmport-load-")) / "llama-server.log"

    def first_token(proc):
        url = served_url(proc, log, time.monotonic() + 600, LLAMA_SERVING)
        while True:
            if proc.poll() is not None:
                raise RuntimeError("llama-server exited before answering")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.01)
        body = json.dumps({"prompt": "Hi", "n_predict": 1}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{url}/completion", body), timeout=120).read()

    return measured([str(bin_dir / "llama-server"), "-m", str(path), "-t", str(threads), "-c", "512",
                     "--host", "127.0.0.1", "--port", "0"], first_token, log)


# TinyLlama-1.1B's shape; the default model's tokenizer (49,152 tokens), copied into the file.
LLAMA_1B = dict(hidden=2048, inter=5632, layers=22, heads=32, kv_heads=4, context=2048)


def random_llama_1b(bin_dir: Path, tokenizer_source: Path, cache: Path) -> Path:
    """The ~1.1B random-weight Llama as Q4_K_M (F16 written by gguf's writer, then llama-quantize)."""
    import gguf
    import numpy as np
    target = cache / "random-llama-1.1b-Q4_K_M.gguf"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / "random-llama-1.1b-F16.gguf"
    c = LLAMA_1B
    d = c["hidden"] // c["heads"]
    vocab_fields = {k: f for k, f in gguf.GGUFReader(tokenizer_source).fields.items() if k.startswith("tokenizer.")}
    vocab = len(vocab_fields["tokenizer.ggml.tokens"].data)
    shapes = {"token_embd.weight": (vocab, c["hidden"]), "output_norm.weight": (c["hidden"],),
              "output.weight": (vocab, c["hidden"])}
    for i in range(c["layers"]):
        shapes |= {f"blk.{i}.attn_norm.weight": (c["hidden"],), f"blk.{i}.ffn_norm.weight": (c["hidden"],),
                   f"blk.{i}.attn_q.weight": (c["hidden"], c["hidden"]),
                   f"blk.{i}.attn_k.weight": (c["kv_heads"] * d, c["hidden"]),
                   f"blk.{i}.attn_v.weight": (c["kv_heads"] * d, c["hidden"]),
                   f"blk.{i}.attn_output.weight": (c["hidden"], c["hidden"]),
                   f"blk.{i}.ffn_gate.weight": (c["inter"], c["hidden"]),
                   f"blk.{i}.ffn_up.weight": (c["inter"], c["hidden"]),
                   f"blk.{i}.ffn_down.weight": (c["hidden"], c["inter"])}
    w = gguf.GGUFWriter(f16, "llama")
    w.add_name("random-llama-1.1b")
    w.add_block_count(c["layers"])
    w.add_context_length(c["context"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["inter"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(d)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in vocab_fields.items():
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():   # tensor infos first, data streamed after: one tensor in memory at a time
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for shape in shapes.values():
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    w.close()
    subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(target), "Q4_K_M"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    f16.unlink()
    return target


def machine(bin_dir: Path, threads: int) -> dict:
    """What the figures were taken on (lmport/bench/machine.py): CPU model and flags, cores, load, memory and a
    measured read bandwidth; and llama.cpp's version."""
    from lmport.bench.machine import cpu_info, memory_bandwidth
    try:
        version = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True,
                                 timeout=30).stderr.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        version = "unknown"
    return {**cpu_info(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "bandwidth": memory_bandwidth(threads), "llama_cpp": version}


def requantize(bin_dir: Path, source: Path, kind: str, cache: Path) -> Path:
    target = cache / f"{source.stem.split('.')[0]}-{kind}.gguf"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(target), kind],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def summary(rounds: list[dict], key: str) -> str:
    return spread([r[key] for r in rounds], ".2f")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LMPORT_LLAMA_CPP_BIN", "/work/cache/llama.cpp/build/bin"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--files", nargs="*", default=[])
    ap.add_argument("--skip-1b", action="store_true", help="leave out the ~1.1B random Llama")
    ap.add_argument("--only", nargs="*", default=None, help="file names (as printed) to run, of those made")
    ap.add_argument("--files-only", action="store_true",
                    help="only the --files given: make none of the default model's (no llama-quantize needed)")
    ap.add_argument("--out", default="benchmarks/results/load.json")
    args = ap.parse_args()
    bin_dir = Path(args.llama_bin)

    from lmport.models.loader import cache_root, resolve_model_path
    from lmport.weights import gguf
    shipped = resolve_model_path("smollm2")
    cache = cache_root() / "benchmark-models"
    made = [] if args.files_only else [
        shipped, *(requantize(bin_dir, shipped, k, cache) for k in ("Q4_K_M", "Q6_K")),
        *([] if args.skip_1b else [random_llama_1b(bin_dir, shipped, cache)])]
    files = [*made, *map(Path, args.files)]
    if args.only is not None:
        files = [f for f in files if f.name in args.only]
    results = {"machine": machine(bin_dir, args.threads), "kernel_build": measured([sys.executable, "-c", BUILD_CHILD]),
               "python_floor": measured([sys.executable, "-c", FLOOR_CHILD]),
               "repeats": args.repeats, "threads": args.threads, "files": []}
    floor = results["python_floor"]
    for path in files:
        tensor_bytes = sum(t.nbytes for t in gguf.read(path).tensors)
        runs: dict[str, list[dict]] = {f"{e} {w}": [] for e in ("llama.cpp", "lmport") for w in ("cold", "warm")}
        for _ in range(args.repeats):
            for engine in ("llama.cpp", "lmport"):
                for when in ("cold", "warm"):
                    if when == "cold":
                        evict(path)
                    r = llama_round(bin_dir, path, args.threads) if engine == "llama.cpp" else lmport_round(path)
                    runs[f"{engine} {when}"].append(r)
                    print(f"{path.name} {engine} {when}: {r['seconds']:.2f} s, peak RSS {r['peak_rss'] / 2 ** 20:.0f} "
                          f"MiB, written {r['written'] / 2 ** 20:.1f} MiB", flush=True)   # a cut-short run keeps these
        results["files"].append({"file": path.name, "file_bytes": path.stat().st_size, "tensor_bytes": tensor_bytes,
                                 "runs": runs})

    results["load_average_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))

    mib = 2 ** 20
    m = results["machine"]
    print(f"machine: {m['model']} ({', '.join(m['kernel_flags'])}), {m['cores']} cores, "
          f"{m['memory_bytes'] / 2 ** 30:.0f} GiB, read bandwidth {m['bandwidth']['median_gbs']:.1f} GB/s "
          f"({m['bandwidth']['threads']} threads); llama.cpp {m['llama_cpp']}; load average before "
          f"{m['load_average']}, after {results['load_average_after']}")
    print(f"cpu kernels loaded (built if this source version was not) before the rounds: "
          f"{results['kernel_build']['seconds']:.2f} s")
    print(f"python floor (lmport.engine.engine imported, no model): {floor['seconds']:.2f} s, "
          f"peak RSS {floor['peak_rss'] / mib:.0f} MiB")
    print("| file | tensor MiB | engine | first token s, median (min-max) | peak RSS MiB, median (min-max) | "
          "RSS / (tensors + KV) | written MiB |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for f in results["files"]:
        for name, rounds in f["runs"].items():
            rss = [r["peak_rss"] / mib for r in rounds]
            kv = statistics.median(r.get("kv_bytes", 0) for r in rounds)
            ratio = statistics.median(rss) * mib / (f["tensor_bytes"] + kv)
            print(f"| {f['file']} | {f['tensor_bytes'] / mib:.1f} | {name} | {summary(rounds, 'seconds')} | "
                  f"{spread(rss, '.0f')} | {ratio:.2f}x | "
                  f"{statistics.median(r['written'] for r in rounds) / mib:.1f} |")
        cold = {e: statistics.median(r["seconds"] for r in f["runs"][f"{e} cold"]) for e in ("llama.cpp", "lmport")}
        print(f"| {f['file']} | | cold first token, lmport / llama.cpp | {cold['lmport'] / cold['llama.cpp']:.1f}x | "
              f"| | |")
    print(f"({args.repeats} rounds, engines alternating, {args.threads} threads; JSON in {args.out})")
    for f in results["files"]:   # what lmport's memory holds once it has generated (the warm rounds' medians)
        anon, file, weights, kv = (statistics.median(r[k] for r in f["runs"]["lmport warm"]) / mib
                                   for k in ("rss_anon_bytes", "rss_file_bytes", "weight_bytes", "kv_bytes"))
        print(f"{f['file']}: lmport's RSS at its first token: {anon:.0f} MiB anonymous, {file:.0f} MiB file-backed; "
              f"it holds {weights:.0f} MiB of weights (those not copied out of the file are read in place) and a "
              f"{kv:.0f} MiB KV cache")


if __name__ == "__main__":
    main()
