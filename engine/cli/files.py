"""Commands on model files: inspect, make-projector, make-model, fetch-model."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.cli.common import Subcommands, flag_parser, flash_attn_arg
from engine.errors import EbbError
from engine.gguf.families import GENERATED as FAMILIES
from engine.units import fmt_bytes


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not WIDTHxHEIGHT (e.g. 1024x768)") from None
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError("width and height must be positive")
    return w, h


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.gguf.info import inspect_files
    from engine.models.default import existing_file, resolve_model_path

    model = resolve_model_path(args.model)
    mmproj = existing_file(args.mmproj, "projector") if args.mmproj else None
    result = inspect_files(model, mmproj)
    probe = None
    if mmproj is not None and result.projector is not None:
        from engine.config import default_threads
        from engine.media.projector import probe_projector

        size = args.image_size or (result.projector.image_size, result.projector.image_size)
        probe = probe_projector(mmproj, model, size, default_threads(None), flash_attn_arg(args) is True,
                                args.image_max_tokens)
    if args.json:
        d = result.to_dict()
        if probe is not None:
            pd = probe.info.to_dict()
            # mtmd's own numbers in the plain keys; the header's guesses kept beside them
            pd.update(n_image_tokens_header=pd["n_image_tokens"],
                     n_image_tokens=probe.image_tokens, n_image_chunks=probe.image_chunks,
                     image_size_asked=list(probe.image_size),
                     n_image_tokens_max=probe.info.n_image_tokens_measured,
                     compute_buffer_bytes=probe.info.compute_buffer_bytes_measured)
            d["projector"] = pd
        print(json.dumps(d, indent=1))
        return 0
    m = result.model
    print(f"model        {m.path}")
    print(f"architecture {m.architecture} ({m.name})")
    print(f"layers       {m.n_layers}   n_embd {m.n_embd}   heads {m.n_head}   "
          f"context {m.n_ctx_train}")
    print(f"tensor bytes {fmt_bytes(m.tensor_bytes)} (file {fmt_bytes(m.file_bytes)})")
    print(f"layers       {fmt_bytes(sum(m.layer_bytes))} in all, "
          f"{fmt_bytes(min(m.layer_bytes, default=0))}–{fmt_bytes(max(m.layer_bytes, default=0))} each")
    print(f"outside      {fmt_bytes(m.non_layer_bytes)}: " + ", ".join(
        f"{k} {fmt_bytes(v)}" for k, v in m.non_layer_tensors.items()))
    print(f"KV cache     {m.kv_bytes_per_token} B/token "
          f"({m.kv_bytes_per_token_per_layer[0] if m.kv_bytes_per_token_per_layer else 0} B/token/layer, f16)")
    if probe is not None:
        p = probe.info
        w, h = probe.image_size
        print(f"projector    {p.path}{'  [synthetic: random weights]' if p.synthetic else ''}")
        print(f"family       {p.family} (type {p.projector_type}), {p.n_layers} blocks, width "
              f"{p.n_embd}, output width {p.output_width}")
        print(f"image tokens {probe.image_tokens} for a {w}x{h} picture"
              + (f" in {probe.image_chunks} chunks" if probe.image_chunks > 1 else "")
              + f"; at most {p.n_image_tokens_measured} (mtmd)")
        print(f"memory       weights {fmt_bytes(p.weight_bytes)}; compute buffer "
              f"{fmt_bytes(p.compute_buffer_bytes_measured)} (mtmd's reserve at load)")
    else:
        print("projector    none (text only)" if not args.mmproj else "")
    return 0


def cmd_make_projector(args: argparse.Namespace) -> int:
    from engine.gguf.info import model_info, read_gguf
    from engine.models.default import resolve_model_path
    from engine.synth.projector_gen import write_projector

    model_path = resolve_model_path(args.for_model)
    if args.colour:
        from engine.synth.projector_gen import write_colour_projector

        out = write_colour_projector(Path(args.out), model_path, size=args.size)
        print(f"wrote {out} ({fmt_bytes(out.stat().st_size)}, colour, {args.size}: names a "
              "picture's colour with the model's own words)")
        return 0
    gf = read_gguf(model_path)
    model = model_info(gf)
    # a model Ebb generated for a family says which; any other model takes the LLaVA adapter
    family = args.family or str(gf.metadata.get("ebb.family", "mlp"))
    out = write_projector(Path(args.out), model.n_embd, size=args.size, seed=args.seed,
                          family=family)
    print(f"wrote {out} ({fmt_bytes(out.stat().st_size)}, {family}, {args.size}, seed "
          f"{args.seed}, output width {model.n_embd}; synthetic: random weights)")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.synth.model_gen import SHAPES, write_model, write_sparse_model

    if args.family:
        from engine.models.default import default_model_path, fetch_default_model

        tok = default_model_path() if default_model_path().exists() else fetch_default_model()
        template = None
        if args.chat_template:
            try:
                template = Path(args.chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise EbbError(f"cannot read the chat template {args.chat_template}: {exc}") from exc
        out = write_model(Path(args.out), SHAPES[args.shape], tok, seed=args.seed,
                          family=args.family, chat_template=template)
        print(f"wrote {out} ({fmt_bytes(out.stat().st_size)}, {args.family} language model, "
              f"{args.shape}, seed {args.seed}; synthetic: random weights, SmolLM2's tokenizer)")
        return 0
    out = write_sparse_model(Path(args.out), args.like)
    st = out.stat()
    print(f"wrote {out}: {fmt_bytes(st.st_size)} of real shapes ({args.like}, Q4_0), "
          f"{fmt_bytes(st.st_blocks * 512)} on disk (the weights are a hole)")
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from engine.models.default import fetch_default_model

    path = fetch_default_model()
    print(path)
    return 0


def register(sub: Subcommands) -> None:
    p = sub.add_parser("inspect", help="what a model (and projector) holds, from its tensor table",
                       parents=[flag_parser("rpc", "mmproj", "json")])
    p.add_argument("model", help="GGUF path, or 'default'")
    p.add_argument("--image-size", type=_size, default=None, metavar="WxH",
                   help="count the image tokens of a picture this size (default: the "
                        "projector's own image size)")
    p.add_argument("--image-max-tokens", type=int, default=0,
                   help="cap on a dynamic-resolution projector's tokens per image (0: its own)")
    p.add_argument("--flash-attn", choices=["on", "off"], default="on",
                   help="the projector's attention kernel (sizes its compute buffer)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("make-projector", help="write a synthetic vision projector (random weights)",
                       parents=[flag_parser("rpc")])
    p.add_argument("--for", dest="for_model", required=True, help="the model it should fit")
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=["tiny", "base", "large"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=FAMILIES, default=None,
                   help="projector family (default: the model's, if Ebb made it; else mlp)")
    p.add_argument("--colour", action="store_true",
                   help="the colour projector (closed-form weights, mlp layout): it tells red, "
                        "green, blue, yellow, black and white apart")
    p.set_defaults(func=cmd_make_projector)

    p = sub.add_parser("make-model", help="write a synthetic language model: a family's tiny "
                       "random-weight model (--family) or a header-only GGUF of real shapes (--like)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--like", choices=["llama-8b", "llama-70b"])
    what.add_argument("--family", choices=FAMILIES,
                      help="the language model of a vision family (its architecture and tokens)")
    p.add_argument("--shape", choices=["tiny", "3b"], default="tiny", help="with --family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", metavar="FILE.jinja", default=None,
                   help="with --family: this chat template in place of SmolLM2's")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("fetch-model", help="fetch the default model into the cache (once)",
                       parents=[flag_parser("rpc")])
    p.set_defaults(func=cmd_fetch_model)
