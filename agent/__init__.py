"""kevo's agent: the loop that proposes kernels and records what became of them.

Folders by role: roles/ (planner, coder, evaluator, conclusion, the proposers), llm/ (the providers and
what a call is made of), run/ (a run's drive, settings and folder), ledger/ (the run's git repository),
reading/ (what a person reads of a run), rejudging/ (`kevo-agent replay`: a past run again). At the top:
the CLI, the typed records and the knowledge catalog, which every folder uses. Judging a kernel is the
harness's (harness/), not here.
"""
