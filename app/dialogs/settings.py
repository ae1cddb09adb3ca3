"""Settings: every window setting, checked before it is saved."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QPushButton,
    QLineEdit,
    QSpinBox,
    QWidget,
)

from app.core.settings import Settings
from engine.errors import EbbError
from engine.units import fmt_bytes, parse_size


Rows = list[tuple[str, QWidget]]  # a section's rows of the form, in order


class SettingsDialog(QDialog):
    def __init__(self, v: Settings, parent: QWidget | None = None,
                 memory_usage: tuple[int, int] = (0, 0),
                 open_tools: Callable[[], None] | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.open_tools = open_tools
        self.error = QLabel("")
        self.error.setStyleSheet("color: #c62828;")
        form = QFormLayout(self)
        for label, widget in [*self._placement(v), *self._conversation(v),
                              *self._memory(v, memory_usage), *self._network(v)]:
            form.addRow(label, widget)
        if open_tools is not None:  # the MCP servers have a dialog of their own
            tools = QPushButton("Tool servers (MCP)…", toolTip="The MCP servers whose tools a chat "
                                "may call: add, switch on per chat, restart (also Model → Tools…)")
            tools.clicked.connect(open_tools)
            form.addRow("Tools", tools)
        form.addRow(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self._on_ok)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def _placement(self, v: Settings) -> Rows:
        """Where the model runs: the budget, threads and layers of each phase, several devices."""
        self.budget = QLineEdit(v.vram_budget, placeholderText="auto (free memory minus a margin), e.g. 6GiB")
        self.threads = QSpinBox(minimum=0, maximum=256, value=v.threads, specialValueText="auto")
        self.gpu_layers = QSpinBox(minimum=-1, maximum=1000, value=v.gpu_layers,
                                   specialValueText="all that fit (or Tune…)")
        self.prompt_layers = QSpinBox(
            minimum=-1, maximum=1000, value=v.prompt_layers,
            specialValueText="as for generation",
            toolTip="A long prompt runs with this many layers on the accelerator and moves back "
                    "before the first generated token, when the move pays (live mover; priced "
                    "from Tune's measurements)")
        self.threads_batch = QSpinBox(minimum=0, maximum=256, value=v.threads_batch,
                                      specialValueText="as for generation")
        self.image_layers = QSpinBox(
            minimum=-1, maximum=1000, value=v.image_layers,
            specialValueText="as for text prompts",
            toolTip="A prompt with images (a larger batch) runs with this many layers on the "
                    "accelerator: Tune measures where its speed falls off")
        self.image_speeds = dict(v.image_speeds)
        self.prompt_speeds = dict(v.prompt_speeds)
        self.phase_info = QLabel(self._phase_text())
        self.phase_info.setWordWrap(True)
        self.phase_info.setStyleSheet("color: #555;")
        self.gpu_layers.valueChanged.connect(lambda _: self.phase_info.setText(self._phase_text()))
        self.prompt_layers.valueChanged.connect(
            lambda _: self.phase_info.setText(self._phase_text()))
        self.spread = QCheckBox("deal layers over every accelerator (local and RPC) by measured "
                                "link", checked=v.spread)
        return [("Accelerator VRAM budget", self.budget), ("Threads (generation)", self.threads),
                ("Threads (prompt)", self.threads_batch),
                ("Accelerator layers (generation)", self.gpu_layers),
                ("Accelerator layers (prompt)", self.prompt_layers),
                ("Accelerator layers (prompt with images)", self.image_layers),
                ("", self.phase_info), ("Several devices", self.spread)]

    def _conversation(self, v: Settings) -> Rows:
        """How long a conversation and a reply may be, and what happens when it is full."""
        self.ctx = QSpinBox(minimum=256, maximum=262144, singleStep=1024, value=v.ctx)
        self.img_tokens = QSpinBox(minimum=0, maximum=16384, value=v.image_max_tokens,
                                   specialValueText="projector default")
        self.max_tokens = QSpinBox(minimum=0, maximum=1_000_000, singleStep=256,
                                   value=v.max_tokens,
                                   specialValueText="none (until the model stops)")
        self.overflow = QComboBox()
        self.overflow.addItem("let the oldest turns go (images first)", "drop-oldest")
        self.overflow.addItem("stop and say so", "stop")
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(v.overflow)))
        self.draft = QLineEdit(v.draft_model, placeholderText="none: guesses from the conversation itself",
                               toolTip="A small GGUF model of the same vocabulary (the same family) "
                                       "that guesses the reply's next tokens; the loaded model checks "
                                       "each guess, so the reply is its own (the model reloads)")
        return [("Context length", self.ctx), ("Image token limit", self.img_tokens),
                ("Reply length cap", self.max_tokens), ("When the context is full", self.overflow),
                ("Draft model", self.draft)]

    def _memory(self, v: Settings, usage: tuple[int, int]) -> Rows:
        """What is kept (the image cache, the chats' memory on disk) and how attention and
        vision run."""
        self.image_cache = QLineEdit(v.image_cache, placeholderText="1GiB",
                                     toolTip="Image embeddings kept in RAM; the least recently "
                                             "used leave first and are encoded again if needed")
        self.memory_disk = QLineEdit(
            v.memory_disk, placeholderText="4GiB",
            toolTip="The model's memory of each chat (its KV cache) and the encoded pictures, "
                    "kept in the data folder so a chat reopens without being evaluated again; "
                    "the least recently used leave first. 0: keep none")
        n_states, n_bytes = usage
        self.memory_usage = QLabel(f"holds {n_states} saved conversation state"
                                   f"{'' if n_states == 1 else 's'}, {fmt_bytes(n_bytes)} with "
                                   "the encoded pictures")
        self.memory_usage.setStyleSheet("color: #555;")
        self.flash = QComboBox(toolTip="On a CPU, flash attention measured slower once a chat "
                                       "has history; on a GPU it is usually faster. Model → "
                                       "Tune… measures it on this machine.")
        self.flash.addItem("auto: on with an accelerator or several requests at once, else off", "auto")
        self.flash.addItem("on", True)
        self.flash.addItem("off", False)
        self.flash.setCurrentIndex(max(0, self.flash.findData(v.flash_attn)))
        self.vision = QComboBox()
        self.vision.addItems(["auto", "resident", "swap", "cpu"])
        self.vision.setCurrentText(v.vision)
        return [("Image cache", self.image_cache), ("Chat memory on disk", self.memory_disk),
                ("", self.memory_usage), ("Flash attention", self.flash),
                ("Vision strategy", self.vision)]

    def _network(self, v: Settings) -> Rows:
        """Other machines: RPC servers, the local server, the Hub."""
        self.rpc = QLineEdit(", ".join(v.rpc), placeholderText="HOST:PORT, … (trusted networks only)")
        self.server = QCheckBox("serve an OpenAI-compatible API (/v1/chat/completions) from "
                                "this window's model", checked=v.server)
        self.server_host = QLineEdit(v.server_host, placeholderText="127.0.0.1",
                                     toolTip="Loopback (127.0.0.1) answers this machine only; "
                                             "any other address lets other machines in")
        self.server_port = QSpinBox(minimum=1, maximum=65535, value=v.server_port)
        self.parallel = QSpinBox(
            minimum=1, maximum=16, value=v.parallel, specialValueText="1: one after another",
            toolTip="Text requests answered at the same time as the window's reply and each other, "
                    "decoded together (the model reloads; flash attention goes on with more than one)")
        self.server_key = QLineEdit(v.server_api_key, placeholderText="none: any local program may ask",
                                    echoMode=QLineEdit.EchoMode.Password)
        self.hub_endpoint = QLineEdit(v.hub_endpoint, placeholderText="HF_ENDPOINT, else "
                                      "https://huggingface.co", toolTip="A mirror of the Hugging "
                                      "Face Hub for Model → Get models…")
        self.hub_token = QLineEdit(v.hub_token, placeholderText="HF_TOKEN, else none (gated "
                                   "models need one)", echoMode=QLineEdit.EchoMode.Password)
        return [("RPC servers", self.rpc), ("Local server", self.server),
                ("  address", self.server_host), ("  port", self.server_port),
                ("  API key", self.server_key), ("  requests at once", self.parallel), ("Hugging Face Hub mirror", self.hub_endpoint),
                ("  token", self.hub_token)]

    def values(self) -> dict[str, Any]:
        return {"vram_budget": self.budget.text().strip(), "threads": self.threads.value(),
                "ctx": self.ctx.value(), "image_max_tokens": self.img_tokens.value(),
                "flash_attn": self.flash.currentData(), "vision": self.vision.currentText(),
                "gpu_layers": self.gpu_layers.value(), "spread": self.spread.isChecked(),
                "prompt_layers": self.prompt_layers.value(),
                "threads_batch": self.threads_batch.value(), "prompt_speeds": self.prompt_speeds,
                "image_layers": self.image_layers.value(), "image_speeds": self.image_speeds,
                "max_tokens": self.max_tokens.value(), "overflow": self.overflow.currentData(),
                "draft_model": self.draft.text().strip(),
                "image_cache": self.image_cache.text().strip(),
                "memory_disk": self.memory_disk.text().strip() or "0",
                "rpc": [r.strip() for r in self.rpc.text().split(",") if r.strip()],
                "server": self.server.isChecked(),
                "server_host": self.server_host.text().strip() or "127.0.0.1",
                "server_port": self.server_port.value(), "parallel": self.parallel.value(),
                "server_api_key": self.server_key.text().strip(),
                "hub_endpoint": self.hub_endpoint.text().strip(),
                "hub_token": self.hub_token.text().strip()}

    def _phase_text(self) -> str:
        """What the two layer counts do, from Tune's measured prompt speeds."""
        gen, prompt = self.gpu_layers.value(), self.prompt_layers.value()
        if prompt < 0 or gen < 0 or prompt == gen:
            return "One placement for both phases."
        speeds = self.prompt_speeds
        if str(gen) not in speeds or str(prompt) not in speeds:
            return ("Tune… has not measured prompts at both counts: one placement until it "
                    "has.")
        return (f"Prompts measured at {speeds[str(prompt)]:.0f} tok/s with {prompt} layers, "
                f"{speeds[str(gen)]:.0f} with {gen}: a long prompt moves when that pays.")

    def _on_ok(self) -> None:
        from engine.llama.devices import parse_endpoint

        try:
            v = self.values()
            if v["vram_budget"]:
                parse_size(v["vram_budget"])
            if v["image_cache"]:
                parse_size(v["image_cache"])
            parse_size(v["memory_disk"])
            for r in v["rpc"]:
                parse_endpoint(r)
            if v["draft_model"] and not Path(v["draft_model"]).expanduser().is_file():
                raise EbbError(f"the draft model {v['draft_model']} is not a file",
                               "name a GGUF file, or leave it empty")
        except EbbError as exc:
            self.error.setText(str(exc))
            return
        self.accept()
