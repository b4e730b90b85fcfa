"""The `ballast` command line (cli/main.py, a module per command in cli/commands/): the top
layer, over the flows, infra, prep and the trainer."""
