"""Every dotted `raychat.` name that a docstring, comment or preset mentions exists: a module, or an attribute of
one. Names whose first part is not a module of the package (a label such as raychat.io/stage, a JSON field
such as raychat.offset) are not references to code and are left alone."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import raychat

ROOT = Path(raychat.__file__).parent
DOTTED = re.compile(r"\braychat(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
MODULES = {m.name for m in pkgutil.iter_modules([str(ROOT)])}


def resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_raychat_name_in_the_package_resolves():
    missing = {}
    for path in sorted([*ROOT.rglob("*.py"), *ROOT.rglob("*.yaml")]):
        for name in set(DOTTED.findall(path.read_text())):
            if name.split(".")[1] in MODULES and not resolves(name):
                missing.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    assert missing == {}
