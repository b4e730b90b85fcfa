"""The prep stages, one module each, named as in the stage graph (tasks/graph.py): ingest,
exact, near, lines, quality, tokenize, mixture, pack, then dataset (the packed rows written as
a dataset). Each is plain functions over the output store; none knows where it runs."""
