"""A flow run that fails on bad input shows its one-line cause in the Prefect UI, not a
traceback after it.

Prefect logs every exception a flow or task raises with its traceback ("Encountered
exception during execution: ...", "Task run failed with exception: ..."). For the errors
that already say what is wrong and what to do (a config key, a missing path, an output
another config claimed, a training run that ended badly) the traceback only hides that
line. So a filter on Prefect's run loggers drops the traceback of exactly those types and
logs their message as `error: <message>` on one line. Every other exception (a bug) keeps
its traceback. The exception is still raised: the run fails with it, and callers of the
flow function get the same type as before.
"""

from __future__ import annotations

import logging

from core.errors import ConfigError, StorageError
from dataprep.cluster import ClusterError
from dataprep.driver import OutputConflict
from dataprep.inputs import InputsChanged
from dataprep.readers import IngestError
from dataprep.report import AccountingError

# ConfigError covers the prep, training, launch, hpo and tracking configs' errors; a flow
# module adds its own (register).
CLEAN: list[type[BaseException]] = [
    ConfigError,
    StorageError,
    ClusterError,
    OutputConflict,
    InputsChanged,
    IngestError,
    AccountingError,
]

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def one_line(message: str) -> str:
    """A multi-line error (a config with several bad keys) as one line: `invalid config
    x.yaml: a: unknown key; b: ...`."""
    out = ""
    for line in (ln.strip() for ln in message.splitlines() if ln.strip()):
        out += (" " if not out or out.endswith(":") else "; ") + line
    return out.strip()


class OneLineErrors(logging.Filter):
    """Rewrites a run logger's record of a CLEAN exception to `error: <message>`, without
    the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, tuple(CLEAN)):
            record.msg, record.args = f"error: {one_line(str(exc))}", None
            record.exc_info, record.exc_text = None, None
        return True


def register(*types: type[BaseException]) -> None:
    """Treat these exception types as CLEAN too, and make sure the filter is on Prefect's
    run loggers (once per logger; logging.config.dictConfig keeps a logger's filters)."""
    CLEAN.extend(t for t in types if t not in CLEAN)
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineErrors) for f in logger.filters):
            logger.addFilter(OneLineErrors())
