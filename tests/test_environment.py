"""The environment a job's nodes need: captured from this venv, hashed, its files filtered and limited,
its index credentials never shown."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_sgpu import SGPUConfigError
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.environment import Environment, EnvironmentOptions, capture, option_text, parse_option
from prefect_sgpu.environment.files import DEFAULT_MAX_BYTES

ROOT = Path(__file__).resolve().parents[1]
SECRET = "hunter2-s3cret"


def _project(root: Path) -> Path:
    """A user project: a package of its own beside the training module, and things that must not travel."""
    (root / "features").mkdir(parents=True)
    (root / "features" / "__init__.py").write_text("")
    (root / "features" / "encode.py").write_text("def tokenize(s):\n    return s.split()\n")
    (root / "train.py").write_text("from features.encode import tokenize\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0" * 10)
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "big.so").write_bytes(b"\0" * 1000)
    (root / "data").mkdir()
    (root / "data" / "shard-0.bin").write_bytes(b"\1" * 5000)
    (root / ".gitignore").write_text("data/\n*.log\n")
    (root / "run.log").write_text("noise\n")
    return root


def _paths(env: Environment) -> set[str]:
    assert env.working_dir is not None
    return {f.path for f in env.working_dir.files}


def test_capture_finds_this_project_as_an_editable_install_and_pins_every_distribution() -> None:
    env = capture()
    direct = json.loads(next((ROOT / ".venv/lib").glob("python3.*/site-packages/prefect_sgpu-*.dist-info"))
                        .joinpath("direct_url.json").read_text())
    assert direct["dir_info"]["editable"], "./dev installs this project editable (uv pip install -e)"
    ours = next(d for d in env.distributions if d.name == "prefect-sgpu")
    assert ours.source == "editable"
    tree = next(t for t in env.local_packages if t.name == "prefect-sgpu")
    assert Path(tree.source) == ROOT
    paths = {f.path for f in tree.files}
    assert "prefect_sgpu/environment/__init__.py" in paths and "pyproject.toml" in paths
    assert not any(p.startswith((".git/", ".venv/")) or "__pycache__" in p or p.endswith(".pyc") for p in paths)
    assert env.python.version == "{}.{}.{}".format(*sys.version_info[:3])
    assert env.python.implementation == sys.implementation.name and env.python.minor == "3.11"
    pins = {d.name: d.version for d in env.distributions}
    import pydantic

    assert pins["pydantic"] == pydantic.VERSION and len(pins) > 50
    assert all(d.source == "index" for d in env.distributions if d.name in ("pydantic", "prefect", "cloudpickle"))
    assert {t.name for t in env.local_packages} == {d.name for d in env.distributions if d.source != "index"}


def test_the_digest_is_stable_and_any_change_gives_a_new_one(tmp_path: Path) -> None:
    project = _project(tmp_path / "a")
    first, second = capture(working_dir=project), capture(working_dir=project)
    assert first.digest == second.digest and len(first.digest) == 64
    assert capture(working_dir=project, requirements=["einops==0.8.0"]).digest != first.digest

    # the same files in another folder (another machine, another checkout): the same environment
    other = tmp_path / "b"
    shutil.copytree(project, other)
    assert capture(mode="image", working_dir=other).digest == capture(mode="image", working_dir=project).digest

    before = capture(mode="image", working_dir=project).digest
    (project / "features" / "encode.py").write_text("def tokenize(s):\n    return s.split(',')\n")
    assert capture(mode="image", working_dir=project).digest != before
    ignored = capture(mode="image", working_dir=project).digest
    (project / "run.log").write_text("more noise\n")  # ignored by .gitignore: same environment
    (project / "__pycache__" / "x.pyc").write_bytes(b"1")
    assert capture(mode="image", working_dir=project).digest == ignored
    assert capture(mode="driver", working_dir=project).digest != ignored, "what installs is part of it"


def test_requirements_and_index_settings_count_but_credentials_do_not(tmp_path: Path) -> None:
    base = capture(mode="driver")
    a = capture(requirements=["einops==0.8.0", "rich>=13"])
    b = capture(requirements=["rich>=13", "einops==0.8.0"])
    assert a.digest == b.digest, "requirements are a set"
    with_index = capture(index_url=f"https://user:{SECRET}@pypi.example.com/simple")
    other_token = capture(index_url="https://user:another-token@pypi.example.com/simple")
    other_host = capture(index_url="https://user:another-token@mirror.example.com/simple")
    assert with_index.digest == other_token.digest != base.digest
    assert other_host.digest != with_index.digest


def test_ignore_rules_defaults_gitignore_and_excludes(tmp_path: Path) -> None:
    project = _project(tmp_path / "p")
    assert _paths(capture(mode="image", working_dir=project)) == {
        ".gitignore", "features/__init__.py", "features/encode.py", "train.py"}
    kept = _paths(capture(mode="image", working_dir=project, excludes=["features/", "!data/", "*.toml"]))
    assert kept == {".gitignore", "train.py", "data/shard-0.bin"}, "excludes come last: '!' takes a rule back"
    (project / "outside.py").symlink_to(tmp_path / "secret.py")
    (tmp_path / "secret.py").write_text("KEY = 1\n")
    (project / "inside.py").symlink_to(project / "train.py")
    paths = _paths(capture(mode="image", working_dir=project))
    assert "inside.py" in paths and "outside.py" not in paths, "nothing outside the folder leaves by a link"


def test_a_folder_over_the_size_limit_fails_naming_the_field_the_size_and_the_limit(tmp_path: Path) -> None:
    project = _project(tmp_path / "p")
    (project / "weights.pt").write_bytes(b"\2" * 3 * 1024 * 1024)
    with pytest.raises(SGPUConfigError) as info:
        capture(mode="image", working_dir=project, max_bytes=2 * 1024 * 1024)
    err = info.value
    assert err.field == "environment.working_dir"
    assert "3.0 MiB" in str(err.value) and "2.0 MiB" in err.allowed and "environment.max_bytes=2097152" in err.allowed
    assert "weights.pt" in str(err), "the largest files are named"
    assert capture(mode="image", working_dir=project, excludes=["*.pt"], max_bytes=2 * 1024 * 1024).working_dir
    assert EnvironmentOptions().max_bytes == DEFAULT_MAX_BYTES


def test_py_modules_by_path_or_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = _project(tmp_path / "p")
    monkeypatch.syspath_prepend(str(project))
    by_name = capture(mode="image", py_modules=["features"], auto_modules=False)
    by_path = capture(mode="image", py_modules=[str(project / "features")], auto_modules=False)
    assert [t.name for t in by_name.py_modules] == ["features"] and by_name.digest == by_path.digest
    assert {f.path for f in by_name.py_modules[0].files} == {"__init__.py", "encode.py"}
    single = capture(mode="image", py_modules=[str(project / "train.py")], auto_modules=False)
    assert single.py_modules[0].name == "train" and single.py_modules[0].files[0].path == "train.py"
    with pytest.raises(SGPUConfigError) as info:
        capture(py_modules=["no_such_module_here"])
    assert info.value.field == "environment.py_modules[0]"
    with pytest.raises(SGPUConfigError, match="top-level module"):
        capture(py_modules=["features.encode"])


def test_index_credentials_never_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"https://__token__:{SECRET}@pypi.example.com/simple"
    options = parse_option({"index_url": url, "extra_index_urls": [f"https://{SECRET}@x.example.com/simple"],
                            "find_links": [f"https://files.example.com/wheels?token={SECRET}"]})
    assert isinstance(options, EnvironmentOptions)
    env = options.capture()
    spec = spec_mod.merge(spec_mod.layer("call", environment=options))
    captured_spec = spec.replace(environment=env)
    shown = [repr(options), str(options), repr(env), str(env), json.dumps(env.describe()),
             env.model_dump_json(), json.dumps(options.model_dump()), repr(spec), repr(captured_spec)]
    for text in shown:
        assert SECRET not in text
    assert "https://***@pypi.example.com/simple" in json.dumps(env.describe())
    for obj in (options, env, spec, captured_spec):
        assert SECRET.encode() not in pickle.dumps(obj)
    assert env.index_url is not None and env.index_url.reveal() == url, "the driver still has it"
    again = pickle.loads(pickle.dumps(captured_spec))
    assert again.environment.digest == env.digest
    with pytest.raises(SGPUConfigError, match=r"\$\{VAR\}"):
        again.environment.index_url.reveal()

    # ${VAR}: shown as written, survives pickling, read from the driver's environment when used
    ref = pickle.loads(pickle.dumps(capture(mode="driver", index_url="https://__token__:${PYPI_TOKEN}@p.example/simple")))
    assert "${PYPI_TOKEN}" in str(ref.index_url)
    monkeypatch.setenv("PYPI_TOKEN", SECRET)
    assert ref.index_url.reveal() == f"https://__token__:{SECRET}@p.example/simple"
    monkeypatch.delenv("PYPI_TOKEN")
    with pytest.raises(SGPUConfigError, match="PYPI_TOKEN"):
        ref.index_url.reveal()


@pytest.mark.parametrize(
    ("value", "field", "needle"),
    [
        ("bogus", "environment", "'driver', 'image'"),
        ({"working_dir": "/no/such/folder"}, "environment.working_dir", "existing folder"),
        ({"wokring_dir": "."}, "environment.wokring_dir", "mode, working_dir, excludes"),
        ({"index_url": "ftp://host/simple"}, "environment.index_url", "http(s)://"),
        ({"index_url": "https:///simple"}, "environment.index_url", "host name"),
        ({"extra_index_urls": ["nope://x"]}, "environment.extra_index_urls[0]", "http(s)://"),
        ({"find_links": ["/no/such/wheelhouse"]}, "environment.find_links[0]", "existing local path"),
        ({"requirements": ["torch >>= 2"]}, "environment.requirements[0]", "PEP 508"),
        ({"mode": "image", "requirements": ["einops"]}, "environment.requirements", "mode='image'"),
        ({"max_bytes": 0}, "environment.max_bytes", "greater than 0"),
        ("{not json", "environment", "not JSON"),
        ("missing.toml", "environment", "existing .json or .toml"),
    ],
)
def test_bad_options_name_the_field_and_what_is_allowed(value: object, field: str, needle: str) -> None:
    with pytest.raises(SGPUConfigError) as info:
        parse_option(value)
    assert info.value.field == field and needle in str(info.value)


def test_option_forms_and_their_text_round_trip(tmp_path: Path) -> None:
    project = _project(tmp_path / "p")
    assert parse_option("driver") == EnvironmentOptions() and parse_option("IMAGE") == EnvironmentOptions(mode="image")
    (tmp_path / "env.toml").write_text('working_dir = "p"\nrequirements = ["einops==0.8.0"]\n'
                                       'index_url = "https://u:${TOK}@mirror.example/simple"\n')
    from_toml = parse_option(str(tmp_path / "env.toml"))
    assert isinstance(from_toml, EnvironmentOptions)
    assert from_toml.working_dir == str(project), "relative paths in a file are the file's own"
    assert parse_option(option_text(from_toml)) == from_toml
    (tmp_path / "env.json").write_text(json.dumps({"mode": "image", "py_modules": [str(project / "features")]}))
    assert parse_option(tmp_path / "env.json") == EnvironmentOptions(mode="image", py_modules=[str(project / "features")])
    captured = capture(mode="image", working_dir=project)
    assert parse_option(captured) is captured
    assert parse_option(json.loads(captured.model_dump_json())).digest == captured.digest
    literal = parse_option({"index_url": f"https://u:{SECRET}@h.example/simple"})
    assert SECRET in option_text(literal), "the work pool hands the flow run what it was given"
    assert option_text(EnvironmentOptions()) == "driver"


def test_the_image_mode_installs_nothing_but_the_project_travels(tmp_path: Path) -> None:
    project = _project(tmp_path / "p")
    env = Environment.image(working_dir=project)
    assert env.mode == "image" and env.distributions == () and env.local_packages == ()
    assert env.working_dir is not None and env.python.minor == "{}.{}".format(*sys.version_info[:2])
    assert env.describe()["distributions"] == 0


def test_capture_imports_no_heavy_library_and_is_fast() -> None:
    code = ("import sys, time; t = time.perf_counter(); from prefect_sgpu.environment import capture; "
            "import prefect_sgpu.spec; env = capture(); dt = time.perf_counter() - t; "
            "heavy = [m for m in ('torch', 'ray', 'mlflow', 'boto3') if m in sys.modules]; "
            "print(dt, heavy, len(env.distributions))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    seconds, heavy, count = out.stdout.split(" ", 1)[0], out.stdout.split("[", 1)[1].split("]")[0], 0
    assert heavy == "", f"capture imported {heavy}"
    assert float(seconds) < 20, f"capture took {seconds} s"


def test_a_distribution_installed_or_removed_between_captures_is_seen_and_edited_files_are_hashed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture reads every distribution's metadata again only when sys.path or a folder on it
    changed; the files of a project that travels are hashed at every capture."""
    project = tmp_path / "checkout"  # a checkout on sys.path with its metadata beside it (PYTHONPATH)
    (project / "probe_pkg").mkdir(parents=True)
    (project / "probe_pkg" / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(project))
    before = capture()
    assert "sgpu-probe" not in {d.name for d in before.distributions}
    # (distributions only: other tests may write into this checkout, whose files travel too)
    assert capture().distributions == before.distributions, "nothing installed: the same distributions"

    info = project / "sgpu_probe.egg-info"
    info.mkdir()
    (info / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: sgpu-probe\nVersion: 1.2.3\n")
    installed = capture()
    assert {d.name: (d.version, d.source) for d in installed.distributions}["sgpu-probe"] == ("1.2.3", "editable")
    tree = next(t for t in installed.local_packages if t.name == "sgpu-probe")
    first = {f.path: f.sha256 for f in tree.files}["probe_pkg/__init__.py"]

    (project / "probe_pkg" / "__init__.py").write_text("VALUE = 2\n")  # an edit between two jobs
    edited = next(t for t in capture().local_packages if t.name == "sgpu-probe")
    assert {f.path: f.sha256 for f in edited.files}["probe_pkg/__init__.py"] != first

    shutil.rmtree(info)
    assert "sgpu-probe" not in {d.name for d in capture().distributions}


# --- the user's own modules travel by default ---------------------------------------------------


def _sibling_project(root: Path, prefix: str) -> Path:
    """A project folder as a user runs it: a training module that imports a package beside it."""
    (root / f"{prefix}lib").mkdir(parents=True)
    (root / f"{prefix}lib" / "__init__.py").write_text("from .scale import scale\n")
    (root / f"{prefix}lib" / "scale.py").write_text("def scale(x):\n    return 3 * x\n")
    (root / f"{prefix}lib" / "__pycache__").mkdir()
    (root / f"{prefix}lib" / "__pycache__" / "scale.cpython-311.pyc").write_bytes(b"\0" * 10)
    (root / f"{prefix}train.py").write_text(f"import {prefix}lib\n\ndef train(x):\n    return {prefix}lib.scale(x)\n")
    return root


def test_modules_the_driver_imported_from_its_own_folders_travel_and_installed_ones_do_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    project = _sibling_project(tmp_path / "proj", "sgpu_auto_a_")
    monkeypatch.syspath_prepend(str(project))
    for name in ("sgpu_auto_a_train", "sgpu_auto_a_lib", "sgpu_auto_a_lib.scale"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = {t.name for t in capture(mode="image").py_modules}
    assert "sgpu_auto_a_lib" not in before, "a module not imported on the driver does not travel"
    importlib.import_module("sgpu_auto_a_train")

    env = capture()
    trees = {t.name: t for t in env.py_modules}
    assert {"sgpu_auto_a_lib", "sgpu_auto_a_train"} <= set(trees), sorted(trees)
    assert {f.path for f in trees["sgpu_auto_a_lib"].files} == {"__init__.py", "scale.py"}, "ignore rules apply"
    assert [f.path for f in trees["sgpu_auto_a_train"].files] == ["sgpu_auto_a_train.py"]
    for installed in ("prefect_sgpu", "pydantic", "json", "cloudpickle"):
        assert installed not in trees, f"{installed} is installed or the standard library, not the user's"
    assert env.digest != capture(auto_modules=False).digest, "what travels is part of the environment's digest"
    assert not {"sgpu_auto_a_lib", "sgpu_auto_a_train"} & {t.name for t in capture(auto_modules=False).py_modules}

    # named in py_modules: travels once; imported from working_dir: the project folder carries it
    named = capture(mode="image", py_modules=[str(project / "sgpu_auto_a_lib")])
    assert [t.name for t in named.py_modules].count("sgpu_auto_a_lib") == 1
    in_project = capture(mode="image", working_dir=project)
    assert not {"sgpu_auto_a_lib", "sgpu_auto_a_train"} & {t.name for t in in_project.py_modules}
    assert option_text(EnvironmentOptions(auto_modules=False)) == '{"mode":"driver","auto_modules":false}'
    assert parse_option(option_text(EnvironmentOptions(auto_modules=False))).auto_modules is False

    (project / "sgpu_auto_a_lib" / "scale.py").write_text("def scale(x):\n    return 4 * x\n")
    assert capture().digest != env.digest, "an edited module is hashed again"


def test_an_imported_module_over_the_size_limit_fails_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    project = _sibling_project(tmp_path / "proj", "sgpu_auto_b_")
    (project / "sgpu_auto_b_lib" / "weights.bin").write_bytes(b"\2" * 12 * 1024 * 1024)
    monkeypatch.syspath_prepend(str(project))
    for name in ("sgpu_auto_b_train", "sgpu_auto_b_lib", "sgpu_auto_b_lib.scale"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("sgpu_auto_b_train")

    class Remote:  # what for_compute asks of a compute: whether its nodes are remote, its block's environment
        remote = True
        sgpu_environment = None

    with pytest.raises(SGPUConfigError) as info:
        spec_mod.for_compute(Remote(), spec_mod.layer("call", environment={"max_bytes": 8 * 1024 * 1024}))
    err = info.value
    assert "sgpu_auto_b_lib" in err.field and str(project) in err.field, err.field
    assert "weights.bin" in str(err) and "auto_modules" in str(err), str(err)
    spec = spec_mod.for_compute(Remote(), spec_mod.layer("call", environment={"max_bytes": 8 * 1024 * 1024,
                                                                               "auto_modules": False}))
    assert "sgpu_auto_b_lib" not in {t.name for t in spec.environment.py_modules}


def test_a_script_ships_the_modules_of_its_folder_it_imports(tmp_path: Path) -> None:
    from prefect_sgpu.environment.modules import imported_by_script

    project = tmp_path / "scripts"
    (project / "helpers").mkdir(parents=True)
    (project / "helpers" / "__init__.py").write_text("from sgpu_auto_c_consts import N\n")
    (project / "sgpu_auto_c_consts.py").write_text("N = 3\n")
    (project / "sgpu_auto_c_unused.py").write_text("X = 1\n")
    (project / "run.py").write_text("import os\nimport helpers\nfrom torch import nn\n")
    found = imported_by_script(project / "run.py")
    assert [(m.name, m.source) for m in found] == [
        ("helpers", project / "helpers"), ("sgpu_auto_c_consts", project / "sgpu_auto_c_consts.py")]
    env = EnvironmentOptions(mode="image").capture(script=project / "run.py")
    assert {"helpers", "sgpu_auto_c_consts"} <= {t.name for t in env.py_modules}
    assert "sgpu_auto_c_unused" not in {t.name for t in env.py_modules}


def test_a_rank_that_cannot_import_a_module_names_it_and_where_the_driver_has_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_sgpu.protocol import payload
    from prefect_sgpu.errors import PayloadImportError

    project = _sibling_project(tmp_path / "proj", "sgpu_auto_d_")
    monkeypatch.syspath_prepend(str(project))
    import importlib

    lib = importlib.import_module("sgpu_auto_d_lib")
    body = payload.build(payload.FunctionCall(print, (lib.scale,)))  # the argument travels by reference
    # a rank without the module: the payload names it and the driver, reading it back, says where it is
    code = ("import pickle, sys; from prefect_sgpu import payload\n"
            "try:\n    payload.load(sys.stdin.buffer.read())\n"
            "except Exception as exc:\n    sys.stdout.buffer.write(pickle.dumps(exc))\n")
    out = subprocess.run([sys.executable, "-c", code], input=body, capture_output=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    from prefect_sgpu.environment.modules import explained

    exc = pickle.loads(out.stdout)
    assert isinstance(exc, PayloadImportError) and isinstance(exc, ModuleNotFoundError)
    assert exc.module == "sgpu_auto_d_lib" and exc.driver_source is None and not exc.explained, \
        "the rank cannot know the driver's folder"
    exc = explained(exc)
    assert exc.module == "sgpu_auto_d_lib" and exc.driver_source == str(project / "sgpu_auto_d_lib"), exc
    text = str(exc)
    assert "sgpu_auto_d_lib" in text and str(project / "sgpu_auto_d_lib") in text and "py_modules" in text, text
