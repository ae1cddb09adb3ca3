"""Whether a model (and its projector) fits *this* machine, and how it would run, judged from
its header alone: the same `ModelInfo` and planner (`placement/whatif.py`) a local file gets,
so a verdict before the download and one after it cannot disagree.

`judge` is pure (the machine comes in as `Machine`); `this_machine` reads the devices,
calibration and free RAM (any thread that may call llama.cpp's device API).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from engine.errors import EbbError
from engine.events import DeviceInfo
from engine.gguf.info import ModelInfo, ProjectorInfo
from engine.hub.catalog import HubFile, Quant
from engine.placement.calibration import DeviceCal
from engine.units import fmt_bytes

STRATEGY_WORDS = {"resident": "pictures on {accel} (the projector stays there)",
                  "swap": "pictures by swap (the projector waits in RAM)",
                  "cpu": "pictures encoded on the CPU"}


@dataclass(frozen=True)
class Machine:
    accel: str | None  # llama.cpp's device name ("CUDA0", "RPC0[...]"); None: the CPU alone
    accel_budget_bytes: int  # what Ebb may use there
    ram_available_bytes: int
    n_threads: int
    cpu_cal: DeviceCal | None = None
    accel_cal: DeviceCal | None = None
    can_stream: bool = True  # a local GPU can run ops on host weights; an RPC device cannot


@dataclass(frozen=True)
class Verdict:
    fits: bool  # False: the weights that stay in RAM are more than the RAM available
    n_layers: int
    n_layers_on_accel: int
    accel: str | None
    gen_tokens_per_s: float
    pictures: str | None  # resident, swap or cpu: the fastest that fits; None without projector
    picture_s: float | None  # predicted seconds per picture that way
    ram_needed_bytes: int
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(model: ModelInfo, proj: ProjectorInfo | None, machine: Machine,
          n_ctx: int = 4096) -> Verdict:
    """One verdict, in words a user reads beside the file."""
    from engine.placement.whatif import what_if

    n_ctx = model.fit_context(n_ctx)
    budget = machine.accel_budget_bytes if machine.accel else 0
    w = what_if(model, proj, budget, 16e9, 40e9, 300e9, n_ctx, machine.n_threads,
                machine.cpu_cal, machine.accel_cal, machine.accel or "GPU",
                can_stream=machine.can_stream)
    on = w.placement.n_layers_on_accel if machine.accel else 0
    ram = w.ram_weight_bytes + (proj.weight_bytes if proj is not None else 0)
    pictures = w.vision_plan.strategy if w.vision_plan is not None else None  # the session's choice
    picture_s = w.vision.get(pictures) if pictures is not None else None
    fits = ram <= machine.ram_available_bytes
    # the speed rests on measurements of the devices the layers run on, where there are some
    calibrated = ((on == 0 or machine.accel_cal is not None)
                  and (on == model.n_layers or machine.cpu_cal is not None))
    return Verdict(fits, model.n_layers, on, machine.accel, w.gen_tokens_per_s, pictures,
                   picture_s, ram, _words(model, machine, on, w.gen_tokens_per_s, pictures,
                                          ram, fits, calibrated))


def _words(model: ModelInfo, machine: Machine, on: int, tps: float, pictures: str | None,
           ram: int, fits: bool, calibrated: bool = True) -> str:
    if not fits:
        return (f"does not fit in RAM: {fmt_bytes(ram)} of weights would stay in RAM, "
                f"{fmt_bytes(machine.ram_available_bytes)} is free")
    accel = machine.accel or "CPU"
    if machine.accel is None:
        where = "on the CPU"
    elif on == model.n_layers:
        where = f"all {on} layers on {accel}"
    else:
        where = f"{on} of {model.n_layers} layers on {accel}"
    # uncalibrated, the speed was 3-50x off on a fresh install (#52): it says it is a guess
    speed = f"about {tps:.0f} tokens/s" + ("" if calibrated else
                                           " (estimate, uncalibrated: ebb-engine calibrate)")
    parts = [where, speed]
    if pictures is not None:
        parts.append(STRATEGY_WORDS[pictures].format(accel=accel))
    return "; ".join(parts)


def this_machine(n_threads: int | None = None) -> Machine:
    """The first accelerator Ebb would use, its budget and calibration, and the RAM free."""
    from engine.config import default_threads
    from engine.llama.devices import default_budget, find_device, pick_accelerator
    from engine.placement import calibration

    accel = pick_accelerator()
    budget, accel_cal, can_stream = 0, None, True
    if accel is not None:
        dev = find_device(accel)
        budget, can_stream = default_budget(accel), not dev.remote
        accel_cal = calibration.load(calibration.device_key(dev.name, dev.description))
    return Machine(accel, budget, ram_available_bytes(), default_threads(n_threads),
                   calibration.load("CPU"), accel_cal, can_stream)


def machine_from_devices(devices: Sequence[DeviceInfo], n_threads: int) -> Machine:
    """The machine as a loaded session saw it (LoadDetails.devices), for a caller that must not
    ask llama.cpp itself (the window's GUI thread)."""
    from engine.llama.devices import SAFETY_MARGIN_BYTES
    from engine.placement import calibration

    accel = next((d for d in devices if d.is_accelerator), None)
    if accel is None:
        return Machine(None, 0, ram_available_bytes(), n_threads, calibration.load("CPU"))
    free = accel.free_bytes or 0
    budget = max(0, free - max(SAFETY_MARGIN_BYTES, free // 20))
    cal = calibration.load(calibration.device_key(accel.name, accel.description))
    return Machine(accel.name, budget, ram_available_bytes(), n_threads,
                   calibration.load("CPU"), cal, not accel.remote)


def ram_available_bytes() -> int:
    """MemAvailable from /proc/meminfo; elsewhere the physical memory (a generous guess)."""
    import os

    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def remote_projector(repo: str, projector: HubFile, endpoint: str | None = None,
                     token: str | None = None) -> ProjectorInfo:
    """A projector on the Hub (`catalog.HubFile`), from its header: read once for a repo,
    then beside each quantisation's verdict."""
    from engine.gguf.info import projector_info
    from engine.hub.remote import remote_gguf

    return projector_info(remote_gguf(repo, projector.name, endpoint=endpoint, token=token))


def judge_remote(repo: str, quant: Quant, proj: ProjectorInfo | None, machine: Machine,
                 endpoint: str | None = None, token: str | None = None,
                 n_ctx: int = 4096) -> Verdict:
    """The verdict for a quantisation on the Hub (`catalog.Quant`: every part's header is
    read, a split model's tensors are in all of them) with a projector already read."""
    from engine.gguf.info import model_info

    return judge(model_info(remote_model(repo, quant, endpoint, token)), proj, machine, n_ctx)


def remote_model(repo: str, quant: Quant, endpoint: str | None = None,
                 token: str | None = None) -> Any:
    """The quantisation's header as llama.cpp would load it (a split set's parts merged and
    checked, engine/gguf/info.py's `check_parts`); an EbbError names a part that is missing, not
    a GGUF, or out of place: the same refusals a local set gets."""
    from engine.gguf.info import merge_parts
    from engine.hub.remote import remote_gguf

    if quant.missing:
        n = len(quant.parts) + len(quant.missing)
        raise EbbError(f"{quant.label} is split in {n} parts, and {repo} lacks "
                       f"{', '.join(quant.missing)}: it cannot be loaded", "pick another quantisation")
    return merge_parts([remote_gguf(repo, p.name, endpoint=endpoint, token=token) for p in quant.parts])


def recommend(verdicts: list[tuple[str, Verdict]]) -> tuple[str, str] | None:
    """Which quantisation to take when none is named, and why (pure): with an accelerator, the
    largest whose every layer fits on it, else the one that puts the most layers there (the
    smaller on a tie); on the CPU alone, Q4_K_M where it fits (llama.cpp's and Ollama's balance
    of size and quality), else the largest that fits. `verdicts`: (label, verdict), smallest
    file first. None when nothing fits this machine."""
    fitting = [(label, v) for label, v in verdicts if v.fits]
    if not fitting:
        return None
    if fitting[0][1].accel is not None:
        whole = [(label, v) for label, v in fitting if v.n_layers_on_accel >= v.n_layers]
        if whole:
            label, v = whole[-1]
            return label, f"the largest whose {v.n_layers} layers all fit on {v.accel}: {v.text}"
        label, v = max(fitting, key=lambda lv: (lv[1].n_layers_on_accel, -fitting.index(lv)))
        return label, f"it puts the most layers on {v.accel}: {v.text}"
    for label, v in fitting:
        if label.upper() == "Q4_K_M":
            return label, f"a balance of size and quality that fits: {v.text}"
    label, v = fitting[-1]
    return label, f"the largest that fits this machine's RAM: {v.text}"

