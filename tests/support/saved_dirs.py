"""Test models and files made once into lmport's cache, safely when pytest workers race to make the same one."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def save_once(target: Path, *parts) -> None:
    """Each of ``parts`` saved (``save_pretrained``) into ``target`` through a sibling directory renamed into
    place, so that no reader (another pytest worker) sees it half written; of two writers, the first rename wins."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    for part in parts:
        part.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
