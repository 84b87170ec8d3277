"""The noxfile's own logic: sibling discovery, lower bounds, sources of old versions, indexes."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess

import nox  # installed by the test-plugins session
import pytest
from packaging.version import Version  # nox depends on packaging

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def noxfile():
    spec = importlib.util.spec_from_file_location("tzrec_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeSession:
    venv_backend = "uv"

    def __init__(self):
        self.messages = []

    def log(self, message):
        self.messages.append(message)

    warn = log

    def error(self, message):
        raise RuntimeError(message)


def test_session_names_ci_and_the_readme_use_exist(noxfile):
    names = set(nox.registry.get())
    assert {"test-ops", "test-gr", "test-acc", "test-bench", "lint", "demo", "tests"} <= names
    assert set(noxfile.CI_SESSIONS) <= names
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m nox -s tests" in readme and "python3 -m nox -s demo" in readme
    assert "python3 -m nox -s tests" in (ROOT / ".ci" / "run").read_text()


def test_each_demo_run_gets_its_own_folder(noxfile):
    runs = noxfile.DEMO_RUNS
    assert noxfile._demo_out_dir([]) == (runs / "hstu-retrieval-synthetic", False)
    movielens = ["--data", "ml-100k", "--data-dir", "../shared/data/ml-100k", "--lr", "2e-3"]
    assert noxfile._demo_out_dir(movielens) == (runs / "hstu-retrieval-ml-100k", False)
    assert noxfile._demo_out_dir(["--model=sasrec", "--data=ml-1m"]) == (
        runs / "sasrec-ml-1m", False)
    assert noxfile._demo_out_dir([*movielens, "--out-dir", "mine"]) == (pathlib.Path("mine"), True)
    # a demo run replaces the last one in its own folder, and continues it on --resume
    default = str(runs / "hstu-retrieval-synthetic")
    assert noxfile._demo_folder_args([]) == ["--out-dir", default, "--overwrite"]
    assert noxfile._demo_folder_args(["--resume"]) == ["--out-dir", default]
    assert noxfile._demo_folder_args(["--out-dir", "mine"]) == []
    # the README names the default run's folder
    readme = (ROOT / "README.md").read_text()
    assert f"{(runs / 'hstu-retrieval-synthetic').relative_to(ROOT)}/curves.png" in readme


def test_every_readme_has_a_cpu_install_block_that_pins_torch_first(noxfile, tmp_path):
    assert "install-cpu" in noxfile.CI_SESSIONS
    assert [r.relative_to(ROOT).as_posix() for r in noxfile.INSTALL_READMES] == [
        "README.md", *(f"packages/{d}/README.md" for d in noxfile.PACKAGES.values())]
    torch_version = noxfile.TORCH_PIN.split("==")[1].split("+")[0]
    for readme in noxfile.INSTALL_READMES:
        commands = noxfile._install_lines(readme)
        assert commands[0][:3] == ["pip", "install", f"torch=={torch_version}"], readme
        # the packages, by path and without extras (tzrec-gr[torchrec] would take the CUDA
        # fbgemm-gpu), each README's own last
        ours = [c for c in commands if any(w.startswith("./packages/") for w in c)]
        assert all(w.startswith("./packages/") and "[" not in w for c in ours for w in c[2:])
        assert ours[-1][-1] == f"./packages/{readme.parent.name}" or readme.parent == ROOT
    root = noxfile._install_lines(ROOT / "README.md")
    assert root[-1] == ["pip", "install", "./packages/tzrec-ops", "./packages/tzrec-gr"]
    bad = tmp_path / "README.md"
    bad.write_text(f"{noxfile.INSTALL_MARK}\n```bash\npip install x\nrm -rf y  # no\n```\n")
    with pytest.raises(ValueError, match="runs 'rm -rf y  # no', not pip install"):
        noxfile._install_lines(bad)
    bad.write_text(f"{noxfile.INSTALL_MARK}\ntext\n```bash\npip install x\n```\n")
    with pytest.raises(ValueError, match="must come right before a fenced block"):
        noxfile._install_lines(bad)


def _pins(path):
    """``name -> version`` of the ``==`` lines of a requirements file (markers dropped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].split(";")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def test_install_cpu_installs_torchrec_with_pip_as_the_readmes_say(noxfile):
    cpu = ["pip", "install", "fbgemm-gpu-cpu==1.8.0", "tensordict==0.15.3",
           "torchmetrics==1.0.3", "tqdm", "pyre-extensions"]
    no_deps = ["pip", "install", "torchrec==1.8.0", "--no-deps"]
    for dist in ("tzrec-gr", "tzrec-bench"):  # the two packages with a torchrec extra
        commands = noxfile._install_lines(ROOT / "packages" / dist / "README.md")
        # torchrec's other requirements, fbgemm-gpu-cpu for the CUDA fbgemm-gpu, then torchrec
        assert commands.index(cpu) + 1 == commands.index(no_deps), dist
    # the versions the test sessions pin (torchmetrics aside: torchrec pins 1.0.3, the sessions
    # keep the constraints' newer one through uv's override or pip's --no-deps)
    pins = _pins(noxfile.CONSTRAINTS)
    for req in noxfile._named_requirements(cpu + no_deps[2:]):
        if req.name != "torchmetrics" and req.specifier:
            assert str(req.specifier) == f"=={pins[req.name]}", req
    assert [str(r) for r in noxfile._named_requirements(
        ["pip", "install", "torch==2.13.0", "--index-url", "https://x.org/whl", "./packages/a",
         "-c", "c.txt", "tqdm"])] == ["torch==2.13.0", "tqdm"]
    # after them the session plans a table with torchrec
    assert noxfile.TORCHREC_CHECK[:2] == ("tzrec-bench", "plan")
    assert "--device" in noxfile.TORCHREC_CHECK


def test_ci_runs_every_dependent_against_both_ends_of_its_tzrec_ops_range(noxfile):
    dependents = [
        short
        for short, dist in noxfile.PACKAGES.items()
        if dist != "tzrec-ops" and "tzrec-ops" in noxfile._siblings(dist)
        and short != "bench"  # an application, not a library others build on
    ]
    assert dependents == ["gr", "acc"]
    for short in dependents:
        # the lower end: the lowest tzrec-ops declared; the upper: this tree's, as installed
        assert f"compat-{short}-ops-min" in noxfile.CI_SESSIONS
        assert f"test-{short}" in noxfile.CI_SESSIONS
    ops = str(ROOT / "packages" / "tzrec-ops")
    args = noxfile._sibling_args(noxfile._siblings("tzrec-acc"))
    assert args == ["-e", str(ROOT / "packages" / "tzrec-gr"), ops]  # ops not editable


def test_siblings_come_from_the_declared_dependencies(noxfile):
    assert noxfile._siblings("tzrec-ops") == []
    assert noxfile._siblings("tzrec-gr") == ["tzrec-ops"]
    assert noxfile._siblings("tzrec-acc") == ["tzrec-gr", "tzrec-ops"]
    assert noxfile._siblings("tzrec-bench") == ["tzrec-acc", "tzrec-gr", "tzrec-ops"]


def test_lower_bound_is_read_from_the_pyproject(noxfile):
    assert noxfile._lower_bound("tzrec-gr", "tzrec-ops") >= Version("0.1")
    with pytest.raises(ValueError, match="tzrec-ops does not depend on tzrec-gr"):
        noxfile._lower_bound("tzrec-ops", "tzrec-gr")


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _commit(repo, version, code, message):
    package = repo / "packages" / "tzrec-ops"
    package.mkdir(parents=True, exist_ok=True)
    (package / "pyproject.toml").write_text(
        f'[project]\nname = "tzrec-ops"\nversion = "{version}"\n'
    )
    (package / "code.py").write_text(code)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


@pytest.fixture
def history(noxfile, monkeypatch, tmp_path):
    """A repository where tzrec-ops went 0.1.0 ("first", "second") -> 0.2.0 ("third")."""
    _git(tmp_path, "init", "-q")
    _commit(tmp_path, "0.1.0", "first", "0.1.0")
    _commit(tmp_path, "0.1.0", "second", "fix at 0.1.0")
    _commit(tmp_path, "0.2.0", "third", "bump")
    monkeypatch.setattr(noxfile, "ROOT", tmp_path)
    return tmp_path


def _code_at(noxfile, version):
    source = noxfile._source_of(FakeSession(), "tzrec-ops", Version(version))
    return (pathlib.Path(source) / "code.py").read_text()


def test_old_version_is_the_last_commit_before_the_bump(noxfile, history):
    assert _code_at(noxfile, "0.1") == "second"


def test_release_tag_wins(noxfile, history):
    _git(history, "tag", "tzrec-ops-v0.1.0", "HEAD~2")
    assert _code_at(noxfile, "0.1.0") == "first"


def test_in_repo_version_uses_the_working_tree(noxfile, history):
    (history / "packages" / "tzrec-ops" / "code.py").write_text("uncommitted")
    assert _code_at(noxfile, "0.2") == "uncommitted"


def test_unknown_version_fails_clearly(noxfile, history):
    with pytest.raises(RuntimeError, match="cannot find tzrec-ops 0.0.5: no tag tzrec-ops-v0.0.5"):
        _code_at(noxfile, "0.0.5")


def test_uv_gets_pip_find_links(noxfile, monkeypatch, tmp_path):
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    monkeypatch.setattr(noxfile, "_pip_find_links", lambda: (str(tmp_path),))
    monkeypatch.delenv("TZREC_TORCH_INDEX", raising=False)
    assert noxfile._index_args(FakeSession()) == ["--find-links", str(tmp_path)]


def test_uv_without_a_torch_wheel_fails_clearly(noxfile, monkeypatch, tmp_path):
    monkeypatch.setattr(noxfile, "_pip_find_links", lambda: (str(tmp_path),))
    for var in ("TZREC_TORCH_INDEX", "UV_FIND_LINKS", "UV_INDEX", "UV_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"no torch-2\.13\.0\+cpu wheel in pip's find-links"):
        noxfile._index_args(FakeSession())
