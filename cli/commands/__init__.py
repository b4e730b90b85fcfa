"""The `ballast` commands, one module per command or group of subcommands. Each has
`add_parser(subparsers)`, which adds its parser and sets `func` to the function that runs
it (`run(args) -> exit code`); cli/main.py lists them in the order `ballast --help` shows.
A command imports what it runs inside `run`, so that building the parser stays cheap."""
