"""What the status bar says of the loaded model: pure formatting (no Qt), so each wording is
tested on its own and the window only shows it."""
from __future__ import annotations

from engine.events import GenStats, LoadDetails, PhasesUsed


def placement_text(n_layers: int, details: LoadDetails, accel_name: str) -> str:
    """Where the layers are: spread over devices, on the accelerator (and by which mover), or
    all in RAM."""
    d = details
    by_dev = {k: v for k, v in d.layers_by_device.items() if k != "CPU"}
    if d.accelerator and len(by_dev) > 1:  # spread over several devices
        return (" + ".join(f"{n} on {dev}" for dev, n in by_dev.items()) + f" of {n_layers} "
                f"layers · {d.mover} mover")
    if d.accelerator:
        mover = f"{d.mover} mover" + (f" ({d.mover_note})" if d.mover_note else "")
        return f"{d.n_layers_on_accel}/{n_layers} layers on {accel_name} · {mover}"
    return f"all {n_layers} layers in RAM (no accelerator)"


def model_line(name: str, n_layers: int, n_ctx: int, details: LoadDetails,
               accel_name: str) -> str:
    """The model label: name, placement, context, safe mode, and what a load sent to remote
    devices."""
    line = f"{name} · {placement_text(n_layers, details, accel_name)} · ctx {n_ctx}"
    if details.safe_mode:
        line += " · safe mode"
    sent = details.rpc_bytes_sent
    if sent:
        line += f" · sent {sent / 2**20:.1f} MiB to remote devices while loading"
    return line


def loaded_message(load_s: float, mover_note: str = "", started_s: float | None = None) -> str:
    """The status line's transient message after a load (the whole start, once)."""
    started = f" (ready {started_s:.1f}s after Ebb started)" if started_s is not None else ""
    return f"Model loaded in {load_s:.2f}s{started}" + (f" — {mover_note}" if mover_note else "")


def phases_line(ph: PhasesUsed) -> str:
    """Where and with how many threads each phase of the last turn ran, and why."""
    def threads(n: int) -> str:
        return f"{n} thread{'s' if n != 1 else ''}"

    return (f"Prompt: {ph.prompt_layers} layers, {threads(ph.prompt_threads)} · "
            f"generation: {ph.gen_layers} layers, {threads(ph.gen_threads)} — {ph.reason}")


def restored_line(gen: GenStats) -> str:
    """"Memory of this chat restored in 0.4 s (6,200 tokens)" when the last reply's prompt
    took the model's memory from a kept state (RAM or disk) instead of evaluating it."""
    n = gen.n_prompt_tokens_restored
    if n <= 0:
        return ""
    evaluated, s = gen.n_prompt_tokens_evaluated, gen.restore_s
    took = f"{s * 1000:.0f} ms" if s < 0.1 else f"{s:.1f} s"
    when = " when the chat was opened" if gen.restored_ahead else ""
    return (f"Memory of this chat restored{when} in {took} ({n:,} tokens); "
            f"{evaluated:,} new token{'s' if evaluated != 1 else ''} evaluated")
