"""The `ballast` command line (cli/main.py): the top layer, over the flows, infra, prep and
the trainer."""
