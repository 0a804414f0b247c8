"""Test models and files made once into lmport's cache, safely when pytest workers race to make the same one."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def own_tmp(path: Path) -> Path:
    """A name beside ``path`` that is this process's alone: pytest workers making the same cached file at once each
    write their own and rename it into place (a whole file either way)."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def save_once(target: Path, *parts) -> None:
    """Each of ``parts`` saved (``save_pretrained``) into ``target`` through a sibling directory renamed into
    place, so that no reader (another pytest worker) sees it half written; of two writers, the first rename wins."""
    tmp = own_tmp(target)
    for part in parts:
        part.save_pretrained(tmp)
    move_into_place(tmp, target)


def move_into_place(tmp: Path, target: Path) -> None:
    """The directory ``tmp`` renamed to ``target``; where another worker's got there first, ``tmp`` removed."""
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
