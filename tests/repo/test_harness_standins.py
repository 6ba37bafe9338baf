"""benchmark/harness/standins.py: import stand-ins for packages the GPU harness machine lacks.

A stand-in must carry a module's import-time use (decorators, base classes, annotations,
calls made while the module body runs) and fail loudly on real use; a package the machine
has must never be replaced.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
from typing import Optional

import pytest

from benchmark.harness import standins

MISSING = "echo_no_such_pkg_for_standins"

USER = f"""
from typing import Optional

from {MISSING} import Base, Thing, SomeError, deco
import {MISSING}.sub.deeper as deeper


@deco
def plain():
    return 1


@deco(option=True)
def configured():
    return 2


class Model(Base, frozen=True):
    field: Optional[Thing] = None

    def method(self) -> Thing | None:
        return None


Model.rebuild()  # a class method of the real base, called at import
HANDLE = deeper.connect("tcp://nowhere")  # a call while the module body runs
ITEMS = list(deeper.registry)
FEATURE_ON = bool(deeper.FEATURE)
IS_THING = isinstance(1, Thing)
try:
    raise KeyError("through an except clause naming a stand-in exception")
except SomeError:
    CAUGHT = "stand-in"
except KeyError:
    CAUGHT = "KeyError"
"""


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Stand-ins installed by a test are gone after it: the finder's names, the meta path,
    ``importlib.util.find_spec`` and the modules imported through them."""
    names = list(standins._FINDER.names)
    meta_path = list(sys.meta_path)
    find_spec = importlib.util.find_spec
    modules = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    standins._FINDER.names[:] = names
    sys.meta_path[:] = meta_path
    importlib.util.find_spec = find_spec
    for name in set(sys.modules) - modules:
        del sys.modules[name]


def import_user(tmp_path, name="standin_user"):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER))
    return importlib.import_module(name)


def test_missing_package_gets_a_standin_that_probes_still_see_absent(isolated):
    assert importlib.util.find_spec(MISSING) is None
    standins.install_standins([MISSING])
    assert MISSING in standins.installed()
    module = importlib.import_module(f"{MISSING}.sub")
    assert isinstance(module, standins.StandInModule)
    # availability probes (find_spec) see the machine as it is, imported or not
    assert importlib.util.find_spec(MISSING) is None
    assert importlib.util.find_spec(f"{MISSING}.sub") is None


def test_module_level_use_works(isolated):
    standins.install_standins([MISSING])
    user = import_user(isolated)
    assert user.plain() == 1 and user.configured() == 2  # decorators return the function
    assert issubclass(user.Model, standins.StandInBase)
    assert user.Model.__annotations__["field"] == Optional[user.Thing]  # noqa: UP045
    assert user.Model.method.__annotations__["return"] == Optional[user.Thing]  # noqa: UP045
    assert isinstance(user.HANDLE, standins.Placeholder)
    assert user.ITEMS == [] and user.FEATURE_ON is False and user.IS_THING is False
    assert user.CAUGHT == "KeyError"  # the stand-in exception is a real, never-raised class


def test_real_use_at_run_time_fails_loudly(isolated):
    standins.install_standins([MISSING])
    user = import_user(isolated)
    missing = importlib.import_module(MISSING)
    with pytest.raises(standins.StandInError, match=f"{MISSING}.dumps is a stand-in"):
        missing.dumps({"a": 1})
    with pytest.raises(standins.StandInError, match=f"'{MISSING}' is not installed"):
        user.HANDLE.send(b"x")
    with pytest.raises(standins.StandInError, match="base of Model"):
        user.Model(field=None)


def test_installed_packages_are_never_replaced(isolated):
    import json

    standins.install_standins(["json", "email.mime", MISSING])
    assert "json" not in standins.installed() and "email.mime" not in standins.installed()
    assert importlib.import_module("json") is json
    assert importlib.import_module("email.mime.text").__file__.endswith("text.py")
    assert importlib.util.find_spec("json") is not None
    assert json.dumps({"a": 1}) == '{"a": 1}'


def test_msgspec_standin_structs_work_for_real():
    from benchmark.harness import msgspec_lite as msgspec

    class Point(msgspec.Struct, frozen=True, kw_only=True):
        x: int
        tags: list = []  # noqa: RUF012 (msgspec copies an empty mutable default)
        scale: float = msgspec.field(default=1.0)

    class Point3(Point):
        z: int = 0

    class Pair(msgspec.Struct, frozen=True):
        a: int
        b: int = 2

    p = Point3(x=1)
    assert (p.x, p.tags, p.scale, p.z) == (1, [], 1.0, 0)
    assert Point3.__struct_config__.frozen and Point3.__struct_fields__ == (
        "x",
        "tags",
        "scale",
        "z",
    )
    assert Pair(1) == Pair(1, 2) and hash(Pair(1)) == hash(Pair(1, 2))
    with pytest.raises(AttributeError):
        p.x = 2
    assert msgspec.MODULES["msgspec.structs"]["replace"](p, z=3).z == 3
    fields = {f.name: f for f in msgspec.MODULES["msgspec.structs"]["fields"](Point3)}
    assert fields["x"].required and fields["tags"].default_factory is list
    assert fields["scale"].default == 1.0
