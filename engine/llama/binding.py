"""llama-cpp-python's ctypes binding, imported without the library's high-level API."""
from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Any

_package_lock = threading.RLock()
_PACKAGE_DUNDERS = frozenset({"__version__"})  # the dunder names the package's __init__ defines


def binding() -> Any:
    """`llama_cpp.llama_cpp`, the ctypes binding, without the rest of the package.

    The package's `__init__` also imports its high-level API (`llama_cpp.llama`: numpy, jinja2,
    diskcache, multiprocessing, ...), 0.1-0.15 s of every start on 2 cores, and Ebb calls
    none of it before the first token. So when nothing has imported the package yet, it goes
    into `sys.modules` unexecuted: its submodules import as usual, the binding's names are
    served from the binding (as its `from .llama_cpp import *` would), and the first other
    name anyone asks for (`llama_cpp.Llama`, `__version__`) runs the real `__init__` then.

    `llama_cpp._logger` comes with it: on import it sets the library's own llama.cpp logger,
    so it is imported now, before Ebb routes the log (engine/llama/log.py), not later by
    whoever imports the high-level API."""
    with _package_lock:  # the window's threads may both get here first
        if "llama_cpp" not in sys.modules:
            spec = importlib.util.find_spec("llama_cpp")
            if spec is not None and spec.loader is not None and spec.submodule_search_locations:
                sys.modules["llama_cpp"] = _unexecuted_package(spec)
        import llama_cpp.llama_cpp
        import llama_cpp._logger  # noqa: F401 - after the binding, whose names it uses; see above

    return llama_cpp.llama_cpp


def _unexecuted_package(spec: Any) -> Any:
    pkg = importlib.util.module_from_spec(spec)
    executed = threading.Event()

    def rest_of_package(name: str) -> Any:  # PEP 562: called only for a name not there yet
        if name.startswith("__") and name.endswith("__") and name not in _PACKAGE_DUNDERS:
            # a probe, not a use: PySide's import hook runs inspect.unwrap on imported modules
            # (`hasattr(mod, "__wrapped__")`), here from inside llama_cpp._logger's own
            # `import llama_cpp`; running the package then re-entered _logger half-made
            # (ImportError, and the window's start died)
            raise AttributeError(f"module 'llama_cpp' has no attribute {name!r}")
        bound = sys.modules.get("llama_cpp.llama_cpp")
        if bound is not None and not name.startswith("_") and hasattr(bound, name):
            return getattr(bound, name)
        submodule = sys.modules.get(f"llama_cpp.{name}")  # one importing now (`import a.b as c`
        if submodule is not None:                         # inside a's own circular imports)
            return submodule
        with _package_lock:  # another thread asking meanwhile waits for the whole package
            if not executed.is_set():
                executed.set()  # first: a name asked for during the run is looked up, not run
                spec.loader.exec_module(pkg)  # `from .llama_cpp import *; from .llama import *`
        try:
            return pkg.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'llama_cpp' has no attribute {name!r}") from None

    pkg.__getattr__ = rest_of_package  # type: ignore[method-assign]
    return pkg
