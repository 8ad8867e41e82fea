"""The house's layout, read from the code's own imports: arrows run downward only.

    python -m pytest -q tests/test_layout.py

Every import in ppo_core/ and kernels/ (the ppo_kernels package), at the top of a file or inside a function, is an
arrow from one module to another. No module may reach itself by following them: a module that imports one that
imports it back, directly or through others, is a circle, and a circle means neither file can be read, tested or
changed on its own. The top of ppo_core/ holds the files a researcher edits (the loop: train, rollout, update; and
config, algo) and the subpackages; nothing below the top imports the loop. The subpackages stand in one order,
models, engine, data, rewards, agents, run from the bottom, and import only down it (ppo_kernels below them all).
bench/ and scripts/ stand above the packages and use only the names their modules export on purpose, never an
underscore helper.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"ppo_core": os.path.join(ROOT, "ppo_core"), "ppo_kernels": os.path.join(ROOT, "kernels")}


def package_modules() -> dict:
    """{dotted module name: path} of every .py file of both packages and their subpackages ("ppo_core" for
    ppo_core/__init__.py, "ppo_core.engine" for ppo_core/engine/__init__.py, "ppo_core.engine.scheduler", ...)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if os.path.isfile(os.path.join(dirpath, d, "__init__.py")))
            inside = os.path.relpath(dirpath, folder)
            prefix = package if inside == "." else ".".join([package, *inside.split(os.sep)])
            for name in sorted(filenames):
                if name.endswith(".py"):
                    modules[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(dirpath, name)
    return modules


def below_the_top(module: str, modules: dict) -> bool:
    """A module of a subpackage of ppo_core (its __init__ included), or of ppo_kernels: the rooms below the loop."""
    return module.startswith("ppo_kernels") or os.path.dirname(modules[module]) != PACKAGES["ppo_core"]


def imported_modules(module: str, path: str, modules: dict) -> set:
    """The package modules that `module` imports anywhere in its file (relative imports resolved). `from P import n`
    is an arrow to the module P.n when there is one, else to P; `import P.m` is an arrow to P.m."""
    package = module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != module}


def import_graph() -> dict:
    modules = package_modules()
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def import_cycles(graph: dict) -> list:
    """Each group of modules that reach one another (Tarjan's strongly connected components of more than one
    module, or a module that imports itself), as a sorted list of names."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
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


def describe(cycle, graph) -> str:
    """'a -> b, b -> a' for the arrows inside one cycle."""
    return ", ".join(f"{a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle)


def test_no_import_cycle_among_the_package_modules():
    graph = import_graph()
    assert "ppo_core.train" in graph and "ppo_core.algo" in graph["ppo_core.train"]  # the reader reads what it should
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(describe(c, graph) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_cycles(graph) == [["a", "b", "c"], ["e"]]
    assert describe(["a", "b", "c"], graph) == "a -> b, b -> c, c -> a"


def test_bench_and_scripts_use_no_underscore_helpers_of_the_packages():
    """`from ppo_core.x import _helper` or `x._helper` on an imported package module: a name its module keeps to
    itself, which a move inside the package may rename or drop without a word."""
    modules = package_modules()
    offences = []
    for folder in ("bench", "scripts"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if not name.endswith(".py"):
                continue
            path = os.path.join(ROOT, folder, name)
            tree = ast.parse(open(path).read(), path)
            bound = set()  # local names of imported package modules
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    bound.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in PACKAGES)
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                    for a in node.names:
                        if a.name.startswith("_"):
                            offences.append(f"{folder}/{name}:{node.lineno} imports {node.module}.{a.name}")
                        elif f"{node.module}.{a.name}" in modules:
                            bound.add(a.asname or a.name)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                        and node.attr.startswith("_") and not node.attr.startswith("__")):
                    offences.append(f"{folder}/{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not offences, "\n".join(offences)


# The files a researcher edits, and ppo-eval's (the scores beside the loop that it shares the evaluation with);
# everything else lives in a subpackage named for what it holds.
TOP_LEVEL = {"__init__", "train", "config", "algo", "update", "rollout", "heads", "evaluate"}
# The loop: what only the top level may import.
LOOP = {"ppo_core.train", "ppo_core.rollout", "ppo_core.update"}
# Arrows from below into the loop, each named here to be removed, never added to (none now: the rollout worker is
# handed the loop's rollout by ppo_core.train.serve_rollouts instead of importing it).
KNOWN_ARROWS_INTO_THE_LOOP = set()


# The subpackages, bottom to top: an import between two of them goes down this list, never up (README's code map).
SUBPACKAGE_ORDER = ["models", "engine", "data", "rewards", "agents", "run"]


def subpackage_of(module: str):
    """'ppo_core.rewards.judges' -> 'rewards'; None for a top-level module or ppo_kernels (below them all)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "ppo_core" and len(parts) > 1 and parts[1] in SUBPACKAGE_ORDER else None


def upward_imports(graph) -> list:
    """'a -> b' for each import from a subpackage to one above it in SUBPACKAGE_ORDER."""
    rank = {name: i for i, name in enumerate(SUBPACKAGE_ORDER)}
    return sorted(f"{m} -> {t}" for m in graph for t in graph[m]
                  if subpackage_of(m) and subpackage_of(t) and rank[subpackage_of(t)] > rank[subpackage_of(m)])


def test_subpackages_import_one_way_down_their_order():
    graph = import_graph()
    folder = PACKAGES["ppo_core"]
    found = {d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, "__init__.py"))}
    assert found == set(SUBPACKAGE_ORDER), f"subpackages {sorted(found)}: place each in SUBPACKAGE_ORDER"
    assert not upward_imports(graph), "imports up the subpackage order: " + ", ".join(upward_imports(graph))
    assert not any(t.startswith("ppo_core") for m in graph if m.startswith("ppo_kernels") for t in graph[m])


def test_an_upward_import_is_seen():
    """The check above on a made-up graph: engine importing run is upward, run importing models is not."""
    graph = {"ppo_core.engine.x": {"ppo_core.run.y"}, "ppo_core.run.y": {"ppo_core.models.z"}}
    assert upward_imports(graph) == ["ppo_core.engine.x -> ppo_core.run.y"]


def test_the_forward_heads_sit_below_both_passes():
    """The update reads its log-probs and values through ppo_core.heads, as the scoring pass does, and never goes back
    into the rollout for them: heads imports neither pass."""
    graph = import_graph()
    assert "ppo_core.heads" in graph["ppo_core.rollout"] and "ppo_core.heads" in graph["ppo_core.update"]
    assert not graph["ppo_core.heads"] & LOOP


def test_the_top_level_holds_the_researchers_files_and_the_subpackages():
    folder = PACKAGES["ppo_core"]
    files = {name[:-3] for name in os.listdir(folder) if name.endswith(".py")}
    assert files == TOP_LEVEL, f"at the top of ppo_core/: {sorted(files - TOP_LEVEL)} belong in a subpackage"
    subpackages = sorted(d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, "__init__.py")))
    assert subpackages, "no subpackages"


def test_nothing_below_the_top_imports_the_loop():
    graph, modules = import_graph(), package_modules()
    arrows = {(m, t) for m in graph if below_the_top(m, modules) for t in graph[m] if t in LOOP}
    assert not arrows - KNOWN_ARROWS_INTO_THE_LOOP, "below the top, importing the loop: " + ", ".join(
        f"{a} -> {b}" for a, b in sorted(arrows - KNOWN_ARROWS_INTO_THE_LOOP))
    assert not KNOWN_ARROWS_INTO_THE_LOOP - arrows, ("gone, so take them out of KNOWN_ARROWS_INTO_THE_LOOP: "
                                                     + ", ".join(f"{a} -> {b}" for a, b in sorted(KNOWN_ARROWS_INTO_THE_LOOP - arrows)))


def test_a_spec_naming_a_module_by_its_place_before_the_move_still_loads():
    """Configs written before the move name reward functions by the old flat path: each of MOVED_MODULES' old names
    resolves to a module that exists, and a shipped reward function loads under both names as the same object."""
    import importlib

    from ppo_core.rewards.functions import MOVED_MODULES, import_callable

    for old, new in MOVED_MODULES.items():
        assert not os.path.exists(os.path.join(PACKAGES["ppo_core"], old + ".py")), f"ppo_core/{old}.py is back"
        importlib.import_module(f"ppo_core.{new}")
    new_fn = import_callable("ppo_core.rewards.verifiers:last_number_reward")
    assert import_callable("ppo_core.verifiers:last_number_reward") is new_fn
    assert import_callable("ppo_core.tasks:reverse_rewards") is import_callable("ppo_core.data.tasks:reverse_rewards")


def test_the_researchers_files_keep_their_lines_within_100_columns():
    """The files a researcher reads first (the top of ppo_core/) read without scrolling sideways: no line over 100
    characters; derivations and measurements live in docs/, with a pointer in the docstring."""
    folder = PACKAGES["ppo_core"]
    long = [f"{name}.py:{i}: {len(line)}" for name in sorted(TOP_LEVEL)
            for i, line in enumerate(open(os.path.join(folder, f"{name}.py"), encoding="utf-8").read().split("\n"), 1)
            if len(line) > 100]
    assert not long, f"lines over 100 characters: {long[:10]}{' ...' if len(long) > 10 else ''}"


def test_no_test_puts_bench_on_the_import_path():
    """bench/kernels.py would shadow the PyPI package `kernels` that transformers imports: a test module that puts
    bench/ on sys.path (at its collection, before any test runs) breaks every transformers test after it. A test
    loads a bench script by its path (importlib.util.spec_from_file_location) instead."""
    offenders = []
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "tests", name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("insert", "append") and "sys.path" in ast.unparse(node.func.value)
                    and "bench" in ast.unparse(node)):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, offenders
    assert os.path.isfile(os.path.join(ROOT, "bench", "kernels.py"))  # what makes the rule needed
