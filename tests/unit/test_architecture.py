"""ARCHITECTURE.md is kept true: every import of the package follows its "May import:" lines, no module imports
in a cycle, raychat imports sit at module top, and every import is a declared dependency (and every declared
dependency is imported)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "platform" / "raychat"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, whether inside a function, line) for every absolute import of a file; `from raychat.x
    import y` yields raychat.x.y (a module or a name in raychat.x)."""
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, in_function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                out.extend((f"{child.module}.{a.name}", in_function, child.lineno) for a in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return out


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def allowed() -> dict[str, set[str]]:
    """{top-level package: packages it may import} from the bullets of ARCHITECTURE.md."""
    rules = {}
    text = (REPO / "ARCHITECTURE.md").read_text().split("\n## Names")[0]  # the bullets of packages
    for bullet in re.findall(r"^- \*\*(\w+)\*\*:(.*?)(?=^- |\Z)", text, re.M | re.S):
        name, body = bullet
        may = re.search(r"May import:(.*?)\.\s*$", " ".join(body.split()))
        assert may, f"ARCHITECTURE.md: {name} has no 'May import:' line"
        items = may.group(1).strip()
        rules[name] = set() if items == "nothing" else {x.strip() for x in items.split(",")}
    return rules


def top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "cli"


def test_every_top_level_package_is_described():
    described = set(allowed())
    present = {top(m) for m in MODULES if m != "raychat"} - {"presets"}
    assert present <= described, f"not in ARCHITECTURE.md: {sorted(present - described)}"
    assert described <= present | {"cli"}, f"described but absent: {sorted(described - present)}"


def test_imports_follow_the_stated_direction():
    rules, wrong = allowed(), []
    for name, path in MODULES.items():
        src = top(name) if name != "raychat" else None
        for imported, _, line in imports(path):
            if not imported.startswith("raychat."):
                continue
            dst = top(resolve(imported) or imported)
            if src and dst != src and dst not in rules.get(src, set()):
                wrong.append(f"{path.relative_to(REPO)}:{line} {src} imports {dst}")
    assert not wrong, "imports against ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for imported, _, _ in imports(path):
            target = resolve(imported) if imported.startswith("raychat.") else None
            # a package's __init__ re-exporting its own modules is not a cycle of ideas
            if target and target != name and not target.startswith(name + "."):
                graph[name].add(target)
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongconnect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
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
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def calls_by_function(attribute: str) -> set[str]:
    """Where the package calls a method named `attribute` (x.attribute(...)): a set of "module:function", the
    innermost enclosing function ("<module>" at top level)."""
    found = set()

    def visit(node, module, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr == attribute
            ):
                found.add(f"{module}:{function}")
            visit(child, module, inner)

    for name, path in MODULES.items():
        visit(ast.parse(path.read_text()), name, "<module>")
    return found


def test_one_forward_backward():
    """One function runs a step's micro-batches for pretraining, SFT and RL (the Trainer and the RL Learner
    call it with their loss components): no second backward loop, no second use of DDP's no_sync."""
    assert calls_by_function("backward") == {"raychat.train.step:forward_backward"}
    assert calls_by_function("no_sync") == {"raychat.train.step:forward_backward"}


def test_one_run_section():
    """Pretraining, SFT and RL share one run section (init_from: the run's starting checkpoint) and one
    checkpoint section: no config class of raychat.config declares those options a second time."""
    owners: dict[str, set] = {"init_from": set(), "checkpoint_every": set(), "keep_checkpoints": set()}
    for name, path in MODULES.items():
        if name.startswith("raychat.config."):
            for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", None) in owners:
                        owners[stmt.target.id].add(f"{name}:{cls.name}")
    assert owners == {
        "init_from": {"raychat.config.train:RunSection"},
        "checkpoint_every": {"raychat.config.train:CheckpointSection"},
        "keep_checkpoints": {"raychat.config.train:CheckpointSection"},
    }


CHECKPOINT_NAMES = re.compile(r"checkpoint_\*|^checkpoint_$|commit\.json")


def test_one_newest_rule():
    """Which directories are checkpoints, which are committed and which is newest is decided in one module:
    no other module of the package names the checkpoint_ pattern or the commit marker in its code
    (docstrings aside), so none can glob, sort or pick checkpoints by a rule of its own."""
    found = set()
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
        }  # fmt: skip
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and CHECKPOINT_NAMES.search(node.value)
            ):
                found.add(name)
    assert found == {"raychat.checkpoint_manager"}


def definitions() -> list[tuple[str, str, str]]:
    """(module, "class" | "def", name) of every class and function (methods included) of the package."""
    out = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.append((module, "class", node.name))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((module, "def", node.name))
    return out


def test_one_meaning_per_name():
    """Issue 25's names: the engine's Scheduler is the only scheduler (RL dispatches rollouts, the optimizer
    has an lr schedule); `evaluate` means measuring a model on held-out data (eval/ and RL), a task grades
    with is_correct and the Trainer runs validators; placement is a layout everywhere (no topology, no
    cluster section); the engine's files are named after what they hold; data/ is corpus / loader / replay."""
    defs = definitions()
    schedulers = {(m, n) for m, kind, n in defs if kind == "class" and "Scheduler" in n}
    assert schedulers == {("raychat.engine.scheduler", "Scheduler")}, schedulers
    evaluates = {m for m, kind, n in defs if kind == "def" and n == "evaluate"}
    assert evaluates and all(m.startswith(("raychat.eval.", "raychat.rl.")) for m in evaluates), evaluates
    assert not [(m, n) for m, _, n in defs if re.search(r"Evaluator|Topology|ClusterSection", n)]
    names = {m.rsplit(".", 1)[-1] for m in MODULES}
    assert not names & {"topology", "placement", "scheduling", "evaluators", "sequence", "packed"}, names
    data = {m.split(".")[2] for m in MODULES if m.startswith("raychat.data.")}
    assert data == {"corpus", "loader", "replay"}, data
    config = (PACKAGE / "config" / "train.py").read_text() + (PACKAGE / "config" / "rl.py").read_text()
    assert re.findall(r"^    (\w+): (\w*LayoutSection)", config, re.M) == [
        ("layout", "LayoutSection"),
        ("layout", "RLLayoutSection"),
    ]


def test_allowed_values_are_owned_by_the_component_that_implements_them():
    """An option's list of allowed values lives once, in the module that acts on it; config/ names it with
    owned_choices(module, name), read from that module's source (so --help imports no torch), and that read
    equals what the module holds when imported."""
    import importlib

    from raychat.config.schema import owned_choices

    owned = [
        (node.args[0].value, node.args[1].value)
        for path in (PACKAGE / "config").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "owned_choices"
    ]
    assert len(owned) >= 7, owned
    for module, name in owned:
        assert getattr(importlib.import_module(module), name) == owned_choices(module, name), (module, name)
    config_lists = {
        t.id
        for path in (PACKAGE / "config").glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert config_lists <= {"STAGES", "DEVICES", "STAGE_SECTIONS"}, config_lists


# calls that import a module named by a string
IMPORT_BY_NAME = {"import_module", "__import__", "spec_from_file_location", "module_from_spec"}


def test_the_one_import_by_name_is_the_cli_loader():
    """A command's code is imported when the command runs, by raychat.cli.load ("module:function"); nothing
    else in the package imports a module by name."""
    calls = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None))
        in IMPORT_BY_NAME
    ]
    load = next(
        f for f in ast.parse(MODULES["raychat.cli"].read_text()).body if getattr(f, "name", "") == "load"
    )
    assert calls == [f"raychat.cli:{load.body[-1].lineno}"], calls


def test_every_command_names_a_function_of_the_package():
    """Each parser in raychat.commands names the code that runs it as "module:function": a module of the
    package that defines that function at its top."""
    targets = [
        node.value
        for node in ast.walk(ast.parse(MODULES["raychat.commands"].read_text()))
        if isinstance(node, ast.Constant) and re.fullmatch(r"raychat(\.\w+)+:\w+", str(node.value))
    ]
    assert len(targets) >= 15, targets
    for target in targets:
        module, _, function = target.partition(":")
        assert module in MODULES, target
        top_level = {
            f.name for f in ast.parse(MODULES[module].read_text()).body if isinstance(f, ast.FunctionDef)
        }
        assert function in top_level, target


# distributions imported under another name, or used through another package
USED_THROUGH = {"tensorboard": "torch.utils.tensorboard", "pyyaml": "yaml", "ray": "ray"}


def declared() -> dict[str, set[str]]:
    """{dependency group ("main" or an extra): distribution names} from pyproject.toml (self-references out)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    norm = lambda req: re.split(r"[\s\[<>=;!~]", req, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    groups = {"main": {norm(r) for r in project["dependencies"]}}
    for extra, reqs in project["optional-dependencies"].items():
        groups[extra] = {norm(r) for r in reqs} - {"raychat"}
    return groups


# imported where used because the import is slow and most runs never need it
LAZY = {
    "torchao.float8": "~3 s of import (measured: torch 4.7 s, torch + torchao.float8 7.7 s); only FP8 runs",
    "torch.nn.attention.flex_attention": "imports torch._dynamo (1-3.5 s); only the engine's GPU path uses it",
    "torch.nn.attention.bias": "imports torch._dynamo too; only a later prefill chunk uses it "
    "(bench/results/job_startup.md: every process importing raychat.engine paid for it)",
    "ray.job_submission": "1.1 s of import (measured); only a lease refusal of a Ray job's holder asks the Jobs "
    "API (raychat.lease.ended_job), and `raychat data prepare` / `tokenizer train` take leases without Ray",
}


def test_imports_are_at_module_top_but_those_of_optional_extras():
    """Inside a function only the optional extras (k8s, tracking) are imported, so raychat imports without
    them (a command that needs one says so when run), and the LAZY modules."""
    groups = declared()
    optional = groups["k8s"] | groups["tracking"]
    dists = {k: {d.lower().replace("_", "-") for d in v} for k, v in packages_distributions().items()}
    local = [
        f"{path.relative_to(REPO)}:{line} {imported}"
        for path in MODULES.values()
        for imported, in_function, line in imports(path)
        if in_function
        and not (
            dists.get(imported.split(".")[0], set()) & optional
            or imported.startswith(("torch.utils.tensorboard", *LAZY))
        )
    ]
    assert not local, "function-local imports:\n" + "\n".join(local)


def test_every_import_is_declared_and_every_dependency_used():
    groups = declared()
    package_deps = groups["main"] | groups["k8s"] | groups["tracking"]
    dists = {k: {d.lower().replace("_", "-") for d in v} for k, v in packages_distributions().items()}
    used, undeclared = set(), []
    for path in MODULES.values():
        for imported, _, line in imports(path):
            root = imported.split(".")[0]
            if root in sys.stdlib_module_names or root in ("raychat", "__future__"):
                continue
            owners = dists.get(root) or {root.lower().replace("_", "-")}
            hit = owners & package_deps
            if not hit:
                undeclared.append(f"{path.relative_to(REPO)}:{line} {root} (from {sorted(owners) or '?'})")
            used |= hit
            used |= {d for d, via in USED_THROUGH.items() if imported.startswith(via)}
    assert not undeclared, "imports of undeclared distributions:\n" + "\n".join(undeclared)
    unused = package_deps - used - {"vllm"}
    assert not unused, f"declared but never imported by the package: {sorted(unused)}"


@pytest.mark.parametrize("extra", ["k8s", "tracking"])
def test_extras_compose(extra):
    """The test extra depends on the other extras instead of repeating their pins."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    test = project["optional-dependencies"]["test"]
    assert any(r.startswith("raychat[") and extra in r for r in test)
    assert not declared()[extra] & declared()["test"]
