"""Import stand-ins for the packages sglang imports but the GPU harness machine lacks.

The harness runs sglang 0.5.23's own memory pools, allocators and host pool on a GPU
machine where sglang cannot be pip-installed (Python 3.12; no wheels there for several of
sglang's compiled dependencies). Those classes are plain Python over torch and Triton, but
the modules that define them, and the modules those import, import packages at module
level that the harness's code paths never use: JSON codecs, the message queue, the web
stack's schema library, sglang's CUDA kernel library. A stand-in module satisfies those
imports and their module-level use (decorators, base classes, type annotations,
``hasattr`` probes), and raises ``StandInError`` as soon as something calls into it for
real, so a harness path that does need the package fails loudly instead of computing with
a placeholder.

"Module-level use" is told from "real use" by the call stack: a call made while the import
system executes a module's body is module-level; any other call is real.

Only names that ``importlib.util.find_spec`` cannot find are stood in (a machine that has
the real package uses it), and ``installed()`` says which ones were, for the run's record.
Once installed, ``importlib.util.find_spec`` still reports them absent: availability
probes see the machine as it is, and only ``import`` statements get a stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import pickle
import sys
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Any

# The packages the harness's import chain (benchmark/harness/sglang_pack.py: CHAIN) needs
# and the target machine lacks, each with the module that first imported it when the chain
# ran on a copy of the target's package set (Python 3.11 venv, CPU torch).
# The CUDA branch (torch.cuda.is_available()) adds sgl_kernel.
WHY: dict[str, str] = {
    "orjson": "sglang.srt.utils.common",
    "pybase64": "sglang.srt.utils.common",
    "starlette": "sglang.srt.utils.common",
    "msgspec": "sglang.srt.platforms.interface",  # emulated: msgspec_lite.py
    "pydantic_core": "sglang.srt.utils.msgspec_utils",
    "zmq": "sglang.srt.utils.network",
    "IPython": "sglang.utils",
    "pydantic": "sglang.utils",
    "tvm_ffi": "sglang.kernels.ops.communication.all_reduce",
    "torchvision": "sglang.srt.multimodal.internvl_utils",
    "dill": "sglang.srt.sampling.custom_logit_processor",  # dumps/loads: pickle's
    "compressed_tensors": "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors",
    "gguf": "sglang.srt.layers.quantization.gguf",
    "openai": "sglang.srt.entrypoints.openai.protocol",
    "partial_json_parser": "sglang.srt.function_call.base_format_detector",
    "sgl_kernel": "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8",
}

STANDINS: tuple[str, ...] = tuple(WHY)


class StandInError(RuntimeError):
    """Something used a stand-in for real: the code path needs the missing package."""


def _during_import() -> bool:
    """Whether the import system is executing a module body somewhere up the stack (the
    caller's own module-level code, or a class body inside it)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _fail(name: str) -> StandInError:
    top = name.split(".")[0]
    return StandInError(
        f"{name} is a stand-in: {top!r} is not installed on this machine "
        f"(benchmark/harness/standins.py); this code path needs the real package"
    )


# Names that read as exception classes get a real (never raised) exception class, so that
# ``except missing.SomeError:`` stays valid when another exception passes through it.
_EXCEPTION_SUFFIXES = ("Error", "Exception", "Warning")

# Stand-ins that carry real attributes, because sglang uses them for real at import or on
# the harness's paths: top-level name -> the module of this package whose ``MODULES`` maps
# each module name to its attributes, or the top-level module's attributes themselves.
EMULATIONS: dict[str, str | dict[str, Any]] = {
    "msgspec": "msgspec_lite",  # sglang's records are Structs (msgspec_lite.py says why)
    # sglang.srt.configs.deepseek_ocr serialises a logit-processor class at import; dill
    # pickles an importable class by reference, as pickle does.
    "dill": {"dumps": pickle.dumps, "loads": pickle.loads},
}


def _attribute(owner: str, attr: str) -> Any:
    """What a stand-in module or placeholder named ``owner`` gives for ``attr``."""
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    if attr.endswith(_EXCEPTION_SUFFIXES):
        return type(attr, (Exception,), {"__module__": owner})
    return Placeholder(f"{owner}.{attr}")


def _is_decoratable(obj: object) -> bool:
    return inspect.isroutine(obj) or isinstance(obj, type | staticmethod | classmethod | property)


class _StandInMeta(type):
    """Class attributes the real base would have provided (e.g. a pydantic model's
    ``model_rebuild``, called at import) are placeholders."""

    def __getattr__(cls, attr: str) -> Any:
        return _attribute(f"{cls.__module__}.{cls.__qualname__}", attr)


class StandInBase(metaclass=_StandInMeta):
    """The plain base class a placeholder turns into when sglang subclasses it: defining
    the subclass works, and so does an instance made at import (its attributes are
    placeholders); making one outside an import is real use and fails."""

    _standin_name = "stand-in"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Class keywords meant for the real base's metaclass (e.g. ``frozen=True``).
        super().__init_subclass__()

    def __new__(cls, *args: Any, **kwargs: Any) -> StandInBase:
        if _during_import():
            return super().__new__(cls)
        raise _fail(f"{cls._standin_name} (base of {cls.__qualname__})")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, attr: str) -> Any:
        return _attribute(f"{type(self).__qualname__}()", attr)


class Placeholder:
    """Any attribute of a stand-in module, and any attribute of a placeholder.

    Module-level code can decorate with it, subclass it, subscript it, put it in
    annotations and unions, iterate it (empty), test it (false) and call it (another
    placeholder); outside an import, a call that is not a plain decoration raises.
    """

    def __init__(self, name: str) -> None:
        module, _, short = name.rpartition(".")
        self._standin_name = name
        self.__name__ = short
        self.__qualname__ = short
        self.__module__ = module

    def __getattr__(self, attr: str) -> Any:
        child = _attribute(self._standin_name, attr)
        setattr(self, attr, child)  # the same object on every access
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and _is_decoratable(args[0]):
            return args[0]  # ``@placeholder``: the decorated object, unchanged
        if _during_import():
            return Placeholder(f"{self._standin_name}()")  # e.g. ``@placeholder(opts)``
        raise _fail(self._standin_name)

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type]:
        base = self.__dict__.get("_standin_base")
        if base is None:
            base = type(
                self.__name__,
                (StandInBase,),
                {"__module__": self.__module__, "_standin_name": self._standin_name},
            )
            self._standin_base = base
        return (base,)

    def __getitem__(self, item: Any) -> Placeholder:
        return self  # ``Placeholder[int]`` in an annotation

    def __or__(self, other: Any) -> Any:
        return typing.Union[self, other]  # noqa: UP007 (``|`` is what is being defined)

    def __ror__(self, other: Any) -> Any:
        return typing.Union[other, self]  # noqa: UP007

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __bool__(self) -> bool:
        return False  # a missing package's feature flags read as off

    def __contains__(self, item: Any) -> bool:
        return False

    def __instancecheck__(self, instance: Any) -> bool:
        return False

    def __subclasscheck__(self, subclass: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<stand-in {self._standin_name}>"


class StandInModule(types.ModuleType):
    """A stand-in package: every attribute is a placeholder, every submodule a stand-in."""

    def __getattr__(self, attr: str) -> Any:
        child = _attribute(self.__name__, attr)
        setattr(self, attr, child)
        return child


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StandInModule(
            spec.name, f"Stand-in for {spec.name} (benchmark/harness/standins.py)."
        )

    def exec_module(self, module: types.ModuleType) -> None:
        top = module.__name__.split(".")[0]
        emulation = EMULATIONS.get(top)
        if emulation is None:
            return
        if isinstance(emulation, dict):
            modules = {top: emulation}
        else:
            modules = importlib.import_module(f"{__package__}.{emulation}").MODULES
        module.__dict__.update(modules.get(module.__name__, {}))
        prefix = module.__name__ + "."
        for name in modules:  # ``import msgspec`` also brings ``msgspec.structs``
            if name.startswith(prefix) and "." not in name[len(prefix) :]:
                setattr(module, name[len(prefix) :], importlib.import_module(name))


class _Finder(importlib.abc.MetaPathFinder):
    """Answers only for the stood-in names and their submodules; every other import goes
    on to the normal finders."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.loader = _Loader()

    def covers(self, fullname: str) -> bool:
        return any(fullname == name or fullname.startswith(name + ".") for name in self.names)

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not self.covers(fullname):
            return None
        return importlib.machinery.ModuleSpec(
            fullname, self.loader, origin="stand-in", is_package=True
        )


_FINDER = _Finder()
_real_find_spec = importlib.util.find_spec


def _find_spec(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
    """``importlib.util.find_spec`` that reports stood-in packages as absent, imported or
    not: availability probes (sglang's, transformers' ``is_*_available``) must see this
    machine as it is, or they take the path that uses the package (transformers reads a
    stood-in torchvision's version and fails)."""
    fullname = importlib.util.resolve_name(name, package) if name.startswith(".") else name
    if _FINDER.covers(fullname):
        return None
    return _real_find_spec(name, package)


def _exists(name: str) -> bool:
    """Whether ``name`` can be imported for real, found without running any module (for
    a dotted name, its parent package is searched, not imported)."""
    if name in sys.modules:
        return True
    top, *rest = name.split(".")
    try:
        spec = _real_find_spec(top)
    except (ImportError, ValueError):
        return False
    fullname = top
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        fullname = f"{fullname}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(fullname, spec.submodule_search_locations)
    return spec is not None


def install_standins(names: Iterable[str], *, force: bool = False) -> None:
    """Stand in for each of ``names`` (a top-level package, or a dotted module such as a
    compiled extension inside a package) that this machine cannot import; names it can
    import are left to the real package. Call before the first import that needs them.

    ``force`` stands in even for installed packages (not yet imported): for tracing, on a
    machine that has them, what the harness machine imports (sglang_pack.py does)."""
    for name in names:
        if _FINDER.covers(name) or (name in sys.modules or (not force and _exists(name))):
            continue
        _FINDER.names.append(name)
    if _FINDER.names and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
        importlib.util.find_spec = _find_spec


def installed() -> list[str]:
    """The names stood in so far in this process, in the order they were installed."""
    return list(_FINDER.names)
