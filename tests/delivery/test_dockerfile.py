"""The Dockerfile: hadolint-clean, three final targets that run as a non-root user with no build tools, pinned
bases, an operator image without torch that still has every module the operator imports, and a build
context (.dockerignore) that holds what the Dockerfile copies. No Docker daemon is needed: the file is read
and linted, never built (the e2e workflow builds it)."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kubellm.operator.render import pods as pods_mod

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
FINAL_TARGETS = ("runtime-cpu", "runtime-cuda", "operator")
# Packages that compile code; none may be installed in a stage a final image is built from.
BUILD_TOOLS = ("build-essential", "gcc", "g++", "clang", "cmake", "make", "python3-dev", "python3.11-dev",
               "libc6-dev", "ninja-build")


@dataclass
class Stage:
    name: str
    base: str  # the FROM argument, with ARG defaults substituted
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def args_of(self, instruction: str) -> list[str]:
        return [args for ins, args in self.instructions if ins == instruction]


def _logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined; comments and blank lines dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """``(global ARG defaults, stages by name)``; FROM lines get the global ARG defaults substituted."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in _logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        rest = rest.strip()
        if instruction == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"stage-{len(stages)}"
            stage = Stage(name, base)
            stages[name] = stage
        elif stage is None:
            if instruction == "ARG" and "=" in rest:
                key, _, value = rest.partition("=")
                global_args[key] = value
        else:
            stage.instructions.append((instruction, rest))
    return global_args, stages


def ancestry(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and every stage of this Dockerfile it is built FROM, nearest first."""
    chain = []
    while name in stages:
        chain.append(stages[name])
        name = stages[name].base
    return chain


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _tool(name: str) -> str:
    """A console script of the dev environment (next to this Python), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it comes with the dev dependencies: pip install -e '.[dev]'")
    return found


def test_hadolint_reports_nothing():
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_every_ignored_hadolint_rule_has_a_written_reason():
    text = (ROOT / ".hadolint.yaml").read_text()
    config = yaml.safe_load(text)
    lines = text.splitlines()
    for rule in config.get("ignored", []):
        index = next(i for i, line in enumerate(lines) if line.strip() == f"- {rule}")
        comments = []
        for line in reversed(lines[:index]):
            if not line.strip().startswith("#"):
                break
            comments.append(line)
        assert any(rule in c for c in comments) and sum(len(c) for c in comments) > 80, (
            f".hadolint.yaml ignores {rule} without a comment above it saying why"
        )
    assert config.get("failure-threshold", "info") in ("style", "info"), "hadolint must fail on every finding"


def test_the_three_targets_exist(dockerfile):
    _, stages = dockerfile
    assert set(FINAL_TARGETS) <= set(stages), f"targets in the Dockerfile: {sorted(stages)}"


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_final_stage_runs_as_the_operators_non_root_user(dockerfile, target):
    _, stages = dockerfile
    users = [u for stage in reversed(ancestry(stages, target)) for u in stage.args_of("USER")]
    assert users, f"{target} sets no USER, so it runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid == str(pods_mod.RUN_AS_USER), f"{target}: USER {users[-1]}; pods run as uid {pods_mod.RUN_AS_USER}"
    assert gid in ("", str(pods_mod.RUN_AS_USER))
    useradd = " ".join(stages[target].args_of("RUN"))
    assert f"--uid {pods_mod.RUN_AS_USER}" in useradd, f"{target} does not create the user {pods_mod.RUN_AS_USER}"


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_final_stage_installs_no_build_tools(dockerfile, target):
    _, stages = dockerfile
    for stage in ancestry(stages, target):
        for command in stage.args_of("RUN"):
            words = set(re.split(r"[\s;&|]+", command))
            found = sorted(words.intersection(BUILD_TOOLS))
            assert not found, f"{target} is built on stage {stage.name}, which installs {found}: {command}"


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_final_stage_copies_only_built_environments(dockerfile, target):
    """No source tree or build context in a final image: only the builders' outputs under /opt."""
    _, stages = dockerfile
    for stage in ancestry(stages, target):
        for args in stage.args_of("COPY") + stage.args_of("ADD"):
            words = shlex.split(args)
            assert any(w.startswith("--from=") for w in words), f"{stage.name} copies from the context: {args}"
            assert all(w.startswith("/opt/") for w in words[-2:]), f"{stage.name}: COPY {args}"
    assert not stages[target].args_of("ADD")


def test_base_images_are_pinned(dockerfile):
    _, stages = dockerfile
    for stage in stages.values():
        if stage.base in stages or stage.base == "scratch":
            continue
        assert "$" not in stage.base, f"stage {stage.name}: FROM {stage.base} has no ARG default"
        _, _, tag = stage.base.rpartition(":")
        assert re.search(r"\d+\.\d+\.\d+", tag), f"stage {stage.name}: FROM {stage.base} is not pinned to a release"


def test_runtime_cpu_uses_cpu_torch_and_can_bake_the_demo_model(dockerfile):
    global_args, stages = dockerfile
    assert global_args["TORCH_CPU_INDEX"].endswith("/whl/cpu")
    assert global_args["TORCH_VERSION"] == "2.13.0"
    bake = " ".join(stages["demo-model"].args_of("RUN"))
    assert "kubellm models pull smollm2" in bake and "BAKE_DEMO_MODEL" in bake
    env = " ".join(stages["demo-model"].args_of("ENV") + stages["runtime-cpu"].args_of("ENV"))
    assert env.count("KUBELLM_CACHE=/opt/kubellm/cache") == 2, "the baked cache and the image's cache differ"


def test_runtime_cpu_ships_prebuilt_cpu_kernels_built_in_a_builder(dockerfile):
    """The compiler-free runtime-cpu image carries the native CPU kernels prebuilt per x86-64 level (see the
    header): compiled against runtime-cpu-builder's torch, copied root-owned, found via KUBELLM_CPU_KERNELS_DIR."""
    from kubellm.kernels import cpu_extension

    _, stages = dockerfile
    kernels = "/opt/kubellm/kernels"
    env = " ".join(stages["runtime-cpu"].args_of("ENV"))
    assert f"{cpu_extension.PREBUILT_ENV}={kernels}" in env
    copies = [shlex.split(args) for args in stages["runtime-cpu"].args_of("COPY")]
    [copy] = [words for words in copies if words[-1] == kernels]
    assert not [w for w in copy if w.startswith("--chown")], f"the kernels are code, root-owned: COPY {copy}"
    builder = next(w.removeprefix("--from=") for w in copy if w.startswith("--from="))
    assert "runtime-cpu-builder" in [s.name for s in ancestry(stages, builder)], (
        f"{builder} must build on runtime-cpu-builder: the libraries link against the torch the image ships")
    runs = " ".join(stages[builder].args_of("RUN"))
    assert f"kubellm kernels build --out {kernels}" in runs
    assert set(re.findall(r"--march (\S+)", runs)) == {"x86-64-v4-bf16", "x86-64-v4", "x86-64-v3"}
    assert "g++" in runs.split(), f"{builder} installs no compiler"
    # Nothing user-owned may hold the kernels folder (the user could swap it): no chown-ed COPY onto one of
    # its parents, and the kernels are copied before the user's cache creates /opt/kubellm.
    for i, words in enumerate(copies):
        if any(w.startswith("--chown") for w in words):
            assert not kernels.startswith(words[-1].rstrip("/") + "/"), f"COPY {words} owns a parent of {kernels}"
            if words[-1].startswith("/opt/kubellm/"):
                assert copies.index(copy) < i, "the kernels must be copied before the user-owned cache"


def test_runtime_cuda_installs_the_gpu_extra_with_cuda_torch(dockerfile):
    global_args, stages = dockerfile
    assert re.search(r"/whl/cu12\d$", global_args["TORCH_CUDA_INDEX"])
    runs = " ".join(stages["runtime-cuda-builder"].args_of("RUN"))
    assert "/src[gpu]" in runs and "TORCH_CUDA_INDEX" in runs


def _third_party_imports(paths: list[Path]) -> set[str]:
    """Top-level modules imported anywhere in these files (lazy imports too), less the stdlib and kubellm."""
    modules = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ("kubellm", "__future__")}


def _with_dependencies(names: set[str]) -> set[str]:
    """``names`` and everything they require (as installed in this environment), canonicalized."""
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def _operator_requirements(stages: dict[str, Stage]) -> list[Requirement]:
    words = shlex.split(" ".join(stages["operator-builder"].args_of("RUN")))
    return [Requirement(w) for w in words if re.match(r"^[A-Za-z][\w.-]*\s*[<>=!~]", w)]


def test_operator_image_installs_kubellm_without_torch(dockerfile):
    _, stages = dockerfile
    chain = ancestry(stages, "operator") + ancestry(stages, "operator-builder")
    installs = [part for s in chain for run in s.args_of("RUN") for part in run.split("&&") if "pip install" in part]
    assert not [i for i in installs if "torch" in i or "triton" in i], installs
    assert any("--no-deps /src" in i for i in installs), "kubellm must go in with --no-deps (else pip pulls torch)"


def test_operator_image_has_every_module_the_operator_imports(dockerfile):
    """operator/*.py and the `kubellm` command (runtime/cli.py, top level) must import with what the operator
    stage installs; the packages' own dependencies count (urllib3 comes with kubernetes)."""
    _, stages = dockerfile
    installed = _with_dependencies({r.name for r in _operator_requirements(stages)})
    cli_top_level = ast.parse((ROOT / "runtime" / "cli.py").read_text()).body
    cli_imports = {
        alias.name.split(".")[0] for node in cli_top_level if isinstance(node, ast.Import) for alias in node.names
    } - set(sys.stdlib_module_names)
    assert not cli_imports, f"runtime/cli.py imports {cli_imports} at top level; the operator image lacks them"
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    runs = sorted(p for p in (ROOT / "operator").rglob("*.py") if p != TEST_SUPPORT)
    for module in sorted(_third_party_imports(runs)):
        dists = {canonicalize_name(d) for d in distributions.get(module, [module])}
        if not dists & installed:
            missing[module] = sorted(dists)
    assert not missing, f"operator/ imports modules the operator image does not install: {missing}"


# kubellm.operator.testing: the kmock set-up the operator tests and benchmarks share (needs the dev extra).
TEST_SUPPORT = ROOT / "operator" / "testing.py"


def test_nothing_the_operator_runs_imports_its_test_support():
    """The image leaves kmock out, which holds only while no other operator module (nor the CLI) imports
    kubellm.operator.testing, lazily or not."""
    assert TEST_SUPPORT.is_file()
    importers = []
    for path in [*(ROOT / "operator").rglob("*.py"), *(ROOT / "runtime").rglob("*.py")]:
        if path == TEST_SUPPORT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.level == 0 else [
                    a.name for a in node.names if node.level == 1 and path.parent.name == "operator"]
            if any(n in ("kubellm.operator.testing", "testing") for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert not importers, f"{importers} import the operator's test support (kmock is not in the image)"
    assert "kmock" in _third_party_imports([TEST_SUPPORT])  # else the exclusion above is no longer needed


def test_operator_image_requirements_match_pyproject(dockerfile):
    _, stages = dockerfile
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {canonicalize_name(r.name): r.specifier for r in map(Requirement, pyproject["project"]["dependencies"])}
    for req in _operator_requirements(stages):
        name = canonicalize_name(req.name)
        assert name in declared, f"the operator image installs {req}, which pyproject.toml does not depend on"
        assert req.specifier == declared[name], f"Dockerfile {req} vs pyproject.toml {name}{declared[name]}"


def _dockerignore_keeps(path: str, patterns: list[str]) -> bool:
    """Whether the build context keeps ``path`` (Docker's rule: the last matching pattern wins)."""
    kept = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
            kept = negate
    return kept


def test_build_context_keeps_what_the_dockerfile_copies_and_nothing_heavy(dockerfile):
    _, stages = dockerfile
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    sources = []
    for stage in stages.values():
        for args in stage.args_of("COPY"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            if not any(w.startswith("--from=") for w in shlex.split(args)):
                sources += words[:-1]
    assert sources, "no COPY from the build context found"
    for source in sources:
        assert _dockerignore_keeps(source.rstrip("/"), patterns), f".dockerignore leaves out {source}"
    for heavy in (".git", ".venv", ".pytest_cache", "benchmarks", "e2e", "tests", "smollm2.gguf",
                  "runtime/models/x.safetensors", "e2e/artifacts"):
        assert not _dockerignore_keeps(heavy, patterns), f".dockerignore lets {heavy} into the build context"


def test_every_source_package_ships_in_the_wheel():
    """The images install kubellm as a wheel (not editable), which holds only the packages pyproject lists."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for package, folder in setuptools["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *relative.parts])
            assert name in listed, f"{init.parent.relative_to(ROOT)} holds package {name}, missing from " \
                                   "pyproject.toml [tool.setuptools] packages: an installed kubellm lacks it"
