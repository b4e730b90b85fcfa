"""`ballast export hf`: a checkpoint as a Hugging Face transformers model directory;
`ballast export dataset`: a prepared dataset in another trainer's format (dataprep/export/)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from cli.console import print_error, stderr_console
from core.protocol import EXIT_ERROR, EXIT_OK


def add_parser(subparsers: Any) -> None:
    exp = subparsers.add_parser("export", help="export a checkpoint or a dataset for other tools")
    sub = exp.add_subparsers(dest="format", required=True)
    hf = sub.add_parser("hf", help="as a Hugging Face transformers model directory")
    hf.add_argument(
        "checkpoint",
        help="a step-N checkpoint, a checkpoint directory or a run "
        "directory (its latest checkpoint)",
    )
    hf.add_argument("out_dir", help="directory to write config.json, model.safetensors, ...")
    hf.add_argument(
        "--dataset", help="the dataset whose tokenizer to export (default: the run's `dataset:`)"
    )
    hf.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    hf.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split model.safetensors above this size (with an index)",
    )
    hf.set_defaults(func=run_hf)
    ds = sub.add_parser("dataset", help="a prepared dataset in another trainer's format")
    ds.add_argument("dataset", help="dataset directory or s3:// URI (its newest version)")
    ds.add_argument("out", help="an empty or new directory (or s3:// prefix) to write to")
    ds.add_argument(
        "--format",
        required=True,
        choices=["megatron", "llmc", "mds"],
        help="megatron: indexed .bin/.idx (documents); llmc: llm.c/nanoGPT "
        ".bin shards; mds: MosaicML streaming shards (packed rows)",
    )
    ds.add_argument("--splits", default="train,validation", help="comma-separated splits to export")
    ds.add_argument(
        "--shard-tokens",
        type=int,
        default=10**8,
        help="llmc: tokens per shard (llm.c's fineweb.py: 10^8)",
    )
    ds.add_argument("--no-progress", action="store_true", help="no progress bars")
    ds.set_defaults(func=run_dataset)


def run_hf(args: argparse.Namespace) -> int:
    from training.export_hf import ExportError, export_hf

    try:
        out, arch = export_hf(
            args.checkpoint,
            args.out_dir,
            dataset=args.dataset,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
        )
    except ExportError as e:
        print_error(str(e))
        return EXIT_ERROR
    from core.dataset import shown_path

    Console(soft_wrap=True).print(
        f"{shown_path(str(out))}: {arch} (load with AutoModelForCausalLM.from_pretrained)",
        markup=False,
    )
    return EXIT_OK


def run_dataset(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from core.dataset import shown_path
    from core.store import StorageError
    from dataprep.export import DatasetExportError, check, export_dataset

    splits = tuple(args.splits.split(","))
    try:
        manifest = check(
            args.dataset, args.format, args.out, splits, shard_tokens=args.shard_tokens
        )[3]
    except (DatasetExportError, StorageError) as e:
        print_error(str(e))
        return EXIT_ERROR
    with Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=stderr_console(),
        disable=args.no_progress,
    ) as bars:
        tasks = {
            s: bars.add_task(
                f"export {s} rows", total=int(manifest.get("splits", {}).get(s, {}).get("rows", 0))
            )
            for s in splits
        }

        def advance(split: str, rows: int) -> None:
            bars.advance(tasks[split], rows)

        try:
            rec = export_dataset(
                args.dataset,
                args.format,
                args.out,
                splits,
                shard_tokens=args.shard_tokens,
                progress=advance,
            )
        except (DatasetExportError, StorageError) as e:
            print_error(str(e))
            return EXIT_ERROR
    out = Console(soft_wrap=True)
    for name, s in rec["splits"].items():
        count = s.get("documents", s.get("samples"))
        unit = "documents" if "documents" in s else "rows"
        cut = f" ({s['cut_pieces']} of them pieces of cut documents)" if s.get("cut_pieces") else ""
        out.print(f"{name}: {count} {unit}{cut}, {len(s['files'])} files", markup=False)
    out.print(
        f"{shown_path(args.out)}: {args.format} export of {shown_path(rec['dataset'])} "
        "(checksums and the "
        f"dataset's accounting in ballast_export.json)",
        markup=False,
    )
    return EXIT_OK
