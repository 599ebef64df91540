"""The ledger: a run's git repository in runs/<run-id>/ — its commits (proposals, paid exchanges, verdicts,
tags), reading it back, and recovery after a kill.

Not here: deciding anything (agent.run), the run folder's lock (agent.run.session), how a run is shown
(agent.reading).
"""
