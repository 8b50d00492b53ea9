"""A script under ci/ loaded as a module in the test's process: its ``main()`` can then be called
with arguments, with torch and Megatron already imported (a fresh interpreter spends seconds
importing them). A test of its argument checks replaces the script's first real work with
:func:`past_the_check`, so a check that stops refusing fails the test instead of running a
benchmark inside the test process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_script(path: Path, monkeypatch):
    """``path`` loaded as a module (its ``main()`` does not run), undone after the test."""
    spec = importlib.util.spec_from_file_location(f"ci_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    monkeypatch.setattr(sys, "path", list(sys.path))  # some add their folder to it
    spec.loader.exec_module(module)
    return module


def past_the_check(*args, **kwargs):
    raise AssertionError("the script went past its argument checks")
