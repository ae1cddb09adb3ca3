"""#31: what a start imports on the way to its first token, and the pieces that let it skip the
library's high-level API (llama_cpp.llama: numpy, diskcache, ...)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "templates"

# the Transformers extras a template may use: {% generation %}, loop controls, tojson's
# arguments, strftime_now and raise_exception
EXTRAS_TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'stop' %}{% break %}{% endif -%}
{%- if m.role == 'skip' %}{% continue %}{% endif -%}
{%- if m.role == 'bad' %}{{ raise_exception('roles must alternate: ' ~ m.content) }}{% endif -%}
[{{ m.role }}]{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
{% endfor -%}
{%- if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}{% endif -%}
{{ bos_token }}{{ strftime_now('%Y') }}{% if add_generation_prompt %}[assistant]{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, «today»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and ünicode ✓?"}],
    [{"role": "user", "content": "weather in Oslo?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "abcdefghi", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
     {"role": "tool", "tool_call_id": "abcdefghi", "content": '{"temp": -3}'}],
    [{"role": "user", "content": "a"}, {"role": "skip", "content": "x"},
     {"role": "stop", "content": "y"}, {"role": "user", "content": "never"}],
]


def _templates(model_path: Path) -> dict[str, str]:
    from engine.gguf.info import read_gguf
    from engine.llama.runtime import CHATML_TEMPLATE

    out = {p.name: p.read_text() for p in sorted(TEMPLATES.glob("*.jinja"))}
    out["SmolLM2's own"] = read_gguf(model_path).metadata["tokenizer.chat_template"]
    out["ChatML (no template in the file)"] = CHATML_TEMPLATE
    out["Transformers extras"] = EXTRAS_TEMPLATE
    return out


def test_a_chat_template_renders_as_the_librarys_formatter(model_path):
    """Ebb renders templates itself (the library's formatter imports its whole high-level API):
    every template the suite has, with and without tools, gives the library's prompt exactly."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from engine.llama.chat_template import ChatTemplate

    compared = 0
    for name, source in _templates(model_path).items():
        ours = ChatTemplate(source, eos_token="<|im_end|>", bos_token="<s>")
        theirs = Jinja2ChatFormatter(template=source, eos_token="<|im_end|>", bos_token="<s>")
        for messages in CONVERSATIONS:
            for tools in (None, TOOLS):
                try:
                    want = theirs(messages=messages, tools=tools).prompt
                except Exception as exc:  # noqa: BLE001 - a template may refuse a conversation
                    with pytest.raises(type(exc), match=None):
                        ours(messages=messages, tools=tools)
                    continue
                assert ours(messages=messages, tools=tools) == want, (name, messages, tools)
                compared += 1
    assert compared >= 30


def test_raise_exception_in_a_template_is_a_value_error_with_its_words():
    from engine.llama.chat_template import ChatTemplate

    t = ChatTemplate(EXTRAS_TEMPLATE, eos_token="", bos_token="")
    with pytest.raises(ValueError, match="roles must alternate: x"):
        t(messages=[{"role": "bad", "content": "x"}])


_CHAT_THEN_REPORT = """
import json, sys
from engine.cli import main
rc = main(["chat", "--model", sys.argv[1], "--prompt", "hi", "--max-tokens", "1", "--temp", "0",
           "--threads", "2", "--ctx", "512", "--json"])
print(json.dumps({"rc": rc, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in
                                             ("numpy", "llama_cpp", "diskcache", "PIL"))}))
"""


def test_a_chat_reaches_its_first_token_without_the_librarys_high_level_api(model_path):
    """`ebb-engine chat` answers with only the ctypes bindings of llama-cpp-python loaded: not
    `llama_cpp.llama` and what it brings (numpy, diskcache), which cost 0.1-0.15 s of every
    start on 2 cores."""
    proc = subprocess.run([sys.executable, "-c", _CHAT_THEN_REPORT, str(model_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    turn, report = json.loads(lines[-2]), json.loads(lines[-1])
    assert report["rc"] == 0 and turn["n_gen_tokens"] == 1 and turn["first_token_s"] > 0
    assert "llama_cpp.llama_cpp" in report["loaded"]
    assert not {"llama_cpp.llama", "llama_cpp.llama_chat_format", "numpy", "diskcache",
                "PIL"} & set(report["loaded"]), report["loaded"]


_PACKAGE_ON_FIRST_USE = """
import json, sys
from engine.llama.binding import binding
b = binding()
before = "llama_cpp.llama" in sys.modules
import llama_cpp
still = "llama_cpp.llama" in sys.modules
from engine.llama.lib import llama
from engine.llama import log
llama()  # Ebb's log routing in place, as in a session
from llama_cpp import Llama
log.clear()
assert not b.llama_model_load_from_file(b"/nonexistent/model.gguf", b.llama_model_default_params())
print(json.dumps({"log_still_ours": any("/nonexistent/model.gguf" in line for _, line in log.recent()),
"before": before, "after_import": still, "version": llama_cpp.__version__,
                  "Llama": Llama.__module__, "same_binding": llama_cpp.llama_cpp is b,
                  "backend_init": llama_cpp.llama_backend_init is b.llama_backend_init}))
"""


def test_the_rest_of_the_library_loads_when_first_asked_for():
    """The package skipped at start is whole for whoever wants it: `from llama_cpp import
    Llama` and `llama_cpp.__version__` run its own __init__ then, over the same binding; and
    llama.cpp's log stays routed through Ebb (the library sets its own logger on import: the
    live mover's layer discovery reads that log)."""
    proc = subprocess.run([sys.executable, "-c", _PACKAGE_ON_FIRST_USE], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    import llama_cpp

    assert out == {"log_still_ours": True, "before": False, "after_import": False, "version": llama_cpp.__version__,
                   "Llama": "llama_cpp.llama", "same_binding": True, "backend_init": True}


_HIGH_LEVEL_FIRST_BY_ITS_MODULE = """
import json, sys
from engine.llama.lib import llama
from engine.llama import log
L = llama()
import llama_cpp.llama_chat_format  # a submodule of the high-level API, not the package's name
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
import llama_cpp
log.clear()
assert not L.llama_model_load_from_file(b"/nonexistent/model.gguf", L.llama_model_default_params())
print(json.dumps({"log_still_ours": any("/nonexistent/model.gguf" in line for _, line in log.recent()),
                  "Llama": llama_cpp.Llama.__name__}))
"""


def test_importing_a_high_level_module_directly_keeps_the_package_whole():
    """`import llama_cpp.llama_chat_format` on its own (it imports llama_cpp.llama, whose logger
    module asks the package for the binding's names mid-import): the package still ends whole,
    and llama.cpp's log still comes to Ebb."""
    proc = subprocess.run([sys.executable, "-c", _HIGH_LEVEL_FIRST_BY_ITS_MODULE],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"log_still_ours": True,
                                                                 "Llama": "Llama"}


_PROBED_MID_LOGGER = """
import builtins, sys
real = builtins.__import__

def probing(name, *args, **kwargs):  # as PySide's import hook does: inspect.unwrap probes
    module = real(name, *args, **kwargs)  # __wrapped__ on what was imported
    if sys._getframe(1).f_globals.get("__name__") == "llama_cpp._logger":
        hasattr(module, "__wrapped__")
    return module

builtins.__import__ = probing
from engine.llama.binding import binding
binding().llama_log_set
import llama_cpp
print("ok", "llama_cpp.llama" in sys.modules, llama_cpp.Llama.__name__)
"""


def test_a_probe_for_a_dunder_mid_import_does_not_run_the_package():
    """CI went red: the window's start died in `import llama_cpp._logger` with "cannot import name
    'logger' from partially initialized module 'llama_cpp._logger'". PySide's import hook probed
    `__wrapped__` on the package from inside _logger's own `import llama_cpp`, and that probe
    ran the whole package, which imports _logger again. A probe is answered without it; the
    package still runs when a real name is asked for."""
    proc = subprocess.run([sys.executable, "-c", _PROBED_MID_LOGGER], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok False Llama"


def test_a_command_builds_only_its_groups_parser_and_every_command_is_listed():
    """`ebb-engine chat` builds chat's parser alone (#31); GROUPS must name what each module
    registers, or a command would be missing from its own start."""
    import argparse

    from engine.cli import GROUPS, build_parser

    def commands(ap: argparse.ArgumentParser) -> set[str]:
        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
        return set(sub.choices)

    assert commands(build_parser()) == {c for cs in GROUPS.values() for c in cs}
    assert commands(build_parser("no-such-command")) == commands(build_parser())
    for cs in GROUPS.values():
        for c in cs:
            assert commands(build_parser(c)) == set(cs), c
    args = build_parser("chat").parse_args(["chat", "--prompt", "hi", "--max-tokens", "1"])
    assert args.prompt == "hi" and args.func.__name__ == "cmd_chat"


_THREADS_AT_ONCE = """
import sys, threading
from engine.llama.binding import binding
barrier = threading.Barrier(6)
errors = []

def first_use(i):
    barrier.wait()
    try:
        if i % 2:
            binding().llama_log_callback
        else:
            import llama_cpp
            llama_cpp.__version__, llama_cpp.Llama, llama_cpp.llama_log_set
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=first_use, args=(i,)) for i in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors or "ok")
"""


def test_threads_that_reach_the_library_at_once_all_get_it():
    """The window's main thread and its engine worker may reach llama_cpp at the same moment:
    one running the package's own __init__ must not leave the others a half-made package."""
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _THREADS_AT_ONCE], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout


def test_a_files_hash_is_worked_out_once_per_version_of_it(tmp_path, monkeypatch):
    """#54: the default model was hashed (98 MB) at every start and load. The hash is kept by
    path, size and modification time: the same file is not read again; a changed one is."""
    import hashlib
    import os

    from engine.models import default

    monkeypatch.setenv("EBB_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 4096)
    assert default.sha256_file(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    reads: list[str] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (reads.append(str(p)), real_open(p, *a, **k))[1])
    assert default.sha256_file(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert str(f) not in reads  # kept: not hashed again
    monkeypatch.undo()
    monkeypatch.setenv("EBB_CACHE_DIR", str(tmp_path / "cache"))
    f.write_bytes(b"b" * 4096)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert default.sha256_file(f) == hashlib.sha256(b"b" * 4096).hexdigest()
