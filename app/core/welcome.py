"""The first start's welcome, shown in the chat area until the first message (Qt-free HTML)."""
from __future__ import annotations

import html
from pathlib import Path

STANDIN_LINK = "standin:start"
OPEN_LINK = "open:model"


def welcome_html(folders: list[Path], n_found: int, has_accelerator: bool | None,
                 standin: str = "") -> str:
    """`has_accelerator`: None while the model loads; `standin`: the running stand-in's label."""
    looked = ", ".join(html.escape(str(f)) for f in folders) or "nowhere yet"
    found = (f"found {n_found} model{'s' if n_found != 1 else ''} there" if n_found
             else "found none there")
    parts = [
        "<h3 style='margin:0'>Welcome to Ebb</h3>",
        "<p>Private, local chat with vision models. The vision projector stays in RAM; when a "
        "message carries an image, Ebb borrows the accelerator's memory from the language "
        "model, encodes the image there, gives the memory back and carries on, with the "
        "conversation's context intact. The <b>Memory</b> panel on the right shows where every "
        "layer is, the memory over time and each step, predicted beside measured.</p>",
        "<p>The model Ebb starts with is the small demo, SmolLM2-135M. Its <b>demo projector "
        "is synthetic</b> (the stand-in below loads it; Open model… offers it too): generated, "
        "not trained. It shows the pipeline and at most tells a picture's colour; it does not "
        "see.</p>",
        f"<p><b>A real model:</b> <a href='{OPEN_LINK}'>File → Open model…</a> lists the GGUF "
        f"models in LM Studio's and Hugging Face's folders and any you add, and pairs a vision "
        f"model with its <code>mmproj</code> file. Ebb looked in {looked} and {found}.</p>",
    ]
    if standin:
        parts.append(f"<p>The <b>{html.escape(standin)}</b> is running: layers sit on it, and "
                     "an image's projector borrows their room (vision swaps while it runs, "
                     "unless Settings name a strategy). Attach a picture and send it to see the "
                     "swap in the timeline. It stops with the window.</p>")
    elif has_accelerator is False:
        parts.append("<p><b>No accelerator here</b>, so every layer stays in RAM and the swap "
                     f"never shows. <a href='{STANDIN_LINK}'>Start a stand-in accelerator</a>: a "
                     "local process that serves part of this machine's RAM as a device with a "
                     "memory size you pick (on loopback only), so you can watch layers move "
                     "and the projector borrow their room.</p>")
    return "".join(parts)
