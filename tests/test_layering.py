"""The house's import rules, read from the source with ``ast`` (no module is imported):

* the contract (``storage_schemas``) imports nothing of the project;
* the library (``pipeline``) never imports the entry points, the lab or Hydra;
* no module of one stage package (``pipeline.<stage>``) imports another stage's modules: what two
  stages share lives in the shared sub-packages, which sit on floors: ``pipeline.runtime`` (errors,
  threads, quiet output) at the bottom, ``pipeline.method`` above it, ``pipeline.folders`` and
  ``pipeline.student_data`` side by side above that; a shared module imports only floors below its
  own (and its own package), never a stage; ``pipeline``'s root holds packages only;
* no import cycle among the project's modules, counting lazy (function-level) imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("score_teacher", "train_student", "inspection", "evaluation", "export_student")
LAB = ("benchmarks", "repro", "mutation", "local_s3", "rehearsal")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for top in ("pipeline", "storage_schemas", "stages", *LAB):
        for path in sorted((REPO / top).rglob("*.py")):
            if "tests" not in path.relative_to(REPO).parts:
                found[module_name(path)] = path
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules and third-party top-level packages ``path`` imports, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in modules)
    return names


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    edges = {}
    for name, path in modules.items():
        edges[name] = {m for m in imports_of(path, modules) if m in modules or m.split(".")[0] in ("hydra", "omegaconf")}
    return edges


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeline" and len(parts) > 1 and parts[1] in STAGES else None


def test_the_contract_imports_nothing_of_the_project():
    bad = {m: sorted(i for i in deps if not i.startswith("storage_schemas"))
           for m, deps in graph().items() if m.startswith("storage_schemas")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_library_imports_no_entry_point_no_lab_and_no_hydra():
    forbidden = ("stages", "hydra", "omegaconf", *LAB)
    bad = {m: sorted(i for i in deps if i.split(".")[0] in forbidden)
           for m, deps in graph().items() if m.startswith("pipeline")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_stage_imports_another_stages_modules():
    bad = {}
    for module, deps in graph().items():
        own = stage_of(module)
        if own is None:
            continue
        other = sorted(d for d in deps if stage_of(d) not in (None, own))
        if other:
            bad[module] = other
    assert bad == {}


FLOORS = {"runtime": 0, "method": 1, "folders": 2, "student_data": 2}


def test_pipeline_root_holds_packages_only():
    loose = sorted(p.name for p in (REPO / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    packages = {p.name for p in (REPO / "pipeline").iterdir() if (p / "__init__.py").is_file()}
    assert packages == {*FLOORS, *STAGES, "embedded"}, "a new package gets a floor here or is a stage"


def test_shared_floors_import_only_lower_floors():
    bad = {}
    for module, deps in graph().items():
        parts = module.split(".")
        if parts[0] != "pipeline" or len(parts) < 2 or parts[1] not in FLOORS:
            continue
        own = parts[1]
        wrong = sorted(d for d in deps if d.startswith("pipeline.") and d.split(".")[1] != own
                       and FLOORS.get(d.split(".")[1], 99) >= FLOORS[own])
        if wrong:
            bad[module] = wrong
    assert bad == {}


def test_shared_modules_import_no_stage():
    bad = {m: sorted(d for d in deps if stage_of(d))
           for m, deps in graph().items() if m.startswith("pipeline") and stage_of(m) is None}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_import_cycle():
    full = graph()
    edges = {m: {d for d in deps if d in full} for m, deps in full.items()}
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in edges.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_lazy_imports_only_for_heavy_optional_packages_each_with_its_reason():
    """A function-level import in the library, the contract or the entry points is never one of the
    project's modules (that would hide a cycle) and says on its line why it is lazy. One exception:
    an entry point's ``main`` (``stages/*.py``) may import the library modules that run its stage
    (stage 2's run and plan subclass transformers' Trainer and callbacks at import), so that the
    config, checked before ``main`` runs, is refused before torch and transformers are imported
    (tests/test_first_errors.py); these imports are in the graph the cycle check reads all the same."""
    bad = []
    for top in ("pipeline", "storage_schemas", "stages"):
        for path in sorted((REPO / top).rglob("*.py")):
            lines = path.read_text().splitlines()
            tree = ast.parse("\n".join(lines))
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                        own = (name or "").split(".")[0] in ("pipeline", "storage_schemas", "stages", *LAB)
                        after_check = top == "stages" and fn.name == "main" and (name or "").startswith("pipeline.")
                        own = own and not after_check
                        if own or "#" not in lines[node.lineno - 1]:
                            bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert sorted(set(bad)) == []
