"""What an appending dataset version (dataset.versions: append) takes over from its
parent's dataset: the parent's files, unread, ahead of the new rows (Base), and the
shard file names both share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core import provenance
from core.store import Store, copy_key


def shard_file(split: str, i: int, num_shards: int) -> str:
    return f"{split}/data-{i:05d}-of-{num_shards:05d}.arrow"


@dataclass
class Base:
    """What an appending version takes over from its parent's dataset, unread: its files
    (hard links or server-side copies, dataprep.stages.mixture.appended_parent), renamed
    where the split's shard count grows, with their manifest entries."""

    version: int
    store: Store
    manifest: dict[str, Any]

    def files(self, split: str) -> list[str]:
        return list(self.manifest["splits"][split]["files"])

    def rows(self, split: str) -> int:
        return int(self.manifest["splits"][split]["rows"])

    def new_shards(self, split: str, rows: int, max_shards: int) -> int:
        """Shards for `rows` new rows: about the parent's rows a shard, at most
        `max_shards`, none for no rows."""
        if rows == 0:
            return 0
        per = -(-self.rows(split) // max(1, len(self.files(split)))) or rows
        return max(1, min(max_shards, -(-rows // per)))

    def carry(self, target: Store, old: str, new: str) -> dict[str, Any]:
        copy_key(self.store, old, target, new)
        return dict(self.manifest["files"][old])

    def carry_split(
        self, target: Store, split: str, total: int
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The parent's shards of `split` as the first of `total`, with their spans: the
        files' manifest entries and the provenance's entries."""
        files: dict[str, Any] = {}
        spans = []
        for i, old in enumerate(self.files(split)):
            new = shard_file(split, i, total)
            files[new] = self.carry(target, old, new)
            old_sp, new_sp = provenance.spans_file(split, old), provenance.spans_file(split, new)
            files[new_sp] = self.carry(target, old_sp, new_sp)
            spans.append({"file": new_sp, "rows": files[new_sp]["rows"]})
        return files, spans

    def carry_docs(self, target: Store) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        docs = self.manifest["provenance"]["docs"]
        return {d["file"]: self.carry(target, d["file"], d["file"]) for d in docs}, list(docs)
