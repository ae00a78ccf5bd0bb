"""The package's shape holds: sizes, import direction, and docs that cover every module.

``scripts/check_shape.py`` states the rules (module <= 450 lines, class <= 250, function
<= 60, no import cycle between modules or between sub-packages, TYPE_CHECKING and
function-local imports included); this runs it on the package, and on small packages
built to break each rule, so the checker itself is seen to catch what it claims.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "omnistage"


def _checker():
    spec = importlib.util.spec_from_file_location("check_shape", ROOT / "scripts/check_shape.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_shape"] = module
    spec.loader.exec_module(module)
    return module


check_shape = _checker()


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_package_keeps_its_shape():
    assert check_shape.problems(PACKAGE) == []


def test_a_module_cycle_through_a_type_checking_import_is_found(tmp_path):
    root = _package(
        tmp_path,
        {
            "a.py": "from pkg import b\n",
            "b.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import x\n",
        },
    )
    assert "module cycle: pkg.a pkg.b" in check_shape.problems(root)


def test_a_cycle_between_sub_packages_is_found(tmp_path):
    root = _package(
        tmp_path,
        {
            "x/__init__.py": "",
            "x/one.py": "from pkg.y.two import f\n",
            "y/__init__.py": "",
            "y/two.py": "def f():\n    from pkg.x import one\n",
        },
    )
    found = check_shape.problems(root)
    assert "package cycle: pkg.x pkg.y" in found


def test_a_long_function_and_a_long_module_are_found(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    root = _package(tmp_path, {"long.py": f"def f():\n{body}\n" + "\n" * 400})
    found = check_shape.problems(root)
    assert any("function f 62 lines" in line for line in found)
    assert any("long.py: module" in line for line in found)


# layout.md lists every module with a line; architecture.md tells how they work together,
# and names each by its path relative to omnistage/, so neither falls behind the package.
@pytest.mark.parametrize("doc", ["docs/layout.md", "docs/architecture.md"])
def test_the_docs_name_every_module(doc):
    text = (ROOT / doc).read_text()
    modules = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent == PACKAGE
    )
    missing = [m for m in modules if f"`{m}`" not in text]
    assert missing == [], f"{doc} does not name: {', '.join(missing)}"
