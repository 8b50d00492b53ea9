"""The standard-library docstrings the corpus is made of; a script with no fp8ops imports.

``corpus.py`` runs this file as ``python -I -S stdlib_docs.py``, a clean interpreter, and reads
the JSON list of documents it prints. It imports only the standard library, so it also runs
where fp8ops is not importable (``-I`` leaves the script's own directory off ``sys.path``).

The module list leaves out modules whose public names or docstrings depend on the platform or
the build (``os``, ``shutil``, ``tempfile``, ``hashlib``, ``decimal``, those with optional SSL
classes) and modules missing from some supported Python (removed by 3.13, added after 3.10), so
the documents are a function of the Python version alone.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

# Sorted, so the documents never depend on the order someone appends in.
STDLIB_MODULES = (
    "abc",
    "argparse",
    "array",
    "ast",
    "base64",
    "bdb",
    "binascii",
    "bisect",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "collections",
    "colorsys",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "dis",
    "doctest",
    "email.message",
    "email.utils",
    "enum",
    "fileinput",
    "fnmatch",
    "fractions",
    "functools",
    "graphlib",
    "gzip",
    "heapq",
    "html.parser",
    "http.cookies",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pdb",
    "pickletools",
    "plistlib",
    "pprint",
    "profile",
    "pstats",
    "pyclbr",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "statistics",
    "string",
    "struct",
    "symtable",
    "tarfile",
    "textwrap",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "typing",
    "unicodedata",
    "unittest",
    "unittest.mock",
    "urllib.parse",
    "warnings",
    "wave",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
)


def stdlib_documents() -> list[str]:
    """One document per docstring, ``"<qualified name>\\n\\n<docstring>"``, in a fixed order.

    A docstring seen before (a name exported by two modules, an alias) is skipped.
    """
    seen: set[str] = set()
    documents = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name, doc in _docstrings(module):
            text = inspect.cleandoc(doc).strip()
            if not text or "\x00" in text or text in seen:
                continue
            seen.add(text)
            documents.append(f"{name}\n\n{text}")
    return documents


def _docstrings(module) -> list[tuple[str, object]]:
    """(qualified name, docstring) of the module and its public classes, methods and functions."""
    out = [(module.__name__, module.__doc__)]
    for name in _public_names(module):
        obj = getattr(module, name, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue  # a constant's __doc__ is its type's
        qualified = f"{module.__name__}.{name}"
        out.append((qualified, obj.__doc__))
        if inspect.isclass(obj):
            # Only what the class itself defines: inherited docstrings would repeat.
            for member_name, member in sorted(vars(obj).items()):
                if member_name.startswith("_"):
                    continue
                if inspect.isroutine(member) or isinstance(member, (classmethod, staticmethod)):
                    out.append((f"{qualified}.{member_name}", member.__doc__))
    # Some C types expose __doc__ as a descriptor, not a string.
    return [(name, doc) for name, doc in out if isinstance(doc, str)]


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(set(names))
    # No __all__: names defined by the module itself (or its C accelerator, e.g. _bisect),
    # not ones it imported.
    own = {module.__name__, "_" + module.__name__}
    return sorted(
        name
        for name in dir(module)
        if not name.startswith("_") and getattr(getattr(module, name), "__module__", None) in own
    )


if __name__ == "__main__":
    # ASCII JSON: the parent reads bytes, whatever this interpreter's stdout encoding is.
    sys.stdout.write(json.dumps(stdlib_documents()))
