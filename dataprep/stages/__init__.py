"""The prep stages, one module each, named by its STAGE as the stage graph's STAGES
(dataprep/graph.py) orders them; dataset writes the packed rows as a dataset. Each is plain
functions over the output store; none knows where it runs."""
