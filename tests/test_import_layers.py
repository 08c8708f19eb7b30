"""Imports point down: each module of rlsys/, experiments/ and training/ imports only its own layer or the
layers below it (LAYERS, bottom first), and no modules import each other in a circle.

The graph is read with `ast`, so an import inside a function counts as much as one at the top: moving an
import into a function hides an upward dependency from Python's import order, not from a reader. Importing
`a.b.c` also runs the `__init__` of `a.b` and `a`, so those packages count as imported too (a package's
`__init__` may import the modules it holds; that is not an edge).
"""

import ast
import functools
import inspect
import json
import re
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlsys", "experiments", "training")

# Bottom first. A module belongs to the entry with the longest prefix of its dotted name.
LAYERS = [
    ("foundation", ["rlsys", "rlsys.errors", "rlsys.protocol", "rlsys.run_privacy",
                    "rlsys.host_copy", "rlsys.plugins", "rlsys.cancellation", "rlsys.stop_grace",
                    "rlsys.blocking_calls"],
     "the errors every layer raises, the bus's key names, plugin importing and small helpers: they import no rlsys"),
    ("contracts", ["rlsys.api"],
     "what plugins are written against (agents, environments, tools, trajectories) and the registries they join"),
    ("parts", ["rlsys.algorithms", "rlsys.model", "rlsys.bus", "rlsys.tools", "rlsys.alarms", "rlsys.token_continuity",
               "rlsys.weight_checksum", "rlsys.checkpoint", "rlsys.distributed", "rlsys.metrics", "rlsys.prompt_ledger",
               "rlsys.run_counters", "rlsys.tracing", "rlsys.frames", "rlsys.weight_versions",
               "rlsys.evaluations", "rlsys.run_files", "rlsys.learner_figures"],
     "self-contained pieces (tensor math, the model, the bus, tools, records on disk) that know only the contracts"),
    ("engines", ["rlsys.engine", "rlsys.weight_transport", "rlsys.training_step", "rlsys.endpoint"],
     "generation, the OpenAI-compatible endpoint and the learning step, built from the parts"),
    ("plugins", ["rlsys.data", "rlsys.impl"],
     "the built-in datasets, environments and agents, written against the contracts as a user's plugin is"),
    ("roles", ["rlsys.workers", "rlsys.delivery"],
     "the loops of the role processes (inference, rollout, learner), which run the engines and the plugins"),
    ("run", ["rlsys.placement", "rlsys.supervisor", "rlsys.stall", "rlsys.assets", "rlsys.preflight",
             "rlsys.report", "rlsys.console", "rlsys.mlflow_export", "rlsys.stop_signals", "rlsys.run_summary"],
     "starting, watching and summarising a run's role processes"),
    ("experiments", ["experiments"],
     "named configurations of the library, registered into rlsys.api's experiment registry"),
    ("entry", ["rlsys.cli", "rlsys.launcher", "rlsys.run_start", "rlsys.config_checks", "rlsys.roles", "training"],
     "the command line (which offers the built-in experiments by name), the run's plan, where it starts and the "
     "checks of its config (which name the keys they refuse as the command line does), and the roles' entry (which "
     "reads a config back as the command line does)"),
]


def module_files() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement anywhere in the module names (`from a import b`: both `a`
    and `a.b`, since b may be a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports (and the packages whose __init__ that runs)."""
    modules = module_files()
    graph = {}
    for module, (path, is_package) in modules.items():
        targets = set()
        for name in imported_names(ast.parse(path.read_text(), str(path)), module, is_package):
            while name and name not in modules:  # `from a.b import Class`: the module a.b
                name = name.rpartition(".")[0]
            if name:
                targets.update(n for n in [name, *ancestors(name)] if n in modules)
        own = {module, *ancestors(module)}  # a module's own packages are running already when it is imported
        graph[module] = targets - own
    return graph


def layer_of(module: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes, _) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_import_points_up():
    upward = []
    for module, targets in sorted(import_graph().items()):
        above = {target for target in targets if layer_of(target) > layer_of(module)}
        named = [t for t in sorted(above) if not any(other.startswith(t + ".") for other in above)]  # not its packages
        upward += [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                   for target in named]
    assert not upward, "imports that point up a layer:\n  " + "\n  ".join(upward)


def test_no_import_circle():
    graph = import_graph()
    found = []
    for component in circles(graph):
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        found.append(", ".join(edges))
    assert not found, "modules that import each other in a circle:\n  " + "\n  ".join(found)


def test_the_check_sees_an_upward_import_and_a_circle():
    graph = {"rlsys.errors": {"rlsys.launcher"}, "rlsys.launcher": {"rlsys.errors"}}
    assert layer_of("rlsys.launcher") > layer_of("rlsys.errors")
    assert circles(graph) == [["rlsys.errors", "rlsys.launcher"]]
    tree = ast.parse("def f():\n    from rlsys.bus.base import connect\n")
    assert "rlsys.bus.base" in imported_names(tree, "rlsys.x", is_package=False)


def test_the_launcher_and_a_rollout_worker_import_no_torch(tmp_path):
    """The launcher and the rollout workers run no torch, and the launcher no transformers or math-verify (the
    verifier's workers import it): importing them (and torch.distributed.checkpoint, and torch's TensorBoard writer)
    cost each process a second or more of CPU at every start, on the two cores where the learner and vLLM start too
    (BENCHMARKS.md, "Start-up"). On a machine without a GPU driver the launcher's device check imports none either."""
    program = f"""
import json, sys
from pathlib import Path
from rlsys.cli import parse_config
import rlsys.launcher, rlsys.roles, rlsys.workers.rollout_worker, rlsys.impl.agent, rlsys.impl.env
from rlsys.placement.gpus import GPU_DRIVER_FILES, visible_devices
config = parse_config(["ppo.adv_estimator=gae"])
driver = any(Path(name).exists() for name in GPU_DRIVER_FILES)
devices = [] if driver else visible_devices()
launcher = sorted(name for name in ("torch", "transformers", "math_verify") if name in sys.modules)
from rlsys.metrics import MetricsLogger
from rlsys.model.tokenizer import build_char_tokenizer
logger = MetricsLogger(Path({str(tmp_path)!r}), "rollout0")
logger.log(1, {{"reward": 0.5}})
logger.close()
build_char_tokenizer()
rollout = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print(json.dumps({{"driver": driver, "devices": devices, "launcher": launcher, "rollout": rollout}}))
"""
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.splitlines()[-1])
    assert (imported["launcher"], imported["rollout"], imported["devices"]) == ([], ["transformers"], [])
    assert list((tmp_path / "tensorboard" / "rollout0").glob("events.out.tfevents.*"))


# Bus methods that change what a key or stream holds, and rlsys.bus.base.Step's, which rlsys.bus' `change` applies
BUS_WRITES = {"set", "incr", "delete", "put", "put_many", "stream_add", "stream_delete", "change", "add", "remove"}
# Shared state with one owner: the modules that may write it. Any other module calls the owner.
OWNERS = {
    "WEIGHT_CHECKS": {"rlsys.run_counters"},
    "DEAD_LETTERS": {"rlsys.run_counters",  # what a checkpoint restores
                     "rlsys.delivery"},  # the entries, which only the learner's inbox sets aside
    "CHECKPOINTS_DIR": {"rlsys.checkpoint"},  # the directory's name as a string, and step_N within it
    "METRICS_RECORDS": {"rlsys.metrics"},  # learner.jsonl and rollout<i>.jsonl spelled out
    "EVAL_RESULTS": {"rlsys.evaluations"},  # protocol.eval_result's keys, written and read
    "EVAL_RECORDS": {"rlsys.evaluations"},  # an evaluation's figures' names in the records (eval/accuracy, ...)
    "RUN_FILES": {"rlsys.run_files"},  # config.yaml, summary.json and the logs directory spelled out
    # the names of the learner's figures that others read: its time split, staleness and logprob alarms
    "LEARNER_FIGURES": {"rlsys.learner_figures"},
    "ROUTING_FIGURES": {"rlsys.workers.routing"},  # a rollout worker's request figures (requests/resent, ...)
    "RECORD_FIELDS": {"rlsys.metrics"},  # the step and the time of every row of the records
    "AGENT_FIGURES": {"rlsys.token_continuity"},  # an agent's figure that others read: its episode's prefix breaks
}
METRICS_RECORDS = re.compile(r"(learner|rollout)\S*\.jsonl")
LEARNER_FIGURES = re.compile(r"(time|alarms|agent)/.*|staleness_(mean|max)")
AGENT_FIGURES = {"prefix_breaks"}  # num_turns, the other, is an experiment's setting too: spelled, it is no figure

# Names in the records that are plain words too ("step", "reward"): checked where they key a row of the records, not
# wherever they are spelled (a trajectory's "reward" in the traces, a checkpoint's "step"). The owner of each, by the
# kind of row: a role's records (the learner's "reward"; every row's "step" and "time") or an evaluation's figures.
ROW_WORDS = {"record": {"step": "RECORD_FIELDS", "time": "RECORD_FIELDS", "reward": "LEARNER_FIGURES",
                        "accuracy": "EVAL_RECORDS"},
             "evaluation": {word: "EVAL_RECORDS" for word in ("reward", "accuracy", "version", "version_max",
                                                              "episodes", "failed")}}
# Where rows come from: the records' readers, and an evaluation's figures (as `figures` names them, on the bus too);
# and where they go: the records' writer, whose `log(step, figures)` writes a row. (kind of row, what the call returns:
# "rows", one "row", a "reader" whose calls return rows, or a "writer")
ROW_SOURCES = {"rlsys.metrics.read_jsonl_metrics": ("record", "rows"),
               "rlsys.metrics.MetricsLogger": ("record", "writer"),
               "rlsys.metrics.JsonlFollower": ("record", "reader"),
               "rlsys.evaluations.curve": ("evaluation", "rows"),
               "rlsys.evaluations.figures": ("evaluation", "row"),
               "rlsys.evaluations.result": ("evaluation", "row")}


class RowTracker:
    """Which expressions of a module hold rows of the records, followed from ROW_SOURCES through assignments, loops,
    comprehensions, `map(figures, rows)`, a function's arguments to its parameters and any function that returns
    rows (`readers`, by name, from every module). A name is its function's (its module's where that has none of that
    name; `self.x` its class's): the same name in another function may hold other things."""

    def __init__(self, tree: ast.AST, readers: dict[str, str]):
        self.tree, self.readers, self.returns, self.names, self.scope, self.nodes = tree, readers, {}, {}, {}, []
        self.imported = {alias.asname or alias.name: f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom)
                         else alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for alias in node.names}
        self.follow()

    def follow(self) -> dict[str, str]:
        """Follows the rows again (`readers` may have grown); returns this module's functions that return rows. A
        module that imports no source of rows or reader of them holds none: it is not walked."""
        sources = {name.rpartition(".")[0] for name in ROW_SOURCES} | set(ROW_SOURCES)
        if not self.nodes and (set(self.imported.values()) & sources or self.imported.keys() & self.readers.keys()):
            self.nodes = self.scoped(self.tree, None)
            self.functions = {node.name: node for node in self.nodes
                              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
            self.local = {self.key(node) for node in self.nodes if isinstance(node, ast.arg)
                          or isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}  # a function's own
        while self.nodes and self.bind_once():
            pass
        return self.returns

    def scoped(self, node: ast.AST, function: str | None) -> list[ast.AST]:
        """Every node below `node`, each noted with the function it is in."""
        found = []
        for child in ast.iter_child_nodes(node):
            self.scope[child] = function
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            found += [child, *self.scoped(child, inner)]
        return found

    def key(self, node: ast.AST) -> tuple[str | None, str]:
        if isinstance(node, ast.Attribute):
            return "attribute", ast.unparse(node)
        return self.scope.get(node), node.arg if isinstance(node, ast.arg) else node.id

    def qualified(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.imported.get(node.id, node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return f"{self.imported.get(node.value.id, node.value.id)}.{node.attr}"
        return None

    def kind(self, node: ast.AST | None) -> tuple[str, str] | None:
        """(kind of row, "rows" | "row" | "reader") of what `node` evaluates to, None where it is no row."""
        if isinstance(node, (ast.Name, ast.Attribute)):
            key = self.key(node)
            return self.names.get(key) or (None if key in self.local else self.names.get((None, key[1])))
        if isinstance(node, ast.Call):
            return self.call_kind(node)
        if isinstance(node, ast.Subscript) and (whole := self.kind(node.value)) and whole[1] == "rows":
            return whole[0], "rows" if isinstance(node.slice, ast.Slice) else "row"
        if isinstance(node, (ast.BoolOp, ast.IfExp)):
            parts = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
            return next(filter(None, map(self.kind, parts)), None)
        if isinstance(node, ast.NamedExpr):
            return self.kind(node.value)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)) and (each := self.kind(node.elt)) and each[1] == "row":
            return each[0], "rows"
        return None

    def call_kind(self, call: ast.Call) -> tuple[str, str] | None:
        name = self.qualified(call.func)
        if name in ROW_SOURCES:
            return ROW_SOURCES[name]
        if (callee := self.kind(call.func)) and callee[1] == "reader":
            return callee[0], "rows"
        short = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
        if short in self.readers or short in self.returns:
            return self.readers.get(short) or self.returns[short], "rows"
        if short == "map" and len(call.args) == 2 and ROW_SOURCES.get(self.qualified(call.args[0]), (0, 0))[1] == "row":
            return ROW_SOURCES[self.qualified(call.args[0])][0], "rows"
        if short in ("list", "sorted", "reversed") and call.args and (rows := self.kind(call.args[0])):
            return rows
        return None

    def bind(self, target: ast.AST, kind: tuple[str, str] | None) -> bool:
        """Whether binding `target` to a value of `kind` told something new."""
        if kind is None:
            return False
        if isinstance(target, (ast.Tuple, ast.List)):
            return kind[1] == "rows" and any([self.bind(each, (kind[0], "row")) for each in target.elts])
        if isinstance(target, (ast.Name, ast.Attribute, ast.arg)):
            key = self.key(target)
            new = key not in self.names
            self.names.setdefault(key, kind)
            return new
        return False

    def bind_once(self) -> bool:
        changed = False
        for node in self.nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) \
                        and isinstance(node.value, ast.Tuple) else [(target, node.value)]  # a, b = x, y
                    changed |= any([self.bind(name, self.kind(value)) for name, value in pairs])
            elif isinstance(node, (ast.For, ast.comprehension)) and (rows := self.kind(node.iter)) \
                    and rows[1] == "rows":
                changed |= self.bind(node.target, (rows[0], "row"))
            elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                callee = self.functions.get(node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
                params = [a for a in callee.args.posonlyargs + callee.args.args if a.arg != "self"] if callee else []
                changed |= any([self.bind(param, self.kind(arg)) for param, arg in zip(params, node.args)])
            elif isinstance(node, ast.Return) and (rows := self.kind(node.value)) and rows[1] == "rows" \
                    and (function := self.scope[node]) not in self.returns:
                self.returns[function] = rows[0]
                changed = True
        return changed

    def keyed(self) -> set[str]:
        """The owners' names (ROW_WORDS) of the words this module keys a row with: `row["step"]`, `row.get("time")`,
        `"accuracy" in row`, a word handed to a function beside rows (`series(rows, "reward")`) or to a method of
        rows (`row.update(...)`), a dict's keys handed so or as a row (`log(step, {"reward": r})` to the records'
        writer, `say({"accuracy": a})` where say's parameter holds rows); each word spelled, or the default of the
        parameter that holds it (`def plot(rows, key="reward")`)."""
        found = set()
        for node in self.nodes:
            if isinstance(node, ast.Subscript):
                found.add(owner(self.kind(node.value), self.word(node.slice)))
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                found.add(owner(self.kind(node.comparators[0]), self.word(node.left)))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and node.args:
                found.add(owner(self.kind(node.func.value), self.word(node.args[0])))
            elif isinstance(node, ast.Call):
                found.update(self.handed(node))
        return found - {None}

    def handed(self, call: ast.Call) -> set[str | None]:
        """The owners' names of the words `call` hands beside rows, to a method of rows, or as a row (a dict's keys)."""
        beside = [self.kind(arg) for arg in call.args]
        if isinstance(call.func, ast.Attribute):
            beside.append(self.kind(call.func.value))
        rows = next((kind for kind in beside if kind and kind[1] != "writer"), None)
        found = {owner(rows, self.word(arg)) for arg in call.args}
        kinds = self.parameter_kinds(call)
        for kind, arg in zip(kinds + [None] * len(call.args), call.args):
            if isinstance(arg, ast.Dict):
                row = kind if kind and kind[1] == "row" else rows
                found |= {owner(row, self.word(key)) for key in arg.keys if key is not None}
        return found

    def parameter_kinds(self, call: ast.Call) -> list[tuple[str, str] | None]:
        """The kind of row each positional parameter of `call`'s function holds: a writer's `log(step, row)`, or a
        function of this module whose parameter rows reach."""
        if isinstance(call.func, ast.Attribute) and call.func.attr == "log" \
                and (writer := self.kind(call.func.value)) and writer[1] == "writer":
            return [None, (writer[0], "row")]
        callee = self.functions.get(call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", ""))
        params = [a for a in callee.args.posonlyargs + callee.args.args if a.arg != "self"] if callee else []
        return [self.names.get(self.key(param)) for param in params]

    def word(self, node: ast.AST) -> ast.AST:
        """`node`, or where it is a parameter of its function with a default, that default."""
        if isinstance(node, ast.Name) and (function := self.functions.get(self.scope.get(node))):
            params = function.args.posonlyargs + function.args.args
            defaults = dict(zip(params[len(params) - len(function.args.defaults):], function.args.defaults))
            defaults |= {a: d for a, d in zip(function.args.kwonlyargs, function.args.kw_defaults) if d is not None}
            return next((default for param, default in defaults.items() if param.arg == node.id), node)
        return node


def owner(kind: tuple[str, str] | None, word: ast.AST) -> str | None:
    """The owner's name (ROW_WORDS) of `word` keying a row of `kind`; None where it is no row or no such word."""
    if kind is None or not isinstance(word, ast.Constant) or not isinstance(word.value, str):
        return None
    return ROW_WORDS[kind[0]].get(word.value)


@functools.lru_cache(maxsize=None)
def row_readers() -> dict[str, str]:
    """The functions of every checked module that return rows of the records, by name: their kind of row."""
    readers: dict[str, str] = {}
    trackers = [RowTracker(ast.parse(path.read_text(), str(path)), readers) for path in checked_files().values()]
    while True:
        found = {name: kind for tracker in trackers for name, kind in tracker.follow().items()}
        if found.items() <= readers.items():
            return readers
        readers.update(found)


def state_writes(tree: ast.AST) -> set[str]:
    """The protocol names (`protocol.X`, or X imported from it) that a call of a BUS_WRITES method takes as an
    argument, "CHECKPOINTS_DIR" or "METRICS_RECORDS" where the module spells the checkpoints directory's name or
    a role's records file itself, "EVAL_RESULTS" where it names an evaluation's key (protocol.eval_result),
    "EVAL_RECORDS" where it spells the name of an evaluation's figure in the records ("eval/..."), and "RUN_FILES"
    where it spells config.yaml, summary.json or the logs directory's name; "LEARNER_FIGURES" where it spells the
    name of a learner's figure that others read ("time/...", "alarms/...", "agent/...", "staleness_mean"),
    "ROUTING_FIGURES" a rollout worker's request figure's ("requests/...") and "AGENT_FIGURES" an agent's; and the
    owner of each plain word (ROW_WORDS) it keys a row of the records with (RowTracker)."""
    written = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in BUS_WRITES:
            for arg in node.args:
                if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "protocol":
                    written.add(arg.attr)
                elif isinstance(arg, ast.Name) and arg.id.isupper():
                    written.add(arg.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "protocol" \
                and node.attr == "eval_result":
            written.add("EVAL_RESULTS")
        elif isinstance(node, ast.Constant) and node.value in ("checkpoints", "step_"):
            written.add("CHECKPOINTS_DIR")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and METRICS_RECORDS.fullmatch(node.value):
            written.add("METRICS_RECORDS")
        elif isinstance(node, ast.Constant) and node.value in ("config.yaml", "summary.json", "logs"):
            written.add("RUN_FILES")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("eval/"):
            written.add("EVAL_RECORDS")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and LEARNER_FIGURES.fullmatch(node.value):
            written.add("LEARNER_FIGURES")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("requests/"):
            written.add("ROUTING_FIGURES")
        elif isinstance(node, ast.Constant) and node.value in AGENT_FIGURES:
            written.add("AGENT_FIGURES")
    return written | RowTracker(tree, row_readers()).keyed()


# The scripts a user runs beside the library (benchmarks, data preparation): no layer's modules, yet readers of the
# same run files and records, so they name them through the owners too
SCRIPT_DIRS = ("bench", "scripts")


def script_files() -> dict[str, Path]:
    """Dotted name -> file, for the Python files of SCRIPT_DIRS."""
    return {".".join(path.relative_to(ROOT).with_suffix("").parts): path
            for directory in SCRIPT_DIRS for path in sorted((ROOT / directory).rglob("*.py"))}


def checked_files() -> dict[str, Path]:
    """Dotted name -> file, for every module of the layers and every script."""
    return {module: path for module, (path, _) in module_files().items()} | script_files()


def test_each_owned_piece_of_state_is_written_only_by_its_owner():
    strays = []
    for module, path in sorted(checked_files().items()):
        for name in sorted(state_writes(ast.parse(path.read_text(), str(path))) & OWNERS.keys()):
            if module not in OWNERS[name]:
                strays.append(f"{module} writes (or spells) {name}, which {', '.join(sorted(OWNERS[name]))} own(s)")
    assert not strays, "shared state written past its owner:\n  " + "\n  ".join(strays)


def test_the_owner_check_sees_a_write():
    tree = ast.parse("bus.incr(protocol.WEIGHT_CHECKS)\nbus.change([Step.add(DEAD_LETTERS, 1)])\n"
                     "path = run_dir / 'checkpoints'\nbus.get(protocol.STOP)\n"
                     "logs.glob('rollout*.jsonl')\nbus.get(protocol.eval_result('initial'))\n"
                     "save_config(config, run_dir / 'config.yaml')\nrow['eval/accuracy']\n"
                     "row[f'time/{key}']\nrow['requests/resent']\n")
    assert state_writes(tree) == {"WEIGHT_CHECKS", "DEAD_LETTERS", "CHECKPOINTS_DIR", "METRICS_RECORDS",
                                  "EVAL_RESULTS", "RUN_FILES", "EVAL_RECORDS", "LEARNER_FIGURES", "ROUTING_FIGURES"}
    for spelled in ("row['staleness_mean']", "stats.get('alarms/probe_kl')", "mean(r['agent/turns'] for r in w)"):
        assert state_writes(ast.parse(spelled)) == {"LEARNER_FIGURES"}


def test_the_owner_check_sees_a_plain_word_key_a_row_of_the_records_and_nothing_else():
    """"step", "reward", "accuracy", an evaluation's "version" key rows of the records where the row came from a
    reader of them, however far it went (a loop, a comprehension, a function's argument or return, an attribute);
    elsewhere they are words."""
    reads = {
        "from rlsys.metrics import read_jsonl_metrics\nfor row in read_jsonl_metrics(p):\n    print(row['step'])":
            {"RECORD_FIELDS"},
        "from rlsys import evaluations\nfirst = evaluations.result(bus, 'initial') or {}\nfirst.get('accuracy')":
            {"EVAL_RECORDS"},
        "from rlsys.metrics import read_jsonl_metrics as read\ndef rows(p):\n    return read(p)\n"
        "def plot(learner):\n    return series(learner, 'reward')\nplot(rows(p)[1:])": {"LEARNER_FIGURES"},
        "from rlsys.metrics import JsonlFollower\nfrom rlsys.evaluations import figures\nclass C:\n"
        "    def __init__(self, p):\n        self.follow = JsonlFollower(p)\n    def new(self):\n"
        "        return [e for e in map(figures, self.follow()) if e]\n"
        "    def say(self):\n        for e in self.new():\n            'accuracy' in e": {"EVAL_RECORDS"},
        "from rlsys.metrics import read_jsonl_metrics\nfirst, last = rows[0], read_jsonl_metrics(p)[-1]\nlast['time']":
            {"RECORD_FIELDS"},
        "from rlsys import evaluations\nfor e in evaluations.curve(d):\n    e['version_max'], e.get('failed')":
            {"EVAL_RECORDS"},
        "from rlsys import evaluations\nplot(evaluations.curve(d), evaluations.ACCURACY, 'version')": {"EVAL_RECORDS"},
        # written through a dict: to the records' writer, beside rows, or as a row to a function whose parameter holds
        # one; and words a parameter takes by default
        "from rlsys.metrics import MetricsLogger\nclass W:\n    def __init__(self, d):\n"
        "        self.metrics = MetricsLogger(d, 'x')\n    def end(self, r):\n"
        "        self.metrics.log(1, {'reward': r})":
            {"LEARNER_FIGURES"},
        "from rlsys.metrics import read_jsonl_metrics\nrows = read_jsonl_metrics(p)\nrows.append({'step': 3})":
            {"RECORD_FIELDS"},
        "from rlsys import evaluations\ndef say(e):\n    return e\nsay(evaluations.result(bus, 'final'))\n"
        "say({'accuracy': 0.5})": {"EVAL_RECORDS"},
        "from rlsys.metrics import read_jsonl_metrics\ndef plot(rows, key='reward'):\n"
        "    return [r[key] for r in rows]\nplot(read_jsonl_metrics(p))": {"LEARNER_FIGURES"},
        "from rlsys.metrics import read_jsonl_metrics\ndef plot(rows, *, key='time'):\n    return series(rows, key)\n"
        "plot(read_jsonl_metrics(p))": {"RECORD_FIELDS"},
    }
    for source, owners in reads.items():
        assert state_writes(ast.parse(source)) == owners, source
    words = ("from rlsys.metrics import read_jsonl_metrics\nrows = read_jsonl_metrics(p)\n"
             "def other():\n    rows = traces()\n    return rows[0]['reward'], state['step'], t.get('accuracy')\n"
             "{'step': 1, 'reward': 0.5}\nrows[0]['advantage']\nsorted(rows, key='step')[0]['version']\n"
             "from rlsys.metrics import MetricsLogger\nlogger = MetricsLogger(d, 'x')\n"
             "logger.log(1, {'episodes/failed': 2})\nlog.log(20, {'step': 1})\nsay({'reward': 1})\n"
             "def f(x, key='step'):\n    return x[key]\n"
             "def g(rows, key='advantage'):\n    return [r[key] for r in rows]\ng(read_jsonl_metrics(p))")
    assert state_writes(ast.parse(words)) == set()
    assert state_writes(ast.parse("state = read_trainer_state(p)\nstate['step'], message['reward']")) == set()
    # beside an evaluation's rows, a version that is none of theirs: the weights' on the bus, a trace's, a checkpoint's,
    # the learner's in its records (an evaluation's words key an evaluation's rows)
    versions = ("from rlsys import evaluations\nfrom rlsys.metrics import read_jsonl_metrics\n"
                "curve = evaluations.curve(d)\nweights = bus.get(protocol.WEIGHTS) or {}\nweights['version']\n"
                "for episode in read_traces(run_dir):\n    episode['version'], episode.get('failed')\n"
                "{'version': 1, 'episodes': 2}\nread_trainer_state(p)['version']\n"
                "[row['version'] for row in read_jsonl_metrics(p) if 'episodes/failed' in row]")
    assert state_writes(ast.parse(versions)) == set()


# Names in rlsys.protocol that are no key on the bus: the learners' consumer group (it lives in TRAJECTORIES' stream),
# an environment variable and the role processes' names (role_stop_reason's keys are made of them)
NOT_BUS_KEYS = {"LEARNERS", "RENDEZVOUS_LISTEN_FD", "KEPT_AT_A_START", "role_name"}


def unaccounted_keys(module) -> list[str]:
    """The bus keys `module` (rlsys.protocol) names that a start of the roles neither deletes (cleared_at_a_start)
    nor leaves with a reason (KEPT_AT_A_START): a key a start forgets, which the next run finds as an earlier one
    left it. A key function counts as deleted where some key it makes (its argument any text) is."""
    cleared = module.cleared_at_a_start(2, 2, 2, fresh=True, keep_initial_eval=False)
    missing, not_keys = [], NOT_BUS_KEYS | module.KEPT_AT_A_START.keys() | {"cleared_at_a_start"}
    for name, value in vars(module).items():
        if name.startswith("_") or name in not_keys:
            continue
        if isinstance(value, str):
            found = value in cleared
        elif inspect.isfunction(value) and value.__module__ == module.__name__:
            shape = re.compile(".+".join(map(re.escape, value("\0").split("\0"))))
            found = any(shape.fullmatch(key) for key in cleared)
        else:
            continue
        if not found:
            missing.append(name)
    return missing


def test_a_start_deletes_or_keeps_with_a_reason_every_key_on_the_bus():
    from rlsys import protocol

    assert not unaccounted_keys(protocol), (
        "keys that a start of the roles neither deletes nor keeps with a reason (rlsys/protocol.py: add each to "
        f"cleared_at_a_start or KEPT_AT_A_START): {unaccounted_keys(protocol)}")


def test_the_start_check_sees_a_forgotten_key():
    from rlsys import protocol

    module = types.ModuleType(protocol.__name__)
    module.__dict__.update(cleared_at_a_start=lambda *_, **__: ["a:1", "b"], KEPT_AT_A_START={"kept": "why"},
                           A="a:1", B="b", C="c", kept=lambda i: f"k:{i}")
    exec("def key_of(i):\n    return f'a:{i}'\ndef forgotten(i):\n    return f'f:{i}'\n", module.__dict__)
    assert unaccounted_keys(module) == ["C", "forgotten"]
