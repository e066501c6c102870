"""The core (common/, algorithm/, experts/, tasks/) is plain Python: it never imports the Ray shell
(cluster/), the driver, or Ray itself, so it can be read, tested and reused without them. Inside
it, common/ is the floor (it imports no other package of the project), and tasks/ and algorithm/
borrow nothing from experts/."""
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("common", "algorithm", "experts", "tasks")
SHELL = ("cluster", "driver", "ray")
BELOW = {  # a core package -> the project's packages it must not import (beside the shell)
    "common": ("algorithm", "experts", "tasks"),
    "algorithm": ("experts",),
    "tasks": ("experts",),
}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_core_files_import_nothing_from_the_shell():
    files = [p for package in CORE for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 20
    offending = {f"{p.relative_to(ROOT)}: {m}" for p in files for m in imported_modules(p)
                 if m.split(".")[0] in SHELL}
    assert not offending, sorted(offending)


def test_the_floor_and_the_tasks_and_maths_import_no_package_above_them():
    assert all(len(list((ROOT / package).rglob("*.py"))) > 3 for package in BELOW)
    offending = {f"{p.relative_to(ROOT)}: {m}" for package, above in BELOW.items()
                 for p in sorted((ROOT / package).rglob("*.py")) for m in imported_modules(p)
                 if m.split(".")[0] in above}
    assert not offending, sorted(offending)


def test_importing_the_whole_core_loads_no_shell_module():
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for package in CORE
               for p in sorted((ROOT / package).rglob("*.py")) if p.name != "__init__.py"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(SHELL)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def project_imports() -> dict[str, set[str]]:
    """Every module of the project's packages -> the project's modules it imports (a name imported
    from a package's module counts as that module)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for package in (*CORE, "cluster", "driver") for p in sorted((ROOT / package).rglob("*.py"))}
    edges = {}
    for name, path in files.items():
        edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                whole = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                edges[name] |= whole or ({node.module} & files.keys())
            elif isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names} & files.keys()
    return edges


def test_no_module_imports_itself_round_a_circle():
    """No circle of imports, at the top or inside a function (driver/ once had one of 18 modules,
    closed by lazy imports; common/ one of three)."""
    edges = project_imports()
    assert len(edges) > 100 and sum(map(len, edges.values())) > 300

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(edges[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(edges[m])
        return seen

    circles = sorted(m for m in edges if m in reach(m))
    assert not circles, circles


def test_no_module_names_another_packages_module_in_a_string_to_import_it():
    """A module is imported by an import statement that shows it, never by its dotted name in a
    string (`experts.tiny.flux1:tiny_flux1`) from another package: the tiny models' builders are
    registered by the packages that own them (common/tiny.py `register_tiny`). A package may name
    its own modules, as the reward library names its built-ins to import them only when used."""
    packages = (*CORE, "cluster", "driver")
    named = re.compile(rf"^(({'|'.join(packages)})(\.\w+)+):\w+$")  # package.module:name
    offending, seen = [], 0
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                found = isinstance(node, ast.Constant) and isinstance(node.value, str) and named.match(node.value)
                if found and (ROOT / f"{found[1].replace('.', '/')}.py").is_file():
                    seen += 1
                    if found[2] != package:
                        offending.append(f"{path.relative_to(ROOT)}: {node.value!r}")
    assert seen > 5  # the reward library's built-ins
    assert not offending, offending


def test_the_training_loop_imports_no_offline_command():
    """driver/commands/ (plan's comparison, score, pretrain, eval, sample, report, export,
    serve-reward, the config's documentation) is called by the CLI; no module of the loop imports it."""
    edges = project_imports()
    commands = {m for m in edges if m.startswith("driver.commands")}
    assert len(commands) >= 9
    loop = {m for m in edges if m.startswith("driver.") and m not in commands and m != "driver.cli"}
    offending = sorted(f"{m}: {t}" for m in loop for t in edges[m] if t in commands)
    assert not offending, offending


def test_the_models_know_no_task_world():
    """experts/ reads the task through its base types (tasks/base.py: Refinement, Vocabulary …), the
    vocabularies the task hands its word-level models (`tasks.text_vocabulary`,
    `tasks.refiner_vocabulary`) and, in the rollout pipeline, the task and its reward terms; nothing
    of the shapes world (its words, ids, lengths), but for the tiny HF LM built over the shapes words
    (experts/tiny_hf.py, a test model)."""
    allowed = {"tasks", "tasks.base", "tasks.reward_guard", "tasks.rewards.term"}
    found = {f"{p.relative_to(ROOT)}: {m}" for p in sorted((ROOT / "experts").rglob("*.py"))
             for m in imported_modules(p) if m.split(".")[0] == "tasks" and m not in allowed}
    assert found == {"experts/tiny_hf.py: tasks.shapes"}
