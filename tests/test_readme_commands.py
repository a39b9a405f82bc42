"""The shell commands of README.md and docs/*.md do what the text says they do.

Convention (the shell counterpart of the ```python / ```py rule in test_docs.py):

- a ```bash block holds commands that a reader runs as they are; every one of them
  is run, or checked, here, each by the runner that ``RUNNERS`` assigns it;
- a ```sh block is a shell excerpt that is not run: commands for other machines
  (multi-host ``TF_CONFIG``), a separate benchmark virtualenv, a GPU build, or a
  placeholder script such as ``python train.py``.

A block is split into commands: a trailing ``\\`` joins the next line, and a ``#``
that starts a word outside quotes starts a comment. A command without a runner
fails ``test_every_shell_command_has_a_runner``: a new README command needs a
runner here (or, if it is not meant to run, a ```sh fence).

The runners:

- ``make demo`` runs the Makefile's demo recipe for real, with this interpreter's
  directory as ``BIN``, a freshly touched ``STAMP`` (newer than its
  prerequisites, so make does not rebuild the venv) and a short ``DEMO_ARGS``;
  test_demo.py covers every optimizer and the comparison's numbers;
- ``make test`` and ``make test-all`` are not run from inside the suite they start: CI's
  ``.ci/run`` runs ``make test-all``, which runs ``make test`` first, as checked here;
- ``make wheel`` runs the Makefile's recipe with this interpreter, as ``make demo`` does;
  the wheel's install runs as written in a fresh virtualenv whose ``PATH`` reaches no
  compiler, where the status check and a THOR step through the op follow;
- ``pip install .`` and the status check after it run as written in a fresh
  virtualenv (its ``bin`` first on ``PATH``) over a copy of the checkout without
  build outputs; a ``.pth`` file gives that virtualenv this interpreter's
  site-packages, so the runtime dependencies are already satisfied. The isolated
  build still fetches TensorFlow, as a user's ``pip install .`` does.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest
from helpers import copy_checkout, venv_over_this_one

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", p)
                               for p in os.listdir(os.path.join(REPO_ROOT, "docs"))
                               if p.endswith(".md"))
SHELL_FENCE = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
KNOWN_FENCES = {"python", "py", "bash", "sh", ""}
DISABLE_ENV = "TF_MSOPT_DISABLE_CUSTOM_OPS"

INSTALL = "pip install ."
STATUS_CHECK = "tf-msopt status"
MAKE_WHEEL = "make wheel"
INSTALL_WHEEL = "pip install dist/tf_msopt-*.whl"
RUNNERS = {
    "make demo": "demo",
    "make test": "ci",
    "make test-all": "ci",
    INSTALL: "install",
    STATUS_CHECK: "install",
    MAKE_WHEEL: "wheel",
    INSTALL_WHEEL: "wheel",
}


def strip_comment(line):
    """``line`` without its ``# comment`` (a ``#`` starting a word, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def split_commands(block):
    """The commands of one shell block, continuation lines joined, comments removed."""
    commands, pending = [], ""
    for line in block.splitlines():
        line = strip_comment(line).rstrip()
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        command = (pending + line.strip()).strip()
        pending = ""
        if command:
            commands.append(command)
    if pending.strip():
        commands.append(pending.strip())
    return commands


def page_commands():
    """[(page, command)] for every runnable shell command, in page order."""
    found = []
    for page in PAGES:
        with open(os.path.join(REPO_ROOT, page)) as f:
            for block in SHELL_FENCE.findall(f.read()):
                found += [(page, command) for command in split_commands(block)]
    return found


def commands_of(runner):
    """The distinct commands the pages hand to ``runner``, in first-seen order."""
    commands = [c for _, c in page_commands() if RUNNERS.get(c) == runner]
    assert commands, f"no README/docs command uses the {runner!r} runner any more: remove it"
    return list(dict.fromkeys(commands))


def test_split_commands_joins_continuations_and_drops_comments():
    block = ("make demo   # trains\n"
             "            # a comment line\n"
             "A='{\"x\": 1}' \\\n"
             "    python run.py --dir /tmp/a#b   # on host0\n"
             "echo '# not a comment'\n")
    assert split_commands(block) == ["make demo", "A='{\"x\": 1}' python run.py --dir /tmp/a#b",
                                     "echo '# not a comment'"]


def test_every_shell_command_has_a_runner():
    commands = page_commands()
    assert any(c == "make test" for _, c in commands), "README lost its `make test`"
    unknown = [f"{page}: {command}" for page, command in commands if command not in RUNNERS]
    assert not unknown, (
        "a new README/docs command needs a runner in tests/test_readme_commands.py "
        "(or a ```sh fence if it is an excerpt that is not run):\n" + "\n".join(unknown))
    stale = set(RUNNERS) - {c for _, c in commands}
    assert not stale, f"runners for commands no page has any more: {sorted(stale)}"


def test_code_fences_are_runnable_or_marked_as_excerpts():
    """Only the fences whose run-or-not rule is defined (here and in test_docs.py)."""
    for page in PAGES:
        with open(os.path.join(REPO_ROOT, page)) as f:
            fences = set(re.findall(r"^```(\S*)", f.read(), re.MULTILINE))
        assert fences <= KNOWN_FENCES, (page, fences - KNOWN_FENCES)


def test_make_test_is_what_ci_runs():
    """`make test` and `make test-all` are not run from inside their own suite: CI runs
    `make test-all`, which runs `make test` first."""
    assert commands_of("ci") == ["make test", "make test-all"]
    with open(os.path.join(REPO_ROOT, ".ci", "run")) as f:
        script = [strip_comment(line).strip() for line in f]
    assert "make test-all" in script, ".ci/run must run the README's `make test-all`"
    with open(os.path.join(REPO_ROOT, "Makefile")) as f:
        makefile = f.read()
    assert re.search(r"^test: \$\(STAMP\)\n\t\$\(BIN\)/python -m pytest", makefile,
                     re.MULTILINE)
    assert re.search(r"^test-all: test\n\t\$\(BIN\)/python -m pytest", makefile, re.MULTILINE)


def _make_env():
    """The environment a user's shell would give make: no outer make's flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


@pytest.mark.slow
def test_make_demo_runs_the_comparison_and_writes_its_outputs(tmp_path):
    assert commands_of("demo") == ["make demo"]
    bin_dir = os.path.dirname(sys.executable)
    stamp = tmp_path / "installed"
    stamp.touch()   # newer than pyproject.toml, setup.py and custom_ops/*: no venv rebuild
    out = tmp_path / "demo_output"
    demo_args = f"--epochs 1 --optimizers THOR,Adam --output-dir {out}"
    result = subprocess.run(
        ["make", "demo", f"BIN={bin_dir}", f"STAMP={stamp}", f"DEMO_ARGS={demo_args}"],
        cwd=REPO_ROOT, env=_make_env(), capture_output=True, text=True, timeout=600)
    log = result.stdout[-5000:] + result.stderr[-5000:]
    assert result.returncode == 0, log
    assert "-m venv" not in result.stdout, log     # the recipe ran, not the venv's
    assert f"{bin_dir}/python -m tf_msopt compare {demo_args}" in result.stdout, log
    for kind in ("mlp", "cnn"):   # the recipe's default models: both
        assert re.search(rf"^{kind}: final epoch", result.stdout, re.MULTILINE), log
        table = result.stdout.split(f"{kind}: final epoch", 1)[1]
        assert "epochs to target" in table.splitlines()[1], log
        for name in ("THOR", "Adam"):
            assert re.search(rf"^{name} +\d+\.\d{{4}} +\d+\.\d{{4}} +\d\.\d{{3}}", table,
                             re.MULTILINE), (kind, name, log)
        assert os.path.getsize(out / f"{kind}_curves.png") > 10_000
    with open(out / "results.json") as f:
        results = json.load(f)
    assert {kind: sorted(runs) for kind, runs in results.items()} == {
        "mlp": ["Adam", "THOR"], "cnn": ["Adam", "THOR"]}


def test_isolated_build_requires_the_tensorflow_the_package_runs_with():
    """A plain ``pip install .`` builds in isolation: pip installs the build requirements,
    which must include the TensorFlow range the package itself requires."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        text = f.read()     # (tomllib is Python >= 3.11; the package supports 3.10)

    def strings(key):
        match = re.search(rf"^{key} = \[(.*?)\]", text, re.MULTILINE | re.DOTALL)
        return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", match.group(1)))

    build, runtime = strings("requires"), strings("dependencies")
    tensorflow = [r for r in runtime if re.match(r"tensorflow\b", r)]
    assert len(tensorflow) == 1 and tensorflow[0] in build, (build, runtime)
    assert re.search(r'^build-backend = "setuptools.build_meta"$', text, re.MULTILINE)


def _run(command, env, cwd):
    """``command`` run to success, its output in the failure's message."""
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=900)
    log = f"$ {command}\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, log
    return result


@pytest.mark.slow
@pytest.mark.once
def test_pip_install_builds_the_custom_ops_and_the_check_reports_them(tmp_path):
    """The README's commands, with pip building against the TensorFlow already installed (the
    README's ``--no-build-isolation``): an isolated build would first install a second
    TensorFlow into pip's build environment (about 45 s), which tests pip, not this package;
    that the isolated build has TensorFlow to build against is checked from pyproject.toml."""
    assert set(commands_of("install")) == {INSTALL, STATUS_CHECK}
    checkout, env_dir = tmp_path / "checkout", tmp_path / "venv"
    copy_checkout(checkout)
    site = venv_over_this_one(env_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # pip reads PIP_NO_BUILD_ISOLATION inverted: "0" means --no-build-isolation.
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
               VIRTUAL_ENV=str(env_dir), TF_CPP_MIN_LOG_LEVEL="2", PIP_NO_BUILD_ISOLATION="0")

    outputs = [_run(["bash", "-c", command], env, cwd=checkout).stdout
               for command in (INSTALL, STATUS_CHECK)]

    # The runtime dependencies came from the .pth, not from a download.
    assert re.search(r"Requirement already satisfied: tensorflow\b", outputs[0]), outputs[0]
    assert "Downloading tensorflow" not in outputs[0], outputs[0]
    # The build compiled the library into the installed package.
    library = os.path.join(site, "tf_msopt", "ops", "_msopt_ops.so")
    assert os.path.exists(library), outputs[0]
    versions, status = outputs[1].strip().splitlines()[-2:]
    assert f"({os.path.join(site, 'tf_msopt', '__init__.py')})" in versions, outputs[1]
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        assert status == f"pure TensorFlow ({DISABLE_ENV} is set)", outputs[1]
    else:
        assert status.startswith(f"custom ops loaded from {library} (built against "
                                 f"TensorFlow {metadata.version('tensorflow')})"), outputs[1]


#: The op status, then one THOR step of MindSpore's form (its inverses through the op when it
#: is loaded) and the back-end that step used.
THOR_STEP = """
import numpy as np, keras, tf_msopt as mso
from tf_msopt.ops.inverse import inverse_backend
print(mso.ops.custom_ops_status())
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(2)])
model.compile(optimizer=mso.thor(model, 0.1, 0.3, 0.9, frequency=2), loss="mse")
model.train_on_batch(np.ones((8, 6), "float32"), np.zeros((8, 2), "float32"))
assert all(np.isfinite(w).all() for w in model.get_weights())
print(inverse_backend())
"""
COMPILERS = ("g++", "gcc", "c++", "cc", "nvcc")


@pytest.mark.slow
@pytest.mark.once
def test_wheel_runs_its_ops_without_a_compiler_and_the_sdist_builds(tmp_path):
    """``make wheel`` and the wheel's install: the ops load where no compiler is reachable, a
    damaged library gives one warning and the pure-TF path, and the sdist builds the library
    as ``pip install .`` does."""
    assert commands_of("wheel") == [MAKE_WHEEL, INSTALL_WHEEL]
    checkout, env_dir = tmp_path / "checkout", tmp_path / "venv"
    copy_checkout(checkout)
    stamp = tmp_path / "installed"
    stamp.touch()   # newer than the Makefile's prerequisites: make uses this interpreter
    build_env = {k: v for k, v in os.environ.items()
                 if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHONPATH")}
    # The objects this checkout's own build compiled, if any (same sources, same commands).
    build_env.setdefault("TF_MSOPT_BUILD_CACHE",
                         os.path.join(REPO_ROOT, ".venv", "build-cache"))
    _run([*MAKE_WHEEL.split(), f"BIN={os.path.dirname(sys.executable)}", f"STAMP={stamp}"],
         build_env, cwd=checkout)
    wheel, = glob.glob(str(checkout / "dist" / "*.whl"))
    sdist, = glob.glob(str(checkout / "dist" / "*.tar.gz"))
    assert os.path.basename(wheel).startswith(
        f"tf_msopt-{metadata.version('tf_msopt')}-py3-none-manylinux_2_"), wheel
    with zipfile.ZipFile(wheel) as archive:
        assert "tf_msopt/ops/_msopt_ops.so" in archive.namelist()

    # A virtualenv whose PATH reaches no compiler; TensorFlow comes from this one's packages.
    site = venv_over_this_one(env_dir)
    bare = {k: v for k, v in build_env.items()
            if k not in ("CC", "CXX", "CUDA_HOME", "CUDA_PATH", "TF_MSOPT_BUILD_CACHE",
                         "TF_MSOPT_DISABLE_CUSTOM_OPS")}
    bare.update(PATH=str(env_dir / "bin"), VIRTUAL_ENV=str(env_dir), TF_CPP_MIN_LOG_LEVEL="2")
    assert not any(shutil.which(tool, path=bare["PATH"]) for tool in COMPILERS)
    python = str(env_dir / "bin" / "python")

    def run(command, env=bare):
        # Outside any checkout: `python -c` puts its working directory first on sys.path.
        return _run(command, env, cwd=tmp_path)

    # The README's command, dependencies from the .pth (PIP_NO_INDEX: nothing is fetched).
    _run(["/bin/bash", "-c", INSTALL_WHEEL], dict(bare, PIP_NO_INDEX="1"), cwd=checkout)
    library = os.path.join(site, "tf_msopt", "ops", "_msopt_ops.so")
    status = run(["tf-msopt", "status"]).stdout.strip().splitlines()[-1]
    assert status == (f"custom ops loaded from {library} (built against TensorFlow "
                      f"{metadata.version('tensorflow')})"), status
    assert run([python, "-c", THOR_STEP]).stdout.strip().endswith("custom op (CPU)")

    # A broken library: one warning saying why and how to rebuild, and the pure-TF path.
    with open(library, "wb") as f:
        f.write(b"\x7fELF, damaged")
    broken = run([python, "-c", THOR_STEP])
    status, backend = broken.stdout.strip().splitlines()[-2:]
    assert status.startswith("pure TensorFlow (custom ops not loaded: NotFoundError"), status
    assert backend == "tf.linalg (custom op not loaded)", broken.stdout
    assert broken.stderr.count("RuntimeWarning: tf_msopt: the compiled custom ops are not "
                               "used") == 1, broken.stderr

    # The sdist builds the library as `pip install .` does (a compiler on the PATH again).
    run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--force-reinstall", sdist],
        dict(bare, PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
             TF_MSOPT_BUILD_CACHE=build_env["TF_MSOPT_BUILD_CACHE"]))
    assert run(["tf-msopt", "status"]).stdout.strip().splitlines()[-1].startswith(
        f"custom ops loaded from {library}")
