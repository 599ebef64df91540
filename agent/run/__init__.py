"""A run: the loop both drives share and the two drives (serial, parallel), its settings, the run folder's
lock and signals, the proposer's snapshot of the state, the baseline profile and the environment record.

Not here: the roles the run calls (agent.roles), writing and reading its git repository (agent.ledger),
showing it to a person (agent.reading).
"""
