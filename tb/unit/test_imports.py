"""Dependencies point one way.

    flashnpu (config, errors) <- golden <- hdl <- sim <- {tb, driver, scripts}

Every module of the package directories is read with ``ast`` (module- and
function-level imports, relative ones resolved) and each project import is
checked: a lower layer never imports a higher one, product code (everything
but ``tb``) never imports ``tb``, the driver never imports ``scripts``, and no
module imports a name starting with ``_`` from another package.
``flashnpu/cli.py``, the entry point, is exempt: it dispatches to the
sub-command modules by string.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> package (pyproject's package-dir)
PACKAGES = {"flashnpu": "flashnpu", "golden": "flashnpu.golden", "hdl": "flashnpu.hdl",
            "sim": "flashnpu.sim", "tb": "flashnpu.tb", "driver": "flashnpu.driver",
            "scripts": "flashnpu.scripts"}
LAYER = {"flashnpu": 0, "flashnpu.golden": 1, "flashnpu.hdl": 2, "flashnpu.sim": 3,
         "flashnpu.tb": 4, "flashnpu.driver": 4, "flashnpu.scripts": 4}
EXEMPT = {"flashnpu/cli.py"}


def package_of(module: str) -> str | None:
    """The top-level package (``LAYER`` key) a dotted module belongs to."""
    parts = module.split(".")
    if parts[0] != "flashnpu":
        return None
    if len(parts) > 1 and f"flashnpu.{parts[1]}" in LAYER:
        return f"flashnpu.{parts[1]}"
    return "flashnpu"


def module_name(rel: Path) -> str:
    pkg = PACKAGES[rel.parts[0]]
    rest = list(rel.with_suffix("").parts[1:])
    if rest and rest[-1] == "__init__":
        rest.pop()
    return ".".join([pkg, *rest])


def imports(source: str, module: str, is_package: bool):
    """(line, imported module, imported names) of every import in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            yield node.lineno, base, [a.name for a in node.names]


def violations(rel: str, source: str) -> list[str]:
    """Every backwards or forbidden import of the file ``rel`` (relative to the root)."""
    path = Path(rel)
    if rel in EXEMPT:
        return []
    module = module_name(path)
    own = package_of(module)
    out = []
    for line, target, names in imports(source, module, path.name == "__init__.py"):
        dep = package_of(target)
        if dep is None:
            continue
        # `from flashnpu.sim import runner` names a module of the package
        where = f"{rel}:{line}"
        if LAYER[dep] > LAYER[own] or (dep == "flashnpu.tb" and own != "flashnpu.tb"):
            out.append(f"{where}: {own} (layer {LAYER[own]}) imports {target} (layer {LAYER[dep]})")
        elif own == "flashnpu.driver" and dep == "flashnpu.scripts":
            out.append(f"{where}: the driver imports {target}")
        if dep != own:
            private = [n for n in names if n.startswith("_")]
            if private or any(p.startswith("_") and p != "__init__" for p in target.split(".")[1:]):
                out.append(f"{where}: imports private {private or target} from {dep}")
    return out


def project_files() -> list[Path]:
    return sorted(p.relative_to(ROOT) for d in PACKAGES for p in (ROOT / d).rglob("*.py"))


def test_every_package_is_read():
    files = {p.parts[0] for p in project_files()}
    assert files == set(PACKAGES), files


def test_dependencies_point_one_way():
    bad = []
    for rel in project_files():
        bad += violations(rel.as_posix(), (ROOT / rel).read_text())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.parametrize("rel,source,expect", [
    ("golden/flash.py", "from flashnpu.hdl.pe import Pe\n", "golden/flash.py:1: flashnpu.golden (layer 1)"),
    ("hdl/x.py", "def f():\n    from flashnpu.sim import runner\n", "hdl/x.py:2: flashnpu.hdl"),
    ("hdl/x.py", "from ..sim.runner import build\n", "imports flashnpu.sim.runner"),
    ("sim/x.py", "import flashnpu.tb.helpers\n", "imports flashnpu.tb.helpers"),
    ("scripts/x.py", "from flashnpu.tb.helpers import pack\n", "imports flashnpu.tb.helpers"),
    ("driver/x.py", "from flashnpu.scripts import bench\n", "the driver imports flashnpu.scripts"),
    ("driver/x.py", "from flashnpu.sim.cli import _config\n", "imports private ['_config']"),
    ("flashnpu/errors.py", "from flashnpu.golden import numerics\n", "flashnpu (layer 0)"),
])
def test_backwards_imports_are_caught(rel, source, expect):
    found = violations(rel, source)
    assert any(expect in v for v in found), found


@pytest.mark.parametrize("rel,source", [
    ("sim/x.py", "from flashnpu.hdl.npu import NPU\nfrom . import runner\n"),
    ("tb/unit/x.py", "from flashnpu.sim.packing import pack\nfrom flashnpu.tb.helpers import stream_put\n"),
    ("hdl/x.py", "from flashnpu.hdl.pe import _bits\n"),          # private, same package
    ("flashnpu/cli.py", "from flashnpu.sim import cli\n"),        # the entry point
])
def test_allowed_imports_pass(rel, source):
    assert violations(rel, source) == []
