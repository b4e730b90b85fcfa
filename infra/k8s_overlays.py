"""The generated files of k8s/ (for kubectl users): each overlay's attempt rendered by
infra/k8s_manifests.py from the canonical JobSpec, the configs copied into overlays, and the
work pool's base job template (infra/k8s_work_pool.py).

    python -m infra.k8s_manifests write [DIR]   # (re)generate the generated files under DIR
    python -m infra.k8s_manifests check [DIR]   # exit 1 if they are stale

(`python -m infra.k8s_overlays` does the same; the generated files and the docs name the
first, so infra/k8s_manifests.py hands its command line to `main` here.)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.jobs import JobSpec
from infra.k8s_manifests import (
    CONFIG_KEY,
    GENERATED_NOTE,
    KubeOptions,
    copy_note,
    render,
)
from infra.k8s_work_pool import work_pool_template
from infra.mesh import MESH_ENV, mesh_name
from training.config.parallel import MeshShape

CANONICAL_NAME = "ballast-train"
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Overlay:
    """A generated overlay: its attempt (`file`) on `nnodes` nodes of KubeOptions'
    gpus_per_node, labelled with `mesh`, the mesh its training config resolves to there
    (the tests check that). `config`: a training config under the repository root copied in
    as the overlay's train.yaml, which its kustomization merges into the ConfigMap; None:
    the base's k8s/base/train.yaml."""

    nnodes: int
    file: str
    mesh: MeshShape
    config: str | None = None


OVERLAYS: dict[str, Overlay] = {
    # k8s/base/train.yaml: `parallel: ddp`, every process a replica.
    "single-node": Overlay(1, "job.yaml", MeshShape(dp_replicate=8, dp_shard=1, tp=1)),
    "multi-node": Overlay(2, "jobset.yaml", MeshShape(dp_replicate=16, dp_shard=1, tp=1)),
    # 2 nodes x 8 GPUs: a pipeline stage per node, TP 4 within it, FSDP over the 2 TP groups
    # of each node (k8s/README.md, "Multi-node meshes").
    "multi-node-3d": Overlay(
        2,
        "jobset.yaml",
        MeshShape(dp_replicate=1, dp_shard=2, tp=4, pp=2),
        config="configs/train-3d.yaml",
    ),
}
WORK_POOL_TEMPLATE = Path("base/work-pool-template.json")


def canonical_spec(
    nnodes: int, opts: KubeOptions | None = None, mesh: MeshShape | None = None
) -> JobSpec:
    """The JobSpec the k8s/ overlays are generated from."""
    opts = opts or KubeOptions()
    return JobSpec(
        name=CANONICAL_NAME,
        config=f"{opts.config_mount}/{CONFIG_KEY}",
        attempt=0,
        nnodes=nnodes,
        nproc_per_node=max(opts.gpus_per_node, 1),
        env={MESH_ENV: mesh_name(mesh)} if mesh is not None else {},
    )


def overlay_spec(overlay: str, opts: KubeOptions | None = None) -> JobSpec:
    """The JobSpec of the generated overlay `overlay` (a key of OVERLAYS)."""
    o = OVERLAYS[overlay]
    return canonical_spec(o.nnodes, opts, o.mesh)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # repeated dicts stay written out in full
        return True


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """Documents in insertion order (apiVersion, kind, metadata, spec read naturally)."""
    body = yaml.dump_all(
        objs,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=100,
        explicit_start=len(objs) > 1,
    )
    return f"# {GENERATED_NOTE}\n{body}"


def generated_files(opts: KubeOptions | None = None) -> dict[Path, str]:
    """Relative path under k8s/ -> content, for every generated file."""
    opts = opts or KubeOptions()
    out: dict[Path, str] = {}
    for name, overlay in OVERLAYS.items():
        spec = overlay_spec(name, opts)
        out[Path("overlays", name, overlay.file)] = to_yaml(render(spec, opts))
        if overlay.config is not None:
            # kustomize reads files only under the overlay: the config is copied in.
            text = (ROOT / overlay.config).read_text(encoding="utf-8")
            out[Path("overlays", name, CONFIG_KEY)] = f"# {copy_note(overlay.config)}\n{text}"
    out[WORK_POOL_TEMPLATE] = json.dumps(work_pool_template(opts), indent=2) + "\n"
    return out


def write(root: Path, opts: KubeOptions | None = None) -> list[Path]:
    """(Re)write the generated files under `root`; returns the ones that changed."""
    changed = []
    for rel, text in generated_files(opts).items():
        path = root / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def stale(root: Path, opts: KubeOptions | None = None) -> list[Path]:
    """Generated files under `root` that differ from what `write` would write."""
    return [
        root / rel
        for rel, text in generated_files(opts).items()
        if not (root / rel).is_file() or (root / rel).read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m infra.k8s_manifests", description="generate the generated files of k8s/"
    )
    ap.add_argument("command", choices=["write", "check"])
    ap.add_argument("dir", nargs="?", default="k8s", type=Path)
    args = ap.parse_args(argv)
    if args.command == "write":
        for p in write(args.dir):
            print(f"wrote {p}")
        return 0
    bad = stale(args.dir)
    for p in bad:
        print(f"stale: {p} (run python -m infra.k8s_manifests write {args.dir})", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
