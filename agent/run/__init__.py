"""A run: the loop (its state, budgets, resume and ledger writes), its one drive (proposing and judging with
as many candidates in flight as its evaluator allows), the evaluators (the loop's own pool, or an executor's
slots), what its end says, its settings, the run folder's lock and signals, the proposer's snapshot of the
state, the baseline profile and the environment record.

Not here: the roles the run calls (agent.roles), writing and reading its git repository (agent.ledger),
showing it to a person (agent.reading).
"""
