"""``lmforge export`` and ``lmforge import``: run folders to and from Hugging Face folders (``hf/``)."""

from __future__ import annotations

import argparse

from lmforge.errors import UserError
from lmforge.recipe import parse_overrides


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model folder")
    p.add_argument("run", help="run folder")
    p.add_argument("--out", help="output folder (default: RUN/hf)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run as a PEFT adapter folder (default RUN/hf-adapter, its base in base/) instead of "
        "merged weights",
    )
    p.add_argument(
        "--quantize",
        metavar="SCHEME",
        help="write the model with integer linear layers instead (torchao; default RUN/quantized-SCHEME): "
        "int8da-int4w, int4w, int8da-int8w or int8w; loads with lmforge generate / eval",
    )
    p.add_argument(
        "--group-size",
        type=int,
        help="--quantize: input columns sharing one weight scale (default: the run's qat.group_size; 0: "
        "one scale per row)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "import",
        help="a Hugging Face Llama / GPT-2 folder as a run folder",
        description="Make a run folder of a local LlamaForCausalLM / GPT2LMHeadModel folder; other keys "
        "(data, train) from --config and --SECTION.KEY=VALUE as for train.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json, *.safetensors, tokenizer.json")
    p.add_argument("--run-dir", required=True, help="the new run folder")
    p.add_argument("--config", help="TOML recipe for the data and training keys")
    p.set_defaults(func=cmd_import, overrides=True)


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    if args.quantize is not None:
        from lmforge.evaluate.quantized_export import export_quantized

        if args.adapter:
            raise UserError("--adapter: a PEFT adapter cannot be quantized; drop --adapter or --quantize")
        out = export_quantized(args.run, args.quantize, args.group_size, args.out, args.step)
        print(f"exported to {out}")
        return 0
    from lmforge.hf.export import export_run

    print(f"exported to {export_run(args.run, args.out, args.step, args.adapter)}")
    return 0


def cmd_import(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.hf.import_ import import_hf

    ckpt = import_hf(args.hf_dir, args.run_dir, args.config, parse_overrides(extra))
    print(
        f"imported to {args.run_dir} ({ckpt.name}); continue with: lmforge train --resume --run-dir {args.run_dir}"
    )
    return 0
