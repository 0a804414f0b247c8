"""The GPU kit's entry: everything the cuda backend must show on an NVIDIA GPU, in one command.

On the GPU machine, from the repository root (``tools/gpu/carry`` beside it, from wheels.py)::

    python3 tools/gpu/run.py --out $OUT                       # every step, within --budget seconds
    python3 tools/gpu/run.py --out $OUT --steps env,graphs    # some of them

Without a GPU (the dry run, ``make gpu-dry-run``): ``--dry-run`` runs the cuda backend under TRITON_INTERPRET=1
on this venv's packages; a step that needs a GPU is skipped with its reason, after a toy-size run of its code.

It installs ``carry/wheels`` into ``--site`` (skipped when that already holds this set), links the repository's
``lmport/`` and ``lmport/backends/`` there as the package ``lmport`` (with lmport's entry points, so the backends are
found), puts that first on PYTHONPATH (the machine's own torch, Triton and transformers stay), then runs each
step (steps.py) as its own process with a time limit. A step that fails, times out or crashes is recorded and
the next one runs. ``--out`` receives three files (the device returns at most eight):

    run.json     every step: status, seconds, reason, its data; and the machine
    run.md       the table of steps (what summary.py turns into docs/cuda.md's tables reads run.json)
    logs.tar.gz  each step's log and files (junit XML, the kernel benchmark's JSON)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WHEELS = HERE / "carry" / "wheels"

# (name, seconds it may take at most, what it checks)
STEPS = (
    ("env", 120, "GPU, driver, torch, Triton, transformers; every requirement of lmport met; backends probed"),
    ("conformance", 420, "tests/conformance -k cuda, slow cases too, natively (no TRITON_INTERPRET): fp16/bf16/fp32"),
    ("parity", 360, "greedy tokens against transformers on the same GPU and dtype: tiny Llama, Qwen2, Qwen3, "
                    "Mistral, Gemma 3, Qwen3-MoE and the default model, in fp32/bf16/fp16"),
    ("graphs", 300, "eager_mode=False (captured decode steps) gives eager's tokens; decode step time at batch "
                    "1/8/64, eager against replay"),
    ("plan", 180, "`lmport plan --json` against the engine's weights, blocks, cache bytes and measured reserve"),
    ("kernels", 420, "lmport bench kernels cuda (decode/prefill attention, KV fill, policies 0/8/4) and int4/int8 "
                     "linear, as fractions of a device-to-device copy measured in the same run"),
    ("throughput", 540, "Llama-3-8B-shaped bf16 engine, mixed workload: lmport (eager, graphs) against "
                        "transformers generate and generate_batch"),
    ("quant", 420, "quant_policy 8 and 4 against 0 on the same cache bytes, where the cache bounds concurrency"),
    ("limits", 480, "against the card's copy bandwidth and matmul peak: Llama-3-8B-shaped decode at batch 1/64/256 "
                    "and prefill of 8 x 2048, bfloat16, fp8 weights and fp8 KV; decode attention at 4k/32k against "
                    "SDPA and flex_attention"),
)


def install_wheels(site: Path, dry_run: bool) -> str:
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return f"no wheels in {WHEELS.relative_to(ROOT)} (run tools/gpu/wheels.py where pip has an index)"
    names = "\n".join(w.name for w in wheels)
    stamp = site / ".lmport-wheels"
    if stamp.exists() and stamp.read_text() == names:
        return f"{len(wheels)} wheels already in {site}"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *map(str, wheels)]
    if dry_run:   # this interpreter is not the GPU's 3.12: install for it anyway, to check the command
        cmd[4:4] = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                                  "manylinux2014_x86_64", "manylinux_2_17_x86_64") for a in ("--platform", p)]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install of the wheel set failed:\n{proc.stdout}\n{proc.stderr}")
    stamp.write_text(names)
    return f"{len(wheels)} wheels installed into {site}"


def link_package(pkg: Path) -> None:
    """``pkg/lmport``: the repository's lmport/ and lmport/backends/ as installed (files linked, so edits show at once),
    and a dist-info with lmport's entry points (the registry finds backends through them)."""
    shutil.rmtree(pkg, ignore_errors=True)
    for src, dst in ((ROOT / "lmport", pkg / "lmport"),):
        for path in src.rglob("*"):
            if "__pycache__" in path.parts or path.is_dir():
                continue
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = pkg / f"lmport-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lmport\nVersion: {project['version']}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in project["dependencies"]))
    eps = project["entry-points"]["lmport.backends"]
    (info / "entry_points.txt").write_text(
        "[console_scripts]\nlmport = lmport.entrypoints.cli:main\n\n[lmport.backends]\n"
        + "".join(f"{k} = {v}\n" for k, v in eps.items()))


def run_step(name: str, limit: float, work: Path, env: dict, extra: list[str]) -> dict:
    sdir = work / name
    shutil.rmtree(sdir, ignore_errors=True)
    sdir.mkdir(parents=True)
    log = sdir / "log.txt"
    cmd = [sys.executable, str(HERE / "steps.py"), name, "--work", str(sdir), *extra]
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = round(time.monotonic() - start, 1)
    result_file = sdir / "result.json"
    if code is None:
        result = {"status": "timeout", "reason": f"stopped at its limit of {limit:.0f}s"}
        if result_file.exists():
            result["partial"] = json.loads(result_file.read_text())
    elif result_file.exists():
        result = json.loads(result_file.read_text())
    else:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        result = {"status": "failed", "reason": f"exited {code} without a result: {' | '.join(tail)[:600]}"}
    result.update(step=name, seconds=seconds)
    return result


def table(results: list[dict]) -> str:
    lines = ["| step | status | seconds | reason |", "|---|---|---|---|"]
    for r in results:
        reason = str(r.get("reason", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['step']} | {r['status']} | {r.get('seconds', 0):.1f} | {reason[:300]} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="where run.json, run.md and logs.tar.gz go ($OUT)")
    ap.add_argument("--steps", default=",".join(s[0] for s in STEPS), help="comma-separated, in this order")
    ap.add_argument("--budget", type=float, default=560, help="seconds for all steps (a device call: 600)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lmport-gpu/work"), help="logs and step files")
    ap.add_argument("--site", type=Path, default=Path("/tmp/lmport-gpu/site"), help="where the wheels go")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/lmport-gpu/cache"),
                    help="models and Triton's cache, kept between calls on a machine that stays up")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the interpreter, GPU-only steps at toy size")
    ap.add_argument("--default-model", default=None, help="the default model's GGUF, where this machine has it")
    ap.add_argument("--quick", action="store_true", help="fewer kernel shapes")
    ap.add_argument("--layers", type=int, default=32, help="layers of the Llama-3-8B-shaped model (32: all)")
    ap.add_argument("--requests", type=int, default=512, help="requests of the throughput and quant steps")
    ap.add_argument("--models", default=None, help="comma-separated: the parity step's models only (llama, qwen2, "
                                                   "qwen3, mistral, gemma3, qwen3-moe, default, and the newer "
                                                   "families of kit_models.NEWER_ARCHS)")
    ap.add_argument("--parts", default=None, help="comma-separated: the limits step's parts only (bfloat16, fp8_kv, "
                                                  "attention, fp8_weights, profile)")
    ap.add_argument("--dtypes", default=None, help="comma-separated: the parity step's dtypes only (float32, "
                                                   "bfloat16, float16)")
    ap.add_argument("--tests", default=None, help="the conformance step's cases only: a pytest -k expression, "
                                                  "e.g. 'fill_kv_cache or sweep'")
    args = ap.parse_args()
    t0 = time.monotonic()
    wanted = [s for s in args.steps.split(",") if s]
    unknown = set(wanted) - {s[0] for s in STEPS}
    if unknown:
        ap.error(f"unknown steps {sorted(unknown)}; the steps: {', '.join(s[0] for s in STEPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONUNBUFFERED="1", LMPORT_CACHE=str(args.cache), TRITON_CACHE_DIR=str(args.cache / "triton"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    results = []
    setup_start = time.monotonic()
    try:
        note = install_wheels(args.site, args.dry_run)
        link_package(args.work / "pkg")
        paths = [str(args.work / "pkg")] + ([] if args.dry_run else [str(args.site)])
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        results.append({"step": "install", "status": "passed", "reason": note + "; lmport linked from the tree",
                        "seconds": round(time.monotonic() - setup_start, 1)})
    except Exception as exc:
        results.append({"step": "install", "status": "failed", "reason": str(exc)[:1000],
                        "seconds": round(time.monotonic() - setup_start, 1)})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "build" / "none")])
    extra = [f"--layers={args.layers}", f"--requests={args.requests}"] + (["--quick"] if args.quick else [])
    if args.default_model:
        extra.append(f"--default-model={args.default_model}")
    if args.models:
        extra.append(f"--models={args.models}")
    if args.tests:
        extra.append(f"--tests={args.tests}")
    if args.dtypes:
        extra.append(f"--dtypes={args.dtypes}")
    if args.parts:
        extra.append(f"--parts={args.parts}")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
        extra.append("--smoke")
    for name, limit, _ in STEPS:
        if name not in wanted:
            continue
        left = args.budget - (time.monotonic() - t0)
        if left < 15:
            results.append({"step": name, "status": "skipped", "seconds": 0.0,
                            "reason": f"out of the {args.budget:.0f}s budget; run it with --steps {name}"})
            continue
        print(f"[{time.monotonic() - t0:6.0f}s] {name} (limit {min(limit, left):.0f}s)", flush=True)
        results.append(run_step(name, min(limit, left), args.work, env, extra))
        r = results[-1]
        print(f"         {r['status']} in {r['seconds']}s {str(r.get('reason', ''))[:200]}", flush=True)
    run = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "dry_run": args.dry_run,
           "argv": sys.argv[1:], "seconds": round(time.monotonic() - t0, 1),
           "what": {name: what for name, _, what in STEPS}, "steps": results}
    (args.out / "run.json").write_text(json.dumps(run, indent=2, default=str))
    (args.out / "run.md").write_text(f"# GPU kit run{' (dry run)' if args.dry_run else ''}\n\n{table(results)}\n")
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(args.work.rglob("*")):
            if path.is_file() and "pkg" not in path.relative_to(args.work).parts[:1]:
                tar.add(path, arcname=str(path.relative_to(args.work)))
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
