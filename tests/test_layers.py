"""Import direction: every arrow between kvmesh's layers points down the picture in
CONTRIBUTING.md ("Layers"), no module reaches itself again through others (no cycles), and a
function-level import of kvmesh code says why it is not at the top.

The walk reads the source with `ast` (nothing is imported), counts imports inside functions
as arrows too (hiding a cycle in a function does not remove it), and resolves
`from kvmesh.x import y` to the module `kvmesh.x.y` when y is one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "proto", "kv", "quant", "worker", "router", "load_tests", "deploy")  # kvmesh.<folder>

# The layer picture: unit -> the units it may import besides itself. A unit is a top-level
# folder, or inside worker/ a subpackage (or the public API module). A module in a unit that
# is missing here (a new module directly under worker/) fails the test until it is placed.
_BELOW_WORKER = {"core", "kv", "quant"}
EVERYTHING = "*"
MAY_IMPORT: dict[str, set[str] | str] = {
    "core": set(),
    "proto": set(),
    "kv": {"core"},
    "quant": {"core"},
    "worker.kernels": _BELOW_WORKER,
    "worker.attention": _BELOW_WORKER | {"worker.kernels"},
    "worker.parallel": _BELOW_WORKER | {"worker.kernels"},
    "worker.model": _BELOW_WORKER | {"worker.kernels", "worker.attention", "worker.parallel"},
    "worker.runner": _BELOW_WORKER | {"worker.kernels", "worker.attention", "worker.parallel", "worker.model"},
    "worker.engine_loop": _BELOW_WORKER | {"worker.kernels", "worker.attention", "worker.parallel", "worker.model",
                                           "worker.runner"},
    "worker.runtime": _BELOW_WORKER | {"worker.kernels", "worker.attention", "worker.parallel", "worker.model",
                                       "worker.runner", "worker.engine_loop"},
    "worker.public_api": {"core", "worker.model", "worker.runtime"},
    "worker.engine_api": _BELOW_WORKER | {"worker.kernels", "worker.attention", "worker.parallel", "worker.model",
                                          "worker.runner", "worker.engine_loop", "worker.runtime"},
    "router": {"core", "proto", "kv", "worker.public_api"},
    # Through public doors only: the cluster through proto and the router's client (and the
    # launcher of a private local cluster), the engine through worker/engine_api.py. Dotted
    # kvmesh.* entries name single modules; the others are units.
    "load_tests": {"core", "proto", "worker.engine_api",
                   "kvmesh.router.client", "kvmesh.router.retry", "kvmesh.router.launch"},
    "deploy": EVERYTHING,  # the composition root: it assembles everything below
}
# A benchmark that measures a component itself reaches that component, and nothing else
# beyond load_tests' doors: module -> (what it may import besides them, why).
COMPONENT_BENCHMARKS: dict[str, tuple[set[str], str]] = {
    "kvmesh.load_tests.routing_sim": (
        {"kv", "router", "worker.engine_loop"},
        "simulates the router's routing and admission policy over real schedulers and KV managers"),
    "kvmesh.load_tests.bench_routing": (
        {"kvmesh.kv.hashing", "router"}, "times the router's own per-request routing work (prefix index, policy)"),
    "kvmesh.load_tests.routing_campaign": (
        {"kvmesh.kv.hashing"}, "the oracle hit rate hashes prompts into blocks as the router does"),
    "kvmesh.load_tests.gpu_check": (
        {"quant", "worker.kernels", "worker.attention"}, "checks each GPU kernel against its torch reference"),
    "kvmesh.load_tests.bench_quant_kernels": ({"quant"}, "times the quantization primitives themselves"),
    "kvmesh.load_tests.bench_speculative": (
        {"worker.runner"}, "times the model runner's forward by the number of verified tokens"),
    "kvmesh.load_tests.bench_engine": (
        {"worker.kernels"}, "the GEMM reference rate uses the engine's own prepacked weights"),
    "kvmesh.load_tests.bench_served": (
        {"worker.public_api"}, "counts the served engine's steps from its worker actors' own metrics"),
    "kvmesh.load_tests.null_engine": (
        {"worker.runtime"}, "the router's own worker actor over a null engine: the serving stack measured alone"),
    "kvmesh.load_tests.avx2_only": (
        {"worker.kernels", "worker.runner"},
        "runs a benchmark as on an AVX2-only CPU: narrows the kernel build's CPU flags and the native-bf16 check"),
}
WORKER_UNITS = ("kernels", "attention", "parallel", "model", "runner", "engine_loop", "runtime", "public_api",
                "engine_api")
# A module whose function-level imports all share one reason (each CLI command loads only what
# it needs) states it once, in a top-level comment line starting with this.
FILE_WIDE_REASON = "# Function-level imports:"


@dataclass(frozen=True)
class ImportLine:
    importer: str  # dotted module name
    imported: str  # dotted module name (a module of the tree when the import names one)
    path: Path
    lineno: int
    in_function: bool
    has_comment: bool  # a `#` comment on the import's line(s), the line just above, or file-wide


def discover_modules(root: Path, folders: Iterable[str]) -> dict[str, Path]:
    """kvmesh.<folder>.<...> -> file, for every .py file of the folders."""
    modules = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules["kvmesh." + ".".join(parts)] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve_relative(module: str, path: Path, level: int, name: str | None) -> str:
    base = module.split(".") if _is_package(path) else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _has_comment(lines: list[str], node: ast.stmt) -> bool:
    end = getattr(node, "end_lineno", node.lineno)
    own = lines[node.lineno - 1:end]
    above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
    return any("#" in line for line in own) or above.startswith("#")


def import_lines(modules: dict[str, Path]) -> list[ImportLine]:
    """Every import of a kvmesh module in the tree, resolved to module names."""
    out = []
    for module, path in modules.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        file_wide_reason = any(line.startswith(FILE_WIDE_REASON) for line in lines)
        tree = ast.parse(text, filename=str(path))
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(node) if n is not node)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = _resolve_relative(module, path, node.level, node.module)
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    targets.append(candidate if candidate in modules else base)
            else:
                continue
            for target in targets:
                if target == "kvmesh" or not target.startswith("kvmesh."):
                    continue
                while target not in modules and target.count(".") > 1:  # kvmesh.x.y.Name -> kvmesh.x.y
                    target = target.rsplit(".", 1)[0]
                out.append(ImportLine(module, target, path, node.lineno, id(node) in in_function,
                                      file_wide_reason or _has_comment(lines, node)))
    return out


def unit_of(module: str) -> str:
    """kvmesh.worker.model.llama -> worker.model; kvmesh.router.app -> router."""
    parts = module.split(".")[1:]
    if parts[0] == "worker" and len(parts) > 1:
        return "worker." + parts[1]
    return parts[0]


def upward_imports(lines: list[ImportLine], may_import=None, component_benchmarks=None) -> list[str]:
    may_import = MAY_IMPORT if may_import is None else may_import
    component_benchmarks = COMPONENT_BENCHMARKS if component_benchmarks is None else component_benchmarks
    problems = []
    for line in lines:
        src, dst = unit_of(line.importer), unit_of(line.imported)
        if src == dst:
            continue
        allowed = may_import.get(src)
        if allowed is not None and allowed != EVERYTHING and line.importer in component_benchmarks:
            allowed = allowed | component_benchmarks[line.importer][0]
        if allowed is None:
            problems.append(f"{line.path}:{line.lineno}: {line.importer} is in no layer ({src}); "
                            f"place it in the picture (tests/test_layers.py, CONTRIBUTING.md)")
        elif allowed != EVERYTHING and dst not in allowed and line.imported not in allowed:
            problems.append(f"{line.path}:{line.lineno}: {line.importer} -> {line.imported} ({src} may not "
                            f"import {dst})")
    return problems


def import_cycles(lines: list[ImportLine]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-imports."""
    graph: dict[str, set[str]] = {}
    for line in lines:
        graph.setdefault(line.importer, set()).add(line.imported)
        graph.setdefault(line.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def unexplained_function_imports(lines: list[ImportLine]) -> list[str]:
    """Function-level imports are for keeping a heavy optional dependency (torch, triton,
    transformers, Ray Serve) out of a light path; each says so in a comment."""
    return sorted({f"{line.path}:{line.lineno}: {line.importer} imports {line.imported} inside a function "
                   f"without a comment saying why" for line in lines if line.in_function and not line.has_comment})


@pytest.fixture(scope="module")
def tree_imports():
    return import_lines(discover_modules(ROOT, FOLDERS))


def test_every_worker_module_sits_in_a_package_of_the_picture():
    loose = sorted(p.name for p in (ROOT / "worker").glob("*.py")
                   if p.name != "__init__.py" and p.stem not in WORKER_UNITS)
    assert not loose, f"worker/ modules outside its packages: {loose}"


def test_no_import_points_up_the_layers(tree_imports):
    problems = upward_imports(tree_imports)
    assert not problems, "\n".join(problems)


def test_no_import_cycles(tree_imports):
    cycles = import_cycles(tree_imports)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_function_level_imports_say_why(tree_imports):
    problems = unexplained_function_imports(tree_imports)
    assert not problems, "\n".join(problems)


# ---- the checker itself, on a synthetic tree -------------------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC = {
    "deploy/__init__.py": "",
    "deploy/cli.py": "from kvmesh.load_tests import bench\n",
    "load_tests/__init__.py": "",
    "load_tests/bench.py": "from kvmesh.worker.engine_api import Engine\nfrom kvmesh.router.client import Client\n",
    "router/client.py": "import kvmesh.core.errors\n",
    "worker/engine_api.py": "from kvmesh.worker.engine_loop.engine import Engine\n",
    "core/__init__.py": "",
    "core/errors.py": "class KvmeshError(Exception):\n    pass\n",
    "kv/__init__.py": "",
    "kv/pool.py": "from kvmesh.core.errors import KvmeshError\n",
    "worker/__init__.py": "",
    "worker/model/__init__.py": "",
    "worker/model/llama.py": "from kvmesh.kv import pool\n",
    "worker/engine_loop/__init__.py": "",
    "worker/engine_loop/engine.py": "from kvmesh.worker.model.llama import *\n",
    "router/__init__.py": "",
    "router/core.py": "import kvmesh.core.errors\n",
}


def _check(root: Path, component_benchmarks=None):
    lines = import_lines(discover_modules(root, ("core", "kv", "worker", "router", "load_tests", "deploy")))
    return (upward_imports(lines, component_benchmarks=component_benchmarks), import_cycles(lines),
            unexplained_function_imports(lines))


def test_checker_passes_a_clean_tree(tmp_path):
    _write(tmp_path, SYNTHETIC)
    assert _check(tmp_path) == ([], [], [])


@pytest.mark.parametrize("rel,text,expected", [
    ("kv/pool.py", "from kvmesh.worker.model import llama\n", "kv may not import worker.model"),
    ("core/errors.py", "import kvmesh.kv.pool\n", "core may not import kv"),
    ("router/core.py", "from kvmesh.worker.engine_loop.engine import Engine\n",
     "router may not import worker.engine_loop"),
    ("worker/model/llama.py", "def f():\n    # lazy\n    from kvmesh.worker.engine_loop import engine\n",
     "worker.model may not import worker.engine_loop"),
    ("worker/stray.py", "from kvmesh.core import errors\n", "is in no layer (worker.stray)"),
    ("load_tests/bench.py", "from kvmesh.worker.engine_loop.engine import Engine\n",
     "load_tests may not import worker.engine_loop"),
    ("load_tests/bench.py", "from kvmesh.router.core import x\n", "load_tests may not import router"),
    ("load_tests/bench.py", "def f():\n    # lazy\n    from kvmesh.deploy import cli\n",
     "load_tests may not import deploy"),
])
def test_checker_fails_on_an_upward_import(tmp_path, rel, text, expected):
    _write(tmp_path, {**SYNTHETIC, rel: text})
    upward, _, _ = _check(tmp_path)
    assert any(expected in p for p in upward), upward


def test_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    _write(tmp_path, {**SYNTHETIC, "kv/hashing.py": "def h():\n    from kvmesh.kv import pool  # lazy\n",
                      "kv/pool.py": "from kvmesh.kv.hashing import h\n"})
    upward, cycles, unexplained = _check(tmp_path)
    assert upward == [] and unexplained == []
    assert cycles == [["kvmesh.kv.hashing", "kvmesh.kv.pool"]]


def test_checker_wants_a_reason_for_a_function_level_import(tmp_path):
    _write(tmp_path, {**SYNTHETIC, "kv/hashing.py": "def h():\n    from kvmesh.core import errors\n"})
    _, _, unexplained = _check(tmp_path)
    assert len(unexplained) == 1 and "kvmesh.kv.hashing imports kvmesh.core.errors" in unexplained[0]
    _write(tmp_path, {"kv/hashing.py": FILE_WIDE_REASON + " keeps torch out of h's callers\n"
                                       "def h():\n    from kvmesh.core import errors\n"})
    assert _check(tmp_path)[2] == []


def test_a_component_benchmark_reaches_only_its_named_component(tmp_path):
    _write(tmp_path, {**SYNTHETIC, "load_tests/sim.py": "from kvmesh.router import core\nfrom kvmesh.kv import pool\n"})
    assert len(_check(tmp_path)[0]) == 2  # no exception: both arrows are refused
    named = {"kvmesh.load_tests.sim": ({"router"}, "simulates the router's policy")}
    upward, _, _ = _check(tmp_path, component_benchmarks=named)
    assert len(upward) == 1 and "load_tests may not import kv" in upward[0]


def test_every_component_benchmark_exists_and_says_why():
    modules = discover_modules(ROOT, ("load_tests",))
    for module, (_, reason) in COMPONENT_BENCHMARKS.items():
        assert module in modules and len(reason) > 20, module
