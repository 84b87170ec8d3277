"""Sessions for the tzrec monorepo.

    nox -s test-ops test-gr   # one package's tests, each in its own environment
    nox -s tests              # what CI runs: lint, every test session, compat, the demo
    nox -s demo               # the main job
    nox -l                    # every session

One file, past 600 lines: nox reads its sessions from this module only, and splitting them
over imported modules would hide them from ``nox -l`` readers of this file.

Each session installs only what it names, pinned by ``constraints/cpu.txt``. Sibling packages
come from this repository, never from an index. Environments are reused between runs
(``.nox/``); local packages are reinstalled every time so that metadata changes are seen.

uv (the default backend when it is installed) ignores pip's configuration, so the folders in
pip's ``find-links`` setting (where the CPU build of torch lies) are handed to it explicitly.
Set ``TZREC_TORCH_INDEX`` to a wheel index holding ``torch==2.13.0+cpu`` on a machine that has
no such folder.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from typing import List, Optional, Tuple

import nox
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox depends on tomli on Python 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"
REPORTS = ROOT / ".nox" / "reports"
EXAMPLE_PLUGIN = ROOT / "examples" / "tzrec-ops-backend-example"
EXAMPLE_MODEL_PLUGIN = ROOT / "examples" / "tzrec-gr-model-example"
TORCH_PIN = "torch==2.13.0+cpu"
TEST_TOOLS = ("pytest", "pytest-xdist")

# short name -> distribution; the distribution's folder is packages/<distribution>
PACKAGES = {"ops": "tzrec-ops", "gr": "tzrec-gr", "acc": "tzrec-acc", "bench": "tzrec-bench"}
# extras each package's tests install: tzrec-ops runs its Triton kernels in the interpreter;
# tzrec-bench's service tests need its HTTP layer
TEST_EXTRAS = {"tzrec-ops": "test,triton", "tzrec-bench": "test,serve"}
# suites long enough to run on every core
PARALLEL = {"tzrec-ops", "tzrec-gr", "tzrec-acc"}

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]


# -- installing ---------------------------------------------------------------------------


def _pyproject(dist: str) -> dict:
    with open(ROOT / "packages" / dist / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _siblings(dist: str) -> List[str]:
    """The tzrec distributions ``dist`` declares, in its dependencies or its test extra."""
    project = _pyproject(dist)
    declared = list(project.get("dependencies", []))
    declared += project.get("optional-dependencies", {}).get("test", [])
    ours = {canonicalize_name(d) for d in PACKAGES.values()}
    names = {canonicalize_name(Requirement(r).name) for r in declared}
    return sorted(names & ours - {canonicalize_name(dist)})


@functools.cache
def _pip_find_links() -> Tuple[str, ...]:
    """The folders in pip's ``find-links`` setting (config files and ``PIP_FIND_LINKS``)."""
    pip = [sys.executable, "-m", "pip"]
    if subprocess.run([*pip, "--version"], capture_output=True).returncode != 0:
        pip = [shutil.which("pip") or "pip"]
    try:
        listing = subprocess.run(
            [*pip, "config", "list"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        listing = ""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += shlex.split(value.strip().strip("'\""))
    return tuple(dict.fromkeys(links))


def _index_args(session: nox.Session) -> List[str]:
    """Where uv or pip finds the pinned CPU build of torch."""
    args: List[str] = []
    index = os.environ.get("TZREC_TORCH_INDEX")
    if index:
        args += ["--extra-index-url", index]
    if session.venv_backend != "uv":
        return args  # pip reads its own configuration
    links = _pip_find_links()
    for link in links:
        args += ["--find-links", link]
    wheel_name = TORCH_PIN.replace("==", "-")
    has_torch = any(
        pathlib.Path(link).is_dir() and any(pathlib.Path(link).glob(f"{wheel_name}-*.whl"))
        for link in links
    )
    elsewhere = any("://" in link for link in links) or any(
        os.environ.get(var) for var in ("UV_FIND_LINKS", "UV_INDEX", "UV_EXTRA_INDEX_URL")
    )
    if not (has_torch or index or elsewhere):
        session.error(
            f"no {wheel_name} wheel in pip's find-links ({list(links) or 'none set'}): put the CPU "
            "build of torch in a folder and set PIP_FIND_LINKS to it, or set TZREC_TORCH_INDEX "
            "to a wheel index that has it"
        )
    return args


def _install(session: nox.Session, *args: str, reinstall: tuple = ()) -> None:
    """``pip install`` (through uv when available) under the CPU constraints."""
    extra = _index_args(session)
    if session.venv_backend == "uv":
        for dist in reinstall:
            extra += ["--reinstall-package", dist]
    session.install("-c", str(CONSTRAINTS), *extra, *args)


def _package_path(dist: str, extras: str = "") -> str:
    path = str(ROOT / "packages" / dist)
    return f"{path}[{extras}]" if extras else path


# siblings installed from source, not editable, as a user gets them: the packages that depend
# on tzrec-ops are tested against this tree's tzrec-ops as it installs (its upper end of their
# range; ``compat-*-ops-min`` tests the lower end)
AS_INSTALLED = {"tzrec-ops"}


def _sibling_args(siblings: List[str]) -> List[str]:
    """pip arguments for ``siblings``: from this repo, editable unless in ``AS_INSTALLED``."""
    args: List[str] = []
    for sibling in siblings:
        args += [_package_path(sibling)] if sibling in AS_INSTALLED else [
            "-e", _package_path(sibling)]
    return args


def _install_packages(
    session: nox.Session, dist: str, *more: str, extras: Optional[str] = None
) -> None:
    """``dist`` (editable) with its test extras, its declared siblings from this repo
    (tzrec-ops as installed, the others editable) and the test tools."""
    siblings = _siblings(dist)
    args = _sibling_args(siblings)
    args += ["-e", _package_path(dist, extras or TEST_EXTRAS.get(dist, "test"))]
    _install(session, *args, *TEST_TOOLS, *more, reinstall=(dist, *siblings))


def _pytest(session: nox.Session, *paths: str, parallel: bool = False) -> None:
    """pytest on ``paths`` with a JUnit report that ``.ci/run`` adds up.

    ``parallel`` runs one pytest-xdist worker per core: worth it only for suites that take
    minutes, as each worker pays torch's import again.
    """
    REPORTS.mkdir(parents=True, exist_ok=True)
    default = ["-n", "auto"] if parallel and "-n" not in session.posargs else []
    session.run(
        "pytest",
        *paths,
        "-ra",
        f"--junitxml={REPORTS / (session.name + '.xml')}",
        *default,
        *session.posargs,
    )


# -- test sessions --------------------------------------------------------------------------


def _make_test_session(short: str, dist: str) -> None:
    @nox.session(name=f"test-{short}", tags=["test"])
    def _session(session: nox.Session) -> None:
        _install_packages(session, dist)
        _pytest(session, str(ROOT / "packages" / dist / "tests"), parallel=dist in PARALLEL)

    _session.__doc__ = f"{dist}'s tests with only {dist}, its declared siblings and test tools."


for _short, _dist in PACKAGES.items():
    _make_test_session(_short, _dist)


def _build_wheel(session: nox.Session, project: pathlib.Path, out_dir: pathlib.Path,
                 dist: str) -> str:
    """Build ``project`` as a wheel into ``out_dir``, as its author ships it; its path."""
    if session.venv_backend == "uv":
        session.run("uv", "build", "--wheel", "--out-dir", str(out_dir), str(project),
                    *_index_args(session), external=True)
    else:
        _install(session, "build")
        session.run("python", "-m", "build", "--wheel", "--outdir", str(out_dir), str(project))
    (wheel,) = out_dir.glob(f"{dist.replace('-', '_')}-*.whl")
    return str(wheel)


@nox.session(name="test-plugins", tags=["test"], reuse_venv=False)
def test_plugins(session: nox.Session) -> None:
    """The example plugins as a third party ships them: built as wheels, installed with
    tzrec-ops and tzrec-gr into a fresh environment.

    The backend (examples/tzrec-ops-backend-example) is seen by ``python -m tzrec_ops info``,
    picked by name and by ``TZREC_OPS_BACKEND`` (tests/test_plugin_install.py), and held to
    tzrec-ops' conformance suite (``pytest --tzrec-backend compiled``) and its own tests.
    The model (examples/tzrec-gr-model-example) is listed by tzrec-gr's model registry and
    trained, evaluated, predicted, served and exported by the tools unchanged
    (tests/test_model_plugin.py), and passes its own tests.

    tests/ holds the tests across packages, so tzrec-gr, tzrec-acc and tzrec-bench come along
    (editable).
    """
    wheels = pathlib.Path(session.create_tmp()) / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    backend = _build_wheel(session, EXAMPLE_PLUGIN, wheels, "tzrec-ops-compiled")
    model = _build_wheel(session, EXAMPLE_MODEL_PLUGIN, wheels, "tzrec-gr-model-example")
    _install(
        session,
        _package_path("tzrec-ops", "test"),
        backend,
        model,
        "-e",
        _package_path("tzrec-gr"),
        "-e",
        _package_path("tzrec-acc"),
        "-e",
        _package_path("tzrec-bench"),
        *TEST_TOOLS,
        "nox",  # tests/test_noxfile.py loads this file
        reinstall=("tzrec-ops", "tzrec-ops-compiled", "tzrec-gr-model-example", "tzrec-gr",
                   "tzrec-acc", "tzrec-bench"),
    )
    # Inductor's compiled kernels outlive the fresh environment (the C++ builds are most of
    # the suite's time); a cache entry is keyed on the code and the compiler flags
    session.env["TORCHINDUCTOR_CACHE_DIR"] = str(ROOT / ".nox" / "inductor-cache")
    _pytest(session, str(ROOT / "tests"), f"--rootdir={ROOT}")
    # the suite and the package's own tests, from the example's folder (its conftest loads
    # the conformance plugin); the installed wheel is what they import
    with session.chdir(EXAMPLE_PLUGIN):
        session.run("pytest", "tests", "--tzrec-backend", "compiled", "-ra", "-p",
                    "no:cacheprovider", f"--junitxml={REPORTS / 'test-plugins-suite.xml'}",
                    *session.posargs)
    with session.chdir(EXAMPLE_MODEL_PLUGIN):
        session.run("pytest", "tests", "-ra", "-p", "no:cacheprovider",
                    f"--junitxml={REPORTS / 'test-plugins-model.xml'}", *session.posargs)


# -- optional CPU extras: fbgemm-gpu-cpu and torchrec -------------------------------------------

TORCHREC_OVERRIDES = ROOT / "constraints" / "torchrec-cpu-overrides.txt"
# torchrec 1.8.0's requirements other than fbgemm-gpu (pip cannot override a requirement;
# torchmetrics at the constraints' version, as in the overrides file)
TORCHREC_DEPS = ("tensordict", "torchmetrics", "tqdm", "pyre-extensions")


@nox.session(name="test-ops-fbgemm", tags=["test"])
def test_ops_fbgemm(session: nox.Session) -> None:
    """tzrec-ops' tests with fbgemm-gpu-cpu (the pytorch backend uses it), without triton.

    The Triton kernel tests (``test_triton_*.py``) are left to ``test-ops``: fbgemm changes
    only the pytorch backend, and their float64 oracle never uses fbgemm.
    """
    _install_packages(session, "tzrec-ops", "fbgemm-gpu-cpu", extras="test")
    _pytest(
        session,
        str(ROOT / "packages" / "tzrec-ops" / "tests"),
        "--ignore-glob=*/test_triton_*.py",
        parallel=True,
    )


# the tests that need torchrec (each skips without it in the other sessions)
TORCHREC_TESTS = (
    "packages/tzrec-gr/tests/test_embeddings.py",
    "packages/tzrec-gr/tests/test_torchrec_adapters.py",
    "packages/tzrec-bench/tests/test_plan.py",
    "packages/tzrec-bench/tests/test_sharded_training.py",
)


@nox.session(name="test-torchrec", tags=["test"])
def test_torchrec(session: nox.Session) -> None:
    """The tests that need torchrec, with torchrec and fbgemm-gpu-cpu installed: tzrec-gr's
    torchrec tables and input adapters, tzrec-bench's sharded training (2 gloo processes) and
    ``plan``."""
    _install_packages(session, "tzrec-bench", "fbgemm-gpu-cpu")
    if session.venv_backend == "uv":
        _install(session, "--override", str(TORCHREC_OVERRIDES), "torchrec")
    else:
        _install(session, "--no-deps", "torchrec")
        _install(session, *TORCHREC_DEPS)
    _pytest(session, *(str(ROOT / path) for path in TORCHREC_TESTS))


# -- compatibility --------------------------------------------------------------------------


def _lower_bound(dist: str, dependency: str) -> Version:
    """The lowest version of ``dependency`` that ``dist`` declares it works with."""
    for line in _pyproject(dist).get("dependencies", []):
        req = Requirement(line)
        if canonicalize_name(req.name) != canonicalize_name(dependency):
            continue
        bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
        if bounds:
            return max(bounds)
        raise ValueError(f"{dist} declares {line!r}, which has no lower bound")
    raise ValueError(f"{dist} does not depend on {dependency}")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def _version_at(commit: str, dist: str) -> Optional[Version]:
    try:
        text = _git("show", f"{commit}:packages/{dist}/pyproject.toml")
    except subprocess.CalledProcessError:
        return None
    return Version(tomllib.loads(text)["project"]["version"])


def _source_of(session: nox.Session, dist: str, version: Version) -> str:
    """A source tree of ``dist`` at ``version``.

    In order: the release tag ``<dist>-v<version>``; the working tree if it is still at that
    version (unreleased); else the last commit before the version was bumped past it.
    """
    tags = _git("tag", "--list", f"{dist}-v*").split()
    ref = next((t for t in tags if Version(t[len(dist) + 2 :]) == version), None)
    if ref is None:
        if Version(_pyproject(dist)["version"]) == version:
            session.log(f"{dist} {version} is the in-repo version (not tagged): using the tree")
            return _package_path(dist)
        # commits that touched the pyproject, newest first; the one after the newest commit
        # at `version` is the bump away from it, and its parent the last commit at `version`
        log = _git("log", "--format=%H", "--", f"packages/{dist}/pyproject.toml").split()
        at = next((i for i, c in enumerate(log) if _version_at(c, dist) == version), None)
        if at is None:
            session.error(
                f"cannot find {dist} {version}: no tag {dist}-v{version} and no commit in "
                "this clone's history has that version (a shallow clone? run git fetch --tags)"
            )
        ref = f"{log[at - 1]}^" if at > 0 else "HEAD"
        session.warn(f"no tag {dist}-v{version}; using {ref}, the last commit at {version}")
    commit = _git("rev-parse", f"{ref}^{{commit}}").strip()
    target = ROOT / ".nox" / "_sources" / f"{dist}-{version}-{commit[:12]}"
    if not target.exists():
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, f"packages/{dist}"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
                tar.extractall(target, filter="data")
            else:
                tar.extractall(target)
    session.log(f"{dist} {version} from {ref} ({commit})")
    return str(target / "packages" / dist)


def _compat_session(short: str, dist: str) -> None:
    """Session ``compat-<short>-ops-min``: ``dist``'s tests against the lowest tzrec-ops it
    declares (``test-<short>`` tests the other end: this tree's, as installed)."""

    @nox.session(name=f"compat-{short}-ops-min", tags=["compat"])
    def _session(session: nox.Session) -> None:
        version = _lower_bound(dist, "tzrec-ops")
        if version == Version(_pyproject("tzrec-ops")["version"]):
            session.skip(
                f"{dist} declares tzrec-ops >= {version}, this tree's version: "
                f"test-{short} runs the same tests against the same source, as installed"
            )
        ops_source = _source_of(session, "tzrec-ops", version)
        # the other tzrec packages dist declares come from this tree, editable
        others = [d for d in _siblings(dist) if d != "tzrec-ops"]
        args = [a for d in others for a in ("-e", _package_path(d))]
        _install(
            session,
            ops_source,  # not editable: installed as a user gets it
            *args,
            "-e",
            _package_path(dist, "test"),
            *TEST_TOOLS,
            reinstall=("tzrec-ops", dist, *others),
        )
        installed = session.run(
            "python", "-c", "import importlib.metadata as m; print(m.version('tzrec-ops'))",
            silent=True,
        ).strip()
        if Version(installed) != version:
            session.error(f"expected tzrec-ops {version} in the environment, found {installed}")
        _pytest(session, str(ROOT / "packages" / dist / "tests"), parallel=dist in PARALLEL)

    _session.__doc__ = f"{dist}'s tests against the lowest tzrec-ops version it declares."


# every package that depends on tzrec-ops, against the lower end of the range it accepts
COMPAT_SESSIONS = []
for _short in ("gr", "acc"):
    _compat_session(_short, PACKAGES[_short])
    COMPAT_SESSIONS.append(f"compat-{_short}-ops-min")


# -- installing as a user does, on a CPU machine ---------------------------------------------

# put before a fenced block of pip commands in a README: install-cpu runs them as written
INSTALL_MARK = "<!-- nox -s install-cpu runs the next block as written -->"
INSTALL_READMES = (
    ROOT / "README.md", *(ROOT / "packages" / dist / "README.md" for dist in PACKAGES.values())
)


def _install_lines(readme: pathlib.Path) -> List[List[str]]:
    """The commands of the blocks marked with :data:`INSTALL_MARK` in ``readme``, split as a
    shell would (comments dropped); each must be a ``pip install``."""
    text = readme.read_text()
    commands = []
    for block in re.findall(re.escape(INSTALL_MARK) + r"\s*```\w*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if words[:2] != ["pip", "install"]:
                raise ValueError(f"{readme}: a marked install block runs {line!r}, not pip install")
            commands.append(words)
    if text.count(INSTALL_MARK) != len(re.findall(re.escape(INSTALL_MARK) + r"\s*```", text)):
        raise ValueError(f"{readme}: {INSTALL_MARK} must come right before a fenced block")
    return commands


# pip install's options that take the next word as their value
_PIP_VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "-e", "--editable", "-i",
                      "--index-url", "--extra-index-url", "-f", "--find-links"}


def _named_requirements(command: List[str]) -> List[Requirement]:
    """The requirements a ``pip install`` command names by name (not paths, URLs, options)."""
    named = []
    words = iter(command[2:])
    for word in words:
        if word in _PIP_VALUE_OPTIONS:
            next(words, None)
        elif word.startswith(("-", ".", "/")):
            continue
        else:
            try:
                named.append(Requirement(word))
            except InvalidRequirement:  # a URL or another file
                continue
    return named


# after the READMEs' torchrec lines (fbgemm-gpu-cpu, then torchrec --no-deps): a small table
# planned by torchrec on the CPU; importing torchrec is most of its ~10 s
TORCHREC_CHECK = ("tzrec-bench", "plan", "--items", "1e6", "--embedding-dim", "64",
                  "--world-size", "2", "--device", "cpu", "--sharding-type", "table_wise")


@nox.session(name="install-cpu", tags=["test"], venv_backend="venv", reuse_venv=False)
def install_cpu(session: nox.Session) -> None:
    """The READMEs' CPU install lines, as written, with pip in a fresh environment.

    Runs every distinct command of the blocks marked ``INSTALL_MARK`` in the root README and
    the packages' (torch's CPU build first, then the packages from this repository, then
    tzrec-gr's and tzrec-bench's torchrec lines), the root README's first. After each, the
    packages it named must import without a UserWarning (torch warns when numpy is missing;
    tzrec-ops declares it). Then torchrec and fbgemm_gpu must import the same way and
    ``tzrec-bench plan`` plan a small table (:data:`TORCHREC_CHECK`), and at the end torch
    must be the pinned version with no CUDA package beside it (the CUDA ``fbgemm-gpu``
    included, which torchrec's own requirements would take). No constraints and no uv: this
    is what a user types. An index the machine cannot reach (CI cannot reach
    download.pytorch.org) is given up at once; pip then takes torch from its find-links.
    """
    session.env["PIP_RETRIES"] = "0"
    commands: List[List[str]] = []
    for readme in INSTALL_READMES:
        found = _install_lines(readme)
        if not found:
            session.error(f"{readme.relative_to(ROOT)} has no block marked {INSTALL_MARK}")
        commands += [c for c in found if c not in commands]
    with session.chdir(ROOT):  # the lines name ./packages/...
        for command in commands:
            session.run(*command)
            named = [pathlib.PurePath(w).name for w in command if w.startswith("./packages/")]
            if named:
                modules = ", ".join(name.replace("-", "_") for name in named)
                session.run("python", "-W", "error::UserWarning", "-c", f"import {modules}")
    requested = {canonicalize_name(r.name) for c in commands for r in _named_requirements(c)}
    if "torchrec" not in requested:
        session.error("no README line installs torchrec (tzrec-gr's and tzrec-bench's should)")
    session.run("python", "-W", "error::UserWarning", "-c", "import torchrec, fbgemm_gpu")
    session.run(*TORCHREC_CHECK)
    torch_version = TORCH_PIN.split("==")[1].split("+")[0]
    session.run("python", "-c", f"""
import importlib.metadata as metadata
import re
import torch
names = sorted(re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
               for d in metadata.distributions())
cuda = [n for n in names if n.startswith(("nvidia-", "cuda-")) or n in ("triton", "fbgemm-gpu")]
assert not cuda, f"CUDA packages installed: {{cuda}}"
assert torch.__version__.split("+")[0] == {torch_version!r}, torch.__version__
assert torch.version.cuda is None, torch.version.cuda
print("torch", torch.__version__, "(no CUDA);", len(names), "distributions")
""")


# -- lint, demo, CI ---------------------------------------------------------------------------


@nox.session(tags=["lint"])
def lint(session: nox.Session) -> None:
    """ruff over every package, test, example and this file (settings in ruff.toml)."""
    session.install("-c", str(CONSTRAINTS), "ruff")
    session.run("ruff", "check", "packages", "tests", "examples", "noxfile.py", *session.posargs)


DEMO_RUNS = ROOT / ".nox" / "demo-runs"
DEMO_MODEL, DEMO_DATA = "hstu-retrieval", "synthetic"


def _demo_out_dir(train_args: List[str]) -> Tuple[pathlib.Path, bool]:
    """The folder of a demo run given the ``tzrec-bench train`` arguments after ``--``, and
    whether they name it: their ``--out-dir``, else ``.nox/demo-runs/<model>-<data>``, so a
    run on MovieLens does not overwrite the synthetic run's checkpoints and curves."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--data", default=DEMO_DATA)
    parser.add_argument("--out-dir")
    known, _ = parser.parse_known_args(train_args)
    if known.out_dir:
        return pathlib.Path(known.out_dir), True
    return DEMO_RUNS / f"{known.model}-{known.data}", False


def _demo_folder_args(train_args: List[str]) -> List[str]:
    """The ``tzrec-bench train`` arguments that place a demo run: none when ``train_args``
    name the folder (the user's own, which train refuses to mix with another run), else the
    demo's folder, whose last run a new demo replaces (``--overwrite``) unless it continues
    it (``--resume``)."""
    out_dir, named = _demo_out_dir(train_args)
    if named:
        return []
    return ["--out-dir", str(out_dir), *([] if "--resume" in train_args else ["--overwrite"])]


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: HSTU retrieval trained on the synthetic data set, a short kernel
    benchmark, then a few ops.

    Prints the metrics table and the throughput, writes the curves, metrics and checkpoints
    to a folder of the run's own, ``.nox/demo-runs/<model>-<data>/`` (printed; an
    ``--out-dir`` after ``--`` wins). Arguments after ``--`` go to ``tzrec-bench train``
    (``nox -s demo -- --epochs 3``). The root README gives the time it takes.
    """
    siblings = _siblings("tzrec-bench")
    args = []
    for dist in siblings:
        args += ["-e", _package_path(dist)]
    _install(session, *args, "-e", _package_path("tzrec-bench", "plot"),
             reinstall=("tzrec-bench", *siblings))
    out_dir, _ = _demo_out_dir(session.posargs)
    session.log(f"this run's folder: {out_dir}")
    session.run(
        "tzrec-bench", "train", "--model", DEMO_MODEL, "--data", DEMO_DATA,
        "--max-seq-len", "100", "--epochs", "200",  # a guard: early stopping ends it
        *_demo_folder_args(session.posargs), *session.posargs,
    )
    # a short kernel benchmark: attention and layer norm on every available backend
    session.run(
        "tzrec-bench", "ops", "--op", "hstu_mha,layer_norm", "--seq-lens", "128", "--batch",
        "16", "--heads", "2", "--dim", "32", "--embedding", "64", "--rep", "50", "--no-csv",
        "--no-progress",
    )
    session.run("python", str(ROOT / "examples" / "quickstart.py"))
    session.log(f"the run's checkpoints, metrics and curves are in {out_dir}")


CI_SESSIONS = (
    "lint",
    "install-cpu",
    "test-ops",
    "test-gr",
    "test-acc",
    "test-bench",
    "test-plugins",
    "test-ops-fbgemm",
    "test-torchrec",
    *COMPAT_SESSIONS,
    "demo",
)


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """What CI runs: lint, every test session, the compat checks and the demo (queued)."""
    for name in CI_SESSIONS:
        session.notify(name)
