"""The wheels lmport needs on the GPU machine that its image lacks, for CPython 3.12 manylinux x86_64.

Run here (where pip reaches an index), from the repository root::

    .venv/bin/python tools/gpu/wheels.py            # download the pinned set, then check it
    .venv/bin/python tools/gpu/wheels.py --lock     # first re-pin requirements.txt from this venv

Everything goes to ``tools/gpu/carry/`` (ignored by git; the device call names it in ``carry``): the wheels
in ``carry/wheels/`` and, in ``carry/smollm2/``, the default model's config and tokenizer without its weights
(the GPU machine builds a random-weight model of the same shape from them, and the tiny models use the
tokenizer). The wheels are ``tools/gpu/requirements.txt``: lmport's runtime dependencies and openai
(the server tests' client), with their own dependencies, minus what ``image.txt`` says the GPU image already
has, each pinned to the version this venv runs (the versions the tests pass with). ``--lock`` recomputes that
closure from this venv, evaluating markers for Python 3.12 on Linux x86_64.

The check (always run after a download, or alone with ``--check``):

1. the set is under 60 MiB and holds one version of each project;
2. pip's resolver, with ``--no-index`` and only this folder plus stand-ins for the image's packages (empty
   wheels named and versioned as ``image.txt`` says; this venv's version where it says '?'), installs lmport's
   requirements for Python 3.12 into an empty target: every requirement of every carried wheel is met by the
   set or the image, and every carried wheel is used;
3. the command the GPU machine runs (``pip install --no-index --no-deps --target ... wheels/*.whl``) installs
   the set into another empty target.

It prints a table of the wheels and the three results, and exits non-zero if any fails.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CARRY = HERE / "carry"             # the folder a device call names in ``carry``
WHEELS = CARRY / "wheels"
TOKENIZER = CARRY / "smollm2"      # the default model's config and tokenizer (its weights stay here)
LOCK = HERE / "requirements.txt"
IMAGE = HERE / "image.txt"
LIMIT_MIB = 60

PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_5_x86_64")
TARGET_FLAGS = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
                "--abi", "cp312", "--abi", "abi3", "--abi", "none", *[a for p in PLATFORMS for a in ("--platform", p)]]
# Markers as they evaluate on the GPU machine.
MARKER_ENV = {"python_version": PYTHON_VERSION, "python_full_version": PYTHON_VERSION + ".3",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "platform_python_implementation": "CPython", "implementation_name": "cpython", "os_name": "posix",
              "extra": ""}
# Beyond lmport's [project.dependencies]: what the suite run on the GPU imports that the image lacks.
EXTRA_TOPLEVEL = ("openai",)
# In the image, but carried anyway: fastapi, pydantic and openai need releases newer than an image may hold, and
# both are backward compatible within their major version (the carried copy comes first on sys.path).
CARRY_ANYWAY = {"typing-extensions", "anyio"}


def image_packages() -> dict[str, str | None]:
    """{canonical name: version, or None where image.txt says '?'}."""
    out: dict[str, str | None] = {}
    for line in IMAGE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition(" ")
            out[canonicalize_name(name)] = None if version.strip() in ("", "?") else version.strip()
    return out


def image_meets(req: Requirement, version: str | None) -> bool:
    """Whether the image's copy meets ``req`` (assumed where image.txt gives no version)."""
    return version is None or req.specifier.contains(version, prereleases=True)


def lmport_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]] + [Requirement(r) for r in EXTRA_TOPLEVEL]


def applies(req: Requirement) -> bool:
    return req.marker is None or Marker(str(req.marker)).evaluate(MARKER_ENV)


def lock() -> list[str]:
    """The closure of lmport's requirements not in the image, at this venv's versions."""
    image = image_packages()
    pins: dict[str, str] = {}
    todo = [r for r in lmport_requirements() if applies(r)]
    missing = []
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in pins or (name in image and name not in CARRY_ANYWAY and image_meets(req, image[name])):
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            missing.append(str(req))
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            missing.append(f"{req} (this venv has {dist.version})")
            continue
        pins[name] = dist.version
        todo.extend(r for r in map(Requirement, dist.requires or []) if applies(r))
    if missing:
        sys.exit("not installed in this venv at a matching version, so not pinned: " + ", ".join(missing))
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())]
    header = ["# The wheels tools/gpu/wheels.py carries to the GPU machine (written by `wheels.py --lock`:",
              "# lmport's requirements and openai with their closure, minus image.txt, at this venv's versions)."]
    LOCK.write_text("\n".join(header + lines) + "\n")
    return lines


def pinned() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version
    return out


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        sys.exit(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc


def export_default_model() -> None:
    """The default model's config, generation config and tokenizer, as transformers saves them (about 3.5 MB)."""
    sys.path.insert(0, str(ROOT))
    from lmport.models.loader import DEFAULT_MODEL, load_tokenizer, read_model_config
    tmp = TOKENIZER.with_name(TOKENIZER.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    load_tokenizer(DEFAULT_MODEL).save_pretrained(tmp)
    read_model_config(DEFAULT_MODEL).save_pretrained(tmp)
    shutil.rmtree(TOKENIZER, ignore_errors=True)
    tmp.rename(TOKENIZER)


def download() -> None:
    WHEELS.mkdir(parents=True, exist_ok=True)
    pip("download", "--no-deps", *TARGET_FLAGS, "-d", str(WHEELS), "-r", str(LOCK))
    # One version of each project: drop what an earlier lock left behind.
    want = pinned()
    for whl in WHEELS.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(whl.name)
        if want.get(name) != str(version):
            whl.unlink()


def write_stub_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """An empty wheel that only says it is ``name`` ``version`` (and what it requires)."""
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    path = folder / f"{stem}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *[f"Requires-Dist: {r}\n" for r in requires]])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{stem}.dist-info/METADATA", meta)
        z.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{stem}.dist-info/RECORD", "")
    return path


def installed(target: Path) -> dict[str, str]:
    out = {}
    for info in target.glob("*.dist-info"):
        text = (info / "METADATA").read_text(errors="replace")
        name = re.search(r"^Name: (.+)$", text, re.M)
        version = re.search(r"^Version: (.+)$", text, re.M)
        if name and version:
            out[canonicalize_name(name.group(1).strip())] = version.group(1).strip()
    return out


def check() -> bool:
    wheels = sorted(WHEELS.glob("*.whl"))
    ok = True
    rows = []
    for whl in wheels:
        name, version, _, tags = parse_wheel_filename(whl.name)
        rows.append((name, str(version), sorted({t.platform for t in tags})[0], whl.stat().st_size))
    total = sum(r[3] for r in rows)
    print(f"{'wheel':28s} {'version':16s} {'platform':24s} {'KiB':>8s}")
    for name, version, plat, size in sorted(rows, key=lambda r: -r[3]):
        print(f"{name:28s} {version:16s} {plat:24s} {size / 1024:8.0f}")
    names = [r[0] for r in rows]
    dupes = sorted({n for n in names if names.count(n) > 1})
    missing = sorted(set(pinned()) - set(names))
    size_ok = total < LIMIT_MIB * 2 ** 20
    print(f"\n1. {len(wheels)} wheels, {total / 2 ** 20:.1f} MiB (limit {LIMIT_MIB} MiB): "
          f"{'ok' if size_ok else 'TOO LARGE'}; one version each: {'ok' if not dupes else dupes}; "
          f"all pins downloaded: {'ok' if not missing else missing}")
    ok &= size_ok and not dupes and not missing

    image = image_packages()
    with tempfile.TemporaryDirectory(prefix="lmport-wheels-") as tmp:
        stubs, target, target2 = Path(tmp, "image"), Path(tmp, "target"), Path(tmp, "target2")
        stubs.mkdir()
        assumed = {}
        carried = set(names)
        for name, version in image.items():
            if name in carried:
                continue
            if version is None:
                try:
                    version = md.version(name)
                except md.PackageNotFoundError:
                    version = "0"
                assumed[name] = version
            write_stub_wheel(stubs, name, version)
        # lmport itself as a stand-in carrying its real requirement list (its code travels with the tree).
        write_stub_wheel(stubs, "lmport", "0.1.0", [str(r) for r in lmport_requirements()])
        proc = pip("install", "--no-index", "--no-compile", "--find-links", str(WHEELS), "--find-links", str(stubs),
                   "--target", str(target), *TARGET_FLAGS, "lmport==0.1.0", check=False)
        got = installed(target) if proc.returncode == 0 else {}
        unused = sorted(set(names) - set(got))
        from_image = sorted(n for n in got if n not in carried and n != "lmport")
        resolved = proc.returncode == 0 and not unused
        print(f"2. resolver, --no-index, Python {PYTHON_VERSION}, this folder + image stand-ins: "
              f"{'ok' if resolved else 'FAILED'}: {len(set(got) & carried)} carried wheels and "
              f"{len(from_image)} image packages meet every requirement"
              + (f"; unused wheels: {unused}" if unused else ""))
        used_assumed = sorted(n for n in from_image if n in assumed)
        if used_assumed:
            print("   image packages whose version image.txt does not know (this venv's taken; the env step "
                  "checks them on the machine): " + ", ".join(f"{n} {assumed[n]}" for n in used_assumed))
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
        ok &= resolved

        cmd = ["install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(target2),
               *TARGET_FLAGS, *map(str, wheels)]
        proc = pip(*cmd, check=False)
        got2 = installed(target2)
        direct = proc.returncode == 0 and set(got2) == set(names)
        print(f"3. pip {' '.join(cmd[:6])} <empty dir> wheels/*.whl (the GPU machine's command): "
              f"{'ok' if direct else 'FAILED'}: {len(got2)} distributions installed")
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
        ok &= direct
    print(f"\nwheel set {WHEELS.relative_to(ROOT)}: {'complete' if ok else 'NOT complete'}")
    files = [f for f in CARRY.rglob("*") if f.is_file()]
    print(f"{CARRY.relative_to(ROOT)}: {len(files)} files, {sum(f.stat().st_size for f in files) / 2 ** 20:.1f} MiB "
          f"(default model files: {sorted(f.name for f in TOKENIZER.glob('*')) or 'none'})")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lock", action="store_true", help="re-pin requirements.txt from this venv first")
    ap.add_argument("--check", action="store_true", help="only check the folder (no download)")
    args = ap.parse_args()
    if args.lock:
        print("\n".join(lock()))
    if not args.check:
        download()
        export_default_model()
    if not check():
        sys.exit(1)
    # The wheel set, the shape of the device call that carries it:
    print('device call: carry ["tools/gpu/carry"], command "python3 tools/gpu/run.py --out $OUT"')


if __name__ == "__main__":
    main()
