"""The code's shape, checked: imports at the top of modules, nothing loaded by name, modules of at most 400 lines,
functions of at most 80, and a command line that starts without heavy libraries.

The layering between packages (pipeline <- decode <- distill <- monitor) and inside decode (runtime <- sampling <-
models <- the algorithm <- serving <- measure <- the command line) is import-linter's contract in pyproject.toml, run
by `make test`.
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "decode", "distill", "monitor")
# the command-line modules: their handlers import what their command runs when it runs
COMMAND_MODULES = ("cli.py", "commands.py", "bench_commands.py")
MAX_LINES = 400
MAX_FUNCTION_LINES = 80


def package_modules() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))]


def function_level_imports(path: Path) -> list[str]:
    """`file:line module` for every import of a draftops module inside a function of `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.module and inner.module.split(".")[0] in PACKAGES:
                found.append(f"{path.relative_to(REPO)}:{inner.lineno} {inner.module}")
            elif isinstance(inner, ast.Import):
                found += [f"{path.relative_to(REPO)}:{inner.lineno} {a.name}" for a in inner.names
                          if a.name.split(".")[0] in PACKAGES]
    return found


def test_draftops_modules_import_each_other_at_the_top():
    """Only the command-line modules import inside functions (their handlers: see their docstrings)."""
    modules = [p for p in package_modules() if p.name not in COMMAND_MODULES]
    assert len(modules) > 30
    assert [hit for path in modules for hit in function_level_imports(path)] == []


def test_no_module_loads_a_draftops_package_by_name():
    """Subcommands come through the `draftops.commands` entry points; no module imports draftops code by a string,
    where the import-linter contract could not see it."""
    by_name = re.compile(r"(import_module|__import__)\(\s*f?[\"'](" + "|".join(PACKAGES) + r")\b")
    assert [f"{p.relative_to(REPO)}" for p in package_modules() if by_name.search(p.read_text())] == []


def test_every_module_holds_one_job_of_at_most_400_lines():
    lines = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in package_modules()}
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert long == {}


def long_functions(path: Path) -> dict[str, int]:
    """`file:function` -> lines (from `def` to its last line, docstring included), for every function or method of
    `path` over MAX_FUNCTION_LINES."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found[f"{path.relative_to(REPO).as_posix()}:{node.name}"] = lines
    return found


def test_every_function_reads_in_at_most_80_lines():
    """A function that does several things reads as named steps, each a function of its own."""
    long = {name: n for path in package_modules() for name, n in long_functions(path).items()}
    assert long == {}


def test_the_parser_builds_without_torch_transformers_or_mlflow():
    code = ("import sys, pipeline.cli; pipeline.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_models_info_on_a_local_checkpoint_loads_no_torch(tiny_checkpoint):
    code = ("import sys; from pipeline.cli import main; main(['models', 'info', sys.argv[1], '--json']); "
            "print(sorted(m for m in ('torch', 'transformers', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_checkpoint)], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert '"layers": 2' in out.stdout
