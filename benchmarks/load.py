"""Loading a GGUF to the first generated token: lmport against llama.cpp's server, on the same files, one run.

Files: the default model's shipped Q4_1 GGUF, and Q4_K_M and Q6_K made from it with
`llama-quantize --allow-requantize IN OUT TYPE` (cached under LMPORT_CACHE/benchmark-models), plus
any --files given. Per file and engine, alternating for --repeats rounds, each round twice:

- cold: the file evicted from the page cache first (posix_fadvise DONTNEED), so it is read from disk;
- warm: right after, the file's pages cached.

A round is one fresh process from start to its first generated token: lmport is a Python process
that builds an Engine (cpu backend, a 16-block KV cache) and generates one token; llama.cpp is
`llama-server -m FILE -t THREADS -c 512`, asked for one token as soon as /health answers. Measured by
the parent: wall seconds to the first token, the child's peak RSS and the bytes it wrote to disk
(``os.wait4``'s ru_maxrss and ru_oublock). The Python process's own floor (interpreter, torch and
transformers imported, no model) is measured too and printed beside lmport's RSS.

llama.cpp is not vendored: pass its bin directory (--llama-bin or LMPORT_LLAMA_CPP_BIN).

Run: python benchmarks/load.py [--repeats 5] [--files A.gguf ...] [--out benchmarks/results/load.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LMPORT_CHILD = r"""
import sys
from lmport import EngineConfig, GenerationConfig
from lmport.engine import Engine
engine = Engine(sys.argv[1], EngineConfig(device_type="cpu", cache_max_entry_count=16))
engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=1, ignore_eos=True))
while not any(out.finished for out in engine.step()):
    pass
print("kv_bytes", engine.plan.cache_bytes, "weight_bytes", engine.weight_bytes, flush=True)
"""
FLOOR_CHILD = "import torch, transformers, lmport.engine"


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measured(cmd: list[str], until=None) -> dict:
    """Run ``cmd``; ``until(proc)`` (if given) returns once the first token is out, then the process is ended."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = ""
    if until is None:
        out = proc.stdout.read() if proc.stdout else ""
    else:
        until(proc)
    seconds = time.perf_counter() - start
    if until is not None:
        proc.terminate()
    _, status, usage = os.wait4(proc.pid, 0)
    if until is None and status != 0:
        raise RuntimeError(f"{cmd[:3]} exited with {status}")
    words = out.split()
    extra = {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 2) if words[i].endswith("_bytes")}
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024, "written": usage.ru_oublock * 512, **extra}


def lmport_round(path: Path) -> dict:
    return measured([sys.executable, "-c", LMPORT_CHILD, str(path)])


def llama_round(bin_dir: Path, path: Path, threads: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    def first_token(proc):
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
                     "--host", "127.0.0.1", "--port", str(port)], first_token)


def requantize(bin_dir: Path, source: Path, kind: str, cache: Path) -> Path:
    target = cache / f"{source.stem.split('.')[0]}-{kind}.gguf"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(target), kind],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def summary(rounds: list[dict], key: str) -> str:
    values = [r[key] for r in rounds]
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LMPORT_LLAMA_CPP_BIN", "/work/cache/llama.cpp/build/bin"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--files", nargs="*", default=[])
    ap.add_argument("--out", default="benchmarks/results/load.json")
    args = ap.parse_args()
    bin_dir = Path(args.llama_bin)

    from lmport.models.loader import cache_root, resolve_model_path
    from lmport.weights import gguf
    shipped = resolve_model_path("smollm2")
    files = [shipped, *(requantize(bin_dir, shipped, k, cache_root() / "benchmark-models") for k in ("Q4_K_M", "Q6_K")),
             *map(Path, args.files)]
    floor = measured([sys.executable, "-c", FLOOR_CHILD])
    results = {"python_floor": floor, "files": []}
    for path in files:
        tensor_bytes = sum(t.nbytes for t in gguf.read(path).tensors)
        runs: dict[str, list[dict]] = {f"{e} {w}": [] for e in ("llama.cpp", "lmport") for w in ("cold", "warm")}
        for _ in range(args.repeats):
            for engine in ("llama.cpp", "lmport"):
                for when in ("cold", "warm"):
                    if when == "cold":
                        evict(path)
                    runs[f"{engine} {when}"].append(llama_round(bin_dir, path, args.threads) if engine == "llama.cpp"
                                                    else lmport_round(path))
        results["files"].append({"file": path.name, "file_bytes": path.stat().st_size, "tensor_bytes": tensor_bytes,
                                 "runs": runs})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))

    mib = 2 ** 20
    print(f"python floor (torch, transformers, lmport imported): {floor['seconds']:.2f} s, "
          f"peak RSS {floor['peak_rss'] / mib:.0f} MiB")
    print("| file | tensor MiB | engine | first token s, median (min-max) | peak RSS MiB | written MiB |")
    print("|---|---:|---|---:|---:|---:|")
    for f in results["files"]:
        for name, rounds in f["runs"].items():
            rss = [r["peak_rss"] / mib for r in rounds]
            print(f"| {f['file']} | {f['tensor_bytes'] / mib:.1f} | {name} | {summary(rounds, 'seconds')} | "
                  f"{statistics.median(rss):.0f} | {statistics.median(r['written'] for r in rounds) / mib:.1f} |")
    print(f"({args.repeats} rounds, engines alternating; JSON in {args.out})")


if __name__ == "__main__":
    main()
