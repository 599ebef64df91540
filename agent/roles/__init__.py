"""The agent's roles: planner and coder (LLM), the built-in offline proposer, the proposer registry, the
evaluator (the harness's stages on a proposal) and the conclusion (what was learned).

Not here: the LLM calls themselves (agent.llm), the run that drives the roles (agent.run), the ledger
(agent.ledger), judging a kernel (harness).
"""
