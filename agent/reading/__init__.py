"""Reading a run: a verdict's figures as every view reports them, the live view and summary, the
`kevo-agent ledger` table and the `kevo-agent report` HTML page with its plots.

Not here: writing the ledger (agent.ledger), re-judging a run (agent.rejudging).
"""
