"""The ledger: a run's git repository in runs/<run-id>/ — its commits (proposals, paid exchanges, verdicts,
tags, and the commits kept beside the run when it is re-judged), reading it back (at its last commit, or pinned
to one tip), and recovery after a kill. The one reader and the one writer of a run's repository (repository.py),
the words of its commits (messages.py) and the repository as kevo opens it (store.py).

Not here: deciding anything (agent.run), the run folder's lock (agent.run.session), how a run is shown
(agent.reading).
"""


class LedgerError(Exception):
    """The ledger cannot be created, read or written; one line (here, so that the command line can name it
    without importing git)."""
