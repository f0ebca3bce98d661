"""The Gefen test matrix.

``nox`` (no arguments) runs the default matrix that CI runs:

* ``tests(package=...)``: one session per distribution found under ``packages/*/pyproject.toml``.
  Every wheel is built once into ``dist/``; the session then installs ``torch==2.13.0`` first
  (except for ``gefen-contracts``, which must work without torch) and the package from ``dist/``,
  so siblings come from the fresh wheels and never from an index. It runs the package's unit tests
  plus its ``smoke``-marked multi-rank subset.
* ``tests_all(backend=...)``: every distribution installed together; every package's tests,
  every multi-rank scenario and the root ``tests/`` integration suite. ``gloo`` always runs;
  ``nccl`` is skipped with a message unless two CUDA devices and NCCL are present.
* ``typecheck`` (mypy strict) and ``lint`` (ruff check, ruff format --check, the repository
  checks of ``tools/``).
* ``build``: every wheel and sdist into ``dist/`` (each wheel built from its sdist), then
  ``twine check --strict`` on all of them; it runs first, so the sessions after it install its
  wheels.

``demo`` and ``bench`` run the comparison harness; ``release`` (``nox -s release -- <package>
<major|minor|patch>``, docs/releasing.md) bumps, dates, records the tested set, commits and tags.
None of them is part of the default run.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
import tarfile
import zipfile

import nox

ROOT = pathlib.Path(__file__).parent
DIST = ROOT / "dist"
TORCH = "torch==2.13.0"
TEST_TOOLS = ("pytest>=8", "hypothesis>=6")
TOOLING = ("hatchling>=1.27",)  # PEP 639 license-files
RELEASE_TOOLS = ("build>=1.2", "twine>=6.1")
LEGAL_FILES = ("LICENSE", "NOTICE")  # in every archive (license-files)
HARNESS_TOOLS = ("tqdm", "matplotlib")  # benchmarks/compare.py (and its test in tests/)
# Compared against by ``bench`` when the index offers them (apollo-torch: APOLLO and APOLLO-Mini).
PEERS = ("bitsandbytes", "torchao", "apollo-torch", "adam-mini")
GEFENX = "gefen-x==0.5.0"  # the upstream fork the harness compares with, always in its own venv

nox.options.sessions = ["build", "tests", "tests_all", "typecheck", "lint"]
nox.options.default_venv_backend = "venv"  # pip venvs: torch comes from the local CPU wheel
nox.options.error_on_missing_interpreters = True
# torch ships thousands of modules; byte-compiling them at install time costs minutes per venv.
os.environ.setdefault("PIP_NO_COMPILE", "1")


def _discover() -> dict[str, pathlib.Path]:
    """Distribution name -> folder, from ``packages/*/pyproject.toml``, in dependency order."""
    order = ["contracts", "dist", "core", "muon", "hybrid"]
    found = {path.parent.name: path.parent for path in ROOT.glob("packages/*/pyproject.toml")}

    def rank(name: str) -> tuple[int, str]:
        suffix = name.removeprefix("gefen-")
        return (order.index(suffix) if suffix in order else len(order), name)

    return {name: found[name] for name in sorted(found, key=rank)}


PACKAGES = _discover()


def _version(package_dir: pathlib.Path) -> str:
    name = package_dir.name.removeprefix("gefen-")
    text = (package_dir / "src" / "gefen" / name / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{package_dir}: no __version__ in _version.py")
    return match.group(1)


_wheels_built = False


def _build_wheels(session: nox.Session) -> None:
    """Build every distribution's wheel once per nox run into ``dist/``."""
    global _wheels_built
    if _wheels_built:
        return
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    session.install(*TOOLING)
    for package_dir in PACKAGES.values():
        session.run(
            "python",
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(DIST),
            str(package_dir),
            silent=True,
        )
    _wheels_built = True


def _install_from_dist(session: nox.Session, names: list[str], *, torch: bool) -> None:
    _build_wheels(session)
    if torch:
        session.install(TORCH)
    pinned = [f"{name}=={_version(PACKAGES[name])}" for name in names]
    session.install("--find-links", str(DIST), *pinned, *TEST_TOOLS)


def _needs_torch(name: str) -> bool:
    return name != "gefen-contracts"


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One distribution alone: its unit tests plus its multi-rank smoke subset."""
    _install_from_dist(session, [package], torch=_needs_torch(package))
    session.run(
        "python",
        "-m",
        "pytest",
        str(PACKAGES[package] / "tests"),
        "-m",
        "not multirank or smoke",
        *session.posargs,
        env={"GEFEN_TEST_BACKEND": "gloo"},
    )


def _nccl_usable(session: nox.Session) -> bool:
    probe = (
        "import torch, torch.distributed as d; "
        "print(int(torch.cuda.device_count() >= 2 and d.is_available() and d.is_nccl_available()))"
    )
    out = session.run("python", "-c", probe, silent=True)
    return isinstance(out, str) and out.strip().endswith("1")


@nox.session
@nox.parametrize("backend", ["gloo", "nccl"])
def tests_all(session: nox.Session, backend: str) -> None:
    """Every distribution together with every multi-rank suite, on one distributed backend."""
    if backend == "nccl":
        # Probe inside this venv with its own torch before installing anything else.
        session.install(TORCH)
        if not _nccl_usable(session):
            session.skip("nccl: needs torch.distributed with NCCL and at least 2 CUDA devices")
    _install_from_dist(session, list(PACKAGES), torch=True)
    session.install(*HARNESS_TOOLS)  # tests/test_benchmarks_harness.py runs benchmarks/compare.py
    paths = [str(path / "tests") for path in PACKAGES.values()] + [str(ROOT / "tests")]
    session.run(
        "python",
        "-m",
        "pytest",
        *paths,
        *session.posargs,
        env={"GEFEN_TEST_BACKEND": backend},
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's src/ (torch installed for its stubs), tools/ and the
    benchmark harness (its peers, absent here, typed as Any)."""
    session.install(TORCH, "mypy>=1.10", "pytest>=8", "numpy")
    modules = [f"gefen.{path.name.removeprefix('gefen-')}" for path in PACKAGES.values()]
    args = [arg for module in modules for arg in ("-p", module)]
    session.run("python", "-m", "mypy", *args)
    session.run("python", "-m", "mypy", "tools")
    session.run("python", "-m", "mypy", *sorted(str(p) for p in ROOT.glob("benchmarks/*.py")))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree, then the private-access rule."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # docs/architecture.md: no module reaches into another object's private names.
    session.run("python", "tools/private_access.py", "--check")
    session.run("python", "tools/import_cycles.py", "--check")  # type-only imports included
    # docs/releasing.md: versions, CHANGELOG entries, sibling ranges, LICENSE copies, READMEs.
    session.run("python", "tools/release.py", "--check")


def _archive_names(archive: pathlib.Path) -> list[str]:
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as wheel:
            return wheel.namelist()
    with tarfile.open(archive) as sdist:
        return sdist.getnames()


@nox.session
def build(session: nox.Session) -> None:
    """Every distribution's sdist and wheel (built from the sdist) into ``dist/``, each holding
    LICENSE and NOTICE, then ``twine check --strict`` on all of them. The test sessions of the
    same run install these wheels instead of building their own."""
    global _wheels_built
    session.install(*TOOLING, *RELEASE_TOOLS)
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    for package_dir in PACKAGES.values():
        session.run(
            "python",
            "-m",
            "build",
            "--no-isolation",
            "--outdir",
            str(DIST),
            str(package_dir),
            silent=True,
        )
    _wheels_built = True
    archives = sorted(DIST.glob("*.whl")) + sorted(DIST.glob("*.tar.gz"))
    if len(archives) != 2 * len(PACKAGES):
        session.error(
            f"expected a wheel and an sdist per package, got {[a.name for a in archives]}"
        )
    for archive in archives:
        names = _archive_names(archive)
        if archive.name.endswith(".whl"):  # <name>-<version>.dist-info/licenses/LICENSE
            found = {n.split("/")[-1] for n in names if n.split("/")[-2:-1] == ["licenses"]}
        else:  # <name>-<version>/LICENSE
            found = {n.split("/")[1] for n in names if n.count("/") == 1}
        missing = [legal for legal in LEGAL_FILES if legal not in found]
        if missing:
            session.error(f"{archive.name} lacks {', '.join(missing)}")
    session.run("twine", "check", "--strict", *(str(archive) for archive in archives))


@nox.session(venv_backend="none")
def release(session: nox.Session) -> None:
    """``nox -s release -- <package> <major|minor|patch|initial>`` (or ``-- --check``):
    tools/release.py, with this interpreter (standard library only). Commits and tags; never
    pushes or uploads."""
    if not session.posargs:
        session.error("usage: nox -s release -- <package> <major|minor|patch|initial> [--dry-run]")
    session.run(sys.executable, str(ROOT / "tools" / "release.py"), *session.posargs, external=True)


def _harness_install(session: nox.Session, *extra: str) -> None:
    """The built wheels of every package (torch first), the harness tools and ``extra``."""
    _build_wheels(session)
    session.install(TORCH)
    names = [f"{name}=={_version(PACKAGES[name])}" for name in PACKAGES]
    session.install("--find-links", str(DIST), *names, *HARNESS_TOOLS, *extra)


@nox.session
def demo(session: nox.Session) -> None:
    """The README's first command: the default comparison run (writes bench-out/)."""
    _harness_install(session)
    session.run("python", "benchmarks/compare.py", *session.posargs)


def _gefenx_venv(session: nox.Session) -> dict[str, str]:
    """A venv of its own for Gefen-X (its regular ``gefen`` package would shadow ours): torch,
    tqdm and gefen-x, none of our packages. Returns the environment that points the harness at
    it, or {} (the harness then skips the Gefen-X rows) when the index does not offer gefen-x."""
    venv = ROOT / "bench-out" / "gefenx-venv"
    python = venv / "bin" / "python"
    try:
        session.run(sys.executable, "-m", "venv", "--clear", str(venv), external=True)
        session.run(
            str(python), "-m", "pip", "install", TORCH, "tqdm", GEFENX, external=True, silent=True
        )
    except Exception:  # an absent peer is reported by the harness, not fatal here
        session.warn(f"{GEFENX} could not be installed in its own venv; the harness will skip it")
        return {}
    return {"GEFENX_PYTHON": str(python)}


def large_model_out(posargs: list[str]) -> str:
    """The folder of ``bench``'s large-model run: ``large`` inside the ``--out`` of ``posargs``
    (the last one given, as argparse reads it), else inside ``bench-out``."""
    out = "bench-out"
    for index, arg in enumerate(posargs):
        if arg == "--out" and index + 1 < len(posargs):
            out = posargs[index + 1]
        elif arg.startswith("--out="):
            out = arg.removeprefix("--out=")
    return str(pathlib.Path(out) / "large")


@nox.session
def bench(session: nox.Session) -> None:
    """The longer comparison (LR sweep) on the default and the large model, with the peers
    (8-/4-bit AdamW, APOLLO, Adam-mini) installed when the index offers them, then the Gefen
    ablation and the micro-benchmark. Arguments after ``--`` go to both compare.py runs (a
    ``--steps`` there replaces the large run's 300); the large model's results go to the
    ``large`` folder inside the ``--out`` given (default ``bench-out``). The large model takes
    hours on a 2-core CPU."""
    _harness_install(session)
    for peer in PEERS:
        try:
            session.install(peer, TORCH)  # TORCH: a peer's dependencies never move torch
        except Exception:  # a missing peer is reported by the harness, not fatal here
            session.warn(f"{peer} could not be installed; the harness will skip it")
    env = _gefenx_venv(session)
    session.run("python", "benchmarks/compare.py", "--lr-sweep", *session.posargs, env=env)
    session.run(
        "python", "benchmarks/compare.py", "--lr-sweep", "--steps", "300", *session.posargs,
        "--model-size", "large", "--out", large_model_out(session.posargs), env=env,
    )  # fmt: skip
    session.run("python", "benchmarks/ablation.py", "--lr-sweep", "--out", "bench-out")
    session.run("python", "benchmarks/micro.py")


@nox.session
def dev(session: nox.Session) -> None:
    """Development venv (.nox/dev): every package editable plus the tools."""
    session.install(TORCH)
    session.install(*(f"-e{path}" for path in PACKAGES.values()))
    session.install("nox", "mypy>=1.10", "ruff>=0.6", *TEST_TOOLS, "tqdm", "matplotlib")
