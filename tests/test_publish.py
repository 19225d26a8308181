"""Publishing and one-click reruns: the workflow passes actionlint and runs the README's commands, Binder's and conda's
environments agree with pyproject.toml, and every notebook's setup cell installs lpfa only where it is missing."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import nbformat
import pytest
import yaml
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lpfa import publish
from lpfa.book import toc_notebooks
from lpfa.params import check_params

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).exists():
        pytest.fail(f"{name} is not installed: pip install 'lpfa[test]' (make test does)")
    return found


def _actionlint(*paths, cwd=ROOT) -> subprocess.CompletedProcess:
    """actionlint on ``paths``, with the installed shellcheck on its PATH (else it skips the `run:` scripts)."""
    path = f"{Path(_tool('shellcheck')).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run([_tool("actionlint"), "-no-color", *map(str, paths)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PATH": path})


def test_workflows_pass_actionlint():
    assert WORKFLOWS, "no workflow in .github/workflows"
    out = _actionlint(*(w.relative_to(ROOT) for w in WORKFLOWS))
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout[-4000:] + out.stderr[-1000:]


def test_actionlint_reports_a_broken_workflow(tmp_path):
    """The linter the previous test trusts does check: an unknown input of deploy-pages and an unquoted variable in a
    `run:` script (shellcheck's SC2086) are both reported."""
    wf = tmp_path / ".github" / "workflows" / "bad.yml"
    wf.parent.mkdir(parents=True)
    wf.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                  "      - uses: actions/deploy-pages@v4\n        with:\n          no_such_input: 1\n"
                  "      - run: echo $HOME\n")
    out = _actionlint(wf.relative_to(tmp_path), cwd=tmp_path)
    assert out.returncode == 1
    assert "no_such_input" in out.stdout and "SC2086" in out.stdout, out.stdout


def _commands(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in job["steps"])


def test_workflow_builds_and_deploys_on_main_and_tests_pull_requests():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "book.yml").read_text())
    on = wf[True]  # YAML 1.1 reads the key `on` as True
    assert on["push"]["branches"] == ["main"] and "pull_request" in on
    jobs = wf["jobs"]
    assert "make test" in _commands(jobs["test"]) and "pull_request" in jobs["test"]["if"]
    build = jobs["build"]
    assert "make book" in _commands(build) and "!= 'pull_request'" in build["if"]
    upload = next(s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == "_build/html"  # where `make book` puts the HTML (README)
    deploy = jobs["deploy"]
    assert deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in deploy["steps"])
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert deploy["concurrency"] == {"group": "pages", "cancel-in-progress": False}
    assert wf["env"]["TORCH_INDEX"] == CPU_INDEX  # the Makefile's variable: a CPU torch, not PyPI's CUDA build


# --- environments -----------------------------------------------------------------------------------------------------

def _requirements(extra: str | None = None) -> dict[str, Requirement]:
    deps = PYPROJECT["project"]["optional-dependencies"][extra] if extra else PYPROJECT["project"]["dependencies"]
    return {(r := Requirement(d)).name: r for d in deps if not d.startswith("lpfa[")}


def _makefile_torch() -> Requirement:
    m = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    return Requirement(m.group(1))


def _binder_lines() -> list[str]:
    text = (ROOT / "binder" / "requirements.txt").read_text()
    return [ln.split(" #")[0].strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_binder_requirements_agree_with_pyproject():
    """Binder installs the Makefile's torch pin (inside pyproject's range) from PyPI's CPU index, then lpfa with its
    book extra (pyproject's own ranges), on a Python that pyproject accepts."""
    lines = _binder_lines()
    assert f"--extra-index-url {CPU_INDEX}" in lines
    reqs = {(r := Requirement(ln)).name: r for ln in lines if not ln.startswith("-")}
    torch, pinned = reqs.pop("torch"), _makefile_torch()
    assert str(torch.specifier) == str(pinned.specifier), (torch, pinned)
    version = Version(next(iter(torch.specifier)).version)
    assert _requirements()["torch"].specifier.contains(version), (version, _requirements()["torch"])
    assert not reqs, f"binder/requirements.txt pins {sorted(reqs)}: leave them to pyproject.toml"
    assert "-e .[book]" in lines
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.\d+", runtime), runtime
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(runtime.removeprefix("python-") + ".0")


def test_environment_yml_mirrors_pyproject():
    """conda's environment asks conda-forge (the pytorch channel publishes no PyTorch after 2.5) for every
    dependency of lpfa and of its book and lab extras, in pyproject's ranges; pip installs lpfa itself."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and dep != "pip":
            r = Requirement(dep)
            conda[r.name] = r.specifier
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip == ["-e ."]
    assert conda.pop("python") == SpecifierSet(PYPROJECT["project"]["requires-python"])
    wanted = {**_requirements(), **_requirements("book"), **_requirements("lab")}
    wanted["pytorch-cpu"] = wanted.pop("torch")  # conda-forge's name for the CPU build of torch
    assert conda == {name: r.specifier for name, r in wanted.items()}


def _index_reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10).close()
        return True
    except (urllib.error.URLError, OSError):
        return False


def _pip_dry_run(*args) -> dict:
    """``pip install --dry-run --ignore-installed --report`` against the named index only (no local wheel folder, no
    pip configuration of this machine): what that index would install, as pip's report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--report", "-", *args], capture_output=True, text=True,
                         env={**env, "PIP_CONFIG_FILE": os.devnull}, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(out.stdout)["install"]}


def test_binder_torch_pin_resolves_on_the_cpu_index():
    """PyTorch's CPU index serves a Linux x86-64 wheel of the pinned torch for Binder's Python (needs the network;
    its file listing is read, not the 200 MB wheel)."""
    if not _index_reachable(f"{CPU_INDEX}/torch/"):
        pytest.skip(f"{CPU_INDEX} is unreachable from here: the pin is checked offline by "
                    "test_binder_requirements_agree_with_pyproject")
    version = next(iter(_makefile_torch().specifier)).version
    py = (ROOT / "binder" / "runtime.txt").read_text().strip().removeprefix("python-").replace(".", "")
    with urllib.request.urlopen(f"{CPU_INDEX}/torch/", timeout=60) as r:
        listing = urllib.parse.unquote(r.read().decode())
    wheel = re.compile(rf"torch-{re.escape(version)}\+cpu-cp{py}-cp{py}-manylinux[\w.]*_x86_64\.whl")
    assert wheel.search(listing), f"no CPU wheel of torch {version} for CPython {py} on {CPU_INDEX}"


def test_book_dependencies_resolve_on_pypi():
    """Everything lpfa[book] needs, torch apart, resolves together on PyPI today for this Python (needs the
    network); Binder installs the same set."""
    if not _index_reachable("https://pypi.org/simple/pip/"):
        pytest.skip("PyPI is unreachable from here: the ranges are checked offline by the two tests above")
    wanted = {**_requirements(), **_requirements("book")}
    wanted.pop("torch")
    got = _pip_dry_run("--index-url", "https://pypi.org/simple", *map(str, wanted.values()))
    for name, req in wanted.items():
        assert req.specifier.contains(got[name.lower()], prereleases=True), (name, got.get(name.lower()))
    assert "torch" not in got  # nothing of the book extra drags in a (CUDA) torch of its own


# --- the setup cell ---------------------------------------------------------------------------------------------------

def test_every_notebook_has_the_current_setup_cell():
    """Each notebook starts its code with the setup cell of _config.yml's repository, removed from the book, stored
    without outputs, just before the parameters cell (papermill inserts its parameters after that one)."""
    assert publish.sync(ROOT, check=True) == [], "python -m lpfa.publish rewrites them"
    url, branch = publish.repository(ROOT)
    for nb in toc_notebooks(ROOT):
        cells = nbformat.read(nb, as_version=4).cells
        i = next(i for i, c in enumerate(cells) if c.get("id") == publish.SETUP_CELL_ID)
        assert "parameters" in cells[i + 1].metadata.get("tags", []), nb.name
        assert all(c.cell_type == "markdown" for c in cells[:i]), nb.name
        assert cells[i].metadata["tags"] == ["remove-cell"] and not cells[i].outputs
        assert f'"{url}"' in cells[i].source and f'"{branch}"' in cells[i].source


def _run_setup_cell(monkeypatch, cwd: Path, hide_lpfa: bool, torch_installed: bool = True) -> list[list[str]]:
    """Execute notebook 01's setup cell in ``cwd``, subprocess.run recorded (a clone makes its folder); returns the
    commands it ran."""
    import importlib.util

    calls = []

    def fake_run(cmd, check=False, **kw):
        calls.append(list(cmd))
        if cmd[:2] == ["git", "clone"]:
            (Path(cmd[-1]) / "notebooks").mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0)

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" and not torch_installed else find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("LPFA_ROOT", os.environ.get("LPFA_ROOT", str(ROOT)))  # restored after the test
    monkeypatch.chdir(cwd)
    if hide_lpfa:
        monkeypatch.setitem(sys.modules, "lpfa", None)  # `import lpfa` now raises ImportError
    cell = next(c for c in nbformat.read(ROOT / "notebooks" / "01_bf16_rounding.ipynb", as_version=4).cells
                if c.get("id") == publish.SETUP_CELL_ID)
    namespace = {}
    exec(compile(cell.source, "setup-cell", "exec"), namespace)
    # what the cell leaves behind passes the page's parameter check, which refuses names it does not declare
    check_params({}, {k: v for k, v in namespace.items() if k != "__builtins__"})
    return calls


def test_setup_cell_does_nothing_where_lpfa_is_installed(monkeypatch, tmp_path):
    assert _run_setup_cell(monkeypatch, tmp_path, hide_lpfa=False) == []
    assert Path.cwd() == tmp_path


def test_setup_cell_clones_and_installs_where_lpfa_is_missing(monkeypatch, tmp_path):
    """Outside a checkout (Colab): a shallow clone of the one repository, lpfa[book] installed from it (with PyTorch's
    CPU index where no torch is installed), then the page runs from its folder in the clone."""
    url, branch = publish.repository(ROOT)
    calls = _run_setup_cell(monkeypatch, tmp_path, hide_lpfa=True, torch_installed=False)
    clone = tmp_path / publish.CLONE_DIR
    assert calls == [["git", "clone", "--depth", "1", "--branch", branch, url, str(clone)],
                     [sys.executable, "-m", "pip", "install", "--quiet", f"{clone}[book]",
                      "--extra-index-url", publish.CPU_WHEELS]]
    assert os.environ["LPFA_ROOT"] == str(clone)
    assert Path.cwd() == clone / "notebooks"


def test_setup_cell_installs_the_checkout_it_runs_in(monkeypatch):
    """Inside a checkout without lpfa installed (a JupyterHub's nbgitpuller copy): no clone, that checkout installed."""
    calls = _run_setup_cell(monkeypatch, ROOT / "notebooks", hide_lpfa=True)
    assert calls == [[sys.executable, "-m", "pip", "install", "--quiet", f"{ROOT}[book]"]]
    assert Path.cwd() == ROOT / "notebooks"


def test_pages_url_and_readme_link():
    """The README's "read online" link is the GitHub Pages address of _config.yml's repository."""
    assert publish.pages_url("https://github.com/Some-Org/book") == "https://some-org.github.io/book/"
    assert publish.pages_url("https://github.com/me/me.github.io.git") == "https://me.github.io/"
    with pytest.raises(ValueError, match="github.com"):
        publish.pages_url("https://gitlab.com/me/book")
    url, _ = publish.repository(ROOT)
    readme = (ROOT / "README.md").read_text()
    head = readme.split("\n## ", 1)[0]
    assert f"]({publish.pages_url(url)})" in head, "no read-online link at the top of README.md"
    assert url in readme
